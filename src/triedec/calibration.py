"""Device calibration: what a verification forward costs here, and how big Token Recycling's tree
should be. A top-layer module: it measures through an :class:`~triedec.lm.LM`; the values it
produces (:class:`~triedec.costmodel.CostModel`,
:class:`~triedec.drafters.recycling.RecyclingProfile`) are pure and reach drafters through
``ModelInfo``. Results are cached as JSON per model + device + dtype (+ CPU threads) under the
triedec cache directory.

* **cost curve** (:func:`measure_cost_model`, a few seconds to a minute) -- median seconds of one
  forward of T tree tokens on a 512-token cache, including the top-k over its logits that Token
  Recycling does after every step, for the sizes in :data:`TREE_SIZES`;
* **recycling profile** (:func:`measure_recycling_profile`, a minute or two) -- for each node of
  the paper's 80-node tree, the share of steps in which it was accepted, measured by decoding
  calibration prompts (``calibration_prompts.json``: Spec-Bench prompts never in the benchmark's
  sample) with the full tree,
  after one warm-up prompt. For each measured size N the N most accepted nodes are kept; expected
  tokens per step = 1 + the sum of their rates; the N with the most expected tokens per second is
  the candidate. The prediction is optimistic (rates measured with the full tree overstate what
  a small tree's matrix learns; per-step overheads are not in the curve), so the candidate is
  decoded against ``ar`` on the same prompts and kept only if it is at least
  :data:`END_TO_END_MARGIN` faster, else 0 draft nodes are chosen.

Methods say what they need (``MethodSpec.needs``); the :class:`~triedec.lm.LM` loads or measures
exactly that before it builds them.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from triedec.adapter import ModelAdapter
from triedec.costmodel import CostModel
from triedec.drafters import ModelInfo, drafter_spec
from triedec.drafters.recycling import METHOD as RECYCLING
from triedec.drafters.recycling import PAPER_TEMPLATE, RecyclingDrafter, RecyclingOptions, RecyclingProfile, best_nodes
from triedec.engine import StopRule, speculative_decode
from triedec.errors import TriedecError, positive_int
from triedec.tree import TokenTree

TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 81)
"""Tree sizes (tokens, the root included) whose verification cost is measured; 81 = the paper's
whole Token Recycling tree."""
END_TO_END_MARGIN = 0.05
"""A predicted recycling tree size is kept only if real decoding with it beats ``ar`` by this share."""
CALIBRATION_FORMAT = "triedec-calibration-2"
PROMPTS_FILE = Path(__file__).with_name("calibration_prompts.json")

log = logging.getLogger("triedec")


class Target(Protocol):
    """What calibration needs of a loaded model (a :class:`~triedec.lm.LM` is one)."""

    adapter: ModelAdapter
    eos_token_ids: frozenset[int]

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, prompt: Any, chat: bool = False) -> list[int]: ...

    def reference_model(self) -> Any: ...


@dataclass(frozen=True)
class Calibration:
    """One model on one device: its cost curve and, once measured, its recycling profile."""

    model_id: str
    device: str
    dtype: str
    cost: CostModel
    recycling: RecyclingProfile | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def profiles(self) -> dict[str, Any]:
        """The method-specific profiles measured so far, by method name (``ModelInfo.profiles``)."""
        return {} if self.recycling is None else {RECYCLING: self.recycling}

    def to_json(self) -> str:
        data = {"format": CALIBRATION_FORMAT, "model_id": self.model_id, "device": self.device, "dtype": self.dtype,
                "cost": self.cost.as_dict(), "details": self.details}
        if self.recycling is not None:
            data["recycling"] = {"rates": list(self.recycling.rates), "nodes": self.recycling.nodes,
                                 "details": self.recycling.details}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        try:
            data = json.loads(text)
            if data.get("format") != CALIBRATION_FORMAT:
                raise TriedecError(f"not a {CALIBRATION_FORMAT} file (format {data.get('format')!r})")
            rec = data.get("recycling")
            profile = None if rec is None else RecyclingProfile(tuple(rec["rates"]), rec["nodes"],
                                                                rec.get("details", {}))
            return cls(data["model_id"], data["device"], data["dtype"], CostModel.from_dict(data["cost"]), profile,
                       data.get("details", {}))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise TriedecError(f"unreadable calibration: {exc!r}") from exc


def device_key(adapter: ModelAdapter) -> str:
    """What a cost curve depends on besides the model: device (name), dtype, CPU threads, kernels."""
    device = adapter.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{torch.get_num_threads()}threads"
    key = f"{name}-{str(adapter.dtype).removeprefix('torch.')}-{adapter.kernels}"
    return "".join(c if c.isalnum() or c in "-." else "-" for c in key)


def calibration_path(cache_dir: Path, adapter: ModelAdapter) -> Path:
    return cache_dir / "calibration" / f"{adapter.model_id}-{device_key(adapter)}.json"


# ---- measurement ------------------------------------------------------------------------------


def measure_cost_model(lm: Target, sizes: Sequence[int] = TREE_SIZES, context_tokens: int = 512,
                       repeats: int = 5, k: int = 8) -> CostModel:
    """Median seconds of a forward of T tree tokens (shaped like the paper's tree cut to T nodes,
    random tokens) on a ``context_tokens`` cache, plus the top-k of its logits; sizes are
    interleaved across repeats so that machine noise spreads evenly."""
    positive_int("repeats", repeats)
    adapter = lm.adapter
    gen = torch.Generator().manual_seed(0)
    cache = adapter.new_cache(context_tokens + max(sizes))
    adapter.prefill(cache, torch.randint(adapter.vocab_size, (context_tokens,), generator=gen))
    cache.commit(range(context_tokens))
    parents_all = (-1, *PAPER_TEMPLATE.parents)  # breadth-first: any prefix is a tree
    trees = {}
    for t in sizes:
        if not 1 <= t <= len(parents_all):
            raise TriedecError(f"cost sizes must lie in [1, {len(parents_all)}], got {t}")
        tokens = torch.randint(adapter.vocab_size, (t,), generator=gen).tolist()
        trees[t] = TokenTree(tuple(tokens), parents_all[:t])
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for round_ in range(repeats + 1):  # round 0 warms up
        for t, tree in trees.items():
            start = time.perf_counter()
            logits = adapter.forward(cache, torch.tensor(tree.tokens), tree.positions(cache.length)[0],
                                     tree.visibility(cache.length))
            logits.topk(k, dim=-1)
            adapter.synchronize()
            if round_:
                times[t].append(time.perf_counter() - start)
            cache.commit([])
    seconds = {t: statistics.median(v) for t, v in times.items()}
    return CostModel(seconds, context_tokens, {"repeats": repeats, "torch": torch.__version__,
                                               "threads": torch.get_num_threads(), "kernels": adapter.kernels})


def measure_reference_forward(model: Any, vocab_size: int, sizes: Sequence[int] = (1, 16),
                              context_tokens: int = 512, repeats: int = 5) -> dict[int, float]:
    """Median seconds of stock transformers' own forward of T tokens (a causal chain) on a
    ``context_tokens`` cache, run as ``generate`` runs it (its default ``DynamicCache``): the
    yardstick the cost curve is read against. ``model`` is an unmodified transformers model."""
    from transformers import DynamicCache

    positive_int("repeats", repeats)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    times: dict[int, list[float]] = {t: [] for t in sizes}
    with torch.inference_mode():
        model(input_ids=torch.randint(vocab_size, (1, context_tokens), generator=gen).to(device),
              past_key_values=cache, use_cache=True)
        for round_ in range(repeats + 1):  # round 0 warms up
            for t in sizes:
                ids = torch.randint(vocab_size, (1, t), generator=gen).to(device)
                start = time.perf_counter()
                model(input_ids=ids, past_key_values=cache, use_cache=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_:
                    times[t].append(time.perf_counter() - start)
                cache.crop(-t)
    return {t: statistics.median(v) for t, v in times.items()}


def calibration_prompts(n: int) -> list[str]:
    """The first ``n`` calibration prompts (``calibration_prompts.json`` beside this module:
    Spec-Bench first turns, one per category in turn, never in the benchmark's sample)."""
    prompts = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))["prompts"]
    if not 1 <= n <= len(prompts):
        raise TriedecError(f"calibration has {len(prompts)} prompts; asked for {n}")
    return prompts[:n]


def _plain_info(adapter: ModelAdapter) -> ModelInfo:
    return ModelInfo(adapter.vocab_size, adapter.device, adapter.model_id)


def _decode_all(lm: Target, drafter: Any, ids: Sequence[int], rule: StopRule) -> int:
    return sum(len(new) for new in speculative_decode(lm.adapter, drafter, ids, rule))


def measure_recycling_rates(lm: Target, prompts: Sequence[str], max_new_tokens: int = 96) -> tuple[float, ...]:
    """Per node of the paper's tree, the share of decoding steps in which it was accepted, over
    ``prompts[1:]`` (``prompts[0]`` warms the adjacency matrix up). A fresh drafter is used."""
    if len(prompts) < 2:
        raise TriedecError("calibration needs at least 2 prompts (the first one warms up)")
    drafter = RecyclingDrafter(RecyclingOptions(nodes=PAPER_TEMPLATE.size), _plain_info(lm.adapter))
    rule = StopRule(max_new_tokens=max_new_tokens, eos_token_ids=lm.eos_token_ids)
    for i, prompt in enumerate(prompts):
        if i == 1:
            drafter.node_accepted[:] = 0
            drafter.steps = 0
        _decode_all(lm, drafter, lm.encode(prompt, chat=lm.has_chat_template), rule)
    return tuple((drafter.node_accepted / max(drafter.steps, 1)).tolist())


def measure_end_to_end(lm: Target, prompts: Sequence[str], cost: CostModel, profile: RecyclingProfile,
                       max_new_tokens: int = 96) -> dict[str, float]:
    """Decode ``prompts[1:]`` with ``ar`` and with recycling at ``profile.nodes`` (fresh drafters,
    warmed up on ``prompts[0]``), alternating per prompt; total seconds of each and the speedup of
    recycling over ``ar``. Both emit the same tokens (greedy is exact)."""
    if len(prompts) < 2:
        raise TriedecError("calibration needs at least 2 prompts (the first one warms up)")
    info = replace(_plain_info(lm.adapter), cost=cost, profiles={RECYCLING: profile})
    drafters = {}
    for name in ("ar", RECYCLING):
        spec = drafter_spec(name)
        assert spec is not None
        drafters[name] = spec.factory(spec.make_options({}), info)
    rule = StopRule(max_new_tokens=max_new_tokens, eos_token_ids=lm.eos_token_ids)
    seconds = {name: 0.0 for name in drafters}
    tokens = 0
    for i, prompt in enumerate(prompts):
        ids = lm.encode(prompt, chat=lm.has_chat_template)
        for name, drafter in drafters.items():
            start = time.perf_counter()
            n = _decode_all(lm, drafter, ids, rule)
            if i:
                seconds[name] += time.perf_counter() - start
                tokens += n if name == "ar" else 0
    return {"tokens": tokens, "ar_seconds": round(seconds["ar"], 6),
            "recycling_seconds": round(seconds[RECYCLING], 6),
            "speedup": round(seconds["ar"] / seconds[RECYCLING], 4)}


def measure_recycling_profile(lm: Target, cost: CostModel, prompts: int = 6, max_new_tokens: int = 96,
                              margin: float = END_TO_END_MARGIN) -> RecyclingProfile:
    """Node rates, the predicted tree size under ``cost``, and the end-to-end check (module doc)."""
    positive_int("prompts", prompts)
    positive_int("max_new_tokens", max_new_tokens)
    if not 0 <= margin < 1:
        raise TriedecError(f"margin must be in [0, 1), got {margin!r}")
    started = time.perf_counter()
    texts = calibration_prompts(max(prompts, 2))
    rates = measure_recycling_rates(lm, texts, max_new_tokens)
    predicted = best_nodes(rates, cost)
    details: dict[str, Any] = {"prompts": prompts, "max_new_tokens": max_new_tokens, "predicted_nodes": predicted,
                               "margin": margin}
    chosen = predicted
    if predicted > 0:
        check = measure_end_to_end(lm, texts, cost, RecyclingProfile(rates, predicted), max_new_tokens)
        details["end_to_end"] = check
        if check["speedup"] < 1 + margin:
            chosen = 0
    details["seconds_taken"] = round(time.perf_counter() - started, 1)
    return RecyclingProfile(rates, chosen, details)


def load_or_calibrate(lm: Target, cache_dir: Path, needs: frozenset[str] = frozenset({"cost"}), force: bool = False,
                      *, prompts: int = 6, max_new_tokens: int = 96, repeats: int = 5) -> Calibration:
    """The cached calibration of ``lm`` on its device, with at least the parts in ``needs``
    (``"cost"``, ``"recycling"``); the missing parts (all of them if ``force``) are measured and
    the file is rewritten atomically. A file from an older triedec version is measured anew. A
    forced calibration also times stock transformers' forward of 1 and 16 tokens on the same cache
    (``details["reference_forward_seconds"]``), next to triedec's curve."""
    unknown = set(needs) - {"cost", RECYCLING}
    if unknown:
        raise TriedecError(f"nothing to calibrate for {sorted(unknown)}")
    path = calibration_path(cache_dir, lm.adapter)
    cached: Calibration | None = None
    if path.is_file() and not force:
        try:
            cached = Calibration.from_json(path.read_text())
        except TriedecError as exc:
            log.info("ignoring the cached calibration %s (%s); measuring again", path, exc)
    if cached is not None and (RECYCLING not in needs or cached.recycling is not None):
        return cached
    started = time.perf_counter()
    if cached is None:
        log.info("measuring this device's cost curve (once; cached in %s)", path)
        key = (lm.adapter.model_id, device_key(lm.adapter), str(lm.adapter.dtype))
        cached = Calibration(*key, measure_cost_model(lm, repeats=repeats))
        if force:
            reference = measure_reference_forward(lm.reference_model(), lm.adapter.vocab_size, repeats=repeats)
            cached = replace(cached, details={"reference_forward_seconds": {str(t): v for t, v in reference.items()}})
    if RECYCLING in needs:
        log.info("measuring Token Recycling's node acceptance on this device (once; a minute or two)")
        cached = replace(cached, recycling=measure_recycling_profile(lm, cached.cost, prompts, max_new_tokens))
    cached = replace(cached, details={**cached.details, "seconds_taken": round(time.perf_counter() - started, 1)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(cached.to_json())
    os.replace(tmp, path)
    return cached

