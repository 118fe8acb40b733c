"""Device calibration: what a verification forward costs here, and which draft-tree size is fastest.

A speculative step that verifies T tokens pays off only if it yields more tokens than
``cost(T) / cost(1)``; on a 2-core CPU an 81-token forward costs 4-5 single-token forwards, on a GPU
about one. So tree sizes are chosen from measurements, once per model + device + dtype (+ CPU
threads), and cached as JSON under the triedec cache directory:

* **cost curve** -- median seconds of one forward of T tree tokens on a 512-token cache, including
  the top-k over its logits that Token Recycling does after every step, for the sizes in
  :data:`NODE_SIZES`;
* **node rates** -- for each node of the paper's 80-node Token Recycling tree, the share of steps
  in which it was accepted, measured by decoding a few calibration prompts (disjoint from the
  benchmark's Spec-Bench sample) with the full tree, after one warm-up prompt;
* **prediction** -- for each measured size N, keep the N nodes with the highest rates; expected
  tokens per step = 1 + the sum of their rates (each accepted node yields one token, plus the bonus
  token); the N with the most expected tokens per second is the candidate;
* **end-to-end check** -- the prediction is optimistic (rates measured with the full tree, whose 81
  positions refill the matrix every step, overstate what a small tree learns; per-step overheads
  are not in the cost curve), so the calibration prompts are decoded with ``ar`` and with the
  candidate, alternating; the candidate is kept only if it is at least :data:`END_TO_END_MARGIN`
  faster, else 0 draft nodes are chosen (recycling then runs plain steps).

The pure part (:class:`Calibration`, :func:`expected_speeds`) needs no model; :func:`calibrate`
runs the measurements through an :class:`~triedec.lm.LM`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from triedec.errors import TriedecError, positive_int

if TYPE_CHECKING:
    from triedec.drafters.recycling import TreeTemplate
    from triedec.lm import LM

NODE_SIZES = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80)
"""Draft-node counts whose verification cost is measured (a forward of N + 1 tokens)."""
END_TO_END_MARGIN = 0.05
"""A predicted tree size is kept only if real decoding with it beats ``ar`` by this share."""
CALIBRATION_FORMAT = "triedec-calibration-1"
CALIBRATION_CATEGORIES = ("coding", "translation", "qa", "math_reasoning", "writing", "summarization",
                          "extraction", "rag", "roleplay", "stem", "reasoning", "humanities", "math")


@dataclass(frozen=True)
class Calibration:
    """One model on one device.

    ``forward_seconds``: tree tokens T -> median seconds of a T-token verification forward;
    ``recycling_rates[i]``: share of steps in which node i of the paper's template was accepted;
    ``recycling_nodes``: the draft-tree size with the most expected tokens per second.
    """

    model_id: str
    device: str
    dtype: str
    forward_seconds: dict[int, float]
    recycling_rates: tuple[float, ...]
    recycling_nodes: int = -1
    context_tokens: int = 512
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from triedec.drafters.recycling import PAPER_TEMPLATE

        seconds = {int(t): float(s) for t, s in self.forward_seconds.items()}
        object.__setattr__(self, "forward_seconds", dict(sorted(seconds.items())))
        object.__setattr__(self, "recycling_rates", tuple(float(r) for r in self.recycling_rates))
        if not seconds or any(t < 1 or s <= 0 for t, s in seconds.items()):
            raise TriedecError("calibration: forward costs must be positive, for sizes >= 1 token")
        if len(self.recycling_rates) != PAPER_TEMPLATE.size or any(not 0 <= r <= 1 for r in self.recycling_rates):
            raise TriedecError(f"calibration: {PAPER_TEMPLATE.size} acceptance rates in [0, 1] are needed")
        if self.recycling_nodes < 0:
            object.__setattr__(self, "recycling_nodes", best_nodes(self.recycling_rates, seconds))

    def verify_seconds(self, tokens: int) -> float:
        """Estimated seconds of a forward of ``tokens`` tree tokens: the measured curve made
        non-decreasing (a bigger tree never counts as cheaper; the raw curve is noisy), linearly
        interpolated between measured sizes and extrapolated from the last two beyond them."""
        if tokens < 1:
            raise TriedecError(f"a forward needs at least 1 token, got {tokens}")
        sizes = list(self.forward_seconds)
        envelope, top = [], 0.0
        for t in sizes:
            top = max(top, self.forward_seconds[t])
            envelope.append(top)
        if tokens <= sizes[0]:
            return envelope[0]
        for (t0, c0), (t1, c1) in zip(zip(sizes, envelope, strict=True), zip(sizes[1:], envelope[1:], strict=True),
                                      strict=False):
            if tokens <= t1:
                return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
        if len(sizes) == 1:
            return envelope[0]
        slope = (envelope[-1] - envelope[-2]) / (sizes[-1] - sizes[-2])
        return envelope[-1] + slope * (tokens - sizes[-1])

    def rates_for(self, template: TreeTemplate) -> list[float]:
        """The measured acceptance rate of each node of ``template`` (a subset of the paper's tree)."""
        from triedec.drafters.recycling import PAPER_TEMPLATE

        by_path = dict(zip(PAPER_TEMPLATE.paths, self.recycling_rates, strict=True))
        missing = [p for p in template.paths if p not in by_path]
        if missing:
            raise TriedecError(f"calibration: no acceptance rate for template nodes {missing[:3]} "
                               "(not in the paper's tree)")
        return [by_path[p] for p in template.paths]

    def to_json(self) -> str:
        return json.dumps({"format": CALIBRATION_FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        try:
            data = json.loads(text)
            if data.pop("format", None) != CALIBRATION_FORMAT:
                raise ValueError("not a triedec calibration")
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise TriedecError(f"unreadable calibration: {exc}") from exc


def expected_speeds(rates: Sequence[float], forward_seconds: Mapping[int, float]) -> list[dict[str, float]]:
    """For each measured size: draft nodes, expected tokens per step and per second."""
    from triedec.drafters.recycling import PAPER_TEMPLATE

    if len(rates) != PAPER_TEMPLATE.size:
        raise TriedecError(f"calibration: {PAPER_TEMPLATE.size} acceptance rates are needed, got {len(rates)}")
    rows = []
    for tokens, seconds in sorted(forward_seconds.items()):
        nodes = tokens - 1
        if nodes > PAPER_TEMPLATE.size:
            continue
        kept = PAPER_TEMPLATE.top(nodes, rates)
        per_step = 1.0 + sum(rates[PAPER_TEMPLATE.paths.index(p)] for p in kept.paths)
        rows.append({"nodes": nodes, "seconds": seconds, "tokens_per_step": per_step,
                     "tokens_per_s": per_step / seconds})
    return rows


def best_nodes(rates: Sequence[float], forward_seconds: Mapping[int, float]) -> int:
    """The draft-tree size with the most expected tokens per second (fewer nodes on ties)."""
    rows = expected_speeds(rates, forward_seconds)
    if not rows:
        raise TriedecError("calibration: no measured tree size")
    return max(rows, key=lambda r: (r["tokens_per_s"], -r["nodes"]))["nodes"]


def device_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a cost curve depends on besides the model: device (name), dtype, CPU threads."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{torch.get_num_threads()}threads"
    return "".join(c if c.isalnum() or c in "-." else "-" for c in f"{name}-{str(dtype).removeprefix('torch.')}")


def calibration_path(cache_dir: Path, model_id: str, device: torch.device, dtype: torch.dtype) -> Path:
    return cache_dir / "calibration" / f"{model_id}-{device_key(device, dtype)}.json"


# ---- measurement (needs a model) --------------------------------------------------------------


def measure_forward_seconds(
    lm: LM, sizes: Sequence[int] = tuple(n + 1 for n in NODE_SIZES), context_tokens: int = 512, repeats: int = 5,
    k: int = 8,
) -> dict[int, float]:
    """Median seconds of a forward of T tree tokens (shaped like the paper's tree cut to T nodes,
    random tokens) on a ``context_tokens`` cache, plus the top-k of its logits; sizes are
    interleaved across repeats so that machine noise spreads evenly."""
    from triedec.drafters.recycling import PAPER_TEMPLATE, TreeTemplate
    from triedec.tree import TokenTree

    positive_int("repeats", repeats)
    adapter = lm.adapter
    gen = torch.Generator().manual_seed(0)
    cache = adapter.new_cache(context_tokens + max(sizes))
    adapter.prefill(cache, torch.randint(adapter.vocab_size, (context_tokens,), generator=gen))
    cache.commit(range(context_tokens))
    trees = {}
    for t in sizes:
        parents = (-1, *TreeTemplate(PAPER_TEMPLATE.paths[: t - 1]).parents)  # a BFS prefix is a tree
        tokens = torch.randint(adapter.vocab_size, (t,), generator=gen).tolist()
        trees[t] = TokenTree(tuple(tokens), parents)
    sync = torch.cuda.synchronize if adapter.device.type == "cuda" else (lambda: None)
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for round_ in range(repeats + 1):  # round 0 warms up
        for t, tree in trees.items():
            start = time.perf_counter()
            logits = adapter.forward(cache, torch.tensor(tree.tokens), tree.positions(cache.length)[0],
                                     tree.visibility(cache.length))
            logits.topk(k, dim=-1)
            sync()
            if round_:
                times[t].append(time.perf_counter() - start)
            cache.commit([])
    return {t: statistics.median(v) for t, v in times.items()}


def calibration_prompts(n: int) -> list[str]:
    """``n`` Spec-Bench first turns, one per category in turn, at indices halfway between the
    benchmark's evenly spaced picks (so never a benchmark prompt)."""
    from triedec.bench.datasets import load_questions

    by_category: dict[str, list[str]] = {}
    for q in load_questions("spec-bench"):
        by_category.setdefault(q.category, []).append(q.turns[0])
    cats = [c for c in CALIBRATION_CATEGORIES if c in by_category]
    out = []
    for j in range(n):
        items = by_category[cats[j % len(cats)]]
        # the benchmark's 5-per-category picks are floor(i * len / 5); halfway between them:
        out.append(items[(len(items) // 10 + (j // len(cats)) * (len(items) // 5)) % len(items)])
    return out


def measure_recycling_rates(lm: LM, prompts: Sequence[str], max_new_tokens: int = 96) -> tuple[float, ...]:
    """Per node of the paper's tree, the share of decoding steps in which it was accepted, over
    ``prompts[1:]`` (``prompts[0]`` warms the adjacency matrix up). A fresh drafter is used."""
    from triedec.drafters.recycling import RecyclingDrafter, RecyclingOptions
    from triedec.engine import StopRule, speculative_decode

    if len(prompts) < 2:
        raise TriedecError("calibration needs at least 2 prompts (the first one warms up)")
    drafter = RecyclingDrafter(RecyclingOptions(nodes=80), lm.model_info(calibrated=False))
    rule = StopRule(max_new_tokens=max_new_tokens, eos_token_ids=lm.eos_token_ids)
    for i, prompt in enumerate(prompts):
        if i == 1:
            drafter.node_accepted[:] = 0
            drafter.steps = 0
        for _ in speculative_decode(lm.adapter, drafter, lm.encode(prompt, chat=lm.has_chat_template), rule):
            pass
    return tuple((drafter.node_accepted / max(drafter.steps, 1)).tolist())


def measure_end_to_end(lm: LM, prompts: Sequence[str], predicted: Calibration,
                       max_new_tokens: int = 96) -> dict[str, float]:
    """Decode ``prompts[1:]`` with ``ar`` and with recycling at ``predicted.recycling_nodes``
    (a fresh drafter, warmed up on ``prompts[0]``), alternating per prompt; total seconds of each
    and the speedup of recycling over ``ar``. Both emit the same tokens (greedy is exact)."""
    from triedec.drafters import method_spec
    from triedec.drafters.base import ModelInfo
    from triedec.engine import StopRule, speculative_decode

    if len(prompts) < 2:
        raise TriedecError("calibration needs at least 2 prompts (the first one warms up)")
    info = ModelInfo(lm.adapter.vocab_size, lm.device, lm.adapter.model_id, lambda: predicted)
    drafters = {spec.name: spec.factory(spec.make_options({}), info) for spec in map(method_spec, ("ar", "recycling"))}
    rule = StopRule(max_new_tokens=max_new_tokens, eos_token_ids=lm.eos_token_ids)
    seconds = {name: 0.0 for name in drafters}
    tokens = 0
    for i, prompt in enumerate(prompts):
        ids = lm.encode(prompt, chat=lm.has_chat_template)
        for name, drafter in drafters.items():
            start = time.perf_counter()
            n = sum(1 for _ in speculative_decode(lm.adapter, drafter, ids, rule))
            if i:
                seconds[name] += time.perf_counter() - start
                tokens += n if name == "ar" else 0
    return {"tokens": tokens, "ar_seconds": round(seconds["ar"], 3),
            "recycling_seconds": round(seconds["recycling"], 3),
            "speedup": round(seconds["ar"] / seconds["recycling"], 4)}


def calibrate(lm: LM, prompts: int = 6, max_new_tokens: int = 96, repeats: int = 5,
              margin: float = END_TO_END_MARGIN) -> Calibration:
    """Measure the cost curve and the node rates for ``lm`` on its device, predict the fastest
    tree size, and keep it only if decoding with it really beats ``ar`` by ``margin`` (see the
    module doc); otherwise choose 0 draft nodes."""
    positive_int("prompts", prompts)
    positive_int("max_new_tokens", max_new_tokens)
    if not 0 <= margin < 1:
        raise TriedecError(f"margin must be in [0, 1), got {margin!r}")
    started = time.perf_counter()
    texts = calibration_prompts(max(prompts, 2))
    seconds = measure_forward_seconds(lm, repeats=repeats)
    rates = measure_recycling_rates(lm, texts, max_new_tokens)
    key = (lm.adapter.model_id, device_key(lm.device, lm.adapter.dtype), str(lm.adapter.dtype))
    predicted = Calibration(*key, seconds, rates)
    details: dict[str, Any] = {
        "prompts": prompts, "max_new_tokens": max_new_tokens, "repeats": repeats,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "predicted_nodes": predicted.recycling_nodes, "margin": margin,
    }
    chosen = predicted.recycling_nodes
    if chosen > 0:
        check = measure_end_to_end(lm, texts, predicted, max_new_tokens)
        details["end_to_end"] = check
        if check["speedup"] < 1 + margin:
            chosen = 0
    details["seconds_taken"] = round(time.perf_counter() - started, 1)
    return Calibration(*key, seconds, rates, chosen, details=details)


def load_or_calibrate(lm: LM, cache_dir: Path, force: bool = False, **kwargs: Any) -> Calibration:
    """The cached calibration of ``lm`` on its device, measured (and cached) if absent."""
    path = calibration_path(cache_dir, lm.adapter.model_id, lm.device, lm.adapter.dtype)
    if path.is_file() and not force:
        return Calibration.from_json(path.read_text())
    import logging

    logging.getLogger("triedec").info("calibrating this model on this device (once; cached in %s)", path)
    result = calibrate(lm, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(result.to_json())
    os.replace(tmp, path)
    return result
