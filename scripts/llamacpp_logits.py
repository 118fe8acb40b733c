"""Each precision mode's logits against llama.cpp's own on the same GGUF file.

For a GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1 file), on the Spec-Bench
evaluation prompts (chat template where the model has one): llama.cpp (``llama-cpp-python``)
decodes each prompt greedily for ``--max-new-tokens`` tokens, keeping every position's logits;
then each triedec mode (float32 and the others asked for) runs the same token sequence in one
forward (teacher-forced, transformers' own forward on the mode's layers), and at every generated
position the two are compared:

* **top-1 agreement**: the share of positions where the mode's top token is llama.cpp's;
* **KL divergence** ``KL(llama.cpp || mode)`` of the next-token distributions, nats, the mean over
  positions (float64 softmax of each side's logits).

float32 here is the GGUF's dequantized weights (transformers' loader), so its row measures what
llama.cpp's own arithmetic (8-bit activations, its kernels, its attention) changes; each
quantized mode's row adds its own rounding. Needs ``llama-cpp-python`` (``bash
scripts/get-models.sh`` installs it); run with nothing else on the machine:

    .venv/bin/python scripts/llamacpp_logits.py --out benchmarks/llamacpp-logits-cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from precision_modes import MODES, header, write_results  # the script beside this one (scripts/ is on the path)

import triedec
from triedec.bench.datasets import load_questions, select, split
from triedec.bench.report import machine_info, source_commit, versions
from triedec.model.source import default_model_path


def llamacpp_continuation(llm: object, prompt: list[int], new: int, eos: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation of ``prompt`` (up to ``new`` tokens, its EOS included) and
    its logits at each generated position, ``[len(continuation), vocab]`` float32."""
    llm.reset()
    llm.eval(prompt)
    tokens: list[int] = []
    rows = []
    while len(tokens) < new:
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        rows.append(logits)
        token = int(logits.argmax())
        tokens.append(token)
        if token == eos:
            break
        llm.eval([token])
    return tokens, np.stack(rows)


@torch.inference_mode()
def compare(lm: triedec.LM, prompt: list[int], continuation: list[int], theirs: np.ndarray) -> tuple[int, float]:
    """(positions where ``lm``'s top token is llama.cpp's, the sum of KL(llama.cpp || lm)) over
    ``continuation``'s positions, teacher-forced."""
    sequence = torch.tensor([prompt + continuation])
    logits = lm.reference_model()(sequence).logits[0, len(prompt) - 1 : -1].double()
    width = min(logits.shape[-1], theirs.shape[-1])
    ours, reference = logits[:, :width], torch.from_numpy(theirs[:, :width]).double()
    agree = int((ours.argmax(-1) == reference.argmax(-1)).sum())
    p_log = torch.log_softmax(reference, -1)
    kl = float((p_log.exp() * (p_log - torch.log_softmax(ours, -1))).sum())
    return agree, kl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded default model's)")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default="float32,int4,int4-a8", help=f"comma-separated: any of {', '.join(MODES)}")
    parser.add_argument("--out", default="benchmarks/llamacpp-logits-cpu")
    args = parser.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        parser.error("needs llama-cpp-python: bash scripts/get-models.sh installs it")
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes names only {', '.join(MODES)}")
    gguf = Path(args.model) if args.model else Path(default_model_path())
    if gguf.suffix != ".gguf" or not gguf.is_file():
        parser.error(f"{gguf} is not a .gguf file")
    torch.set_num_threads(args.threads)
    say = lambda text: print(f"llamacpp_logits: {text}", file=sys.stderr, flush=True)  # noqa: E731

    questions = select(split(load_questions("spec-bench"), "evaluation"), args.per_category)
    lms = {}
    for name in modes:
        say(f"loading {name}")
        lms[name] = triedec.load(args.model, **MODES[name])
    first = next(iter(lms.values()))
    chat = first.prompts.has_chat_template
    prompts = [first.prompts.encode(q.turns[0], chat=chat) for q in questions]
    llm = Llama(model_path=str(gguf), n_ctx=max(map(len, prompts)) + args.max_new_tokens + 8, n_threads=args.threads,
                n_threads_batch=args.threads, logits_all=True, verbose=False)
    eos = int(llm.token_eos())
    totals = {name: {"agree": 0, "kl": 0.0} for name in lms}
    positions = 0
    for i, prompt in enumerate(prompts):
        continuation, theirs = llamacpp_continuation(llm, prompt, args.max_new_tokens, eos)
        positions += len(continuation)
        for name, lm in lms.items():
            agree, kl = compare(lm, prompt, continuation, theirs)
            totals[name]["agree"] += agree
            totals[name]["kl"] += kl
        say(f"prompt {i + 1}/{len(prompts)}")
    import llama_cpp

    results = {
        "machine": machine_info(torch.device("cpu")), "commit": source_commit(),
        "versions": {**versions(), "llama_cpp_python": llama_cpp.__version__},
        "command": "python " + " ".join(sys.argv), "model": str(gguf), "chat_template": chat,
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "positions": positions,
        "modes": {name: {"precision": lm.adapter.precision.name,
                         "top1_agreement_with_llamacpp": totals[name]["agree"] / positions,
                         "mean_kl_from_llamacpp": totals[name]["kl"] / positions}
                  for name, lm in lms.items()},
    }
    write_results(results, Path(args.out), markdown)
    return 0


def markdown(results: dict) -> str:
    lines = [*header(results, f"Logits against llama.cpp's on the same GGUF ({results['prompts']} Spec-Bench "
                              f"evaluation prompts, {results['positions']} positions of llama.cpp's greedy answers)",
                     f", llama-cpp-python {results['versions']['llama_cpp_python']}"),
             "", "| mode | top-1 agreement with llama.cpp | mean KL(llama.cpp ‖ mode), nats |", "|---|---|---|"]
    for mode in results["modes"].values():
        lines.append(f"| {mode['precision']} | {mode['top1_agreement_with_llamacpp']:.3f} | "
                     f"{mode['mean_kl_from_llamacpp']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
