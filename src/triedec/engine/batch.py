"""The step loop: one forward for every running request, under one verify budget.

A :class:`Batch` owns the loop (mini-sglang's scheduler that owns it; vLLM's engine core). Each
:meth:`Batch.step` is four named calls: admit, :meth:`~Batch.schedule` (steps 2-3, which return a
frozen :class:`StepPlan`, as vLLM v1's ``SchedulerOutput``), :meth:`~Batch.verify` (4-6) and
:meth:`~Batch.retire_finished` (7):

1. **admits** waiting runs at the step boundary (each starts from the longest prefix of its prompt
   a prefix trie holds, and requests of one group with one prompt share its prefill:
   :meth:`Batch.share_prompts`), oldest first, within :class:`BatchLimits`
   (running requests, KV memory) and each group's running cap (a server tenant's share); a
   ``fair`` batch (the server's) admits the group with the fewest running first, and pauses a run
   of a group holding more than its share of slots while another group waits;
2. **propose**: every decoding request's drafter proposes a scored draft (the root alone on a
   plain step: a batch that measures drafting, :class:`~triedec.core.allocate.DraftPayoff`, runs
   plain steps where drafting does not pay at the step's load);
3. **allocate**: :func:`~triedec.core.allocate.allocate` sizes all drafts together under the device's
   :class:`~triedec.core.costmodel.CostModel` (nodes go where they are most likely to be accepted, and
   only while they pay; the forward's prompt chunks count in its cost);
4. **verify**: one forward (:meth:`~triedec.model.adapter.ModelAdapter.forward_batch`) carries every
   request's tree and up to ``max_prefill_tokens`` of prompt chunks of requests still prefilling;
5. **accept** and **commit**, per request (:class:`~triedec.engine.request.Request`);
6. runs with a loop of their own (beam search, :class:`~triedec.engine.runs.SoloRun`) advance one step each,
   beside; while another group has work, a group's only while their rows fit its share of the forward;
7. finished runs leave at once: their session ends, their KV is freed.

A run that raises in its own part of a step (starting, proposing, accepting, its grammar, its
stop rule) ends alone, closed with stop reason ``error`` (:attr:`StepReport.failed`), and the step
goes on for the others.

Single-request decoding is the same step with one request (:func:`run_alone`), so ``generate``,
``stream``, the CLI, ``custom_generate`` and the server share one code path.

**Learned-state files** are written by the drafters' ``persist()`` (a snapshot under the lock,
written outside it) when the batch goes idle, every ``persist_every`` finished requests, and when
the batch closes; never on the per-step path.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from triedec.core.accept import GREEDY, AcceptanceRule
from triedec.core.allocate import DraftGate, DraftPayoff, Pace, allocate
from triedec.core.costmodel import CostModel, ForwardCost, ObservedCost
from triedec.core.errors import TriedecError, positive_int
from triedec.core.limits import BatchLimits
from triedec.core.prefixtrie import PrefixTrie
from triedec.drafters.base import MAX_TREE_NODES, Drafter
from triedec.engine.outcome import Outcome, Stats
from triedec.engine.request import Request, StopRule
from triedec.engine.runs import Run
from triedec.model.adapter import ForwardItem, ModelAdapter

_T = TypeVar("_T")

SETTLE = 4
"""How much less a batch that measures drafting explores the slower arm at a load level once its
verdict is clear (:class:`~triedec.core.allocate.DraftPayoff`'s ``settle``: one step in 64 rather
than 16)."""

__all__ = ["MAX_TREE_NODES", "Batch", "BatchLimits", "Outcome", "Request", "Run", "Stats", "StepPlan", "StepReport",
           "StopRule", "run_alone", "speculative_decode"]


@dataclass(frozen=True)
class StepPlan:
    """What one step does, fixed before its forward (vLLM v1's ``SchedulerOutput``): the runs
    running, the requests whose next prompt chunk goes in (``chunks``) and those that verify a
    tree (``decoding``), the forward's ``items`` (chunks first, then trees sized by the
    allocator), the ``context`` tokens they attend to, and counts for the report."""

    running: tuple[Run, ...]
    chunks: tuple[Request, ...]
    decoding: tuple[Request, ...]
    items: tuple[ForwardItem, ...]
    context: int
    tokens_before: int
    """tokens the decoding requests had generated before the step (the pace's baseline)"""
    proposed_nodes: int
    draft_nodes: int
    drafting: bool = True
    """whether the step's requests were asked to draft (False: a plain step of a batch that
    measures what drafting pays, :class:`~triedec.core.allocate.DraftPayoff`)"""

    @property
    def requests(self) -> int:
        """items in the forward: prompt chunks and verified trees"""
        return len(self.items)

    @property
    def tokens(self) -> int:
        return sum(i.size for i in self.items)

    @property
    def prefill_tokens(self) -> int:
        return sum(i.size for i in self.items[: len(self.chunks)])


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`Batch.step` did: the request ids of the runs that finished during it
    (already closed and out of the batch: the caller that holds a run reads its ``outcome``), those
    that failed alone (``failed``), its
    :class:`StepPlan` (what its forward carried: ``requests``, ``tokens``, ``prefill_tokens``,
    ``draft_nodes`` verified and ``proposed_nodes`` drafted), the step's wall
    ``seconds`` and its forward's ``forward_seconds`` (the rest is host time: drafting,
    allocating, accepting, committing)."""

    finished: tuple[str, ...]
    plan: StepPlan
    seconds: float
    forward_seconds: float
    failed: tuple[tuple[str, BaseException], ...] = ()
    """the runs that raised in their own part of the step (starting, drafting, accepting, a grammar,
    a stop rule, logprobs), each with what it raised: each ended alone (closed with stop reason
    ``error``, the message in its stats' ``error``), out of the batch before the report, while the
    step went on for the others"""


class Batch:
    """Owns the step loop over its runs (module doc), and admission. Every run is known by its
    request id (given to :meth:`submit`, or one the batch makes): :attr:`runs` holds each waiting
    or running run by id, :attr:`waiting` and :attr:`running` hold ids. Runs wait
    and join at a step boundary, oldest first, while there is room (``limits``: running slots, KV
    bytes) and their group has running room (``group_running``: most runs of one group, e.g. one
    server tenant, running at once; None: no cap; a run whose group is full lets the ones behind it
    go first). Used by one thread at a time: the caller of :meth:`step` (``LM.stream``'s
    generator, ``generate_batch``, the server's scheduler thread). ``cost`` None sizes drafts as
    for a flat curve (every node with a chance goes).

    ``learn_cost``: follow the machine as it runs. Drafts are sized under ``cost`` corrected by
    every forward's observed time (:class:`~triedec.core.costmodel.ObservedCost`, rebuilt whenever
    ``cost`` is replaced), with the step's host time (a moving average of its time outside the
    forward: drafting, accepting, committing) charged to every step
    (:func:`~triedec.core.allocate.allocate`'s ``host_seconds``). Tree sizes then depend on timing;
    tokens never do. ``gate_drafts``: a request whose drafts stopped paying (steps in a row whose
    proposal got no node verified, or whose accepted drafts no longer pay for the drafter's host
    time at what a committed token costs the batch now, :class:`~triedec.core.allocate.Pace`) is not
    asked to draft for a while, so its step costs what ``ar``'s does, and probes again after a
    growing pause (:class:`~triedec.core.allocate.DraftGate`);
    tokens never change. ``measure_drafting``: whether a step drafts at all is decided by what
    drafting measurably bought at this load, steps that draft against steps that do not, with one
    step in 16 running the other arm (one in 64 once a level's verdict is clear), each such step
    compared with its neighbour at the same load
    (:class:`~triedec.core.allocate.DraftPayoff`), so speculation runs only where it pays, and
    where it does not it costs at most that exploration share. The
    server turns all three on; a single ``generate`` keeps the calibrated sizes and drafts every
    step, reproducible step for step.

    ``fair``: no group holds more than its share of running slots (``max_running`` over the groups
    with work, rounded up) while a run of another group under its share waits: candidates are
    admitted fewest-running group first, and when no slot is free the group with the most running
    above its share has its latest-joined run *paused* (it keeps its KV and its state, is not
    stepped, and resumes at a later boundary with room). The caller may also pause a run itself
    (:meth:`hold`, e.g. a client that stopped reading) and let it resume (:meth:`release`). Pausing
    changes when a run's steps happen, never its tokens. Pausing frees running slots, not KV: a
    paused run's KV stays reserved."""

    HOST_WEIGHT = 0.2
    """weight of each step in the moving average of host seconds"""

    def __init__(self, adapter: ModelAdapter, cost: CostModel | None = None,
                 limits: BatchLimits | None = None, group_running: int | None = None,
                 learn_cost: bool = False, gate_drafts: bool = False, fair: bool = False,
                 measure_drafting: bool = False, prefix: PrefixTrie | None = None) -> None:
        if group_running is not None:
            positive_int("group_running", group_running)
        self.adapter, self.cost = adapter, cost
        self.limits = limits or BatchLimits()
        self.group_running = group_running
        self.learn_cost, self.gate_drafts, self.fair = learn_cost, gate_drafts, fair
        self._observed: ObservedCost | None = None
        self._pace = Pace()  # what a committed token costs now, for the gates (``gate_drafts``)
        self.payoff: DraftPayoff | None = DraftPayoff(settle=SETTLE) if measure_drafting else None
        """what drafting measurably buys at each load, and whether a step drafts (``measure_drafting``)"""
        self.host_seconds = 0.0
        """moving average of a step's seconds outside its forward (``learn_cost`` only)"""
        self.runs: dict[str, Run] = {}
        """every waiting or running run, by its request id"""
        self.waiting: deque[str] = deque()
        """ids of the runs waiting to join, oldest first"""
        self.running: list[str] = []
        """ids of the runs running, in the order they joined"""
        self.paused: dict[str, bool] = {}
        """ids of the runs that started and are not stepped now (their KV kept), each True while the
        caller holds it (:meth:`hold`), False once it may resume (paused for fairness, or released)"""
        self._group: dict[str, str] = {}  # every waiting or running run's group, by id
        self._made_ids = 0  # ids this batch made for runs submitted without one
        self._running_in: Counter[str] = Counter()  # group -> its runs running
        self._dirty: dict[Drafter, None] = {}  # drafters with state to write, in the order they finished
        self._finished_since_persist = 0
        self._failed: list[tuple[str, BaseException]] = []  # runs that failed alone in the step under way
        self._steps_done = 0
        self.prefix = prefix if prefix is not None and adapter.exactness == "bit-exact" else None
        """the KV kept across requests (:class:`~triedec.core.prefixtrie.PrefixTrie`): a request
        starts from the longest cached prefix of its prompt and leaves its own rows there; only
        where the kernels are bit-exact (a hit is then the bits of a miss), else None"""

    # ---- admission ----------------------------------------------------------------------------

    def kv_bytes(self, run: Run) -> int:
        return run.kv_tokens * self.adapter.kv_bytes_per_token

    def check(self, run: Run) -> None:
        """Refuse a run that could never be admitted (more KV than the cap)."""
        cap = self.limits.max_kv_bytes
        if cap is not None and self.kv_bytes(run) > cap:
            raise TriedecError(f"the request needs {self.kv_bytes(run) / 2**20:.0f} MiB of KV cache (prompt + "
                               f"max_new_tokens), more than this engine's cap of {cap / 2**20:.0f} MiB")

    def submit(self, run: Run, group: str = "", request_id: str | None = None) -> str:
        """Queue ``run`` as one of ``group``'s, under ``request_id`` (None: the batch makes one,
        ``"run-N"``); it joins at the next step boundary with room. Returns the id. A
        :class:`~triedec.core.errors.TriedecError` for an id that a waiting or running run has, or a
        run that could never be admitted (:meth:`check`)."""
        if request_id is None:
            self._made_ids += 1
            request_id = f"run-{self._made_ids}"
        elif not isinstance(request_id, str) or not request_id:
            raise TriedecError(f"a request id is a non-empty string, got {request_id!r}")
        if request_id in self.runs:
            raise TriedecError(f"request id {request_id!r} is already in this batch")
        self.check(run)
        self.runs[request_id] = run
        self._group[request_id] = group
        self.waiting.append(request_id)
        return request_id

    def running_in(self, group: str) -> int:
        """How many of ``group``'s runs are running."""
        return self._running_in[group]

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End the run of ``request_id`` now with stop reason ``reason`` (its session ends, its KV
        is freed; what it generated so far stays in its outcome); it emits nothing more. An id
        not in the batch (finished, or never submitted) is a no-op."""
        if request_id in self.running:
            self.running.remove(request_id)
            self._retire(request_id, reason)
        elif request_id in self.paused:
            del self.paused[request_id]
            self._retire(request_id, reason, counted=False)
        elif request_id in self.waiting:
            self.waiting.remove(request_id)
            del self._group[request_id]
            self.runs.pop(request_id).close(reason)

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting or self.paused)

    @property
    def runnable(self) -> bool:
        """Whether a step could do anything: a run runs, waits, or is paused and may resume."""
        return bool(self.running or self.waiting or not all(self.paused.values()))

    def hold(self, request_id: str) -> None:
        """Pause the running run of ``request_id`` until :meth:`release` (its KV and state kept, its
        slot free for others); a run that is not running is left as it is."""
        if request_id in self.running:
            self._pause(request_id, held=True)

    def release(self, request_id: str) -> None:
        """Let a run paused by :meth:`hold` resume at a step boundary with room."""
        if self.paused.get(request_id):
            self.paused[request_id] = False

    def _pause(self, request_id: str, held: bool) -> None:
        self.running.remove(request_id)
        self._running_in[self._group[request_id]] -= 1
        self.paused[request_id] = held

    def _admit(self) -> None:
        if self.fair:
            self._admit_fairly()
            return
        cap = self.limits.max_kv_bytes
        reserved = sum(self.kv_bytes(self.runs[i]) for i in (*self.running, *self.paused))
        for rid in [*(i for i, held in self.paused.items() if not held), *self.waiting]:
            if len(self.running) >= self.limits.max_running:
                break
            run, group = self.runs[rid], self._group[rid]
            if self.group_running is not None and self._running_in[group] >= self.group_running:
                continue
            if rid in self.paused:  # its KV is reserved already
                del self.paused[rid]
                self.running.append(rid)
                self._running_in[group] += 1
                continue
            if cap is not None and self.running and reserved + self.kv_bytes(run) > cap:
                break
            self._start(rid)
            reserved += self.kv_bytes(run)

    def _start(self, rid: str) -> None:
        """The waiting run of ``rid`` joins :attr:`running`."""
        run, group = self.runs[rid], self._group[rid]
        self.waiting.remove(rid)
        try:
            cached = self.prefix is not None and isinstance(run, Request)
            if cached:  # what followed this very prompt before (a regenerated answer): a document to draft from
                after = self.prefix.continuation(run.cache_scope, run.prompt)  # type: ignore[union-attr]
                if after:
                    run.documents = [*run.documents, after]
            run.start(self.adapter)
            if cached:
                scores = run.scores_prompt and run.score_spec is not None
                if not run.scores_prompt or scores:
                    hit, entries = self.prefix.restore(run.cache_scope, run.prompt,  # type: ignore[union-attr]
                                                       run.cacheable_prefix, run.cache,
                                                       run.score_spec if scores else None)
                    if hit:
                        run.adopt_cached(hit, entries)
        except Exception as exc:  # it never ran: it leaves the batch alone, closed, and the step goes on
            del self._group[rid], self.runs[rid]
            run.close("error")
            self._note_failure(rid, run, exc)
            return
        except BaseException:
            del self._group[rid], self.runs[rid]
            run.close("cancelled")
            raise
        if self.gate_drafts and run.shares_forward:
            run.gate = DraftGate(pace=self._pace)  # type: ignore[attr-defined]
        self.running.append(rid)
        self._running_in[group] += 1

    def _admit_fairly(self) -> None:
        """``fair`` admission (class doc): resumable paused runs and waiting runs, fewest-running
        group first (ties: paused ones, then the oldest); a group's surplus over its share is paused
        while a run of a group under its share waits and no slot is free."""
        limits, cap = self.limits, self.limits.max_kv_bytes
        reserved = sum(self.kv_bytes(self.runs[i]) for i in (*self.running, *self.paused))

        def candidates() -> list[str]:
            found = [i for i, held in self.paused.items() if not held] + list(self.waiting)
            if self.group_running is not None:
                found = [i for i in found if self._running_in[self._group[i]] < self.group_running]
            return sorted(found, key=lambda i: self._running_in[self._group[i]])  # stable: paused, then oldest

        while True:
            waiting = candidates()
            if not waiting:
                return
            rid = waiting[0]
            run, group = self.runs[rid], self._group[rid]
            fits = rid in self.paused or cap is None or not self.running or reserved + self.kv_bytes(run) <= cap
            if not fits:
                return
            if len(self.running) >= limits.max_running:
                groups = {self._group[i] for i in (*self.running, *waiting)}
                share = math.ceil(limits.max_running / len(groups))
                richest = max(self._running_in, key=lambda g: self._running_in[g], default=None)
                if (self._running_in[group] >= share or richest is None
                        or self._running_in[richest] <= max(share, self._running_in[group] + 1)):
                    return  # nobody holds more than its share against this run's group
                victim = next(i for i in reversed(self.running) if self._group[i] == richest)
                self._pause(victim, held=False)
            if rid in self.paused:
                del self.paused[rid]
                self.running.append(rid)
                self._running_in[group] += 1
            else:
                self._start(rid)
                reserved += self.kv_bytes(run)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> StepReport:
        """Advance every running run by one step (module doc); the report names the runs that
        finished during it and what the forward carried."""
        started = time.perf_counter()
        self._failed = []
        self._admit()
        held = self.share_prompts()
        scheduled = time.perf_counter()
        plan = self.schedule(held)
        forward_seconds = self.verify(plan)
        work_seconds = time.perf_counter() - scheduled
        self.share_prompts()  # requests that waited for a prefix copy it now, before its computer retires
        finished = self.retire_finished()
        seconds = time.perf_counter() - started
        self._learn(plan, seconds, forward_seconds, work_seconds)
        failed, self._failed = tuple(self._failed), []
        return StepReport(finished, plan, seconds, forward_seconds, failed)

    def _alone(self, run: Run, call: Callable[[], _T]) -> tuple[bool, _T | None]:
        """``call()``, one run's own part of the step: ``(True, its result)``, or, when it raises
        an :class:`Exception`, ``(False, None)`` with the run ended alone (:meth:`_fail`)."""
        try:
            return True, call()
        except Exception as exc:
            self._fail(run, exc)
            return False, None

    def _fail(self, run: Run, exc: Exception) -> None:
        """``run`` raised in its own part of the step: it leaves the batch now, closed with stop
        reason ``error`` (``exc``'s message in its stats), and the step goes on for the others."""
        rid = next((i for i in self.running if self.runs[i] is run), None)
        if rid is None:  # already out (a second failure in one step)
            return
        self.running.remove(rid)
        self._retire(rid, "error")
        self._note_failure(rid, run, exc)

    def _note_failure(self, rid: str, run: Run, exc: Exception) -> None:
        with contextlib.suppress(TriedecError):  # a run that never started has no outcome to note it in
            run.outcome.stats.error = str(exc) if isinstance(exc, TriedecError) else f"{type(exc).__name__}: {exc}"
        self._failed.append((rid, exc))

    def schedule(self, held: set[int] | frozenset[int] = frozenset()) -> StepPlan:
        """Propose and allocate: which requests put a prompt chunk in this step's forward, which
        verify a tree and how many of their draft's nodes it holds (module doc, 2-3); ``held``:
        the ``id()`` of requests whose prompt a peer is computing for them (:meth:`share_prompts`,
        part of admission), which put no chunk in this step. It only plans: nothing changes until
        :meth:`verify`."""
        running = tuple(self.runs[i] for i in self.running)
        requests: list[Request] = [r for r in running if r.shares_forward]  # type: ignore[misc]
        waiting = held
        chunks, budget = [], self.limits.max_prefill_tokens
        for r in requests:
            if r.prefilling and id(r) not in waiting and (not chunks or r.chunk_tokens <= budget):
                chunks.append(r)
                budget -= r.chunk_tokens
        decoding = [r for r in requests if not r.prefilling and not r.done]
        drafting = self.payoff is None or not decoding or self.payoff.drafts(len(decoding), measured=not chunks)
        proposed = [(r, self._alone(r, lambda r=r: r.propose(drafting))) for r in decoding]
        decoding = [r for r, (ok, _) in proposed if ok]
        drafts = [d for _, (ok, d) in proposed if ok]
        chunk_context = sum(r.context_tokens for r in chunks)
        context = chunk_context + sum(r.context_tokens for r in decoding)
        counts = allocate([d.chances for d in drafts], [d.required for d in drafts], self.sizing_cost,
                          fixed_tokens=sum(r.chunk_tokens for r in chunks), items=len(chunks) + len(decoding),
                          context=context, max_tokens=self.limits.max_tokens_per_forward,
                          host_seconds=self.host_seconds, fixed_context=chunk_context)
        items = [r.prefill_item() for r in chunks]
        verifying = [(r, self._alone(r, lambda r=r, n=n: r.verify_item(n)))
                     for r, n in zip(decoding, counts, strict=True)]
        decoding = [r for r, (ok, _) in verifying if ok]
        items += [item for _, (ok, item) in verifying if ok]
        counts = [n for (_, (ok, _)), n in zip(verifying, counts, strict=True) if ok]
        drafts = [d for (_, (ok, _)), d in zip(verifying, drafts, strict=True) if ok]
        return StepPlan(running, tuple(chunks), tuple(decoding), tuple(items), context,
                        tokens_before=sum(len(r.generated) for r in decoding),
                        proposed_nodes=sum(d.size - 1 for d in drafts), draft_nodes=sum(counts) - len(counts),
                        drafting=drafting)

    SHARE_AT_LEAST = 32
    """the fewest prompt tokens a request waits for a peer to compute for it (:meth:`share_prompts`)"""

    def share_prompts(self) -> set[int]:
        """Admission's last part: prompt KV computed once for requests of one group whose prompts
        start alike (a request's ``n`` choices or ``best_of`` candidates; a list of prompts that
        share a context, such as one question's answer choices, each scored): a running request
        that has prefilled nothing copies the prefix it shares with a peer that has prefilled it
        (:meth:`Request.adopt_prompt`; with its scores when it scores its prompt), or waits while a
        peer ahead of it computes that prefix (at least :data:`SHARE_AT_LEAST` tokens). Only within
        a group, so one tenant's timing never shows what another sent. (Across requests and steps,
        the prefix trie does the like as a request starts: :meth:`_start`.) Returns the ``id()`` of
        the requests that wait this step."""
        waiting: set[int] = set()
        running = [(rid, self.runs[rid]) for rid in self.running if self.runs[rid].shares_forward]
        order = {id(r): i for i, (_, r) in enumerate(running)}
        for rid, r in running:
            if not (r.prefilling and r.prefilled_tokens == 0 and r.cacheable_prefix > 0):  # type: ignore[attr-defined]
                continue
            peers = [(p, r.shared_with(p)) for i, p in running  # type: ignore[attr-defined]
                     if p is not r and id(p) not in waiting and self._group[i] == self._group[rid]]
            # the peers that have computed the prefix shared, or are ahead computing it (the first of
            # them prefills, the rest wait)
            peers = [(p, n) for p, n in peers if n >= min(self.SHARE_AT_LEAST, r.cacheable_prefix)  # type: ignore
                     and (p.prefilled_tokens >= n  # type: ignore[attr-defined]
                          or (p.prefilling and (p.prefilled_tokens or order[id(p)] < order[id(r)])))]  # type: ignore
            if not peers:
                continue
            most = max(n for _, n in peers)
            ready = next((p for p, n in peers if n == most and p.prefilled_tokens >= n), None)  # type: ignore
            if ready is not None:
                r.adopt_prompt(ready, most)  # type: ignore[attr-defined]
            else:
                waiting.add(id(r))
        return waiting

    def verify(self, plan: StepPlan) -> float:
        """One forward over the plan's items, then accept and commit per request; runs with a loop
        of their own advance one step (module doc, 4-6). Returns the forward's seconds."""
        forward_seconds = 0.0
        if plan.items:
            forward_started = time.perf_counter()
            logits = self.adapter.forward_batch(plan.items)
            self.adapter.synchronize()
            forward_seconds = time.perf_counter() - forward_started
            if self._observed is not None:
                self._observed.observe(plan.tokens, len(plan.items), plan.context, forward_seconds)
            if self.gate_drafts and plan.draft_nodes:
                self._charge_draft_rows(plan)
            for r, rows in zip(plan.chunks, logits, strict=False):
                self._alone(r, lambda r=r, rows=rows: r.prefilled(rows))
            for r, rows in zip(plan.decoding, logits[len(plan.chunks) :], strict=True):
                self._alone(r, lambda r=r, rows=rows: r.verified(rows))
        for run in self._solo_turns(plan):
            self._alone(run, run.advance)  # type: ignore[attr-defined]
        return forward_seconds

    def _solo_turns(self, plan: StepPlan) -> list[Run]:
        """The runs with a loop of their own (beam search) that advance this step: all of them,
        unless another group has work; then each group's advance, longest waiting first, only
        while its rows (its beams) fit its share of the forward's tokens
        (``max_tokens_per_forward`` over the groups with work; at least one run a group), so one
        client's beams never hold a step for everyone else."""
        self._steps_done += 1
        solo = [(rid, self.runs[rid]) for rid in self.running
                if not self.runs[rid].shares_forward and not self.runs[rid].done and self.runs[rid] in plan.running]
        if not solo:
            return []
        groups = {self._group[i] for i in (*self.running, *self.waiting, *self.paused)}
        if len(groups) <= 1:
            chosen = [run for _, run in solo]
        else:
            share = max(1, self.limits.max_tokens_per_forward // len(groups))
            spent: Counter[str] = Counter()
            chosen = []
            for rid, run in sorted(solo, key=lambda pair: pair[1].advanced_at):  # type: ignore[attr-defined]
                group, rows = self._group[rid], getattr(run, "rows", 1)
                if spent[group] and spent[group] + rows > share:
                    continue
                spent[group] += rows
                chosen.append(run)
        for run in chosen:
            run.advanced_at = self._steps_done  # type: ignore[attr-defined]
        return chosen

    def _charge_draft_rows(self, plan: StepPlan) -> None:
        """Tell each decoding request what its verified draft rows added to the forward (the sizing
        cost's estimate of the forward with and without them), so that its gate weighs them with
        its drafting's host time."""
        cost = self.sizing_cost
        if cost is None:
            return
        trees = plan.items[len(plan.chunks) :]
        rows = np.array([item.size - 1 for item in trees], dtype=np.float64)
        totals = np.concatenate([[plan.tokens], plan.tokens - rows[rows > 0]])
        seconds = cost.seconds_many(np.maximum(totals, 1), len(plan.items), plan.context)
        extra = iter(np.maximum(0.0, seconds[0] - seconds[1:]))
        for r, count in zip(plan.decoding, rows, strict=True):
            if count > 0:
                r.draft_forward_seconds = float(next(extra))

    def retire_finished(self) -> tuple[str, ...]:
        """Finished runs leave (their session ends, their KV is freed); learned state is written
        when the batch goes idle or every ``persist_every`` finished requests (module doc, 7)."""
        finished = tuple(i for i in self.running if self.runs[i].done)
        for rid in finished:
            self.running.remove(rid)
            self._retire(rid, "")
        if self.idle or self._finished_since_persist >= self.limits.persist_every:
            self.persist()
        return finished

    def _learn(self, plan: StepPlan, seconds: float, forward_seconds: float, work_seconds: float) -> None:
        """What the step taught about the machine: the pace of committed tokens (``gate_drafts``),
        the host seconds outside the forward (``learn_cost``) and, for a step without prompt chunks,
        what its arm (drafting or plain) commits per second of propose-to-commit time
        (``measure_drafting``)."""
        if not plan.decoding:
            return
        committed = sum(len(r.generated) for r in plan.decoding) - plan.tokens_before
        if self.gate_drafts:
            self._pace.observe(seconds, committed)
        if self.payoff is not None and not plan.chunks:
            self.payoff.observe(len(plan.decoding), plan.drafting, work_seconds, committed)
        if self._observed is not None:
            self.host_seconds += self.HOST_WEIGHT * (max(0.0, seconds - forward_seconds) - self.host_seconds)

    @property
    def sizing_cost(self) -> ForwardCost | None:
        """What drafts are sized under: ``cost``, or (``learn_cost``) ``cost`` corrected by the
        forwards observed since it was set."""
        if not self.learn_cost or self.cost is None:
            self._observed = None
            return self.cost
        if self._observed is None or self._observed.base is not self.cost:
            self._observed, self.host_seconds = ObservedCost(self.cost), 0.0
        return self._observed

    def _retire(self, request_id: str, reason: str, counted: bool = True) -> None:
        """The run of ``request_id`` has left :attr:`running` (``counted``; else :attr:`paused`):
        close it and count it out."""
        run, group = self.runs.pop(request_id), self._group.pop(request_id)
        self._running_in[group] -= int(counted)
        if self._running_in[group] <= 0:
            del self._running_in[group]
        if self.prefix is not None and isinstance(run, Request) and run.cache is not None and reason != "error":
            spec = run.score_spec
            self.prefix.insert(run.cache_scope, run.committed_tokens, run.cache,
                               run.cached_scores() if spec is not None else None, spec)
        run.close(reason or "cancelled")
        drafter = getattr(run, "drafter", None)
        if drafter is not None:
            self._dirty[drafter] = None
            self._finished_since_persist += 1

    def persist(self) -> None:
        """Write the learned state of the drafters that finished requests since the last write."""
        dirty, self._dirty, self._finished_since_persist = list(self._dirty), {}, 0
        for drafter in dirty:
            drafter.persist()

    def close(self) -> None:
        """Cancel every run and write the learned state (idempotent)."""
        for rid in [*self.running, *self.paused, *self.waiting]:
            self.cancel(rid)
        self.persist()


def run_alone(adapter: ModelAdapter, run: Run, cost: CostModel | None = None,
              limits: BatchLimits | None = None, prefix: PrefixTrie | None = None
              ) -> Generator[list[int], None, Outcome]:
    """Decode one run in a batch of its own: yields its tokens as they are committed (non-empty
    lists), returns its :class:`~triedec.engine.outcome.Outcome`. A run that fails in its own part
    of a step (its grammar admits no continuation, ...) raises what it raised, after the tokens it
    committed. Closing the generator early ends the run (its session ends; its learned state is
    written). ``prefix``: a prefix trie it starts from and leaves its KV in."""
    batch = Batch(adapter, cost, limits, prefix=prefix)
    batch.submit(run)
    try:
        while not run.done:
            failed = batch.step().failed
            fresh = run.take()
            if fresh:
                yield fresh
            if failed:
                raise failed[0][1]
        return run.outcome
    finally:
        batch.close()


def speculative_decode(
    adapter: ModelAdapter,
    drafter: Drafter,
    prompt: Sequence[int],
    stop: StopRule,
    documents: Sequence[Sequence[int]] = (),
    rule: AcceptanceRule = GREEDY,
    cost: CostModel | None = None,
) -> Generator[list[int], None, Any]:
    """Decoding of ``prompt`` alone with drafts from ``drafter``, each step's tokens chosen by
    ``rule`` (greedy by default, or sampling: :mod:`triedec.core.accept`), drafts sized under ``cost``;
    exactly equal to autoregressive decoding with the same rule, whatever the drafts. Yields the
    newly committed tokens; returns the :class:`~triedec.engine.outcome.Stats`."""
    outcome = yield from run_alone(adapter, Request(drafter, prompt, stop, documents, rule), cost)
    return outcome.stats
