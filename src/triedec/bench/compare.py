"""``triedec compare A B``: two benchmark results files side by side, paired per prompt.

For every method both files ran, and every prompt both measured, the per-prompt ratio of B's
tokens/s to A's, with its geometric mean and 95% bootstrap interval (:mod:`triedec.bench.stats`),
and each file's own paired speedup over its stock baseline. Timings from two machines do not
compare: files whose machines differ (CPU, cores, threads, device, GPU, platform) are refused
unless ``cross_machine`` is given, and the report then says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from triedec.bench.stats import compare, ratio_text
from triedec.bench.summary import units
from triedec.core.errors import TriedecError

MACHINE_KEYS = ("cpu", "cpu_count", "torch_threads", "device", "gpu", "platform")
"""What must match for two files' timings to be compared without ``--cross-machine``."""


def read_results(path: str | Path) -> dict[str, Any]:
    """A ``results.json`` (or the directory holding one) of the speculative benchmark."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TriedecError(f"cannot read results file {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list) or "machine" not in data:
        raise TriedecError(f"{path} is not a triedec bench results file (no machine or samples)")
    if "reference" not in data:
        raise TriedecError(f"{path} is not a results file of the speculative benchmark (beam or serving results "
                           "do not compare this way)")
    return data


def machine_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The machine fields on which two results files differ (``key: A != B``)."""
    ma, mb = a["machine"], b["machine"]
    return [f"{k}: {ma.get(k)!r} != {mb.get(k)!r}" for k in MACHINE_KEYS if ma.get(k) != mb.get(k)]


def _speeds(results: Mapping[str, Any], method: str) -> dict[str, float]:
    return {s["id"]: s["new_tokens"] / s["seconds"] for s in results["samples"]
            if s["method"] == method and s["seconds"] > 0 and s.get("identical_to_reference") is not False}


def compare_results(a: Mapping[str, Any], b: Mapping[str, Any], methods: Sequence[str] | None = None,
                    cross_machine: bool = False) -> dict[str, Any]:
    """Per method: ``b_over_a`` (per-prompt tokens/s of B over A, paired), ``a_vs_stock`` and
    ``b_vs_stock`` (each file's paired speedup over its own stock baseline), as comparison dicts."""
    differences = machine_differences(a, b)
    if differences and not cross_machine:
        raise TriedecError("the two results come from different machines (" + "; ".join(differences)
                           + "): their timings do not compare; pass --cross-machine to compare them anyway")
    common = [m for m in dict.fromkeys(s["method"] for s in a["samples"])
              if m in {s["method"] for s in b["samples"]}]
    if methods:
        missing = sorted(set(methods) - set(common))
        if missing:
            raise TriedecError(f"methods not in both files: {missing}; in both: {common}")
        common = [m for m in common if m in methods]
    if not common:
        raise TriedecError("the two files share no method")
    rows: dict[str, Any] = {}
    for m in common:
        pair = compare(_speeds(b, m), _speeds(a, m), {**units(a["samples"]), **units(b["samples"])})
        rows[m] = {
            "b_over_a": None if pair is None else pair.as_dict(),
            "a_vs_stock": _vs_stock(a, m),
            "b_vs_stock": _vs_stock(b, m),
        }
    return {"cross_machine": bool(differences), "machine_differences": differences, "methods": rows}


def _vs_stock(results: Mapping[str, Any], method: str) -> dict[str, Any] | None:
    pair = compare(_speeds(results, method), _speeds(results, results["reference"]), units(results["samples"]))
    return None if pair is None else pair.as_dict()


def compare_markdown(report: Mapping[str, Any], a_name: str, b_name: str) -> str:
    def fmt(c: Mapping[str, Any] | None) -> str:
        return ratio_text(c, with_count=True)

    lines = [f"# {b_name} against {a_name}", ""]
    if report["cross_machine"]:
        lines += ["**Different machines** (compared on request; timings mix machine and method): "
                  + "; ".join(report["machine_differences"]), ""]
    lines += ["Per-prompt ratios, geometric mean [95% bootstrap interval] (prompts); B over A = B's tokens/s over "
              "A's on the same prompt:", "",
              "| method | B over A | A vs its stock baseline | B vs its stock baseline |", "|---|---|---|---|"]
    for m, r in report["methods"].items():
        lines.append(f"| {m} | {fmt(r['b_over_a'])} | {fmt(r['a_vs_stock'])} | {fmt(r['b_vs_stock'])} |")
    return "\n".join(lines) + "\n"
