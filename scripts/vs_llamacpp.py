"""triedec against llama.cpp built natively, on the same GGUF, one client: ``llama-bench`` (tg and
pp), ``llama-server`` plain and with ``--spec-type ngram-mod``, and ``triedec serve`` with ``ar``
and with ``auto``, each server given the same chat-template token ids (a model without a chat template: the
question's plain text) on ``POST /v1/completions`` (streamed, greedy).

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
speed is its mean over the R passes. ``auto`` is also compared with ``llama-server --spec-type
ngram-mod`` (llama.cpp's own draft-model-free speculation) the same way. llama.cpp's tokens are
not triedec's (other arithmetic on the same codes): its texts are not compared; ``auto``'s are compared with ``ar``'s.

Build llama.cpp first (about 6 minutes): ``bash ../shared/tools/build_llamacpp.sh``. Then:

    .venv/bin/python scripts/vs_llamacpp.py --out benchmarks/native-forward-vs-llamacpp-cpu

``--report-only`` rewrites a stored run's report from its records (what this script reports now,
on the same measurements).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

from triedec.bench.datasets import load_questions, select, split, warmup_questions
from triedec.bench.report import machine_info, source_commit, versions
from triedec.bench.servers import (
    add_common_arguments,
    check_llamacpp,
    complete,
    free_port,
    llama_bench,
    llama_bench_line,
    per_prompt_speeds,
    ratio_cell,
    speeds,
    start_servers,
    summarize,
)
from triedec.model.source import default_model_path

BASELINE = "llama-server"
NGRAM = "llama-server ngram-mod"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, max_tokens=128)
    parser.add_argument("--weights", default="int4-a8", help="triedec's precision mode")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rewrite --out's results.md (and the summaries in its results.json) "
                             "from the records its results.json holds")
    args = parser.parse_args()
    if args.report_only:
        print(write_report(args.out, json.loads((args.out / "results.json").read_text())))
        return 0
    gguf = (args.model or default_model_path()).resolve()
    check_llamacpp(args.llamacpp)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="vs-llamacpp-"))

    from triedec.api.loading import load

    lm = load(gguf, weights=args.weights)
    questions = split(load_questions("spec-bench"), "evaluation")
    sample = select(questions, args.per_category)
    warm = warmup_questions("spec-bench", sample, 2)
    chat = lm.prompts.has_chat_template  # a base model (Gemma 3 270M) gets the question as plain text
    prompts = {q.id: lm.prompts.encode(q.turns[0], chat=chat) for q in sample}
    warm_prompts = [lm.prompts.encode(q.turns[0], chat=chat) for q in warm]
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
    startup: dict[str, list[str]] = {}  # the last pass's
    order = random.Random(args.seed)
    for repeat in range(args.repeats):
        # fresh servers for every pass: auto's memory then holds this pass's earlier prompts only
        with contextlib.ExitStack() as stack:
            bases, startup = start_servers(stack, commands, ports, args.startup_timeout, logs)
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
    data = {
        "args": {k: str(v) for k, v in vars(args).items()}, "model": str(gguf), "chat_template": chat,
        "commands": commands,
        "startup_lines": startup, "llama_server_version": (version.stdout + version.stderr).strip(),
        "llama_bench": bench, "records": records,
        "machine": machine_info(torch.device("cpu")), "versions": versions(), "commit": source_commit(),
        "environment": env_note}
    print(write_report(args.out, data))
    return 0


def write_report(out: Path, data: dict[str, Any]) -> str:
    """The run's summaries from its records (``data``: what results.json holds; a run stored before
    ``chat_template`` was recorded used the chat template), written to
    ``out``'s results.json (with them) and results.md; returns the markdown."""
    records, args = data["records"], data["args"]
    systems = list(data["commands"])
    per_prompt = per_prompt_speeds(records, systems)
    decode, e2e = summarize(per_prompt, systems, 0, BASELINE), summarize(per_prompt, systems, 1, BASELINE)
    vs_ngram = summarize(per_prompt, systems, 0, NGRAM)["triedec auto"]
    texts: dict[tuple[str, int], dict[str, str]] = {(r["prompt"], r["repeat"]): {} for r in records}
    for r in records:
        texts[(r["prompt"], r["repeat"])][r["system"]] = r["text"]
    auto_equal = sum(t["triedec auto"] == t["triedec ar"] for t in texts.values())
    llama_same = sum(t[BASELINE] == t[NGRAM] for t in texts.values())
    low, high = vs_ngram["geomean_interval"]
    lines = [
        f"{Path(data['model']).name}, {args['threads']} threads; triedec `--weights {args['weights']}`; "
        f"{len({r['prompt'] for r in records})} Spec-Bench evaluation prompts "
        f"({'chat template' if data.get('chat_template', True) else 'plain text: no chat template'}) x "
        f"{args['max_tokens']} greedy tokens, {args['repeats']} pass(es), one client; "
        f"intervals: 95% bootstrap over prompts.",
        "",
        llama_bench_line(data["llama_bench"]),
        "",
        "| system | decode tok/s | decode vs llama-server, geo-mean | ratio of means | end-to-end tok/s | "
        "end to end vs llama-server, geo-mean | ratio of means |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in systems:
        lines.append(f"| {name} | {ratio_cell(decode[name])} | {ratio_cell(e2e[name])} |")
    lines += ["", f"`auto` decode vs `llama-server --spec-type ngram-mod`: {vs_ngram['geomean_ratio']:.2f}x "
              f"[{low:.2f}, {high:.2f}] (geo-mean), {vs_ngram['ratio_of_means']:.2f}x (ratio of means).",
              "", f"`auto`'s text equals `ar`'s on {auto_equal} of {len(texts)} requests; llama-server's text with "
              f"ngram-mod equals its plain text on {llama_same} of {len(texts)}."]
    text = "\n".join(lines)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({
        **data, "decode": decode, "end_to_end": e2e, "auto_vs_ngram_decode": vs_ngram, "auto_equals_ar": auto_equal,
        "llama_ngram_equals_plain": llama_same, "requests": len(texts)}, indent=1, default=str))
    return text

if __name__ == "__main__":
    sys.exit(main())
