"""Work that repeats a prefix, through servers side by side, one client: ``triedec serve`` with
``ar`` and with ``auto``, each with its prefix trie (the default) and without
(``--no-prefix-cache``), and ``llama-server`` with its prompt cache on, as shipped (one slot), on
the same GGUF and the same token ids (the chat template rendered here, sent to
``POST /v1/completions``, streamed, greedy).

Two workloads of the project's own (``triedec/bench/data/prefix_workloads.json``; never used to
tune anything):

* **chat**: 8 conversations x 4 turns; each turn's prompt is the chat template over the earlier
  turns and the answers that same system gave, so every system extends its own conversation;
* **documents**: 8 passages (470-790 tokens) x 4 questions, each question a request of its own
  (system line, the passage, the question).

Each request goes to every system in an order shuffled per request (seeded), one at a time; the
requests go in their workload's order (a conversation's turns, a passage's questions, in turn).
Every pass (``--repeats``) starts every server afresh: nothing is cached from an earlier pass.
Per request: the time to its first token, decode tokens/s after it, its wall time, and the prompt
tokens the server took from its cache (triedec: ``usage.prompt_tokens_details.cached_tokens``;
llama-server: its ``timings.cache_n``). Reported per workload and system: the wall time of the
whole workload (the sum of its requests'), the median time to the first token of the *repeated*
requests (turns 2-4, questions 2-4) with its ratio to llama-server's, the prompt tokens computed
(not taken from a cache), the share of the repeated requests' prompt tokens taken from a cache,
and, for triedec, the trie's bytes after the workload (``/health``). The intervals are 95%
bootstrap intervals over the repeated requests (their TTFT ratios, per request, paired).

Build llama.cpp first (about 6 minutes; ``--no-llamacpp`` leaves it out):
``bash ../shared/tools/build_llamacpp.sh``. Then:

    .venv/bin/python scripts/prefix_bench.py --out benchmarks/prefix-trie-cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

from triedec.bench.datasets import prefix_workloads
from triedec.bench.report import machine_info, source_commit, versions
from triedec.bench.servers import add_common_arguments, check_llamacpp, complete, free_port, start_servers
from triedec.bench.stats import bootstrap_interval, geometric_mean
from triedec.model.source import default_model_path

LLAMA = "llama-server"
SYSTEM = "Answer from the passage, briefly."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, max_tokens=48)
    parser.add_argument("--weights", default="int4-a8", help="triedec's precision mode")
    parser.add_argument("--no-llamacpp", action="store_true", help="leave llama-server out")
    parser.add_argument("--llamacpp-args", default="",
                        help="more arguments for llama-server, e.g. '-nr' where its AMX path fails (an AMX CPU in "
                             "a VM that does not grant the tile state: SIGILL)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--passages", type=int, default=8)
    parser.add_argument("--lm-eval", action=argparse.BooleanOptionalAction, default=True,
                        help="also run lm-eval's multiple choice (evals/lm_eval: triedec_mc, triedec_mc_long) against "
                             "each triedec server")
    args = parser.parse_args()
    gguf = (args.model or default_model_path()).resolve()
    if not args.no_llamacpp:
        check_llamacpp(args.llamacpp, ("llama-server",), "pass --no-llamacpp")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    from triedec.api.loading import load

    lm = load(gguf, weights=args.weights)
    data = prefix_workloads()
    conversations = data["conversations"][: args.conversations]
    passages = data["passages"][: args.passages]

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return lm.prompts.encode(messages, chat=True)

    serve = [sys.executable, "-m", "triedec.cli.main", "serve", "--model", str(gguf), "--weights", args.weights,
             "--threads", str(args.threads), "--remeasure-after", "0"]
    systems = ["triedec ar", "triedec auto", "triedec ar no-trie", "triedec auto no-trie"]
    if not args.no_llamacpp:
        systems.append(LLAMA)
    ports = {name: free_port() for name in systems}
    commands = {name: [*serve, "--method", name.split()[1], *(["--no-prefix-cache"] if "no-trie" in name else []),
                       "--port", str(ports[name])] for name in systems if name != LLAMA}
    if not args.no_llamacpp:  # as shipped: prompt cache on, one slot
        commands[LLAMA] = [str(args.llamacpp / "llama-server"), "-m", str(gguf), "-t", str(args.threads), "-tb",
                           str(args.threads), "-np", "1", "-c", "8192", *args.llamacpp_args.split(),
                           "--port", str(ports[LLAMA])]
    order = random.Random(args.seed)
    records: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    startup: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        with contextlib.ExitStack() as stack:
            bases, startup = start_servers(stack, commands, ports, args.startup_timeout, logs)
            client = stack.enter_context(httpx.Client(timeout=600))

            def send(name: str, ids: list[int], workload: str, unit: str, index: int, repeat: int = repeat,
                     client: httpx.Client = client, bases: dict[str, str] = bases) -> str:
                got = complete(client, bases[name], ids, args.max_tokens, {})
                cached = None
                if name == LLAMA:
                    cached = (got.get("server_timings") or {}).get("cache_n")
                elif got.get("usage"):
                    cached = (got["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                records.append({"repeat": repeat, "workload": workload, "unit": unit, "index": index, "system": name,
                                "prompt_tokens": len(ids), "cached_tokens": cached, "sent": got["sent"],
                                "first": got["first"], "last": got["last"], "tokens": got["tokens"],
                                "text": got["text"]})
                return got["text"]

            histories = {name: {} for name in systems}
            for c, turns in enumerate(conversations):
                for t, question in enumerate(turns):
                    names = list(systems)
                    order.shuffle(names)
                    for name in names:
                        history = histories[name].setdefault(c, [])
                        history.append({"role": "user", "content": question})
                        answer = send(name, encode(history), "chat", f"c{c}", t)
                        history.append({"role": "assistant", "content": answer})
            memory.append({"repeat": repeat, "after": "chat", **_trie_bytes(client, bases)})
            for passage in passages:
                for q, question in enumerate(data["questions"]):
                    ids = encode([{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": f"{passage['text']}\n\nQuestion: {question}"}])
                    names = list(systems)
                    order.shuffle(names)
                    for name in names:
                        send(name, ids, "documents", passage["id"], q)
            memory.append({"repeat": repeat, "after": "documents", **_trie_bytes(client, bases)})
            if args.lm_eval:  # lm-eval's multiple choice through local-completions: each choice a request
                for task in LM_EVAL_TASKS:
                    names = [n for n in systems if n != LLAMA]
                    order.shuffle(names)
                    for name in names:
                        seconds, items = lm_eval_run(bases[name], task)
                        evals.append({"repeat": repeat, "task": task, "system": name, "seconds": seconds,
                                      "loglikelihoods": items})
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "gguf": str(gguf), "systems": systems,
              "startup": startup, "records": records, "memory": memory, "lm_eval": evals,
              "machine": machine_info(torch.device("cpu")),
              "versions": versions(), "commit": source_commit()}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(write_report(args.out, result))
    return 0


LM_EVAL_TASKS = ("triedec_mc", "triedec_mc_long")
TASKS = Path(__file__).resolve().parents[1] / "evals" / "lm_eval"


def lm_eval_run(base: str, task: str) -> tuple[float, list[Any]]:
    """lm-eval's ``task`` through ``local-completions`` against ``base`` (offline): its wall
    seconds and each item's loglikelihoods, in item order."""
    import os
    import time

    import lm_eval
    from lm_eval.tasks import TaskManager

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)
    served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    started = time.perf_counter()
    out = lm_eval.simple_evaluate(model="local-completions", tasks=[task], log_samples=True, task_manager=tasks,
                                  model_args={"base_url": f"{base}/v1/completions", "model": served,
                                              "tokenizer_backend": "remote", "max_retries": 1},
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    seconds = time.perf_counter() - started
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return seconds, [[r[0][0] for r in s["resps"]] for s in samples]


def _trie_bytes(client: httpx.Client, bases: dict[str, str]) -> dict[str, Any]:
    out = {}
    for name, base in bases.items():
        if name != LLAMA:
            health = client.get(f"{base}/health").json()
            out[name] = (health.get("prefix_cache") or {}).get("bytes", 0)
    return out


def write_report(out: Path, result: dict[str, Any]) -> str:
    records, systems = result["records"], result["systems"]
    repeats = 1 + max(r["repeat"] for r in records)
    baseline = LLAMA if LLAMA in systems else "triedec auto no-trie"
    lines = [f"{len(records) // max(1, len(systems))} requests a system ({repeats} passes, fresh servers each), "
             f"one client, {result['args']['max_tokens']} greedy tokens; commit {result['commit']}; "
             f"startup: {json.dumps(result['startup'])}", ""]
    for workload in ("chat", "documents"):
        mine = [r for r in records if r["workload"] == workload]
        lines += [f"## {workload}", "",
                  f"| system | wall s (a pass) | TTFT of repeated requests, median ms | vs {baseline} | prompt tokens "
                  f"computed (a pass) | repeated prompt tokens from cache | decode tok/s (geo-mean) |",
                  "|---|---|---|---|---|---|---|"]
        base_ttft = {(r["repeat"], r["unit"], r["index"]): r["first"] - r["sent"] for r in mine
                     if r["system"] == baseline and r["index"] > 0}
        for name in systems:
            rows = [r for r in mine if r["system"] == name]
            repeated = [r for r in rows if r["index"] > 0]
            wall = sum(r["last"] - r["sent"] for r in rows) / repeats
            ttft = [1e3 * (r["first"] - r["sent"]) for r in repeated]
            ratios = [base_ttft[(r["repeat"], r["unit"], r["index"])] / (r["first"] - r["sent"]) for r in repeated]
            low, high = bootstrap_interval(ratios)
            computed = sum(r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in rows) / repeats
            hit = sum(r["cached_tokens"] or 0 for r in repeated) / max(1, sum(r["prompt_tokens"] for r in repeated))
            decode = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in rows if r["tokens"] > 1
                      and r["last"] > r["first"]]
            lines.append(f"| {name} | {wall:.1f} | {statistics.median(ttft):.0f} | "
                         f"{geometric_mean(ratios):.2f}x sooner [{low:.2f}, {high:.2f}] | {computed:.0f} | "
                         f"{100 * hit:.0f}% | {geometric_mean(decode):.1f} |")
        lines.append("")
    texts = {}
    for r in records:
        if r["system"].startswith("triedec"):
            texts.setdefault((r["repeat"], r["workload"], r["unit"], r["index"], r["system"].split()[1]), set()).add(
                r["text"])
    unequal = sum(1 for v in texts.values() if len(v) > 1)
    lines.append(f"triedec's texts with and without the trie: {len(texts) - unequal} of {len(texts)} equal "
                 "(request by request, same method).")
    lines.append("")
    lines.append("prefix trie bytes after each workload: " + "; ".join(
        f"pass {m['repeat']} after {m['after']}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in m.items()
                                                            if k not in ("repeat", "after"))
        for m in result["memory"]))
    if result.get("lm_eval"):
        lines += ["", "## lm-eval multiple choice (local-completions, every choice a request)", "",
                  "| task | system | wall s (mean over passes) | vs the same method without the trie | loglikelihoods "
                  "equal to without the trie |", "|---|---|---|---|---|"]
        runs = result["lm_eval"]
        for task in dict.fromkeys(r["task"] for r in runs):
            for name in dict.fromkeys(r["system"] for r in runs):
                mine = [r for r in runs if r["task"] == task and r["system"] == name]
                if not mine:
                    continue
                wall = statistics.fmean(r["seconds"] for r in mine)
                without = [r for r in runs if r["task"] == task and r["system"] == f"{name} no-trie"]
                ratio = equal = ""
                if without:
                    ratio = f"{statistics.fmean(r['seconds'] for r in without) / wall:.2f}x faster"
                    same = sum(a["loglikelihoods"] == b["loglikelihoods"] for a in mine for b in without
                               if a["repeat"] == b["repeat"])
                    equal = f"{same} of {len(mine)} passes"
                lines.append(f"| {task} | {name} | {wall:.1f} | {ratio} | {equal} |")
    report = "\n".join(lines) + "\n"
    (out / "results.md").write_text(report)
    return report


if __name__ == "__main__":
    sys.exit(main())
