"""Precision modes side by side in one run: speed, quality, and exactness against ``ar``.

For each mode (float32, bfloat16, int8, int4 and int4-a8 weights) of one model (default: the embedded
SmolLM2-135M-Instruct), loaded in one process:

* forward time at 1, 4 and 16 new tokens on a 256-token cache (a chain; the median of repeats,
  modes interleaved), and ``ar``'s step against float32's;
* quality against float32: along float32's greedy continuation of each prompt, the share of
  positions where the mode's top token is float32's (teacher-forced, so one early difference does
  not hide the rest), and the share of prompts whose whole greedy answer equals float32's;
  perplexity of the prompts' own text;
* decoding: ``ar`` and ``auto`` tokens/s per prompt (greedy, chat template), the (mode, method)
  order shuffled per prompt with a fixed seed, per-prompt ratios against float32 ``ar`` (geometric
  mean, 95% bootstrap interval from 10 prompts up); and whether ``auto`` returned ``ar``'s tokens
  in its own mode (it must).

Learned state: each mode's ``auto`` starts cold and learns across the run's prompts, the same
prompts in the same order for every mode (declared warm after the first). Calibration: each mode's
own (measured on first use if not cached), recorded. Prompts: the Spec-Bench evaluation split.
Run it with nothing else on the machine:

    .venv/bin/python scripts/precision_modes.py --out benchmarks/precision-cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import triedec
from triedec.bench.datasets import load_questions, select, split
from triedec.bench.report import machine_info, source_commit, versions
from triedec.bench.stats import MIN_UNITS, bootstrap_interval, geometric_mean

MODES = {"float32": {"weights": "float"}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"weights": "int8"},
         "int4": {"weights": "int4"}, "int4-a8": {"weights": "int4-a8"}}


def context_cache(lm: triedec.LM, context: int = 256) -> object:
    """A cache holding ``context`` random tokens (prefilled once per mode)."""
    adapter = lm.adapter
    cache = adapter.new_cache(context + 17)
    gen = torch.Generator().manual_seed(0)
    adapter.prefill(cache, torch.randint(0, adapter.vocab_size, (context,), generator=gen))
    cache.commit(list(range(context)))
    return cache


def forward_ms(lm: triedec.LM, cache: object, rows: int) -> float:
    """One forward of ``rows`` new tokens (a chain) on ``cache``, ms; the new tokens are dropped."""
    adapter = lm.adapter
    tokens = torch.randint(0, adapter.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    visible = torch.ones((rows, rows), dtype=torch.bool).tril()
    adapter.synchronize()
    start = time.perf_counter()
    adapter.forward(cache, tokens, torch.arange(cache.length, cache.length + rows), visible)
    adapter.synchronize()
    seconds = time.perf_counter() - start
    cache.commit([])
    return seconds * 1000


@torch.inference_mode()
def quality(lm: triedec.LM, references: list[list[int]], prompts: list[str], new: int, chat: bool) -> dict[str, float]:
    """Top-1 agreement with float32 along its greedy continuations ``references`` (one per
    prompt), whole-answer agreement, and perplexity of the prompts' text."""
    agree = total = whole = 0
    nll = count = 0.0
    for text, theirs in zip(prompts, references, strict=True):
        ours = lm.generate(text, "ar", max_new_tokens=new, chat=chat)
        whole += ours.token_ids == theirs
        ids = lm.prompts.encode(text, chat=chat)
        sequence = torch.tensor([ids + theirs], device=lm.device)
        logits = lm.reference_model()(sequence).logits[0].float()
        predicted = logits[len(ids) - 1 : -1].argmax(-1)
        agree += int((predicted == sequence[0, len(ids):]).sum())
        total += len(theirs)
        plain = torch.tensor([lm.tokenizer.encode(text)], device=lm.device)
        plain_logits = lm.reference_model()(plain).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(plain_logits, plain[0, 1:], reduction="sum"))
        count += plain.shape[1] - 1
    return {"top1_agreement_with_float32": agree / total, "whole_answers_equal_float32": whole / len(prompts),
            "perplexity_of_prompts": float(torch.exp(torch.tensor(nll / count)))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15, help="forwards timed per mode and row count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: float32 and bfloat16 only on a GPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, float32 first (the reference): any of {', '.join(MODES)}")
    parser.add_argument("--out", default="benchmarks/precision-cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say = lambda text: print(f"precision_modes: {text}", file=sys.stderr, flush=True)  # noqa: E731

    questions = select(split(load_questions("spec-bench"), "evaluation"), args.per_category)
    prompts = [q.turns[0] for q in questions]
    modes = args.modes.split(",")
    if modes[0] != "float32" or not set(modes) <= set(MODES):
        parser.error(f"--modes must start with float32 and name only {', '.join(MODES)}")
    lms = {}
    for name in modes:
        kwargs = MODES[name]
        say(f"loading {name}")
        lms[name] = triedec.load(args.model, device=args.device, **kwargs)
        lms[name].generate("Hello", "auto", max_new_tokens=4)  # calibrates now if not cached
    for lm in lms.values():
        lm.generate("Warm up the kernels on a short request.", "ar", max_new_tokens=8)

    say("forward times")
    times: dict[str, dict[int, list[float]]] = {n: {r: [] for r in (1, 4, 16)} for n in lms}
    caches = {name: context_cache(lm) for name, lm in lms.items()}
    for _ in range(args.repeats):
        for rows in (1, 4, 16):
            for name, lm in lms.items():
                times[name][rows].append(forward_ms(lm, caches[name], rows))
    del caches
    forward = {n: {str(r): statistics.median(v) for r, v in per.items()} for n, per in times.items()}
    say(f"forward ms (median) {json.dumps(forward)}")

    chat = lms["float32"].prompts.has_chat_template  # a base model (no template) gets the plain text
    say("quality")
    with torch.inference_mode():
        references = [lms["float32"].generate(text, "ar", max_new_tokens=args.max_new_tokens, chat=chat).token_ids
                      for text in prompts]
    qualities = {n: quality(lm, references, prompts, args.max_new_tokens, chat) for n, lm in lms.items()}

    say(f"decoding {len(prompts)} prompts")
    rng = random.Random(args.seed)
    runs: dict[str, dict[str, list[float]]] = {n: {"ar": [], "auto": []} for n in lms}
    mismatches = {n: 0 for n in lms}
    for i, text in enumerate(prompts):
        order = [(n, m) for n in lms for m in ("ar", "auto")]
        rng.shuffle(order)
        got: dict[tuple[str, str], list[int]] = {}
        for name, method_name in order:
            lms[name].adapter.synchronize()
            start = time.perf_counter()
            out = lms[name].generate(text, method_name, max_new_tokens=args.max_new_tokens, chat=chat)
            lms[name].adapter.synchronize()
            seconds = time.perf_counter() - start
            runs[name][method_name].append(len(out.token_ids) / seconds)
            got[name, method_name] = out.token_ids
        for name in lms:
            mismatches[name] += got[name, "auto"] != got[name, "ar"]
        say(f"prompt {i + 1}/{len(prompts)}")
    base = runs["float32"]["ar"]
    decoding = {}
    for name in lms:
        decoding[name] = {"mismatches_auto_vs_ar": mismatches[name]}
        for method_name in ("ar", "auto"):
            ratios = [a / b for a, b in zip(runs[name][method_name], base, strict=True)]
            # no interval under MIN_UNITS prompts: a percentile bootstrap over so few claims more than it covers
            point, (low, high) = geometric_mean(ratios), \
                bootstrap_interval(ratios) if len(ratios) >= MIN_UNITS else (None, None)
            decoding[name][method_name] = {"tokens_per_s_median": statistics.median(runs[name][method_name]),
                                           "vs_float32_ar": [point, low, high]}
    results = {
        "machine": machine_info(torch.device(args.device)), "commit": source_commit(), "versions": versions(),
        "command": "python " + " ".join(sys.argv), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "model": args.model or "the default model (SmolLM2-135M-Instruct)", "chat_template": chat,
        "modes": {n: {"precision": lm.adapter.precision.name, "kernels": lm.adapter.kernels,
                      "exactness": lm.adapter.exactness,
                      "calibration": (lm.loaded_calibration().as_dict() if lm.loaded_calibration() else None)}
                  for n, lm in lms.items()},
        "forward_ms": forward, "quality": qualities, "decoding": decoding, "raw_tokens_per_s": runs,
    }
    write_results(results, Path(args.out), markdown)
    return 0


def write_results(results: dict, out: Path, markdown: Callable[[dict], str]) -> None:
    """``results.json`` and ``results.md`` (``markdown(results)``) into ``out``; the markdown printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (out / "results.md").write_text(text)
    print(text)


def header(results: dict, title: str, tools: str = "") -> list[str]:
    """A results file's title and its machine, command and model lines (``tools``: more versions,
    after transformers')."""
    m = results["machine"]
    return [f"# {title}", "",
            f"- machine: {m['cpu']}, {m['cpu_count']} cores, {m['torch_threads']} torch threads"
            f"{'; GPU ' + m['gpu'] if 'gpu' in m else ''}; torch {m['torch']}, "
            f"transformers {m['transformers']}{tools}; commit {results['commit']}",
            f"- command: `{results['command']}`",
            f"- model: {results.get('model', 'the default model')}; prompts "
            f"{'in its chat template' if results.get('chat_template', True) else 'as plain text (no chat template)'}"]


def markdown(results: dict) -> str:
    lines = [*header(results, f"Precision modes, side by side ({results['prompts']} Spec-Bench evaluation "
                              f"prompts, {results['max_new_tokens']} greedy tokens)"),
             "",
             "| mode | kernels | forward ms at 1 / 4 / 16 tokens | ar step vs float32 | top-1 agreement with "
             "float32 | whole answers = float32 | prompt perplexity | ar tok/s (x float32 ar) | auto tok/s "
             "(x float32 ar) | auto != ar |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    one = results["forward_ms"]["float32"]["1"]
    for name, mode in results["modes"].items():
        f = results["forward_ms"][name]
        q = results["quality"][name]
        d = results["decoding"][name]

        def rate(method: str, d: dict = d) -> str:
            point, low, high = d[method]["vs_float32_ar"]
            spread = f"[{low:.2f}, {high:.2f}]" if low is not None else f"n={results['prompts']}"
            return f"{d[method]['tokens_per_s_median']:.1f} ({point:.2f}x {spread})"

        lines.append(f"| {mode['precision']} | {mode['kernels']} | {f['1']:.1f} / {f['4']:.1f} / {f['16']:.1f} | "
                     f"{one / f['1']:.2f}x | {q['top1_agreement_with_float32']:.3f} | "
                     f"{q['whole_answers_equal_float32']:.2f} | {q['perplexity_of_prompts']:.2f} | {rate('ar')} | "
                     f"{rate('auto')} | {d['mismatches_auto_vs_ar']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
