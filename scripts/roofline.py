"""This machine's limits and how near a forward of M rows comes to them: the peak rate of the 8-bit
dot products triedec's linears issue (``dot_peak``: 12 independent chains of this build's
``vpdpbusd``, AVX-VNNI's, or AVX2's ``vpmaddubsw`` with its ``vpaddw``, on 1 .. ``--threads``
threads), the rate at which a kernel streams bytes from memory (``stream_read``: ``--stream-mib``
read once over the threads), and the roofline of a forward of M rows of the loaded model,
``max(weight bytes / bandwidth, M x multiply-adds / peak)``, beside the measured forward (M tokens
of a verify tree on a ``--context``-token cache, every row's logits, as a step verifies them).

Two more bounds are printed, both from the same measured peak. ``arith``: M x multiply-adds at
the peak, the roofline's compute term. ``exact``: what the linears' own arithmetic costs at that
peak once their float steps are counted (docs/kernels.md): per row, 16 outputs and group of 32
features, 8 dot-product instructions and 4 float ones in int4 (``fma(a D, s, y)``, ``fma(a Q, c,
y)``, the conversion and the product ``a D``), 8 and 3 in int8; on AVX-512 those share the ports
the dot products run on, so the linears can reach at most 2/3 (int4) and 8/11 (int8) of the peak.
Attention, norms and the rest of the forward are not in either bound.

Limits are the best of ``--trials`` trials (the machine's; a busy host lowers a trial, never raises
it), forwards the median of ``--rounds`` rounds with their quartiles.

    .venv/bin/python scripts/roofline.py --out benchmarks/roofline-cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import triedec
from triedec.bench.report import machine_info, source_commit, versions
from triedec.core.tree import TokenTree
from triedec.model.adapter import ForwardItem
from triedec.model.native import load_kernel
from triedec.model.opcheck import int8_peak, memory_rate
from triedec.model.precision import NATIVE_LINEARS, Int4A8Linear, linear_weight_bytes

FLOAT_STEPS = {"int4": (8, 4), "int8": (8, 3)}
"""Vector instructions per row, 16 outputs and group of 32 features: (dot products, float steps)."""


def best_of(trials: int, measure) -> tuple[float, float]:
    """(best, median) of ``trials`` calls of ``measure`` (each returns a rate)."""
    rates = [measure() for _ in range(trials)]
    return max(rates), statistics.median(rates)


def dot_rate(kernel, threads: int, seconds: float) -> float:
    """Multiply-adds a second of the kernel build's dot-product loop on ``threads`` threads."""
    torch.set_num_threads(threads)
    return int8_peak(kernel, seconds)


stream_rate = memory_rate


def linear_costs(model: torch.nn.Module) -> tuple[int, int, float]:
    """(multiply-adds a row, weight bytes a forward reads (``linear_weight_bytes``), vector
    instructions a row at the exact arithmetic, in units of one dot-product instruction's 64
    multiply-adds) of ``model``'s packed linears on 8-bit activations."""
    layers = {id(m): m for m in model.modules() if isinstance(m, NATIVE_LINEARS)}
    macs = sum(m.in_features * m.out_features for m in layers.values())
    steps = 0.0
    for m in layers.values():
        dots, floats = FLOAT_STEPS["int4" if isinstance(m, Int4A8Linear) else "int8"]
        steps += m.in_features * m.out_features / (32 * 16) * (dots + floats) / dots * 8
    return macs, linear_weight_bytes(model), steps


def verify_tree(size: int, root: int, generator: torch.Generator) -> TokenTree:
    """A verify tree of ``size`` nodes: the root and 4 chains under it (forward_timings' shape)."""
    tokens = [root, *torch.randint(100, 4000, (size - 1,), generator=generator).tolist()]
    return TokenTree(tuple(tokens), tuple(-1 if i == 0 else 0 if i <= 4 else i - 4 for i in range(size)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--weights", default="int4-a8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stream-mib", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kernel = load_kernel()
    peaks = {}
    for threads in range(1, args.threads + 1):
        peaks[threads] = best_of(args.trials, lambda t=threads: dot_rate(kernel, t, 0.2))
    torch.set_num_threads(args.threads)
    stream = torch.ones(args.stream_mib << 20, dtype=torch.uint8)
    kernel.stream_read(stream)  # touched: the pages exist before the trials
    bandwidth = best_of(args.trials, lambda: stream_rate(kernel, stream))
    stream = torch.empty(0, dtype=torch.uint8)  # its memory back before the model loads
    peak = peaks[args.threads][0]

    lm = triedec.load(args.model, weights=args.weights)
    macs, weight_bytes, steps = linear_costs(lm.model)
    adapter = lm.adapter
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(100, adapter.vocab_size - 100, (args.context,), generator=generator)
    sizes = [int(r) for r in args.rows.split(",")]
    cache = adapter.new_cache(args.context + max(sizes) + 8)
    adapter.prefill(cache, context)
    cache.commit(list(range(args.context)))
    results = []
    for size in sizes:
        tree = verify_tree(size, int(context[-1]), generator)
        item = ForwardItem(cache, torch.tensor(tree.tokens), tree.positions(args.context)[0], tree.ancestry, -1)

        def forward(item: ForwardItem = item) -> None:
            adapter.forward_batch([item])
            cache.commit([])

        forward()
        per_round = max(1, 64 // size)
        medians = []
        for _ in range(args.rounds):
            times = []
            for _ in range(per_round):
                start = time.perf_counter()
                forward()
                times.append(time.perf_counter() - start)
            medians.append(1e3 * statistics.median(times))
        q = statistics.quantiles(medians, n=4) if len(medians) > 1 else [medians[0]] * 3
        bytes_ms = 1e3 * weight_bytes / bandwidth[0]
        arith_ms = 1e3 * size * macs / peak
        exact_ms = 1e3 * size * steps * 64 / peak
        results.append({"rows": size, "median_ms": statistics.median(medians), "q1_ms": q[0], "q3_ms": q[2],
                        "bytes_ms": bytes_ms, "arith_ms": arith_ms, "exact_ms": exact_ms,
                        "roofline_ms": max(bytes_ms, arith_ms)})

    lines = [f"kernel build {kernel.isa()}, {args.threads} threads, {lm.adapter.precision.name}; "
             f"best [median] of {args.trials} trials", ""]
    lines.append("| threads | 8-bit dot products, G multiply-adds/s |")
    lines.append("|---|---|")
    for threads, (best, median) in peaks.items():
        lines.append(f"| {threads} | {best / 1e9:.0f} [{median / 1e9:.0f}] |")
    lines += ["", f"memory read ({args.stream_mib} MiB, {args.threads} threads): {bandwidth[0] / 1e9:.1f} "
              f"[{bandwidth[1] / 1e9:.1f}] GB/s", "",
              f"the model's packed linears: {macs / 1e6:.1f} M multiply-adds a row, {weight_bytes / 1e6:.1f} MB a "
              f"forward; the exact arithmetic's instructions are {steps * 64 / macs:.2f}x the dot products'", "",
              f"a forward of M rows ({args.context}-token cache, every row's logits), median ms [quartiles] over "
              f"{args.rounds} rounds, against its bounds at the best peak and bandwidth", "",
              "| rows | measured | roofline | bytes | arith | exact | measured / roofline | measured / exact "
              "| ms a row |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        extra = (r["median_ms"] - results[0]["median_ms"]) / (r["rows"] - 1) if r["rows"] > 1 else float("nan")
        lines.append(f"| {r['rows']} | {r['median_ms']:.2f} [{r['q1_ms']:.2f}, {r['q3_ms']:.2f}] | "
                     f"{r['roofline_ms']:.2f} | {r['bytes_ms']:.2f} | {r['arith_ms']:.2f} | {r['exact_ms']:.2f} | "
                     f"{r['median_ms'] / r['roofline_ms']:.2f} | "
                     f"{r['median_ms'] / max(r['bytes_ms'], r['exact_ms']):.2f} "
                     f"| {'' if r['rows'] == 1 else f'{extra:.3f}'} |")
    lines.append("")
    lines.append("ms a row: (M rows' time - one row's) / (M - 1), what an extra row of the forward costs.")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "isa": kernel.isa(),
            "dot_peak": {str(t): {"best": b, "median": m} for t, (b, m) in peaks.items()},
            "bandwidth": {"best": bandwidth[0], "median": bandwidth[1]},
            "macs_per_row": macs, "weight_bytes": weight_bytes, "exact_steps_per_row": steps,
            "results": results, "machine": machine_info(torch.device("cpu")), "versions": versions(),
            "commit": source_commit()}, indent=2))
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
