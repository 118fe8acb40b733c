"""The n-gram trie with frequencies (Chen, Li et al., 3.1), built incrementally: ngram-trie drafts
from one, and auto's context source is one.

A window of ``n`` tokens slides over the context; each window is split into a prefix ``P`` (its
first ``Lp`` = ``prefix`` tokens) and a suffix ``S``; the keys ``P[j:] + S`` for j = 0 .. Lp-1 are
inserted, adding 1 to the frequency of every node on the key's path. Every key is a substring of
the context starting at some position s, and the node at depth d of the path from s gains
``min(Lp - 1, s, n - d) + 1``: :class:`NgramTrie` inserts that way, token by token, each new
token extending the (at most n) open paths by one node, so building costs O(n) dict operations
per token and adding generated tokens later continues the same paths.

Pure Python; one request's trie is used by that request only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from triedec.core.errors import TriedecError


@dataclass
class TrieStream:
    """Where insertion of one token sequence stands: its length so far and the open paths
    ``(start position, node)`` of the keys that can still grow."""

    length: int = 0
    open: list[tuple[int, int]] = field(default_factory=list)


class NgramTrie:
    """The paper's n-gram trie with frequencies. Node 0 is the root; ``children[v]`` maps a token
    to a child, ``freq[v]`` is the number of inserted keys passing through v, ``parent[v]`` and
    ``token[v]`` describe the node. Mutated only by :meth:`add`."""

    def __init__(self, n: int, prefix: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise TriedecError(f"n (window length) must be an integer >= 2, got {n!r}")
        if isinstance(prefix, bool) or not isinstance(prefix, int) or not 1 <= prefix < n:
            raise TriedecError(f"prefix (Lp) must be an integer in [1, n), got {prefix!r} with n={n}")
        self.n, self.prefix = n, prefix
        self.children: list[dict[int, int]] = [{}]
        self.freq: list[int] = [0]
        self.parent: list[int] = [-1]
        self.token: list[int] = [-1]

    @property
    def size(self) -> int:
        """Nodes, root excluded."""
        return len(self.freq) - 1

    def add(self, tokens: Sequence[int], stream: TrieStream | None = None) -> TrieStream:
        """Insert the windows of ``tokens``, continuing ``stream`` (the same document) if given,
        else starting a new document. Returns the stream to continue later."""
        st = stream if stream is not None else TrieStream()
        n, lp = self.n, self.prefix
        for t in tokens:
            t = int(t)
            st.open.append((st.length, 0))
            still = []
            for start, node in st.open:
                depth = st.length - start + 1
                child = self.children[node].get(t)
                if child is None:
                    child = len(self.freq)
                    self.children[node][t] = child
                    self.children.append({})
                    self.freq.append(0)
                    self.parent.append(node)
                    self.token.append(t)
                self.freq[child] += min(lp - 1, start, n - depth) + 1
                if depth < n:
                    still.append((start, child))
            st.open = still
            st.length += 1
        return st

    def node(self, path: Sequence[int]) -> int | None:
        """The node reached from the root by ``path``, or None."""
        node = 0
        for t in path:
            node = self.children[node].get(int(t))
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """``(node, length)`` of the longest suffix of ``context`` (at most ``prefix`` tokens)
        that is a trie path with continuations; ``(0, 0)`` if none."""
        for m in range(min(self.prefix, len(context)), 0, -1):
            node = self.node(context[-m:])
            if node is not None and self.children[node]:
                return node, m
        return 0, 0

    def top(self, node: int, k: int) -> list[int]:
        """The ``k`` most frequent nodes of ``node``'s subtree (``node`` excluded), best-first
        (highest frequency first, ties to the older node). A child's frequency never exceeds its
        parent's, so this is the top k of the subtree, parents listed before their children."""
        out: list[int] = []
        frontier = [(-self.freq[c], c) for c in self.children[node].values()]
        heapq.heapify(frontier)
        while frontier and len(out) < k:
            _, v = heapq.heappop(frontier)
            out.append(v)
            for c in self.children[v].values():
                heapq.heappush(frontier, (-self.freq[c], c))
        return out
