"""What one forward costs on a device: a small pure value, measured elsewhere.

A speculative step that verifies T tree tokens pays off only if it yields more tokens than
``seconds(T) / seconds(1)``; a forward that carries B requests' trees at once streams the weights
once for all of them, so its cost depends on the tokens it carries and on how many requests they
belong to. :class:`CostModel` holds the measured surface and interpolates it: median seconds of a
forward of N tokens in all, for B requests whose caches each hold ``context_tokens`` tokens, plus
``context_seconds`` per token of context beyond that (attention reads each request's cache).
Measuring it needs a model, so it lives in :mod:`triedec.api.calibration`; the engine's allocator
(:mod:`triedec.core.allocate`) and drafters receive the value (``None`` means "size as for a flat
curve": every verified token free).

A calibration is one machine state, measured once. :class:`ObservedCost` follows the machine as it
runs: the engine hands it every forward's observed time, and it scales the calibrated surface by
the moving average of observed / calibrated seconds where it has seen forwards of that shape.

Imports nothing from triedec but :mod:`triedec.core.errors`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from triedec.core.errors import TriedecError


def _curve(seconds: Mapping[Any, Any], what: str) -> dict[int, float]:
    try:
        curve = {int(t): float(s) for t, s in seconds.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise TriedecError(f"cost model: {what} must map token counts to seconds ({exc})") from exc
    if not curve or any(t < 1 or not (s > 0 and math.isfinite(s)) for t, s in curve.items()):
        raise TriedecError(f"cost model: {what}: forward costs must be positive and finite, for sizes >= 1 token")
    return dict(sorted(curve.items()))


def _envelope(curve: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """Sizes and the curve made non-decreasing (a bigger forward never counts as cheaper; the raw
    curve is noisy)."""
    sizes = np.array(list(curve), dtype=np.float64)
    return sizes, np.maximum.accumulate(np.array(list(curve.values()), dtype=np.float64))


def _interpolate(sizes: np.ndarray, envelope: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Linear between measured sizes, flat below the first, extrapolated from the last two."""
    out = np.interp(tokens, sizes, envelope)
    if len(sizes) > 1:
        slope = (envelope[-1] - envelope[-2]) / (sizes[-1] - sizes[-2])
        beyond = tokens > sizes[-1]
        out[beyond] = envelope[-1] + slope * (tokens[beyond] - sizes[-1])
    return out


@dataclass(frozen=True)
class CostModel:
    """``forward_seconds[T]``: median seconds of one forward of T tree tokens (T >= 1, the root
    included) of one request on a ``context_tokens`` cache. ``batch_seconds[B][N]``: of one
    forward carrying B >= 2 requests (each on a ``context_tokens`` cache) and N tokens in all.
    ``context_seconds``: the extra seconds per forward of each token of context beyond that.
    ``details``: free-form notes on how it was measured (kept in the calibration file, not used
    for sizing)."""

    forward_seconds: Mapping[int, float]
    context_tokens: int = 512
    details: Mapping[str, Any] = field(default_factory=dict, compare=False)
    batch_seconds: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    context_seconds: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward_seconds", _curve(self.forward_seconds, "forward_seconds"))
        if isinstance(self.context_tokens, bool) or not isinstance(self.context_tokens, int) or self.context_tokens < 0:
            raise TriedecError(f"cost model: context_tokens must be an integer >= 0, got {self.context_tokens!r}")
        try:
            rows = {int(b): _curve(row, f"batch_seconds[{b}]") for b, row in self.batch_seconds.items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise TriedecError(f"cost model: batch_seconds must map request counts to curves ({exc})") from exc
        if any(b < 2 for b in rows):
            raise TriedecError("cost model: batch_seconds holds forwards of 2 or more requests")
        object.__setattr__(self, "batch_seconds", dict(sorted(rows.items())))
        if not (isinstance(self.context_seconds, int | float) and math.isfinite(self.context_seconds)
                and self.context_seconds >= 0):
            raise TriedecError(f"cost model: context_seconds must be a finite number >= 0, "
                               f"got {self.context_seconds!r}")
        object.__setattr__(self, "details", dict(self.details))
        rows_by_b = {1: _envelope(self.forward_seconds), **{b: _envelope(r) for b, r in self.batch_seconds.items()}}
        object.__setattr__(self, "_rows", rows_by_b)

    def seconds(self, tokens: int, requests: int = 1, context: int | None = None) -> float:
        """Estimated seconds of a forward of ``tokens`` tokens in all, for ``requests`` requests
        whose caches hold ``context`` tokens in all (None: ``context_tokens`` each). See
        :meth:`seconds_many`."""
        return float(self.seconds_many(np.array([tokens]), requests, context)[0])

    def seconds_many(self, tokens: np.ndarray, requests: int = 1, context: int | None = None) -> np.ndarray:
        """:meth:`seconds` for an array of token counts. Within a measured request count, linear
        in tokens on the non-decreasing envelope; between request counts, linear in requests;
        beyond the largest, extrapolated from the last two; then the context term."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if tokens.size and tokens.min() < 1:
            raise TriedecError(f"a forward needs at least 1 token, got {int(tokens.min())}")
        if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
            raise TriedecError(f"a forward serves at least 1 request, got {requests!r}")
        rows: dict[int, tuple[np.ndarray, np.ndarray]] = self._rows  # type: ignore[attr-defined]
        counts = list(rows)
        if requests in rows:
            out = _interpolate(*rows[requests], tokens)
        else:
            below = [b for b in counts if b < requests]
            above = [b for b in counts if b > requests]
            if above:
                lo, hi = below[-1], above[0]
            elif len(counts) > 1:
                lo, hi = counts[-2], counts[-1]
            else:
                lo = hi = counts[0]
            a, b = _interpolate(*rows[lo], tokens), _interpolate(*rows[hi], tokens)
            out = a if hi == lo else a + (b - a) * (requests - lo) / (hi - lo)
            out = np.maximum(out, _interpolate(*rows[below[-1]], tokens))  # more requests never cost less
        if context is not None and self.context_seconds:
            floor = 0.5 * out
            out = np.maximum(floor, out + self.context_seconds * (context - requests * self.context_tokens))
        return out

    def ratio(self, tokens: int) -> float:
        """Cost of one request's ``tokens``-token forward in 1-token forwards (>= 1)."""
        return self.seconds(tokens) / self.seconds(1)

    def break_even(self, tokens: int) -> float:
        """Accepted draft tokens per step that one request's ``tokens``-token tree needs to be as
        fast as a plain step: ``ratio(tokens) - 1`` (a step always yields one token of its own)."""
        return self.ratio(tokens) - 1.0

    def surface_ms(self) -> dict[str, Any]:
        """The measured surface in milliseconds, as ``calibrate --json`` and benchmark results show
        it: ``context_tokens``, ``forward_ms`` (one request), ``batch_forward_ms`` (B requests, N
        tokens in all) and ``context_ms_per_1k_tokens``."""
        return {
            "context_tokens": self.context_tokens,
            "forward_ms": {str(t): round(s * 1000, 2) for t, s in self.forward_seconds.items()},
            "batch_forward_ms": {str(b): {str(t): round(s * 1000, 2) for t, s in row.items()}
                                 for b, row in self.batch_seconds.items()},
            "context_ms_per_1k_tokens": round(self.context_seconds * 1e6, 3),
        }

    def as_dict(self) -> dict[str, Any]:
        return {"forward_seconds": {str(t): s for t, s in self.forward_seconds.items()},
                "batch_seconds": {str(b): {str(t): s for t, s in row.items()} for b, row in self.batch_seconds.items()},
                "context_tokens": self.context_tokens, "context_seconds": self.context_seconds,
                "details": dict(self.details)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        try:
            return cls(data["forward_seconds"], data.get("context_tokens", 512), data.get("details", {}),
                       data.get("batch_seconds", {}), data.get("context_seconds", 0.0))
        except (KeyError, TypeError, AttributeError) as exc:
            raise TriedecError(f"unreadable cost model: {exc!r}") from exc


class ForwardCost(Protocol):
    """What the allocator reads: estimated seconds of forwards (a :class:`CostModel`, or an
    :class:`ObservedCost` over one)."""

    def seconds_many(self, tokens: np.ndarray, requests: int = 1, context: int | None = None) -> np.ndarray: ...


def _bucket(count: int) -> int:
    """The power of two at or below ``count`` (>= 1): forwards of about the same shape share a cell."""
    return 1 << (max(1, int(count)).bit_length() - 1)


class ObservedCost:
    """``base`` scaled by what forwards actually took on this machine since it was built.

    :meth:`observe` records a forward's observed seconds against ``base``'s estimate for it; the
    ratio goes into a moving average (weight ``weight`` per observation) for its cell (request
    count and token count, each rounded down to a power of two), for its request count, and
    overall. An estimate is ``base``'s times the ratio of the most specific of these with at
    least ``min_observations`` observations (1 where there are none yet), clamped to
    [:attr:`LOW`, :attr:`HIGH`]. So a surface measured while the machine was busy, or before it
    got busier, is corrected by the first few forwards, and its shape where forwards of that
    shape ran. Not thread-safe: one engine thread observes and reads it."""

    LOW, HIGH = 0.1, 10.0

    def __init__(self, base: CostModel, weight: float = 0.2, min_observations: int = 3) -> None:
        if not 0 < weight <= 1:
            raise TriedecError(f"weight must lie in (0, 1], got {weight!r}")
        if isinstance(min_observations, bool) or not isinstance(min_observations, int) or min_observations < 1:
            raise TriedecError(f"min_observations must be a positive integer, got {min_observations!r}")
        self.base, self.weight, self.min_observations = base, weight, min_observations
        self._ratios: dict[tuple[int, int] | int | None, tuple[float, int]] = {}  # key -> (average, count)

    def observe(self, tokens: int, requests: int, context: int | None, seconds: float) -> None:
        """A forward of ``tokens`` tokens for ``requests`` requests over ``context`` cached tokens
        in all took ``seconds``."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        ratio = seconds / self.base.seconds(tokens, requests, context)
        cell = (_bucket(requests), _bucket(tokens))
        for key in (cell, cell[0], None):
            average, count = self._ratios.get(key, (ratio, 0))
            self._ratios[key] = (average + self.weight * (ratio - average) if count else ratio, count + 1)

    def ratio(self, requests: int = 1, tokens: int | None = None) -> float:
        """The correction applied to a forward of ``tokens`` tokens (None: any) for ``requests``
        requests."""
        keys: list[tuple[int, int] | int | None] = [_bucket(requests), None]
        if tokens is not None:
            keys.insert(0, (_bucket(requests), _bucket(tokens)))
        for key in keys:
            average, count = self._ratios.get(key, (1.0, 0))
            if count >= self.min_observations:
                return min(self.HIGH, max(self.LOW, average))
        return 1.0

    def seconds_many(self, tokens: np.ndarray, requests: int = 1, context: int | None = None) -> np.ndarray:
        """:meth:`CostModel.seconds_many` times each forward's :meth:`ratio`."""
        tokens = np.asarray(tokens, dtype=np.float64)
        buckets = np.exp2(np.floor(np.log2(np.maximum(tokens, 1.0)))).astype(np.int64)
        found, where = np.unique(buckets, return_inverse=True)
        factors = np.array([self.ratio(requests, int(b)) for b in found])[where].reshape(tokens.shape)
        return self.base.seconds_many(tokens, requests, context) * factors

    def seconds(self, tokens: int, requests: int = 1, context: int | None = None) -> float:
        return float(self.seconds_many(np.array([tokens]), requests, context)[0])

    def observations(self) -> int:
        """Forwards observed so far."""
        return self._ratios.get(None, (1.0, 0))[1]
