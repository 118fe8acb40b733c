"""Serving under load, triedec against llama.cpp built natively, on the same GGUF and the same token
ids: total tokens/s, time to the first token and per output token (p50 and p99), at several
concurrencies, greedy and sampled, with every system's texts compared across loads.

Systems: ``llama-server -np C`` (C slots for C clients; ``cache_prompt`` off) and ``triedec serve``
in each ``--modes`` precision mode with each of ``--methods`` (``--max-running C``: the same slot
count). A *phase* is one system at one concurrency C and one temperature: a fresh server (so
``auto``'s memory holds only that phase's earlier answers, never this prompt's answer from another
phase; declared warm within the phase, as a server runs), one untimed warm-up request on a tuning
prompt, then every prompt sent once, C in flight at a time, each streamed on
``POST /v1/completions``. Phases run in blocks (``triedec.bench.stats.paired_order``): every
system back to back, in an order of its own, at one (concurrency, temperature, repeat); the blocks
in one order shuffled by ``--seed``, so the phases a ratio pairs run minutes apart at most.
Sampled requests carry ``temperature``, ``top_p`` 1 and the seed ``--seed`` + the prompt's index
(llama-server also ``top_k`` 0 and ``min_p`` 0: both draw from the whole distribution).

The prompts are Spec-Bench's evaluation split (``--per-category`` per category), which no default
of triedec was tuned on. Two kinds of interval, each named where it is given: **over repeats**
(each repeat's ratio of total tokens/s, paired within the repeat; a 95% Student-t interval of
their geometric mean: machine noise between runs) and **over prompts** (each prompt's request
tokens/s at that load, sending to its last token, averaged over repeats; the ratio of means with
a 95% bootstrap interval over prompts).

Build llama.cpp first (about 6 minutes): ``bash ../shared/tools/build_llamacpp.sh``. Then:

    .venv/bin/python scripts/serving_vs_llamacpp.py --out benchmarks/serving-vs-llamacpp-cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from triedec.bench.datasets import load_questions, select, split, warmup_questions
from triedec.bench.report import machine_info, source_commit, versions
from triedec.bench.servers import (
    add_common_arguments,
    check_llamacpp,
    engine_metrics,
    free_port,
    latency_summary,
    run_phase,
    server,
)
from triedec.bench.stats import geometric_mean, paired_order, ratio_interval, repeat_interval
from triedec.model.source import default_model_path

LLAMA = "llama-server"


def system_names(modes: list[str], methods: list[str], llama: bool) -> list[str]:
    return ([LLAMA] if llama else []) + [f"triedec {mode} {method}" for mode in modes for method in methods]


def command(name: str, args: argparse.Namespace, gguf: Path, concurrency: int, port: int) -> list[str]:
    if name == LLAMA:
        return [str(args.llamacpp / "llama-server"), "-m", str(gguf), "-t", str(args.threads), "-tb",
                str(args.threads), "-np", str(concurrency), "-c", str(2048 * concurrency), "--port", str(port)]
    _, mode, method = name.split()
    return [sys.executable, "-m", "triedec.cli.main", "serve", "--model", str(gguf), "--weights", mode,
            "--method", method, "--threads", str(args.threads), "--remeasure-after", "0",
            "--max-running", str(max(concurrency, 1)), "--port", str(port)]


def body(name: str, temperature: float, seed: int) -> dict[str, Any]:
    extra: dict[str, Any] = {"cache_prompt": False} if name == LLAMA else {}
    if temperature > 0:
        extra.update(temperature=temperature, top_p=1.0, seed=seed)
        if name == LLAMA:
            extra.update(top_k=0, min_p=0.0)
    return extra


def probe_gflops(seconds: float = 0.5) -> float:
    """The machine's speed just before a phase, nothing of the benchmark running: single-thread
    float32 GFLOP/s of a 256 x 256 matmul for ``seconds``. A phase that ran on a slowed machine
    (a busy neighbour) shows here, and the report gives the range over phases."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        for _ in range(3):
            a @ b
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            count += 1
        return count * 2 * 256**3 / (time.perf_counter() - started) / 1e9
    finally:
        torch.set_num_threads(threads)


def ratio_cells(phases: list[dict[str, Any]], system: str, baseline: str, concurrency: int,
                temperature: float) -> dict[str, Any] | None:
    """``system`` over ``baseline`` at one load: over repeats (total tokens/s, paired per repeat)
    and over prompts (request tokens/s, each prompt's mean over repeats)."""
    def mine(name: str) -> dict[int, dict[str, Any]]:
        return {p["repeat"]: p for p in phases
                if p["system"] == name and p["concurrency"] == concurrency and p["temperature"] == temperature}

    a, b = mine(system), mine(baseline)
    repeats = sorted(set(a) & set(b))
    if not repeats:
        return None
    per_repeat = [a[r]["summary"]["tokens_per_s"] / b[r]["summary"]["tokens_per_s"] for r in repeats]
    decode = [b[r]["summary"]["tpot_p50_ms"] / a[r]["summary"]["tpot_p50_ms"] for r in repeats
              if a[r]["summary"]["tpot_p50_ms"] and b[r]["summary"]["tpot_p50_ms"]]
    speeds: dict[str, dict[str, list[float]]] = {}
    for name, found in ((system, a), (baseline, b)):
        for r in repeats:
            for qid, speed in found[r]["request_tokens_per_s"].items():
                speeds.setdefault(qid, {}).setdefault(name, []).append(speed)
    prompts = [q for q, s in speeds.items() if len(s.get(system, ())) == len(s.get(baseline, ())) == len(repeats)]
    num = [statistics.fmean(speeds[q][system]) for q in prompts]
    den = [statistics.fmean(speeds[q][baseline]) for q in prompts]
    return {"repeats": len(repeats), "total_ratio": geometric_mean(per_repeat), "per_repeat": per_repeat,
            "tpot_p50_ratio": geometric_mean(decode) if decode else None,
            "total_ratio_interval_over_repeats": repeat_interval(per_repeat),
            "prompts": len(prompts), "request_ratio_of_means": sum(num) / sum(den) if den else None,
            "request_ratio_interval_over_prompts": ratio_interval(num, den) if len(prompts) > 1 else None}


def cell_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    rep = c["total_ratio_interval_over_repeats"]
    pro = c["request_ratio_interval_over_prompts"]
    text = f"{c['total_ratio']:.2f}x"
    text += f" [{rep[0]:.2f}, {rep[1]:.2f}]r" if rep else ""
    if c["request_ratio_of_means"] is not None:
        text += f"; {c['request_ratio_of_means']:.2f}x"
        text += f" [{pro[0]:.2f}, {pro[1]:.2f}]p" if pro else ""
    if c.get("tpot_p50_ratio"):
        text += f"; decode {c['tpot_p50_ratio']:.2f}x"
    return text


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def engine_line(engine: dict[str, Any] | None) -> str:
    """What a triedec phase's engine did (:func:`~triedec.bench.servers.engine_metrics`), for the log."""
    if engine is None or not engine["steps"]:
        return ""
    levels = " ".join(f"{level}:{'draft' if engine['drafting'].get(level) else 'plain'}"
                      f"({engine['speedup'][level]:.2f}x)" if level in engine["speedup"] else f"{level}:?"
                      for level in sorted(engine["drafting"], key=int))
    return (f"  steps {engine['steps']:.0f}, plain {engine['plain_steps'] / engine['steps']:.0%}, "
            f"draft nodes/step {engine['draft_nodes'] / engine['steps']:.1f}; {levels}")


def header_text(prompts: int, max_tokens: int | str, repeats: int | str, threads: int | str, commit: str,
                version: str | None) -> str:
    return (f"{prompts} Spec-Bench evaluation prompts x {max_tokens} tokens, each sent once per phase, C at a time; "
            f"{repeats} repeat(s) of every phase, each on a fresh server, every system back to back in each "
            f"(C, T, repeat) block, the blocks in one seeded random order; "
            f"{threads} threads; llama-server `-np C`, triedec `--max-running C`. Commit {commit}; llama.cpp: "
            f"{version}.")


def below_ar(phases: list[dict[str, Any]], mode: str, concurrency: int, temperature: float) -> str:
    """The prompts on which ``auto`` ran below ``ar`` beyond noise at one load: slower in every
    repeat, and by more than 5% over their mean."""
    def speeds(method: str) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for p in sorted(phases, key=lambda p: p["repeat"]):
            if p["system"] == f"triedec {mode} {method}" and p["concurrency"] == concurrency \
                    and p["temperature"] == temperature:
                for qid, speed in p["request_tokens_per_s"].items():
                    out.setdefault(qid, []).append(speed)
        return out

    auto, ar = speeds("auto"), speeds("ar")
    both = [q for q in auto if q in ar and len(auto[q]) == len(ar[q])]
    below = [q for q in both if all(a < b for a, b in zip(auto[q], ar[q], strict=True))
             and statistics.fmean(auto[q]) < 0.95 * statistics.fmean(ar[q])]
    ratios = sorted(statistics.fmean(auto[q]) / statistics.fmean(ar[q]) for q in both)
    lowest = f"; the lowest per-prompt ratio {ratios[0]:.2f}x" if ratios else ""
    return (f"`auto` below `ar` beyond noise (slower in every repeat and by more than 5%) on {len(below)} of "
            f"{len(both)} prompts{lowest}" + (f": {', '.join(below)}." if below else "."))


def report(phases: list[dict[str, Any]], model: str, header: str, modes: list[str], methods: list[str],
           loads: list[int], temperatures: list[float], systems: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The results as markdown lines, and the ratio cells by temperature."""
    lines = [f"# Serving under load: triedec vs llama-server ({model})", "", header, ""]
    probes = [p["probe_gflops"] for p in phases if p.get("probe_gflops")]
    if probes:
        lines += [f"The machine before each phase (single-thread matmul, idle): median {statistics.median(probes):.0f} "
                  f"GFLOP/s, {min(probes):.0f}-{max(probes):.0f} over the {len(probes)} phases.", ""]
    ratios: dict[str, Any] = {}
    for temperature in temperatures:
        kind = "greedy" if temperature == 0 else f"sampled, T={temperature}"
        lines += [f"## {kind}", "", "| system | C | total tok/s (mean over repeats) | TTFT p50 / p99 ms | "
                  "TPOT p50 / p99 ms | ITL p50 / p99 ms |", "|---|---|---|---|---|---|"]
        for name in systems:
            for c in loads:
                mine = [p["summary"] for p in phases
                        if p["system"] == name and p["concurrency"] == c and p["temperature"] == temperature]
                if not mine:
                    continue

                def med(key: str, mine: list[dict[str, Any]] = mine) -> float | None:
                    values = [m[key] for m in mine if m[key] is not None]
                    return statistics.median(values) if values else None

                lines.append(f"| {name} | {c} | {statistics.fmean(m['tokens_per_s'] for m in mine):.1f} | "
                             f"{ms(med('ttft_p50_ms'))} / {ms(med('ttft_p99_ms'))} | {ms(med('tpot_p50_ms'))} / "
                             f"{ms(med('tpot_p99_ms'))} | {ms(med('itl_p50_ms'))} / {ms(med('itl_p99_ms'))} |")
        lines += ["", "Each cell: the ratio of total tokens/s, geometric mean over repeats `[..]r` (95% t interval "
                  "over repeats: machine noise); the ratio of mean request tokens/s, sending to last token `[..]p` "
                  "(95% bootstrap interval over prompts); and `decode`, the ratio of median time per output token "
                  "after the first (baseline's over the system's; geometric mean over repeats). Cells with 1 repeat "
                  "carry no interval over repeats.", "",
                  "| ratio | " + " | ".join(f"C={c}" for c in loads) + " |", "|---|" + "---|" * len(loads)]
        comparisons: dict[str, Any] = {}
        pairs = [(f"triedec {m} auto", f"triedec {m} ar") for m in modes if {"ar", "auto"} <= set(methods)]
        if LLAMA in systems:
            pairs += [(f"triedec {m} {method}", LLAMA) for m in modes for method in methods]
        for system, baseline in pairs:
            cells = [ratio_cells(phases, system, baseline, c, temperature) for c in loads]
            comparisons[f"{system} / {baseline}"] = cells
            lines.append(f"| {system} / {baseline} | " + " | ".join(cell_text(c) for c in cells) + " |")
        lines.append("")
        # texts across loads: each system's text at C against its text at the lowest load, same repeat
        low = min(loads)
        for name in systems:
            same = total = 0
            for p in phases:
                if p["system"] != name or p["temperature"] != temperature or p["concurrency"] == low:
                    continue
                ref = next((q for q in phases if q["system"] == name and q["temperature"] == temperature
                            and q["concurrency"] == low and q["repeat"] == p["repeat"]), None)
                if ref is None:  # a run cut short: not measured
                    continue
                for qid, text in p["texts"].items():
                    total += 1
                    same += text == ref["texts"].get(qid)
            lines.append(f"- {name}: texts equal to its own at C={low} on {same} of {total}.")
        for mode in modes:
            if {"ar", "auto"} <= set(methods):
                ar = {(p["repeat"], p["concurrency"]): p for p in phases
                      if p["system"] == f"triedec {mode} ar" and p["temperature"] == temperature}
                same = total = 0
                for p in phases:
                    if p["system"] == f"triedec {mode} auto" and p["temperature"] == temperature:
                        ref = ar.get((p["repeat"], p["concurrency"]))
                        if ref is None:
                            continue
                        for qid, text in p["texts"].items():
                            total += 1
                            same += text == ref["texts"].get(qid)
                lines.append(f"- triedec {mode}: `auto`'s text equals `ar`'s on {same} of {total}.")
                where = "one at a time" if low == 1 else f"at C={low}"
                lines.append(f"- triedec {mode}, {where}: " + below_ar(phases, mode, low, temperature))
        lines.append("")
        ratios[str(temperature)] = comparisons
    return lines, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, max_tokens=128)
    parser.add_argument("--no-llama", action="store_true", help="triedec's systems only")
    parser.add_argument("--modes", default="int4-a8,float", help="triedec precision modes (--weights)")
    parser.add_argument("--methods", default="ar,auto")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--from-json", type=Path, default=None,
                        help="render the report again from a results.json this script wrote (runs nothing)")
    args = parser.parse_args()
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        if isinstance(data, list):  # phases.partial.json of a run cut short: the options come from this command
            data = {"phases": data, "args": {k: str(v) for k, v in vars(args).items()}, "prompts":
                    sorted({q for p in data for q in p["texts"]}), "commit": "see the run's log",
                    "llama_server_version": None, "model": str(args.model or default_model_path())}
        stored = data["args"]
        modes, methods = stored["modes"].split(","), stored["methods"].split(",")
        systems = system_names(modes, methods, stored["no_llama"] != "True")
        header = data.get("header") or header_text(len(data["prompts"]), stored["max_tokens"], stored["repeats"],
                                                   stored["threads"], data["commit"], data["llama_server_version"])
        lines, _ = report(data["phases"], Path(data["model"]).name, header, modes, methods,
                          [int(c) for c in stored["concurrency"].split(",")],
                          [float(t) for t in stored["temperatures"].split(",")], systems)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    gguf = (args.model or default_model_path()).resolve()
    if not args.no_llama:
        check_llamacpp(args.llamacpp, ("llama-server",), otherwise="pass --no-llama")
    modes, methods = args.modes.split(","), args.methods.split(",")
    loads = [int(c) for c in args.concurrency.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    systems = system_names(modes, methods, not args.no_llama)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="serving-vs-llamacpp-"))

    from triedec.api.loading import load

    lm = load(gguf, weights="float")
    questions = split(load_questions("spec-bench"), "evaluation")
    sample = select(questions, args.per_category)
    warm = warmup_questions("spec-bench", sample, 1)
    prompts = {q.id: lm.prompts.encode(q.turns[0], chat=True) for q in sample}
    index = {qid: k for k, qid in enumerate(prompts)}
    warm_prompt = {"warm-up": lm.prompts.encode(warm[0].turns[0], chat=True)}
    del lm
    version = None
    if not args.no_llama:
        found = subprocess.run([str(args.llamacpp / "llama-server"), "--version"], capture_output=True, text=True)
        version = (found.stdout + found.stderr).strip()

    plan = [(name, c, t, r) for name, (c, t), r in paired_order(systems, [(c, t) for c in loads for t in temperatures],
                                                                 args.repeats, args.seed)]
    phases: list[dict[str, Any]] = []
    started = time.time()
    for k, (name, concurrency, temperature, repeat) in enumerate(plan):
        port = free_port()
        probe = probe_gflops()
        with contextlib.ExitStack() as stack:
            base = stack.enter_context(server(name.replace(" ", "-"), command(name, args, gguf, concurrency, port),
                                              port, args.startup_timeout, logs))
            run_phase(base, warm_prompt, 1, args.max_tokens, lambda _q, n=name, t=temperature: body(n, t, args.seed))
            records, seconds = run_phase(base, prompts, concurrency, args.max_tokens,
                                         lambda q, n=name, t=temperature: body(n, t, args.seed + index[q]))
            engine = None if name.startswith("llama") else engine_metrics(httpx.get(f"{base}/metrics").text)
        summary = latency_summary(records, seconds)
        phases.append({"system": name, "concurrency": concurrency, "temperature": temperature, "repeat": repeat,
                       "probe_gflops": probe, "summary": summary, "texts": {r["prompt"]: r["text"] for r in records},
                       "request_tokens_per_s": {r["prompt"]: r["tokens"] / (r["last"] - r["sent"])
                                                for r in records if r["last"] is not None and r["tokens"]},
                       "finish_reasons": {r["prompt"]: r["finish_reason"] for r in records}, "engine": engine})
        print(f"[{k + 1}/{len(plan)} {time.time() - started:6.0f}s] {name:>24} C={concurrency:<2} T={temperature} "
              f"r{repeat}: {summary['tokens_per_s']:7.1f} tok/s  ttft p50 {ms(summary['ttft_p50_ms'])} ms  "
              f"tpot p50 {ms(summary['tpot_p50_ms'])} ms  probe {probe:.0f} GFLOP/s{engine_line(engine)}", flush=True)
        (args.out / "phases.partial.json").write_text(json.dumps(phases))  # a run cut short keeps what it measured

    header = header_text(len(prompts), args.max_tokens, args.repeats, args.threads, source_commit(), version)
    lines, ratios = report(phases, gguf.name, header, modes, methods, loads, temperatures, systems)
    print("\n".join(lines))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items()}, "model": str(gguf), "prompts": list(prompts),
        "order": plan, "llama_server_version": version, "header": header, "ratios": ratios, "phases": phases,
        "machine": machine_info(torch.device("cpu")), "versions": versions(), "commit": source_commit()},
        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
