"""Structured output side by side: JSON extraction with a JSON schema, triedec against llama.cpp
built natively, on the same GGUF, one client.

Systems (each given the same chat-template token ids on ``POST /v1/completions``, streamed, greedy):

* ``llama-server`` with no grammar and ``llama-server json_schema`` (its ``json_schema`` field,
  which llama.cpp turns into a GBNF grammar): one server;
* ``triedec ar`` with no grammar and ``triedec ar+grammar`` (``response_format`` ``json_schema``,
  ``strict``): one server (``ar`` learns nothing);
* ``triedec auto`` with no grammar and ``triedec M+grammar`` for each ``--methods`` entry: a
  server each, so that no answer to a prompt is drafted from another system's answer to it.

The tasks are the project's JSON-extraction tasks (``triedec/bench/data/extraction.jsonl``: 6
schemas with nested objects, arrays, enums, nullable fields, numbers and booleans, x 6 texts):
the 30 of the evaluation split are timed; 2 of the development split (used while writing this
script) warm every system up first. Every pass (``--repeats``) starts every server afresh, and
each prompt goes to every system in an order shuffled per prompt (seeded). ``auto``'s memory of
earlier answers carries across the prompts of a pass (declared warm, as in a server).

Reported per system: decode tokens/s after the first token and end-to-end tokens/s, against
``llama-server json_schema``, against ``triedec ar+grammar`` (what speculation buys under the
grammar) and ``triedec ar+grammar`` against ``triedec ar`` (what the grammar costs); each as the
geometric mean of per-prompt ratios and the ratio of means, with 95% bootstrap intervals over
prompts (each prompt's speed the mean over passes). Validity: the answer parses as JSON and
validates against the task's schema (jsonschema), counted apart from answers cut by
``max_tokens``. For triedec with a grammar: the share of returned tokens the grammar forced
(drafted for free) and the time spent in the grammar engine per forward and as a share of the
request's engine time. Texts of every ``M+grammar`` are compared with ``ar+grammar``'s.

Build llama.cpp first (about 6 minutes): ``bash ../shared/tools/build_llamacpp.sh``. Then:

    .venv/bin/python scripts/json_bench.py --out benchmarks/json-extraction-cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import torch

from triedec.bench.datasets import extraction_tasks
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

LLAMA, LLAMA_GRAMMAR = "llama-server", "llama-server json_schema"
AR, AR_GRAMMAR = "triedec ar", "triedec ar+grammar"


def valid(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` is one JSON value that validates against ``schema``."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, max_tokens=256)
    parser.add_argument("--weights", default="int4-a8", help="triedec's precision mode")
    parser.add_argument("--methods", default="auto", help="triedec methods with the grammar besides ar (comma list)")
    parser.add_argument("--split", default="evaluation", help="the tasks timed (development: a quick check)")
    args = parser.parse_args()
    gguf = (args.model or default_model_path()).resolve()
    check_llamacpp(args.llamacpp)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="json-bench-"))

    from triedec.api.loading import load

    lm = load(gguf, weights=args.weights)
    tasks = {t.id: t for t in extraction_tasks(args.split)}
    warm = extraction_tasks("development")[:2]
    prompts = {t.id: lm.prompts.encode(t.prompt, chat=True) for t in tasks.values()}
    warm_prompts = [(lm.prompts.encode(t.prompt, chat=True), t.schema) for t in warm]
    del lm

    bench = llama_bench(args.llamacpp / "llama-bench", gguf, args.threads)
    version = subprocess.run([str(args.llamacpp / "llama-server"), "--version"], capture_output=True, text=True)
    serve = [sys.executable, "-m", "triedec.cli.main", "serve", "--model", str(gguf), "--weights", args.weights,
             "--threads", str(args.threads), "--remeasure-after", "0"]
    servers = {"llama": [str(args.llamacpp / "llama-server"), "-m", str(gguf), "-t", str(args.threads), "-tb",
                         str(args.threads), "-np", "1", "-c", "4096"],
               "ar": [*serve, "--method", "ar"], "auto": [*serve, "--method", "auto"],
               **{f"{m}+grammar": [*serve, "--method", m] for m in methods}}
    ports = {name: free_port() for name in servers}
    commands = {name: [*command, "--port", str(ports[name])] for name, command in servers.items()}

    def body(system: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The server a system runs on and what its request adds to the body."""
        if system == LLAMA:
            return "llama", {"cache_prompt": False}
        if system == LLAMA_GRAMMAR:
            return "llama", {"cache_prompt": False, "json_schema": schema}
        name = system.removeprefix("triedec ")
        if not name.endswith("+grammar"):
            return name, {}
        fmt = {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "extraction", "schema": schema, "strict": True}}}
        return ("ar" if name == "ar+grammar" else name), fmt

    systems = [LLAMA, LLAMA_GRAMMAR, AR, AR_GRAMMAR, "triedec auto", *(f"triedec {m}+grammar" for m in methods)]
    records: list[dict[str, Any]] = []
    startup: dict[str, list[str]] = {}  # the last pass's
    order = random.Random(args.seed)
    for repeat in range(args.repeats):
        with contextlib.ExitStack() as stack:
            bases, startup = start_servers(stack, commands, ports, args.startup_timeout, logs)
            client = stack.enter_context(httpx.Client(timeout=600))
            for ids, schema in warm_prompts:
                for system in systems:
                    where, extra = body(system, schema)
                    complete(client, bases[where], ids, args.max_tokens, extra)
            ids_order = list(prompts)
            order.shuffle(ids_order)
            for tid in ids_order:
                names = list(systems)
                order.shuffle(names)
                for system in names:
                    where, extra = body(system, tasks[tid].schema)
                    record = complete(client, bases[where], prompts[tid], args.max_tokens, extra)
                    record.update(system=system, prompt=tid, repeat=repeat, prompt_tokens=len(prompts[tid]),
                                  valid=valid(record["text"], tasks[tid].schema))
                    records.append(record)
                    decode, e2e = speeds(record)
                    print(f"{repeat} {tid:>12} {system:>26} {record['tokens']:4d} tokens  decode "
                          f"{decode or float('nan'):7.1f}  e2e {e2e or float('nan'):7.1f} tok/s  "
                          f"{'valid' if record['valid'] else 'INVALID'} {record['finish_reason']}", flush=True)

    per_prompt = per_prompt_speeds(records, systems)
    against = {base: [summarize(per_prompt, systems, kind, base) for kind in (0, 1)]
               for base in (LLAMA_GRAMMAR, AR_GRAMMAR, AR)}
    quality: dict[str, Any] = {}
    for system in systems:
        mine = [r for r in records if r["system"] == system]
        cut = [r for r in mine if r["finish_reason"] == "length"]
        row: dict[str, Any] = {"requests": len(mine), "valid": sum(r["valid"] for r in mine),
                               "cut_by_max_tokens": len(cut), "valid_among_finished":
                                   sum(r["valid"] for r in mine if r["finish_reason"] != "length"),
                               "tokens": sum(r["tokens"] for r in mine)}
        exts = [r["triedec"] for r in mine if r["triedec"] and r["triedec"].get("grammar_seconds") is not None]
        if exts:
            forwards = sum(e["steps"] + 1 for e in exts)  # the prefill's forward and one per step
            row.update(forced_share=sum(e["forced_tokens"] for e in exts) / max(1, row["tokens"]),
                       grammar_ms_per_forward=1e3 * sum(e["grammar_seconds"] for e in exts) / forwards,
                       grammar_share_of_engine_time=sum(e["grammar_seconds"] for e in exts)
                       / sum(e["seconds"] for e in exts),
                       tokens_per_forward=row["tokens"] / forwards)
        quality[system] = row
    texts: dict[tuple[str, int], dict[str, str]] = {}
    for r in records:
        texts.setdefault((r["prompt"], r["repeat"]), {})[r["system"]] = r["text"]
    mismatches = {f"triedec {m}+grammar": sum(t[f"triedec {m}+grammar"] != t[AR_GRAMMAR] for t in texts.values())
                  for m in methods}

    lines = [
        f"{gguf.name}, {args.threads} threads; triedec `--weights {args.weights}`; {len(prompts)} JSON-extraction "
        f"tasks ({args.split} split) x at most {args.max_tokens} greedy tokens, {args.repeats} pass(es) with fresh "
        "servers, one client, systems shuffled per prompt; intervals: 95% bootstrap over prompts (each prompt's "
        "speed the mean over passes).",
        "",
        llama_bench_line(bench),
    ]
    for base in against:
        lines += ["", f"Against `{base}`:", "",
                  "| system | decode tok/s | decode, geo-mean | ratio of means | end-to-end tok/s | "
                  "end to end, geo-mean | ratio of means |", "|---|---|---|---|---|---|---|"]
        for system in systems:
            lines.append(f"| {system} | {ratio_cell(against[base][0][system])} | "
                         f"{ratio_cell(against[base][1][system])} |")
    lines += ["", "| system | valid JSON (schema) | cut by max_tokens | valid among finished | mean tokens | "
              "forced share | grammar ms / forward | grammar share of engine time | tokens / forward |",
              "|---|---|---|---|---|---|---|---|---|"]
    for system, q in quality.items():
        finished = q["requests"] - q["cut_by_max_tokens"]
        extra = (f"{q['forced_share']:.1%} | {q['grammar_ms_per_forward']:.3f} | "
                 f"{q['grammar_share_of_engine_time']:.1%} | {q['tokens_per_forward']:.2f}"
                 if "forced_share" in q else "- | - | - | -")
        lines.append(f"| {system} | {q['valid']} of {q['requests']} | {q['cut_by_max_tokens']} | "
                     f"{q['valid_among_finished']} of {finished} | {q['tokens'] / q['requests']:.1f} | {extra} |")
    lines += ["", "Texts against `triedec ar+grammar`'s: " + ", ".join(
        f"`{name}` differs on {n} of {len(texts)}" for name, n in mismatches.items()) + "."]
    print("\n".join(lines))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items()}, "model": str(gguf), "commands": commands,
        "startup_lines": startup, "llama_server_version": (version.stdout + version.stderr).strip(),
        "llama_bench": bench, "against": {base: {"decode": v[0], "end_to_end": v[1]} for base, v in against.items()},
        "quality": quality, "mismatches_vs_ar_grammar": mismatches, "requests": len(texts),
        "mean_speeds": {s: statistics.fmean(v) for s in systems
                        if (v := [x for p in per_prompt.values() if (x := p[s][0]) is not None])},
        "records": records, "machine": machine_info(torch.device("cpu")), "versions": versions(),
        "commit": source_commit()}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
