"""Paired statistics over prompts: per-prompt speedups, their geometric mean and median, and
percentile-bootstrap intervals that resample prompts (every method keeps its pairing with the
baseline on the same prompt), plus the verdict those intervals allow.

The unit is the prompt: a prompt's time is the median of its repeats, and its speedup is the
method's tokens/s over the baseline's tokens/s on that prompt. Resampling prompts (not runs)
makes the interval speak for prompts like these, not for this sample alone. Prompts that are not
independent are resampled together: the turns of one question (MT-bench's second turn continues
its first answer) form one *unit* (``units`` maps each prompt id to its question), and intervals
need at least :data:`MIN_UNITS` units.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from triedec.core.errors import TriedecError, positive_int

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
LEVEL = 0.95
MIN_UNITS = 10
"""Fewer independent units (questions) than this get no interval and no verdict: a percentile
bootstrap that claims 95% covers 84% over 5 units, 87% over 7, 90% over 10 and 92% over 15-30
(:func:`bootstrap_coverage`, 2,000 trials each)."""


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(log v)); every value must be positive."""
    if not values or any(v <= 0 for v in values):
        raise TriedecError("a geometric mean needs positive values")
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _unit_index(count: int, units: Sequence[str] | None) -> tuple[np.ndarray, int]:
    """Each item's unit number (0 ..), and how many units: one per item without ``units``."""
    if units is None:
        return np.arange(count), count
    if len(units) != count:
        raise TriedecError("one unit per item, please")
    names = {u: i for i, u in enumerate(dict.fromkeys(units))}
    return np.asarray([names[u] for u in units], dtype=np.int64), len(names)


def _resample_sums(values: Sequence[np.ndarray], units: Sequence[str] | None, resamples: int,
                   seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """One set of draws (``resamples`` draws of as many units as there are, with replacement,
    seeded) applied to every array of ``values`` (each one value per item): per array, the sum of
    its values over the items of each draw's units; and how many items each draw held."""
    index, count = _unit_index(len(values[0]), units)
    draws = np.random.default_rng(seed).integers(0, count, size=(resamples, count))
    sums = [np.bincount(index, weights=v, minlength=count)[draws].sum(axis=1) for v in values]
    sizes = np.bincount(index, minlength=count).astype(np.float64)[draws].sum(axis=1)
    return sums, sizes


def bootstrap_interval(ratios: Sequence[float], level: float = LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED, units: Sequence[str] | None = None) -> tuple[float, float]:
    """The percentile-bootstrap ``level`` interval of the geometric mean of paired ``ratios`` (one
    per prompt): ``resamples`` draws, seeded, of as many units as there are, with replacement
    (``units``: each ratio's unit, e.g. its question; None: every prompt its own unit), each draw
    taking all its units' prompts."""
    if not ratios or any(r <= 0 for r in ratios):
        raise TriedecError("bootstrap needs positive ratios")
    (sums,), sizes = _resample_sums([np.log(np.asarray(ratios, dtype=np.float64))], units, resamples, seed)
    means = np.exp(sums / sizes)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def bootstrap_coverage(units: int, trials: int = 2_000, resamples: int = 2_000, level: float = LEVEL,
                       seed: int = BOOTSTRAP_SEED) -> float:
    """How often :func:`bootstrap_interval` over ``units`` independent log-normal ratios (sigma
    0.2, a spread like per-prompt speedups') contains their true geometric mean: the interval's
    real coverage at that sample size, against its nominal ``level``."""
    rng = np.random.default_rng(seed)
    hits = 0
    for trial in range(trials):
        ratios = np.exp(rng.normal(0.0, 0.2, size=units))
        low, high = bootstrap_interval(list(ratios), level, resamples, seed + 1 + trial)
        hits += low <= 1.0 <= high
    return hits / trials


def ratio_interval(numerators: Sequence[float], denominators: Sequence[float], level: float = LEVEL,
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                   units: Sequence[str] | None = None) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of ``sum(numerators) / sum(denominators)`` (a ratio of totals,
    such as tokens per step over prompts, or tokens per second over requests), resampling the
    paired items by unit (``units``: each item's; None: every item its own); None with fewer than
    :data:`MIN_UNITS` units."""
    if len(numerators) != len(denominators):
        raise TriedecError("ratio_interval needs one denominator per numerator")
    if _unit_index(len(numerators), units)[1] < MIN_UNITS:
        return None
    num, den = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    if np.any(den <= 0):
        raise TriedecError("ratio_interval needs positive denominators")
    (top, bottom), _ = _resample_sums([num, den], units, resamples, seed)  # paired: the same draws
    ratios = top / bottom
    tail = (1 - level) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return float(low), float(high)


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
"""Student's t 0.975 quantiles for 1..10 degrees of freedom (beyond: :func:`t_quantile`'s expansion)."""


def t_quantile(df: int) -> float:
    """Student's t 0.975 quantile with ``df`` >= 1 degrees of freedom: the table up to 10, then the
    Cornish-Fisher expansion around the normal's 1.96 (within 0.001 of the exact value there)."""
    if df < 1:
        raise TriedecError(f"a t quantile needs at least 1 degree of freedom, got {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def repeat_interval(ratios: Sequence[float]) -> tuple[float, float] | None:
    """The 95% Student-t interval of the geometric mean of paired ``ratios`` (one per repeat: a
    method's total tokens/s over the baseline's in the same repeat), on the log scale; None with
    fewer than 2 repeats. With 3 repeats it is wide (t = 4.30): it speaks for the machine's noise
    between runs, not for other prompts."""
    if len(ratios) < 2:
        return None
    if any(r <= 0 for r in ratios):
        raise TriedecError("repeat_interval needs positive ratios")
    logs = [math.log(r) for r in ratios]
    half = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


S = TypeVar("S")
C = TypeVar("C")


def paired_order(systems: Sequence[S], cells: Sequence[C], repeats: int, seed: int) -> list[tuple[S, C, int]]:
    """The order a serving benchmark runs its phases in, ``(system, cell, repeat)``: each (cell,
    repeat) is a *block* in which every system runs once, back to back, in an order of its own;
    the blocks run in one seeded random order. The phases a ratio pairs (two systems, the same
    cell and repeat) then run minutes apart at most, so the machine's drift between them is what
    a block lasts, not what the whole run does, and no system always runs first in its block."""
    positive_int("repeats", repeats)
    rng = random.Random(seed)
    blocks = [(cell, r) for r in range(repeats) for cell in cells]
    rng.shuffle(blocks)
    order: list[tuple[S, C, int]] = []
    for cell, r in blocks:
        inside = list(systems)
        rng.shuffle(inside)
        order += [(system, cell, r) for system in inside]
    return order


@dataclass(frozen=True)
class Comparison:
    """Method A against baseline B on the same prompts: ``geomean`` and ``median`` of the per-prompt
    speedups (A's tokens/s over B's), its 95% bootstrap interval ``low``..``high`` (None with fewer
    than :data:`MIN_UNITS` units), ``prompts`` and ``units`` (the independent groups of prompts the
    interval resamples: questions)."""

    geomean: float
    median: float
    low: float | None
    high: float | None
    prompts: int
    units: int

    @property
    def verdict(self) -> str:
        """``faster`` or ``slower`` only where the interval excludes 1; else ``no difference shown``
        (or ``too few prompts`` without an interval)."""
        if self.low is None or self.high is None:
            return "too few prompts"
        if self.low > 1:
            return "faster"
        if self.high < 1:
            return "slower"
        return "no difference shown"

    def as_dict(self) -> dict[str, Any]:
        ci = None if self.low is None else [self.low, self.high]
        return {"geomean": self.geomean, "median": self.median, "ci95": ci, "prompts": self.prompts,
                "units": self.units, "verdict": self.verdict}


def _paired(speeds: Mapping[str, float], baseline: Mapping[str, float]) -> list[str]:
    return sorted(k for k in speeds if k in baseline and speeds[k] > 0 and baseline[k] > 0)


def compare(speeds: Mapping[str, float], baseline: Mapping[str, float],
            units: Mapping[str, str] | None = None) -> Comparison | None:
    """A paired :class:`Comparison` of per-prompt tokens/s (None if no prompt is shared); ``units``
    maps a prompt id to its unit (its question: the turns of one question are resampled together;
    a prompt it does not name is its own unit)."""
    keys = _paired(speeds, baseline)
    if not keys:
        return None
    ratios = [speeds[k] / baseline[k] for k in keys]
    groups = [str((units or {}).get(k, k)) for k in keys]
    count = len(set(groups))
    low, high = bootstrap_interval(ratios, units=groups) if count >= MIN_UNITS else (None, None)
    return Comparison(geometric_mean(ratios), statistics.median(ratios), low, high, len(ratios), count)


def ratio_text(c: Mapping[str, Any] | None, with_count: bool = False) -> str:
    """A paired comparison as ``1.23x [1.10, 1.35]`` (geometric mean, 95% interval; ``with_count``:
    then the number of prompts in parentheses); without an interval ``1.23x (n=4)`` (``1.23x (4)``
    with the count); ``—`` without a value."""
    if not c:
        return "—"
    count = f" ({c['prompts']})" if with_count else ""
    if not c.get("ci95"):
        return f"{c['geomean']:.2f}x" + (count or f" (n={c['prompts']})")
    return f"{c['geomean']:.2f}x [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]{count}"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear between ranks) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
