"""The host share of forward_batch: its wall time against the native call inside it (median of a few hundred forwards of 1, 4 and 16 rows on a 256-token cache)."""
import sys, time, statistics, torch, triedec
from triedec.model.adapter import ForwardItem
sys.path.insert(0, "/work/main/scripts")
from roofline import verify_tree
torch.set_num_threads(2)
lm = triedec.load(); ad = lm.adapter; runner = ad._runner; nat = runner._native
inner = []
orig = nat.forward
class Wrap:
    def __getattr__(s, k): return getattr(nat, k)
    def forward(s, *a):
        t = time.perf_counter(); r = orig(*a); inner.append(time.perf_counter() - t); return r
runner._native = Wrap()
g = torch.Generator().manual_seed(0)
ctx = torch.randint(100, ad.vocab_size - 100, (256,), generator=g)
for size in (1, 4, 16):
    cache = ad.new_cache(256 + size + 8); ad.prefill(cache, ctx); cache.commit(list(range(256)))
    tree = verify_tree(size, int(ctx[-1]), g)
    item = ForwardItem(cache, torch.tensor(tree.tokens), tree.positions(256)[0], tree.ancestry, -1)
    outer = []; inner.clear()
    for i in range(400 // size + 20):
        t = time.perf_counter(); ad.forward_batch([item]); outer.append(time.perf_counter() - t); cache.commit([])
    o, n = statistics.median(outer[10:]) * 1e3, statistics.median(inner[10:]) * 1e3
    print(f"rows {size}: forward_batch {o:.3f} ms, native {n:.3f} ms, host {o - n:.3f} ms ({(o - n) / o:.1%})")
