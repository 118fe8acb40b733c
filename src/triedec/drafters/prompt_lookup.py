"""Method ``pld``: prompt lookup decoding, with several matches merged into one trie.

Each step looks for earlier occurrences of the context's suffix n-gram (longest n first, from
``max_ngram`` down to ``min_ngram``) in prompt + output, and proposes the ``num_tokens`` tokens that
followed each occurrence. Up to ``num_matches`` distinct continuations (most recent occurrence
first) are merged into one trie, so a shared prefix is verified once. ``transformers``' own prompt
lookup keeps only the first match of a single n-gram size.

Drafting is not free: on a CPU, verifying even 2-4 tokens costs more than a 1-token step, so a
draft that is rarely accepted slows decoding down. The drafter therefore keeps, per matched n-gram
length, the running rate ``rho`` at which the model agreed with drafted tokens (accepted over tried
draft tokens, a ratio of two moving averages, as ngram-trie does), and scores each node
``share * rho ** depth``, ``share`` being the fraction of the matches whose continuation passes
through it. By default (``min_expected=None``) the engine's allocator verifies the prefix of the
draft that pays under the device's cost model; with ``min_expected`` set, the whole trie is sent
whenever its expected accepted tokens (the sum of its nodes' scores) reach that number (0 = always
draft). A length whose drafts were not verified drifts back toward the optimistic prior, so it is
probed again later. The rates are shared learned state: they live as long as the drafter (one per
loaded model and option set), updated under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from triedec.core.errors import TriedecError, positive_int
from triedec.core.settings import at_most
from triedec.core.tree import TokenTree
from triedec.drafters.base import MAX_TREE_NODES, BaseSession, Draft, ModelInfo, Verified
from triedec.drafters.rates import RatedDrafter, RateTable
from triedec.drafters.registry import NEEDS_COST, register


@dataclass(frozen=True)
class PromptLookupOptions:
    max_ngram: int = field(default=3, metadata=at_most(64))
    """longest suffix n-gram to match"""
    min_ngram: int = 2
    """shortest suffix n-gram to fall back to"""
    num_tokens: int = field(default=10, metadata=at_most(MAX_TREE_NODES))
    """tokens proposed per matched continuation"""
    num_matches: int = field(default=2, metadata=at_most(64))
    """distinct continuations merged into the draft trie"""
    min_expected: float | None = None
    """send the whole trie whenever its expected accepted draft tokens reach this (0 = always);
    None (auto) = let the engine's allocator verify the part that pays on this device"""

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


def _valid_rate_key(key: object) -> bool:
    """An n-gram length."""
    return isinstance(key, int) and not isinstance(key, bool) and key > 0


def _needs(options: PromptLookupOptions) -> frozenset[str]:
    return frozenset({NEEDS_COST}) if options.min_expected is None else frozenset()


@register("pld", PromptLookupOptions, "prompt lookup: continuations of suffix n-gram matches, merged into a trie",
          needs=_needs)
class PromptLookupDrafter(RatedDrafter):
    """Shared across requests: the agreement rate per matched n-gram length (updated under
    ``lock``). Per request: which length the last proposal drafted."""

    PRIOR_RHO = 0.8
    """optimistic initial agreement rate, for every n-gram length"""
    EMA = 0.2
    """weight of a new drafted step in the two moving averages"""
    RELAX = 0.01
    """how far a skipped length's averages move back toward the prior: a length whose drafts keep
    failing is probed again about once every 15-20 opportunities"""

    def __init__(self, options: PromptLookupOptions, model: ModelInfo) -> None:
        # n-gram length -> accepted over tried draft tokens
        super().__init__(RateTable(lambda n, rho=self.PRIOR_RHO: rho, self.EMA, self.RELAX, _valid_rate_key))
        self.options = options

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> _PromptLookupSession:
        """The context is searched afresh every step; documents are not used."""
        return _PromptLookupSession(self)

    def rho(self, n: int) -> float:
        """Estimated chance that the model agrees with a token drafted after a length-``n`` match."""
        return self.rates.value(n)

    def stats(self) -> dict[str, float]:
        """The agreement rate per matched n-gram length."""
        with self.lock:
            return {f"rho_n{n}": rate for n, rate in self.rates.items()}


class _PromptLookupSession(BaseSession):
    def __init__(self, drafter: PromptLookupDrafter) -> None:
        self.drafter = drafter
        self.drafted_n: int | None = None

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        drafter = self.drafter
        self.drafted_n = None
        matches = find_matches(context, drafter.options)
        if not matches:
            return Draft.root_only(context[-1])
        n = matches[0][0]
        continuations = [cont for _, cont in matches]
        tree = TokenTree.from_sequences(context[-1], continuations, max_nodes)
        rho = drafter.rho(n)
        passing = [0] * tree.size  # how many continuations pass through each node
        for cont in continuations:
            node = 0
            for tok in cont:
                node = tree.children[node].get(int(tok), -1)
                if node < 0:
                    break
                passing[node] += 1
        depths = tree.depths
        chances = [1.0, *(passing[i] / len(continuations) * rho ** depths[i] for i in range(1, tree.size))]
        order = sorted(range(1, tree.size), key=lambda i: -chances[i])  # stable: parents first
        tree, chances = _reordered(tree, [0, *order], chances)
        minimum = drafter.options.min_expected
        if minimum is not None and sum(chances[1:]) < minimum:
            drafter.relax(n)
            return Draft.root_only(context[-1])
        self.drafted_n = n
        return Draft.scored(tree, chances, whole=minimum is not None).labelled("prompt")

    def observe(self, verified: Verified) -> None:
        n, self.drafted_n = self.drafted_n, None
        if n is None:
            return
        if verified.tree.size == 1:  # nothing was worth verifying: probe again later
            self.drafter.relax(n)
            return
        path = verified.acceptance.path
        accepted = len(path) - 1
        tried = accepted + (1 if verified.tree.child_lists[path[-1]] else 0)  # the rejected one, if any
        self.drafter.learn(n, accepted, tried)

    def stats(self) -> dict[str, float]:
        return self.drafter.stats()


def _reordered(tree: TokenTree, order: list[int], chances: list[float]) -> tuple[TokenTree, list[float]]:
    """``tree`` with its nodes listed in ``order`` (parents before children)."""
    index = {old: new for new, old in enumerate(order)}
    parents = tuple(-1 if old == 0 else index[tree.parents[old]] for old in order)
    return TokenTree(tuple(tree.tokens[i] for i in order), parents), [chances[i] for i in order]
