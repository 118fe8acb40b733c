"""Measure ``triedec serve`` under load on this machine: 48 requests (chat and completions, mixed
methods, streaming and not) sent 12 at a time, against the same 48 sent one at a time, to a real
uvicorn server on a loopback port. Writes ``results.json`` and ``results.md`` into ``--out``.

    .venv/bin/python scripts/load_test.py --out benchmarks/server-load-cpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import triedec
from triedec.bench.load import LoadRequest, run_load, serving, summarize_load
from triedec.bench.report import machine_info
from triedec.server import ServerConfig, create_app

TOPICS = ["the sea", "a city at night", "how rain forms", "a robot that paints", "the history of bread",
          "why cats purr", "a mountain village", "how a bicycle works"]
METHODS = [{}, {"method": "ar"}, {"method": "ngram-trie"}, {"method": "lookahead"}, {"method": "recycling"},
           {"method": "pld", "temperature": 0.7, "seed": 1}]


def requests(count: int, max_tokens: int) -> list[LoadRequest]:
    out = []
    for i in range(count):
        extra = dict(METHODS[i % len(METHODS)])
        topic = TOPICS[i % len(TOPICS)]
        if i % 4 == 3:
            out.append(LoadRequest(max_tokens, prompt=f"A short essay about {topic}.\n\n", stream=i % 2 == 0,
                                   extra=extra))
        else:
            out.append(LoadRequest(max_tokens, messages=[{"role": "user", "content": f"Write a few sentences about "
                                                          f"{topic}."}], stream=i % 2 == 0, extra=extra))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/server-load-cpu")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = triedec.load()
    config = ServerConfig(model_name="SmolLM2-135M-Instruct", method="pld", max_running=args.concurrency)
    batch = requests(args.requests, args.max_tokens)
    with serving(create_app(lm, config)) as base:
        url = f"{base}/v1"
        run_load(url, config.model_name, requests(6, 16), concurrency=6)  # warm-up: builds every method
        together, seconds = run_load(url, config.model_name, batch, concurrency=args.concurrency)
        alone, alone_seconds = run_load(url, config.model_name, batch, concurrency=1)
    same = sum(a.text == b.text for a, b in zip(together, alone, strict=True))
    results = {
        "machine": machine_info(lm.device), "kernels": lm.adapter.kernels, "requests": args.requests,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "concurrent": summarize_load(together, seconds), "one_at_a_time": summarize_load(alone, alone_seconds),
        "identical_texts": same,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    c, a = results["concurrent"], results["one_at_a_time"]
    lines = [f"# triedec serve under load ({args.requests} requests, max_tokens {args.max_tokens})", "",
             f"- machine: {results['machine']['cpu']}, {args.threads} torch threads; kernels {lm.adapter.kernels}",
             "- requests: chat and completions, methods pld (default), ar, ngram-trie, lookahead, recycling and "
             "pld sampling at temperature 0.7; half streamed", "",
             "| run | requests/s | p50 latency s | p95 latency s | tokens/s (total) |", "|---|---|---|---|---|",
             f"| {args.concurrency} at a time | {c['requests_per_s']:.2f} | {c['p50_latency_s']:.2f} | "
             f"{c['p95_latency_s']:.2f} | {c['tokens_per_s']:.1f} |",
             f"| one at a time | {a['requests_per_s']:.2f} | {a['p50_latency_s']:.2f} | {a['p95_latency_s']:.2f} | "
             f"{a['tokens_per_s']:.1f} |", "",
             f"Identical texts in both runs: {same}/{args.requests}."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
