"""Token Recycling's draft tree (Luo et al.): the paper's static 80-node template, the smaller
trees cut from it, and the profile the calibration measures for it on one device (each node's
acceptance rate, the tree size chosen), with the expected speed of each size under a cost model.

Pure values; recycling builds its drafts from them, the calibration fills the profile.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError

PAPER_TREE: tuple[tuple[int, ...], ...] = (
    # depth 1 (8)
    (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,),
    # depth 2 (21)
    (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (1, 0), (1, 1), (1, 2), (1, 3),
    (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0),
    # depth 3 (25)
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5), (0, 0, 6), (0, 0, 7),
    (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 2, 0), (0, 2, 1), (0, 3, 0), (0, 4, 0), (0, 5, 0), (0, 6, 0),
    (0, 7, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0),
    # depth 4 (15)
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 0, 4), (0, 0, 1, 0), (0, 0, 1, 1),
    (0, 0, 2, 0), (0, 0, 3, 0), (0, 0, 4, 0), (0, 1, 0, 0), (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0),
    (3, 0, 0, 0),
    # depth 5 (8)
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 1, 0), (0, 0, 0, 2, 0), (0, 0, 1, 0, 0),
    (0, 1, 0, 0, 0), (1, 0, 0, 0, 0),
    # depth 6 (3)
    (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0),
)
"""The paper's static draft tree ("2.2.2": 80 nodes, depth 6, 40 leaves), each node written as its
path of candidate ranks from the root."""


@dataclass(frozen=True)
class TreeTemplate:
    """A static tree shape: each node is its path of candidate ranks from the root (the root
    itself is implicit). Validated on construction; nodes are kept in breadth-first order."""

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        paths = tuple(tuple(int(r) for r in p) for p in self.paths)
        if len(set(paths)) != len(paths):
            raise TriedecError("a tree template lists a node twice")
        known = set(paths)
        for p in paths:
            if not p or any(r < 0 for r in p):
                raise TriedecError(f"template node {p}: a path of non-negative ranks is needed")
            if len(p) > 1 and p[:-1] not in known:
                raise TriedecError(f"template node {p} has no parent {p[:-1]} in the template")
        object.__setattr__(self, "paths", tuple(sorted(paths, key=len)))  # stable: BFS order

    @property
    def size(self) -> int:
        """Draft nodes (the root excluded)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Parent of node i+1 in tree numbering (root = 0, template node i = i + 1)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return tuple(index[p[:-1]] if len(p) > 1 else 0 for p in self.paths)

    @cached_property
    def layers(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` tree indices of each depth's nodes."""
        bounds, start = [], 1
        for d in range(1, self.depth + 1):
            stop = start + sum(1 for p in self.paths if len(p) == d)
            bounds.append((start, stop))
            start = stop
        return tuple(bounds)

    def with_max_rank(self, k: int) -> TreeTemplate:
        """The nodes whose every rank is below ``k`` (what a ``[vocab, k]`` matrix can fill)."""
        return TreeTemplate(tuple(p for p in self.paths if max(p) < k))

    def top(self, n: int, rates: Sequence[float]) -> TreeTemplate:
        """The ``n`` nodes most likely to be accepted, given ``rates[i]`` for ``paths[i]``.

        Greedy from the root over the frontier (highest rate first, breadth-first order on ties),
        so every kept node's parent is kept too. A node's acceptance rate never exceeds its
        parent's, so on exact rates this is simply the top ``n``.
        """
        if len(rates) != self.size:
            raise TriedecError(f"{len(rates)} acceptance rates given for a {self.size}-node template")
        if not 0 <= n <= self.size:
            raise TriedecError(f"cannot keep {n} nodes of a {self.size}-node template")
        return TreeTemplate(tuple(self.paths[i - 1] for i in sorted(self.ranked(n, rates))))

    def ranked(self, n: int, rates: Sequence[float]) -> list[int]:
        """The tree indices (root = 0, node i = ``paths[i - 1]``) of :meth:`top`'s ``n`` nodes in
        the order they were picked: best first, every parent before its children."""
        if len(rates) != self.size:
            raise TriedecError(f"{len(rates)} acceptance rates given for a {self.size}-node template")
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(i + 1)
        frontier = [(-float(rates[c - 1]), c) for c in children.get(0, [])]
        heapq.heapify(frontier)
        kept: list[int] = []
        while frontier and len(kept) < n:
            _, node = heapq.heappop(frontier)
            kept.append(node)
            for c in children.get(node, []):
                heapq.heappush(frontier, (-float(rates[c - 1]), c))
        return kept


PAPER_TEMPLATE = TreeTemplate(PAPER_TREE)


@dataclass(frozen=True)
class RecyclingProfile:
    """Calibrated acceptance of the paper's tree on one device: ``rates[i]`` is the share of
    steps in which node ``PAPER_TEMPLATE.paths[i]`` was accepted; ``nodes`` is the tree size
    chosen for this device (0 = draft nothing). ``details``: how it was measured."""

    rates: tuple[float, ...]
    nodes: int
    details: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        rates = tuple(float(r) for r in self.rates)
        if len(rates) != PAPER_TEMPLATE.size or any(not (0 <= r <= 1) or math.isnan(r) for r in rates):
            raise TriedecError(f"recycling profile: {PAPER_TEMPLATE.size} acceptance rates in [0, 1] are needed")
        nodes = self.nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 0 <= nodes <= PAPER_TEMPLATE.size:
            raise TriedecError(f"recycling profile: nodes must be an integer in [0, {PAPER_TEMPLATE.size}]")
        object.__setattr__(self, "rates", rates)

    def rates_for(self, template: TreeTemplate) -> list[float]:
        """The measured acceptance rate of each node of ``template`` (a subset of the paper's tree)."""
        by_path = dict(zip(PAPER_TEMPLATE.paths, self.rates, strict=True))
        missing = [p for p in template.paths if p not in by_path]
        if missing:
            raise TriedecError(f"recycling profile: no acceptance rate for template nodes {missing[:3]} "
                               "(not in the paper's tree)")
        return [by_path[p] for p in template.paths]


def expected_speeds(rates: Sequence[float], cost: CostModel) -> list[dict[str, float]]:
    """For each size measured in ``cost`` (draft nodes = tree tokens - 1, up to the paper's 80):
    expected tokens per step (1 + the rates of the N most accepted nodes) and per second."""
    if len(rates) != PAPER_TEMPLATE.size:
        raise TriedecError(f"{PAPER_TEMPLATE.size} acceptance rates are needed, got {len(rates)}")
    index = {p: i for i, p in enumerate(PAPER_TEMPLATE.paths)}
    rows = []
    for tokens, seconds in cost.forward_seconds.items():
        nodes = tokens - 1
        if nodes > PAPER_TEMPLATE.size:
            continue
        kept = PAPER_TEMPLATE.top(nodes, rates)
        per_step = 1.0 + sum(rates[index[p]] for p in kept.paths)
        rows.append({"nodes": nodes, "seconds": seconds, "tokens_per_step": per_step,
                     "tokens_per_s": per_step / seconds})
    return rows


def best_nodes(rates: Sequence[float], cost: CostModel) -> int:
    """The draft-tree size with the most expected tokens per second (fewer nodes on ties)."""
    rows = expected_speeds(rates, cost)
    if not rows:
        raise TriedecError("no tree size of the paper's template is measured in the cost model")
    return int(max(rows, key=lambda r: (r["tokens_per_s"], -r["nodes"]))["nodes"])
