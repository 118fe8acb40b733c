"""``triedec bench``: every method measured side by side, Spec-Bench style (see ``harness``)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from triedec.bench.datasets import DATASETS, Question, load_questions, select
from triedec.bench.harness import REFERENCE, BenchConfig, HFRunner, Runner, TriedecRunner, run_benchmark, summarize
from triedec.bench.report import machine_info, write_outputs
from triedec.drafters import method_spec
from triedec.drafters.base import parse_option_value
from triedec.errors import TriedecError
from triedec.lm import LM

HF_METHODS = ("hf-greedy", "hf-pld")
HF_PLD_DEFAULT_TOKENS = 10

__all__ = ["DATASETS", "HF_METHODS", "REFERENCE", "BenchConfig", "Question", "bench", "parse_method_entry"]


def parse_method_entry(entry: str) -> tuple[str, dict[str, str]]:
    """``name[:key=value[:key=value...]]`` -> (name, {key: value})."""
    name, *parts = entry.strip().split(":")
    if not name:
        raise TriedecError(f"empty method name in {entry!r}")
    options = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise TriedecError(f"method entry {entry!r}: expected key=value after ':', got {part!r}")
        options[key.replace("-", "_")] = value
    return name, options


def _inline_value(text: str, default: object, entry: str) -> object:
    try:
        return parse_option_value(text, default)
    except TriedecError as exc:
        raise TriedecError(f"{entry}: {exc}") from exc


def make_runner(
    lm: LM,
    entry: str,
    defaults: Mapping[str, Mapping[str, object]],
    extra_runners: Mapping[str, Callable[[LM, str], Runner]] | None = None,
) -> Runner:
    """A runner for one ``--methods`` entry; per-method ``defaults`` come from ``--METHOD-OPTION``."""
    name, inline = parse_method_entry(entry)
    if extra_runners and name in extra_runners:
        return extra_runners[name](lm, entry)
    if name == "hf-greedy":
        if inline:
            raise TriedecError("hf-greedy takes no options")
        return HFRunner(lm, entry)
    if name == "hf-pld":
        unknown = set(inline) - {"num_tokens"}
        if unknown:
            raise TriedecError(f"unknown option(s) {sorted(unknown)} for hf-pld; valid options: num_tokens")
        n = _inline_value(inline.get("num_tokens", str(HF_PLD_DEFAULT_TOKENS)), HF_PLD_DEFAULT_TOKENS, entry)
        if n < 1:
            raise TriedecError(f"{entry}: num_tokens must be positive")
        return HFRunner(lm, entry, prompt_lookup_num_tokens=n)
    spec = method_spec(name)
    fields = {f.name: f.default for f in dataclasses.fields(spec.options)}
    options = dict(defaults.get(name, {}))
    for key, value in inline.items():
        if key not in fields:
            spec.make_options({key: value})  # raises the standard unknown-option error
        options[key] = _inline_value(value, fields[key], entry)
    return TriedecRunner(lm, entry, name, options)


def bench(
    lm: LM,
    *,
    methods: Sequence[str],
    dataset: str,
    out: Path,
    per_category: int | None = None,
    categories: Sequence[str] | None = None,
    config: BenchConfig | None = None,
    model_name: str = "default",
    option_defaults: Mapping[str, Mapping[str, object]] | None = None,
    extra_runners: Mapping[str, Callable[[LM, str], Runner]] | None = None,
    progress: bool = True,
    command: str | None = None,
) -> dict[str, Any]:
    """Run the benchmark and write ``results.json``, ``results.md`` and plots into ``out``.

    The reference ``hf-greedy`` is always run first (added if missing).
    """
    config = config or BenchConfig()
    entries = [m.strip() for m in methods if m.strip()]
    if not entries:
        raise TriedecError("no methods given")
    if REFERENCE in entries:
        entries.remove(REFERENCE)
    entries.insert(0, REFERENCE)
    questions = select(load_questions(dataset), per_category, categories)
    runners = [make_runner(lm, e, option_defaults or {}, extra_runners) for e in entries]

    bar_factory = None
    if progress:
        from tqdm import tqdm

        def bar_factory(total: int) -> Any:
            return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)

    samples, skipped = run_benchmark(lm, runners, questions, config, bar_factory)
    results: dict[str, Any] = {
        "machine": machine_info(lm.device),
        "model": model_name,
        "dataset": dataset,
        "max_new_tokens": config.max_new_tokens,
        "repeats": config.repeats,
        "warmup": config.warmup,
        "per_category": per_category,
        "questions": len(questions),
        "turns": len({(s["id"], s["category"]) for s in samples}),
        "command": command or "triedec bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "methods": summarize(samples),
        "samples": samples,
        "skipped": skipped,
    }
    write_outputs(results, out)
    return results
