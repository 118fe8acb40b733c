"""The one decode loop: propose -> verify -> accept -> commit.

Every speculative method (and ``ar``, whose drafter proposes a root-only tree) runs through
:func:`speculative_decode`. The loop keeps one invariant: the KV cache holds every committed token
except the newest one, which is the root of the next draft tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from triedec.accept import GREEDY, Acceptance, AcceptanceRule
from triedec.adapter import ModelAdapter
from triedec.drafters.base import Drafter, DrafterSession, Verified
from triedec.errors import TriedecError, positive_int
from triedec.kvcache import KVCache
from triedec.tree import TokenTree


@dataclass(frozen=True)
class StopRule:
    """When generation ends: EOS / stop tokens, stop strings, or ``max_new_tokens``.

    ``decode`` turns token ids into text; it is needed only when ``stop_strings`` are given.
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = field(default=None, compare=False)

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
            if tok in self.eos_token_ids:
                return kept, "eos"
            if self.stop_strings and self._stop_string_completed([*generated, *kept]):
                return kept, "stop_string"
            if len(generated) + len(kept) >= self.max_new_tokens:
                return kept, "length"
        return kept, None

    def _stop_string_completed(self, tokens: Sequence[int]) -> bool:
        # A stop string of k characters spans at most k tokens (plus a few for partial bytes).
        window = max(len(s) for s in self.stop_strings) + 8
        text = self.decode(tokens[-window:])  # type: ignore[misc]
        return any(s in text for s in self.stop_strings)


@dataclass
class Stats:
    """Counters every decoding method reports (names match the benchmark's JSON).

    * ``new_tokens``: tokens returned; ``steps``: forward passes after prefill;
    * ``computed_tokens``: tokens that went through the model, prompt excluded;
    * ``seconds``: wall clock from the start of prefill to the last token; ``tokens_per_s``;
    * ``prompt_tokens``, ``prefill_seconds``, ``stop_reason`` (``eos``, ``stop_string``, ``length``);
    * ``peak_kv_tokens``: most KV slots in use; ``kv_bytes``: their size;
    * ``kernels``: what the model ran on (``plain``, or triedec's faster kernels; see the adapter).
    """

    new_tokens: int = 0
    steps: int = 0
    computed_tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    stop_reason: str = ""
    peak_kv_tokens: int = 0
    kv_bytes: int = 0
    kernels: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def summary(self) -> str:
        """One line for people: speed, steps, prompt and why generation stopped."""
        return (f"{self.new_tokens} tokens in {self.seconds:.2f} s = {self.tokens_per_s:.1f} tok/s"
                f" | {self._steps_text()}, {self.computed_tokens} computed"
                f" | prompt {self.prompt_tokens} tokens, prefill {self.prefill_seconds:.2f} s"
                f" | stop: {self.stop_reason}")

    def _steps_text(self) -> str:
        return f"{self.steps} steps"

    def finish(self, start: float, new_tokens: int, cache: KVCache, reason: str, kernels: str) -> None:
        """Fill the common end-of-run fields (time since ``start``, KV use of ``cache``)."""
        self.kernels = kernels
        self.seconds = time.perf_counter() - start
        self.new_tokens = new_tokens
        self.tokens_per_s = new_tokens / self.seconds if self.seconds > 0 else 0.0
        self.stop_reason = reason
        self.peak_kv_tokens = cache.peak
        self.kv_bytes = cache.peak * cache.bytes_per_slot()


@dataclass
class DecodeStats(Stats):
    """:class:`Stats` of the speculative loop, plus:

    * ``mean_accepted``: tokens produced per step (the prefill's first token excluded): 1.0 for
      ``ar``, higher when drafts are accepted (the papers' MAT);
    * ``accepted_per_step``: tokens kept at each step;
    * ``acceptance_by_depth[d-1]``: among steps whose tree reached depth d, the share that
      accepted at least d draft tokens;
    * ``drafter``: the drafter session's own counters (:meth:`DrafterSession.stats`);
    * ``seed``: the sampling seed (None for greedy decoding): the same seed gives the same tokens.
    """

    mean_accepted: float = 0.0
    accepted_per_step: list[int] = field(default_factory=list)
    acceptance_by_depth: list[float] = field(default_factory=list)
    drafter: dict[str, float] = field(default_factory=dict)
    seed: int | None = None

    def _steps_text(self) -> str:
        seed = "" if self.seed is None else f", seed {self.seed}"
        return f"{self.steps} steps, {self.mean_accepted:.2f} tokens/step{seed}"


MAX_TREE_NODES = 256
"""Upper bound on a verified tree's size (root included); larger proposals are truncated."""


def speculative_decode(
    adapter: ModelAdapter,
    drafter: Drafter,
    prompt: Sequence[int],
    stop: StopRule,
    documents: Sequence[Sequence[int]] = (),
    rule: AcceptanceRule = GREEDY,
) -> Generator[list[int], None, DecodeStats]:
    """Decoding of ``prompt`` with drafts from ``drafter``, each step's tokens chosen by ``rule``
    (greedy by default, or sampling: :mod:`triedec.accept`); exactly equal to autoregressive
    decoding with the same rule, whatever the drafts.

    Yields the newly committed tokens after prefill and after every step; returns the stats.
    Per-request drafting state lives in the session ``drafter.begin`` returns; the drafter's
    shared state changes only through that session (under the drafter's own lock).
    """
    prompt = [int(t) for t in prompt]
    session = drafter.begin(prompt, documents)
    try:
        return (yield from _decode(adapter, session, drafter.prefill_logits, prompt, stop, rule))
    finally:
        session.end()


def prefill(adapter: ModelAdapter, cache: KVCache, prompt: Sequence[int], keep_last: int = 1) -> torch.Tensor:
    """Run the prompt on the empty ``cache`` and commit it; the logits of its last ``keep_last``
    positions ``[min(keep_last, len(prompt)), vocab]``."""
    logits = adapter.prefill(cache, torch.tensor(prompt), keep_last=keep_last)
    cache.commit(range(len(prompt)))
    return logits


def _decode(
    adapter: ModelAdapter, session: DrafterSession, prefill_logits: int, prompt: list[int], stop: StopRule,
    rule: AcceptanceRule,
) -> Generator[list[int], None, DecodeStats]:
    start = time.perf_counter()
    cache = adapter.new_cache(len(prompt) + stop.max_new_tokens + MAX_TREE_NODES)

    # Prefill: the prompt's KV, and the first new token from its last logits.
    logits = prefill(adapter, cache, prompt, keep_last=prefill_logits)
    first = rule.accept(TokenTree.root_only(prompt[-1]), logits[-1:], prompt, 0).tokens[0]
    if prefill_logits > 0:  # the prompt's tail, seen as a fully accepted chain
        tail = prompt[-len(logits) :]
        chain = TokenTree(tuple(tail), tuple(range(-1, len(tail) - 1)))
        session.observe(Verified(chain, logits, Acceptance(tuple(range(len(tail))), (*tail[1:], first))))
    generated, reason = stop.cut([], [first])
    adapter.synchronize()
    stats = DecodeStats(prompt_tokens=len(prompt), prefill_seconds=time.perf_counter() - start)
    yield list(generated)
    reached = [0] * (MAX_TREE_NODES + 1)  # reached[d]: steps whose tree had depth >= d
    accepted_at = [0] * (MAX_TREE_NODES + 1)  # accepted_at[d]: steps that accepted >= d drafts

    while reason is None:
        context = prompt + generated
        # propose
        tree = session.propose(context)
        if tree.root != context[-1]:
            raise TriedecError(f"drafter session {type(session).__name__} proposed a tree not rooted at the last token")
        tree = tree.pruned(stop.max_new_tokens - len(generated) - 1).truncated(MAX_TREE_NODES)
        # verify
        logits = adapter.forward(
            cache, torch.tensor(tree.tokens), tree.positions(cache.length)[0], tree.visibility(cache.length)
        )
        # accept
        acceptance = rule.accept(tree, logits, context, len(generated))
        session.observe(Verified(tree, logits, acceptance))
        new, reason = stop.cut(generated, acceptance.tokens)
        # commit: the root and the accepted drafts that precede the newest kept token
        cache.commit(acceptance.path[: len(new)])
        generated += new
        stats.steps += 1
        stats.computed_tokens += tree.size
        stats.accepted_per_step.append(len(new))
        for d in range(1, tree.max_depth + 1):
            reached[d] += 1
        for d in range(1, len(acceptance.path)):
            accepted_at[d] += 1
        yield new

    adapter.synchronize()
    stats.finish(start, len(generated), cache, reason, adapter.kernels)
    stats.mean_accepted = (len(generated) - 1) / stats.steps if stats.steps else 0.0
    stats.acceptance_by_depth = [accepted_at[d] / reached[d] for d in range(1, len(reached)) if reached[d]]
    stats.drafter = session.stats()
    stats.seed = rule.seed
    return stats

