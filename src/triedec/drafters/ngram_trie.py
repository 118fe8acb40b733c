"""Method ``ngram-trie``: the N-Gram Trie drafter (Chen, Li et al.), sized for the device.

**Building** (paper, 3.1). A window of ``n`` tokens slides over the context; each window is split
into a prefix ``P`` (its first ``Lp`` = ``prefix`` tokens) and a suffix ``S``; the keys
``P[j:] + S`` for j = 0 .. Lp-1 (the full prefix and its sub-prefixes, so that shorter suffixes of
the output also match) are inserted into a trie, adding 1 to the frequency of every node on the
key's path. Windows never span two documents; windows at the end of a document are shorter.

Equivalently, every key is a substring of the context starting at some position s, and the node
at depth d of the path from s gains ``min(Lp - 1, s, n - d) + 1`` (the number of windows whose
key passes there). :class:`NgramTrie` inserts that way, token by token: each new token extends the
(at most n) open paths by one node. So building costs O(n) dict operations per context token,
memory is at most n nodes per context token (linear in the context, not quadratic), and adding
generated tokens later (``update=True``) continues the same paths, as if the windows had covered
them from the start.

**Each step** (paper, 3.2): match the longest suffix of the context (prompt + output), backing off
from Lp tokens to 1, to a trie path that has continuations; take the matched node's subtree; keep
its ``num_draft`` most frequent nodes (best-first with a heap, so every kept node's parent is kept:
a child's frequency never exceeds its parent's) and emit them as a tree.

**Sized for the device** (``sized=True``, the default). The paper's ``num_draft`` is 64, for a GPU.
Here the chance that a node is accepted is estimated as ``share * rho ** depth``: ``share`` is its
frequency over the matched node's (the share of the context's occurrences that continue that way)
and ``rho`` is the running rate at which the model has agreed with drafted tokens, one token at a
time, after matches of the same length and in the same state (whether the previous step accepted
drafts: copying tends to go on); a ratio of two exponential moving averages, accepted draft tokens
over tried ones, where a step tries its accepted tokens plus the one it rejected, if any.
The draft lists the num_draft nodes best first with these chances, and the engine's allocator
(:mod:`triedec.core.allocate`) verifies the prefix that pays under the device's measured cost model,
so nothing is drafted when no draft is worth its verification. A match length whose drafts were
not verified drifts back toward the optimistic prior, so it is probed again later (as ``pld``
does). ``sized=False`` sends all num_draft nodes.

**State.** The trie belongs to one request (its session). The agreement rates are shared learned
state: they live as long as the drafter and are updated under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from triedec.core.errors import TriedecError, positive_int
from triedec.core.settings import at_most
from triedec.core.tree import TokenTree
from triedec.drafters.base import MAX_TREE_NODES, BaseSession, Draft, ModelInfo, Verified
from triedec.drafters.rates import RatedDrafter, RateTable
from triedec.drafters.registry import NEEDS_COST, register
from triedec.drafters.trie import NgramTrie


@dataclass(frozen=True)
class NgramTrieOptions:
    n: int = field(default=13, metadata=at_most(64))
    """sliding-window length (the paper's n)"""
    prefix: int = 3
    """maximum prefix length Lp (1 <= Lp < n): suffixes of up to Lp tokens are matched"""
    num_draft: int = field(default=64, metadata=at_most(MAX_TREE_NODES))
    """most draft nodes per step (the paper's num_draft)"""
    sized: bool = True
    """send only as many of them as pay off on this device (measured cost curve); False = always num_draft"""
    update: bool = True
    """also insert the generated tokens into the trie as they are accepted (the paper: context only)"""

    def __post_init__(self) -> None:
        NgramTrie(self.n, self.prefix)  # validates n and prefix
        positive_int("num_draft", self.num_draft)
        for name in ("sized", "update"):
            if not isinstance(getattr(self, name), bool):
                raise TriedecError(f"{name} must be true or false, got {getattr(self, name)!r}")


def _valid_rate_key(key: object) -> bool:
    """(match length, hot)"""
    return (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int) and not isinstance(key[0], bool)
            and key[0] >= 0 and isinstance(key[1], bool))


def _needs(options: NgramTrieOptions) -> frozenset[str]:
    return frozenset({NEEDS_COST}) if options.sized else frozenset()


@register("ngram-trie", NgramTrieOptions, "N-Gram Trie: a frequency trie of the context's n-grams; the most "
          "frequent continuations of the longest matched suffix, sized for the device", needs=_needs)
class NgramTrieDrafter(RatedDrafter):
    """Shared across requests (under ``lock``): the agreement rates ``rho`` per (matched suffix
    length, hot). Per request (the session): the trie, built in ``begin`` from the documents and
    the prompt."""

    PRIOR_RHO = 0.8
    """optimistic initial agreement rate, for every match length"""
    EMA = 0.2
    """weight of a new drafted step in the two moving averages"""
    RELAX = 0.01
    """how far a skipped match length's averages move back toward the prior per skipped step"""

    def __init__(self, options: NgramTrieOptions, model: ModelInfo) -> None:
        # (match length, hot) -> accepted over tried draft tokens per drafted step
        super().__init__(RateTable(lambda key, rho=self.PRIOR_RHO: rho, self.EMA, self.RELAX, _valid_rate_key))
        self.options = options

    def rho(self, m: int, hot: bool = False) -> float:
        """Estimated chance that the model agrees with a drafted token after a length-``m`` match,
        when the previous step accepted a draft (``hot``) or not."""
        return self.rates.value((m, hot))

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> _NgramTrieSession:
        return _NgramTrieSession(self, prompt, documents)

    def stats(self) -> dict[str, float]:
        """The agreement rate per match length."""
        with self.lock:
            return {f"rho_m{m}" + ("_hot" if hot else ""): rate for (m, hot), rate in self.rates.items()}


class _NgramTrieSession(BaseSession):
    def __init__(self, drafter: NgramTrieDrafter, prompt: Sequence[int], documents: Sequence[Sequence[int]]) -> None:
        start = time.perf_counter()
        self.drafter = drafter
        options = drafter.options
        self.trie = NgramTrie(options.n, options.prefix)
        self.stream = self.trie.build([*documents, prompt])
        self.fed = len(prompt)
        self.hot = False  # the last step accepted at least one draft token
        self.drafted: tuple[int, bool] | None = None  # the key of the last proposal if it drafted
        self.build_seconds = time.perf_counter() - start

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        drafter = self.drafter
        if drafter.options.update and len(context) > self.fed:
            self.trie.add(context[self.fed :], self.stream)
            self.fed = len(context)
        trie = self.trie
        matched, m = trie.match(context)
        nodes = trie.top(matched, min(drafter.options.num_draft, max_nodes - 1)) if matched else []
        key = (m, self.hot)
        rho, depth = drafter.rho(*key), {matched: 0}
        for v in nodes:  # parents come before their children
            depth[v] = depth[trie.parent[v]] + 1
        chance = {v: trie.freq[v] / trie.freq[matched] * rho ** depth[v] for v in nodes}
        # best first; a child's chance never exceeds its parent's, and the sort is stable
        nodes.sort(key=lambda v: -chance[v])
        self.drafted = key if nodes else None
        index = {matched: 0}
        tokens, parents = [int(context[-1])], [-1]
        for v in nodes:
            index[v] = len(tokens)
            tokens.append(trie.token[v])
            parents.append(index[trie.parent[v]])
        tree = TokenTree(tuple(tokens), tuple(parents))
        chances = [1.0, *(chance[v] for v in nodes)]
        return Draft.scored(tree, chances, whole=not drafter.options.sized).labelled("context")

    def observe(self, verified: Verified) -> None:
        key, self.drafted = self.drafted, None
        path = verified.acceptance.path
        accepted = len(path) - 1
        self.hot = accepted > 0
        if key is None:
            return
        if verified.tree.size == 1:  # drafts proposed, none worth verifying: probe again later
            self.drafter.relax(key)
            return
        tried = accepted + (1 if verified.tree.child_lists[path[-1]] else 0)  # the rejected one, if any
        self.drafter.learn(key, accepted, tried)

    def stats(self) -> dict[str, float]:
        """The trie's size and build time for this request, and the shared agreement rates."""
        return {"trie_nodes": float(self.trie.size), "build_ms": self.build_seconds * 1000, **self.drafter.stats()}
