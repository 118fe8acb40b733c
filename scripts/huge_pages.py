"""What placing the packed weights in huge pages (``triedec.model.hugepages``) buys a forward: in
one process, the native forward on the weights as loaded (one mapping advised for huge pages)
against the same forward on copies of them in torch's ordinary allocations (4 KiB pages unless
the kernel's ``transparent_hugepage`` is ``always``), the two alternating in a shuffled order per
round on the same cache. Checks the two give the same logits (``torch.equal``).

    .venv/bin/python scripts/huge_pages.py --out benchmarks/huge-pages-cpu \\
        --model default --model models/gemma-3-270m-q4_k_m.gguf --model models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import triedec
from triedec.bench.report import machine_info, source_commit, versions
from triedec.model.adapter import ForwardItem
from triedec.model.hugepages import in_placed_memory
from triedec.model.linears import LinearStandIn
from triedec.model.runner import native_decoder


def _thp_setting() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


def _anon_huge_kib() -> int | None:
    try:
        for line in Path(f"/proc/{os.getpid()}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def measure(model: str | None, weights: str, rows: list[int], rounds: int, per_round: int,
            context: int) -> dict:
    lm = triedec.load(model, weights=weights)
    adapter = lm.adapter
    runner = adapter._runner
    if runner is None or not adapter.native_forward:
        raise SystemExit(f"{model}: no native forward in {weights}")
    linears = [m for m in adapter.model.modules() if isinstance(m, LinearStandIn) and m._buffers]
    placed = all(in_placed_memory(t) for m in linears for t in m._buffers.values() if t is not None)
    # the same decoder on copies of the weights in torch's own allocations
    held = {id(m): dict(m._buffers) for m in linears}
    for m in linears:
        for name, t in list(m._buffers.items()):
            if t is not None:
                m._buffers[name] = t.clone()
    ordinary = native_decoder(adapter.model, runner.layers)
    for m in linears:
        m._buffers.update(held[id(m)])
    decoders = {"huge pages": runner._native, "4 KiB pages": ordinary}
    cache = adapter.new_cache(context + max(rows) + 8)
    ctx = torch.randint(100, 4000, (context,), generator=torch.Generator().manual_seed(0))
    adapter.prefill(cache, ctx)
    cache.commit(list(range(context)))
    out: dict = {"model": model or "default", "weights": weights, "placed": placed,
                 "anon_huge_pages_kib": _anon_huge_kib(), "shapes": {}}
    order = random.Random(0)
    for n in rows:
        item = ForwardItem(cache, torch.full((n,), 1234), torch.arange(context, context + n),
                           torch.ones((n, n), dtype=torch.bool).tril(), -1)

        def forward(name: str, item: ForwardItem = item) -> torch.Tensor:
            runner._native = decoders[name]
            logits = adapter.forward_batch([item])[0]
            cache.commit([])
            return logits

        equal = torch.equal(forward("huge pages"), forward("4 KiB pages"))
        medians: dict[str, list[float]] = {name: [] for name in decoders}
        for _ in range(rounds):
            names = list(decoders)
            order.shuffle(names)
            for name in names:
                forward(name)
                times = []
                for _ in range(per_round):
                    start = time.perf_counter()
                    forward(name)
                    times.append(time.perf_counter() - start)
                medians[name].append(1e3 * statistics.median(times))
        runner._native = decoders["huge pages"]
        ratios = [a / b for a, b in zip(medians["4 KiB pages"], medians["huge pages"], strict=True)]
        out["shapes"][str(n)] = {
            "median_ms": {name: statistics.median(v) for name, v in medians.items()},
            "ratio_geomean": statistics.geometric_mean(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "rounds_faster": sum(r > 1 for r in ratios), "rounds": rounds, "logits_equal": equal}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=None, help="'default' or a GGUF (repeatable)")
    parser.add_argument("--weights", default="int4-a8")
    parser.add_argument("--rows", default="1,16", help="tokens in the forward (a chain), comma-separated")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--per-round", type=int, default=15)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results = [measure(None if m == "default" else m, args.weights, rows, args.rounds, args.per_round, args.context)
               for m in (args.model or ["default"])]
    lines = [f"{args.weights}, {args.threads} threads, {args.context}-token cache, transparent_hugepage: "
             f"`{_thp_setting()}`; median ms of each placement over {args.rounds} rounds (each round's "
             f"median of {args.per_round} forwards), the two alternating in a shuffled order per round; "
             "ratio: 4 KiB pages' time over huge pages', geometric mean [min, max] over the rounds", "",
             "| model | tokens | huge pages, ms | 4 KiB pages, ms | ratio | rounds huge faster | logits equal |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for n, s in r["shapes"].items():
            lines.append(f"| {Path(r['model']).name} | {n} | {s['median_ms']['huge pages']:.2f} | "
                         f"{s['median_ms']['4 KiB pages']:.2f} | {s['ratio_geomean']:.3f} [{s['ratio_min']:.3f}, "
                         f"{s['ratio_max']:.3f}] | {s['rounds_faster']} of {s['rounds']} | "
                         f"{'yes' if s['logits_equal'] else 'NO'} |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "transparent_hugepage": _thp_setting(),
            "results": results, "machine": machine_info(torch.device("cpu")), "versions": versions(),
            "commit": source_commit()}, indent=2))
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0 if all(s["logits_equal"] for r in results for s in r["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
