"""What a run reports: :class:`Stats` (one type for every method: the counters all fill, the
speculative loop's per step and per draft source, beam search's) and :class:`Outcome` (a finished
run's stats and, for beam search, its ranked sequences)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triedec.core.kvcache import KVCache
    from triedec.model.adapter import ModelAdapter


@dataclass
class Stats:
    """What every run reports: one type for every method (names match the benchmark's JSON).
    Fields a method does not fill keep their defaults.

    Every run:

    * ``new_tokens``: tokens returned; ``steps``: forwards the request took part in after its
      prefill; ``computed_tokens``: its tokens that went through the model, prompt excluded;
    * ``seconds``: wall clock from the start of its prefill to its last token, as the request
      lived it: when it shares forwards with other requests, each forward's whole duration counts;
      ``tokens_per_s`` = new tokens / seconds; ``queued_seconds``: waiting before that;
    * ``prompt_tokens``, ``cached_tokens`` (of them, those whose K/V came from a prefix trie, not
      computed), ``prefill_seconds`` (to the first token), ``stop_reason`` (``eos``,
      ``stop_string``, ``length``, ``grammar`` (the request's grammar is complete), ``cancelled``,
      ``time_limit``, ``error``: the run raised in its own part of a step, e.g. a grammar that
      admits no continuation, and ended alone); ``error``: what it raised (``stop_reason`` ``error``);
    * ``peak_kv_tokens``: most KV slots in use; ``kv_bytes``: their size;
    * ``kernels``: what the model ran on (``plain``, or triedec's faster kernels; see the adapter);
      ``runner``: which code walked its layers, ``triedec`` (its own runner) or ``transformers``;
    * ``exactness``: the guarantee the run had, ``bit-exact`` (every token's logits the same bits
      as plain decoding's, whatever tree or batch carried them: the kernels passed the load-time
      self-test) or ``up to rounding`` (``ModelAdapter.exactness``);
    * ``seed``: the sampling seed (None for greedy decoding): the same seed gives the same tokens.

    Runs that verify drafts (every method but ``beam``; None or empty otherwise):

    * ``mean_accepted``: tokens produced per step (the prefill's first token excluded): 1.0 for
      ``ar``, higher when drafts are accepted (the papers' MAT);
    * ``accepted_per_step``: tokens kept at each step;
    * ``acceptance_by_depth[d-1]``: among steps whose tree reached depth d, the share that
      accepted at least d draft tokens;
    * ``proposed_nodes`` / ``verified_nodes``: draft nodes (root excluded) the drafter proposed
      and the engine verified, summed over steps (the allocator and the length limit cut the rest);
    * ``drafter``: the drafter session's own counters (:meth:`DrafterSession.stats`);
    * ``accepted_by_origin``: the tokens returned, counted by origin (:mod:`triedec.core.trace`):
      ``model`` for those the forward chose itself, else the source that drafted them; the counts
      add up to ``new_tokens``;
    * ``grammar_seconds``: the wall time spent in the request's grammar state (masks, draft
      checks, forced tokens, commits; None when it had no grammar);
    * ``skipped_drafts``: steps on which the request did not draft because its drafts had stopped
      paying (:class:`~triedec.core.allocate.DraftGate`: batches that gate drafting, as the server's).

    Beam search (``num_beams`` 0 otherwise): ``new_tokens`` are the best hypothesis's,
    ``computed_tokens`` b per step, ``peak_kv_tokens`` the most trie KV slots in use; plus
    ``num_beams``, ``hf_peak_kv_tokens`` (what transformers holds for the same run: b copies of
    prompt + steps), ``kv_bytes_per_token`` (peak KV bytes / (prompt + new tokens)) and ``gc_runs``
    (compactions).
    """

    new_tokens: int = 0
    steps: int = 0
    computed_tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    queued_seconds: float = 0.0
    stop_reason: str = ""
    error: str = ""
    peak_kv_tokens: int = 0
    kv_bytes: int = 0
    kernels: str = ""
    runner: str = ""
    exactness: str = ""
    seed: int | None = None
    # runs that verify drafts
    mean_accepted: float | None = None
    accepted_per_step: list[int] = field(default_factory=list)
    acceptance_by_depth: list[float] = field(default_factory=list)
    proposed_nodes: int = 0
    verified_nodes: int = 0
    drafter: dict[str, float] = field(default_factory=dict)
    accepted_by_origin: dict[str, int] = field(default_factory=dict)
    skipped_drafts: int = 0
    grammar_seconds: float | None = None
    # beam search
    num_beams: int = 0
    hf_peak_kv_tokens: int = 0
    kv_bytes_per_token: float = 0.0
    gc_runs: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def summary(self) -> str:
        """One line for people: speed, steps, prompt and why generation stopped."""
        steps = f"{self.steps} steps"
        if self.mean_accepted is not None:
            steps += f", {self.mean_accepted:.2f} tokens/step"
        if self.seed is not None:
            steps += f", seed {self.seed}"
        line = (f"{self.new_tokens} tokens in {self.seconds:.2f} s = {self.tokens_per_s:.1f} tok/s"
                f" | {steps}, {self.computed_tokens} computed"
                f" | prompt {self.prompt_tokens} tokens, prefill {self.prefill_seconds:.2f} s"
                f" | stop: {self.stop_reason} | {self.exactness}"
                + (f" | {self.runner} runner" if self.runner else "")
                + (", one native call a forward" if self.kernels.endswith("+native-forward") else "")
                + (f" | {self.kernels.split('+')[0]}" if self.kernels.split("+")[0].endswith("-weights") else ""))
        if self.num_beams:
            line += (f" | {self.num_beams} beams, KV peak {self.peak_kv_tokens} tokens "
                     f"(transformers: {self.hf_peak_kv_tokens})")
        return line

    def finish(self, start: float, new_tokens: int, cache: KVCache, reason: str, adapter: ModelAdapter) -> None:
        """Fill the common end-of-run fields (time since ``start``, KV use of ``cache``, what
        ``adapter`` ran and guaranteed)."""
        self.kernels, self.runner, self.exactness = adapter.kernels, adapter.runner, adapter.exactness
        self.seconds = time.perf_counter() - start
        self.new_tokens = new_tokens
        self.tokens_per_s = new_tokens / self.seconds if self.seconds > 0 else 0.0
        self.stop_reason = reason
        self.peak_kv_tokens = cache.peak
        self.kv_bytes = cache.peak * cache.bytes_per_slot()


@dataclass(frozen=True)
class Outcome:
    """What a finished request returns: its stats and, for methods that rank several sequences
    (beam search), the best ones with their scores, best first."""

    stats: Stats
    sequences: tuple = ()
