"""The benchmark's metrics (the names and meanings :mod:`triedec.bench.harness` lists): per method
and category from the samples, and the leader with its paired interval."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from triedec.bench.runners import OWN_BASELINE, REFERENCE
from triedec.bench.stats import compare

# ---- metrics ----------------------------------------------------------------------------------


def _metrics(rows: Sequence[dict]) -> dict[str, Any]:
    new = sum(r["new_tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    speeds = [r["new_tokens"] / r["seconds"] for r in rows if r["seconds"] > 0]
    out: dict[str, Any] = {
        "tokens_per_s": statistics.fmean(speeds) if speeds else 0.0,
        "mean_accepted": sum(max(r["new_tokens"] - 1, 0) for r in rows) / steps if steps else 0.0,
        "steps": steps,
        "new_tokens": new,
        "computed_tokens": sum(r["computed_tokens"] for r in rows),
        "computed_per_token": sum(r["computed_tokens"] for r in rows) / new if new else 0.0,
        "mismatches": sum(r["identical_to_reference"] is False for r in rows),
        "compared": sum(r["identical_to_reference"] is not None for r in rows),
        "peak_mem_mb": max((r["peak_mem_mb"] for r in rows), default=0.0),
        "kv_mb": max((r["kv_mb"] for r in rows), default=0.0),
        "repeated_4grams": statistics.fmean(r.get("repeated_4grams", 0.0) for r in rows) if rows else 0.0,
        "prompt_copy_4grams": statistics.fmean(r.get("prompt_copy_4grams", 0.0) for r in rows) if rows else 0.0,
        "samples": len(rows),
    }
    verify = [(r.get("drafter") or {}).get("verify_tokens") for r in rows]
    if rows and all(v is not None for v in verify):  # drafters that split their tree (lookahead)
        out["verify_per_token"] = sum(verify) / new if new else 0.0
    by_depth = [r["acceptance_by_depth"] for r in rows if r.get("acceptance_by_depth")]
    if by_depth:
        depth = max(len(d) for d in by_depth)
        out["acceptance_by_depth"] = [
            statistics.fmean(d[i] for d in by_depth if len(d) > i) for i in range(depth)
        ]
    if rows and rows[-1].get("drafter"):
        out["drafter"] = rows[-1]["drafter"]
    return out


LOW_REPETITION = 0.2
"""The low-repetition slice: prompts whose reference output repeats at most this share of its own
4-grams and copies at most this share from its prompt (set before any run; never tuned)."""


def _speeds(rows: Sequence[dict]) -> dict[str, float]:
    return {r["id"]: r["new_tokens"] / r["seconds"] for r in rows if r["seconds"] > 0}


def units(samples: Sequence[dict]) -> dict[str, str]:
    """Each prompt id's unit for resampling: its question (the turns of one MT-bench question are
    not independent: the second continues the first answer)."""
    return {r["id"]: str(r.get("question", r["id"])) for r in samples}


def summarize(samples: Sequence[dict], reference: str = REFERENCE,
              token_reference: str = REFERENCE) -> dict[str, dict[str, Any]]:
    """Per-method metrics over groups of prompts: ``overall``, ``by_category`` (MT-bench with both
    turns, as Spec-Bench counts it), ``by_turn`` (each turn of multi-turn categories),
    ``slices`` (``low_repetition``: see :data:`LOW_REPETITION`, judged on ``token_reference``'s
    outputs) and, when every category is named ``PASS:CATEGORY`` (the ``repeated`` workload),
    ``by_pass``. Each group has :func:`_metrics`, Spec-Bench's ``speedup`` (ratio of mean tokens/s)
    over the speed ``reference`` and over ``ar`` (``speedup_vs_ar``), and paired per-prompt
    comparisons with bootstrap intervals against both (``vs_reference``, ``vs_ar``; see
    :mod:`triedec.bench.stats`: a question's turns are resampled together, and fewer than
    :data:`~triedec.bench.stats.MIN_UNITS` questions get no interval). A method whose tokens
    differ from the reference gets no speedup."""
    methods = list(dict.fromkeys(r["method"] for r in samples))
    categories = list(dict.fromkeys(r["category"] for r in samples))
    passes = list(dict.fromkeys(c.split(":", 1)[0] for c in categories)) \
        if categories and all(":" in c for c in categories) else []
    turns = list(dict.fromkeys((r["category"], r.get("turn", 1)) for r in samples if r.get("turns", 1) > 1))
    low = {r["id"] for r in samples if r["method"] == token_reference
           and r.get("repeated_4grams", 0.0) <= LOW_REPETITION and r.get("prompt_copy_4grams", 0.0) <= LOW_REPETITION}
    groups: list[tuple[str, str, Callable[[dict], bool]]] = [("overall", "overall", lambda r: True)]
    groups += [("by_category", c, lambda r, c=c: r["category"] == c) for c in categories]
    groups += [("by_turn", f"{c} turn {t}", lambda r, c=c, t=t: r["category"] == c and r.get("turn", 1) == t)
               for c, t in turns]
    groups += [("by_pass", p, lambda r, p=p: r["category"].split(":", 1)[0] == p) for p in passes]
    groups += [("slices", "low_repetition", lambda r: r["id"] in low)]

    question_of = units(samples)
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        result: dict[str, Any] = {"by_category": {}, **({"by_turn": {}} if turns else {}),
                                  **({"by_pass": {}} if passes else {}), "slices": {}}
        for kind, name, keep in groups:
            rows = [r for r in samples if r["method"] == m and keep(r)]
            if not rows:
                continue
            metrics = _metrics(rows)
            metrics["wrong"] = metrics["mismatches"] > 0
            for key, base in (("speedup", reference), ("speedup_vs_ar", OWN_BASELINE)):
                base_rows = [r for r in samples if r["method"] == base and keep(r)]
                base_speed = _metrics(base_rows)["tokens_per_s"] if base_rows else 0.0
                ratio = metrics["tokens_per_s"] / base_speed if base_speed else None
                if key == "speedup":
                    metrics["speedup_if_correct"] = ratio
                metrics[key] = None if metrics["wrong"] else ratio
                paired = compare(_speeds(rows), _speeds(base_rows), question_of) \
                    if base_rows and not metrics["wrong"] else None
                metrics["vs_reference" if key == "speedup" else "vs_ar"] = None if paired is None else paired.as_dict()
            if kind == "overall":
                result["overall"] = metrics
            else:
                result[kind][name] = metrics
        out[m] = result
    return out


def leader(samples: Sequence[dict], summary: dict[str, dict[str, Any]], reference: str = REFERENCE
           ) -> dict[str, Any] | None:
    """The fastest exact method (highest paired geometric-mean speedup over ``reference`` among the
    methods whose tokens were compared and all equal the reference's) and its paired comparison
    with every other method, so "A is faster than B" can be read off an interval."""
    exact = [m for m, res in summary.items() if m != reference and res["overall"]["compared"]
             and not res["overall"]["wrong"] and res["overall"].get("vs_reference")]
    if not exact:
        return None
    best = max(exact, key=lambda m: summary[m]["overall"]["vs_reference"]["geomean"])
    mine = _speeds([r for r in samples if r["method"] == best])
    question_of = units(samples)
    against = {}
    for m in summary:
        if m != best:
            c = compare(mine, _speeds([r for r in samples if r["method"] == m]), question_of)
            against[m] = None if c is None else c.as_dict()
    return {"method": best, "against": against}
