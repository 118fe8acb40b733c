"""The host time of forward_batch on the default model (int4-a8, 2 threads, a 256-token cache),
step by step as adapter.forward_batch and runner._native_forward run them: one token and a
16-token tree, 80 forwards each, the median of the last 70 (ms)."""
import statistics, time, sys
import torch, triedec
from triedec.model.adapter import ForwardItem
from triedec.model.dispatch import item_visibility, ItemBatch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"))
from forward_timings import draft_tree
torch.set_num_threads(2)
lm = triedec.load(None, weights="int4-a8")
ad = lm.adapter; run = ad._runner
gen = torch.Generator().manual_seed(0)
ctx = torch.randint(100, 40000, (256,), generator=gen)
cache = ad.new_cache(600); ad.prefill(cache, ctx); cache.commit(list(range(256)))
tree = draft_tree(16, int(ctx[-1]), gen)
shapes = {"one": (torch.tensor([1234]), torch.tensor([256]), torch.ones((1, 1), dtype=torch.bool)),
          "tree16": (torch.tensor(tree.tokens), tree.positions(256)[0], tree.ancestry)}
for name, s in shapes.items():
    T = {}
    def mark(k, t0):
        t = time.perf_counter(); T.setdefault(k, []).append(t - t0); return t
    for rep in range(80):
        with torch.inference_mode():
            t = time.perf_counter()
            items = [ForwardItem(cache, *s, -1)]
            t = mark("item", t)
            for item in items: item.cache.stage(item.positions)
            t = mark("stage", t)
            vis = [item_visibility(item, ad.layout) for item in items]
            t = mark("visibility", t)
            batch = ItemBatch(items, vis, ad.layout.kinds, ad.exact_attention, ad.dtype, ad.device)
            t = mark("ItemBatch", t)
            tokens = torch.cat([item.tokens.reshape(-1) for item in items]).to(ad.device)
            positions = torch.cat([item.positions.reshape(-1) for item in items]).to(ad.device)
            rows = [(stop - item.rows, stop) for item, (_, stop) in zip(items, batch.bounds)]
            keep = torch.cat([torch.arange(a, b) for a, b in rows])
            t = mark("cats", t)
            hidden = run._embedded(tokens)
            t = mark("embed", t)
            tables = run._rotary_tables(hidden, positions)
            t = mark("rotary", t)
            caches = [item.cache for item in batch.items]
            for c in caches: c.allocate(len(run.layers), *run._kv, hidden.dtype, hidden.device)
            t = mark("allocate", t)
            kinds = run._kinds
            seen = [[batch.key_lists(i, k) for i in range(len(caches))] for k in kinds]
            t = mark("key_lists", t)
            edges = [st for st, _ in batch.bounds] + [batch.bounds[-1][1]]
            args = (hidden, [tables[k][0][0].contiguous() for k in kinds], [tables[k][1][0].contiguous() for k in kinds], edges,
                [c.length for c in caches], [c.keys for c in caches], [c.values for c in caches],
                [[None if x is None else x[0] for x in l] for l in seen], [[None if x is None else x[1] for x in l] for l in seen], None)
            t = mark("args", t)
            logits = run._native.forward(*args)
            t = mark("NATIVE", t)
            logits = run._scaled_logits(logits[None])[0].float()
            t = mark("float", t)
            cache.commit([])
            t = mark("commit", t)
    print(name, " ".join(f"{k} {1e3*statistics.median(v[10:]):.3f}" for k, v in T.items()))
