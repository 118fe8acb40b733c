"""triedec's float32 linear (``csrc/f32_linears.cpp``, :class:`~triedec.model.linears.F32Linear`)
against oneDNN's pre-packed float32 linear (what the float mode ran before it), on the default
model's layer shapes: its 30 layers' joined q/k/v (960 x 576), o (576 x 576), joined gate/up
(3072 x 576) and down (576 x 1536), then the head (49152 x 576), called one after the other as a
forward calls them, so every weight streams from memory (540 MB, far beyond the caches). Random
weights (the time does not depend on the values). For each row count the two kernels alternate
over ``--rounds`` rounds; the median and the range of the rounds are given, with the bytes each
call sequence reads over the median time.

    .venv/bin/python scripts/f32_linear_timings.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from triedec.model.linears import pack_f32
from triedec.model.native import load_kernel

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
HEAD = (49152, 576)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = load_kernel()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(LAYERS) for n, k in SHAPES]
    weights.append(torch.randn(*HEAD, generator=gen) * 0.05)
    ours = [pack_f32(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    features = [w.shape[1] for w in weights]
    total = sum(w.numel() * 4 for w in weights)
    del weights
    print(f"kernel build {kernel.isa()}, {args.threads} threads, {len(ours)} linears, {total / 1e6:.0f} MB; "
          f"ms a sequence, median [min, max] over {args.rounds} rounds")
    print("| rows | triedec | oneDNN | triedec GB/s |")
    print("|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k, generator=gen) for k in set(features)}

        def triedec_sequence(x: dict[int, torch.Tensor] = x) -> None:
            for packed, k in zip(ours, features, strict=True):
                kernel.f32_linear(x[k], packed, None)

        def onednn_sequence(x: dict[int, torch.Tensor] = x) -> None:
            for packed, k in zip(onednn, features, strict=True):
                torch.ops.mkldnn._linear_pointwise(x[k], packed, None, "none", [], "")

        times: dict[str, list[float]] = {"triedec": [], "oneDNN": []}
        for _ in range(args.rounds):
            for name, run in (("triedec", triedec_sequence), ("oneDNN", onednn_sequence)):
                start = time.perf_counter()
                run()
                times[name].append(1e3 * (time.perf_counter() - start))
        cells = [f"{statistics.median(v):.1f} [{min(v):.1f}, {max(v):.1f}]" for v in times.values()]
        print(f"| {rows} | {cells[0]} | {cells[1]} | {total / statistics.median(times['triedec']) / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
