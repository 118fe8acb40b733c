"""What drafting from the prefix trie buys on a request asked again (a regenerated answer, a
retried call): the project's 8 passages with their first question (``prefix_workloads.json``),
each asked twice in a row, with ``pld`` and ``auto``, once with a prefix trie (the second ask
finds the first answer in the trie past its prompt, and its drafter gets it as a document) and
once without; each arm in a learned-state scope of its own, so ``auto``'s store learns the same
first answers in both. Greedy, the default model in its default mode, in-process (no server).
Reports the second ask's tokens per forward and steps, and whether its tokens equal the first's.

    .venv/bin/python scripts/prefix_repeat.py --out benchmarks/prefix-repeat-cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import triedec
from triedec.api.generation import GenerationRequest
from triedec.bench.datasets import prefix_workloads
from triedec.bench.report import machine_info, source_commit, versions
from triedec.core.prefixtrie import PrefixTrie
from triedec.engine.batch import run_alone

SYSTEM = "Answer from the passage, briefly."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = triedec.load()
    data = prefix_workloads()
    rows = []
    for method in ("pld", "auto"):
        for arm in ("trie", "no trie"):
            trie = PrefixTrie(1 << 30) if arm == "trie" else None
            for passage in data["passages"]:
                messages = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"{passage['text']}\n\nQuestion: {data['questions'][0]}"}]
                asks = []
                for _ in range(2):
                    run = lm.start(GenerationRequest.of(messages, method, max_new_tokens=args.max_tokens),
                                   scope=(method, arm))
                    tokens = []
                    steps = run_alone(lm.adapter, run, lm.cost_model(), lm.limits, trie)
                    try:
                        while True:
                            tokens += next(steps)
                    except StopIteration as done:
                        stats = done.value.stats
                    asks.append((tokens, stats))
                (first, _), (second, stats) = asks
                rows.append({"method": method, "arm": arm, "passage": passage["id"], "tokens": len(second),
                             "steps": stats.steps, "tokens_per_forward": stats.mean_accepted,
                             "cached_tokens": stats.cached_tokens, "equal": first == second})
    lines = [f"Each passage's first question asked twice in a row; the second ask's figures, greedy, "
             f"{args.max_tokens} tokens at most, the default model ({lm.adapter.precision.name}); commit "
             f"{source_commit()}", "", "| method | arm | tokens per forward (mean over 8) | steps (sum) | "
             "prompt tokens from the trie (mean) | second ask = first |", "|---|---|---|---|---|---|"]
    for method in ("pld", "auto"):
        for arm in ("trie", "no trie"):
            mine = [r for r in rows if r["method"] == method and r["arm"] == arm]
            lines.append(f"| {method} | {arm} | {statistics.fmean(r['tokens_per_forward'] for r in mine):.2f} | "
                         f"{sum(r['steps'] for r in mine)} | {statistics.fmean(r['cached_tokens'] for r in mine):.0f} "
                         f"| {sum(r['equal'] for r in mine)} of {len(mine)} |")
    report = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(report)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows, "machine": machine_info(torch.device("cpu")),
                                                       "versions": versions(), "commit": source_commit()}, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
