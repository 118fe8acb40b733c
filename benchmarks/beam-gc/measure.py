"""How often should trie beam search compact its KV cache? (chooses ``BeamOptions.gc_every``)

b = 8 beams, 64 new tokens, 2 HumanEval + 2 Spec-Bench summarization prompts (the benchmark's
evenly spaced picks), every period in turn per prompt (order rotating with the prompt), one round
(kept short for the session's time); per period the seconds summed over prompts and the mean peak
KV tokens. Run from the repository root:

    python benchmarks/beam-gc/measure.py > benchmarks/beam-gc/results.json
"""

from __future__ import annotations

import json
import platform
import statistics

import torch

import triedec
from triedec.bench.datasets import load_questions, select

PERIODS = (1, 5, 15, 50, 0)
BEAMS, TOKENS, ROUNDS = 8, 64, 1


def main() -> None:
    torch.set_num_threads(2)
    lm = triedec.load()
    questions = select(load_questions("humaneval"), 2) + select(load_questions("spec-bench"), 2, ["summarization"])
    prompts = [lm.encode([{"role": "user", "content": q.turns[0]}]) for q in questions]
    lm.generate(prompts[0], "beam", num_beams=BEAMS, max_new_tokens=8)  # warm-up
    seconds = {g: [[] for _ in prompts] for g in PERIODS}
    peak = {g: [] for g in PERIODS}
    outputs = {}
    for r in range(ROUNDS):
        for i, ids in enumerate(prompts):
            k = (r + i) % len(PERIODS)
            order = PERIODS[k:] + PERIODS[:k]
            for g in order:
                out = lm.generate(ids, "beam", num_beams=BEAMS, max_new_tokens=TOKENS, gc_every=g)
                seconds[g][i].append(out.stats.seconds)
                if r == 0:
                    peak[g].append(out.stats.peak_kv_tokens)
                outputs.setdefault(i, set()).add(tuple(out.token_ids))
    print(json.dumps({
        "machine": {"cpu": platform.processor() or "see README", "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "beams": BEAMS, "max_new_tokens": TOKENS, "rounds": ROUNDS, "prompts": [q.id for q in questions],
        "same_output_for_every_period": all(len(v) == 1 for v in outputs.values()),
        "periods": {str(g): {"seconds": sum(statistics.median(s) for s in seconds[g]),
                             "mean_peak_kv_tokens": statistics.fmean(peak[g])} for g in PERIODS},
    }, indent=1))


if __name__ == "__main__":
    main()
