"""Acceptance rates learned online, one table for every drafter that keeps them: pld's and
ngram-trie's agreement per match length (accepted over tried draft tokens) and auto's per-kind
rates (accepted over base).

* :class:`MovingRatio` -- one rate: the ratio of two exponential moving averages;
* :class:`RateTable` -- rates by key, each created at its prior when first updated, with the
  exchange with other replicas (:mod:`triedec.drafters.learned`): export what was updated since
  the last export, blend what another replica exported;
* :class:`RatedDrafter` -- the base of a drafter whose only learned state is one table (pld,
  ngram-trie): its lock, and its ``learn`` / ``relax`` / exchange methods.

Pure Python. A table is not thread-safe by itself: its owner updates it under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

from triedec.drafters.base import BaseDrafter
from triedec.drafters.learned import Learned, Rate


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
        """observations since the last export (:meth:`RateTable.export`)"""

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


class RateTable(Generic[K]):
    """Rates by key: ``prior(key)`` until the key is first updated, then its :class:`MovingRatio`
    (created at that prior). ``ema`` weighs each new observation, ``relaxation`` each step a key
    was skipped (its averages drift back toward the prior, so a key that stopped paying is probed
    again later); ``valid(key)`` says whether a key another replica sent belongs here."""

    def __init__(self, prior: Callable[[K], float], ema: float, relaxation: float,
                 valid: Callable[[object], bool]) -> None:
        self.prior, self.ema, self.relaxation, self.valid = prior, ema, relaxation, valid
        self._rates: dict[K, MovingRatio] = {}

    def value(self, key: K) -> float:
        """The estimated rate of ``key``."""
        found = self._rates.get(key)
        return self.prior(key) if found is None else found.value

    def _ratio(self, key: K) -> MovingRatio:
        found = self._rates.get(key)
        if found is None:
            found = self._rates[key] = MovingRatio(self.prior(key))
        return found

    def learn(self, key: K, numerator: float, denominator: float) -> None:
        """One observation of ``key``: ``numerator`` over ``denominator`` (accepted over tried)."""
        self._ratio(key).update(numerator, denominator, self.ema)

    def relax(self, key: K) -> None:
        """``key`` was skipped this step: its averages move toward their start."""
        self._ratio(key).relax(self.relaxation)

    def items(self) -> list[tuple[K, float]]:
        """Every key updated so far with its rate, in key order."""
        return [(key, r.value) for key, r in sorted(self._rates.items())]

    def export(self) -> tuple[Rate, ...]:
        """The rates updated since the last export, with their update counts (which restart at 0)."""
        found = tuple((key, r.numerator, r.denominator, r.updates) for key, r in self._rates.items() if r.updates)
        for r in self._rates.values():
            r.updates = 0
        return found

    def absorb(self, found: Iterable[Rate]) -> None:
        """Blend another replica's exported rates into these; keys that ``valid`` refuses (another
        drafter's) are skipped."""
        for key, numerator, denominator, updates in found:
            if updates and self.valid(key):
                self._ratio(key).blend(numerator, denominator, updates)  # type: ignore[arg-type]


class RatedDrafter(BaseDrafter):
    """A drafter whose learned state is one :class:`RateTable` (``self.rates``), updated under
    ``self.lock``; it has no state file and its rates take negligible memory."""

    def __init__(self, rates: RateTable) -> None:
        self.lock = threading.Lock()
        self.rates = rates

    def learn(self, key: Hashable, accepted: float, tried: float) -> None:
        with self.lock:
            self.rates.learn(key, accepted, tried)

    def relax(self, key: Hashable) -> None:
        with self.lock:
            self.rates.relax(key)

    def export_learned(self) -> Learned:
        """The rates updated here since the last export (:mod:`triedec.drafters.learned`)."""
        with self.lock:
            return Learned(rates=self.rates.export())

    def absorb_learned(self, learned: Learned) -> None:
        """Blend another replica's rates into these."""
        with self.lock:
            self.rates.absorb(learned.rates)
