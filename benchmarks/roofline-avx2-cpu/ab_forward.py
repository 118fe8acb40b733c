"""Alternates two kernel libraries (paths, "new" for the installed avx2 one, or an installed build's
ISA name, e.g. avx512vnni,avx512amx) in one process on the default model's forward of M rows:
ab_forward.py OLD.so,new 1,4,16,64 ROUNDS (ab_forward.md)."""
import statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import triedec
from roofline import verify_tree
from triedec.model.adapter import ForwardItem
from triedec.model.native import load_kernel, installed_libraries
libs = sys.argv[1].split(",")
sizes = [int(s) for s in sys.argv[2].split(",")]
rounds = int(sys.argv[3])
torch.set_num_threads(2)
k = load_kernel()
installed = installed_libraries()
paths = [str(installed["avx2"]) if l == "new" else str(installed[l]) if l in installed else l for l in libs]
labels = {p: l if l in installed else p.split('/')[-1][:12] for p, l in zip(paths, libs)}
libs = paths
lm = triedec.load(None, weights="int4-a8")
ad = lm.adapter
gen = torch.Generator().manual_seed(0)
ctx = torch.randint(100, ad.vocab_size - 100, (256,), generator=gen)
cache = ad.new_cache(256 + max(sizes) + 8)
ad.prefill(cache, ctx); cache.commit(list(range(256)))
items = {}
for s in sizes:
    tree = verify_tree(s, int(ctx[-1]), gen)
    items[s] = ForwardItem(cache, torch.tensor(tree.tokens), tree.positions(256)[0], tree.ancestry, -1)
def fwd(s):
    out = ad.forward_batch([items[s]]); cache.commit([]); return out
res = {(l, s): [] for l in libs for s in sizes}
outs = {}
for r in range(rounds):
    for l in (libs if r % 2 == 0 else libs[::-1]):
        k.use_kernels(l)
        for s in sizes:
            o = fwd(s)
            if r == 0: outs[(l, s)] = o
            ts = []
            for _ in range(max(2, 32 // s)):
                t = time.perf_counter(); fwd(s); ts.append(time.perf_counter() - t)
            res[(l, s)].append(1e3 * statistics.median(ts))
def flat(o):
    if isinstance(o, torch.Tensor): return [o]
    if isinstance(o, (list, tuple)): return [t for x in o for t in flat(x)]
    if hasattr(o, "__dict__"): return [t for x in vars(o).values() for t in flat(x)]
    return []
for s in sizes:
    a, b = flat(outs[(libs[0], s)]), flat(outs[(libs[1], s)])
    same = len(a) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
    print(f"rows {s}: " + "  ".join(f"{labels[l]} {statistics.median(res[(l,s)]):.2f} ms [{min(res[(l,s)]):.2f}-{max(res[(l,s)]):.2f}]" for l in libs) + f"  ratio {statistics.median(res[(libs[0],s)])/statistics.median(res[(libs[1],s)]):.2f}  same bits: {same} ({len(a)} tensors)")
