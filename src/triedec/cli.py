"""The ``triedec`` command: thin; it parses, calls the library, prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from triedec.drafters import methods
from triedec.drafters.base import parse_option_value
from triedec.errors import TriedecError

DEFAULT_THREADS = 2


def _option_flag(method: str, option: str) -> str:
    return f"--{method}-{option.replace('_', '-')}"


def _add_method_options(parser: argparse.ArgumentParser) -> None:
    """One ``--METHOD-OPTION`` flag per registered method option, typed from its default."""
    group = parser.add_argument_group("method options (see `triedec methods`)")
    group.add_argument("--verify", dest="opt:lookahead:verify", choices=("independent", "trie"), default=None,
                       help="lookahead: verification mode (same as --lookahead-verify)")
    for name, spec in methods().items():
        for field in dataclasses.fields(spec.options):
            kind = type(field.default) if field.default is not None else str
            group.add_argument(
                _option_flag(name, field.name),
                dest=f"opt:{name}:{field.name}",
                type=lambda text, default=field.default: _option_value(text, default),
                default=None,
                metavar=kind.__name__.upper(),
                help=f"{name}: {field.name} (default {field.default})",
            )


def _option_value(text: str, default: object) -> object:
    try:
        return parse_option_value(text, default)
    except TriedecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def given_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The ``--METHOD-OPTION`` flags given, as ``{method: {option: value}}``."""
    given: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if key.startswith("opt:") and value is not None:
            _, owner, option = key.split(":")
            given.setdefault(owner, {})[option] = value
    return given


def method_options(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The ``--METHOD-OPTION`` values given for ``method``; refuses options of other methods."""
    given = given_options(args)
    for owner, options in given.items():
        if owner != method:
            flag = _option_flag(owner, next(iter(options)))
            raise TriedecError(f"{flag} is an option of method {owner!r}, not {method!r}")
    return given.get(method, {})


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None,
        help="HF model directory, cached hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--attn", default="sdpa", help="attention implementation: sdpa (default) or eager")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"torch CPU threads (default {DEFAULT_THREADS})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triedec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion and print it with speed stats")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (read from stdin if absent or '-')")
    gen.add_argument("--method", default="pld", help="decoding method (default pld; see `triedec methods`)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true",
                     help="tokenize the prompt as plain text instead of applying the chat template")
    gen.add_argument("--json", action="store_true", help="print the result and stats as JSON")
    beam = gen.add_argument_group("beam search (--method beam; transformers' meaning and defaults)")
    beam.add_argument("--num-beams", type=int, default=None, help="beams (default 4)")
    beam.add_argument("--length-penalty", type=float, default=None, help="score = log-prob sum / length ** this (1.0)")
    beam.add_argument("--early-stopping", default=None, choices=["true", "false", "never"], help="(default false)")
    beam.add_argument("--num-return-sequences", type=int, default=None, help="hypotheses printed (default 1)")
    beam.add_argument("--gc-every", type=int, default=None,
                      help="compact the trie KV cache every N steps; 0 = only when full (default 5)")
    _add_model_args(gen)
    _add_method_options(gen)

    sub.add_parser("methods", help="list decoding methods and their options with defaults")

    cal = sub.add_parser("calibrate", help="measure what a verification forward costs on this device and pick "
                                           "the fastest draft-tree size (cached per model + device + dtype)")
    cal.add_argument("--prompts", type=int, default=6, help="calibration prompts (the first warms up; default 6)")
    cal.add_argument("--max-new-tokens", type=int, default=96, help="tokens per calibration prompt (default 96)")
    cal.add_argument("--repeats", type=int, default=5, help="timed repeats per tree size (median; default 5)")
    cal.add_argument("--show", action="store_true", help="print the cached calibration; measure only if none")
    _add_model_args(cal)

    bench = sub.add_parser("bench", help="measure methods side by side on a dataset (Spec-Bench style)")
    bench.add_argument("--methods", default="hf-greedy,hf-pld,ar,pld",
                       help="comma-separated: hf-greedy, hf-pld, or triedec methods, each optionally "
                            "with inline options as name:key=value:key=value (default %(default)s)")
    bench.add_argument("--dataset", default="spec-bench",
                       help="spec-bench, humaneval, mbpp or a path to a .jsonl file (fields prompt or turns)")
    bench.add_argument("--per-category", type=int, default=None,
                       help="questions per category: a fixed, evenly spaced sample (default: all)")
    bench.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    bench.add_argument("--max-new-tokens", type=int, default=256)
    bench.add_argument("--repeats", type=int, default=1, help="rotations per prompt; the median is reported")
    bench.add_argument("--warmup", type=int, default=1, help="warm-up rounds of every method (not recorded)")
    bench.add_argument("--out", default="bench-results", help="output directory (default %(default)s)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--beams", default="3,8,15",
                       help="beam widths for --methods hf-beam,beam (beam-search benchmark; default %(default)s)")
    _add_model_args(bench)
    _add_method_options(bench)
    return parser


BEAM_FLAGS = ("num_beams", "length_penalty", "early_stopping", "num_return_sequences", "gc_every")


def cmd_methods() -> int:
    for name, spec in methods().items():
        print(f"{name}: {spec.description}")
        for option, default in spec.option_defaults().items():
            print(f"    {_option_flag(name, option)}  (default {default})")
    from triedec.beam import BeamOptions

    print("beam: trie beam search, transformers' results with one shared trie-shaped KV cache")
    defaults = BeamOptions()
    for option in BEAM_FLAGS:
        print(f"    --{option.replace('_', '-')}  (default {getattr(defaults, option)})")
    return 0


def beam_options(args: argparse.Namespace) -> dict[str, Any]:
    """The beam flags given; refused unless the method is ``beam``."""
    given = {f: getattr(args, f) for f in BEAM_FLAGS if getattr(args, f) is not None}
    if given and args.method != "beam":
        raise TriedecError(f"--{next(iter(given)).replace('_', '-')} is an option of method 'beam', "
                           f"not {args.method!r}")
    if "early_stopping" in given:
        given["early_stopping"] = {"true": True, "false": False}.get(given["early_stopping"], "never")
    return given


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from triedec.calibration import calibration_path, expected_speeds
    from triedec.lm import load

    for flag in ("prompts", "max_new_tokens", "repeats", "threads"):
        if getattr(args, flag) < 1:
            raise TriedecError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.prompts < 2:
        raise TriedecError("--prompts must be at least 2 (the first one warms up)")
    torch.set_num_threads(args.threads)
    lm = load(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    if args.show:
        cal = lm.calibration()
    else:
        cal = lm.recalibrate(prompts=args.prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    print(f"device {cal.device}; model {cal.model_id}; a {cal.context_tokens}-token cache")
    print("| draft nodes | ms per forward | expected tokens/step | expected tokens/s |")
    print("|---|---|---|---|")
    predicted = cal.details.get("predicted_nodes", cal.recycling_nodes)
    for row in expected_speeds(cal.recycling_rates, cal.forward_seconds):
        marks = [m for m, n in (("predicted", predicted), ("chosen", cal.recycling_nodes)) if row["nodes"] == n]
        mark = f" **{', '.join(marks)}**" if marks else ""
        print(f"| {row['nodes']} | {row['seconds'] * 1000:.0f} | {row['tokens_per_step']:.2f} | "
              f"{row['tokens_per_s']:.1f}{mark} |")
    check = cal.details.get("end_to_end")
    if check:
        print(f"end-to-end check of {predicted} nodes on the calibration prompts: {check['speedup']:.2f}x ar "
              f"(kept if >= {1 + cal.details.get('margin', 0):.2f}x)")
    print(f"recycling verifies {cal.recycling_nodes} draft nodes per step on this device "
          f"(saved in {calibration_path(lm.cache_dir, cal.model_id, lm.device, lm.adapter.dtype)})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from triedec.lm import load

    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise TriedecError("the prompt is empty")
    options = {**method_options(args, args.method), **beam_options(args)}
    if args.threads < 1:
        raise TriedecError(f"--threads must be positive, got {args.threads}")
    torch.set_num_threads(args.threads)
    lm = load(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    if args.method == "beam":  # validate the method and options before any output
        from triedec.beam import BeamOptions

        BeamOptions.from_mapping(options)
    else:
        lm.drafter(args.method, **options)
    chat = not args.raw and lm.has_chat_template
    printer = _StreamPrinter(lm.tokenizer) if not args.json else None
    result = lm.generate(
        prompt, args.method, max_new_tokens=args.max_new_tokens, stop=args.stop, chat=chat,
        on_tokens=printer, **options,
    )
    stats = result.stats
    sequences = [{"text": lm.decode_result(h.token_ids), "token_ids": list(h.token_ids), "score": h.score}
                 for h in result.sequences]
    if args.json:
        out = {"method": args.method, "text": result.text, "token_ids": result.token_ids, "stats": stats.as_dict()}
        print(json.dumps({**out, "sequences": sequences} if sequences else out, indent=2))
    elif args.method == "beam":
        printer.finish(result.text)
        for i, seq in enumerate(sequences[1:], start=2):
            print(f"\n--- hypothesis {i} (score {seq['score']:.4f}) ---\n{seq['text']}")
        print(
            f"\n[beam x{stats.num_beams}] {stats.new_tokens} tokens in {stats.seconds:.2f} s = "
            f"{stats.tokens_per_s:.1f} tok/s | best score {result.sequences[0].score:.4f} | KV peak "
            f"{stats.peak_kv_tokens} tokens (transformers: {stats.hf_peak_kv_tokens}) | stop: {stats.stop_reason}"
        )
    else:
        printer.finish(result.text)
        print(
            f"\n[{args.method}] {stats.new_tokens} tokens in {stats.seconds:.2f} s = {stats.tokens_per_s:.1f} tok/s"
            f" | {stats.steps} steps, {stats.mean_accepted:.2f} tokens/step, {stats.computed_tokens} computed"
            f" | prompt {stats.prompt_tokens} tokens, prefill {stats.prefill_seconds:.2f} s | stop: {stats.stop_reason}"
        )
    return 0


class _StreamPrinter:
    """Prints text as tokens arrive (holding back incomplete UTF-8 characters)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = ""

    def __call__(self, new: list[int]) -> None:
        self.tokens += new
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self._show(text)

    def _show(self, text: str) -> None:
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text

    def finish(self, final_text: str) -> None:
        """Print whatever is left of the final text (it may be cut at a stop string)."""
        if final_text.startswith(self.shown):
            self._show(final_text)


def cmd_bench(args: argparse.Namespace, extra_runners: Mapping[str, Any] | None = None) -> int:
    import torch

    from triedec.bench import BenchConfig, bench
    from triedec.lm import load

    if args.threads < 1:
        raise TriedecError(f"--threads must be positive, got {args.threads}")
    config = BenchConfig(max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup)
    if args.per_category is not None and args.per_category < 1:
        raise TriedecError(f"--per-category must be a positive integer, got {args.per_category}")
    defaults = given_options(args)
    from triedec.bench.datasets import load_questions, select

    categories = args.categories.split(",") if args.categories else None
    questions = select(load_questions(args.dataset), args.per_category, categories)  # fail fast on bad data
    from triedec.bench.beam import BEAM_BENCH_METHODS

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if any(n in BEAM_BENCH_METHODS for n in names):
        if set(names) - set(BEAM_BENCH_METHODS):
            raise TriedecError(f"beam-search methods ({', '.join(BEAM_BENCH_METHODS)}) are benchmarked on their own; "
                               f"got {names}")
        return _bench_beams(args, questions)
    torch.set_num_threads(args.threads)
    lm = load(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    results = bench(
        lm, methods=args.methods.split(","), dataset=args.dataset, out=Path(args.out),
        per_category=args.per_category, categories=categories, config=config,
        model_name=args.model or "SmolLM2-135M-Instruct (embedded default, fp32)", option_defaults=defaults,
        extra_runners=extra_runners, progress=not args.no_progress,
    )
    from triedec.bench.report import markdown

    print(markdown(results))
    print(f"results written to {args.out}/ (results.json, results.md, *.png)")
    return 0


def _bench_beams(args: argparse.Namespace, questions: list) -> int:
    import shlex

    import torch

    from triedec.bench.beam import parse_beams, run_beam_benchmark, summarize_beams, write_beam_outputs
    from triedec.bench.report import machine_info
    from triedec.lm import load

    beams = parse_beams(args.beams)
    if given_options(args):
        raise TriedecError("--METHOD-OPTION flags do not apply to the beam-search benchmark")
    torch.set_num_threads(args.threads)
    lm = load(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        def bar(total: int) -> Any:
            return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)

    samples = run_beam_benchmark(lm, questions, beams, args.max_new_tokens, args.warmup, bar)
    results = {
        "machine": machine_info(lm.device),
        "model": args.model or "SmolLM2-135M-Instruct (embedded default, fp32)",
        "dataset": args.dataset, "categories": args.categories, "per_category": args.per_category,
        "max_new_tokens": args.max_new_tokens, "beams": beams,
        "prompts": len({s["id"] for s in samples}),
        "command": "triedec " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "summary": summarize_beams(samples), "samples": samples,
    }
    write_beam_outputs(results, Path(args.out))
    from triedec.bench.beam import beam_markdown

    print(beam_markdown(results))
    print(f"results written to {args.out}/ (results.json, results.md)")
    return 0


def main(argv: Sequence[str] | None = None, *, extra_runners: Mapping[str, Any] | None = None) -> int:
    """Entry point. ``extra_runners`` lets tests add benchmark-only methods."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="triedec: %(message)s", stream=sys.stderr)
    try:
        if args.command == "methods":
            return cmd_methods()
        if args.command == "bench":
            return cmd_bench(args, extra_runners)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        return cmd_generate(args)
    except TriedecError as exc:
        print(f"triedec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
