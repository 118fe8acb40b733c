"""The server's scheduler: one thread that owns the engine's step loop.

Every HTTP request becomes a :class:`~triedec.server.jobs.Job`: its engine run (a
:class:`~triedec.engine.request.Request`, or beam search's :class:`~triedec.engine.runs.SoloRun`), its tenant
and deadline, and the channel its events travel on to the handler (:meth:`~triedec.server.jobs.Job.next`: the
tokens emitted since the last call, then ``("done", Outcome)``, ``("error", exception)``, ``("cancelled", None)``
or ``("timeout", None)``; bounded, and never waited on by this thread). The scheduler thread hands new jobs to one
:class:`~triedec.engine.batch.Batch` at step boundaries. The batch owns admission: oldest first, while
there is room and the job's tenant (the run's group) has running room (:class:`TenantLimits`).
The thread runs :meth:`~triedec.engine.batch.Batch.step` (one forward for every running request; beam
searches beside it) and hands each job its new tokens. A job cancelled by
its handler (the client left) or past its deadline leaves the batch at the next step boundary:
its session ends and its KV is freed. Nothing per request is shared between jobs; the batch is
touched by this thread only.

**One thread does all torch work.** Each thread that runs torch ops gets an OpenMP thread team of
its own; on a small CPU a second team makes every multi-threaded op of the first slower (the two
teams' threads contend for the same cores, on either thread once both have run ops). So work that
may run torch ops off the request path (building a method, which may calibrate) goes through
:meth:`Scheduler.call` to the engine thread too, and ``triedec serve`` runs the loop on the main
thread (:meth:`Scheduler.run`), where the model was loaded, with uvicorn on a thread of its own.
Embedded uses (tests, ``serving()``) let the loop start on a thread of its own with the first
request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from triedec.api.lm import LM
from triedec.core.errors import TriedecError
from triedec.core.limits import BatchLimits
from triedec.core.prefixtrie import PrefixTrie
from triedec.engine.batch import Batch, StepReport
from triedec.model.memory import release_memory
from triedec.server.config import TenantLimits
from triedec.server.jobs import Job

log = logging.getLogger("triedec.server")


class QueueFull(Exception):
    """``max_queue`` requests wait already and no running slot is free, or the scheduler is
    shutting down."""


class TenantBusy(Exception):
    """The request's tenant has its maximum of requests running and waiting already;
    ``retry_after``: seconds after which one of them has likely finished."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Scheduler:
    """Owns the engine's step loop on one thread (started on first use); see the module doc.
    ``on_step`` receives what each step carried (a :class:`~triedec.engine.batch.StepReport`), on the
    scheduler thread; ``tenants`` bounds each tenant's share and each request's time."""

    def __init__(self, lm: LM, limits: BatchLimits, max_queue: int,
                 on_step: Callable[[StepReport], None] | None = None,
                 tenants: TenantLimits | None = None, remeasure_after: float | None = None,
                 stall_seconds: float | None = None, prefix: PrefixTrie | None = None) -> None:
        if remeasure_after is not None and not 0 < remeasure_after < float("inf"):
            raise TriedecError(f"remeasure_after must be a positive number of seconds or None, got {remeasure_after!r}")
        self.lm = lm
        self.remeasure_after = remeasure_after
        """seconds with no request after which a calibration measured busy is measured again, on
        this thread, abandoned the moment work arrives (None: never; see :meth:`_remeasure`)"""
        self._quiet_needed = remeasure_after  # grows after each attempt that found the machine busy again
        self.limits, self.max_queue = limits, max_queue
        self.tenants = tenants or TenantLimits()
        self.stall_seconds = stall_seconds
        """a running job whose tokens have waited this long for its handler (a client that stopped
        reading) is paused, its slot free for others, until the handler takes them (None: never)"""
        self.batch = Batch(lm.adapter, lm.cost_model(), limits, group_running=self.tenants.max_running,
                           learn_cost=True, gate_drafts=True, fair=True, measure_drafting=True, prefix=prefix)
        self.on_step = on_step
        self._cond = threading.Condition()
        self._incoming: deque[Job] = deque()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._jobs: dict[str, Job] = {}  # the jobs in the batch (waiting or running), by request id
        self._flying: Counter[str] = Counter()  # tenant -> its jobs anywhere here (under the condition)
        self._durations: deque[float] = deque(maxlen=64)  # seconds of recently finished requests
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

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the median time of recent requests (at least 1;
        any thread)."""
        with self._cond:
            recent = list(self._durations)
        return max(1, math.ceil(statistics.median(recent))) if recent else 1

    def check_tenant(self, tenant: str, count: int = 1) -> None:
        """:class:`TenantBusy` if ``count`` more requests would pass ``tenant``'s maximum of
        requests running and waiting (any thread; :meth:`submit` checks again): a request over its
        share is refused before anything is built or waited for."""
        limits = self.tenants
        cap = (limits.max_running or self.limits.max_running) + (
            math.inf if limits.max_queued is None else limits.max_queued)
        with self._cond:
            if self._flying[tenant] + count > cap:
                raise TenantBusy(f"too many requests of this client at once: at most {cap} running or waiting",
                                 self.retry_after())  # the condition's lock is reentrant

    def check_room(self) -> None:
        """:class:`QueueFull` when a request submitted now would be refused for room (any thread;
        :meth:`submit` checks again): ``max_queue`` requests wait already and the running ones fill
        every slot, so ``waiting`` in :attr:`depth` never passes ``max_queue`` for long (only
        while requests that fit in free slots wait for the next step). The server asks before any
        per-request work, so a refusal costs nothing."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            running, waiting = self._depth
            if waiting >= self.max_queue and running + waiting >= self.limits.max_running:
                raise QueueFull(f"the queue is full ({self.limits.max_running} running, {self.max_queue} waiting)")

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` past the queue's bound or while shutting down,
        :class:`TenantBusy` past its tenant's share (:class:`TenantLimits`); a
        :class:`~triedec.core.errors.TriedecError` for a request that could never run here (more KV
        than the cap)."""
        with self._cond:
            self.check_room()  # the condition's lock is reentrant
            if job.id in self._jobs or any(job.id == j.id for j in self._incoming):
                raise TriedecError(f"request id {job.id!r} is already in use")
            self.check_tenant(job.tenant)
            self.batch.check(job.run)
            self._incoming.append(job)
            self._flying[job.tenant] += 1
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

    def start(self) -> None:
        """Start the loop on a thread of its own now, unless a caller runs it (:meth:`claim`) or it runs."""
        with self._cond:
            self._ensure_loop()

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
            self._cond.notify_all()
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
            remeasure = False
            if not self._has_work():  # a glance without the lock: at worst one trim too many or too few
                release_memory()  # the server just went idle: hand the peak's free pages back, outside the lock
            with self._cond:
                idle_since = time.perf_counter()
                while not self._has_work():
                    quiet = self._quiet_needed if self._remeasure_wanted() else None
                    waited = time.perf_counter() - idle_since
                    if quiet is not None and waited >= quiet:
                        remeasure = True
                        break
                    self._cond.wait(None if quiet is None else quiet - waited)
                if self._closed:
                    break
            if remeasure:
                self._remeasure()
                continue
            arrived, calls = self._take_arrivals()
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # handed to the caller
                        future.set_exception(exc)
            for job in arrived:
                try:
                    self.batch.submit(job.run, group=job.group, request_id=job.id)
                except TriedecError as exc:  # checked in submit(); kept from reaching the loop's thread
                    job.run.close("cancelled")
                    self._finish(job, "error", exc)
                    continue
                self._jobs[job.id] = job
            now = time.perf_counter()
            for job in list(self._jobs.values()):
                if job.cancelled.is_set():
                    self._drop(job, "cancelled")
                    self._finish(job, "cancelled", None)
                elif job.deadline is not None and now >= job.deadline:
                    self._expire(job)
            if batch.runnable:
                self._step()
            elif self._jobs:  # every job is paused until its client reads: look again shortly
                with self._cond:
                    self._cond.wait(0.05)
            self._pause_stalled()
            with self._cond:
                self._depth = (len(batch.running) + len(batch.paused), len(batch.waiting) + len(self._incoming))
        self._shutdown()

    def _pause_stalled(self) -> None:
        """Pause each running job whose client has not taken its tokens for ``stall_seconds``;
        resume each paused one whose client took them."""
        if self.stall_seconds is None:
            return
        now = time.perf_counter()
        for rid, job in self._jobs.items():
            since = job.untaken_since
            if since is None:
                self.batch.release(rid)
            elif now - since >= self.stall_seconds:
                self.batch.hold(rid)

    def _has_work(self) -> bool:
        return bool(self._incoming or self._jobs or self._calls or self._closed)

    def _remeasure_wanted(self) -> bool:
        cal = self.lm.loaded_calibration()
        return self.remeasure_after is not None and cal is not None and cal.busy

    def _remeasure(self) -> None:
        """The server has been idle ``remeasure_after`` seconds (more after each attempt that found
        the machine busy again) and its calibration was measured busy: measure the cost model again
        now (:meth:`~triedec.api.lm.LM.remeasure_if_busy`), abandoned within one forward when a request,
        a call or shutdown arrives (the next quiet period tries again)."""
        from triedec.api.calibration import Interrupted

        try:
            quiet = self.lm.remeasure_if_busy(should_stop=self._has_work)
        except Interrupted:
            log.info("re-measuring the busy calibration stopped: work arrived")
            return
        except Exception:  # a bug in measuring must not take the server down: stop trying
            log.exception("re-measuring the busy calibration failed; keeping the one in use")
            self.remeasure_after = None
            return
        if quiet:
            log.info("the busy calibration was measured again while idle, on a quiet machine")
            self._quiet_needed = self.remeasure_after
        else:
            self._quiet_needed = min(2 * (self._quiet_needed or 1.0), 600.0)
            log.info("the machine was busy again while re-measuring; next try after %.0f s idle", self._quiet_needed)

    def _drop(self, job: Job, reason: str) -> None:
        """Take ``job`` out of the batch now (waiting or running), its run ended with ``reason``."""
        if self._jobs.pop(job.id, None) is not None:
            self.batch.cancel(job.id, reason)
        else:  # never handed to the batch (shutting down)
            job.run.close(reason)

    def _expire(self, job: Job) -> None:
        """``job`` ran past its deadline: it ends with what it has (stop reason ``time_limit``), or
        with a timeout event when it has emitted nothing."""
        self._drop(job, "time_limit")
        fresh = job.run.take()
        if fresh:
            job.emit("tokens", fresh, job.run.take_steps(), job.run.take_logprobs())
        if not job.emitted:
            self._finish(job, "timeout", None)
            return
        self._finish(job, "done", job.run.outcome)  # closed by _drop: every run has one

    def _finish(self, job: Job, kind: str, value: Any) -> None:
        """``job`` has left: hand its final event over and count it out."""
        job.emit(kind, value)
        with self._cond:
            self._flying[job.tenant] -= 1
            if self._flying[job.tenant] <= 0:
                del self._flying[job.tenant]
            if kind == "done":
                self._durations.append(time.perf_counter() - job.submitted)

    def _step(self) -> None:
        batch = self.batch
        batch.cost = self.lm.cost_model()  # measured once a method needed it
        try:
            report = batch.step()
        except Exception as exc:  # a bug outside any one run's part (the forward): this step's runs fail (500)
            log.exception("a decoding step failed")
            waiting = set(batch.waiting)  # the others ran in the step, or were being started when it failed
            for job in [job for rid, job in self._jobs.items() if rid not in waiting]:
                self._drop(job, "cancelled")
                self._finish(job, "error", exc)
            return
        for job in self._jobs.values():
            fresh = job.run.take()
            if fresh:
                job.emit("tokens", fresh, job.run.take_steps(), job.run.take_logprobs())
        for rid in report.finished:
            job = self._jobs.pop(rid)
            self._finish(job, "done", job.run.outcome)
        for rid, exc in report.failed:  # each ended alone; the others' tokens went out above
            job = self._jobs.pop(rid)
            if not isinstance(exc, TriedecError):  # the request's own error is its answer; anything else is a bug
                log.error("request %s failed alone in a step: %s", rid, exc, exc_info=exc)
            if job.emitted:  # it has output: it ends as a finished choice, stop reason "error" naming why
                self._finish(job, "done", job.run.outcome)
            else:
                self._finish(job, "error", exc)
        if self.on_step is not None:
            self.on_step(report)

    def _take_arrivals(self) -> tuple[list[Job], list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]]:
        """The jobs submitted and the calls made since the last take, taken under the condition."""
        with self._cond:
            arrived, calls = list(self._incoming), list(self._calls)
            self._incoming.clear()
            self._calls.clear()
        return arrived, calls

    def _shutdown(self) -> None:
        arrived, calls = self._take_arrivals()
        for _, future in calls:
            future.cancel()
        for job in [*arrived, *self._jobs.values()]:
            self._drop(job, "cancelled")
            self._finish(job, "cancelled", None)
        self.batch.close()  # writes the learned state: nothing is lost at SIGTERM
        with self._cond:
            self._depth = (0, 0)
        self._stopped.set()
