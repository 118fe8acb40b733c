"""The report of a ``triedec bench --serving`` run (:mod:`triedec.bench.serving`): its tables as
markdown (each method against ``ar`` at every concurrency, paired by repeat, with a 95% interval
over repeats), and total tokens/s and latency against concurrency as a figure (each point the
median over repeats with their range; with one repeat, a 95% interval over the requests it drew)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from triedec.bench.stats import geometric_mean, ratio_interval, repeat_interval
from triedec.core.params import GREEDY_SAMPLING


def phase_runs(results: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Each (method, concurrency)'s phases, one per repeat, in repeat order (a run from before
    repeats has one each)."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in sorted(results["phases"], key=lambda row: row.get("repeat", 0)):
        runs.setdefault((r["method"], r["concurrency"]), []).append(r)
    return runs


def median_tokens_per_s(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["tokens_per_s"] for r in runs)


def paired_ratio(runs: dict[tuple[str, int], list[dict[str, Any]]], method: str, baseline: str,
                 concurrency: int) -> tuple[float, tuple[float, float] | None, int]:
    """``method``'s total tokens/s over ``baseline``'s at ``concurrency``, pairing the phases of the
    same repeat: the geometric mean of the per-repeat ratios, its 95% Student-t interval over
    repeats (:func:`~triedec.bench.stats.repeat_interval`; None with one repeat), and the pairs."""
    base = {r.get("repeat", 0): r["tokens_per_s"] for r in runs[baseline, concurrency]}
    ratios = [r["tokens_per_s"] / base[r.get("repeat", 0)] for r in runs[method, concurrency]
              if r.get("repeat", 0) in base]  # only repeats both ran, each with its own pair
    return geometric_mean(ratios), repeat_interval(ratios), len(ratios)


def _sampling_text(sampling: dict[str, Any] | None) -> str:
    if not sampling or not sampling.get("temperature"):
        return "greedy"
    shown = ", ".join(f"{k} {v}" for k, v in sampling.items()
                      if k == "temperature" or (k != "seed" and v != getattr(GREEDY_SAMPLING, k, None)))
    return f"sampled ({shown}; request k seeded {sampling.get('seed') or 0} + k)"


def serving_markdown(results: dict[str, Any]) -> str:
    """The tables of a serving run: per phase (the median over repeats, with their range), against
    the in-process solo speed, and each method against ``ar`` with paired intervals."""
    repeats = results.get("repeats", 1)
    runs = phase_runs(results)
    calibration = results.get("calibration") or {}
    lines = [f"# triedec serve under load ({results['requests']} distinct chat requests, max_tokens "
             f"{results['max_tokens']}, {_sampling_text(results.get('sampling'))})", "",
             f"- machine: {results['machine']['cpu']}, {results['machine']['torch_threads']} torch threads; precision "
             f"{results.get('precision', 'float32')}; kernels {results['kernels']}; torch "
             f"{results['machine']['torch']}, transformers {results['machine']['transformers']}; "
             f"commit {results.get('commit', '?')}",
             *_surface_lines(results.get("cost_surface")),
             *(["- the calibration was measured while the machine was busy"] if calibration.get("busy") else []),
             f"- a fresh server over fresh learned state per phase; {repeats} repeat(s) of every phase; phases in "
             "blocks, every method back to back at one concurrency and repeat, the blocks in a seeded random "
             f"order ({', '.join('@'.join(map(str, p[:2])) for p in results['phase_order'])})", "",
             "| method | concurrency | tokens/s (total" + ("; median, min-max over repeats" if repeats > 1 else "")
             + ") | x one at a time | p50 latency s | p95 latency s | identical texts |",
             "|---|---|---|---|---|---|---|"]
    alone = {m: median_tokens_per_s(rows) for (m, c), rows in runs.items() if c == 1}
    for (m, c), rows in runs.items():
        tps = median_tokens_per_s(rows)
        spread = (f" ({min(r['tokens_per_s'] for r in rows):.1f}-{max(r['tokens_per_s'] for r in rows):.1f})"
                  if len(rows) > 1 else "")
        ratio = f"{tps / alone[m]:.2f}x" if alone.get(m) else "—"
        same = sum(r["identical_texts"] for r in rows)
        total = sum(r["requests"] for r in rows)
        lines.append(f"| {m} | {c} | {tps:.1f}{spread} | {ratio} | "
                     f"{statistics.median(r['p50_latency_s'] for r in rows):.2f} | "
                     f"{statistics.median(r['p95_latency_s'] for r in rows):.2f} | {same}/{total} |")
    lines += ["", "| method | in-process `lm.generate`, one at a time | through the server, one at a time | ratio |",
              "|---|---|---|---|"]
    bases = {r["method"]: r.get("base_method", r["method"]) for r in results["phases"]}
    for m in results["methods"]:
        tps, served = results["in_process_tokens_per_s"].get(bases.get(m, m)), alone.get(m)
        if tps is None:
            continue
        lines.append(f"| {m} | {tps:.1f} | {served:.1f} | {served / tps:.2f}x |" if served else f"| {m} | {tps:.1f} | "
                     "— | — |")
    others = [m for m in results["methods"] if m != "ar"]
    if "ar" in results["methods"] and others:
        lines += ["", "| concurrency | " + " | ".join(f"{m} / ar, total tokens/s" for m in others) + " |",
                  "|---|" + "---|" * len(others)]
        for c in sorted({c for _, c in runs}):
            cells = []
            for m in others:
                if (m, c) not in runs or ("ar", c) not in runs:
                    cells.append("—")
                    continue
                point, ci, _ = paired_ratio(runs, m, "ar", c)
                cells.append(f"{point:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        if repeats > 1:
            lines.append(f"\nEach ratio pairs the two methods' phases of the same repeat: the geometric mean over "
                         f"{repeats} repeats, with its 95% Student-t interval over them (machine noise between runs, "
                         "not other prompts).")
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
    """Total tokens/s against concurrency, one line per method, each point the median over repeats
    with its range over them (with one repeat: its interval over requests, :func:`throughput_interval`),
    and p50/p95 latency beside it."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    runs = phase_runs(results)
    repeated = any(len(rows) > 1 for rows in runs.values())
    intervals = True
    for m in results["methods"]:
        cells = sorted((c, rows) for (method, c), rows in runs.items() if method == m)
        cs = [c for c, _ in cells]
        tps = [median_tokens_per_s(rows) for _, rows in cells]
        if repeated:
            cis = [(min(r["tokens_per_s"] for r in rows), max(r["tokens_per_s"] for r in rows)) for _, rows in cells]
        else:
            cis = [throughput_interval(rows[0]) for _, rows in cells]
        intervals = intervals and all(cis)
        err = [[t - c[0] if c else 0.0 for t, c in zip(tps, cis, strict=True)],
               [c[1] - t if c else 0.0 for t, c in zip(tps, cis, strict=True)]]
        left.errorbar(cs, tps, yerr=err, marker="o", capsize=3, label=m)
        right.plot(cs, [statistics.median(r["p50_latency_s"] for r in rows) for _, rows in cells], marker="o",
                   label=f"{m} p50")
        right.plot(cs, [statistics.median(r["p95_latency_s"] for r in rows) for _, rows in cells], marker="x",
                   linestyle="--", label=f"{m} p95")
    for ax, label in ((left, "total tokens/s"), (right, "latency, s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if repeated:
        title = f"median of {results.get('repeats')} repeats, bars: their range"
    else:
        title = ("95% bootstrap interval over requests" if intervals else
                 "intervals only where per-request tokens were recorded")
    left.set_title(title, fontsize=9)
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

