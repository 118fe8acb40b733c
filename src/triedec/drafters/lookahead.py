"""Method ``lookahead``: lookahead decoding (Fu et al. 2024, "LADE") with LADE's independent or
the seed paper's trie-merged verification.

Everything runs in one forward over one :class:`~triedec.core.tree.TokenTree` rooted at the last token:

* **Lookahead branch** (Jacobi iterations over a window of W future positions, N-gram size N).
  The 2D window holds N-1 levels of W guesses; level j, column c guesses position +c+j (c = 1..W).
  Level 0 is a chain from the root (column c at depth c); under level-0 column c hangs the chain of
  its higher levels (level j at depth c + j). So each column's trajectory sees the root, the level-0
  guesses before it and its own lower levels, at position = depth: the lookahead mask of LADE
  (and of llama.cpp's implementation) is a tree. After the forward, the model's argmax at the top of
  each column is its next Jacobi guess; every column yields the N-gram (level 0 .. level N-2, new
  guess), which goes into the **n-gram pool** (keyed by first token, at most G per key, most recent
  kept); the levels shift down and the new guesses become the top level.
* **Verification branch**: the pool's n-grams that start with the root token (their N-1 following
  tokens), either ``independent`` (LADE: each its own branch, shared prefixes computed again) or
  ``trie`` (the seed paper: merged into a prefix trie, each unique node computed once, at most
  ``budget`` nodes and ``depth`` levels).

Acceptance is the engine's greedy walk over the whole tree, so any node (a verified n-gram, or a
lookahead guess that happens to be right) whose token is the model's argmax is accepted: the output
is exactly greedy decoding's. Computed tokens per step = the tree's size (root + lookahead branch +
verification branch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from triedec.core.errors import TriedecError, positive_int
from triedec.core.rowops import argmax
from triedec.core.settings import at_most
from triedec.core.tree import TokenTree
from triedec.drafters.base import MAX_TREE_NODES, BaseDrafter, BaseSession, Draft, ModelInfo, Verified
from triedec.drafters.registry import register

VERIFY_MODES = ("independent", "trie")


@dataclass(frozen=True)
class LookaheadOptions:
    window: int = field(default=2, metadata=at_most(64))
    """W: future positions guessed by the Jacobi window"""
    ngram: int = field(default=3, metadata=at_most(32))
    """N: n-gram size (levels in the window = N - 1)"""
    guesses: int = field(default=4, metadata=at_most(64))
    """G: n-grams kept per first token in the pool, and verified per step"""
    verify: str = "trie"
    """"trie" (merged prefix trie) or "independent" (LADE: each candidate its own branch)"""
    budget: int = field(default=16, metadata=at_most(MAX_TREE_NODES))
    """trie mode: most verification nodes per step (B)"""
    depth: int = field(default=0, metadata=at_most(31))
    """trie mode: deepest verified level (D); 0 = N - 1"""
    window_seed: int = 0
    """seed of the window's initial guesses (drawn from the prompt); not the sampling seed"""

    CLI_ALIASES: ClassVar[dict[str, str]] = {"verify": "--verify"}
    """short command-line flags besides ``--lookahead-OPTION``"""

    def __post_init__(self) -> None:
        for name in ("window", "ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise TriedecError(f"{name} must be an integer >= 2, got {value!r}")
        positive_int("guesses", self.guesses)
        positive_int("budget", self.budget)
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 0:
            raise TriedecError(f"depth must be an integer >= 0 (0 = ngram - 1), got {self.depth!r}")
        if self.verify not in VERIFY_MODES:
            raise TriedecError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if isinstance(self.window_seed, bool) or not isinstance(self.window_seed, int):
            raise TriedecError(f"window_seed must be an integer, got {self.window_seed!r}")
        nodes = 1 + self.window * (self.ngram - 1) + self.budget
        if nodes > MAX_TREE_NODES:
            raise TriedecError(f"lookahead verifies 1 + window x (ngram - 1) + budget = {nodes} nodes per step, more "
                               f"than the {MAX_TREE_NODES} one step may carry; make window, ngram or budget smaller")


class NgramPool:
    """N-grams keyed by their first token: ``pool[t]`` holds at most ``per_key`` continuations
    (the N-1 tokens after t), oldest first; re-adding one makes it the most recent."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        key, rest = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        entries = self.table.setdefault(key, [])
        if rest in entries:
            entries.remove(rest)
        entries.append(rest)
        if len(entries) > self.per_key:
            del entries[0]

    def candidates(self, token: int) -> list[tuple[int, ...]]:
        """The continuations of ``token``, most recent first."""
        return list(reversed(self.table.get(int(token), [])))

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())


def verification_branch(
    candidates: Sequence[Sequence[int]], mode: str, budget: int, depth: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The verification branch as (tokens, parents) under a root at index 0 (parents index into
    ``[root, *tokens]``). ``independent``: each candidate its own chain; ``trie``: merged into a
    prefix trie, cut to ``depth`` levels and ``budget`` nodes."""
    if mode == "independent":
        tokens: list[int] = []
        parents: list[int] = []
        for cand in candidates:
            parent = 0
            for t in cand:
                tokens.append(int(t))
                parents.append(parent)
                parent = len(tokens)
        return tuple(tokens), tuple(parents)
    tree = TokenTree.from_sequences(0, candidates).pruned(depth).truncated(budget + 1)
    return tree.tokens[1:], tree.parents[1:]


@register("lookahead", LookaheadOptions, "lookahead decoding: Jacobi n-grams from a lookahead branch, verified "
          "in the same forward (verify=independent as LADE, or trie-merged)")
class LookaheadDrafter(BaseDrafter):
    """No shared state: the window and the n-gram pool belong to one request (the session)."""

    def __init__(self, options: LookaheadOptions, model: ModelInfo) -> None:
        self.options = options
        self.vocab_size = model.vocab_size

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> LookaheadSession:
        return LookaheadSession(self.options, prompt)


class LookaheadSession(BaseSession):
    """One request's Jacobi window (``window[level][column]``, level 0 = oldest) and n-gram pool."""

    def __init__(self, options: LookaheadOptions, prompt: Sequence[int]) -> None:
        self.options = options
        self.levels = options.ngram - 1
        self.depth = options.depth or self.levels
        rng = np.random.default_rng(options.window_seed)
        source = np.asarray(prompt, dtype=np.int64)
        picks = rng.integers(0, len(source), size=(self.levels, options.window))
        self.window: list[list[int]] = source[picks].tolist()
        self.pool = NgramPool(options.guesses)
        self._tops: list[int] = []  # tree index of each column's top-level node in the last proposal
        self._proposed: TokenTree | None = None
        self.lookahead_tokens = self.verify_tokens = self.steps = 0

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        """The whole structure, verified whole (it has no scores); a tree the engine cuts (near
        ``max_new_tokens``) teaches nothing."""
        o = self.options
        tokens, parents = [int(context[-1])], [-1]
        level0 = []
        for c in range(o.window):  # level 0: a chain from the root
            tokens.append(self.window[0][c])
            parents.append(len(tokens) - 2 if c else 0)
            level0.append(len(tokens) - 1)
        self._tops = []
        for c in range(o.window):  # levels 1..N-2 of column c, chained under its level-0 node
            node = level0[c]
            for j in range(1, self.levels):
                tokens.append(self.window[j][c])
                parents.append(node)
                node = len(tokens) - 1
            self._tops.append(node)
        lookahead = len(tokens) - 1
        v_tokens, v_parents = verification_branch(self.pool.candidates(context[-1]), o.verify, o.budget, self.depth)
        offset = len(tokens) - 1  # verification node i (1-based under its root) -> tree index offset + i
        tokens += v_tokens
        parents += [0 if p == 0 else offset + p for p in v_parents]
        self.lookahead_tokens += lookahead
        self.verify_tokens += len(v_tokens)
        self.steps += 1
        self._proposed = TokenTree(tuple(tokens), tuple(parents))
        return Draft.fixed(self._proposed).labelled("lookahead")

    def observe(self, verified: Verified) -> None:
        if self._proposed is None or verified.cut or verified.tree != self._proposed:
            return
        best = argmax(verified.logits)
        new = [best[i] for i in self._tops]
        for c in range(self.options.window):
            self.pool.add([*(self.window[j][c] for j in range(self.levels)), new[c]])
        self.window = [*self.window[1:], new]
        self._proposed = None

    def stats(self) -> dict[str, float]:
        """Tokens fed for the lookahead branch and for the verification branch as proposed (with
        one root per step, the engine's ``computed_tokens``, unless the engine cut a tree to fit
        ``max_new_tokens``), per step, and the pool's size."""
        steps = max(self.steps, 1)
        return {"pool_ngrams": float(len(self.pool)), "lookahead_tokens": float(self.lookahead_tokens),
                "verify_tokens": float(self.verify_tokens), "lookahead_tokens_per_step": self.lookahead_tokens / steps,
                "verify_tokens_per_step": self.verify_tokens / steps}
