"""What the evaluation fields cost through ``triedec serve``: logprobs, ``n`` and prompt scoring.

One model (default: the embedded SmolLM2-135M-Instruct, in float32 unless ``--weights``), one
server in this process on loopback, one client at a time, learning off (``auto`` starts every
request cold, so no system gains from an answer another one produced). Three comparisons, each
paired per prompt, the systems in a fresh seeded order per prompt and repeat:

* **logprobs**: the same chat request (``auto``, greedy, ``--max-tokens``) streamed with and
  without ``logprobs: true, top_logprobs: 5``. Decode (tokens after the first over the time after
  the first token's chunk) and end-to-end (tokens over the whole request) apart.
* **n**: one request with ``n: 8`` against one with ``n: 1`` (``auto``, temperature 0.8, a seed
  per prompt): total completion tokens per second of wall time.
* **prompt scoring**: ``echo`` with ``max_tokens: 0`` and ``logprobs: 1`` (what lm-eval sends)
  against the prefill of ``LM.generate`` on the same token ids in the same process: prompt tokens
  per second, the server's side from its own ``seconds`` (the run's prefill) and the client's
  wall time both given.

Each line: geometric mean of per-prompt ratios with a 95% bootstrap interval over prompts, and
the ratio of means (total tokens over total seconds). Prompts: Spec-Bench's evaluation split,
``--per-category`` per category less the first of each (the prompts the script was tried on while
it was written). Run it with nothing else on the machine:

    .venv/bin/python scripts/fields_bench.py --out benchmarks/fields-cpu
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import torch

import triedec
from triedec.bench.datasets import load_questions, select, split
from triedec.bench.load import serving
from triedec.bench.report import machine_info, source_commit, versions
from triedec.bench.stats import MIN_UNITS, bootstrap_interval, geometric_mean
from triedec.server import ServerConfig, create_app

MODEL = "bench"


def stream_chat(base: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed chat request: tokens, seconds to the first content chunk, seconds in all."""
    start = time.perf_counter()
    first = None
    usage: dict[str, int] = {}
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=payload, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if first is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                first = time.perf_counter()
    end = time.perf_counter()
    tokens = usage["completion_tokens"]
    assert first is not None and tokens > 1
    return {"tokens": tokens, "first": first - start, "seconds": end - start}


def post(base: str, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    response = httpx.post(f"{base}{path}", json=body, timeout=600)
    response.raise_for_status()
    return response.json(), time.perf_counter() - start


def summary(name: str, pairs: list[tuple[float, float, float, float]]) -> dict[str, Any]:
    """``pairs``: (tokens, seconds) of the system, then of its baseline, per prompt (repeats
    averaged first)."""
    ratios = [(a / s) / (b / t) for a, s, b, t in pairs]
    out: dict[str, Any] = {"name": name, "prompts": len(pairs), "geomean": geometric_mean(ratios),
                           "ratio_of_means": (sum(p[0] for p in pairs) / sum(p[1] for p in pairs))
                           / (sum(p[2] for p in pairs) / sum(p[3] for p in pairs)),
                           "system_tok_s": sum(p[0] for p in pairs) / sum(p[1] for p in pairs),
                           "baseline_tok_s": sum(p[2] for p in pairs) / sum(p[3] for p in pairs)}
    if len(pairs) >= MIN_UNITS:
        out["interval"] = bootstrap_interval(ratios)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--weights", default="float")
    parser.add_argument("--per-category", type=int, default=3,
                        help="prompts per category, less the first (the one the script was tried on)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    lm = triedec.load(args.model, weights=args.weights)
    evaluation = split(load_questions("spec-bench"), "evaluation")
    tried = {q.id for q in select(evaluation, 1)}  # what the script was developed on: never published
    questions = [q for q in select(evaluation, args.per_category) if q.id not in tried]
    rng = random.Random(args.seed)
    config = ServerConfig(model_name=MODEL, method="auto", learning="off")
    rows: dict[str, list[dict[str, Any]]] = {"logprobs": [], "n": [], "scoring": []}
    with serving(create_app(lm, config)) as base:
        warm = [{"role": "user", "content": "Say hello."}]
        stream_chat(base, {"model": MODEL, "messages": warm, "max_tokens": 8})  # first request: warm-up
        for q_index, question in enumerate(questions):
            messages = [{"role": "user", "content": question.turns[0]}]
            ids = lm.encode(messages, chat=True)
            for repeat in range(args.repeats):
                jobs = [("logprobs", "plain"), ("logprobs", "with"), ("n", "1"), ("n", "8"), ("scoring", "echo"),
                        ("scoring", "prefill")]
                rng.shuffle(jobs)
                for part, system in jobs:
                    record = {"prompt": question.id, "repeat": repeat, "system": system, "prompt_tokens": len(ids)}
                    if part == "logprobs":
                        body = {"model": MODEL, "messages": messages, "max_tokens": args.max_tokens}
                        if system == "with":
                            body |= {"logprobs": True, "top_logprobs": 5}
                        record |= stream_chat(base, body)
                    elif part == "n":
                        body = {"model": MODEL, "prompt": ids, "max_tokens": args.n_tokens, "temperature": 0.8,
                                "seed": 1000 * q_index + repeat, "n": int(system)}
                        found, seconds = post(base, "/v1/completions", body)
                        record |= {"tokens": found["usage"]["completion_tokens"], "seconds": seconds}
                    elif system == "echo":
                        body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
                        found, seconds = post(base, "/v1/completions", body)
                        assert len(found["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
                        record |= {"tokens": len(ids), "seconds": seconds,
                                   "engine_seconds": found["triedec"]["seconds"]}
                    else:  # the library's prefill of the same ids, in this process (the server idles)
                        start = time.perf_counter()
                        result = lm.generate(ids, "ar", max_new_tokens=1)
                        record |= {"tokens": len(ids), "seconds": time.perf_counter() - start,
                                   "engine_seconds": result.stats.prefill_seconds}
                    rows[part].append(record)
                    print(part, json.dumps(record), flush=True)

    def paired(part: str, system: str, baseline: str, tokens: str, seconds: Any) -> list[tuple]:
        out = []
        for question in questions:
            mine = [r for r in rows[part] if r["prompt"] == question.id and r["system"] == system]
            base_rows = [r for r in rows[part] if r["prompt"] == question.id and r["system"] == baseline]
            out.append((sum(r[tokens] for r in mine), sum(seconds(r) for r in mine),
                        sum(r[tokens] for r in base_rows), sum(seconds(r) for r in base_rows)))
        return out

    def decode(r: dict[str, Any]) -> float:
        return r["seconds"] - r["first"]

    for part in ("logprobs",):
        for r in rows[part]:
            r["decode_tokens"] = r["tokens"] - 1
    results = [
        summary("logprobs top 5 vs none, decode", paired("logprobs", "with", "plain", "decode_tokens", decode)),
        summary("logprobs top 5 vs none, end-to-end",
                paired("logprobs", "with", "plain", "tokens", lambda r: r["seconds"])),
        summary("n=8 vs n=1, total tokens/s", paired("n", "8", "1", "tokens", lambda r: r["seconds"])),
        summary("prompt scoring vs generate's prefill, engine",
                paired("scoring", "echo", "prefill", "tokens", lambda r: r["engine_seconds"])),
        summary("prompt scoring vs generate's prefill, wall",
                paired("scoring", "echo", "prefill", "tokens", lambda r: r["seconds"])),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "scripts/fields_bench.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                             vars(args).items() if v is not None),
            "commit": source_commit(), "versions": versions(), "machine": machine_info(torch.device("cpu")),
            "prompts": [q.id for q in questions], "learning": "off", "method": "auto"}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results, "rows": rows}, indent=1))
    lines = ["# Evaluation fields through `triedec serve`", "", f"`{meta['command']}`, commit {meta['commit']}; "
             f"{len(questions)} prompts x {args.repeats} repeats, one client, learning off, `auto`.", "",
             "| comparison | geomean [95% interval over prompts] | ratio of means | tok/s (system / baseline) |",
             "|---|---|---|---|"]
    for r in results:
        interval = r.get("interval")
        shown = f"{r['geomean']:.2f}x" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
        lines.append(f"| {r['name']} | {shown} | {r['ratio_of_means']:.2f}x | "
                     f"{r['system_tok_s']:.1f} / {r['baseline_tok_s']:.1f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
