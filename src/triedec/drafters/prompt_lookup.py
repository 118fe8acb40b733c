"""Method ``pld``: prompt lookup decoding, with several matches merged into one trie.

Each step looks for earlier occurrences of the context's suffix n-gram (longest n first, from
``max_ngram`` down to ``min_ngram``) in prompt + output, and proposes the ``num_tokens`` tokens that
followed each occurrence. Up to ``num_matches`` distinct continuations (most recent occurrence
first) are merged into one trie, so a shared prefix is verified once. ``transformers``' own prompt
lookup keeps only the first match of a single n-gram size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from triedec.drafters.base import ModelInfo, Verified, register
from triedec.errors import TriedecError, positive_int
from triedec.tree import TokenTree


@dataclass(frozen=True)
class PromptLookupOptions:
    max_ngram: int = 3
    """longest suffix n-gram to match"""
    min_ngram: int = 1
    """shortest suffix n-gram to fall back to"""
    num_tokens: int = 10
    """tokens proposed per matched continuation"""
    num_matches: int = 2
    """distinct continuations merged into the draft trie"""

    def __post_init__(self) -> None:
        for name in ("max_ngram", "min_ngram", "num_tokens", "num_matches"):
            positive_int(name, getattr(self, name))
        if self.min_ngram > self.max_ngram:
            raise TriedecError(f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")


def find_continuations(context: Sequence[int], options: PromptLookupOptions) -> list[tuple[int, ...]]:
    """Continuations of earlier occurrences of the context's suffix n-grams.

    Longest n first; within one n, most recent occurrence first; each continuation start is used
    once (an n-gram hit implies (n-1)-gram hits with the same continuation).
    """
    ctx = np.asarray(context, dtype=np.int64)
    length = len(ctx)
    found: list[tuple[int, ...]] = []
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
            if cont not in found:
                found.append(cont)
            if len(found) >= options.num_matches:
                return found
    return found


@register("pld", PromptLookupOptions, "prompt lookup: continuations of suffix n-gram matches, merged into a trie")
class PromptLookupDrafter:
    def __init__(self, options: PromptLookupOptions, model: ModelInfo) -> None:
        del model
        self.options = options

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> None:
        """Stateless: the context is searched afresh every step."""

    def propose(self, context: Sequence[int]) -> TokenTree:
        return TokenTree.from_sequences(context[-1], find_continuations(context, self.options))

    def observe(self, verified: Verified) -> None:
        """Nothing to learn."""
