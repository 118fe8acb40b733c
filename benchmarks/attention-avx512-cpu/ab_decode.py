"""Alternates kernel libraries in one process on a decoding step of many requests (ab_decode.md):
ab_decode.py OLD.so,NEW.so REQUESTS CONTEXT ROUNDS. The default model in int4-a8, 2 threads,
REQUESTS caches of CONTEXT random tokens each, one forward of one token per request; each round
times 10 forwards and keeps their median; printed: the median over the rounds [smallest-largest]
and whether the logits are the same bits on both."""
import statistics
import sys
import time

import torch

import triedec
from triedec.model.adapter import ForwardItem
from triedec.model.native import load_kernel

libs, requests, context, rounds = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(2)
kernel = load_kernel()
lm = triedec.load(None, weights="int4-a8")
ad = lm.adapter
gen = torch.Generator().manual_seed(0)
items = []
for _ in range(requests):
    cache = ad.new_cache(context + 8)
    ad.prefill(cache, torch.randint(100, ad.vocab_size - 100, (context,), generator=gen))
    cache.commit(list(range(context)))
    token = torch.randint(100, 4000, (1,), generator=gen)
    items.append(ForwardItem(cache, token, torch.tensor([context]), torch.ones((1, 1), dtype=torch.bool), -1))


def step() -> list[torch.Tensor]:
    out = ad.forward_batch(items)
    for item in items:
        item.cache.commit([])
    return out


times: dict[str, list[float]] = {lib: [] for lib in libs}
outputs: dict[str, list[torch.Tensor]] = {}
for r in range(rounds):
    for lib in libs if r % 2 == 0 else libs[::-1]:
        kernel.use_kernels(lib)
        outputs.setdefault(lib, step())
        trials = []
        for _ in range(10):
            start = time.perf_counter()
            step()
            trials.append(time.perf_counter() - start)
        times[lib].append(1e3 * statistics.median(trials))
same = all(torch.equal(a, b) for lib in libs for a, b in zip(outputs[libs[0]], outputs[lib], strict=True))
cells = [f"{lib.split('/')[-1]} {statistics.median(times[lib]):.2f} ms [{min(times[lib]):.2f}-{max(times[lib]):.2f}]"
         for lib in libs]
ratio = statistics.median(times[libs[0]]) / statistics.median(times[libs[-1]])
print(f"{requests} requests on {context}-token caches: " + "  ".join(cells) + f"  ratio {ratio:.2f}  same bits: {same}")
