"""Entry points of ``triedec bench``: method entries, and the two protocols.

An entry is ``name[:key=value[:key=value...]]``: a triedec method with inline options, or a stock
transformers baseline (``hf-greedy``, ``hf-sample`` (sampling runs), ``hf-pld[:num_tokens=N]``
(greedy or sampling, as the run), ``hf-beam``). Each entry has an
exactness contract (:attr:`triedec.engine.methods.Method.equals`): the entries of one run must share it,
and it picks the protocol -- the Spec-Bench-style greedy benchmark (:mod:`~triedec.bench.harness`,
reference ``hf-greedy``) or the beam-search benchmark (:mod:`~triedec.bench.beam`, widths from
``beams``).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from triedec.api.lm import LM
from triedec.bench.beam import beam_markdown, parse_beams, run_beam_benchmark, summarize_beams, write_beam_outputs
from triedec.bench.datasets import (
    DATASETS,
    TUNED_ON,
    load_questions,
    questions_sha256,
    select,
    split,
    warmup_questions,
)
from triedec.bench.harness import BenchConfig, run_benchmark
from triedec.bench.llamacpp import LABEL as LLAMACPP
from triedec.bench.llamacpp import LlamaCppRunner
from triedec.bench.report import machine_info, source_commit, versions, write_outputs
from triedec.bench.runners import (
    REFERENCE,
    SAMPLED_REFERENCE,
    HFRunner,
    Runner,
    TriedecRunner,
    transformers_tokens_compared,
)
from triedec.bench.summary import leader, summarize
from triedec.core.errors import TriedecError, positive_int
from triedec.core.sampling import GREEDY_SAMPLING, Sampling
from triedec.engine.methods import BEAM_SEARCH, GREEDY, method
from triedec.model.source import default_model_path

HF_PLD_DEFAULT_TOKENS = 10
HF_BASELINES = {"hf-greedy": GREEDY, "hf-sample": GREEDY, "hf-pld": GREEDY, "hf-beam": BEAM_SEARCH,
                LLAMACPP: GREEDY}
"""Baselines (stock transformers, and llama.cpp on the GGUF file: :mod:`triedec.bench.llamacpp`)
and the protocol each one runs in (``hf-sample`` and every triedec drafter run in the speculative
protocol, greedy or sampling)."""

ProgressFactory = Callable[[int], Any]


def parse_method_entry(entry: str) -> tuple[str, dict[str, str]]:
    """``name[:key=value[:key=value...]]`` -> (name, {key: value text})."""
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


def contract(entry: str, extra: Mapping[str, object] | None = None) -> str:
    """The exactness contract of an entry (see the module doc); ``extra`` runners (tests) are greedy."""
    name, _ = parse_method_entry(entry)
    if extra and name in extra:
        return GREEDY
    return HF_BASELINES[name] if name in HF_BASELINES else method(name).equals


def make_runner(
    lm: LM,
    entry: str,
    defaults: Mapping[str, Mapping[str, str]],
    extra_runners: Mapping[str, Callable[[LM, str], Runner]] | None = None,
    sampling: Sampling = GREEDY_SAMPLING,
    cold: bool = False,
    model_path: str | None = None,
) -> Runner:
    """A runner of the speculative protocol for one entry; ``defaults`` are ``--METHOD-OPTION``
    texts per method, overridden by the entry's inline options (both read by the one option
    parser). Every runner decodes as ``sampling`` says. ``cold`` refuses options that name a
    learned-state file (it would carry state from one prompt to the next). ``model_path``: the
    ``--model`` given (None: the embedded default), whose GGUF the ``llamacpp`` baseline runs."""
    name, inline = parse_method_entry(entry)
    if extra_runners and name in extra_runners:
        return extra_runners[name](lm, entry)
    if name in (REFERENCE, SAMPLED_REFERENCE):
        if inline:
            raise TriedecError(f"{name} takes no options")
        if (name == SAMPLED_REFERENCE) == sampling.greedy:
            wanted = REFERENCE if sampling.greedy else SAMPLED_REFERENCE
            raise TriedecError(f"{REFERENCE} decodes greedily and {SAMPLED_REFERENCE} samples: with --temperature "
                               f"{sampling.temperature:g} the baseline is {wanted}")
        return HFRunner(lm, entry, sampling)
    if name == LLAMACPP:
        unknown = set(inline) - {"gguf", "lookup"}
        if unknown:
            raise TriedecError(f"unknown option(s) {sorted(unknown)} for {LLAMACPP}; valid options: gguf, lookup")
        gguf = inline.get("gguf") or model_path or str(default_model_path())
        try:
            lookup = int(inline.get("lookup", "0"))
        except ValueError as exc:
            raise TriedecError(f"{entry}: lookup must be an integer >= 0 (prompt-lookup draft tokens)") from exc
        return LlamaCppRunner(gguf, entry, lm.eos_token_ids, lm.max_context or 4096, sampling, lookup)
    if name == "hf-pld":
        unknown = set(inline) - {"num_tokens"}
        if unknown:
            raise TriedecError(f"unknown option(s) {sorted(unknown)} for hf-pld; valid options: num_tokens")
        try:
            n = int(inline.get("num_tokens", HF_PLD_DEFAULT_TOKENS))
            positive_int("num_tokens", n)
        except (ValueError, TriedecError) as exc:
            raise TriedecError(f"{entry}: num_tokens must be a positive integer") from exc
        return HFRunner(lm, entry, sampling, prompt_lookup_num_tokens=n)
    found = method(name)
    try:
        options = found.spec.parse_options({**defaults.get(name, {}), **inline})
    except TriedecError as exc:
        raise TriedecError(f"{entry}: {exc}") from exc
    files = found.spec.state_files(options)
    if cold and files:
        raise TriedecError(f"{entry}: --state cold starts every prompt from no learned state, but {', '.join(files)} "
                           "names a state file that would carry it; drop it or use --state warm")
    return TriedecRunner(lm, entry, name, options, sampling, files)


def _check_contracts(entries: Sequence[str], want: str, extra: Mapping[str, object] | None = None) -> None:
    other = [e for e in entries if contract(e, extra) != want]
    if other:
        raise TriedecError(f"{', '.join(other)} reproduce(s) {contract(other[0])}, not {want}: benchmark "
                           f"{BEAM_SEARCH} methods (hf-beam, beam) on their own, with --beams")


def bench(
    lm: LM,
    *,
    methods: Sequence[str],
    dataset: str,
    out: Path,
    per_category: int | None = None,
    categories: Sequence[str] | None = None,
    part: str | None = None,
    config: BenchConfig | None = None,
    model_name: str = "default",
    model_path: str | None = None,
    option_defaults: Mapping[str, Mapping[str, str]] | None = None,
    extra_runners: Mapping[str, Callable[[LM, str], Runner]] | None = None,
    progress: ProgressFactory | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """The speculative-decoding benchmark, greedy or sampling (``config.sampling``): run it and
    write ``results.json``, ``results.md`` and plots into ``out``.

    The sample is ``per_category`` questions of the dataset's ``part`` (default: the evaluation
    split of a shipped dataset, all of a user's file; see :mod:`~triedec.bench.datasets`). The
    speed reference (``hf-greedy``; sampling: ``hf-sample``) and the token reference
    (``hf-greedy``; sampling, or a precision mode other than float32: triedec's ``ar``) always run
    (each added if missing).
    """
    config = config or BenchConfig()
    config = dataclasses.replace(config, against_transformers=transformers_tokens_compared(lm))
    entries = [m.strip() for m in methods if m.strip()]
    if not entries:
        raise TriedecError("no methods given")
    if config.speed_reference in entries:
        entries.remove(config.speed_reference)
    entries.insert(0, config.speed_reference)
    if config.token_reference not in entries:
        entries.insert(1, config.token_reference)
    _check_contracts(entries, GREEDY, extra_runners)
    part = part or ("evaluation" if dataset in DATASETS else "all")
    everything = load_questions(dataset)
    questions = select(split(everything, part), per_category, categories)
    warmup = warmup_questions(dataset, questions, config.warmup)
    runners = [make_runner(lm, e, option_defaults or {}, extra_runners, config.sampling, config.state == "cold",
                           model_path) for e in entries]
    samples, skipped, failed = run_benchmark(lm, runners, questions, config, progress, warmup)
    calibration = lm.loaded_calibration()
    summary = summarize(samples, config.speed_reference, config.token_reference)
    results: dict[str, Any] = {
        "machine": machine_info(lm.device),
        "commit": source_commit(),
        "versions": versions(),
        "model": model_name,
        "model_id": lm.adapter.model_id,
        "kernels": lm.adapter.kernels,
        "precision": lm.adapter.precision.name,
        "exactness": lm.adapter.exactness,
        "calibration": None if calibration is None else calibration.as_dict(),
        "dataset": dataset,
        "dataset_sha256": questions_sha256(everything),
        "split": part,
        "tuned_on": TUNED_ON if dataset in DATASETS else None,
        "sample_sha256": questions_sha256(questions),
        "max_new_tokens": config.max_new_tokens,
        "state": config.state,
        "repeats": config.repeats,
        "order": f"methods in a fresh random order for every prompt and repeat (seeded: {config.order_seed})",
        "order_seed": config.order_seed,
        "warmup": config.warmup,
        "warmup_prompts": [q.id for q in warmup],
        "sampling": config.sampling.as_dict(),
        "reference": config.speed_reference,
        "token_reference": config.token_reference,
        "per_category": per_category,
        "questions": len(questions),
        "turns": len({s["id"] for s in samples}),
        "command": command or _command(),
        "methods": summary,
        "leader": leader(samples, summary, config.speed_reference),
        "samples": samples,
        "skipped": skipped,
        "failed": failed,
    }
    write_outputs(results, out)
    return results


def bench_beams(
    lm: LM,
    *,
    methods: Sequence[str],
    beams: str,
    dataset: str,
    out: Path,
    per_category: int | None = None,
    categories: Sequence[str] | None = None,
    part: str | None = None,
    max_new_tokens: int = 256,
    warmup: int = 1,
    model_name: str = "default",
    progress: ProgressFactory | None = None,
) -> dict[str, Any]:
    """The beam-search benchmark (``--methods hf-beam,beam --beams 3,8,15``; see
    :mod:`triedec.bench.beam`): run it and write ``results.json`` and ``results.md`` into ``out``.
    It always compares ``beam`` with ``hf-beam`` at every width; ``methods`` only picks it."""
    _check_contracts(methods, BEAM_SEARCH)
    widths = parse_beams(beams)
    part = part or ("evaluation" if dataset in DATASETS else "all")
    questions = select(split(load_questions(dataset), part), per_category, categories)
    samples = run_beam_benchmark(lm, questions, widths, max_new_tokens, warmup, progress)
    results = {
        "machine": machine_info(lm.device), "model": model_name, "kernels": lm.adapter.kernels,
        "precision": lm.adapter.precision.name, "exactness": lm.adapter.exactness, "dataset": dataset, "split": part,
        "categories": ",".join(categories) if categories else None,
        "per_category": per_category, "commit": source_commit(), "versions": versions(),
        "max_new_tokens": max_new_tokens, "beams": widths,
        "prompts": len({s["id"] for s in samples}),
        "command": _command(),
        "summary": summarize_beams(samples), "samples": samples,
    }
    write_beam_outputs(results, out)
    return results


def run_entries(lm: LM, methods: Sequence[str], beams: str, **kwargs: Any) -> tuple[dict[str, Any], str]:
    """Run the protocol that the entries' contract picks; the results and their markdown."""
    from triedec.bench.report import markdown

    entries = [m.strip() for m in methods if m.strip()]
    if entries and all(contract(e, kwargs.get("extra_runners")) == BEAM_SEARCH for e in entries):
        if kwargs.pop("option_defaults", None):
            raise TriedecError("--METHOD-OPTION flags do not apply to the beam-search benchmark")
        config = kwargs.pop("config")
        if not config.sampling.plain:
            raise TriedecError("beam search does not sample: run the beam-search benchmark without --temperature "
                               "and --repetition-penalty")
        kwargs.pop("extra_runners", None)
        kwargs.pop("model_path", None)
        results = bench_beams(lm, methods=entries, beams=beams, max_new_tokens=config.max_new_tokens,
                              warmup=config.warmup, **kwargs)
        return results, beam_markdown(results)
    results = bench(lm, methods=entries, **kwargs)
    return results, markdown(results)


def rebuild_report(out: Path) -> dict[str, Any]:
    """Summarize a speculative-benchmark run's samples again with this version's statistics and
    rewrite its ``results.json`` summary, ``results.md`` and plots (the samples are left as they
    were measured; ``report_rebuilt`` records the commit that rebuilt them)."""
    from triedec.bench.compare import read_results

    results = read_results(out)
    results["methods"] = summarize(results["samples"], results["reference"],
                                   results.get("token_reference", REFERENCE))
    results["leader"] = leader(results["samples"], results["methods"], results["reference"])
    results["report_rebuilt"] = source_commit()
    write_outputs(results, Path(out))
    return results


def _command() -> str:
    return "triedec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
