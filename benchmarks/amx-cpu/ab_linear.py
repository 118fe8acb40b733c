"""The default model's int4-a8 linear shapes (its Q4_1 layers, the int8 head) on the avx512vnni and
avx512amx builds, alternated in one process, 3 rounds, best round each: ab_linear.py ROWS THREADS."""
import sys, time, torch, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "tests"))
from test_native_kernels import _scale_min_raw, _linear_of
from triedec.model.native import load_kernel, switchable_libraries
from triedec.model.gguf_blocks import parse_scale_min
from triedec.model.precision import ScaleMinA8Linear, Int8A8Linear
from torch import nn
K = load_kernel(); libs = switchable_libraries()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = []
for n, k in shapes:
    raw, w = _scale_min_raw("Q4_1", n, k, 1)
    layers.append(("q4_1 %dx%d" % (n, k), ScaleMinA8Linear(_linear_of(w), parse_scale_min(raw, "Q4_1")), k))
head = Int8A8Linear(nn.Linear(576, 49152, bias=False)); layers.append(("int8 head", head, 576))
rows_list = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8, 16, 32, 64, 256]
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
def run(layer, x):
    if isinstance(layer, Int8A8Linear): return K.int8_linear(x, layer.packed, layer.scales, False)
    return K.scale_min_linear(x, layer.packed, layer.highs, layer.dm, False)
with torch.inference_mode():
  for name, layer, k in layers:
    for R in rows_list:
        x = torch.randn(R, k).to(torch.bfloat16)
        res = {}
        outs = {}
        for rnd in range(3):
            for isa in ("avx512vnni", "avx512amx"):
                K.use_kernels(str(libs[isa]))
                outs[isa] = run(layer, x)
                n = max(3, int(2e8 / (R * k * layer.out_features + 1)))
                t = time.perf_counter()
                for _ in range(n): run(layer, x)
                res.setdefault(isa, []).append((time.perf_counter() - t) / n)
        same = torch.equal(outs["avx512vnni"], outs["avx512amx"])
        v, a = min(res["avx512vnni"]), min(res["avx512amx"])
        gmac = R * k * layer.out_features / a / 1e9
        print(f"{name:16s} R={R:4d} vnni {v*1e3:8.3f} ms amx {a*1e3:8.3f} ms  {v/a:5.2f}x  amx {gmac:6.0f} G/s same={same}", flush=True)
