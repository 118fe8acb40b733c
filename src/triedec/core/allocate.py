"""One verify budget per forward: how many nodes of each running request's draft to verify.

Every request in a step brings a :class:`~triedec.drafters.Draft`: a best-first list of nodes,
each with the drafter's estimate of its chance to be accepted, and a count of nodes it requires.
A forward's cost depends on the tokens it carries and the requests they belong to
(:class:`~triedec.core.costmodel.CostModel`); a step yields, per decoding request, one token of its own
plus its accepted drafts. So the most tokens per second come from:

* every request's required nodes (its root at least), plus the step's prefill tokens;
* then the optional nodes of all drafts merged into one list by chance, highest first (a node
  costs the same marginal forward time whichever request it serves, so the highest chance is the
  most expected tokens per unit of marginal cost), each draft's nodes taken in its own order so
  that every request verifies a prefix of its draft, i.e. a tree;
* cut where the expected tokens per second of the whole step, ``(requests + sum of chances) /
  (seconds(tokens, requests, context) + host seconds)``, is highest: nodes are added while they
  pay. The host seconds (the step's time outside the forward: drafting, accepting, committing,
  measured by the engine) are paid whatever the cut, so they weigh each node's marginal forward
  time against a longer step.
* a forward that also carries prompt chunks: the chunks' own seconds (the forward with them less
  the forward without them) leave the denominator. The prompt is processed whatever the cut, so
  a node is weighed against the rate of a decoding step, not against a step slowed by a prompt
  (which would take nodes at a fraction of the decode rate), while its marginal time is read
  where the curve is with the chunks aboard (a row beside a long chunk costs several times a row
  in a decoding step). With the chunk's time in the denominator, drafts verified in chunk steps
  cost more forward than they saved (the measurement is in docs/batching.md).

At low load this is each drafter's own best tree (for one request it is exactly the old per-
drafter rule); as requests pile up, the step's fixed cost is shared by more of them, a node's
marginal cost weighs more against the step's yield, and trees shrink smoothly toward plain batched
decoding. There is no switch by batch size. Pure: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from triedec.core.costmodel import ForwardCost
from triedec.core.errors import TriedecError


def allocate(chances: Sequence[Sequence[float]], required: Sequence[int], cost: ForwardCost | None, *,
             fixed_tokens: int = 0, items: int | None = None, context: int | None = None,
             max_tokens: int | None = None, host_seconds: float = 0.0, fixed_context: int = 0) -> list[int]:
    """How many leading nodes of each draft to verify (root included; at least ``required[i]``).

    ``chances[i]``: draft i's per-node chances (``chances[i][0]`` is its root), best first;
    ``fixed_tokens``: other tokens in the same forward (prompt chunks); ``items``: how many
    requests the forward carries in all (default: the drafts; prompt chunks count too);
    ``context``: the tokens in all their caches, ``fixed_context`` of them the chunks';
    ``max_tokens``: most tokens the forward may carry (required nodes always go);
    ``host_seconds``: the step's time outside its forward. ``cost`` None (a flat curve) takes
    every node with a positive chance."""
    if not (host_seconds >= 0 and math.isfinite(host_seconds)):
        raise TriedecError(f"host_seconds must be a finite number >= 0, got {host_seconds!r}")
    if len(chances) != len(required):
        raise TriedecError("allocate needs one required count per draft")
    counts = [int(r) for r in required]
    for r, c in zip(counts, chances, strict=True):
        if not 1 <= r <= len(c):
            raise TriedecError(f"required must lie in [1, {len(c)}], got {r}")
    base_tokens = fixed_tokens + sum(counts)
    room = None if max_tokens is None else max(0, max_tokens - base_tokens)
    # each draft's optional nodes, made non-increasing (so a global order by chance takes prefixes)
    owner, value = [], []
    for i, (r, c) in enumerate(zip(counts, chances, strict=True)):
        tail = np.minimum.accumulate(np.asarray(c[r:], dtype=np.float64)) if len(c) > r else np.zeros(0)
        owner.append(np.full(tail.size, i))
        value.append(tail)
    if not owner:
        return counts
    owners, values = np.concatenate(owner), np.concatenate(value)
    order = np.lexsort((np.arange(values.size), owners, -values))  # by chance, then draft, then position
    order = order[values[order] > 0]
    if room is not None:
        order = order[:room]
    if not order.size:
        return counts
    if cost is None:
        take = order.size
    else:
        forward_items = len(chances) if items is None else items
        expected = len(chances) + sum(float(np.sum(c[1:r])) for r, c in zip(counts, chances, strict=True))
        gains = expected + np.concatenate([[0.0], np.cumsum(values[order])])
        tokens = base_tokens + np.arange(order.size + 1)
        seconds = cost.seconds_many(tokens, max(1, forward_items), context)
        if fixed_tokens > 0:  # the chunks' own time is spent whatever the cut (module doc)
            decode_context = None if context is None else max(0, context - fixed_context)
            alone = cost.seconds_many(np.array([base_tokens - fixed_tokens]), len(chances), decode_context)[0]
            seconds = seconds - max(0.0, float(seconds[0] - alone))
        speed = gains / (seconds + host_seconds)
        take = int(np.argmax(speed))  # the first of equal speeds: fewer nodes
    for i in owners[order[:take]]:
        counts[int(i)] += 1
    return counts


class Pace:
    """What a committed token costs the batch right now: a moving average (weight ``weight``) of a
    step's wall seconds over the tokens it committed, updated once per step by the batch and read by
    every request's :class:`DraftGate`. 0 until the first step (the gate then judges by verified
    nodes alone)."""

    def __init__(self, weight: float = 0.2) -> None:
        if not 0 < weight <= 1:
            raise TriedecError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.token_seconds = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        """One step: ``seconds`` of wall time committed ``tokens`` tokens (a step that committed
        none, a prefill-only step, teaches nothing)."""
        if tokens <= 0 or seconds < 0:
            return
        per_token = seconds / tokens
        self.token_seconds = per_token if not self.token_seconds else (
            self.token_seconds + self.weight * (per_token - self.token_seconds))


class DraftGate:
    """Whether one request proposes a draft this step: a request whose drafts stopped paying is not
    asked to draft at all, so its step costs what ``ar``'s does, until a probe says otherwise.

    A *miss* is a step whose proposal held draft nodes that did not pay: :func:`allocate` verified
    none of them (the step's budget judged that none pays), or, given a :class:`Pace`, the
    request's drafting stopped paying for what it costs: the moving average (weight ``weight``,
    over the steps it drafted) of the draft tokens it had accepted, times what a committed token
    costs the batch now (``pace.token_seconds``), fell below the moving average of the seconds its
    drafting took: its drafter's host time (propose + observe) plus the forward time its verified
    draft rows added (the batch's cost-model estimate). An empty proposal is no miss: drafting
    found nothing, which is cheap. After ``patience`` misses in a row the request skips drafting
    for ``skip`` steps, then proposes again (a probe); each further miss doubles the skip, up to
    ``max_skip`` steps; a step that pays resets it. Skipping changes no token (every method's tokens
    are ``ar``'s whatever it verifies), only the host time spent drafting. One per request; the
    engine calls :meth:`proposes` before each step's proposal and :meth:`verified` after it.

    Alone, a token costs a whole forward against a small fraction of that for drafting, so a rare
    accepted token pays; in a full batch a token costs a share of a forward, and drafting has to
    earn proportionally more to go on.
    """

    def __init__(self, patience: int = 2, max_skip: int = 32, pace: Pace | None = None,
                 weight: float = 0.2) -> None:
        if patience < 1 or max_skip < 1:
            raise TriedecError(f"patience and max_skip must be >= 1, got {patience}, {max_skip}")
        if not 0 < weight <= 1:
            raise TriedecError(f"weight must be in (0, 1], got {weight}")
        self.patience, self.max_skip, self.pace, self.weight = patience, max_skip, pace, weight
        self.misses = 0
        self.skip = 1
        self.waiting = 0
        self.skipped = 0
        """steps this request did not draft (a counter for stats)"""
        self.accepted = 1.0
        """moving average of the draft tokens accepted per drafted step, from a prior of 1 (a new
        request is given the benefit of the doubt for its first steps)"""
        self.draft_seconds: float | None = None
        """moving average of the host seconds a drafted step's drafting took (None before the first)"""

    def proposes(self) -> bool:
        """True if the request drafts this step (False: it skips, and one skipped step is spent)."""
        if self.waiting > 0:
            self.waiting -= 1
            self.skipped += 1
            return False
        return True

    def pays(self) -> bool:
        """Whether the request's drafting pays for its host time at the batch's pace (True without
        a pace, or before anything is known)."""
        if self.pace is None or not self.pace.token_seconds or self.draft_seconds is None:
            return True
        return self.accepted * self.pace.token_seconds >= self.draft_seconds

    def verified(self, proposed: int, verified: int, accepted: int = 0, draft_seconds: float = 0.0) -> None:
        """A step's outcome: ``proposed`` draft nodes (root excluded), ``verified`` of them,
        ``accepted`` of those, and the seconds drafting took (propose + observe, plus the forward
        time the verified draft rows added)."""
        if proposed <= 0:
            return  # nothing drafted: no evidence either way
        w = self.weight
        self.accepted += w * (accepted - self.accepted)
        self.draft_seconds = (draft_seconds if self.draft_seconds is None
                              else self.draft_seconds + w * (draft_seconds - self.draft_seconds))
        if verified > 0 and self.pays():
            self.misses, self.skip = 0, 1
            return
        self.misses += 1
        if self.misses >= self.patience:
            self.waiting, self.misses = self.skip, self.patience - 1  # a missed probe backs off at once
            self.skip = min(2 * self.skip, self.max_skip)


def load_level(requests: int) -> int:
    """The load level a step of ``requests`` decoding requests counts under in a
    :class:`DraftPayoff`: 1-4 as they are, then the power of two at or below (5-7 count as 4,
    8-15 as 8, ...)."""
    requests = max(1, int(requests))
    return requests if requests <= 4 else 1 << (requests.bit_length() - 1)


@dataclass
class _Arm:
    """Decayed sums of one arm's committed tokens and step seconds at one load level, over the
    steps it ran in measured pairs."""

    tokens: float = 0.0
    seconds: float = 0.0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class DraftPayoff:
    """Whether drafting pays at each load, measured rather than predicted: an A/B controller over
    whole steps, in *pairs*. At each load level (:func:`load_level` of the step's decoding
    requests) it compares two arms, steps that draft and steps that do not (every request verifies
    its root alone, as ``ar`` does), by committed tokens per second of step time. Only pairs count:
    two observed steps in a row, one of each arm, with the same number of decoding requests. What a
    step costs and yields depends far more on how many requests it carries (a level spans 8-15, say)
    and on the machine's state (which drifts over minutes) than on whether it drafted; a pair holds
    both fixed, so an arm that runs rarely is not judged on the loads and minutes it happened to run
    in (unpaired, ``ar``'s two identical arms measured 1.2x apart at 8-15 requests, where requests
    finishing made the load fall while the rare arm ran). Each arm's rate is its ratio of sums over
    the level's pairs, decayed: at each new pair both arms' sums weigh ``1 - 1/window`` less, so a
    change in what pays is followed within about ``window`` pairs.

    A step drafts when the drafting arm's rate is at least the plain arm's; one step in
    ``explore`` runs the other arm and pairs with the step before it or, where that one carried
    another number of requests, the step after it. While the level has fewer than ``min_pairs``
    pairs, one step in ``warmup`` does (every other step by default: a level is measured in about
    ``2 * min_pairs`` steps, half of them on the prior's arm, which may be the slow one; sampled
    under load a drafting step can cost twice a plain one). Before any pair, drafting (the cost
    model's choice) is the prior.

    So drafting runs only where it measurably pays, and where it does not the loss is bounded by
    the exploration share: ``1/explore`` of the steps run the slower arm, and ``1/(explore x
    settle)`` once the level has ``settle_pairs`` pairs and the slower arm's rate is below
    ``settle_margin`` of the faster's (a clear verdict: explored less as the evidence grows). Which arm a step runs
    changes when its tokens come, never which tokens (every method's tokens are ``ar``'s whatever
    it verifies). The batch observes only steps without prompt chunks (a chunk's time is not the
    decode rate). Deterministic (a counter per level, no randomness); one engine thread uses it."""

    def __init__(self, explore: int = 16, warmup: int = 2, min_pairs: int = 4, window: int = 32, settle: int = 1,
                 settle_pairs: int = 16, settle_margin: float = 0.9) -> None:
        for name, value, least in (("explore", explore, 2), ("warmup", warmup, 2), ("min_pairs", min_pairs, 1),
                                   ("window", window, 1), ("settle", settle, 1), ("settle_pairs", settle_pairs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise TriedecError(f"{name} must be an integer >= {least}, got {value!r}")
        if not 0 < settle_margin <= 1:
            raise TriedecError(f"settle_margin must lie in (0, 1], got {settle_margin!r}")
        self.explore, self.warmup, self.min_pairs = explore, warmup, min_pairs
        self.settle, self.settle_pairs, self.settle_margin = settle, settle_pairs, settle_margin
        self.decay = 1.0 - 1.0 / window
        self._arms: dict[tuple[int, bool], _Arm] = {}
        self._pairs: dict[int, int] = {}
        self._decisions: dict[int, int] = {}
        self._last: tuple[int, bool, float, int] | None = None  # the last observed step, still unpaired

    def arm(self, level: int, drafting: bool) -> _Arm:
        return self._arms.setdefault((level, drafting), _Arm())

    def pairs(self, level: int) -> int:
        """Pairs measured at ``level``."""
        return self._pairs.get(level, 0)

    def prefers_drafting(self, level: int) -> bool:
        """The arm the measurements favour at ``level`` (drafting until ``min_pairs`` pairs)."""
        if self.pairs(level) < self.min_pairs:
            return True
        return self.arm(level, True).rate() >= self.arm(level, False).rate()

    def drafts(self, requests: int, measured: bool = True) -> bool:
        """Whether a step of ``requests`` decoding requests drafts (counts one decision at its
        level). ``measured`` False: a step that will not be observed (it carries prompt chunks)
        drafts only where pairs at its level measured drafting to pay (never on the prior: such
        steps are never measured, and beside a chunk a draft row costs more than in a decoding
        step), and counts no decision, so no exploration is spent on it."""
        level = load_level(requests)
        if not measured:
            return self.pairs(level) >= self.min_pairs and self.prefers_drafting(level)
        count = self._decisions.get(level, 0) + 1
        self._decisions[level] = count
        best = self.prefers_drafting(level)
        period = self.warmup if self.pairs(level) < self.min_pairs else self.explore * (
            self.settle if self.settled(level) else 1)
        return (not best) if count % period == 0 else best

    def settled(self, level: int) -> bool:
        """Whether ``level``'s verdict is clear: ``settle_pairs`` pairs or more, and the slower
        arm's rate below ``settle_margin`` of the faster's."""
        if self.pairs(level) < self.settle_pairs:
            return False
        rates = sorted((self.arm(level, True).rate(), self.arm(level, False).rate()))
        return rates[1] > 0 and rates[0] < self.settle_margin * rates[1]

    def observe(self, requests: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A step of ``requests`` decoding requests (``drafted``: whether it drafted) took ``seconds``
        and committed ``tokens``. It completes a pair with the step observed just before it if that
        one ran the other arm with as many requests; else it waits for the next one. A step that
        took no time or a bad count breaks the chain."""
        if not (seconds > 0 and math.isfinite(seconds)) or tokens < 0:
            self._last = None
            return
        before, self._last = self._last, (requests, drafted, seconds, tokens)
        if before is None or before[0] != requests or before[1] == drafted:
            return
        self._last = None  # a step counts in one pair at most
        level = load_level(requests)
        for either in (self.arm(level, True), self.arm(level, False)):
            either.tokens *= self.decay
            either.seconds *= self.decay
        for _, arm_drafted, arm_seconds, arm_tokens in (before, (requests, drafted, seconds, tokens)):
            arm = self.arm(level, arm_drafted)
            arm.tokens += arm_tokens
            arm.seconds += arm_seconds
        self._pairs[level] = self.pairs(level) + 1

    def speedup(self, level: int) -> float | None:
        """The drafting arm's rate over the plain arm's at ``level`` (None before ``min_pairs`` pairs)."""
        plain = self.arm(level, False).rate()
        if self.pairs(level) < self.min_pairs or not plain:
            return None
        return self.arm(level, True).rate() / plain

    def report(self) -> dict[int, dict[str, float | int | bool | None]]:
        """Per load level measured so far: each arm's tokens/s over the pairs, the pairs, the
        speedup, and which arm is preferred."""
        levels = sorted({level for level, _ in self._arms} | set(self._decisions))
        return {level: {"draft_tokens_per_s": round(self.arm(level, True).rate(), 2),
                        "plain_tokens_per_s": round(self.arm(level, False).rate(), 2),
                        "pairs": self.pairs(level), "speedup": self.speedup(level),
                        "drafting": self.prefers_drafting(level)}
                for level in levels}
