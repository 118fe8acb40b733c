"""One side's numbers: forward_batch at 1 and 16 rows (median of many) and ar decode ms/token over 4 prompts."""
import sys, time, statistics, json, torch, triedec
from triedec.model.adapter import ForwardItem
sys.path.insert(0, "/work/main/scripts")
from roofline import verify_tree
torch.set_num_threads(2)
lm = triedec.load(); ad = lm.adapter
g = torch.Generator().manual_seed(0)
ctx = torch.randint(100, ad.vocab_size - 100, (256,), generator=g)
res = {}
for size in (1, 16, 256):
    cache = ad.new_cache(256 + size + 8); ad.prefill(cache, ctx); cache.commit(list(range(256)))
    tree = verify_tree(size, int(ctx[-1]), g)
    item = ForwardItem(cache, torch.tensor(tree.tokens), tree.positions(256)[0], tree.ancestry, -1)
    ts = []
    for i in range(max(600 // size, 12) + 20 if size < 256 else 14):
        t = time.perf_counter(); ad.forward_batch([item]); ts.append(time.perf_counter() - t); cache.commit([])
    res[f"fb{size}"] = statistics.median(ts[20:] if size < 256 else ts[4:]) * 1e3
qs = ["Write a short story about a robot who learns to paint.", "List ten fruits and their colors.",
      "Explain how a bicycle works.", "Describe the water cycle in detail."]
dec = []
for q in qs:
    s = lm.generate([{"role": "user", "content": q}], "ar", max_new_tokens=128).stats
    dec.append(1e3 * (s.seconds - s.prefill_seconds) / (s.new_tokens - 1))
res["ar_ms_tok"] = statistics.mean(dec)
print(json.dumps(res))
