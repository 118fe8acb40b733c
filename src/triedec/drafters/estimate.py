"""A rate measured as the ratio of two exponential moving averages: pld's and ngram-trie's
agreement per match length (accepted over tried draft tokens) and auto's per-kind rates (accepted
over base); and how a drafter's table of them is exported to, and blended with, other replicas'
(:mod:`triedec.drafters.learned`).

Pure Python, not thread-safe by itself: the drafter that owns one updates it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from triedec.drafters.learned import Rate


class MovingRatio:
    """``numerator / denominator`` of two exponential moving averages, both starting at
    ``(prior, 1)`` so that the estimate starts at ``prior``; :meth:`relax` moves both back toward
    that start (for a key whose drafts are no longer sent, so it is probed again later)."""

    __slots__ = ("denominator", "numerator", "prior", "updates")

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.numerator = prior
        self.denominator = 1.0
        self.updates = 0
        """observations since the last export (:func:`export_rates`)"""

    @property
    def value(self) -> float:
        return self.numerator / self.denominator

    def update(self, numerator: float, denominator: float, weight: float) -> None:
        """Move each average toward one new observation by ``weight``."""
        self.numerator += weight * (numerator - self.numerator)
        self.denominator += weight * (denominator - self.denominator)
        self.updates += 1

    def relax(self, weight: float) -> None:
        """Move each average toward its start by ``weight``."""
        self.numerator += weight * (self.prior - self.numerator)
        self.denominator += weight * (1.0 - self.denominator)

    def blend(self, numerator: float, denominator: float, updates: int) -> None:
        """Merge another replica's averages of this rate, measured over ``updates`` observations
        since its last export: each average becomes the weighted mean of the two, this side
        weighted by its own updates since its last export (at least 1)."""
        own = max(self.updates, 1)
        total = own + updates
        self.numerator = (own * self.numerator + updates * numerator) / total
        self.denominator = (own * self.denominator + updates * denominator) / total


K = TypeVar("K", bound=Hashable)


def export_rates(rates: dict[K, MovingRatio]) -> tuple[Rate, ...]:
    """The rates updated since the last export, with their update counts (which restart at 0)."""
    found = tuple((key, r.numerator, r.denominator, r.updates) for key, r in rates.items() if r.updates)
    for r in rates.values():
        r.updates = 0
    return found


def absorb_rates(ratio: Callable[[K], MovingRatio], valid: Callable[[Hashable], bool], found: Iterable[Rate]) -> None:
    """Blend another replica's exported rates into this drafter's: ``ratio(key)`` is the local
    rate (created at its prior); keys that ``valid`` refuses (another drafter's) are skipped."""
    for key, numerator, denominator, updates in found:
        if updates and valid(key):
            ratio(key).blend(numerator, denominator, updates)  # type: ignore[arg-type]
