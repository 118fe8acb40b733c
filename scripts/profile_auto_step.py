"""Where auto's time per step goes, next to ngram-trie's: the drafter's own Python (``propose``
and ``observe``, cumulative per step under cProfile) on 4 default-model prompts x 96 tokens.

    .venv/bin/python scripts/profile_auto_step.py
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

import torch

import triedec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import PROMPTS


def main() -> None:
    torch.set_num_threads(2)
    lm = triedec.load()
    prompts = [PROMPTS[i] for i in (6, 12, 13, 2)]
    for method in ("ngram-trie", "auto"):
        lm.generate(prompts[0], method, max_new_tokens=16)  # build and warm up
        profile = cProfile.Profile()
        profile.enable()
        steps = sum(lm.generate(p, method, max_new_tokens=96).stats.steps for p in prompts)
        profile.disable()
        stats = pstats.Stats(profile)

        def per_step_ms(name: str, stats: pstats.Stats = stats, steps: int = steps) -> float:
            return sum(v[3] for k, v in stats.stats.items() if k[2] == name) / steps * 1000

        print(f"{method}: {steps} steps, {stats.total_tt / steps * 1000:.1f} ms per step in all; "
              f"propose {per_step_ms('propose'):.2f} ms, observe {per_step_ms('observe'):.2f} ms per step")


if __name__ == "__main__":
    main()
