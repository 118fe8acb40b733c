"""Diagnose the mismatches of a sampled benchmark run: rerun the reference (`ar`) and the
mismatching method on each mismatching prompt with its seed (drafters' learned state starts
cold here, so a mismatch that depended on it may not reproduce), and report where they first differ
and the draw's CDF margin under stock transformers' logits (see ``harness.first_mismatch``).

    .venv/bin/python scripts/diagnose_sampled_mismatches.py benchmarks/spec-bench-sampled-cpu
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import triedec
from triedec.bench.datasets import load_questions, select
from triedec.bench.harness import _messages, first_mismatch
from triedec.bench.run import parse_method_entry
from triedec.core.sampling import Sampling


def main(folder: str) -> None:
    torch.set_num_threads(2)
    results = json.loads((Path(folder) / "results.json").read_text())
    sampling = Sampling(**results["sampling"])
    lm = triedec.load()
    questions = {q.id: q for q in select(load_questions(results["dataset"]), results["per_category"], None)}
    found = []
    for smp in results["samples"]:
        if not smp.get("first_mismatch"):
            continue
        qid, _, turn = smp["id"].partition("-turn")
        q = questions[qid]
        history: list[dict[str, str]] = []
        turns = int(turn or 1)
        for t in range(turns):  # earlier turns were prompts of their own, with the seeds before this one
            params = {**sampling.as_dict(), "seed": smp["seed"] - (turns - 1 - t)}
            prompt = lm.encode(_messages(history, q.turns[t], True))
            reference = lm.generate(prompt, "ar", max_new_tokens=results["max_new_tokens"], **params).token_ids
            history += [{"role": "user", "content": q.turns[t]},
                        {"role": "assistant", "content": lm.tokenizer.decode(reference, skip_special_tokens=True)}]
        name, options = parse_method_entry(smp["method"])
        method = triedec.method(name)
        tokens = lm.generate(prompt, name, max_new_tokens=results["max_new_tokens"], **params,
                             **method.spec.parse_options(options)).token_ids
        diagnosis = first_mismatch(lm, prompt, reference, tokens, sampling, smp["seed"]) if tokens != reference \
            else {"reproduced": False}
        found.append({"id": smp["id"], "method": smp["method"], "seed": smp["seed"], "benchmark": smp["first_mismatch"],
                      "rerun": diagnosis})
        print(json.dumps(found[-1]))
    (Path(folder) / "mismatch-diagnosis.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
