"""What one verification forward costs on a device: a small pure value, measured elsewhere.

A speculative step that verifies T tree tokens pays off only if it yields more tokens than
``seconds(T) / seconds(1)``. On a 2-core CPU an 81-token forward costs several 1-token forwards,
on a GPU about one. :class:`CostModel` holds the measured curve (median seconds of a forward of T
tree tokens on a cache of ``context_tokens``) and derives what sizing drafters need from it.
Measuring it needs a model, so it lives in :mod:`triedec.calibration`; drafters receive the value
through :class:`~triedec.drafters.ModelInfo` (``None`` there means "size as for a flat curve").

Imports nothing from triedec but :mod:`triedec.errors`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triedec.errors import TriedecError


@dataclass(frozen=True)
class CostModel:
    """``forward_seconds[T]``: median seconds of one forward of T tree tokens (T >= 1, the root
    included) on a ``context_tokens`` cache. ``details``: free-form notes on how it was measured
    (kept in the calibration file, not used for sizing)."""

    forward_seconds: Mapping[int, float]
    context_tokens: int = 512
    details: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        try:
            seconds = {int(t): float(s) for t, s in self.forward_seconds.items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise TriedecError(f"cost model: forward_seconds must map token counts to seconds ({exc})") from exc
        if not seconds or any(t < 1 or not (s > 0 and math.isfinite(s)) for t, s in seconds.items()):
            raise TriedecError("cost model: forward costs must be positive and finite, for sizes >= 1 token")
        if isinstance(self.context_tokens, bool) or not isinstance(self.context_tokens, int) or self.context_tokens < 0:
            raise TriedecError(f"cost model: context_tokens must be an integer >= 0, got {self.context_tokens!r}")
        object.__setattr__(self, "forward_seconds", dict(sorted(seconds.items())))
        object.__setattr__(self, "details", dict(self.details))

    def seconds(self, tokens: int) -> float:
        """Estimated seconds of a forward of ``tokens`` tree tokens: the measured curve made
        non-decreasing (a bigger tree never counts as cheaper; the raw curve is noisy), linearly
        interpolated between measured sizes and extrapolated from the last two beyond them."""
        if tokens < 1:
            raise TriedecError(f"a forward needs at least 1 token, got {tokens}")
        sizes = list(self.forward_seconds)
        envelope, top = [], 0.0
        for t in sizes:
            top = max(top, self.forward_seconds[t])
            envelope.append(top)
        if tokens <= sizes[0]:
            return envelope[0]
        for i in range(1, len(sizes)):
            if tokens <= sizes[i]:
                t0, t1, c0, c1 = sizes[i - 1], sizes[i], envelope[i - 1], envelope[i]
                return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
        if len(sizes) == 1:
            return envelope[0]
        slope = (envelope[-1] - envelope[-2]) / (sizes[-1] - sizes[-2])
        return envelope[-1] + slope * (tokens - sizes[-1])

    def ratio(self, tokens: int) -> float:
        """Cost of a ``tokens``-token forward in 1-token forwards (>= 1)."""
        return self.seconds(tokens) / self.seconds(1)

    def break_even(self, tokens: int) -> float:
        """Accepted draft tokens per step that a ``tokens``-token tree needs to be as fast as a
        plain step: ``ratio(tokens) - 1`` (a step always yields one token of its own)."""
        return self.ratio(tokens) - 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"forward_seconds": {str(t): s for t, s in self.forward_seconds.items()},
                "context_tokens": self.context_tokens, "details": dict(self.details)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        try:
            return cls(data["forward_seconds"], data.get("context_tokens", 512), data.get("details", {}))
        except (KeyError, TypeError, AttributeError) as exc:
            raise TriedecError(f"unreadable cost model: {exc!r}") from exc


def best_count(chance: list[float] | tuple[float, ...], cost: CostModel | None) -> int:
    """How many of a best-first list of draft nodes to verify for the most expected tokens per
    second: node i is accepted with probability ``chance[i]`` (nodes listed parents first), a step
    with k nodes yields ``1 + sum(chance[:k])`` tokens in ``cost.seconds(k + 1)``. ``cost`` None
    (a flat curve) keeps every node with a positive chance."""
    if cost is None:
        return max((i + 1 for i, p in enumerate(chance) if p > 0), default=0)
    best, best_speed, expected = 0, 1.0 / cost.seconds(1), 1.0
    for k, p in enumerate(chance, start=1):
        expected += p
        speed = expected / cost.seconds(k + 1)
        if speed > best_speed:
            best, best_speed = k, speed
    return best
