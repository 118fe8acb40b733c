"""``triedec bench --methods hf-beam,beam --beams 3,8,15``: trie beam search vs transformers'.

Protocol (one process, one loaded model): per prompt, ``hf-greedy`` once (the pass@1 baseline),
then for every beam width b, ``hf-beam`` (transformers ``generate(num_beams=b)``) and ``beam``
(triedec), in an order that alternates per prompt; peak RSS is reset before each run (as in the
greedy benchmark). Both beam searches must return the same best hypothesis: a difference is
counted as a mismatch and the method is reported as wrong, never as fast.

Metrics per method and b (means over prompts unless stated):
* ``tokens_per_s``: new tokens of the best hypothesis / seconds; ``speedup``: beam's over
  hf-beam's at the same b;
* ``kv_tokens``: KV slots held at the peak (transformers: b x (prompt + steps); triedec: the
  trie's peak); ``kv_ratio``: triedec / transformers, per prompt, averaged;
* ``kv_kb_per_token``: peak KV bytes / (prompt + new tokens);
* ``mem_kb_per_token``: peak memory increase of the run / (prompt + new tokens) -- the paper's
  "memory per token" with the loaded model as the baseline; ``peak_mem_mb``: the largest. On GPU
  this is allocated memory. On CPU it is the rise of the process's peak RSS, which only counts
  memory taken from the OS: a run after a bigger one reuses the freed heap and shows ~0, so on
  CPU read the KV columns (exact) and treat these as an upper-bound check on the first runs only;
* ``pass@1`` (HumanEval): share of problems whose answer passes the tests; code runs only in a
  separate, isolated Python process with a timeout and memory/CPU limits.
"""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from triedec.api.lm import LM
from triedec.bench.datasets import Question, data_path
from triedec.bench.harness import _messages
from triedec.bench.runners import HFRunner, RunRecord, TriedecRunner, hf_generate, measured
from triedec.core.errors import TriedecError

BASELINE = "hf-beam"
SANDBOX_TIMEOUT_S = 10.0


class HFBeamRunner:
    """Stock transformers ``generate(num_beams=b, do_sample=False)``: the best hypothesis."""

    comparable = True

    def __init__(self, lm: LM, num_beams: int) -> None:
        self.lm, self.num_beams, self.label = lm, num_beams, BASELINE

    def run(self, prompt: list[int], max_new_tokens: int, seed: int | None = None) -> RunRecord:
        done = hf_generate(self.lm, prompt, max_new_tokens, do_sample=False, num_beams=self.num_beams,
                           output_scores=True)
        out = done.output
        length = int((out.beam_indices[0] != -1).sum())  # the best hypothesis, without padding
        tokens = out.sequences[0, len(prompt) : len(prompt) + length].tolist()
        steps = done.forward_calls - 1
        details = {"kv_tokens": self.num_beams * (len(prompt) + steps), "score": float(out.sequences_scores[0])}
        return RunRecord(tokens, done.seconds, steps, done.forward_tokens - self.num_beams * len(prompt),
                         done.kv_bytes, details=details)


# ---- HumanEval pass@1 -------------------------------------------------------------------------


def humaneval_tasks() -> dict[str, dict[str, str]]:
    """task_id -> {prompt, test, entry_point} from the shipped HumanEval file."""
    import gzip

    with gzip.open(data_path("HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["task_id"]: r for r in rows}


def extract_code(answer: str) -> str:
    """The first fenced code block of a chat answer (an unclosed one runs to the end); the whole
    answer if it has none."""
    match = re.search(r"```(?:[Pp]ython|py)?[^\n]*\n(.*?)(?:```|\Z)", answer, re.S)
    return match.group(1) if match else answer


def passes(task: dict[str, str], answer: str, timeout: float = SANDBOX_TIMEOUT_S) -> bool:
    """Whether ``answer`` passes the task's tests, run in a separate isolated interpreter (``-I``,
    empty environment, a temporary working directory, CPU/memory limits, ``timeout`` seconds).
    The task's prompt (imports, signature, docstring) comes first: an answer with the whole
    function redefines it, an answer without one is taken as the body."""
    code = extract_code(answer)
    head = f"{task['prompt']}\n    pass\n\n" if f"def {task['entry_point']}" in code else task["prompt"]
    program = f"{head}{code}\n\n{task['test']}\ncheck({task['entry_point']})\n"

    def limits() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))
        resource.setrlimit(resource.RLIMIT_CPU, (int(timeout) + 1, int(timeout) + 1))

    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", program], cwd=tmp, env={}, capture_output=True, timeout=timeout,
                preexec_fn=limits if os.name == "posix" else None, check=False,
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


# ---- protocol ---------------------------------------------------------------------------------


def parse_beams(text: str) -> list[int]:
    try:
        beams = [int(b) for b in text.split(",") if b.strip()]
    except ValueError as exc:
        raise TriedecError(f"--beams must be comma-separated integers, got {text!r}") from exc
    if not beams or any(b < 2 for b in beams):
        raise TriedecError(f"--beams needs widths >= 2 (1 beam is greedy decoding), got {text!r}")
    return list(dict.fromkeys(beams))


def run_beam_benchmark(
    lm: LM,
    questions: Sequence[Question],
    beams: Sequence[int],
    max_new_tokens: int,
    warmup: int = 1,
    progress: Callable[[int], Any] | None = None,
) -> list[dict]:
    """Run the protocol (module doc); one sample row per prompt, method and width."""
    chat = lm.has_chat_template
    tasks = humaneval_tasks() if any(q.category == "humaneval" for q in questions) else {}
    greedy = HFRunner(lm, "hf-greedy")
    pairs = {b: (HFBeamRunner(lm, b), TriedecRunner(lm, "beam", "beam", {"num_beams": b})) for b in beams}
    bar = progress(len(questions) * (1 + 2 * len(beams))) if progress else None
    if questions and warmup:
        warm = lm.encode(_messages([], questions[0].turns[0], chat))
        for _ in range(warmup):
            greedy.run(warm, 16)
            for pair in pairs.values():
                for runner in pair:
                    runner.run(warm, 16)
    samples: list[dict] = []
    for qi, q in enumerate(questions):
        prompt = lm.encode(_messages([], q.turns[0], chat))
        if lm.max_context is not None and len(prompt) + max_new_tokens > lm.max_context:
            continue
        task = tasks.get(q.id)

        row = functools.partial(_row, lm, q, prompt, task)  # (method, b, record, identical) -> sample

        samples.append(row("hf-greedy", 1, measured(greedy, prompt, max_new_tokens, lm.device), None))
        if bar:
            bar.update(1)
        for b, pair in pairs.items():
            order = pair if qi % 2 == 0 else pair[::-1]
            recs = {}
            for runner in order:
                if bar:
                    bar.set_description(f"{q.category} {q.id} {runner.label} b={b}")
                recs[runner.label] = measured(runner, prompt, max_new_tokens, lm.device)
                if bar:
                    bar.update(1)
            hf, mine = (recs[r.label] for r in pair)
            samples.append(row(BASELINE, b, hf, True))
            samples.append(row(pair[1].label, b, mine, mine.tokens == hf.tokens))
            samples[-1]["kv_ratio"] = mine.details["kv_tokens"] / hf.details["kv_tokens"]
    if bar and hasattr(bar, "close"):
        bar.close()
    return samples


def _row(lm: LM, q: Question, prompt: list[int], task: dict[str, str] | None, method: str, b: int,
         rec: RunRecord, identical: bool | None) -> dict[str, Any]:
    total = len(prompt) + len(rec.tokens)
    answer = lm.tokenizer.decode(rec.tokens, skip_special_tokens=True)
    return {
        "id": q.id, "category": q.category, "method": method, "num_beams": b,
        "prompt_tokens": len(prompt), "new_tokens": len(rec.tokens), "seconds": rec.seconds,
        "steps": rec.steps, "kv_tokens": rec.details.get("kv_tokens", len(prompt) + rec.steps),
        "kv_bytes": rec.kv_bytes, "kv_kb_per_token": rec.kv_bytes / total / 1024,
        "peak_mem_mb": rec.peak_mem_bytes / 2**20, "mem_kb_per_token": rec.peak_mem_bytes / total / 1024,
        "identical_to_hf": identical, "score": rec.details.get("score"),
        "passed": passes(task, answer) if task else None,
    }


def summarize_beams(samples: Sequence[dict]) -> list[dict[str, Any]]:
    """One row per (method, b): means over prompts; speedup and ratios against hf-beam at that b."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for s in samples:
        groups.setdefault((s["method"], s["num_beams"]), []).append(s)
    rows = []
    for (method, b), rs in groups.items():
        speeds = [r["new_tokens"] / r["seconds"] for r in rs if r["seconds"] > 0]
        out: dict[str, Any] = {
            "method": method, "num_beams": b, "prompts": len(rs),
            "tokens_per_s": statistics.fmean(speeds) if speeds else 0.0,
            "kv_tokens": statistics.fmean(r["kv_tokens"] for r in rs),
            "kv_kb_per_token": statistics.fmean(r["kv_kb_per_token"] for r in rs),
            "mem_kb_per_token": statistics.fmean(r["mem_kb_per_token"] for r in rs),
            "peak_mem_mb": max(r["peak_mem_mb"] for r in rs),
            "mismatches": sum(r["identical_to_hf"] is False for r in rs),
        }
        judged = [r["passed"] for r in rs if r["passed"] is not None]
        out["pass@1"] = sum(judged) / len(judged) if judged else None
        if method != BASELINE and (BASELINE, b) in groups:  # compared with transformers at the same width
            ref = groups[(BASELINE, b)]
            ref_speeds = [r["new_tokens"] / r["seconds"] for r in ref if r["seconds"] > 0]
            ratio = out["tokens_per_s"] / statistics.fmean(ref_speeds) if ref_speeds else None
            out["speedup"] = ratio if out["mismatches"] == 0 else None
            out["kv_ratio"] = statistics.fmean(r["kv_ratio"] for r in rs)
            out["mem_ratio"] = out["mem_kb_per_token"] / statistics.fmean(r["mem_kb_per_token"] for r in ref) \
                if any(r["mem_kb_per_token"] for r in ref) else None
        rows.append(out)
    return rows


def beam_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"# triedec bench (beam search): {results['dataset']}",
        "",
        f"- command: `{results['command']}`",
        f"- model: {results['model']}; max_new_tokens {results['max_new_tokens']}; {results['prompts']} prompts",
        f"- machine: {m['cpu']}, {m['cpu_count']} cores, {m['torch_threads']} torch threads, device {m['device']}; "
        f"torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}; triedec precision "
        f"{results.get('precision', 'float32')}, kernels: {results.get('kernels', 'plain')}; "
        "hf-beam: stock transformers",
        "",
        "| method | beams | tokens/s | speedup vs hf-beam | KV tokens (peak) | KV ratio trie/hf | KV KiB/token "
        "| peak-memory increase KiB/token | its ratio | peak-memory increase MB | pass@1 | mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, d: int = 2) -> str:
        return "—" if x is None else f"{x:.{d}f}"

    for r in results["summary"]:
        lines.append(
            f"| {r['method']} | {r['num_beams']} | {f(r['tokens_per_s'], 1)} | {f(r.get('speedup'))} "
            f"| {r['kv_tokens']:.0f} | {f(r.get('kv_ratio'))} | {f(r['kv_kb_per_token'], 1)} "
            f"| {f(r['mem_kb_per_token'], 1)} | {f(r.get('mem_ratio'))} | {f(r['peak_mem_mb'], 1)} "
            f"| {f(r['pass@1'])} | {r['mismatches']} |"
        )
    return "\n".join(lines) + "\n"


def write_beam_outputs(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(beam_markdown(results))
