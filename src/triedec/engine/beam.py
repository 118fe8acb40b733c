"""Method ``beam``: trie beam search -- all beams share one trie-shaped KV cache.

``transformers`` keeps one KV copy per beam (``num_beams x sequence`` slots) and reorders it every
step. Here one :class:`~triedec.core.kvcache.KVCache` holds the prompt once and every beam as a path of
a token trie: a beam that branches shares its parent's slots. Each step feeds the b newest leaves
(b tokens) with a mask that lets each leaf see the prompt and its own ancestors only, at position
= its depth. Branches that no live beam goes through any more are garbage: every ``gc_every``
steps, and whenever the cache would outgrow its buffers, the live slots are compacted with one
``index_select`` per layer (:meth:`KVCache.select`). Which beams live and die is decided by
:class:`BeamScorer`, a line-by-line port of ``transformers``' beam search bookkeeping
(``GenerationMixin._beam_search``, transformers 5.x) for one prompt, so the hypotheses and scores
are those of ``model.generate(num_beams=b, do_sample=False, ...)``.

Split: :class:`~triedec.core.beamscore.BeamScorer` is pure (log-probs in, chosen parents/tokens out;
:mod:`triedec.core.beamscore`); :func:`beam_search` drives it with model forwards and owns the trie KV;
:class:`BeamSearchDecoder` is the method, registered under :data:`METHOD` with a loop of its own.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any

import torch

from triedec.core.beamscore import BeamOptions, BeamScorer, Hypothesis
from triedec.core.errors import TriedecError
from triedec.core.grammar import TokenConstraint
from triedec.core.kvcache import KVCache
from triedec.core.limits import PREFILL_CHUNK
from triedec.core.logprobs import Logprobs
from triedec.core.sampling import GREEDY_SAMPLING, Sampling
from triedec.core.trace import MODEL, StepTrace
from triedec.core.tree import TokenTree
from triedec.drafters.base import ModelInfo
from triedec.drafters.learned import Learned
from triedec.drafters.registry import BEAM_SEARCH, register
from triedec.engine.outcome import Outcome, Stats
from triedec.engine.request import StopRule, prompt_chunk
from triedec.engine.runs import SoloRun
from triedec.model.adapter import ModelAdapter

__all__ = ["METHOD", "BeamOptions", "BeamScorer", "BeamSearchDecoder", "Hypothesis",
           "beam_search", "check_request", "kv_slots"]

METHOD = "beam"


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
) -> Generator[list[int], None, Outcome]:
    """Beam search over ``prompt`` with transformers' semantics on a shared trie KV cache.

    The returned generator yields once per forward (a prompt chunk, or one step of all beams): the
    tokens of the best hypothesis that became certain since (the stable prefix of all candidates;
    often none), and the rest at the end; it returns an :class:`~triedec.engine.outcome.Outcome`
    (stats, and the hypotheses best first as its ``sequences``). So whoever drives it
    (the engine's :class:`~triedec.engine.runs.SoloRun`) gets control back after every forward, and a
    time limit or a cancel takes effect within one. Stops at EOS / stop tokens
    (``stop.eos_token_ids``) and ``stop.max_new_tokens``. Stop strings and context documents are
    refused here, before anything runs. With ``steps`` (a list), it appends a
    :class:`~triedec.core.trace.StepTrace` per beam step: the tokens that became certain (origin
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
    """The prompt into the empty ``cache`` in chunks of :data:`~triedec.core.limits.PREFILL_CHUNK`
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
            stop: StopRule, steps: list[StepTrace] | None = None) -> Generator[list[int], None, Outcome]:
    start = time.perf_counter()
    b = options.num_beams
    scorer = BeamScorer(options, len(prompt), stop.max_new_tokens, stop.eos_token_ids)
    trie = _TrieKV(adapter, len(prompt), b, options.gc_every, kv_slots(len(prompt), b, stop.max_new_tokens))

    logits = yield from _prefill(adapter, trie.cache, prompt)  # [1, vocab]
    stats = Stats(num_beams=b, prompt_tokens=len(prompt), prefill_seconds=time.perf_counter() - start)
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
    return Outcome(stats, tuple(results))


@register(METHOD, BeamOptions, "trie beam search: transformers' beam search results, all beams sharing one "
          "trie-shaped KV cache", own_loop=True, equals=BEAM_SEARCH)
class BeamSearchDecoder:
    """Trie beam search with fixed :class:`~triedec.core.beamscore.BeamOptions`, in a loop of its own
    (all beams in one forward already; :class:`~triedec.engine.runs.SoloRun`). It applies no logits
    processors, so it refuses sampling and the repetition penalty."""

    def __init__(self, options: BeamOptions, model: ModelInfo) -> None:
        del model
        self.options = options

    def start(self, prompt: Sequence[int], stop: StopRule, documents: Sequence[Sequence[int]] = (),
              sampling: Sampling = GREEDY_SAMPLING, logprobs: Logprobs | None = None,
              constraint: TokenConstraint | None = None) -> SoloRun:
        if constraint is not None:
            raise TriedecError("beam search does not take a grammar yet: use another method with a grammar")
        if logprobs is not None:
            raise TriedecError("beam search does not report logprobs (its hypotheses carry their scores)")
        if not sampling.plain:
            raise TriedecError("beam search does not sample and applies no penalty, logit_bias or min_tokens: use "
                               "temperature=0 and leave those off with method 'beam'")
        ids = check_request(prompt, stop, documents)
        reserve = kv_slots(len(ids), self.options.num_beams, stop.max_new_tokens)  # what its trie may grow to

        def loop(adapter: Any, steps: list[StepTrace] | None) -> Generator[list[int], None, Outcome]:
            return (yield from beam_search(adapter, ids, self.options, stop, steps=steps))

        return SoloRun(loop, reserve, rows=self.options.num_beams)

    def export_learned(self) -> Learned:
        """Beam search learns nothing across requests."""
        return Learned()

    def absorb_learned(self, learned: Learned) -> None:
        """Nothing to merge."""

    def max_learned_bytes(self) -> int:
        """Nothing learned across requests."""
        return 0
