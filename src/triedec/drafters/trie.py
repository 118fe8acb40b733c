"""The n-gram trie with frequencies (Chen, Li et al., 3.1), built incrementally: ngram-trie drafts
from one, and auto's context source is one.

A window of ``n`` tokens slides over the context; each window is split into a prefix ``P`` (its
first ``Lp`` = ``prefix`` tokens) and a suffix ``S``; the keys ``P[j:] + S`` for j = 0 .. Lp-1 are
inserted, adding 1 to the frequency of every node on the key's path. Every key is a substring of
the context starting at some position s, and the node at depth d of the path from s gains
``min(Lp - 1, s, n - d) + 1``: :class:`NgramTrie` inserts that way, token by token, each new
token extending the (at most n) open paths by one node, so building costs O(n) dict operations
per token and adding generated tokens later continues the same paths.

Pure Python, with numpy to build an empty trie's documents at once (:meth:`NgramTrie.build`); one
request's trie is used by that request only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

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
        else starting a new document. Returns the stream to continue later. A session's first
        documents go in at once (:meth:`build`); this loop continues them token by token."""
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

    def build(self, documents: Sequence[Sequence[int]]) -> TrieStream:
        """Insert ``documents`` in order into this empty trie, as :meth:`add` would one after the
        other, vectorized: every key (a window's substring from each start, up to ``n`` tokens,
        within its document) is a row of a table sorted lexicographically, so the keys sharing a
        prefix of length d are adjacent and each such run is one node at depth d. A node's
        frequency sums its rows' gains; node ids follow :meth:`add`'s creation order (by the end
        of the node's first occurrence, then deeper first, as the open paths are extended oldest
        start first), so ties in :meth:`top` fall the same way. Returns the last document's
        stream (an empty one for no tokens). ~10x faster than :meth:`add` on a long prompt."""
        if self.size:
            raise TriedecError("build fills an empty trie; add continues a filled one")
        docs = [np.asarray([int(t) for t in d], dtype=np.int64) for d in documents]
        sizes = [d.size for d in docs]
        n, lp = self.n, self.prefix
        total = sum(sizes)
        if total == 0:
            return TrieStream()
        flat = np.concatenate(docs)
        starts = np.repeat(np.cumsum([0, *sizes[:-1]]), sizes)
        ends = starts + np.repeat(sizes, sizes)
        local = np.arange(total) - starts  # each row's start within its document
        lengths = np.minimum(n, ends - np.arange(total))  # each key's length
        sentinel = int(flat.min()) - 1
        table = np.full((total, n), sentinel, dtype=np.int64)
        for j in range(n):
            at = np.arange(total) + j
            inside = at < ends
            table[inside, j] = flat[at[inside]]
        order = np.lexsort(table.T[::-1])  # rows by their keys, first column first
        rows = table[order]
        same = rows[1:] == rows[:-1]
        lcp = np.concatenate([[0], np.where(same.all(axis=1), n, same.argmin(axis=1))])
        lcp[0] = -1  # the first row starts every run
        first_at, length_of, local_of = order, lengths[order], local[order]
        row_node = np.full((n + 1, total), -1, dtype=np.int64)  # depth -> sorted row -> candidate
        cand_depth, cand_end, cand_token, cand_parent, cand_freq = [], [], [], [], []
        count = 0
        for d in range(1, n + 1):
            valid = np.flatnonzero(length_of >= d)
            if not valid.size:
                break
            fresh = lcp[valid] < d
            fresh[0] = True
            heads = np.flatnonzero(fresh)
            row_node[d, valid] = count + np.cumsum(fresh) - 1
            gains = np.minimum(np.minimum(lp - 1, local_of[valid]), n - d) + 1
            cand_freq.append(np.add.reduceat(gains, heads))
            cand_end.append(np.minimum.reduceat(first_at[valid], heads) + d - 1)
            cand_token.append(rows[valid[heads], d - 1])
            cand_parent.append(row_node[d - 1, valid[heads]] if d > 1 else np.full(heads.size, -1))
            cand_depth.append(np.full(heads.size, d))
            count += heads.size
        depth, end = np.concatenate(cand_depth), np.concatenate(cand_end)
        rank = np.lexsort((-depth, end))  # created at the end of the first occurrence, deeper first
        ids = np.empty(count, dtype=np.int64)
        ids[rank] = np.arange(1, count + 1)
        parent = np.concatenate(cand_parent)
        parent_ids = np.where(parent < 0, 0, ids[np.maximum(parent, 0)])[rank].tolist()
        tokens = np.concatenate(cand_token)[rank].tolist()
        self.freq.extend(np.concatenate(cand_freq)[rank].tolist())
        self.parent.extend(parent_ids)
        self.token.extend(tokens)
        children = self.children
        children.extend({} for _ in range(count))
        for node, (up, t) in enumerate(zip(parent_ids, tokens, strict=True), start=1):
            children[up][t] = node
        # the last document's open paths: starts whose key is still shorter than n, oldest first
        last = sizes[-1]
        where = np.empty(total, dtype=np.int64)
        where[order] = np.arange(total)
        first_open = total - last + max(0, last - n + 1)
        open_paths = [(int(local[g]), int(ids[row_node[total - g, where[g]]])) for g in range(first_open, total)]
        return TrieStream(last, open_paths)

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
