"""What a :class:`~triedec.engine.batch.Batch` runs: the :class:`Run` protocol, and :class:`SoloRun`, a
method with a loop of its own (beam search) that advances one step per batch step beside the
shared forward. A :class:`~triedec.engine.request.Request` is the other kind: its steps join the forward."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Protocol

from triedec.core.errors import TriedecError
from triedec.core.logprobs import TokenLogprob
from triedec.core.trace import StepTrace
from triedec.engine.outcome import Outcome, Stats
from triedec.model.adapter import ModelAdapter


class Run(Protocol):
    """What a batch runs: a :class:`~triedec.engine.request.Request` (decoded in the shared forward,
    ``shares_forward`` True) or a :class:`SoloRun` (a loop of its own, ``shares_forward`` False:
    beam search). ``start`` when admitted, ``take`` the tokens committed since the last call
    (``take_logprobs`` their logprobs, when the request asked for them), ``done``, ``outcome``
    once done, ``close`` (idempotent) to end it early or release it; ``kv_tokens`` is the KV it
    reserves. ``record_steps`` (before ``start``) makes it keep a
    :class:`~triedec.core.trace.StepTrace` per step, which ``take_steps`` hands over."""

    shares_forward: bool
    """whether its steps join the batch's shared forward (else it advances in a loop of its own)"""

    @property
    def done(self) -> bool: ...

    @property
    def kv_tokens(self) -> int: ...

    @property
    def outcome(self) -> Outcome: ...

    def start(self, adapter: ModelAdapter) -> None: ...

    def take(self) -> list[int]: ...

    def take_logprobs(self) -> list[TokenLogprob]: ...

    def record_steps(self) -> None: ...

    def take_steps(self) -> list[StepTrace]: ...

    def close(self, reason: str = "cancelled") -> None: ...


class SoloRun:
    """A method with a loop of its own (beam search verifies all its beams in one forward
    already): ``loop(adapter, steps)`` is a generator that yields committed tokens once per step
    and returns an :class:`~triedec.engine.outcome.Outcome`; ``steps`` is None, or (after
    :meth:`record_steps`) a list it appends a :class:`~triedec.core.trace.StepTrace` to per step. It
    advances one step per batch step, beside the shared forward. Closed before its loop returned
    (cancelled, or past its time limit), its outcome holds what it lived: the tokens it emitted,
    its steps, its seconds and the reason. ``rows``: the rows one step of its loop carries
    (beam search's beams): a batch counts them in the run's group's share of a step's rows."""

    shares_forward = False

    def __init__(self, loop: Callable[[ModelAdapter, list[StepTrace] | None], Generator[list[int], None, Outcome]],
                 kv_tokens: int, rows: int = 1) -> None:
        self._loop = loop
        self.rows = rows
        """the rows a step of its loop carries (beam search: its beams), what a batch counts against
        its group's share of a step while other groups have work"""
        self.advanced_at = 0
        """the batch step it last advanced in (a batch that shares steps advances the longest waiting first)"""
        self._trace: list[StepTrace] | None = None
        self._steps: Generator[list[int], None, Outcome] | None = None
        self._kv_tokens = kv_tokens
        self._fresh: list[int] = []
        self._outcome: Outcome | None = None
        self._closed = False
        self._started = 0.0
        self._advances = 0
        self._emitted = 0

    @property
    def done(self) -> bool:
        return self._outcome is not None or self._closed

    @property
    def kv_tokens(self) -> int:
        return self._kv_tokens

    @property
    def outcome(self) -> Outcome:
        if self._outcome is None:
            raise TriedecError("the run has not finished")
        return self._outcome

    def start(self, adapter: ModelAdapter) -> None:
        self._started = time.perf_counter()
        self._steps = self._loop(adapter, self._trace)

    def advance(self) -> None:
        assert self._steps is not None
        self._advances += 1
        try:
            fresh = next(self._steps)
            self._fresh += fresh
            self._emitted += len(fresh)
        except StopIteration as finished:
            self._outcome = finished.value

    def take(self) -> list[int]:
        fresh, self._fresh = self._fresh, []
        return fresh

    def take_logprobs(self) -> list[TokenLogprob]:
        """Always empty: a solo run (beam search) reports no logprobs."""
        return []

    def record_steps(self) -> None:
        if self._trace is None:
            self._trace = []

    def take_steps(self) -> list[StepTrace]:
        if not self._trace:
            return []
        steps = list(self._trace)
        self._trace.clear()  # the loop keeps appending to this same list
        return steps

    def close(self, reason: str = "cancelled") -> None:
        if not self._closed and self._outcome is None:
            seconds = time.perf_counter() - self._started if self._started else 0.0
            self._outcome = Outcome(Stats(new_tokens=self._emitted, steps=self._advances, seconds=seconds,
                                          tokens_per_s=self._emitted / seconds if seconds else 0.0,
                                          stop_reason=reason))
        self._closed = True
        if self._steps is not None:
            self._steps.close()
