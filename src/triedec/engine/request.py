"""One request's whole state, and its part of a decoding step.

A :class:`Request` holds everything that belongs to one request (vLLM's request state): the
prompt, the tokens generated so far, its KV cache, its drafter session, its stop rule and
acceptance rule, its counters. It keeps one invariant: the KV cache holds every committed token
except the newest one, which is the root of the next draft tree. The engine
(:mod:`triedec.engine.batch`) drives it through

* **prefill**, in chunks of :data:`~triedec.core.limits.PREFILL_CHUNK` tokens (:meth:`Request.prefill_item`,
  :meth:`Request.prefilled`): the last chunk's logits give the first token;
* **propose** (:meth:`Request.propose`): the drafter session's :class:`~triedec.drafters.Draft`,
  cut to what the stop rule still allows;
* **verify** (:meth:`Request.verify_item`): the prefix of the draft that the allocator sized,
  as one item of a forward shared with other requests;
* **accept** and **commit** (:meth:`Request.verified`): the acceptance rule walks the tree, the
  drafter observes what was verified, the stop rule cuts (even inside an accepted draft) and the
  cache keeps the accepted path.

Chunk boundaries are fixed multiples of :data:`~triedec.core.limits.PREFILL_CHUNK` within the prompt and a request's
tree never depends on where it sits in a forward, so a request's arithmetic is the same whatever
else runs beside it (see :mod:`triedec.model.adapter` on batch invariance).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from triedec.core.accept import GREEDY, Acceptance, AcceptanceRule
from triedec.core.allocate import DraftGate
from triedec.core.errors import TriedecError, positive_int
from triedec.core.grammar import ConstrainedRule, TokenConstraint, constrained_row
from triedec.core.kvcache import KVCache
from triedec.core.limits import PREFILL_CHUNK
from triedec.core.logprobs import Logprobs, TokenLogprob, token_logprobs
from triedec.core.sampling import seen_tokens
from triedec.core.trace import MODEL, StepTrace, origin_of
from triedec.core.tree import TokenTree
from triedec.drafters.base import MAX_TREE_NODES, Draft, Drafter, DrafterSession, Verified
from triedec.engine.constrained import EXTENDED_LEAVES, constrained_draft, own_view
from triedec.engine.outcome import Outcome, Stats
from triedec.model.adapter import ForwardItem, ModelAdapter


def prompt_chunk(cache: KVCache, prompt: Sequence[int], start: int, stop: int, keep: int) -> ForwardItem:
    """The prompt's tokens ``[start, stop)`` at their positions, as a causal chain on top of the
    chunks already committed to ``cache``, keeping the last ``keep`` rows' logits: one prefill
    chunk (a request's, or beam search's)."""
    n = stop - start
    return ForwardItem(cache, torch.tensor(prompt[start:stop]), torch.arange(start, stop),
                       torch.ones((n, n), dtype=torch.bool).tril_(), keep)


@dataclass(frozen=True)
class StopRule:
    """When generation ends: EOS / stop tokens, stop strings, or ``max_new_tokens``; none of the
    first two before ``min_tokens`` tokens are out (the acceptance rule gives the stop ids no mass
    there either: :func:`~triedec.core.accept.acceptance_rule`).

    ``decode`` turns token ids into text; it is needed only when ``stop_strings`` are given.
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = field(default=None, compare=False)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        positive_int("max_new_tokens", self.max_new_tokens)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise TriedecError("stop strings must be non-empty strings")
        if self.stop_strings and self.decode is None:
            raise TriedecError("stop strings need a decode function")

    def cut(self, generated: Sequence[int], new: Sequence[int]) -> tuple[list[int], str | None]:
        """The part of ``new`` (appended after ``generated``) to keep, and why generation stops
        (``"eos"``, ``"stop_string"``, ``"length"``) or None. Nothing past a stop is kept."""
        kept: list[int] = []
        for tok in new:
            kept.append(tok)
            early = len(generated) + len(kept) < self.min_tokens  # vLLM's check: fewer than min_tokens out
            if tok in self.eos_token_ids and not early:
                return kept, "eos"
            if self.stop_strings and not early and self._stop_string_completed([*generated, *kept]):
                return kept, "stop_string"
            if len(generated) + len(kept) >= self.max_new_tokens:
                return kept, "length"
        return kept, None

    def _stop_string_completed(self, tokens: Sequence[int]) -> bool:
        # A stop string of k characters spans at most k tokens (plus a few for partial bytes).
        window = max(len(s) for s in self.stop_strings) + 8
        text = self.decode(tokens[-window:])  # type: ignore[misc]
        return any(s in text for s in self.stop_strings)


class Request:
    """One speculative request's whole state (see the module doc). Created by a decoder, started
    by the engine when admitted (:meth:`start`: the drafter session begins, the KV cache is made),
    driven one phase at a time, and closed once (:meth:`close`: the session ends, the KV is
    freed). Used by one thread at a time; shares nothing with other requests but the drafter,
    whose learned state is updated under the drafter's own lock."""

    shares_forward = True
    """its steps join the batch's shared forward (:class:`~triedec.engine.runs.Run`)"""

    def __init__(self, drafter: Drafter, prompt: Sequence[int], stop: StopRule,
                 documents: Sequence[Sequence[int]] = (), rule: AcceptanceRule = GREEDY,
                 logprobs: Logprobs | None = None, constraint: TokenConstraint | None = None) -> None:
        self.prompt = [int(t) for t in prompt]
        if not self.prompt:
            raise TriedecError("the prompt is empty (no tokens)")
        self.drafter, self.stop, self.documents = drafter, stop, documents
        self.constraint = constraint
        """the request's grammar state (None: unconstrained): every chosen token is masked by it
        after its own prefix (:class:`~triedec.core.grammar.ConstrainedRule`), drafts it forbids are
        cut and the tokens it forces are drafted (:mod:`triedec.engine.constrained`)"""
        self.rule: AcceptanceRule = rule if constraint is None else ConstrainedRule(rule, constraint)
        self.logprobs = logprobs
        """what to report of each new token's probability (None: nothing): computed from the row
        that chose it (:mod:`triedec.core.logprobs`), so every method reports ``ar``'s values"""
        self._fresh_logprobs: list[TokenLogprob] = []
        self.generated: list[int] = []
        self.reason: str | None = None
        self.stats = Stats(prompt_tokens=len(self.prompt), seed=rule.seed)
        self.submitted = time.perf_counter()
        self.session: DrafterSession | None = None
        self.cache: KVCache | None = None
        self._adapter: ModelAdapter | None = None
        self._started = 0.0
        self._prefilled = 0
        self._fresh: list[int] = []
        self._draft: Draft | None = None
        self._kept: tuple[int, ...] = ()
        self._proposed = 0
        self._own_nodes = 0  # the proposal's draft nodes that are the drafter's own (not the grammar's)
        self._draft_seconds = 0.0  # host seconds of the last proposal (the gate weighs drafting by them)
        self.draft_forward_seconds = 0.0
        """the forward seconds this step's verified draft rows added (set by a gating batch before
        :meth:`verified`, from its cost model; the gate charges them to drafting)"""
        self._tree: TokenTree | None = None
        self._context: list[int] = []
        self._reached: list[int] = []  # _reached[d]: steps whose tree had depth >= d
        self._accepted_at: list[int] = []  # _accepted_at[d]: steps that accepted >= d drafts
        self._trace: list[StepTrace] | None = None
        self._pruned = 0  # the drafter's nodes the grammar cut from this step's draft
        self.prompt_entries: list[TokenLogprob] = []
        """its prompt's scores so far, when it scores its prompt (``logprobs.prompt``): entry j is
        prompt token j + 1's, from the row before it (what a prefix trie keeps beside the rows)"""
        self.cache_scope: Hashable = None
        """whose prefix trie its prompt is looked up in and its KV kept in (a batch with a
        :class:`~triedec.core.prefixtrie.PrefixTrie`): the server's tenant and the client's
        ``cache_salt``; None: the one scope of a library's batches"""
        self._closed = False
        self.gate: DraftGate | None = None
        """set by a batch that gates drafting (:class:`~triedec.core.allocate.DraftGate`); None: always drafts"""

    # ---- lifecycle ----------------------------------------------------------------------------

    @property
    def kv_tokens(self) -> int:
        """KV slots this request reserves: prompt, output and the largest tree."""
        return len(self.prompt) + self.stop.max_new_tokens + MAX_TREE_NODES

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def prefilling(self) -> bool:
        return self._prefilled < len(self.prompt)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens already in its cache."""
        return self._prefilled

    def shared_with(self, source: Request) -> int:
        """How much of its prompt it may take from ``source``, another started request (its K/V,
        and its scores when it scores its prompt: then only from one that scores the same way):
        their common prefix, less one token when it scores (the row before a token of its own must
        be computed to score it), at most :attr:`cacheable_prefix`. 0: nothing."""
        common = 0
        for a, b in zip(self.prompt, source.prompt, strict=False):
            if a != b:
                break
            common += 1
        if self.scores_prompt:
            if self.score_spec is None or source.score_spec != self.score_spec:
                return 0
            common -= 1
        return max(0, min(common, self.cacheable_prefix))

    def adopt_prompt(self, source: Request, length: int | None = None) -> None:
        """Take the first ``length`` (default :meth:`shared_with`) prompt slots of ``source`` (a
        started request whose prompt starts as this one's and that has prefilled at least that
        much) as its own prefill: a copy of K/V that are the same bits as its own prefill would
        compute (a token's K/V depend on its prefix only, whatever chunk or batch carried them),
        with their scores when it scores its prompt; it prefills the rest itself."""
        share = self.shared_with(source) if length is None else length
        if self.cache is None or source.cache is None or self._prefilled or share > self.shared_with(source) \
                or source._prefilled < share or (self.scores_prompt and len(source.prompt_entries) < share):
            raise TriedecError("internal error: a prompt can be adopted only by a started request that has "
                               "prefilled nothing, from one that has prefilled the prefix they share")
        self.cache.copy_prefix(source.cache, share)
        self._prefilled = share
        if self.scores_prompt and share:
            scores = source.prompt_entries[:share]
            self.prompt_entries += scores
            self._fresh_logprobs += scores

    @property
    def cacheable_prefix(self) -> int:
        """How much of its prompt it may take from a prefix trie: all but the rows whose logits it
        needs itself (the last, and those its drafter observes); a request that scores its prompt
        takes the scores of the tokens it takes too (:attr:`score_spec`)."""
        return max(0, len(self.prompt) - max(1, self.drafter.prefill_logits))

    @property
    def score_spec(self) -> tuple[int, bool, str] | None:
        """What its prompt's scores are (alternatives, ranks, distribution) when it scores its
        prompt under the raw distribution: a prefix trie gives it cached rows only with scores of
        this spec (None: it scores no prompt, or in the processed distribution, which depends on
        its sampling; then it takes rows only if it scores nothing)."""
        ask = self.logprobs
        if ask is None or not ask.prompt:
            return None
        return (ask.prompt_alternatives, ask.prompt_ranks, ask.mode) if ask.mode == "raw" else None

    @property
    def scores_prompt(self) -> bool:
        return self.logprobs is not None and self.logprobs.prompt

    def adopt_cached(self, length: int, scores: Sequence[TokenLogprob] = ()) -> None:
        """Its cache, started and empty, now holds its prompt's first ``length`` tokens (restored
        from a prefix trie: the same bits its own prefill would compute, a token's K/V depending on
        its prefix only); it prefills the rest. At most :attr:`cacheable_prefix`. A request that
        scores its prompt gets the scores of prompt tokens 1 .. ``length`` with them (``scores``,
        from the rows before them: the same bits its own rows give), and scores the rest itself."""
        if self.cache is None or self._prefilled or self.cache.length != length or length > self.cacheable_prefix \
                or (self.scores_prompt and len(scores) != length) or (not self.scores_prompt and scores):
            raise TriedecError("internal error: cached rows go only into a started request's empty cache, at most "
                               "its cacheable prefix, with the scores it asks for")
        self._prefilled = length
        self.stats.cached_tokens = length
        if scores:
            self.prompt_entries += scores
            self._fresh_logprobs += scores

    def cached_scores(self) -> list[TokenLogprob | None]:
        """Per slot of its committed tokens, the score of its token (the first prompt token's, and
        the generated ones', None): what a prefix trie keeps beside the rows."""
        count = 0 if self.cache is None else self.cache.length
        scores: list[TokenLogprob | None] = [None, *self.prompt_entries][:count]
        return scores + [None] * (count - len(scores))

    @property
    def committed_tokens(self) -> list[int]:
        """The tokens whose K/V its cache holds, in slot order (its prompt, then what it generated)."""
        if self.cache is None:
            return []
        return [*self.prompt, *self.generated][: self.cache.length]

    @property
    def context_tokens(self) -> int:
        """Tokens in its cache (what attention reads)."""
        return 0 if self.cache is None else self.cache.length

    def start(self, adapter: ModelAdapter) -> None:
        """Admitted: begin the drafting session and make the KV cache."""
        if self._adapter is not None:
            raise TriedecError("a request starts once")
        self._adapter = adapter
        self._started = time.perf_counter()
        self.stats.queued_seconds = self._started - self.submitted
        self.session = self.drafter.begin(self.prompt, self.documents)
        self.cache = adapter.new_cache(self.kv_tokens)

    def take(self) -> list[int]:
        """The tokens committed since the last call."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens committed since the last call, one per token in their order
        (always empty unless the request asked for them); with ``logprobs.prompt``, each prompt
        token's after the first come first (``len(prompt) - 1`` of them, before the first
        generated token's)."""
        fresh, self._fresh_logprobs = self._fresh_logprobs, []
        return fresh

    def record_steps(self) -> None:
        """From now on, keep a :class:`~triedec.core.trace.StepTrace` of every step (before
        :meth:`start`; memory: one tree of at most ``MAX_TREE_NODES`` nodes per step until taken)."""
        if self._trace is None:
            self._trace = []

    def take_steps(self) -> list[StepTrace]:
        """The step records made since the last call (always empty unless :meth:`record_steps`)."""
        if not self._trace:
            return []
        steps, self._trace = self._trace, []
        return steps

    @property
    def outcome(self) -> Outcome:
        return Outcome(self.stats)

    def close(self, reason: str = "cancelled") -> None:
        """End the request (idempotent): finish its stats (``reason`` if it had not stopped), end
        the drafting session, free the KV cache."""
        if self._closed:
            return
        self._closed = True
        if self.reason is None:
            self.reason = reason
        try:
            if self.cache is not None and self._adapter is not None:
                self._finish()
        finally:
            self.cache = None
            if self.session is not None:
                self.session.end()

    def _finish(self) -> None:
        assert self.cache is not None and self._adapter is not None and self.reason is not None
        self._adapter.synchronize()
        stats = self.stats
        stats.finish(self._started, len(self.generated), self.cache, self.reason, self._adapter)
        stats.mean_accepted = (len(self.generated) - 1) / stats.steps if stats.steps else 0.0
        stats.acceptance_by_depth = [a / r for a, r in zip(self._accepted_at[1:], self._reached[1:], strict=True) if r]
        if self.session is not None:
            stats.drafter = self.session.stats()
        if self.gate is not None:
            stats.skipped_drafts = self.gate.skipped
        if self.constraint is not None:
            stats.grammar_seconds = self.constraint.seconds

    def _score(self, rows: torch.Tensor, new: Sequence[int], prefix: Sequence[int] | None = None) -> None:
        """The logprobs of ``new`` (tokens about to be committed, or prompt tokens), token j
        following row j of ``rows`` (``[>= len(new), V]``), when the request asked for them: under
        the model's raw distribution, or the one the rule chooses from (after token j's own prefix:
        ``prefix``, by default the committed tokens, then ``new[:j]``; prompt tokens are scored as
        if nothing were out yet), all rows in one block (:func:`token_logprobs`)."""
        ask = self.logprobs
        if ask is None:
            return
        output = prefix is None  # new tokens: token j is output number len(generated) + j
        if prefix is None:
            prefix = [*self.prompt, *self.generated]
        if not new:
            return
        rows = rows[: len(new)]
        if ask.mode == "processed":
            processed = []
            for j, row in enumerate(rows):
                seen = seen_tokens(prefix, new[:j]) if self.rule.penalized else seen_tokens(())
                position = len(self.generated) + j if output else 0
                row = row.detach().to("cpu")
                if output and self.constraint is not None:  # chosen under the grammar after new[:j]
                    row = constrained_row(row, self.constraint.allowed(new[:j]))
                processed.append(self.rule.processed(row, seen, position))
            rows = torch.stack(processed)
        top, ranks = (ask.top, False) if output else (ask.prompt_alternatives, ask.prompt_ranks)
        entries = token_logprobs(rows, new, top, ranks)
        if not output:
            self.prompt_entries += entries
        self._fresh_logprobs += entries

    def _emit(self, new: Sequence[int], reason: str | None, origins: Sequence[str], tree: TokenTree | None = None,
              sources: tuple[tuple[str, ...], ...] = (), path: tuple[int, ...] = (), pruned: int = 0) -> None:
        """Commit ``new`` (each token with its origin) and count the origins; record the step if asked."""
        if self.constraint is not None:  # after _score, which masks by the state before ``new``
            self.constraint.commit(new)
        self.generated += new
        self._fresh += new
        self.reason = reason
        counts = self.stats.accepted_by_origin
        for origin in origins[: len(new)]:
            counts[origin] = counts.get(origin, 0) + 1
        if self._trace is not None:  # sources: every node's, given when recording
            self._trace.append(StepTrace(self.stats.steps, tuple(new), tuple(origins[: len(new)]), tree, sources, path,
                                         pruned))

    def _constrained(self, new: list[int], reason: str | None) -> tuple[list[int], str | None]:
        """``new`` cut after the token that completes the request's grammar, if one does: a
        complete grammar ends generation (``"grammar"``), whatever end-of-sequence tokens do."""
        if self.constraint is None:
            return new, reason
        done = self.constraint.completed_by(new)
        return (new, reason) if done is None else (new[:done], "grammar")

    # ---- prefill ------------------------------------------------------------------------------

    def _chunk(self) -> tuple[int, int]:
        start = self._prefilled
        return start, min(len(self.prompt), (start // PREFILL_CHUNK + 1) * PREFILL_CHUNK)

    @property
    def chunk_tokens(self) -> int:
        """Tokens of the next prefill chunk."""
        start, stop = self._chunk()
        return stop - start

    def _observed_rows(self, start: int, stop: int) -> int:
        """Rows of this chunk whose logits the drafter observes (the prompt's last
        ``prefill_logits`` positions)."""
        return max(0, stop - max(start, len(self.prompt) - self.drafter.prefill_logits))

    def prefill_item(self) -> ForwardItem:
        """The next prompt chunk: a causal chain on top of the committed chunks."""
        assert self.cache is not None
        start, stop = self._chunk()
        keep = max(self._observed_rows(start, stop), 1 if stop == len(self.prompt) else 0)
        if self.logprobs is not None and self.logprobs.prompt:
            keep = stop - start  # every row scores the prompt token after it
        return prompt_chunk(self.cache, self.prompt, start, stop, keep)

    def prefilled(self, logits: torch.Tensor) -> None:
        """Commit the chunk; the drafter observes the rows it asked for; the last chunk's last
        logits choose the first token (by the acceptance rule, like any other token)."""
        assert self.cache is not None and self.session is not None
        start, stop = self._chunk()
        self.cache.commit(range(stop - start))
        self._prefilled = stop
        final = stop == len(self.prompt)
        if self.logprobs is not None and self.logprobs.prompt:  # row r: position start + r, scoring the next one
            scored = min(stop, len(self.prompt) - 1) - start
            self._score(logits[:scored], self.prompt[start + 1 : start + 1 + scored], self.prompt[: start + 1])
        first = None
        if final:
            first = self.rule.accept(TokenTree.root_only(self.prompt[-1]), logits[-1:], self.prompt, 0).tokens[0]
        rows = self._observed_rows(start, stop)
        if rows:
            tail = self.prompt[stop - rows : stop]
            after = first if final else self.prompt[stop]
            chain = TokenTree(tuple(tail), tuple(range(-1, rows - 1)))
            self.session.observe(Verified(chain, logits[-rows:], Acceptance(tuple(range(rows)), (*tail[1:], after))))
        if final:
            assert first is not None
            new, reason = self._constrained(*self.stop.cut([], [first]))
            self._score(logits[-1:], new)
            self._emit(new, reason, (MODEL,))
            self._adapter.synchronize()  # type: ignore[union-attr]
            self.stats.prefill_seconds = time.perf_counter() - self._started

    # ---- propose -> verify -> accept -> commit ------------------------------------------------

    def propose(self, drafting: bool = True) -> Draft:
        """The drafter's proposal, without nodes past what ``max_new_tokens`` still allows; the root
        alone (``propose(context, 1)``) on a step that does not draft (``drafting`` False: the
        batch's step runs plain) or that its :attr:`gate` skips."""
        assert self.session is not None
        self._context = self.prompt + self.generated
        drafting = drafting and (self.gate is None or self.gate.proposes())
        started = time.perf_counter()
        draft = self.session.propose(self._context, MAX_TREE_NODES if drafting else 1)
        self._draft_seconds = time.perf_counter() - started
        if not isinstance(draft, Draft):
            raise TriedecError(f"drafter session {type(self.session).__name__} returned a "
                               f"{type(draft).__name__}, not a Draft")
        if draft.tree.root != self._context[-1]:
            raise TriedecError(f"drafter session {type(self.session).__name__} proposed a tree not rooted at the "
                               "last token")
        self._proposed = draft.size
        room = self.stop.max_new_tokens - len(self.generated) - 1
        self._draft, self._kept = draft.within(MAX_TREE_NODES, room)
        if self.constraint is not None:
            # the tokens the grammar forces are accepted for certain: drafted on every step of a
            # method that drafts them, a plain or gated one too (the drafter's leaves only when it drafts)
            forced = self.constraint.forced(min(room, MAX_TREE_NODES - 1)) if self.drafter.drafts_forced else []
            extend = EXTENDED_LEAVES if drafting and self.drafter.drafts_forced else 0
            merged, own = constrained_draft(self._draft, self.constraint, forced, extend, min(room, MAX_TREE_NODES - 1))
            self._pruned = self._draft.size - sum(1 for o in own if o >= 0)
            self._draft, keep = merged.within(MAX_TREE_NODES, room)
            self._kept = tuple(-1 if own[k] < 0 else self._kept[own[k]] for k in keep)
            self._own_nodes = sum(1 for k in self._kept[1:] if k >= 0)
        else:
            self._own_nodes = self._draft.size - 1
        return self._draft

    def verify_item(self, count: int) -> ForwardItem:
        """The first ``count`` nodes of the proposal (as the allocator sized them) as one item of
        a forward."""
        assert self._draft is not None and self.cache is not None
        tree = self._draft.tree.truncated(count)
        self._tree, self._kept = tree, self._kept[: tree.size]
        return ForwardItem(self.cache, torch.tensor(tree.tokens), tree.positions(self.cache.length)[0], tree.ancestry)

    def verified(self, logits: torch.Tensor) -> None:
        """Accept, tell the drafter what was verified, cut at a stop, commit."""
        tree, cache, session, draft = self._tree, self.cache, self.session, self._draft
        assert tree is not None and cache is not None and session is not None and draft is not None
        acceptance = self.rule.accept(tree, logits, self._context, len(self.generated))
        started = time.perf_counter()
        session.observe(own_view(tree, logits, acceptance, self._kept, self._proposed))
        if self.gate is not None:
            verified, accepted = tree.size - 1, len(acceptance.path) - 1
            if self.constraint is not None:  # the drafter's own nodes only: forced tokens are no evidence
                kept = self._kept
                verified = sum(1 for k in kept[1:] if k >= 0)
                accepted = sum(1 for n in acceptance.path[1:] if kept[n] >= 0)
            self.gate.verified(self._own_nodes, verified, accepted,
                               self._draft_seconds + time.perf_counter() - started + self.draft_forward_seconds)
            self.draft_forward_seconds = 0.0
        new, reason = self._constrained(*self.stop.cut(self.generated, acceptance.tokens))
        if self.logprobs is not None:  # the accepted rows gathered (a copy) only when they are scored
            self._score(logits[list(acceptance.path[: len(new)])], new)
        cache.commit(acceptance.path[: len(new)])  # the root and the accepted drafts before the newest token
        stats = self.stats
        stats.steps += 1
        stats.computed_tokens += tree.size
        stats.proposed_nodes += self._proposed - 1
        stats.verified_nodes += tree.size - 1
        stats.accepted_per_step.append(len(new))
        depth = tree.max_depth
        while len(self._reached) <= depth:
            self._reached.append(0)
            self._accepted_at.append(0)
        for d in range(1, depth + 1):
            self._reached[d] += 1
        for d in range(1, len(acceptance.path)):
            self._accepted_at[d] += 1
        self._draft = self._tree = None
        origins = (*(origin_of(draft.sources_of(i)) for i in acceptance.path[1:]), MODEL)
        sources = tuple(draft.sources_of(i) for i in range(tree.size)) if self._trace is not None else ()
        self._emit(new, reason, origins, tree, sources, acceptance.path, self._pruned)
