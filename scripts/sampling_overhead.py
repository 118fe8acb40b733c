"""A quick look at what sampling costs triedec per token: ``ar`` and ``pld`` greedy, sampling at
temperature 0.7, and sampling with top-p, top-k and a repetition penalty, on one default-model
prompt (96 tokens each, after a warm-up).

    .venv/bin/python scripts/sampling_overhead.py
"""

from __future__ import annotations

import time

import torch

import triedec

SETTINGS = ({}, {"temperature": 0.7, "seed": 1},
            {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1, "seed": 1})


def main() -> None:
    torch.set_num_threads(2)
    lm = triedec.load()
    prompt = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    for method in ("ar", "pld"):
        for setting in SETTINGS:
            lm.generate(prompt, method, max_new_tokens=16, **setting)
            start = time.perf_counter()
            out = lm.generate(prompt, method, max_new_tokens=96, **setting)
            seconds = time.perf_counter() - start
            print(f"{method} {setting or 'greedy'}: {out.stats.new_tokens / seconds:.1f} tok/s, "
                  f"MAT {out.stats.mean_accepted:.2f}")


if __name__ == "__main__":
    main()
