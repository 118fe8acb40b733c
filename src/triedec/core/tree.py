"""The draft tree: one value (tokens + parent indices) from which everything else is derived.

Node 0 is the root: the last committed token, whose KV is *not* yet in the cache. Every other node
is a draft token whose parent has a smaller index (topological order). From this value we derive

* ``depths``       -- depth of each node (root = 0),
* ``ancestry``     -- ``[T, T]``: which nodes lie on each node's root path (its path to the root):
                      what each node may attend to among the tree's nodes, besides the whole cache
                      (the adapter turns it into the 4D attention mask),
* ``positions``    -- position ids ``[1, T]`` = cache length + depth,
* ``children`` / ``child_lists`` -- each node's children, which acceptance walks.

The tree is immutable; "changing" it returns a new tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from triedec.core.errors import TriedecError


@dataclass(frozen=True)
class TokenTree:
    """A token trie rooted at the last committed token.

    ``tokens[i]`` is node i's token id; ``parents[i]`` is its parent's index (``-1`` for the root,
    which is node 0). Validated on construction: parents precede children, so any prefix of the
    node list is itself a valid tree.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        tokens, parents = tuple(int(t) for t in self.tokens), tuple(int(p) for p in self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if not tokens:
            raise TriedecError("a token tree needs at least its root")
        if len(tokens) != len(parents):
            raise TriedecError(f"tree has {len(tokens)} tokens but {len(parents)} parents")
        if parents[0] != -1:
            raise TriedecError("node 0 must be the root (parent -1)")
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise TriedecError(f"node {i} has parent {p}: parents must precede their children")
        if any(t < 0 for t in tokens):
            raise TriedecError("token ids must be non-negative")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def root_only(cls, root: int) -> TokenTree:
        """The tree with no drafts: verifying it is one autoregressive step."""
        return cls((root,), (-1,))

    @classmethod
    def from_sequences(
        cls, root: int, sequences: Iterable[Sequence[int]], max_nodes: int | None = None
    ) -> TokenTree:
        """Merge draft sequences (each a continuation of ``root``) into one trie.

        Shared prefixes become shared nodes, so no prefix is ever duplicated. Sequences are taken in
        order; once ``max_nodes`` nodes (root included) exist, remaining tokens are dropped.
        """
        tokens, parents = [root], [-1]
        child: dict[tuple[int, int], int] = {}
        for seq in sequences:
            node = 0
            for tok in seq:
                key = (node, int(tok))
                nxt = child.get(key)
                if nxt is None:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    nxt = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                    child[key] = nxt
                node = nxt
        return cls(tuple(tokens), tuple(parents))

    def truncated(self, max_nodes: int) -> TokenTree:
        """The first ``max_nodes`` nodes (a valid tree because parents precede children)."""
        if max_nodes >= self.size:
            return self
        return TokenTree(self.tokens[:max_nodes], self.parents[:max_nodes])

    def pruned(self, max_depth: int) -> TokenTree:
        """Drop every node deeper than ``max_depth`` (its descendants go too)."""
        if self.max_depth <= max_depth:
            return self
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        new_index = {old: new for new, old in enumerate(keep)}
        parents = tuple(-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in keep)
        return TokenTree(tuple(self.tokens[i] for i in keep), parents)

    # ---- derived structure --------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of nodes, root included (= tokens fed to the model to verify this tree)."""
        return len(self.tokens)

    @property
    def root(self) -> int:
        return self.tokens[0]

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0] * self.size
        for i in range(1, self.size):
            depths[i] = depths[self.parents[i]] + 1
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[dict[int, int], ...]:
        """``children[i]`` maps a child's token to the child's index (the last one if siblings
        repeat a token; :attr:`child_lists` has them all)."""
        out: list[dict[int, int]] = [{} for _ in range(self.size)]
        for i in range(1, self.size):
            out[self.parents[i]][self.tokens[i]] = i
        return tuple(out)

    @cached_property
    def child_lists(self) -> tuple[tuple[int, ...], ...]:
        """``child_lists[i]``: the indices of i's children, in order (repeated tokens included)."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            out[self.parents[i]].append(i)
        return tuple(tuple(c) for c in out)

    @cached_property
    def ancestry(self) -> torch.Tensor:
        """Bool ``[T, T]``: ``ancestry[i, j]`` iff j is i or one of i's ancestors.

        Each row is its parent's row plus one bit (one pass, parents precede children).
        """
        anc = np.zeros((self.size, self.size), dtype=np.bool_)  # numpy's row copies: ~0.3 us, torch's ~2
        anc[0, 0] = True
        for i in range(1, self.size):
            anc[i] = anc[self.parents[i]]
            anc[i, i] = True
        return torch.from_numpy(anc)

    # ---- model inputs -------------------------------------------------------------------------

    def positions(self, cache_len: int) -> torch.Tensor:
        """Position ids ``[1, T]``: cache length + depth."""
        return torch.from_numpy(np.add(self.depths, cache_len, dtype=np.int64)[None])

    def __repr__(self) -> str:
        return f"TokenTree(size={self.size}, depth={self.max_depth}, tokens={self.tokens[:8]}...)"
