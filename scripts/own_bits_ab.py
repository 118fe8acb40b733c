"""A Q4_K_M file's Q5_0 or Q6_K layers held at their own bits (``Int5A8Linear``, 5.5 bits a weight;
``Int6A8Linear``, 6.625) against the same layers in int8 (``Int8A8Linear``, 8.5 bits, what triedec
did before), or (``--block legacy``) a file's Q4_0, Q4_1 and Q5_1 layers as its own blocks
(``ScaleMinA8Linear``) against the same file's values on int4's grid (``Int4A8Linear``: bf16 scale
and zero, what triedec did before; a Q5_1 layer then in int8): one process, the two models'
forwards alternated in rounds, the bytes a token reads, and the logits compared (Q5_0: the same
bits expected, its codes fit int8 exactly; Q6_K and legacy: the other form rounds the values
again, so the logits differ, and the table gives by how much and whether the top token agrees).

    .venv/bin/python scripts/own_bits_ab.py models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --block Q5_0 \
        --out benchmarks/q5_0-qwen-cpu
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
from triedec.model import gguf_blocks, precision
from triedec.model.adapter import ForwardItem
from triedec.model.native import load_kernel
from triedec.model.source import gguf_linear_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--block", choices=("Q5_0", "Q6_K", "legacy"), default="Q5_0",
                        help="which layers the second model widens to int8 (legacy: puts on int4's grid)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--per-round", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    own = triedec.load(args.model)
    if args.block == "legacy":
        read = dict(gguf_blocks._BLOCK_BYTES)
        for kind in precision.SCALE_MIN_KINDS:  # not read from the file: the values on int4's grid
            del gguf_blocks._BLOCK_BYTES[kind]
        try:
            eight = triedec.load(args.model)
        finally:
            gguf_blocks._BLOCK_BYTES.update(read)
    else:
        own_class = {"Q5_0": precision.Int5A8Linear, "Q6_K": precision.Int6A8Linear}[args.block]
        chosen = precision._a8_linear

        def widened(linear: torch.nn.Module) -> torch.nn.Module:
            layer = chosen(linear)
            return precision.Int8A8Linear(linear) if type(layer) is own_class else layer

        precision._a8_linear = widened  # those layers in int8, the others as they were
        try:
            eight = triedec.load(args.model)
        finally:
            precision._a8_linear = chosen
    own_name = {"Q5_0": "int5", "Q6_K": "int6", "legacy": "scale-min"}[args.block]
    models = {own_name: own, "int8": eight}
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, own.adapter.vocab_size - 100, (args.context,), generator=gen)
    caches = {}
    for name, lm in models.items():
        cache = lm.adapter.new_cache(args.context + 64)
        lm.adapter.prefill(cache, context)
        cache.commit(list(range(args.context)))
        caches[name] = cache
    shapes = {"one token": 1, "16 tokens": 16}
    results, equal, apart = {}, {}, {}
    order = random.Random(0)
    for label, n in shapes.items():
        tokens = torch.randint(100, 4000, (n,), generator=gen)
        item = (tokens, torch.arange(args.context, args.context + n), torch.ones((n, n), dtype=torch.bool).tril())

        def forward(name: str, item=item) -> torch.Tensor:
            out = models[name].adapter.forward_batch([ForwardItem(caches[name], *item)])[0]
            caches[name].commit([])
            return out

        a, b = forward(own_name).float(), forward("int8").float()
        equal[label] = torch.equal(a, b)
        apart[label] = {"max_abs": float((a - b).abs().max()), "top1_agree": float((a.argmax(-1) == b.argmax(-1))
                                                                                   .float().mean())}
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
    own_label = {"Q5_0": "int5 (Q5_0 at 5.5 bits)", "Q6_K": "int6 (Q6_K at 6.625 bits)",
                 "legacy": "scale-min (the file's own blocks)"}[args.block]
    other_label = "int4's grid (bf16 scale and zero)" if args.block == "legacy" else "int8 (those layers at 8.5)"
    lines = [f"{args.model.name}, {args.threads} threads, kernel build {load_kernel().isa()}, {args.context}-token "
             f"cache; median ms [quartiles] over {args.rounds} rounds of {args.per_round}; "
             f"{precision.layer_mix(own.model)} against {precision.layer_mix(eight.model)}", "",
             f"| | {own_label} | {other_label} | logits equal |", "|---|---|---|---|"]
    for label, row in results.items():
        cells = [f"{r['median_ms']:.2f} [{r['q1_ms']:.2f}, {r['q3_ms']:.2f}]" for r in row.values()]
        same = "yes" if equal[label] else (f"no: up to {apart[label]['max_abs']:.3g} apart, top token the same at "
                                           f"{100 * apart[label]['top1_agree']:.0f}% of rows")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {same} |")
    lines.append(f"| weights a token reads | {held[own_name] / 1e6:.1f} MB ({held[own_name] / in_file:.2f}x the "
                 f"file's {in_file / 1e6:.1f}) | {held['int8'] / 1e6:.1f} MB ({held['int8'] / in_file:.2f}x) | |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "results": results, "logits_equal": equal,
            "logits_apart": apart,
            "weight_bytes": held, "file_weight_bytes": in_file, "machine": machine_info(torch.device("cpu")),
            "versions": versions(), "commit": source_commit()}, indent=2))
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0 if all(equal.values()) or args.block != "Q5_0" else 1


if __name__ == "__main__":
    sys.exit(main())
