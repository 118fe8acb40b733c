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
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError, positive_int
from triedec.core.settings import at_most
from triedec.core.tree import TokenTree
from triedec.drafters.base import MAX_TREE_NODES, BaseDrafter, BaseSession, Draft, ModelInfo, Verified
from triedec.drafters.learned import Learned
from triedec.drafters.matrix import AdjacencyMatrix
from triedec.drafters.registry import (
    NEEDS_COST,
    STATE_FILE,
    CalibrationBench,
    NoOptions,
    ProfileSpec,
    register,
)
from triedec.drafters.state import check_location
from triedec.drafters.template import (
    PAPER_TEMPLATE,
    RecyclingProfile,
    TreeTemplate,
    best_nodes,
    expected_speeds,
)

METHOD = "recycling"


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


@torch.inference_mode()
def fill(matrix: AdjacencyMatrix, root: int, template: TreeTemplate, plan: _Plan) -> tuple[list[int], list[bool]]:
    """Fill ``template`` from ``root`` out of ``matrix``: tokens ``[1 + size]`` in tree numbering,
    and whether each node may be proposed (it and all its ancestors come from written rows)."""
    tokens = torch.empty(template.size + 1, dtype=torch.long, device=matrix.device)
    usable = torch.empty(template.size + 1, dtype=torch.bool, device=matrix.device)
    tokens[0], usable[0] = root, True
    for (start, stop), parents, ranks in zip(template.layers, plan.parents, plan.ranks, strict=True):
        parent_tokens = tokens[parents]
        tokens[start:stop] = matrix.table[parent_tokens, ranks]  # one gather per layer
        usable[start:stop] = usable[parents] & matrix.filled[parent_tokens]
    return tokens.tolist(), usable.tolist()


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
    """file the matrix is loaded from at start (if it exists) and written to when the engine persists learned
    state (when idle, every few finished requests, at shutdown)"""

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
class RecyclingDrafter(BaseDrafter):
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
        self.whole = options.nodes > 0 or rates is None
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
        tokens, usable = fill(self.matrix, root, self.template, self._plan)
        keep = [i for i in self._order if usable[i]][:max_nodes]
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [-1, *(new_index[self.template.parents[i - 1]] for i in keep[1:])]
        tree = TokenTree(tuple(tokens[i] for i in keep), tuple(parents))
        if self._rates is None:
            draft = Draft.fixed(tree)
        else:
            where = {node: rank for rank, node in enumerate(self._order)}
            draft = Draft.scored(tree, [self._rates[where[i]] for i in keep], whole=self.whole)
        return draft.labelled("recycling"), self._paper_index[keep]

    def learn(self, verified: Verified, proposed: np.ndarray | None) -> None:
        """Recycle the verified logits into the matrix; count the template nodes proposed and
        accepted when the whole proposal was verified (``proposed``: the paper index of each
        proposed node, None for the prefill)."""
        with self.lock:
            self.matrix.update(verified.tree.tokens, verified.logits)
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


