"""Paired statistics over prompts: per-prompt speedups, their geometric mean and median, and
percentile-bootstrap intervals that resample prompts (every method keeps its pairing with the
baseline on the same prompt), plus the verdict those intervals allow.

The unit is the prompt: a prompt's time is the median of its repeats, and its speedup is the
method's tokens/s over the baseline's tokens/s on that prompt. Resampling prompts (not runs)
makes the interval speak for prompts like these, not for this sample alone.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from triedec.errors import TriedecError

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
LEVEL = 0.95
MIN_PROMPTS = 5
"""Fewer paired prompts than this get no interval and no verdict: a percentile bootstrap over a
handful of prompts covers far less than its nominal level."""


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(log v)); every value must be positive."""
    if not values or any(v <= 0 for v in values):
        raise TriedecError("a geometric mean needs positive values")
    return math.exp(statistics.fmean(math.log(v) for v in values))


def bootstrap_interval(ratios: Sequence[float], level: float = LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """The percentile-bootstrap ``level`` interval of the geometric mean of paired ``ratios`` (one
    per prompt): ``resamples`` draws of len(ratios) prompts with replacement, seeded."""
    if not ratios or any(r <= 0 for r in ratios):
        raise TriedecError("bootstrap needs positive ratios")
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(logs), size=(resamples, len(logs)))
    means = np.exp(logs[draws].mean(axis=1))
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def ratio_interval(numerators: Sequence[float], denominators: Sequence[float], level: float = LEVEL,
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of ``sum(numerators) / sum(denominators)`` (a ratio of totals,
    such as tokens per step over prompts, or tokens per second over requests), resampling the
    paired items; None with fewer than :data:`MIN_PROMPTS` items."""
    if len(numerators) != len(denominators):
        raise TriedecError("ratio_interval needs one denominator per numerator")
    if len(numerators) < MIN_PROMPTS:
        return None
    num, den = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    if np.any(den <= 0):
        raise TriedecError("ratio_interval needs positive denominators")
    draws = np.random.default_rng(seed).integers(0, len(num), size=(resamples, len(num)))
    ratios = num[draws].sum(axis=1) / den[draws].sum(axis=1)
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


@dataclass(frozen=True)
class Comparison:
    """Method A against baseline B on the same prompts: ``geomean`` and ``median`` of the per-prompt
    speedups (A's tokens/s over B's), its 95% bootstrap interval ``low``..``high`` (None with fewer
    than :data:`MIN_PROMPTS` prompts), and ``prompts``."""

    geomean: float
    median: float
    low: float | None
    high: float | None
    prompts: int

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
                "verdict": self.verdict}


def paired_ratios(speeds: Mapping[str, float], baseline: Mapping[str, float]) -> list[float]:
    """Per-prompt speedups over the prompts both sides ran (keys: prompt ids), in a fixed order."""
    common = sorted(k for k in speeds if k in baseline and speeds[k] > 0 and baseline[k] > 0)
    return [speeds[k] / baseline[k] for k in common]


def compare(speeds: Mapping[str, float], baseline: Mapping[str, float]) -> Comparison | None:
    """A paired :class:`Comparison` of per-prompt tokens/s (None if no prompt is shared)."""
    ratios = paired_ratios(speeds, baseline)
    if not ratios:
        return None
    low, high = bootstrap_interval(ratios) if len(ratios) >= MIN_PROMPTS else (None, None)
    return Comparison(geometric_mean(ratios), statistics.median(ratios), low, high, len(ratios))
