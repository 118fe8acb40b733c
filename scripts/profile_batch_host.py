"""Host time per request-step at B requests, as the server's batch runs them (``learn_cost`` and
``gate_drafts`` on): the step's wall time outside its forward, split by cProfile into the
drafters' ``propose`` and ``observe`` and the rest, for ``ar`` and ``auto`` on tuning-split chat
prompts (never the published ones; ``--per-category N``: N of every category, long documents
among them, instead of the split's first, all MT-bench), fresh learned state per method.

    .venv/bin/python scripts/profile_batch_host.py [--requests 16] [--slots 8] [--tokens 96] [--profile]
        [--measure-drafting]

``--measure-drafting`` runs the batch as the server does (``measure_drafting`` and ``fair`` on too)
and prints what its A/B of drafting measured at each load level (``DraftPayoff.report``).

Without ``--profile`` only wall clocks run (no profiler overhead): host ms per request-step is
(sum of step seconds - sum of forward seconds) / request-steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import triedec
from triedec.api.generation import GenerationRequest
from triedec.bench.datasets import load_questions, select, split
from triedec.core.limits import BatchLimits
from triedec.engine.batch import Batch


def run(lm: triedec.LM, method: str, prompts: list[str], tokens: int, profile: bool, gate: bool, top: int,
        slots: int, temperature: float, measure: bool = False) -> None:
    runs = [lm.start(GenerationRequest.of([{"role": "user", "content": p}], method, max_new_tokens=tokens,
                                          temperature=temperature, seed=k if temperature else None))
            for k, p in enumerate(prompts)]
    batch = Batch(lm.adapter, lm.cost_model(), BatchLimits(max_running=slots), learn_cost=True, gate_drafts=gate,
                  fair=measure, measure_drafting=measure)
    for r in runs:
        batch.submit(r)
    profiler = cProfile.Profile() if profile else None
    step_s = forward_s = 0.0
    request_steps = steps = prefill_steps = 0
    prefill_s = 0.0
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    while not batch.idle:
        decoding = sum(1 for i in batch.running if not batch.runs[i].prefilling) if batch.running else 0
        report = batch.step()
        if report.plan.prefill_tokens:
            prefill_steps += 1
            prefill_s += report.seconds
            continue  # steps that carry prompt chunks are prefill, not decoding
        steps += 1
        request_steps += decoding
        step_s += report.seconds
        forward_s += report.forward_seconds
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - started
    produced = sum(r.outcome.stats.new_tokens for r in runs)
    skipped = sum(r.outcome.stats.skipped_drafts for r in runs)
    host_ms = (step_s - forward_s) / request_steps * 1e3
    print(f"{method}: {produced} tokens in {wall:.1f} s ({produced / wall:.1f} tok/s); {steps} decode steps, "
          f"{request_steps} request-steps, {skipped} drafts skipped; host {host_ms:.2f} ms per request-step "
          f"(step {step_s / steps * 1e3:.1f} ms, forward {forward_s / steps * 1e3:.1f} ms per step); "
          f"{prefill_steps} steps with prompt chunks, {prefill_s:.1f} s")
    if batch.payoff is not None:
        for level, arms in batch.payoff.report().items():
            print(f"  load level {level}: " + ", ".join(f"{k} {v}" for k, v in arms.items()))
    if profiler:
        stats = pstats.Stats(profiler)
        for name in ("propose", "observe", "verified", "accept", "commit", "forward_batch", "allocate", "cut"):
            total = sum(v[3] for k, v in stats.stats.items() if k[2] == name)
            print(f"  {name:14s} {total / request_steps * 1e3:7.3f} ms per request-step (cumulative, under cProfile)")
        if top:
            stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--per-category", type=int, default=0,
                        help="instead of the first --requests tuning questions, this many from each category")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--slots", type=int, default=0,
                        help="requests running at once, the rest waiting for a slot as in a server (0: all)")
    parser.add_argument("--methods", default="ar,auto")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0 samples (request k seeded k)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-gate", action="store_true", help="draft every step (the gate off)")
    parser.add_argument("--top", type=int, default=0, help="with --profile: print the N costliest functions")
    parser.add_argument("--measure-drafting", action="store_true",
                        help="as the server runs it: the A/B of drafting per load level on (and fair admission)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    lm = triedec.load()
    questions = split(load_questions("spec-bench"), "tuning")
    if args.per_category:  # every category (the long RAG and summarization documents among them)
        chosen = select(questions, args.per_category)
        prompts = [q.turns[0] for q in chosen]
        warm = next(q for q in questions if q not in chosen)
    else:  # the split's first questions (all MT-bench: short prompts)
        prompts = [q.turns[0] for q in questions[1 : 1 + args.requests]]
        warm = questions[0]
    lm.generate(warm.turns[0], "auto", max_new_tokens=8)  # builds and warms up
    for method in args.methods.split(","):
        run(lm.fresh(), method, prompts, args.tokens, args.profile, not args.no_gate, args.top,
            args.slots or args.requests, args.temperature, args.measure_drafting)


if __name__ == "__main__":
    main()
