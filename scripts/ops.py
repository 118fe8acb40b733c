"""The op-level harness (``triedec.model.opcheck``, as ggml's ``test-backend-ops``): every op of
triedec's kernel libraries (the linear of each weight layout, tree attention, the RMS norms,
rotary) on its check shapes against a float64 reference within its bound, on every installed
library this CPU runs, bits compared across them; with ``--perf``, each op's time on the loaded
library at the default model's shapes, its multiply-adds a second and its share of this
machine's measured int8 dot-product peak (8-bit linears), and its bytes a second against the
measured memory rate (over 1: the op's data sat in the caches).

    .venv/bin/python scripts/ops.py
    .venv/bin/python scripts/ops.py --perf --threads 2 --out benchmarks/ops-cpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from triedec.bench.report import machine_info, source_commit, versions
from triedec.model.native import load_kernel
from triedec.model.opcheck import check, perf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--perf", action="store_true", help="also time each op and print its share of the peak")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="a folder for results.json and report.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = ["| op | shape | library | worst error / bound | same bits |", "|---|---|---|---|---|"]
    checked = check()
    for c in checked:
        lines.append(f"| {c.op} | {c.shape} | {c.isa} | {c.worst:.3f} | {'yes' if c.same_bits else 'NO'} |")
    failed = [c for c in checked if not c.ok]
    lines.append(f"\n{len(checked) - len(failed)} of {len(checked)} passed")
    record: dict = {"checked": [vars(c) for c in checked], "machine": machine_info(torch.device("cpu")),
                    "versions": versions(), "commit": source_commit(), "isa": load_kernel().isa(),
                    "threads": args.threads}
    if args.perf:
        peak, rate, timed = perf(repeats=args.repeats)
        lines += ["", f"int8 peak {peak / 1e9:.0f} G multiply-adds/s, memory {rate / 1e9:.1f} GB/s "
                      f"({load_kernel().isa()}, {args.threads} threads); times: median of {args.repeats} "
                      "(quartiles)", "",
                  "| op | shape | ms | G MAC/s | share of int8 peak | GB/s | share of memory rate |",
                  "|---|---|---|---|---|---|---|"]
        for t in timed:
            share = "" if t.peak_share is None else f"{t.peak_share:.0%}"
            lines.append(f"| {t.op} | {t.shape} | {t.seconds * 1e3:.3f} ({t.quartiles[0] * 1e3:.3f}-"
                         f"{t.quartiles[1] * 1e3:.3f}) | {t.macs_per_second / 1e9:.1f} | {share} | "
                         f"{t.bytes_per_second / 1e9:.1f} | {t.memory_share:.2f} |")
        record.update({"int8_peak": peak, "memory_rate": rate, "timed": [vars(t) for t in timed]})
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(record, indent=1, default=str))
        (args.out / "report.md").write_text("# Op-level harness (scripts/ops.py)\n\n" + "\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
