"""One HTTP request's job: its engine run, tenant and deadline, and the bounded channel its events
travel on from the scheduler's thread (:mod:`triedec.server.scheduler`) to its handler."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from triedec.core.logprobs import TokenLogprob
from triedec.core.trace import StepTrace
from triedec.engine.runs import Run


class Job:
    """One request's id and run, its tenant and deadline, and the channel its events travel on to its
    HTTP handler.

    The channel is bounded whatever the handler does: the scheduler thread never waits on it. New
    tokens are appended to one pending list (at most the request's ``max_new_tokens``) and at most
    one wake-up is scheduled on the event loop at a time, so a client that reads slowly, or never,
    costs its own request's tokens and nothing else; :meth:`next` hands the handler every pending
    token at once, then the final event."""

    def __init__(self, run: Run, loop: asyncio.AbstractEventLoop, tenant: str = "",
                 deadline: float | None = None, on_end: Callable[[], None] | None = None,
                 request_id: str | None = None, group: str | None = None) -> None:
        self.id = request_id or f"job-{uuid.uuid4().hex}"
        """the request's id (the response's ``id`` over HTTP): the scheduler and the engine batch
        know the job by it"""
        self.run = run
        self.loop = loop
        self.tenant = tenant
        self.group = tenant if group is None else group
        """whose share of the batch's running slots the job counts in: the key's tenant with API keys,
        else the client's address (never a field the client chooses)"""
        self.deadline = deadline
        """``time.perf_counter()`` value past which the scheduler ends the request (None: never)"""
        self.on_end = on_end
        """called once on the event loop after the final event, whoever reads it (or nobody)"""
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.emitted = 0
        self.untaken_since: float | None = None
        """``time.perf_counter()`` when tokens began to wait for the handler (None: nothing waits):
        how long a client has not taken what the server produced"""
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._steps: list[StepTrace] = []
        self.steps: list[StepTrace] = []
        """the step records of the tokens the last :meth:`next` returned (empty unless the run
        records its steps); the handler reads them before it calls :meth:`next` again"""
        self._logprobs: list[TokenLogprob] = []
        self.logprobs: list[TokenLogprob] = []
        """the logprobs of the tokens the last :meth:`next` returned, one per token (empty unless
        the request asked for them); read like :attr:`steps`"""
        self._final: tuple[str, Any] | None = None
        self._signalled = False
        self._ready = asyncio.Event()

    def emit(self, kind: str, value: Any, steps: Sequence[StepTrace] = (),
             logprobs: Sequence[TokenLogprob] = ()) -> None:
        """From the scheduler thread: ``("tokens", list[int])`` with their step records and
        logprobs, or a final
        event (``done``, ``error``, ``cancelled``, ``timeout``); never blocks."""
        with self._lock:
            if self._final is not None:
                return
            if kind == "tokens":
                if not self._tokens:
                    self.untaken_since = time.perf_counter()
                self._tokens += value
                self._steps += steps
                self._logprobs += logprobs
                self.emitted += len(value)
            else:
                self._final = (kind, value)
            final = kind != "tokens"
            wake, self._signalled = not self._signalled, True
        with contextlib.suppress(RuntimeError):  # the event loop is already closed: nobody listens
            if wake:
                self.loop.call_soon_threadsafe(self._ready.set)
            if final and self.on_end is not None:
                self.loop.call_soon_threadsafe(self.on_end)

    async def next(self) -> tuple[str, Any]:
        """The next event, on the job's event loop: every token emitted since the last call as one
        ``("tokens", list[int])``, then the final event (repeated if asked again)."""
        while True:
            with self._lock:
                if self._tokens:
                    tokens, self._tokens = self._tokens, []
                    self.untaken_since = None
                    self.steps, self._steps = self._steps, []
                    self.logprobs, self._logprobs = self._logprobs, []
                    return "tokens", tokens
                if self._final is not None:
                    return self._final
                self._signalled = False
                self._ready.clear()
            await self._ready.wait()

    def cancel(self) -> None:
        """Ask the scheduler to drop this job at its next step boundary (any thread)."""
        self.cancelled.set()
