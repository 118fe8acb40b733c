"""The prefix trie behind Ray Serve: does affinity keep what each replica's trie holds? The
project's chat and documents workloads (``triedec/bench/data/prefix_workloads.json``, as
``scripts/prefix_bench.py`` runs them: each chat turn over the earlier turns and answers, each
question over its passage) sent through ``triedec serve --ray`` as chat messages (what the router
keys on), one client, streamed, greedy, in three phases, each on a fresh cluster:

* **1 replica**: every request on the one trie;
* **2 replicas, affinity**: the router's keys (a conversation's start, a passage) as shipped;
* **2 replicas, no affinity**: each request with a ``user`` field of its own, so its key is new
  and it lands where rendezvous hashing puts a random key: what round-robin gets.

Reported per phase and workload: the share of the repeated requests' prompt tokens taken from a
trie (``usage.prompt_tokens_details.cached_tokens``; turns and questions 2-4), the median time to
their first token, and how many requests each replica answered (its ``triedec-replica`` header).

    .venv/bin/python scripts/ray_prefix_bench.py --out benchmarks/prefix-trie-ray-cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import torch

from triedec.bench.datasets import prefix_workloads
from triedec.bench.report import machine_info, source_commit, versions
from triedec.bench.servers import free_port
from triedec.bench.serving import running_server

PHASES = {"1 replica": (1, False), "2 replicas, affinity": (2, True), "2 replicas, no affinity": (2, False)}
SYSTEM = "Answer from the passage, briefly."


def ask(client: httpx.Client, base: str, messages: list[dict[str, str]], max_tokens: int,
        user: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, "method": "ar"}
    if user is not None:
        body["user"] = user
    sent, first, text, usage = time.perf_counter(), None, [], None
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        replica = response.headers.get("triedec-replica", "")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
    assert usage is not None
    return {"text": "".join(text), "ttft": (first or time.perf_counter()) - sent, "replica": replica,
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    data = prefix_workloads()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="ray-prefix-"))
    records: list[dict[str, Any]] = []
    for phase, (replicas, affinity) in PHASES.items():
        port = free_port()
        command = [sys.executable, "-m", "triedec.cli.main", "serve", "--ray", "--replicas", str(replicas),
                   "--threads", "1", "--method", "ar", "--port", str(port), "--remeasure-after", "0"]
        with (logs / f"{phase}.log").open("w+") as log, \
                running_server(command, f"http://127.0.0.1:{port}", log, args.startup_timeout, phase) as base, \
                httpx.Client(timeout=600) as client:
            def user(affinity: bool = affinity) -> str | None:
                return None if affinity else uuid.uuid4().hex

            for c, turns in enumerate(data["conversations"]):
                history: list[dict[str, str]] = []
                for t, question in enumerate(turns):
                    history.append({"role": "user", "content": question})
                    got = ask(client, base, history, args.max_tokens, user())
                    history.append({"role": "assistant", "content": got["text"]})
                    records.append({"phase": phase, "workload": "chat", "unit": c, "index": t, **got})
            for p, passage in enumerate(data["passages"]):
                for q, question in enumerate(data["questions"]):
                    messages = [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": f"{passage['text']}\n\nQuestion: {question}"}]
                    got = ask(client, base, messages, args.max_tokens, user())
                    records.append({"phase": phase, "workload": "documents", "unit": p, "index": q, **got})
        ray = Path(sys.executable).parent / "ray"  # the cluster the server started, stopped for the next phase
        if ray.is_file():
            subprocess.run([str(ray), "stop", "--force"], capture_output=True, check=False)
    lines = ["Through `triedec serve --ray`, `ar`, one client, chat messages, streamed, "
             f"{args.max_tokens} greedy tokens; commit {source_commit()}", "",
             "| phase | workload | repeated prompt tokens from a trie | vs 1 replica | TTFT of repeated requests, "
             "median ms | requests per replica |", "|---|---|---|---|---|---|"]
    rates: dict[tuple[str, str], float] = {}
    for phase in PHASES:
        for workload in ("chat", "documents"):
            rows = [r for r in records if r["phase"] == phase and r["workload"] == workload]
            repeated = [r for r in rows if r["index"] > 0]
            rate = sum(r["cached_tokens"] for r in repeated) / max(1, sum(r["prompt_tokens"] for r in repeated))
            rates[(phase, workload)] = rate
            base_rate = rates.get(("1 replica", workload))
            ratio = f"{rate / base_rate:.2f}" if base_rate else ""
            per = Counter(r["replica"] for r in rows)
            lines.append(f"| {phase} | {workload} | {100 * rate:.0f}% | {ratio} | "
                         f"{statistics.median(1e3 * r['ttft'] for r in repeated):.0f} | "
                         f"{', '.join(str(n) for _, n in sorted(per.items()))} |")
    report = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(report)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "records": records, "machine": machine_info(torch.device("cpu")),
                                                       "versions": versions(), "commit": source_commit()}, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
