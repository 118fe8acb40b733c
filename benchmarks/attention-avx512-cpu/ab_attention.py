"""Alternates kernel libraries in one process on tree attention alone (ab_attention.md):
ab_attention.py OLD.so,NEW.so ROUNDS. Shapes of the default model (9 query heads on 3 key/value
heads, 64 features, bf16): T queries of a prompt chunk over a cache of C tokens (query t sees
slots up to C + t), and a decoding step of N requests of one query each, every one on its own
cache. Each round times 5 calls per shape and keeps the fastest; printed: the median over the
rounds, [smallest-largest round], and whether every output is the same bits on both."""
import statistics
import sys
import time

import torch

from triedec.model.attention import key_lists, tree_attention, tree_attention_items
from triedec.model.native import load_kernel

libs, rounds = sys.argv[1].split(","), int(sys.argv[2])
torch.set_num_threads(2)
kernel = load_kernel()
gen = torch.Generator().manual_seed(0)


def case(queries: int, cache: int) -> tuple:
    slots, dim = cache + queries, 64
    q = torch.randn(1, 9, queries, dim, generator=gen).bfloat16()
    k, v = (torch.randn(1, 3, slots, dim, generator=gen).bfloat16() for _ in range(2))
    return q, k, v, key_lists(torch.arange(slots)[None] <= cache + torch.arange(queries)[:, None])


def requests(count: int, cache: int) -> tuple:
    """A decoding step of ``count`` requests, one query each, every one on its own cache."""
    q = torch.randn(1, 9, count, 64, generator=gen).bfloat16()
    caches = [tuple(torch.randn(1, 3, cache + 1, 64, generator=gen).bfloat16() for _ in range(2)) for _ in range(count)]
    return q, caches, list(range(count + 1)), [None] * count


cases = {(t, c): case(t, c) for t, c in [(1, 256), (1, 1200), (16, 256), (64, 256), (256, 256), (256, 0)]}
batches = {(n, c): requests(n, c) for n, c in [(16, 400), (16, 1000)]}
times: dict[tuple, list[float]] = {}
outputs: dict[tuple, torch.Tensor] = {}


def measure(lib: str, key: tuple, call) -> None:
    """``call``'s output (once per library) and its fastest of 5 runs, this round."""
    outputs.setdefault((lib, key), call())
    trials = []
    for _ in range(5):
        start = time.perf_counter()
        call()
        trials.append(time.perf_counter() - start)
    times.setdefault((lib, key), []).append(1e3 * min(trials))


for r in range(rounds):
    for lib in libs if r % 2 == 0 else libs[::-1]:
        kernel.use_kernels(lib)
        for shape, (q, k, v, seen) in cases.items():
            measure(lib, shape, lambda q=q, k=k, v=v, seen=seen: tree_attention(q, k, v, seen, 0.125))
        for shape, (q, caches, bounds, seen) in batches.items():
            measure(lib, ("requests", *shape),
                    lambda q=q, caches=caches, bounds=bounds, seen=seen: tree_attention_items(q, caches, bounds,
                                                                                              seen, 0.125))
for shape in [*cases, *(("requests", *b) for b in batches)]:
    same = all(torch.equal(outputs[(libs[0], shape)], outputs[(lib, shape)]) for lib in libs)
    cells = [f"{lib.split('/')[-1]} {statistics.median(times[(lib, shape)]):.3f} ms "
             f"[{min(times[(lib, shape)]):.3f}-{max(times[(lib, shape)]):.3f}]" for lib in libs]
    ratio = statistics.median(times[(libs[0], shape)]) / statistics.median(times[(libs[-1], shape)])
    label = (f"{shape[1]} requests of one query, caches of {shape[2]}" if shape[0] == "requests"
             else f"queries {shape[0]}, cache {shape[1]}")
    print(f"{label}: " + "  ".join(cells) + f"  ratio {ratio:.2f}  same bits: {same}")
