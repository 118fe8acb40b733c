"""The report of a ``triedec bench --serving`` run (:mod:`triedec.bench.serving`): its tables as
markdown, and total tokens/s and latency against concurrency as a figure, each point with a 95%
interval over the requests it drew."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from triedec.bench.stats import ratio_interval


def serving_markdown(results: dict[str, Any]) -> str:
    """The tables of a serving run."""
    lines = [f"# triedec serve under load ({results['requests']} distinct chat requests, max_tokens "
             f"{results['max_tokens']}, greedy)", "",
             f"- machine: {results['machine']['cpu']}, {results['machine']['torch_threads']} torch threads; precision "
             f"{results.get('precision', 'float32')}; kernels {results['kernels']}; torch "
             f"{results['machine']['torch']}, transformers {results['machine']['transformers']}; "
             f"commit {results.get('commit', '?')}",
             *_surface_lines(results.get("cost_surface")),
             "- a fresh server over fresh learned state per phase; phases in a seeded random order "
             f"({', '.join(f'{m}@{c}' for m, c in results['phase_order'])})", "",
             "| method | concurrency | tokens/s (total) | x one at a time | p50 latency s | p95 latency s "
             "| identical texts |", "|---|---|---|---|---|---|---|"]
    alone = {r["method"]: r["tokens_per_s"] for r in results["phases"] if r["concurrency"] == 1}
    for r in results["phases"]:
        base = alone.get(r["method"])
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "—"
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{r['p50_latency_s']:.2f} | {r['p95_latency_s']:.2f} | {r['identical_texts']}/{r['requests']} |")
    lines += ["", "| method | in-process `lm.generate`, one at a time | through the server, one at a time | ratio |",
              "|---|---|---|---|"]
    bases = {r["method"]: r.get("base_method", r["method"]) for r in results["phases"]}
    for m in results["methods"]:
        tps, served = results["in_process_tokens_per_s"].get(bases.get(m, m)), alone.get(m)
        if tps is None:
            continue
        lines.append(f"| {m} | {tps:.1f} | {served:.1f} | {served / tps:.2f}x |" if served else f"| {m} | {tps:.1f} | "
                     "— | — |")
    by_c: dict[int, dict[str, float]] = {}
    for r in results["phases"]:
        by_c.setdefault(r["concurrency"], {})[r["method"]] = r["tokens_per_s"]
    others = [m for m in results["methods"] if m != "ar"]
    if "ar" in results["methods"] and others:
        lines += ["", "| concurrency | " + " | ".join(f"{m} / ar, total tokens/s" for m in others) + " |",
                  "|---|" + "---|" * len(others)]
        for c, row in sorted(by_c.items()):
            lines.append(f"| {c} | " + " | ".join(f"{row[m] / row['ar']:.2f}x" for m in others) + " |")
    if results["generate_batch"]:
        lines += ["", "| requests | triedec `generate_batch` tokens/s | transformers `generate_batch` tokens/s | "
                  "speedup | tokens that differ from solo (triedec / transformers) |", "|---|---|---|---|---|"]
        for r in results["generate_batch"]:
            differ = f"{len(r['mismatches_vs_solo'])} / {r['transformers_mismatches_vs_solo']}"
            lines.append(f"| {r['requests']} | {r['triedec_tokens_per_s']:.1f} | "
                         f"{r['transformers_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {differ} |")
        for r in results["generate_batch"]:
            for mm in r["mismatches_vs_solo"]:
                lines.append(f"- {r['requests']} requests, request {mm['request']}: first differs at token "
                             f"{mm['position']}, stock top-2 gap {mm.get('top2_gap', float('nan')):.2e}")
    return "\n".join(lines) + "\n"


def _surface_lines(surface: dict[str, Any] | None) -> list[str]:
    """The cost surface the in-process runs sized drafts under (the servers measure or load the
    same cached calibration), as one line."""
    if not surface:
        return []
    rows = [f"1 request {surface['forward_ms'].get('1', '?')} ms (1 token), "
            f"{surface['forward_ms'].get('16', '?')} ms (16)"]
    rows += [f"{b} requests {row.get(b, '?')} ms ({b} tokens)" for b, row in surface["batch_forward_ms"].items()]
    return [f"- calibration (ms per forward): {'; '.join(rows)}"]


def throughput_interval(phase: dict[str, Any]) -> tuple[float, float] | None:
    """A 95% interval for a phase's total tokens/s over the requests it drew: by Little's law its
    throughput is about ``concurrency * sum(tokens) / sum(latency)``; that ratio is bootstrapped over
    requests (:func:`~triedec.bench.stats.ratio_interval`) and scaled to the measured tokens/s.
    None for results without per-request tokens (before 2026-11-25) or with too few requests."""
    tokens, latencies = phase.get("completion_tokens_each"), phase.get("latencies_s")
    if not tokens or not latencies or len(tokens) != len(latencies):
        return None
    ci = ratio_interval(tokens, latencies)
    if ci is None:
        return None
    point = sum(tokens) / sum(latencies)
    return phase["tokens_per_s"] * ci[0] / point, phase["tokens_per_s"] * ci[1] / point


def serving_figure(results: dict[str, Any]) -> Any:
    """Total tokens/s against concurrency, one line per method, each point with its interval
    (:func:`throughput_interval`), and p50/p95 latency beside it."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    intervals = True
    for m in results["methods"]:
        rows = [r for r in results["phases"] if r["method"] == m]
        cs = [r["concurrency"] for r in rows]
        tps = [r["tokens_per_s"] for r in rows]
        cis = [throughput_interval(r) for r in rows]
        intervals = intervals and all(cis)
        err = [[t - c[0] if c else 0.0 for t, c in zip(tps, cis, strict=True)],
               [c[1] - t if c else 0.0 for t, c in zip(tps, cis, strict=True)]]
        left.errorbar(cs, tps, yerr=err, marker="o", capsize=3, label=m)
        right.plot(cs, [r["p50_latency_s"] for r in rows], marker="o", label=f"{m} p50")
        right.plot(cs, [r["p95_latency_s"] for r in rows], marker="x", linestyle="--", label=f"{m} p95")
    for ax, label in ((left, "total tokens/s"), (right, "latency, s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    left.set_title("95% bootstrap interval over requests" if intervals else
                   "intervals only where per-request tokens were recorded", fontsize=9)
    fig.suptitle(f"triedec serve: n = {results['requests']} requests x {results['max_tokens']} tokens per point")
    return fig


def serving_plot(results: dict[str, Any], out: Path) -> Path:
    """:func:`serving_figure` saved as ``serving.png`` in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = serving_figure(results)
    fig.tight_layout()
    path = out / "serving.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

