"""The KV of earlier requests kept across requests: a radix trie over token ids whose nodes hold
the K/V rows of their tokens (SGLang's RadixAttention; llama-server's prompt cache).

A token's K/V are a function of the model, the precision mode and the token's prefix alone,
whatever chunk, tree or batch computed them (triedec's kernels compute a row alone: the
load-time self-test that sets ``exactness == "bit-exact"``), so K/V copied from here are the
bits a prefill would compute, and so is everything computed on top of them: a hit is
bit-identical to a miss (``tests/test_prefix_trie.py``).

* :meth:`PrefixTrie.insert` keeps a finished (or cancelled) request's committed rows, prompt and
  generated tokens, under its scope: the part of its sequence the trie already holds is shared
  (a conversation's next turn adds only its new tokens), the rest is copied out of the request's
  cache into a new node, splitting a node where the sequence leaves it.
* :meth:`PrefixTrie.restore` copies the longest cached prefix of a new request's prompt (at most
  ``most`` tokens: the rows whose logits the request needs are computed) into its empty cache.
* Scores too: a request that scores its prompt (``echo`` with ``logprobs``, ``prompt_logprobs``:
  what lm-evaluation-harness sends for each answer choice) needs every prompt token's score, and a
  token's score is a function of its prefix as its K/V are; so such a request leaves its scores
  beside its rows, and a later one that scores the same way (alternatives, ranks, the raw
  distribution) takes both for the prefix they share, less one token (the row before its own
  first token must be computed to score that token): a question's context is computed once for
  all its choices.
* Copy, not paging: the native forward attends over each request's contiguous cache, and a
  1,000-token prefix of the default model (23 KB a token) took 2.6 ms to restore and 3.8 ms to
  keep, against ~1 s to compute it (docs/serving.md). So no node is ever in use by a running request (nothing to pin),
  and eviction never touches a running request's KV. The price is memory: N conversations over
  one system prompt each hold their own copy while they run (the trie holds one).
* Memory: at most ``capacity_bytes`` of rows in all scopes; the least recently used leaves are
  evicted first (before a new node is made, so the trie never passes its cap). A sequence larger
  than the cap is not kept.
* Scopes: each scope (a tenant, with a client's ``cache_salt``) is a trie of its own; a lookup
  never sees another scope's rows.
* Thread-safe: every call under one lock (the engine thread inserts and restores; ``/metrics`` and
  ``/health`` read the counters).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from triedec.core.kvcache import KVCache

SCORE_BYTES = 128
"""What a kept score costs in memory, about, besides 16 bytes an alternative (a token's logprob, its
alternatives, its rank: Python objects)."""


def _score_bytes(scores: Sequence[Any] | None) -> int:
    if not scores:
        return 0
    return sum(SCORE_BYTES + 16 * len(getattr(s, "top", ()) or ()) for s in scores if s is not None)


class _Node:
    """An edge of the trie: its ``tokens`` and their rows, ``keys`` and ``values`` (one tensor per
    layer, ``[kv_heads, n, head_dim]``) and ``positions`` (``[n]``); and, where a request that
    scored its prompt left them, each token's score (``scores``, None where unknown) of ``spec``."""

    __slots__ = ("bytes", "children", "keys", "parent", "positions", "scores", "spec", "tokens", "used", "values")

    def __init__(self, tokens: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor],
                 positions: torch.Tensor, parent: _Node | None, used: int, scores: list[Any] | None = None,
                 spec: Hashable = None) -> None:
        self.tokens, self.keys, self.values, self.positions = tokens, keys, values, positions
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.used = used
        self.scores, self.spec = scores, spec
        self.bytes = sum(t.numel() * t.element_size() for t in (*keys, *values)) + _score_bytes(scores)

    def split(self, at: int, used: int) -> _Node:
        """Cut this edge after its first ``at`` tokens: this node keeps them, a new child the rest
        (with this node's children). Returns the child."""
        child = _Node(self.tokens[at:], [k[:, at:].clone() for k in self.keys],
                      [v[:, at:].clone() for v in self.values], self.positions[at:].clone(), self, self.used,
                      None if self.scores is None else self.scores[at:], self.spec)
        child.children = self.children
        for grandchild in child.children.values():
            grandchild.parent = child
        self.tokens = self.tokens[:at]
        self.keys = [k[:, :at].clone() for k in self.keys]
        self.values = [v[:, :at].clone() for v in self.values]
        self.positions = self.positions[:at].clone()
        self.scores = None if self.scores is None else self.scores[:at]
        self.children = {child.tokens[0]: child}
        self.bytes -= child.bytes
        self.used = used
        return child


@dataclass(frozen=True)
class PrefixStats:
    """What the trie did: ``lookups`` and ``hits`` (a lookup that found at least one token),
    ``cached_tokens`` (prompt tokens served from it in all), ``inserted_tokens``, ``evictions``
    (nodes dropped for room), ``bytes`` and ``tokens`` held now, ``capacity_bytes``."""

    lookups: int
    hits: int
    cached_tokens: int
    inserted_tokens: int
    evictions: int
    bytes: int
    tokens: int
    capacity_bytes: int


class PrefixTrie:
    """The trie of every scope, under one memory cap (module doc)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._roots: dict[Hashable, _Node] = {}
        self._lock = threading.Lock()
        self._clock = itertools.count(1)
        self._bytes = 0
        self._tokens = 0
        self._lookups = self._hits = self._cached = self._inserted = self._evictions = 0

    # ---- lookups ------------------------------------------------------------------------------

    def _walk(self, root: _Node, tokens: Sequence[int]) -> list[tuple[_Node, int]]:
        """The nodes ``tokens`` runs through from ``root``, each with how many of its tokens match."""
        path: list[tuple[_Node, int]] = []
        node, at = root, 0
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                break
            n = 0
            edge = child.tokens
            while n < len(edge) and at + n < len(tokens) and edge[n] == tokens[at + n]:
                n += 1
            path.append((child, n))
            at += n
            if n < len(edge):
                break
            node = child
        return path

    def restore(self, scope: Hashable, tokens: Sequence[int], most: int, cache: KVCache,
                spec: Hashable = None) -> tuple[int, list[Any]]:
        """Copy the rows of the longest cached prefix of ``tokens`` in ``scope``, at most ``most``
        tokens, into the empty ``cache`` (allocating its buffers as the rows' shapes say); returns
        how many tokens it holds now (0: a miss, the cache untouched) and, with ``spec`` (a request
        that scores its prompt so), the scores of tokens 1 .. that many: then the prefix stops where
        the trie has no score of ``spec``, and one token short of where ``tokens`` leave the cached
        sequence (the row before a token of its own must be computed to score it)."""
        with self._lock:
            self._lookups += 1
            root = self._roots.get(scope)
            if root is None or most <= 0 or cache.length or cache.pending:
                return 0, []
            path = self._walk(root, tokens)
            matched = sum(n for _, n in path)
            length = min(most, matched if spec is None else matched - 1, cache.capacity)
            scores: list[Any] = []
            if spec is not None and length > 0:  # the scores of tokens 1 .. length, while the trie has them
                at = 0
                for node, n in path:
                    for i in range(n):
                        if 1 <= at <= length:
                            score = node.scores[i] if node.scores is not None and node.spec == spec else None
                            if score is None:
                                length = at - 1
                                break
                            scores.append(score)
                        at += 1
                    if len(scores) >= length:
                        break
                scores = scores[:length]
            if length <= 0:
                return 0, []
            now = next(self._clock)
            first = path[0][0]
            layers = len(first.keys)
            while len(cache.keys) < layers:  # the buffers, as a forward would allocate them
                for bufs, rows in ((cache.keys, first.keys), (cache.values, first.values)):
                    shape = rows[len(bufs)].shape
                    bufs.append(torch.empty((1, shape[0], cache.capacity, shape[2]), dtype=rows[len(bufs)].dtype,
                                            device=rows[len(bufs)].device))
            at = 0
            with torch.inference_mode():
                for node, n in path:
                    take = min(n, length - at)
                    if take <= 0:
                        break
                    for layer in range(layers):
                        cache.keys[layer][0, :, at : at + take] = node.keys[layer][:, :take]
                        cache.values[layer][0, :, at : at + take] = node.values[layer][:, :take]
                    cache._positions[at : at + take] = node.positions[:take]
                    node.used = now
                    at += take
            cache.length = length
            cache.peak = max(cache.peak, length)
            self._hits += 1
            self._cached += length
            return length, scores

    def continuation(self, scope: Hashable, tokens: Sequence[int], most: int = 256) -> list[int]:
        """What followed ``tokens`` in ``scope`` the last time it was seen whole (the most recently
        used branch below its end, up to ``most`` tokens): a regenerated answer, a retried call.
        Empty when the trie holds no sequence longer than ``tokens`` that starts with it."""
        with self._lock:
            root = self._roots.get(scope)
            if root is None or not tokens:
                return []
            path = self._walk(root, tokens)
            if sum(n for _, n in path) < len(tokens):
                return []
            node, n = path[-1]
            out = list(node.tokens[n:])
            while len(out) < most and node.children:
                node = max(node.children.values(), key=lambda c: c.used)
                out += node.tokens
            return out[:most]

    # ---- inserting ----------------------------------------------------------------------------

    def insert(self, scope: Hashable, tokens: Sequence[int], cache: KVCache, scores: Sequence[Any] | None = None,
               spec: Hashable = None) -> int:
        """Keep the rows of ``cache``'s committed slots, slot i holding ``tokens[i]``, under
        ``scope``: what the trie holds already is shared, the rest copied into a new node (after
        evicting least recently used leaves for room); with ``scores`` (slot i's token's score, of
        ``spec``, or None), those too, also on shared nodes that had none. Returns the tokens
        added."""
        count = min(len(tokens), cache.length)
        if count <= 0 or not cache.keys:
            return 0
        tokens = [int(t) for t in tokens[:count]]
        scores = None if scores is None else [*scores[:count], *[None] * (count - len(scores))]
        with self._lock:
            now = next(self._clock)
            root = self._roots.get(scope)
            if root is None:
                root = _Node((), [], [], torch.empty(0, dtype=torch.long), None, now)
                self._roots[scope] = root
            path = self._walk(root, tokens)
            node, at = root, 0
            for child, n in path:
                child.used = now
                if n < len(child.tokens):
                    child.split(n, now)
                if scores is not None and child.scores is None:  # the scores this request computed, kept
                    child.scores, child.spec = scores[at : at + n], spec
                    added = _score_bytes(child.scores)
                    child.bytes += added
                    self._bytes += added
                node, at = child, at + n
            if at >= count:
                return 0
            per_token = sum(b[:, :, :1].numel() * b.element_size() for b in (*cache.keys, *cache.values))
            kept_scores = None if scores is None else scores[at:count]
            needed = per_token * (count - at) + _score_bytes(kept_scores)
            if needed > self.capacity_bytes:
                return 0
            keep = {id(n) for n, _ in path} | {id(root)}
            while self._bytes + needed > self.capacity_bytes and self._evict_one(keep):
                pass
            if self._bytes + needed > self.capacity_bytes:
                return 0
            with torch.inference_mode():
                keys = [b[0, :, at:count].clone() for b in cache.keys]
                values = [b[0, :, at:count].clone() for b in cache.values]
            leaf = _Node(tuple(tokens[at:count]), keys, values, cache._positions[at:count].clone(), node, now,
                         kept_scores, spec if kept_scores is not None else None)
            node.children[leaf.tokens[0]] = leaf
            self._bytes += leaf.bytes
            self._tokens += count - at
            self._inserted += count - at
            return count - at

    def _evict_one(self, keep: set[int]) -> bool:
        """Drop the least recently used leaf not in ``keep`` (ids); False when none is left."""
        best: tuple[int, Hashable, _Node] | None = None
        for scope, root in self._roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                elif id(node) not in keep and (best is None or node.used < best[0]):
                    best = (node.used, scope, node)
        if best is None:
            return False
        _, scope, node = best
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[0]]
        self._bytes -= node.bytes
        self._tokens -= len(node.tokens)
        self._evictions += 1
        if parent.parent is None and not parent.children:  # a scope left empty
            del self._roots[scope]
        return True

    def clear(self) -> None:
        """Drop every scope's rows."""
        with self._lock:
            self._roots.clear()
            self._bytes = self._tokens = 0

    @property
    def stats(self) -> PrefixStats:
        with self._lock:
            return PrefixStats(self._lookups, self._hits, self._cached, self._inserted, self._evictions, self._bytes,
                               self._tokens, self.capacity_bytes)
