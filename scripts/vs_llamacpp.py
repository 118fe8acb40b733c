"""triedec against llama.cpp built natively, on the same GGUF, one client: ``llama-bench`` (tg and
pp), ``llama-server`` plain and with ``--spec-type ngram-mod``, and ``triedec serve`` with ``ar``
and with ``auto``, each server given the same chat-template token ids on ``POST /v1/completions``
(streamed, greedy).

Every server is up during a pass; each prompt goes to every system in an order shuffled per
prompt (seeded), one request at a time, after two warm-up prompts from the tuning split. The
timed prompts are the evaluation split of Spec-Bench (``--per-category`` per category), which no
default of triedec was tuned on. ``auto`` runs on a server of its own, so its memory of earlier
answers holds only earlier prompts' (declared warm: learned state carried across the sample, as
in a server; never the same prompt's ``ar`` answer), and every pass (``--repeats``) starts every
server afresh, so that no pass drafts from an earlier pass's answer to the same prompt.

Per request: ``decode`` tokens/s after the first token ((tokens - 1) over the time from the first
streamed token to the last) and ``end-to-end`` tokens/s (tokens over the time from sending to
the last token). Per system against ``llama-server`` plain: the geometric mean of per-prompt
ratios with a 95% bootstrap interval over prompts, and the ratio of means (mean tokens/s over
mean tokens/s) with its bootstrap interval over prompts. With ``--repeats`` R, each prompt's
speed is its mean over the R passes. llama.cpp's tokens are not triedec's (other arithmetic
on the same codes): its texts are not compared; ``auto``'s are compared with ``ar``'s.

Build llama.cpp first (about 6 minutes): ``bash ../shared/tools/build_llamacpp.sh``. Then:

    .venv/bin/python scripts/vs_llamacpp.py --out benchmarks/native-forward-vs-llamacpp-cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from triedec.bench.datasets import load_questions, select, split, warmup_questions
from triedec.bench.report import machine_info, source_commit, versions
from triedec.bench.serving import running_server
from triedec.bench.stats import bootstrap_interval, geometric_mean, ratio_interval
from triedec.core.errors import TriedecError
from triedec.model.source import default_model_path

BASELINE = "llama-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server(name: str, command: list[str], port: int, timeout: float, logs: Path) -> Iterator[str]:
    """A server process for the block, its log in ``logs``; yields its base URL once healthy."""
    with (logs / f"{name}.log").open("w+") as log, \
            running_server(command, f"http://127.0.0.1:{port}", log, timeout, name) as base:
        yield base


def complete(client: httpx.Client, base: str, ids: list[int], max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One streamed greedy completion of token ids: its text, token count and times."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    text, chunks, usage, timings = [], 0, None, None
    first = last = None
    sent = time.perf_counter()
    # a connection of its own (Connection: close): a kept-alive one could be closed by the server's
    # idle timeout just as the next request goes out on it
    with client.stream("POST", f"{base}/v1/completions", json=body, headers={"Connection": "close"}) as response:
        if response.status_code != 200:
            raise TriedecError(f"{base}: HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    text.append(choice["text"])
                    chunks += 1
                    first = now if first is None else first
                    last = now
    if usage and usage.get("completion_tokens"):
        tokens = int(usage["completion_tokens"])
    elif timings and timings.get("predicted_n"):
        tokens = int(timings["predicted_n"])
    else:
        tokens = chunks
    return {"text": "".join(text), "tokens": tokens, "sent": sent, "first": first, "last": last,
            "server_timings": timings}


def speeds(record: dict[str, Any]) -> tuple[float | None, float | None]:
    """(decode tokens/s after the first token, end-to-end tokens/s) of one request."""
    if record["first"] is None or record["tokens"] < 1:
        return None, None
    end_to_end = record["tokens"] / (record["last"] - record["sent"])
    span = record["last"] - record["first"]
    decode = (record["tokens"] - 1) / span if record["tokens"] > 1 and span > 0 else None
    return decode, end_to_end


def llama_bench(binary: Path, gguf: Path, threads: int) -> dict[str, Any]:
    """``llama-bench`` tg128 and pp256, 3 repetitions, as JSON (its build and CPU are in it)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", "256", "-n", "128", "-r", "3",
                          "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return {"rows": rows, "summary": {("pp" if r["n_prompt"] else "tg") + str(r["n_prompt"] or r["n_gen"]):
                                      {"tokens_per_s": r["avg_ts"], "stddev": r["stddev_ts"]} for r in rows}}


def summarize(per_prompt: dict[str, dict[str, list[float]]], systems: list[str], kind: int) -> dict[str, Any]:
    """Per system: mean tokens/s, geometric mean of per-prompt ratios to the baseline and the ratio
    of means, each with a 95% bootstrap interval over prompts (``kind``: 0 decode, 1 end to end)."""
    out: dict[str, Any] = {}
    prompts = [p for p in per_prompt if all(per_prompt[p][s][kind] is not None for s in systems)]
    base = [per_prompt[p][BASELINE][kind] for p in prompts]
    for system in systems:
        mine = [per_prompt[p][system][kind] for p in prompts]
        ratios = [a / b for a, b in zip(mine, base, strict=True)]
        out[system] = {"prompts": len(prompts), "mean_tokens_per_s": statistics.fmean(mine),
                       "geomean_ratio": geometric_mean(ratios), "geomean_interval": bootstrap_interval(ratios),
                       "ratio_of_means": sum(mine) / sum(base), "ratio_of_means_interval": ratio_interval(mine, base)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--llamacpp", type=Path, default=Path.home() / ".cache" / "llamacpp-native" / "bin")
    parser.add_argument("--weights", default="int4-a8", help="triedec's precision mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gguf = (args.model or default_model_path()).resolve()
    for tool in ("llama-server", "llama-bench"):
        if not (args.llamacpp / tool).is_file():
            raise TriedecError(f"{args.llamacpp / tool} not found: build llama.cpp with "
                               "../shared/tools/build_llamacpp.sh")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="vs-llamacpp-"))

    from triedec.api.loading import load

    lm = load(gguf, weights=args.weights)
    questions = split(load_questions("spec-bench"), "evaluation")
    sample = select(questions, args.per_category)
    warm = warmup_questions("spec-bench", sample, 2)
    prompts = {q.id: lm.prompts.encode(q.turns[0], chat=True) for q in sample}
    warm_prompts = [lm.prompts.encode(q.turns[0], chat=True) for q in warm]
    del lm

    bench = llama_bench(args.llamacpp / "llama-bench", gguf, args.threads)
    version = subprocess.run([str(args.llamacpp / "llama-server"), "--version"], capture_output=True, text=True)
    llama_common = ["-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads), "-np", "1", "-c", "4096"]
    serve = [sys.executable, "-m", "triedec.cli.main", "serve", "--model", str(gguf), "--weights", args.weights,
             "--threads", str(args.threads), "--remeasure-after", "0"]
    ports = {name: free_port() for name in (BASELINE, "llama-server ngram-mod", "triedec ar", "triedec auto")}
    commands = {
        BASELINE: [str(args.llamacpp / "llama-server"), *llama_common, "--port", str(ports[BASELINE])],
        "llama-server ngram-mod": [str(args.llamacpp / "llama-server"), *llama_common, "--spec-type", "ngram-mod",
                                   "--port", str(ports["llama-server ngram-mod"])],
        "triedec ar": [*serve, "--method", "ar", "--port", str(ports["triedec ar"])],
        "triedec auto": [*serve, "--method", "auto", "--port", str(ports["triedec auto"])],
    }
    extra = {name: ({"cache_prompt": False} if name.startswith("llama") else {}) for name in commands}
    systems = list(commands)
    records: list[dict[str, Any]] = []
    env_note = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    startup: dict[str, list[str]] = {}
    order = random.Random(args.seed)
    for repeat in range(args.repeats):
        # fresh servers for every pass: auto's memory then holds this pass's earlier prompts only
        with contextlib.ExitStack() as stack:
            bases = {}
            for name, command in commands.items():  # one at a time: a triedec server may calibrate at start
                bases[name] = stack.enter_context(server(name, command, ports[name], args.startup_timeout, logs))
            for name in systems:
                with open(logs / f"{name}.log") as log:
                    startup[name] = [line.rstrip() for line in log if "runner:" in line or "system_info" in line][-1:]
            client = stack.enter_context(httpx.Client(timeout=600))
            for ids in warm_prompts:
                for name in systems:
                    complete(client, bases[name], ids, args.max_tokens, extra[name])
            ids_order = list(prompts)
            order.shuffle(ids_order)
            for qid in ids_order:
                names = list(systems)
                order.shuffle(names)
                for name in names:
                    record = complete(client, bases[name], prompts[qid], args.max_tokens, extra[name])
                    record.update(system=name, prompt=qid, repeat=repeat, prompt_tokens=len(prompts[qid]))
                    records.append(record)
                    decode, e2e = speeds(record)
                    print(f"{repeat} {qid:>28} {name:>24} {record['tokens']:4d} tokens  decode "
                          f"{decode or float('nan'):7.1f}  e2e {e2e or float('nan'):7.1f} tok/s", flush=True)
    per_prompt: dict[str, dict[str, list[float]]] = {}
    for qid in prompts:
        per_prompt[qid] = {}
        for name in systems:
            mine = [speeds(r) for r in records if r["prompt"] == qid and r["system"] == name]
            per_prompt[qid][name] = [
                statistics.fmean(v) if (v := [s[k] for s in mine if s[k] is not None]) else None for k in (0, 1)]
    decode, e2e = summarize(per_prompt, systems, 0), summarize(per_prompt, systems, 1)
    texts = {(r["prompt"], r["repeat"]): {} for r in records}
    for r in records:
        texts[(r["prompt"], r["repeat"])][r["system"]] = r["text"]
    auto_equal = sum(t["triedec auto"] == t["triedec ar"] for t in texts.values())
    llama_same = sum(t[BASELINE] == t["llama-server ngram-mod"] for t in texts.values())

    def cell(s: dict[str, Any]) -> str:
        low, high = s["geomean_interval"]
        rom = s["ratio_of_means_interval"]
        rom_text = f" [{rom[0]:.2f}, {rom[1]:.2f}]" if rom else ""
        return (f"{s['mean_tokens_per_s']:.1f} | {s['geomean_ratio']:.2f}x [{low:.2f}, {high:.2f}] | "
                f"{s['ratio_of_means']:.2f}x{rom_text}")

    summary = bench["summary"]
    lines = [
        f"{gguf.name}, {args.threads} threads; triedec `--weights {args.weights}`; {len(prompts)} Spec-Bench "
        f"evaluation prompts x {args.max_tokens} greedy tokens, {args.repeats} pass(es), one client; "
        f"intervals: 95% bootstrap over prompts.",
        "",
        f"llama-bench: tg128 {summary['tg128']['tokens_per_s']:.1f} ± {summary['tg128']['stddev']:.1f} tok/s, "
        f"pp256 {summary['pp256']['tokens_per_s']:.1f} ± {summary['pp256']['stddev']:.1f} tok/s "
        f"(build {bench['rows'][0].get('build_commit')}, {bench['rows'][0].get('cpu_info')}).",
        "",
        "| system | decode tok/s | decode vs llama-server, geo-mean | ratio of means | end-to-end tok/s | "
        "end to end vs llama-server, geo-mean | ratio of means |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in systems:
        lines.append(f"| {name} | {cell(decode[name])} | {cell(e2e[name])} |")
    lines += ["", f"`auto`'s text equals `ar`'s on {auto_equal} of {len(texts)} requests; llama-server's text with "
              f"ngram-mod equals its plain text on {llama_same} of {len(texts)}."]
    print("\n".join(lines))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items()}, "model": str(gguf), "commands": commands,
        "startup_lines": startup, "llama_server_version": (version.stdout + version.stderr).strip(),
        "llama_bench": bench, "decode": decode, "end_to_end": e2e, "auto_equals_ar": auto_equal,
        "llama_ngram_equals_plain": llama_same, "requests": len(texts), "records": records,
        "machine": machine_info(torch.device("cpu")), "versions": versions(), "commit": source_commit(),
        "environment": env_note},
        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
