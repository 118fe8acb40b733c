"""A/B of two kernel libraries on the default model's int4 linear shapes, in one process.

    python ab_linear.py OLD.so,NEW.so ROUNDS 1,4,16

Each round loads the libraries in turn (the order reversed every other round) and times
`int4_linear` on random weights of the model's shapes (qkv, gate_up, down, head) at each row
count: the median of a round's calls, then the median over rounds. It also checks that both
libraries return the same bits (`torch.equal`). Build the libraries with
`../roofline-avx2-cpu/build_library.sh`.
"""

import statistics
import sys
import time

import torch
import torch.nn as nn

from triedec.model.native import load_kernel
from triedec.model.precision import Int4A8Linear

libs = sys.argv[1].split(",")
rounds = int(sys.argv[2])
sizes = [int(s) for s in sys.argv[3].split(",")]
torch.set_num_threads(2)
torch.manual_seed(0)
k = load_kernel()
shapes = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}
layers = {n: Int4A8Linear(nn.Linear(i, o, bias=False)) for n, (i, o) in shapes.items()}
res: dict = {}
outs: dict = {}
with torch.inference_mode():
    for r in range(rounds):
        for lib in libs if r % 2 == 0 else libs[::-1]:
            k.use_kernels(lib)
            for n, layer in layers.items():
                for s in sizes:
                    gen = torch.Generator().manual_seed(s)
                    x = torch.randn(s, shapes[n][0], generator=gen).to(torch.bfloat16)
                    outs.setdefault((n, s), {})[lib] = k.int4_linear(
                        x, layer.packed, layer.scales_zeros, False
                    )
                    reps = max(3, int(2e8 / (s * shapes[n][0] * shapes[n][1])))
                    ts = []
                    for _ in range(reps):
                        t = time.perf_counter()
                        k.int4_linear(x, layer.packed, layer.scales_zeros, False)
                        ts.append(time.perf_counter() - t)
                    res.setdefault((n, s, lib), []).append(1e3 * statistics.median(ts))
for n in layers:
    for s in sizes:
        m = [statistics.median(res[(n, s, lib)]) for lib in libs]
        same = all(torch.equal(outs[(n, s)][libs[0]], outs[(n, s)][lib]) for lib in libs)
        mac = s * shapes[n][0] * shapes[n][1]
        cells = "  ".join(f"{x:.3f} ms ({mac / x / 1e6:.0f} GMAC/s)" for x in m)
        print(f"{n:8s} rows {s:3d}: {cells}  old/new {m[0] / m[1]:.2f} same {same}")
