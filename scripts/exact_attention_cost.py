"""What exactness by construction costs: one forward of the default model with triedec's
fixed-order tree attention against the same forward with the attention it replaced (torch's sdpa,
grouped-query, additive masks), at 1, 16 and 64 new tokens on caches of 256 and 2,048 tokens.

Both run in one process on one loaded model (the switch is ``ModelAdapter.exact_attention``; the
linears are the same pre-packed ones), interleaved in pairs whose order is shuffled, after warm-up.
Prints a markdown table and writes ``results.json`` to ``--out``: per cell, the median forward time
of each and the median of the per-pair ratios with a 95% bootstrap interval.

    .venv/bin/python scripts/exact_attention_cost.py --out benchmarks/exact-attention-cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

import triedec
from triedec.bench.report import source_commit
from triedec.model.adapter import ForwardItem


def tree_item(cache, context: int, size: int) -> ForwardItem:
    """A draft tree of ``size`` nodes (node i's parent is (i - 1) // 2: a binary tree) on top of
    ``context`` committed tokens; a single token for size 1."""
    parents = [(i - 1) // 2 for i in range(size)]
    visible = torch.zeros((size, size), dtype=torch.bool)
    depth = []
    for i in range(size):
        j = i
        while j >= 0:
            visible[i, j] = True
            j = parents[j] if j else -1
        depth.append(0 if i == 0 else depth[parents[i]] + 1)
    tokens = torch.randint(100, 10_000, (size,), generator=torch.Generator().manual_seed(size))
    return ForwardItem(cache, tokens, context + torch.tensor(depth), visible)


def bootstrap(values: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm = triedec.load()
    adapter = lm.adapter
    assert adapter.exact_attention, "triedec's tree-attention kernel did not load"
    rng = random.Random(1)
    cells = []
    for context in (256, 2048):
        cache = adapter.new_cache(context + 64)
        adapter.prefill(cache, torch.randint(100, 10_000, (64,), generator=torch.Generator().manual_seed(0)))
        cache.commit(list(range(64)))
        cache.extend_to(context)
        for size in (1, 16, 64):
            item = tree_item(cache, context, size)

            def forward(exact: bool, item: ForwardItem = item, cache=cache) -> float:
                adapter.exact_attention = exact
                start = time.perf_counter()
                adapter.forward_batch([item])
                seconds = time.perf_counter() - start
                cache.commit([])
                return seconds

            for exact in (True, False, True, False):  # warm-up
                forward(exact)
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.pairs):
                order = [True, False]
                rng.shuffle(order)
                for exact in order:
                    times[exact].append(forward(exact))
            ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
            low, high = bootstrap(ratios)
            cells.append({"context": context, "tokens": size, "fixed_order_ms": 1000 * statistics.median(times[True]),
                          "sdpa_ms": 1000 * statistics.median(times[False]), "ratio": statistics.median(ratios),
                          "ratio_interval": [low, high], "pairs": args.pairs})
    adapter.exact_attention = True
    commit = source_commit()
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                           "torch": torch.__version__, "platform": platform.platform()},
               "commit": commit, "kernels": adapter.kernels, "exactness": adapter.exactness, "cells": cells}
    lines = [f"forward of the default model, {torch.get_num_threads()} threads, commit {commit}; "
             f"median of {args.pairs} shuffled pairs; ratio = fixed-order / sdpa per pair, median [95% bootstrap]",
             "", "| context | new tokens | fixed-order ms | sdpa ms | ratio |", "|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['context']} | {c['tokens']} | {c['fixed_order_ms']:.1f} | {c['sdpa_ms']:.1f} | "
                     f"{c['ratio']:.2f} [{c['ratio_interval'][0]:.2f}, {c['ratio_interval'][1]:.2f}] |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "results.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
