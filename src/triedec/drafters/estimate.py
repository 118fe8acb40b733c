"""A rate measured as the ratio of two exponential moving averages: ngram-trie's agreement per
match length (accepted over tried draft tokens) and auto's per-kind rates (accepted over base).

Pure Python, not thread-safe by itself: the drafter that owns one updates it under its lock.
"""

from __future__ import annotations


class MovingRatio:
    """``numerator / denominator`` of two exponential moving averages, both starting at
    ``(prior, 1)`` so that the estimate starts at ``prior``; :meth:`relax` moves both back toward
    that start (for a key whose drafts are no longer sent, so it is probed again later)."""

    __slots__ = ("denominator", "numerator", "prior")

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.numerator = prior
        self.denominator = 1.0

    @property
    def value(self) -> float:
        return self.numerator / self.denominator

    def update(self, numerator: float, denominator: float, weight: float) -> None:
        """Move each average toward one new observation by ``weight``."""
        self.numerator += weight * (numerator - self.numerator)
        self.denominator += weight * (denominator - self.denominator)

    def relax(self, weight: float) -> None:
        """Move each average toward its start by ``weight``."""
        self.numerator += weight * (self.prior - self.numerator)
        self.denominator += weight * (1.0 - self.denominator)
