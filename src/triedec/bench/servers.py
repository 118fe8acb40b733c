"""Benchmarks that time servers side by side over HTTP: triedec's own ``triedec serve`` and
llama.cpp's ``llama-server`` (``scripts/vs_llamacpp.py``, ``scripts/json_bench.py``,
``scripts/serving_vs_llamacpp.py``; the options they share: :func:`add_common_arguments`, and
:func:`check_llamacpp` for the tools they run).

A server runs as a process for a block (:func:`server`); :func:`complete` sends one streamed
``POST /v1/completions`` of token ids and times it; :func:`speeds` turns a record into decode
tokens/s (after the first token) and end-to-end tokens/s; :func:`summarize` compares systems
per prompt against a baseline with 95% bootstrap intervals over prompts; :func:`engine_metrics`
reads what ``triedec serve``'s engine did from its metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from triedec.bench.serving import running_server
from triedec.bench.stats import bootstrap_interval, geometric_mean, percentile, ratio_interval
from triedec.core.errors import TriedecError


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server(name: str, command: list[str], port: int, timeout: float, logs: Path) -> Iterator[str]:
    """A server process for the block, its log in ``logs``; yields its base URL once healthy."""
    with (logs / f"{name}.log").open("w+") as log, \
            running_server(command, f"http://127.0.0.1:{port}", log, timeout, name) as base:
        yield base


def complete(client: httpx.Client, base: str, ids: Sequence[int], max_tokens: int,
             extra: Mapping[str, Any]) -> dict[str, Any]:
    """One streamed completion of token ids, greedy unless ``extra`` (more body fields) says
    otherwise: its text, token count, times (``sent``, ``first`` and ``last`` token, and every
    chunk's arrival in ``chunk_times``; perf_counter seconds), finish reason, llama-server's
    ``timings``, triedec's ``triedec`` extension and the ``usage`` (None where absent)."""
    body = {"prompt": list(ids), "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    text, chunks, usage, timings, ext, finish = [], 0, None, None, None, None
    chunk_times: list[float] = []
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
            ext = chunk.get("triedec") or ext
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
                if choice.get("text"):
                    text.append(choice["text"])
                    chunks += 1
                    chunk_times.append(now)
                    first = now if first is None else first
                    last = now
    if usage and usage.get("completion_tokens"):
        tokens = int(usage["completion_tokens"])
    elif timings and timings.get("predicted_n"):
        tokens = int(timings["predicted_n"])
    else:
        tokens = chunks
    return {"text": "".join(text), "tokens": tokens, "sent": sent, "first": first, "last": last,
            "chunk_times": chunk_times, "finish_reason": finish, "server_timings": timings, "triedec": ext,
            "usage": usage}


def run_phase(base: str, prompts: Mapping[str, Sequence[int]], concurrency: int, max_tokens: int,
              extra: Callable[[str], Mapping[str, Any]], timeout: float = 1800.0
              ) -> tuple[list[dict[str, Any]], float]:
    """Every prompt of ``prompts`` (by id) sent once to ``base``, ``concurrency`` in flight at a
    time, each streamed (:func:`complete`, with ``extra(prompt_id)`` as more body fields): the
    records (each with its ``prompt``), in the order of ``prompts``, and the wall seconds from the
    first send to the last token."""
    from concurrent.futures import ThreadPoolExecutor

    def one(qid: str) -> dict[str, Any]:
        with httpx.Client(timeout=timeout) as client:
            record = complete(client, base, prompts[qid], max_tokens, extra(qid))
        record["prompt"] = qid
        return record

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        records = list(pool.map(one, list(prompts)))
    return records, max((r["last"] or r["sent"] for r in records), default=started) - started


def engine_metrics(text: str) -> dict[str, Any]:
    """What ``triedec serve``'s engine did, from its ``GET /metrics`` text: ``steps`` and
    ``plain_steps`` (steps whose requests were not asked to draft), ``draft_nodes`` (verified, all
    steps together), and per load level (:func:`triedec.core.allocate.load_level`, as a string)
    ``drafting`` (1: steps at that load draft) and ``speedup`` (what drafting measurably bought
    there). Levels the server has not seen are absent."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"steps": 0.0, "plain_steps": 0.0, "draft_nodes": 0.0, "drafting": {}, "speedup": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("triedec_steps_total", "triedec_plain_steps_total"):
                out[sample.name.removeprefix("triedec_").removesuffix("_total")] = sample.value
            elif sample.name == "triedec_forward_draft_nodes_sum":
                out["draft_nodes"] = sample.value
            elif sample.name in ("triedec_drafting", "triedec_drafting_speedup"):
                key = "drafting" if sample.name == "triedec_drafting" else "speedup"
                out[key][sample.labels["load"]] = sample.value
    return out


def latency_summary(records: Sequence[Mapping[str, Any]], seconds: float) -> dict[str, Any]:
    """One load phase as a user sees it: total tokens/s (every token over the phase's wall
    seconds), and at p50 and p99, each in milliseconds: time to the first token (``ttft``, per
    request), time per output token after the first (``tpot``, per request: the span from the
    first to the last token over the tokens after the first) and the time between streamed chunks
    (``itl``, every gap of every request; a chunk may carry several tokens)."""
    ttft = [1000 * (r["first"] - r["sent"]) for r in records if r["first"] is not None]
    tpot = [1000 * (r["last"] - r["first"]) / (r["tokens"] - 1) for r in records
            if r["first"] is not None and r["tokens"] > 1]
    itl = [1000 * (b - a) for r in records for a, b in zip(r["chunk_times"], r["chunk_times"][1:], strict=False)]
    tokens = sum(int(r["tokens"]) for r in records)
    out: dict[str, Any] = {"requests": len(records), "tokens": tokens, "seconds": seconds,
                           "tokens_per_s": tokens / seconds if seconds > 0 else None}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q)
    return out


def speeds(record: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(decode tokens/s after the first token, end-to-end tokens/s) of one request (None where
    it has too few tokens to say)."""
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


def per_prompt_speeds(records: Sequence[Mapping[str, Any]], systems: Sequence[str]
                      ) -> dict[str, dict[str, list[float | None]]]:
    """Each prompt's [decode, end-to-end] tokens/s per system: the mean over its records
    (repeats), None where no record could say."""
    out: dict[str, dict[str, list[float | None]]] = {}
    for prompt in dict.fromkeys(r["prompt"] for r in records):
        out[prompt] = {}
        for name in systems:
            mine = [speeds(r) for r in records if r["prompt"] == prompt and r["system"] == name]
            out[prompt][name] = [
                statistics.fmean(v) if (v := [s[k] for s in mine if s[k] is not None]) else None for k in (0, 1)]
    return out


def summarize(per_prompt: Mapping[str, Mapping[str, Sequence[float | None]]], systems: Sequence[str], kind: int,
              baseline: str) -> dict[str, Any]:
    """Per system: mean tokens/s, geometric mean of per-prompt ratios to ``baseline`` and the
    ratio of means, each with a 95% bootstrap interval over prompts (``kind``: 0 decode, 1 end to
    end; prompts where a system has no speed are left out for all)."""
    out: dict[str, Any] = {}
    prompts = [p for p in per_prompt if all(per_prompt[p][s][kind] is not None for s in systems)]
    base = [float(per_prompt[p][baseline][kind]) for p in prompts]  # type: ignore[arg-type]
    for system in systems:
        mine = [float(per_prompt[p][system][kind]) for p in prompts]  # type: ignore[arg-type]
        ratios = [a / b for a, b in zip(mine, base, strict=True)]
        out[system] = {"prompts": len(prompts), "mean_tokens_per_s": statistics.fmean(mine),
                       "geomean_ratio": geometric_mean(ratios), "geomean_interval": bootstrap_interval(ratios),
                       "ratio_of_means": sum(mine) / sum(base), "ratio_of_means_interval": ratio_interval(mine, base)}
    return out


def ratio_cell(s: Mapping[str, Any]) -> str:
    """One :func:`summarize` entry as ``mean | geo-mean [interval] | ratio of means [interval]``."""
    low, high = s["geomean_interval"]
    rom = s["ratio_of_means_interval"]
    rom_text = f" [{rom[0]:.2f}, {rom[1]:.2f}]" if rom else ""
    return (f"{s['mean_tokens_per_s']:.1f} | {s['geomean_ratio']:.2f}x [{low:.2f}, {high:.2f}] | "
            f"{s['ratio_of_means']:.2f}x{rom_text}")


def startup_line(line: str) -> bool:
    """Whether a server's log ``line`` says what it runs on: triedec's ``runner:`` line, or
    llama.cpp's system info (``system info:`` now, ``system_info:`` in older builds)."""
    return "runner:" in line or "system info:" in line or "system_info:" in line


def start_servers(stack: contextlib.ExitStack, commands: Mapping[str, list[str]], ports: Mapping[str, int],
                  timeout: float, logs: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Every server of ``commands`` started for ``stack``'s block, one at a time (a triedec server
    may calibrate at start): each one's base URL, and the last line of its log that names its
    runner (triedec) or its CPU features (llama.cpp: ``system info: n_threads = ... | CPU : ...``;
    older builds wrote ``system_info``)."""
    bases, startup = {}, {}
    for name, command in commands.items():
        bases[name] = stack.enter_context(server(name, command, ports[name], timeout, logs))
    for name in commands:
        with open(logs / f"{name}.log") as log:
            startup[name] = [line.rstrip() for line in log if startup_line(line)][-1:]
    return bases, startup


def llama_bench_line(bench: Mapping[str, Any]) -> str:
    """:func:`llama_bench`'s figures and llama.cpp's build as one line of a report."""
    summary, row = bench["summary"], bench["rows"][0]
    return (f"llama-bench: tg128 {summary['tg128']['tokens_per_s']:.1f} ± {summary['tg128']['stddev']:.1f} tok/s, "
            f"pp256 {summary['pp256']['tokens_per_s']:.1f} ± {summary['pp256']['stddev']:.1f} tok/s "
            f"(build {row.get('build_commit')}, {row.get('cpu_info')}).")


LLAMACPP_BIN = Path.home() / ".cache" / "llamacpp-native" / "bin"
"""where ``../shared/tools/build_llamacpp.sh`` puts llama.cpp's native build"""


def add_common_arguments(parser: argparse.ArgumentParser, *, max_tokens: int, repeats: int = 2) -> None:
    """The options every script that times triedec against llama.cpp takes: the GGUF, llama.cpp's
    binaries, threads, answer length, repeats, the order's seed, the servers' startup timeout and
    the output folder."""
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--llamacpp", type=Path, default=LLAMACPP_BIN, help="llama.cpp's binaries (native build)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the runs (and sampled requests)")
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds a server may take to start (a first start measures the calibration)")
    parser.add_argument("--out", type=Path, required=True)


def check_llamacpp(folder: Path, tools: Sequence[str] = ("llama-server", "llama-bench"), otherwise: str = "") -> None:
    """Refuse with how to build them when llama.cpp's ``tools`` are not in ``folder`` (``otherwise``:
    what else the user may do, ending the message)."""
    for tool in tools:
        if not (folder / tool).is_file():
            raise TriedecError(f"{folder / tool} not found: build llama.cpp with ../shared/tools/build_llamacpp.sh"
                               + (f", or {otherwise}" if otherwise else ""))
