"""A Q4_K_M file's Q5_0 layers held at their own 5 bits (``Int5A8Linear``) against the same codes
held in int8 (``Int8A8Linear``, what triedec did before): one process, the two models' forwards
alternated in rounds, the bytes a token reads, and the logits compared (the same bits expected).

    .venv/bin/python scripts/q5_0_ab.py models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --out benchmarks/q5_0-cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import triedec
from triedec.bench.report import machine_info, source_commit, versions
from triedec.model import precision
from triedec.model.adapter import ForwardItem
from triedec.model.native import load_kernel
from triedec.model.source import gguf_linear_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--per-round", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    five = triedec.load(args.model)
    chosen = precision._a8_linear
    precision._a8_linear = precision.Int8A8Linear  # the same codes in int8
    try:
        eight = triedec.load(args.model)
    finally:
        precision._a8_linear = chosen
    models = {"int5": five, "int8": eight}
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, five.adapter.vocab_size - 100, (args.context,), generator=gen)
    caches = {}
    for name, lm in models.items():
        cache = lm.adapter.new_cache(args.context + 64)
        lm.adapter.prefill(cache, context)
        cache.commit(list(range(args.context)))
        caches[name] = cache
    shapes = {"one token": 1, "16 tokens": 16}
    results, equal = {}, {}
    order = random.Random(0)
    for label, n in shapes.items():
        tokens = torch.randint(100, 4000, (n,), generator=gen)
        item = (tokens, torch.arange(args.context, args.context + n), torch.ones((n, n), dtype=torch.bool).tril())

        def forward(name: str, item=item) -> torch.Tensor:
            out = models[name].adapter.forward_batch([ForwardItem(caches[name], *item)])[0]
            caches[name].commit([])
            return out

        equal[label] = torch.equal(forward("int5"), forward("int8"))
        medians: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.rounds):
            names = list(models)
            order.shuffle(names)
            for name in names:
                forward(name)
                times = []
                for _ in range(args.per_round):
                    start = time.perf_counter()
                    forward(name)
                    times.append(time.perf_counter() - start)
                medians[name].append(1e3 * statistics.median(times))
        results[label] = {name: {"median_ms": statistics.median(v), "q1_ms": statistics.quantiles(v, n=4)[0],
                                 "q3_ms": statistics.quantiles(v, n=4)[2]} for name, v in medians.items()}
    held = {name: precision.linear_weight_bytes(lm.model) for name, lm in models.items()}
    in_file = gguf_linear_bytes(args.model)
    lines = [f"{args.model.name}, {args.threads} threads, kernel build {load_kernel().isa()}, {args.context}-token "
             f"cache; median ms [quartiles] over {args.rounds} rounds of {args.per_round}", "",
             "| | int5 (Q5_0 at 5.5 bits) | int8 (the same codes at 8.5) | logits equal |", "|---|---|---|---|"]
    for label, row in results.items():
        cells = [f"{r['median_ms']:.2f} [{r['q1_ms']:.2f}, {r['q3_ms']:.2f}]" for r in row.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'yes' if equal[label] else 'NO'} |")
    lines.append(f"| weights a token reads | {held['int5'] / 1e6:.1f} MB ({held['int5'] / in_file:.2f}x the "
                 f"file's {in_file / 1e6:.1f}) | {held['int8'] / 1e6:.1f} MB ({held['int8'] / in_file:.2f}x) | |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "results": results, "logits_equal": equal,
            "weight_bytes": held, "file_weight_bytes": in_file, "machine": machine_info(torch.device("cpu")),
            "versions": versions(), "commit": source_commit()}, indent=2))
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
