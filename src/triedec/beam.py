"""Method ``beam``: trie beam search -- all beams share one trie-shaped KV cache.

``transformers`` keeps one KV copy per beam (``num_beams x sequence`` slots) and reorders it every
step. Here one :class:`~triedec.kvcache.KVCache` holds the prompt once and every beam as a path of
a token trie: a beam that branches shares its parent's slots. Each step feeds the b newest leaves
(b tokens) with a mask that lets each leaf see the prompt and its own ancestors only, at position
= its depth. Branches that no live beam goes through any more are garbage: every ``gc_every``
steps, and whenever the cache would outgrow its buffers, the live slots are compacted with one
``index_select`` per layer (:meth:`KVCache.select`). Which beams live and die is decided by
:class:`BeamScorer`, a line-by-line port of ``transformers``' beam search bookkeeping
(``GenerationMixin._beam_search``, transformers 5.x) for one prompt, so the hypotheses and scores
are those of ``model.generate(num_beams=b, do_sample=False, ...)``.

Split: :class:`BeamScorer` is pure (log-probs in, chosen parents/tokens out); :func:`beam_search`
drives it with model forwards and owns the trie KV.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from triedec.adapter import ModelAdapter
from triedec.drafters.registry import at_most
from triedec.errors import TriedecError, positive_int
from triedec.kvcache import KVCache
from triedec.request import PREFILL_CHUNK, Stats, StopRule, prompt_chunk
from triedec.trace import MODEL, StepTrace
from triedec.tree import TokenTree

METHOD = "beam"
DEFAULT_GC_EVERY = 5
"""Compaction period in steps, chosen by measurement (benchmarks/beam-gc: every 1 or 5 steps was as
fast as or faster than the paper's 15 and held less KV)."""
_NEG = -1.0e9  # transformers' "impossible" score


@dataclass(frozen=True)
class BeamOptions:
    """Beam search settings, with ``transformers``' meaning and defaults."""

    num_beams: int = field(default=4, metadata=at_most(64))
    """beams kept alive per step (b): one step verifies b tokens, and the trie KV holds up to
    prompt + b x max_new_tokens slots (:func:`kv_slots`)"""
    length_penalty: float = 1.0
    """finished score = sum of log-probs / generated length ** length_penalty"""
    early_stopping: bool | str = False
    """True: stop when num_beams hypotheses are finished; False: stop when no live beam can do
    better (heuristic); "never": the canonical test"""
    num_return_sequences: int = 1
    """best finished hypotheses returned (<= num_beams)"""
    gc_every: int = field(default=DEFAULT_GC_EVERY, metadata=at_most(64))
    """compact the trie KV every N steps (0 = only when the buffers are full)"""

    CLI_ALIASES: ClassVar[dict[str, str]] = {
        "num_beams": "--num-beams", "length_penalty": "--length-penalty", "early_stopping": "--early-stopping",
        "num_return_sequences": "--num-return-sequences", "gc_every": "--gc-every"}
    """short command-line flags (transformers' names) besides ``--beam-OPTION``"""

    def __post_init__(self) -> None:
        positive_int("num_beams", self.num_beams)
        positive_int("num_return_sequences", self.num_return_sequences)
        if self.num_return_sequences > self.num_beams:
            raise TriedecError(
                f"num_return_sequences ({self.num_return_sequences}) cannot exceed num_beams ({self.num_beams})"
            )
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
            raise TriedecError(f"length_penalty must be a finite number, got {lp!r}")
        object.__setattr__(self, "length_penalty", float(lp))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise TriedecError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        gc = self.gc_every
        if isinstance(gc, bool) or not isinstance(gc, int) or gc < 0:
            raise TriedecError(f"gc_every must be an integer >= 0, got {gc!r}")


@dataclass(frozen=True)
class Hypothesis:
    """A returned sequence: its new tokens (ending with the EOS token if it ended on one) and its
    score (sum of token log-probs / length ** length_penalty, as in transformers)."""

    token_ids: tuple[int, ...]
    score: float


class BeamScorer:
    """transformers' beam search state for one prompt, as tensors of a batch of one.

    Per step, :meth:`step` takes the running beams' next-token log-probs ``[b, vocab]`` and returns
    which beam each new running beam extends (``parents [b]``) and with which token (``tokens
    [b]``). It mirrors ``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
    ``_update_finished_beams``, ``_check_early_stop_heuristic`` and
    ``_beam_search_has_unfinished_sequences`` operation for operation, so that float ties and the
    -1e9 sentinels behave identically. Mutates only itself.
    """

    def __init__(self, options: BeamOptions, prompt_len: int, max_new_tokens: int, eos_token_ids: frozenset[int]):
        b = options.num_beams
        self.options = options
        self.prompt_len = prompt_len
        self.max_length = prompt_len + max_new_tokens
        self.cur_len = prompt_len
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
        self.keep = max(2, 1 + len(eos_token_ids)) * b
        self.top_mask = torch.cat((torch.ones(b, dtype=torch.bool), torch.zeros(self.keep - b, dtype=torch.bool)))
        self.running_scores = torch.zeros((1, b))
        self.running_scores[:, 1:] = _NEG
        self.running: list[tuple[int, ...]] = [() for _ in range(b)]
        self.finished: list[tuple[int, ...]] = [() for _ in range(b)]
        self.finished_scores = torch.full((1, b), _NEG)
        self.is_finished = torch.zeros((1, b), dtype=torch.bool)
        self.unsatisfied = torch.ones((1, 1), dtype=torch.bool)
        self.done = False

    def step(self, log_probs: torch.Tensor) -> tuple[list[int], list[int]]:
        """Advance one token. ``log_probs [b, vocab]`` (float32) of the running beams, in order."""
        if self.done:
            raise TriedecError("beam search is already finished")
        b, opts = self.options.num_beams, self.options
        vocab = log_probs.shape[-1]
        scores = (log_probs[None] + self.running_scores[:, :, None]).reshape(1, -1)  # [1, b * vocab]
        # top-K continuations
        topk_scores, topk_index = torch.topk(scores, k=self.keep)
        topk_beam = (topk_index // vocab)[0].tolist()
        topk_tokens = (topk_index % vocab)[0]
        token_list = topk_tokens.tolist()
        candidates = [(*self.running[beam], tok) for beam, tok in zip(topk_beam, token_list, strict=True)]
        hits = torch.isin(topk_tokens, self.eos) | (self.cur_len + 1 >= self.max_length)
        hits = hits[None]  # [1, keep]
        # running beams for the next step
        running_scores = topk_scores + hits.to(torch.float32) * _NEG
        nxt = torch.topk(running_scores, k=b)[1]
        self.running_scores = torch.take_along_dim(running_scores, nxt, dim=1)
        nxt_list = nxt[0].tolist()
        self.running = [candidates[i] for i in nxt_list]
        parents = [topk_beam[i] for i in nxt_list]
        tokens = [token_list[i] for i in nxt_list]
        # finished hypotheses
        just_finished = hits & self.top_mask[None, :]
        fin = topk_scores / ((self.cur_len + 1 - self.prompt_len) ** opts.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (opts.early_stopping is True)
        fin = fin + full.to(torch.float32) * _NEG
        fin = fin + (~self.unsatisfied).to(torch.float32) * _NEG
        fin = fin + (~just_finished) * _NEG
        merged_scores = torch.cat((self.finished_scores, fin), dim=1)
        merged = [*self.finished, *candidates]
        merged_finished = torch.cat((self.is_finished, just_finished), dim=1)
        best = torch.topk(merged_scores, k=b)[1]
        self.finished = [merged[i] for i in best[0].tolist()]
        self.finished_scores = torch.take_along_dim(merged_scores, best, dim=1)
        self.is_finished = torch.take_along_dim(merged_finished, best, dim=1)
        # stopping
        self.cur_len += 1
        self._update_early_stop_heuristic()
        improvement_possible = bool(self.unsatisfied.any())
        exists_open_beam = not (bool(self.is_finished.all()) and opts.early_stopping is True)
        valid_continuations = not bool(hits.all())
        self.done = not (improvement_possible and exists_open_beam and valid_continuations)
        return parents, tokens

    def _update_early_stop_heuristic(self) -> None:
        opts = self.options
        if opts.early_stopping == "never" and opts.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_len
        else:
            best_length = self.cur_len - self.prompt_len
        best_running = self.running_scores[:, :1] / (best_length**opts.length_penalty)
        worst_finished = torch.where(
            self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], torch.tensor(_NEG)
        )
        self.unsatisfied = self.unsatisfied & torch.any(best_running > worst_finished, dim=-1, keepdim=True)

    def stable_prefix(self) -> tuple[int, ...]:
        """Tokens every possible final answer starts with: the common prefix of the running beams
        and the finished hypotheses still held (later results descend from one of them)."""
        held = [*self.running, *(h for h, f in zip(self.finished, self.is_finished[0].tolist(), strict=True) if f)]
        prefix: list[int] = []
        for column in zip(*held, strict=False):
            if any(t != column[0] for t in column):
                break
            prefix.append(column[0])
        return tuple(prefix)

    def results(self) -> list[Hypothesis]:
        """The ``num_return_sequences`` best finished hypotheses, best first."""
        n = self.options.num_return_sequences
        scores = self.finished_scores[0, :n].tolist()
        return [Hypothesis(tokens, score) for tokens, score in zip(self.finished[:n], scores, strict=True)]


@dataclass
class BeamStats(Stats):
    """:class:`~triedec.engine.Stats` of a beam search (``new_tokens``: tokens of the best
    hypothesis; ``computed_tokens``: b per step; ``peak_kv_tokens``: most trie KV slots in use),
    plus ``num_beams``, ``hf_peak_kv_tokens`` (what transformers holds for the same run: b copies
    of prompt + steps), ``kv_bytes_per_token`` (peak KV bytes / (prompt + new tokens)) and
    ``gc_runs`` (compactions)."""

    num_beams: int = 0
    hf_peak_kv_tokens: int = 0
    kv_bytes_per_token: float = 0.0
    gc_runs: int = 0

    def summary(self) -> str:
        return (f"{super().summary()} | {self.num_beams} beams, KV peak {self.peak_kv_tokens} tokens "
                f"(transformers: {self.hf_peak_kv_tokens})")


@dataclass(frozen=True)
class BeamResult:
    hypotheses: tuple[Hypothesis, ...]
    stats: BeamStats


def kv_slots(prompt_len: int, num_beams: int, max_new_tokens: int) -> int:
    """The most KV slots a beam search ever holds: the prompt plus b new slots per forward, and
    there are at most ``max_new_tokens - 1`` forwards (the first token comes from the prompt's
    logits), so even with no compaction at all it stays under ``prompt + b x max_new_tokens``.
    The trie's buffers never grow past it, so it is what admission reserves for a beam request."""
    return prompt_len + num_beams * max_new_tokens


class _TrieKV:
    """The shared cache plus, for each running beam, which slots it may see (the prompt and its
    own path in the trie): ``visible [b, capacity]`` bool. Its buffers start small and double when
    full, never past ``limit`` (:func:`kv_slots`). Mutates its cache."""

    def __init__(self, adapter: ModelAdapter, prompt_len: int, num_beams: int, gc_every: int, limit: int) -> None:
        self.prompt_len, self.b, self.gc_every, self.limit = prompt_len, num_beams, gc_every, limit
        self.cache = adapter.new_cache(min(limit, prompt_len + num_beams * (2 * (gc_every or 16) + 1)))
        self.visible = torch.zeros((num_beams, self.cache.capacity), dtype=torch.bool)
        self.visible[:, :prompt_len] = True
        self.since_gc = 0
        self.gc_runs = 0

    def before_forward(self, parents: Sequence[int]) -> torch.Tensor:
        """Reorder per-beam visibility to the new running beams and make room for b slots.
        Returns the visibility ``[b, length + b]`` of the b new leaves."""
        self.visible = self.visible[torch.tensor(parents)]
        cache = self.cache
        if cache.length + self.b > cache.capacity:
            self.collect()
            if cache.length + self.b > cache.capacity:
                self._grow(max(cache.length + self.b, min(2 * cache.capacity, self.limit)))
        length = cache.length
        vis = torch.zeros((self.b, length + self.b), dtype=torch.bool)
        vis[:, :length] = self.visible[:, :length]
        vis[:, length:] = torch.eye(self.b, dtype=torch.bool)
        return vis

    def after_forward(self) -> None:
        """Commit the b leaves (each beam's new slot joins its path); compact if it is time."""
        length = self.cache.length
        self.cache.commit(range(self.b))
        self.visible[:, length : length + self.b] = torch.eye(self.b, dtype=torch.bool)
        self.since_gc += 1
        if self.gc_every and self.since_gc >= self.gc_every:
            self.collect()

    def collect(self) -> None:
        """Drop every slot no running beam sees (dead branches): one index_select per layer."""
        live = self.visible[:, : self.cache.length].any(dim=0).nonzero()[:, 0]
        self.since_gc = 0
        if live.numel() == self.cache.length:
            return
        self.cache.select(live)
        kept = self.visible[:, live]
        self.visible = torch.zeros_like(self.visible)
        self.visible[:, : live.numel()] = kept
        self.gc_runs += 1

    def _grow(self, capacity: int) -> None:
        self.cache.reserve(capacity)
        grown = torch.zeros((self.b, capacity), dtype=torch.bool)
        grown[:, : self.visible.shape[1]] = self.visible
        self.visible = grown


def beam_search(
    adapter: ModelAdapter, prompt: Sequence[int], options: BeamOptions, stop: StopRule,
    documents: Sequence[Sequence[int]] = (), steps: list[StepTrace] | None = None,
) -> Generator[list[int], None, BeamResult]:
    """Beam search over ``prompt`` with transformers' semantics on a shared trie KV cache.

    The returned generator yields once per forward (a prompt chunk, or one step of all beams): the
    tokens of the best hypothesis that became certain since (the stable prefix of all candidates;
    often none), and the rest at the end; it returns the hypotheses and stats. So whoever drives it
    (the engine's :class:`~triedec.engine.SoloRun`) gets control back after every forward, and a
    time limit or a cancel takes effect within one. Stops at EOS / stop tokens
    (``stop.eos_token_ids``) and ``stop.max_new_tokens``. Stop strings and context documents are
    refused here, before anything runs. With ``steps`` (a list), it appends a
    :class:`~triedec.trace.StepTrace` per beam step: the tokens that became certain (origin
    ``model``), and the live hypotheses past them as the step's tree, the best one as its path
    (the last record: the returned hypotheses).
    """
    return _search(adapter, check_request(prompt, stop, documents), options, stop, steps)


def check_request(prompt: Sequence[int], stop: StopRule, documents: Sequence[Sequence[int]] = ()) -> list[int]:
    """The prompt's token ids, or a clear error for what beam search cannot honour."""
    if stop.stop_strings:
        raise TriedecError("stop strings are not supported with beam search (stop_token_ids are)")
    if documents:
        raise TriedecError("context documents are for drafting methods, not beam search")
    ids = [int(t) for t in prompt]
    if not ids:
        raise TriedecError("the prompt is empty (no tokens)")
    return ids


def _prefill(adapter: ModelAdapter, cache: KVCache, prompt: list[int]) -> Generator[list[int], None, torch.Tensor]:
    """The prompt into the empty ``cache`` in chunks of :data:`~triedec.request.PREFILL_CHUNK`
    tokens at fixed offsets, one chunk per step (it yields nothing between chunks), so that a long
    prompt holds the engine no longer than one chunk's forward at a time, as a request's prefill
    does; returns the last token's logits ``[1, vocab]``. The chunks are committed."""
    logits = torch.empty(0)
    for start in range(0, len(prompt), PREFILL_CHUNK):
        stop = min(len(prompt), start + PREFILL_CHUNK)
        last = stop == len(prompt)
        logits = adapter.forward_batch([prompt_chunk(cache, prompt, start, stop, 1 if last else 0)])[0]
        cache.commit(range(stop - start))
        if not last:
            yield []
    return logits


def _record(step: int, fresh: Sequence[int], root: int, streamed: int,
            hypotheses: Sequence[tuple[int, ...]]) -> StepTrace:
    """A beam step's record: the tokens that became certain (``fresh``, chosen by the model) and
    the hypotheses past their first ``streamed`` tokens as one trie rooted at ``root`` (the last
    certain token), the first (best) one as its path."""
    tokens, parents, index = [root], [-1], {(): 0}
    best: tuple[int, ...] = (0,)
    for rank, beam in enumerate(hypotheses):
        suffix = beam[streamed:]
        for i in range(1, len(suffix) + 1):
            if suffix[:i] not in index:
                index[suffix[:i]] = len(tokens)
                tokens.append(suffix[i - 1])
                parents.append(index[suffix[: i - 1]])
        if rank == 0:
            best = tuple(index[suffix[:i]] for i in range(len(suffix) + 1))
    return StepTrace(step, tuple(fresh), (MODEL,) * len(fresh), TokenTree(tuple(tokens), tuple(parents)),
                     ((),) * len(tokens), best)


def _search(adapter: ModelAdapter, prompt: list[int], options: BeamOptions,
            stop: StopRule, steps: list[StepTrace] | None = None) -> Generator[list[int], None, BeamResult]:
    start = time.perf_counter()
    b = options.num_beams
    scorer = BeamScorer(options, len(prompt), stop.max_new_tokens, stop.eos_token_ids)
    trie = _TrieKV(adapter, len(prompt), b, options.gc_every, kv_slots(len(prompt), b, stop.max_new_tokens))

    logits = yield from _prefill(adapter, trie.cache, prompt)  # [1, vocab]
    stats = BeamStats(num_beams=b, prompt_tokens=len(prompt), prefill_seconds=time.perf_counter() - start)
    log_probs = torch.log_softmax(logits, dim=-1).expand(b, -1)  # every beam starts at the prompt
    streamed: tuple[int, ...] = ()
    while True:
        parents, tokens = scorer.step(log_probs)
        prefix = scorer.stable_prefix()
        fresh = list(prefix[len(streamed) :])
        streamed = prefix if fresh else streamed
        if steps is not None:  # the live hypotheses
            steps.append(_record(stats.steps, fresh, streamed[-1] if streamed else prompt[-1], len(streamed),
                                 scorer.running))
        if scorer.done:
            if fresh:
                yield fresh
            break
        yield fresh  # once per forward, even empty: one engine step is one beam step, never more
        visible = trie.before_forward(parents)
        positions = torch.full((b,), scorer.cur_len - 1, dtype=torch.long)  # depth of the new leaves
        logits = adapter.forward(trie.cache, torch.tensor(tokens), positions, visible)  # [b, vocab]
        trie.after_forward()
        log_probs = torch.log_softmax(logits, dim=-1)
        stats.steps += 1
        stats.computed_tokens += b

    results = scorer.results()
    best = results[0].token_ids
    if best[: len(streamed)] != streamed:
        raise TriedecError("internal error: the streamed prefix is not a prefix of the best hypothesis")
    if len(best) > len(streamed):
        if steps is not None:  # the returned hypotheses as the last tree
            steps.append(_record(stats.steps, best[len(streamed) :], streamed[-1] if streamed else prompt[-1],
                                 len(streamed), [h.token_ids for h in results]))
        yield list(best[len(streamed) :])
    adapter.synchronize()
    reason = "eos" if best and best[-1] in stop.eos_token_ids else "length"
    stats.finish(start, len(best), trie.cache, reason, adapter)
    stats.hf_peak_kv_tokens = b * (len(prompt) + stats.steps)
    stats.kv_bytes_per_token = stats.kv_bytes / (len(prompt) + len(best))
    stats.gc_runs = trie.gc_runs
    return BeamResult(tuple(results), stats)
