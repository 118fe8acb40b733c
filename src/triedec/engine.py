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

from triedec.accept import Acceptance, accept_greedy
from triedec.adapter import ModelAdapter
from triedec.drafters.base import Drafter, Verified
from triedec.errors import TriedecError, positive_int
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
class DecodeStats:
    """Counters of one generation. Names match the benchmark's JSON.

    * ``steps``: forward passes after prefill;
    * ``mean_accepted``: tokens produced per step (the prefill's first token excluded): 1.0 for
      ``ar``, higher when drafts are accepted;
    * ``computed_tokens``: tokens that went through the model, prompt excluded (tree nodes);
    * ``seconds``: wall clock from the start of prefill to the last token;
    * ``acceptance_by_depth[d-1]``: among steps whose tree reached depth d, the share that
      accepted at least d draft tokens;
    * ``drafter``: the drafter's own counters (:meth:`Drafter.stats`).
    """

    new_tokens: int = 0
    steps: int = 0
    mean_accepted: float = 0.0
    computed_tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    stop_reason: str = ""
    peak_kv_tokens: int = 0
    kv_bytes: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    acceptance_by_depth: list[float] = field(default_factory=list)
    drafter: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


MAX_TREE_NODES = 256
"""Upper bound on a verified tree's size (root included); larger proposals are truncated."""


def speculative_decode(
    adapter: ModelAdapter,
    drafter: Drafter,
    prompt: Sequence[int],
    stop: StopRule,
    documents: Sequence[Sequence[int]] = (),
) -> Generator[list[int], None, DecodeStats]:
    """Greedy decoding of ``prompt`` with drafts from ``drafter``; exactly equal to greedy
    autoregressive decoding.

    Yields the newly committed tokens after prefill and after every step; returns the stats.
    Mutates only the drafter's state (through its protocol methods).
    """
    prompt = [int(t) for t in prompt]
    drafter.begin(prompt, documents)
    try:
        return (yield from _decode(adapter, drafter, prompt, stop))
    finally:
        drafter.end()


def _decode(
    adapter: ModelAdapter, drafter: Drafter, prompt: list[int], stop: StopRule
) -> Generator[list[int], None, DecodeStats]:
    sync = _synchronizer(adapter.device)
    start = time.perf_counter()
    cache = adapter.new_cache(len(prompt) + stop.max_new_tokens + MAX_TREE_NODES)

    # Prefill: the prompt's KV, and the first new token from its last logits.
    logits = adapter.prefill(cache, torch.tensor(prompt), keep_last=drafter.prefill_logits)
    cache.commit(range(len(prompt)))
    first = int(logits[-1].argmax())
    if drafter.prefill_logits > 0:  # the prompt's tail, seen as a fully accepted chain
        tail = prompt[-len(logits) :]
        chain = TokenTree(tuple(tail), tuple(range(-1, len(tail) - 1)))
        drafter.observe(Verified(chain, logits, Acceptance(tuple(range(len(tail))), (*tail[1:], first))))
    generated, reason = stop.cut([], [first])
    sync()
    stats = DecodeStats(prompt_tokens=len(prompt), prefill_seconds=time.perf_counter() - start)
    yield list(generated)
    reached = [0] * (MAX_TREE_NODES + 1)  # reached[d]: steps whose tree had depth >= d
    accepted_at = [0] * (MAX_TREE_NODES + 1)  # accepted_at[d]: steps that accepted >= d drafts

    while reason is None:
        context = prompt + generated
        # propose
        tree = drafter.propose(context)
        if tree.root != context[-1]:
            raise TriedecError(f"drafter {type(drafter).__name__} proposed a tree not rooted at the last token")
        tree = tree.pruned(stop.max_new_tokens - len(generated) - 1).truncated(MAX_TREE_NODES)
        # verify
        logits = adapter.forward(
            cache, torch.tensor(tree.tokens), tree.positions(cache.length)[0], tree.visibility(cache.length)
        )
        # accept
        acceptance = accept_greedy(tree, logits.argmax(dim=-1).tolist())
        drafter.observe(Verified(tree, logits, acceptance))
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

    sync()
    stats.seconds = time.perf_counter() - start
    stats.new_tokens = len(generated)
    stats.mean_accepted = (len(generated) - 1) / stats.steps if stats.steps else 0.0
    stats.tokens_per_s = len(generated) / stats.seconds if stats.seconds > 0 else 0.0
    stats.stop_reason = reason
    stats.peak_kv_tokens = cache.peak
    stats.kv_bytes = cache.peak * cache.bytes_per_slot()
    stats.acceptance_by_depth = [accepted_at[d] / reached[d] for d in range(1, len(reached)) if reached[d]]
    stats.drafter = drafter.stats()
    return stats


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None

