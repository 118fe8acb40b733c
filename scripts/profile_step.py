"""Where a decoding step's wall time goes: the time the device spends in kernels against the wall
clock, for ``ar`` and ``auto`` (greedy, chat template), under ``torch.profiler``.

On a GPU, ``kernels`` is the sum of the CUDA kernels' own times and ``host`` the rest of the wall
clock: a step is host-bound when ``host`` dominates. On a CPU, ``kernels`` is the self time of
every profiled op (the ATen ops; the linears and triedec's kernels among them) and ``host`` the
Python around them. Each method decodes the prompts once untimed, then once under the profiler,
then once timed without it (the wall clock reported):

    .venv/bin/python scripts/profile_step.py --device cuda --dtype bfloat16 --out benchmarks/step-profile-gpu
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import triedec
from triedec.bench.datasets import load_questions, select, split
from triedec.bench.report import machine_info, source_commit, versions


def kernel_ms(prof: profile, device: torch.device) -> float:
    """Milliseconds of kernel time in ``prof``: the device's kernels on a GPU, every op's self
    time on a CPU."""
    events = prof.key_averages()
    if device.type == "cuda":
        return sum(e.self_device_time_total for e in events) / 1000
    return sum(e.self_cpu_time_total for e in events) / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default="ar,auto")
    parser.add_argument("--out", default="benchmarks/step-profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    lm = triedec.load(args.model, device=device, dtype=args.dtype)
    prompts = [q.turns[0] for q in select(split(load_questions("spec-bench"), "evaluation"), args.per_category)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rows = {}
    for method in args.methods.split(","):
        for text in prompts:  # untimed: builds the method, calibrates if needed, warms the kernels
            lm.generate(text, method, max_new_tokens=args.max_new_tokens)
        with profile(activities=activities) as prof:
            steps = sum(lm.generate(text, method, max_new_tokens=args.max_new_tokens).stats.steps
                        for text in prompts)
            lm.adapter.synchronize()  # the profile holds every kernel of these steps
        start = time.perf_counter()
        outs = [lm.generate(text, method, max_new_tokens=args.max_new_tokens) for text in prompts]
        lm.adapter.synchronize()
        wall = (time.perf_counter() - start) * 1000
        tokens = sum(len(out.token_ids) for out in outs)
        kernels = kernel_ms(prof, device) / steps
        per_step = wall / sum(out.stats.steps for out in outs)
        rows[method] = {"steps": steps, "tokens": tokens, "wall_ms_per_step": per_step,
                        "kernel_ms_per_step": kernels, "host_share": max(0.0, 1 - kernels / per_step),
                        "tokens_per_s": tokens / wall * 1000}
        print(f"profile_step: {method}: {json.dumps(rows[method])}", file=sys.stderr, flush=True)
    results = {"machine": machine_info(device), "commit": source_commit(), "versions": versions(),
               "command": "python " + " ".join(sys.argv), "precision": lm.adapter.precision.name,
               "kernels": lm.adapter.kernels, "exactness": lm.adapter.exactness, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "methods": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
