"""Method ``recycling``: Token Recycling (Luo et al., ACL 2025).

The model's top-k next-token candidates at every verified position are "recycled" into an
adjacency matrix ``[vocab, k]``: row t holds the k candidates most recently seen after token t.
Each step a static tree template is filled breadth-first from the matrix, starting at the last
committed token: node ``(r1, ..., rd)`` is the r_d-th candidate after the token of node
``(r1, ..., r(d-1))``. One gather per template layer builds the whole tree.

* **Update** (after every verification): every tree position -- the root and every draft node,
  accepted or not -- writes the top-k of its logits into the row of its token. When a token occurs
  at several positions, the last one in tree order wins.
* **Cold rows** (never written) propose nothing: a node whose parent's row is cold is dropped
  with its subtree, instead of drafting token 0.
* **Tree size.** :data:`PAPER_TREE` is the paper's 80-node template (sized for an A100). ``nodes=N``
  keeps its N nodes most likely to be accepted, ranked by the acceptance rates of a
  :class:`RecyclingProfile`, and sends them whole; ``nodes=0`` (default) offers, best first, the N
  nodes the calibration found fastest on this device alone, each with its calibrated acceptance
  rate as its chance, and the engine's allocator verifies the prefix that pays in each step (all N
  when alone, fewer under load). The profile is measured by the calibration through this module's
  :data:`PROFILE` (:func:`measure_profile`) and reaches the drafter through
  ``ModelInfo.profiles["recycling"]``; the drafter itself never measures anything.
* **Hot start.** The matrix is shared learned state: it lives as long as the drafter (one per
  loaded model and option set), so later requests start warm, and concurrent requests update it
  under the drafter's lock; ``state=PATH`` also loads it from a file at start (if the file
  exists) and writes it there when the engine persists learned state (when it goes idle, every
  few finished requests, and at shutdown).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from triedec.costmodel import CostModel
from triedec.drafters.base import (
    MAX_TREE_NODES,
    NEEDS_COST,
    STATE_FILE,
    BaseSession,
    CalibrationBench,
    Draft,
    ModelInfo,
    NoOptions,
    ProfileSpec,
    Verified,
    at_most,
    register,
)
from triedec.drafters.learned import Learned, Row
from triedec.drafters.state import check_location, load_state, save_state
from triedec.errors import StateFileError, TriedecError, positive_int
from triedec.tree import TokenTree

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
STATE_FORMAT = "triedec-recycling-1"
METHOD = "recycling"


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


class AdjacencyMatrix:
    """``table [vocab, k]``: row t holds the top-k next tokens last seen after token t;
    ``filled [vocab]``: whether row t was ever written; ``written [vocab]``: whether row t was
    written here since the last :meth:`take_written` (what another replica is sent). All live on
    the model's device."""

    def __init__(self, vocab_size: int, k: int, device: torch.device) -> None:
        positive_int("vocab_size", vocab_size)
        positive_int("k", k)
        if k > vocab_size:
            raise TriedecError(f"k ({k}) cannot exceed the vocabulary size ({vocab_size})")
        self.vocab_size, self.k, self.device = vocab_size, k, device
        self.table = torch.zeros((vocab_size, k), dtype=torch.long, device=device)
        self.filled = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.written = torch.zeros(vocab_size, dtype=torch.bool, device=device)

    @torch.inference_mode()
    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Write ``topk(logits[i]).indices`` into row ``tokens[i]`` for every i (``tokens [T]``,
        ``logits [T, vocab]``). Duplicate tokens: the last position wins. Vectorised."""
        tokens = tokens.to(self.device)
        top = logits.to(self.device).topk(self.k, dim=-1).indices  # [T, k]
        rows, inverse = torch.unique(tokens, return_inverse=True)
        order = torch.arange(tokens.numel(), device=self.device)
        last = torch.full((rows.numel(),), -1, dtype=torch.long, device=self.device)
        last.scatter_reduce_(0, inverse, order, reduce="amax")
        self.table[rows] = top[last]
        self.filled[rows] = True
        self.written[rows] = True

    @torch.inference_mode()
    def take_written(self) -> tuple[Row, ...]:
        """The rows written here since the last call, each (token, its row); marks them sent."""
        rows = self.written.nonzero().flatten()
        found = tuple(zip(rows.tolist(), map(tuple, self.table[rows].tolist()), strict=True))
        self.written[rows] = False
        return found

    @torch.inference_mode()
    def put_rows(self, rows: Sequence[Row]) -> None:
        """Take another replica's rows (last writer wins), except those written here since the
        last :meth:`take_written` (this replica wrote them later). Rows of another width or token
        ids outside the vocabulary are refused with a clear error (the matrix is then unchanged)."""
        if any(len(row) != self.k for _, row in rows):
            raise TriedecError(f"matrix rows of another width than this matrix's k ({self.k})")
        if any(not 0 <= t < self.vocab_size for token, row in rows for t in (token, *row)):
            raise TriedecError(f"matrix rows hold token ids beyond this vocabulary ({self.vocab_size})")
        if not rows:
            return
        tokens = torch.tensor([token for token, _ in rows], dtype=torch.long, device=self.device)
        values = torch.tensor([row for _, row in rows], dtype=torch.long, device=self.device)
        keep = ~self.written[tokens]
        self.table[tokens[keep]] = values[keep]
        self.filled[tokens[keep]] = True

    @torch.inference_mode()
    def expand(self, root: int, template: TreeTemplate, plan: _Plan) -> tuple[list[int], list[bool]]:
        """Fill ``template`` from ``root``: tokens ``[1 + size]`` in tree numbering, and whether
        each node may be proposed (it and all its ancestors come from written rows)."""
        tokens = torch.empty(template.size + 1, dtype=torch.long, device=self.device)
        usable = torch.empty(template.size + 1, dtype=torch.bool, device=self.device)
        tokens[0], usable[0] = root, True
        for (start, stop), parents, ranks in zip(template.layers, plan.parents, plan.ranks, strict=True):
            parent_tokens = tokens[parents]
            tokens[start:stop] = self.table[parent_tokens, ranks]  # one gather per layer
            usable[start:stop] = usable[parents] & self.filled[parent_tokens]
        return tokens.tolist(), usable.tolist()

    @property
    def nbytes(self) -> int:
        """Memory its tensors take (fixed by vocab and k)."""
        return sum(t.element_size() * t.numel() for t in (self.table, self.filled, self.written))

    def copy(self) -> AdjacencyMatrix:
        """An independent copy (a snapshot to write while the original keeps learning)."""
        other = AdjacencyMatrix.__new__(AdjacencyMatrix)
        other.vocab_size, other.k, other.device = self.vocab_size, self.k, self.device
        other.table, other.filled, other.written = self.table.clone(), self.filled.clone(), self.written.clone()
        return other

    def filled_share(self) -> float:
        return float(self.filled.float().mean())

    # ---- persistence --------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str], model_id: str) -> None:
        """Write the matrix to ``path`` (safetensors, replaced atomically), tagged with the model."""
        meta = {"format": STATE_FORMAT, "model_id": model_id, "vocab_size": str(self.vocab_size), "k": str(self.k)}
        save_state(path, {"table": self.table, "filled": self.filled}, meta)

    def load(self, path: str | os.PathLike[str], model_id: str) -> None:
        """Replace the matrix with the one saved in ``path``; refuse a file from another model,
        vocabulary or k, and a corrupt one, with a clear error (the matrix is then unchanged)."""
        meta, tensors = load_state(path, "recycling state", "state", STATE_FORMAT)
        if meta.get("vocab_size") != str(self.vocab_size) or meta.get("k") != str(self.k):
            raise TriedecError(
                f"recycling state {path} is for vocabulary {meta.get('vocab_size')} and k={meta.get('k')}; "
                f"this model has vocabulary {self.vocab_size} and k={self.k}"
            )
        if meta.get("model_id") != model_id:
            raise StateFileError(f"recycling state {path} was saved for another model ({meta.get('model_id')!r})")
        table, filled = tensors.get("table"), tensors.get("filled")
        if (
            table is None or filled is None or table.dtype != torch.long or filled.dtype != torch.bool
            or table.shape != (self.vocab_size, self.k) or filled.shape != (self.vocab_size,)
            or bool(((table < 0) | (table >= self.vocab_size)).any())
        ):
            raise StateFileError(f"recycling state {path} is corrupt (bad tensors)")
        self.table = table.to(self.device)
        self.filled = filled.to(self.device)


@dataclass(frozen=True)
class _Plan:
    """A template's parent indices and ranks per layer, as device tensors (for :meth:`expand`)."""

    parents: tuple[torch.Tensor, ...]
    ranks: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, template: TreeTemplate, device: torch.device) -> _Plan:
        parents, ranks = [], []
        for start, stop in template.layers:
            parents.append(torch.tensor(template.parents[start - 1 : stop - 1], dtype=torch.long, device=device))
            ranks.append(torch.tensor([p[-1] for p in template.paths[start - 1 : stop - 1]], device=device))
        return cls(tuple(parents), tuple(ranks))


@dataclass(frozen=True)
class RecyclingOptions:
    nodes: int = 0
    """draft nodes per step: 0 = the size calibrated as fastest on this device; N = the N nodes of the
    paper's 80-node tree most often accepted (calibrated rates); 80 = the paper's whole tree"""
    k: int = field(default=8, metadata=at_most(64))
    """candidates kept per token (columns of the adjacency matrix)"""
    seed_prefill: int = field(default=512, metadata=at_most(8192))
    """also write the prefill logits of the prompt's last N tokens into the matrix (0 = off)"""
    state: str = field(default="", metadata=STATE_FILE)
    """file to load the matrix from at start (if it exists) and save it to after every request"""

    def __post_init__(self) -> None:
        positive_int("k", self.k)
        seed = self.seed_prefill
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise TriedecError(f"seed_prefill must be an integer >= 0, got {seed!r}")
        nodes = self.nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 0 <= nodes <= PAPER_TEMPLATE.size:
            raise TriedecError(f"nodes must be an integer in [0, {PAPER_TEMPLATE.size}], got {self.nodes!r}")
        if not isinstance(self.state, str):
            raise TriedecError(f"state must be a file path, got {self.state!r}")


# ---- calibration: the profile ---------------------------------------------------------------------

END_TO_END_MARGIN = 0.05
"""A predicted tree size is kept only if real decoding with it beats ``ar`` by this share."""


def measure_rates(bench: CalibrationBench, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[float, ...]:
    """Per node of the paper's tree, the share of decoding steps in which it was accepted, over
    ``prompts[1:]`` (``prompts[0]`` warms the adjacency matrix up). A fresh drafter is used."""
    if len(prompts) < 2:
        raise TriedecError("calibration needs at least 2 prompts (the first one warms up)")
    plain = dataclasses.replace(bench.info, cost=None, profiles={})
    drafter = RecyclingDrafter(RecyclingOptions(nodes=PAPER_TEMPLATE.size), plain)
    for i, ids in enumerate(prompts):
        if i == 1:
            drafter.reset_counters()
        bench.decode(drafter, ids, max_new_tokens)
    return drafter.rates()


def measure_end_to_end(bench: CalibrationBench, prompts: Sequence[Sequence[int]], profile: RecyclingProfile,
                       max_new_tokens: int) -> dict[str, float]:
    """Decode ``prompts[1:]`` with ``ar`` and with recycling at ``profile.nodes`` (fresh drafters,
    warmed up on ``prompts[0]``), alternating per prompt; total seconds of each and the speedup of
    recycling over ``ar``. Both emit the same tokens (greedy is exact)."""
    from triedec.drafters.autoregressive import Autoregressive

    if len(prompts) < 2:
        raise TriedecError("calibration needs at least 2 prompts (the first one warms up)")
    info = dataclasses.replace(bench.info, profiles={METHOD: profile})
    drafters = {"ar": Autoregressive(NoOptions(), info), METHOD: RecyclingDrafter(RecyclingOptions(), info)}
    seconds = dict.fromkeys(drafters, 0.0)
    tokens = 0
    for i, ids in enumerate(prompts):
        for name, drafter in drafters.items():
            start = time.perf_counter()
            n = bench.decode(drafter, ids, max_new_tokens)
            if i:
                seconds[name] += time.perf_counter() - start
                tokens += n if name == "ar" else 0
    return {"tokens": tokens, "ar_seconds": round(seconds["ar"], 6), "recycling_seconds": round(seconds[METHOD], 6),
            "speedup": round(seconds["ar"] / seconds[METHOD], 4)}


def measure_profile(bench: CalibrationBench, margin: float = END_TO_END_MARGIN) -> RecyclingProfile:
    """Node rates, the tree size predicted under the device's cost model, and the end-to-end check:
    the prediction is optimistic (rates measured with the full tree overstate what a small tree's
    matrix learns; per-step overheads are not in the curve), so the predicted size is decoded
    against ``ar`` on the same calibration prompts and kept only if at least ``margin`` faster,
    else 0 draft nodes are chosen."""
    if not 0 <= margin < 1:
        raise TriedecError(f"margin must be in [0, 1), got {margin!r}")
    if bench.info.cost is None:
        raise TriedecError("the recycling profile needs the device's cost model")
    started = time.perf_counter()
    prompts = bench.prompts(max(bench.prompt_count, 2))
    rates = measure_rates(bench, prompts, bench.max_new_tokens)
    predicted = best_nodes(rates, bench.info.cost)
    details: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": bench.max_new_tokens,
                               "predicted_nodes": predicted, "margin": margin}
    chosen = predicted
    if predicted > 0:
        check = measure_end_to_end(bench, prompts, RecyclingProfile(rates, predicted), bench.max_new_tokens)
        details["end_to_end"] = check
        if check["speedup"] < 1 + margin:
            chosen = 0
    details["seconds_taken"] = round(time.perf_counter() - started, 1)
    return RecyclingProfile(rates, chosen, details)


def _dump(profile: RecyclingProfile) -> dict[str, Any]:
    return {"rates": list(profile.rates), "nodes": profile.nodes, "details": profile.details}


def _load(data: Mapping[str, Any]) -> RecyclingProfile:
    try:
        return RecyclingProfile(tuple(data["rates"]), data["nodes"], dict(data.get("details", {})))
    except (KeyError, TypeError, ValueError) as exc:
        raise TriedecError(f"unreadable recycling profile: {exc!r}") from exc


def _describe(profile: RecyclingProfile, cost: CostModel) -> list[str]:
    predicted = profile.details.get("predicted_nodes", profile.nodes)
    lines = ["recycling: | draft nodes | ms per forward | x a 1-token forward | expected tokens/step "
             "| expected tokens/s |", "|---|---|---|---|---|"]
    for row in expected_speeds(profile.rates, cost):
        marks = [m for m, n in (("predicted", predicted), ("chosen", profile.nodes)) if row["nodes"] == n]
        mark = f" **{', '.join(marks)}**" if marks else ""
        lines.append(f"| {row['nodes']} | {row['seconds'] * 1000:.0f} | {cost.ratio(row['nodes'] + 1):.2f} "
                     f"| {row['tokens_per_step']:.2f} | {row['tokens_per_s']:.1f}{mark} |")
    check = profile.details.get("end_to_end")
    if check:
        lines.append(f"end-to-end check of {predicted} nodes on the calibration prompts: {check['speedup']:.2f}x ar "
                     f"(kept if >= {1 + profile.details.get('margin', 0):.2f}x)")
    lines.append(f"recycling offers at most {profile.nodes} draft nodes per step on this device")
    return lines


PROFILE = ProfileSpec(measure_profile, _dump, _load, _describe)


def _needs(options: RecyclingOptions) -> frozenset[str]:
    full = options.nodes >= PAPER_TEMPLATE.with_max_rank(options.k).size
    return frozenset() if full else frozenset({NEEDS_COST, METHOD})


@register(METHOD, RecyclingOptions, "Token Recycling: a tree filled from a matrix of recycled top-k candidates",
          needs=_needs, profile=PROFILE)
class RecyclingDrafter:
    """Shared across requests, updated under ``lock``: the matrix, and the counters ``steps``,
    ``node_proposed`` / ``node_accepted`` (how often each node of the paper's template was
    proposed and accepted over ``steps`` whole verified proposals: the calibration ranks nodes by
    ``node_accepted / steps``). Per request: the template index of each node of the last tree.

    Each step's draft lists the template's nodes best first with their calibrated acceptance rates
    as chances (``nodes=0``: the engine's allocator verifies the prefix that pays, at most the
    calibrated size); ``nodes=N`` or the whole template are sent whole."""

    def __init__(self, options: RecyclingOptions, model: ModelInfo) -> None:
        self.options = options
        self.prefill_logits = options.seed_prefill
        self.model_id = model.model_id
        self.lock = threading.Lock()
        self._writing = threading.Lock()
        self.matrix = AdjacencyMatrix(model.vocab_size, options.k, model.device)
        base = PAPER_TEMPLATE.with_max_rank(options.k)
        rates: list[float] | None = None
        if options.nodes >= base.size:
            self.template, order = base, list(range(base.size + 1))
        else:
            profile = model.profiles.get(METHOD)
            if not isinstance(profile, RecyclingProfile):
                raise TriedecError("recycling with nodes < the whole template needs the device's recycling profile "
                                   "(run `triedec calibrate`, or pass nodes=80)")
            nodes = min(options.nodes or profile.nodes, base.size)
            base_rates = profile.rates_for(base)
            picks = base.ranked(nodes, base_rates)
            self.template = TreeTemplate(tuple(base.paths[i - 1] for i in sorted(picks)))
            position = {p: i + 1 for i, p in enumerate(self.template.paths)}
            order = [0, *(position[base.paths[i - 1]] for i in picks)]
            rates = [1.0, *(base_rates[i - 1] for i in picks)]
        self.send_all = options.nodes > 0 or rates is None
        self._order = order  # best-first order of the template's nodes (tree numbering)
        self._rates = rates
        self._plan = _Plan.of(self.template, model.device)
        # template node (tree numbering) -> index in PAPER_TEMPLATE.paths
        paper_index = {p: i for i, p in enumerate(PAPER_TEMPLATE.paths)}
        self._paper_index = np.array([-1, *(paper_index[p] for p in self.template.paths)])
        self.node_proposed = np.zeros(PAPER_TEMPLATE.size, dtype=np.int64)
        self.node_accepted = np.zeros(PAPER_TEMPLATE.size, dtype=np.int64)
        self.steps = 0
        if options.state:
            check_location(options.state)  # refused now, not at the first write
            if Path(options.state).exists():
                self.matrix.load(options.state, self.model_id)

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> _RecyclingSession:
        """The matrix is kept (hot start); documents are not used."""
        return _RecyclingSession(self)

    def propose(self, root: int, max_nodes: int = MAX_TREE_NODES) -> tuple[Draft, np.ndarray]:
        """The template filled from ``root``, best first (cold rows dropped, at most
        ``max_nodes`` nodes), and each node's paper index."""
        tokens, usable = self.matrix.expand(root, self.template, self._plan)
        keep = [i for i in self._order if usable[i]][:max_nodes]
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [-1, *(new_index[self.template.parents[i - 1]] for i in keep[1:])]
        tree = TokenTree(tuple(tokens[i] for i in keep), tuple(parents))
        if self._rates is None:
            draft = Draft.fixed(tree)
        else:
            where = {node: rank for rank, node in enumerate(self._order)}
            draft = Draft.scored(tree, [self._rates[where[i]] for i in keep], send_all=self.send_all)
        return draft.labelled("recycling"), self._paper_index[keep]

    def learn(self, verified: Verified, proposed: np.ndarray | None) -> None:
        """Recycle the verified logits into the matrix; count the template nodes proposed and
        accepted when the whole proposal was verified (``proposed``: the paper index of each
        proposed node, None for the prefill)."""
        with self.lock:
            self.matrix.update(torch.tensor(verified.tree.tokens), verified.logits)
            if proposed is not None and not verified.cut and len(proposed) == verified.tree.size:
                self.steps += 1
                self.node_proposed[proposed[1:]] += 1
                self.node_accepted[proposed[list(verified.acceptance.path[1:])]] += 1

    def reset_counters(self) -> None:
        with self.lock:
            self.node_proposed[:] = 0
            self.node_accepted[:] = 0
            self.steps = 0

    def rates(self) -> tuple[float, ...]:
        """Per node of the paper's template, the share of counted steps that accepted it."""
        with self.lock:
            return tuple((self.node_accepted / max(self.steps, 1)).tolist())

    def max_learned_bytes(self) -> int:
        """The adjacency matrix (``vocab x k`` token ids), allocated whole when built."""
        return self.matrix.nbytes

    def persist(self) -> None:
        """Write the matrix to ``state`` (if set): copied under the lock, written outside it."""
        if not self.options.state:
            return
        with self._writing:  # writes land in the order their snapshots were taken
            with self.lock:
                snapshot = self.matrix.copy()
            snapshot.save(self.options.state, self.model_id)

    def export_learned(self) -> Learned:
        """The matrix rows written here since the last export (:mod:`triedec.drafters.learned`)."""
        with self.lock:
            return Learned(rows=self.matrix.take_written())

    def absorb_learned(self, learned: Learned) -> None:
        """Another replica's matrix rows (last writer wins per row)."""
        with self.lock:
            self.matrix.put_rows(learned.rows)

    def stats(self) -> dict[str, float]:
        return {"tree_nodes": float(self.template.size), "matrix_rows_filled": self.matrix.filled_share()}


class _RecyclingSession(BaseSession):
    def __init__(self, drafter: RecyclingDrafter) -> None:
        self.drafter = drafter
        self.proposed: np.ndarray | None = None  # paper index of each node of the last draft

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        draft, self.proposed = self.drafter.propose(int(context[-1]), max_nodes)
        return draft

    def observe(self, verified: Verified) -> None:
        proposed = self.proposed
        if proposed is not None and verified.kept is not None:
            proposed = proposed[list(verified.kept)] if verified.cut else proposed
        self.drafter.learn(verified, proposed)
        self.proposed = None

    def stats(self) -> dict[str, float]:
        return self.drafter.stats()


