"""Method ``pld``: prompt lookup decoding, with several matches merged into one trie.

Each step looks for earlier occurrences of the context's suffix n-gram (longest n first, from
``max_ngram`` down to ``min_ngram``) in prompt + output, and proposes the ``num_tokens`` tokens that
followed each occurrence. Up to ``num_matches`` distinct continuations (most recent occurrence
first) are merged into one trie, so a shared prefix is verified once. ``transformers``' own prompt
lookup keeps only the first match of a single n-gram size.

Drafting is not free: on a CPU, verifying even 2-4 tokens costs about twice a 1-token step, so a
draft that is rarely accepted slows decoding down. The drafter therefore keeps, per matched n-gram
length, a running mean (EMA) of how many draft tokens were accepted, and drafts only when that mean
is at least ``min_expected``. By default (``None``) that is the device's break-even for the tree it
would send, from the measured cost curve: ``cost(tree) / cost(1 token) - 1`` (about 1 on the 2-core
CPU measured here, about 0 on a GPU); 0 = always draft. A length that is skipped drifts back toward
the optimistic prior, so it is probed again later. The estimates are shared learned state: they
live as long as the drafter (one per loaded model and option set), updated under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from triedec.drafters.base import NEEDS_COST, BaseSession, ModelInfo, Verified, register
from triedec.errors import TriedecError, positive_int
from triedec.tree import TokenTree


@dataclass(frozen=True)
class PromptLookupOptions:
    max_ngram: int = 3
    """longest suffix n-gram to match"""
    min_ngram: int = 2
    """shortest suffix n-gram to fall back to"""
    num_tokens: int = 10
    """tokens proposed per matched continuation"""
    num_matches: int = 2
    """distinct continuations merged into the draft trie"""
    min_expected: float | None = None
    """draft only if the running mean of accepted draft tokens for the matched n-gram length is at least
    this; None (auto) = the device's break-even for the tree, from the measured cost curve"""

    def __post_init__(self) -> None:
        for name in ("max_ngram", "min_ngram", "num_tokens", "num_matches"):
            positive_int(name, getattr(self, name))
        if self.min_ngram > self.max_ngram:
            raise TriedecError(f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")
        value = self.min_expected
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not 0 <= value < float("inf")):
            raise TriedecError(f"min_expected must be a finite number >= 0 or None (auto), got {value!r}")


def find_matches(context: Sequence[int], options: PromptLookupOptions) -> list[tuple[int, tuple[int, ...]]]:
    """Continuations of earlier occurrences of the context's suffix n-grams, each paired with its
    matched n-gram length.

    Longest n first; within one n, most recent occurrence first; each continuation start is used
    once (an n-gram hit implies (n-1)-gram hits with the same continuation).
    """
    ctx = np.asarray(context, dtype=np.int64)
    length = len(ctx)
    found: list[tuple[int, tuple[int, ...]]] = []
    seen: set[tuple[int, ...]] = set()
    used_starts: set[int] = set()
    for n in range(min(options.max_ngram, length - 1), options.min_ngram - 1, -1):
        # windows[i] = ctx[i : i + n] for starts whose continuation begins inside the context
        windows = sliding_window_view(ctx[: length - 1], n)
        hits = np.flatnonzero((windows == ctx[length - n :]).all(axis=1))
        for start in hits[::-1] + n:
            if start in used_starts:
                continue
            used_starts.add(int(start))
            cont = tuple(ctx[start : start + options.num_tokens].tolist())
            if cont not in seen:
                seen.add(cont)
                found.append((n, cont))
            if len(found) >= options.num_matches:
                return found
    return found


def _needs(options: PromptLookupOptions) -> frozenset[str]:
    return frozenset({NEEDS_COST}) if options.min_expected is None else frozenset()


@register("pld", PromptLookupOptions, "prompt lookup: continuations of suffix n-gram matches, merged into a trie",
          needs=_needs)
class PromptLookupDrafter:
    """Shared across requests: ``expected``, the running mean of accepted draft tokens per matched
    n-gram length (updated under ``lock``). Per request: which length the last proposal drafted."""

    PRIOR = 2.0
    """optimistic initial estimate of accepted draft tokens, for every n-gram length"""
    ALPHA = 0.2
    """EMA weight of a new observation"""
    RELAX = 0.01
    """how far a skipped length's estimate moves back toward the prior: a length whose drafts keep
    failing is probed again about once every 15-20 opportunities"""

    prefill_logits = 0

    def __init__(self, options: PromptLookupOptions, model: ModelInfo) -> None:
        self.options = options
        self.cost = model.cost
        self.expected: dict[int, float] = {}  # n-gram length -> running mean of accepted draft tokens
        self.lock = threading.Lock()

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> _PromptLookupSession:
        """The context is searched afresh every step; documents are not used."""
        return _PromptLookupSession(self)

    def threshold(self, tree: TokenTree) -> float:
        """Accepted draft tokens a proposal of ``tree`` must expect to be worth verifying."""
        if self.options.min_expected is not None:
            return float(self.options.min_expected)
        return self.cost.break_even(tree.size) if self.cost is not None else 0.0

    def estimate(self, n: int) -> float:
        return self.expected.get(n, self.PRIOR)

    def relax(self, n: int) -> None:
        """A skipped length drifts back toward the prior."""
        with self.lock:
            estimate = self.estimate(n)
            self.expected[n] = estimate + self.RELAX * (self.PRIOR - estimate)

    def learn(self, n: int, accepted: int) -> None:
        with self.lock:
            estimate = self.estimate(n)
            self.expected[n] = estimate + self.ALPHA * (accepted - estimate)

    def stats(self) -> dict[str, float]:
        """The running mean of accepted draft tokens per matched n-gram length."""
        with self.lock:
            return {f"expected_accepted_n{n}": v for n, v in sorted(self.expected.items())}


class _PromptLookupSession(BaseSession):
    def __init__(self, drafter: PromptLookupDrafter) -> None:
        self.drafter = drafter
        self.drafted_n: int | None = None

    def propose(self, context: Sequence[int]) -> TokenTree:
        drafter = self.drafter
        self.drafted_n = None
        matches = find_matches(context, drafter.options)
        if not matches:
            return TokenTree.root_only(context[-1])
        n = matches[0][0]
        tree = TokenTree.from_sequences(context[-1], [cont for _, cont in matches])
        if drafter.estimate(n) < drafter.threshold(tree):
            drafter.relax(n)
            return TokenTree.root_only(context[-1])
        self.drafted_n = n
        return tree

    def observe(self, verified: Verified) -> None:
        if self.drafted_n is not None:
            self.drafter.learn(self.drafted_n, len(verified.acceptance.path) - 1)

    def stats(self) -> dict[str, float]:
        return self.drafter.stats()
