"""The server's scheduler: one thread that owns the engine's step loop.

Every HTTP request becomes a :class:`Job`: its engine run (a :class:`~triedec.request.Request`,
or beam search's :class:`~triedec.engine.SoloRun`) and the asyncio queue its events travel on to
the handler. The scheduler thread submits new jobs to one :class:`~triedec.engine.Batch` at step
boundaries, runs :meth:`~triedec.engine.Batch.step` (one forward for every running request; beam
searches beside it), and hands each job its new tokens: ``("tokens", list[int])`` per step, then
``("done", Outcome)``, ``("error", exception)`` or ``("cancelled", None)``. A job cancelled by its
handler (the client left) leaves the batch at the next step boundary: its session ends and its KV
is freed. Nothing per request is shared between jobs; the batch is touched by this thread only.

**One thread does all torch work.** Each thread that runs torch ops gets an OpenMP thread team
of its own; on this 2-core CPU a second team makes every multi-threaded op of the first ~1.5x
slower (measured: ``lm.generate`` 14.5 tok/s on the thread that loaded the model, 9-10 on another,
and 6-10 on either once both have run ops). So work that may run torch ops off the request path
(building a method, which may calibrate) goes through :meth:`Scheduler.call` to the engine thread
too, and ``triedec serve`` runs the loop on the main thread (:meth:`Scheduler.run`), where the
model was loaded, with uvicorn on a thread of its own. Embedded uses (tests, ``serving()``) let
the loop start on a thread of its own with the first request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from triedec.engine import Batch, BatchLimits, Run
from triedec.lm import LM

log = logging.getLogger("triedec.server")


class QueueFull(Exception):
    """The scheduler holds ``max_running + max_queue`` requests already, or is shutting down."""


class Job:
    """One request's run and the channel its events travel on to its HTTP handler."""

    def __init__(self, run: Run, loop: asyncio.AbstractEventLoop) -> None:
        self.run = run
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()

    def emit(self, kind: str, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is already closed: nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        """Ask the scheduler to drop this job at its next step boundary (any thread)."""
        self.cancelled.set()


class Scheduler:
    """Owns the engine's step loop on one thread (started on first use); see the module doc.
    ``on_step`` receives what each step carried (:attr:`~triedec.engine.Batch.last_step`), on the
    scheduler thread."""

    def __init__(self, lm: LM, limits: BatchLimits, max_queue: int,
                 on_step: Callable[[dict[str, float]], None] | None = None) -> None:
        self.lm = lm
        self.limits, self.max_queue = limits, max_queue
        self.batch = Batch(lm.adapter, lm.cost_model(), limits)
        self.on_step = on_step
        self._cond = threading.Condition()
        self._incoming: deque[Job] = deque()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._jobs: dict[int, Job] = {}  # id(run) -> job, for the jobs in the batch
        self._depth = (0, 0)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._running = threading.Event()  # a thread runs the loop
        self._stopped = threading.Event()  # the loop has ended

    @property
    def depth(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cond:
            return self._depth

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` past the queue's bound or while shutting down; a
        :class:`~triedec.errors.TriedecError` for a request that could never run here (more KV
        than the cap)."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._jobs) + len(self._incoming) >= self.limits.max_running + self.max_queue:
                raise QueueFull(f"the queue is full ({self.limits.max_running} running, {self.max_queue} waiting)")
            self.batch.check(job.run)
            self._incoming.append(job)
            self._depth = (self._depth[0], self._depth[1] + 1)
            self._ensure_loop()
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the engine thread at the next step boundary (module doc: building a
        method may run torch ops); its result or exception arrives in the returned future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                future.set_exception(QueueFull("the server is shutting down"))
                return future
            self._calls.append((fn, future))
            self._ensure_loop()
            self._cond.notify()
        return future

    def _ensure_loop(self) -> None:
        """Under the condition: start the loop on a thread of its own unless one runs it."""
        if self._thread is None and not self._running.is_set():
            self._running.set()
            self._thread = threading.Thread(target=self._loop, name="triedec-scheduler", daemon=True)
            self._thread.start()

    def claim(self) -> None:
        """Promise that the caller's thread will run the loop (:meth:`run`); requests submitted
        until then wait for it."""
        with self._cond:
            if self._running.is_set():
                raise RuntimeError("the scheduler's loop already runs")
            self._running.set()

    def run(self) -> None:
        """Run the loop on the calling thread until :meth:`close` (``triedec serve`` calls it on the
        main thread, after :meth:`claim`)."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the scheduler's loop already runs on a thread of its own")
            self._running.set()
        self._loop()

    def close(self, timeout: float = 30.0) -> None:
        """Stop: cancel every job (each run is closed, its session ended), write the learned
        state, and wait for the loop to end."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            running, thread = self._running.is_set(), self._thread
        if thread is not None:
            thread.join(timeout)
        elif not running:
            self._shutdown()
        else:  # the loop runs on another thread (triedec serve: the main thread)
            self._stopped.wait(timeout)

    # ---- the scheduler thread -----------------------------------------------------------------

    def _loop(self) -> None:
        batch = self.batch
        while True:
            with self._cond:
                while not (self._incoming or self._jobs or self._calls or self._closed):
                    self._cond.wait()
                if self._closed:
                    break
                arrived = list(self._incoming)
                self._incoming.clear()
                calls = list(self._calls)
                self._calls.clear()
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # handed to the caller
                        future.set_exception(exc)
            for job in arrived:
                batch.submit(job.run)
                self._jobs[id(job.run)] = job
            for key, job in list(self._jobs.items()):
                if job.cancelled.is_set():
                    batch.cancel(job.run)
                    del self._jobs[key]
                    job.emit("cancelled", None)
            if not batch.idle:
                self._step()
            with self._cond:
                self._depth = (len(batch.running), len(batch.waiting) + len(self._incoming))
        self._shutdown()

    def _step(self) -> None:
        batch = self.batch
        batch.cost = self.lm.cost_model()  # measured once a method needed it
        try:
            finished = batch.step()
        except Exception as exc:  # a bug: the requests of this step fail (500), the server lives on
            log.exception("a decoding step failed")
            for job in self._jobs.values():
                batch.cancel(job.run)
                job.emit("error", exc)
            self._jobs.clear()
            return
        for job in self._jobs.values():
            fresh = job.run.take()
            if fresh:
                job.emit("tokens", fresh)
        for run in finished:
            job = self._jobs.pop(id(run))
            job.emit("done", run.outcome)
        if self.on_step is not None:
            self.on_step(batch.last_step)

    def _shutdown(self) -> None:
        with self._cond:
            left = [*self._jobs.values(), *self._incoming]
            self._incoming.clear()
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            future.cancel()
        for job in left:
            self.batch.cancel(job.run)
            job.run.close()
            job.emit("cancelled", None)
        self._jobs.clear()
        self.batch.close()  # writes the learned state: nothing is lost at SIGTERM
        with self._cond:
            self._depth = (0, 0)
        self._stopped.set()
