"""The ``triedec`` command: thin; it parses, calls the library, prints."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from triedec.api.spec import ModelSpec
from triedec.cli.flags import load_model, model_label, parse_command_line, sampling_of
from triedec.cli.method_flags import given_options, method_options, option_flags
from triedec.cli.serve_config import server_config
from triedec.core.errors import TriedecError, require_extra
from triedec.core.params import AUTO_WEIGHTS


def cmd_methods(markdown: bool = False) -> int:
    """Every registered method with its options, defaults and maxima: as text, or (``--markdown``)
    as the index docs/methods/README.md holds between its markers."""
    from triedec.engine.methods import methods

    if markdown:
        print(methods_markdown(methods()))
        return 0
    for name, found in methods().items():
        print(f"{name}: {found.description}")
        maxima = found.spec.maxima()
        for field in dataclasses.fields(found.spec.options):
            default = "auto" if field.default is None else field.default
            bound = f", at most {maxima[field.name]}" if field.name in maxima else ""
            print(f"    {', '.join(option_flags(name, found.spec.options, field.name))}  (default {default}{bound})")
    return 0


def methods_markdown(found: Mapping[str, Any]) -> str:
    """The methods index as markdown: one row per method (its page, what it does, its options
    with defaults and maxima), then each option's meaning from its options class."""
    rows = ["| method | what it does | options: default (maximum) |", "|---|---|---|"]
    notes = []
    for name, method in found.items():
        maxima = method.spec.maxima()
        fields = dataclasses.fields(method.spec.options)
        options = ", ".join(f"`{f.name}` {'auto' if f.default is None else repr(f.default)}"
                            + (f" (≤ {maxima[f.name]})" if f.name in maxima else "") for f in fields) or "—"
        rows.append(f"| [`{name}`]({name}.md) | {method.description} | {options} |")
        docs = option_docs(method.spec.options)
        if fields:
            notes.append(f"\n**`{name}`**: " + "; ".join(
                f"`{f.name}`" + (f": {docs[f.name]}" if f.name in docs else "") for f in fields) + ".")
    return "\n".join(rows) + "\n" + "\n".join(notes)


def option_docs(options: type) -> dict[str, str]:
    """Each option's docstring (the string literal right after the field in its class's source),
    on one line."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(options)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    found = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            text = " ".join(after.value.value.split())
            found[node.target.id] = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)  # Sphinx roles as code
    return found


def cmd_calibrate(args: argparse.Namespace) -> int:
    from triedec.api.calibration import calibration_path, read_calibration
    from triedec.drafters.registry import profile_specs

    for flag in ("prompts", "max_new_tokens", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise TriedecError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.prompts is not None and args.prompts < 2:
        raise TriedecError("--prompts must be at least 2 (the first one warms up)")
    lm = load_model(args)
    specs = profile_specs()
    path = calibration_path(lm.cache_dir, lm.adapter)
    if args.show:  # read only: measuring is `triedec calibrate` without --show
        found = read_calibration(lm.cache_dir, lm.adapter)
        if found is None:
            print(f"no calibration cached for this model and device (looked for {path}); `triedec calibrate` "
                  "measures it, and any method that needs it measures its part on first use", file=sys.stderr)
            return 1
        cal = found
    else:
        cal = lm.recalibrate(effort=args.effort, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                             repeats=args.repeats)
    cost = cal.cost
    reference = cal.details.get("reference_forward_seconds", {})
    if args.json:
        print(json.dumps({
            "model_id": cal.model_id, "device": cal.device, "dtype": cal.dtype, "kernels": lm.adapter.kernels,
            "precision": lm.adapter.precision.name,
            "exactness": lm.adapter.exactness,
            "effort": cal.effort, "others_cpu_share": cal.details.get("others_cpu_share"), "busy": cal.busy,
            **cost.surface_ms(),
            "hf_forward_ms": {str(t): round(s * 1000, 2) for t, s in reference.items()},
            "ratio_to_hf1": {str(t): round(s / reference["1"], 3) for t, s in cost.forward_seconds.items()}
            if "1" in reference else {},
            "profiles": {name: specs[name].dump(p) for name, p in cal.profiles.items()},
            "file": str(path),
        }, indent=1))
        return 0
    print(f"device {cal.device}; model {cal.model_id}; precision {lm.adapter.precision.name}; "
          f"{cal.effort} effort; each request on a {cost.context_tokens}-token cache")
    print("| forward of | ms | x one request's 1-token forward |")
    print("|---|---|---|")
    one = cost.seconds(1)
    for t, s in cost.forward_seconds.items():
        print(f"| 1 request, {t} tokens | {s * 1000:.0f} | {s / one:.2f} |")
    for b, row in cost.batch_seconds.items():
        for t, s in row.items():
            print(f"| {b} requests, {t} tokens | {s * 1000:.0f} | {s / one:.2f} |")
    print(f"each token of context beyond {cost.context_tokens} adds {cost.context_seconds * 1e6:.2f} ms per 1,000 "
          "tokens to a forward")
    if reference:
        print("stock transformers' own forward on a 512-token cache: "
              + ", ".join(f"{t} token(s) {v * 1000:.0f} ms" for t, v in reference.items())
              + f"; triedec's kernels: {lm.adapter.kernels} ({lm.adapter.exactness})")
    for name, profile in cal.profiles.items():
        print("\n".join(specs[name].describe(profile, cost)))
    share = cal.details.get("others_cpu_share")
    if share is not None:
        print(f"other processes took {100 * share:.0f}% of the CPU its threads needed while the cost model was measured"
              + (": marked busy, measured again on the next load" if cal.busy else ""))
    missing = sorted(set(specs) - set(cal.profiles))
    if missing:
        print(f"not measured yet: {', '.join(missing)} (measured on first use, or by `triedec calibrate`)")
    print(f"saved in {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from triedec.api.generation import GenerationRequest, vars_of

    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise TriedecError("the prompt is empty")
    # every check that needs no model runs before the model loads
    request = GenerationRequest(prompt, args.method, method_options(args, args.method), args.max_new_tokens,
                                tuple(args.stop or ()), sampling=sampling_of(args))
    lm = load_model(args)
    request = dataclasses.replace(request, chat=not args.raw and lm.has_chat_template)
    lm.decoder(request.method, **vars_of(request.options))  # build the method (it may measure) before any output
    printer = _StreamPrinter(lm.tokenizer, request.stop) if not args.json else None
    result = lm.generate(request, on_tokens=printer)
    stats = result.stats
    sequences = [{"text": lm.decode_result(h.token_ids), "token_ids": list(h.token_ids), "score": h.score}
                 for h in result.sequences]
    if args.json:
        out = {"method": args.method, "text": result.text, "token_ids": result.token_ids, "stats": stats.as_dict()}
        print(json.dumps({**out, "sequences": sequences} if sequences else out, indent=2))
        return 0
    assert printer is not None
    printer.finish()
    for i, seq in enumerate(sequences[1:], start=2):
        print(f"\n--- hypothesis {i} (score {seq['score']:.4f}) ---\n{seq['text']}")
    best = f" | best score {sequences[0]['score']:.4f}" if sequences else ""
    print(f"\n[{args.method}] {stats.summary()}{best}")
    return 0


class _StreamPrinter:
    """Prints text as tokens arrive (a :class:`~triedec.api.text.TextStream`: incomplete characters
    are held back, and the text ends right after a stop string, as the library's does)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        from triedec.api.text import TextStream

        self.text = TextStream(tokenizer, stops, keep_stop=True)

    def __call__(self, new: list[int]) -> None:
        sys.stdout.write(self.text.add(new))
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write(self.text.finish())
        sys.stdout.flush()


def cmd_serve(args: argparse.Namespace) -> int:
    config = server_config(args, os.environ)
    logging.getLogger("triedec.server").info(
        "API keys: %s; learning: %s; learned state shared through Redis: %s",
        config.api_keys or "none (the server is open to anyone who can reach it)", config.tenancy().learning,
        "yes" if config.redis_url else "no")
    if args.ray:
        try:
            from triedec.ray.app import RaySettings, run
        except ImportError as exc:
            raise TriedecError(f"--ray needs Ray Serve ({exc}): pip install 'triedec[ray]'") from exc
        run(RaySettings.from_args(args), ModelSpec.from_args(args), config, host=args.host, port=args.port)
        return 0
    if args.replicas != 1 or args.max_replicas is not None or args.affinity_slack is not None or args.gateways != 1:
        raise TriedecError("--replicas, --max-replicas, --affinity-slack and --gateways need --ray")
    from triedec.server import serve

    lm = load_model(args)
    adapter = lm.adapter
    runner = adapter.runner + (f" ({adapter.runner_note})" if adapter.runner_note else "")  # why, in words
    logging.getLogger("triedec.server").info(
        "model: precision %s%s; runner: %s; kernels: %s (%s)", adapter.precision.name,
        " (--weights auto)" if args.weights == AUTO_WEIGHTS else "", runner, adapter.kernels,
        adapter.exactness)
    serve(lm, config, host=args.host, port=args.port)
    return 0


def server_setups(given: Sequence[str] | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``--server-setup NAME=FLAGS`` values as (name, flags); each one's flags are checked by the
    ``serve`` parser now, before any model loads."""
    if not given:
        return (("", ()),)
    setups = []
    for text in given:
        name, sep, flags = text.partition("=")
        if not sep or not name.strip():
            raise TriedecError(f"--server-setup needs NAME=FLAGS, got {text!r}")
        split = tuple(shlex.split(flags))
        bad = [f for f in split if f in ("--port", "--model-name", "--max-running", "--method")]
        if bad:
            raise TriedecError(f"--server-setup may not set {', '.join(bad)}: the benchmark sets them")
        try:
            given_options(parse_command_line(["serve", *split]))
        except (SystemExit, TriedecError) as exc:
            raise TriedecError(f"--server-setup {name.strip()!r}: bad flags {flags!r}") from exc
        setups.append((name.strip(), split))
    return tuple(setups)


def cmd_serving(args: argparse.Namespace) -> int:
    from triedec.bench.datasets import DATASETS, load_questions, select, split
    from triedec.bench.report import machine_info, source_commit
    from triedec.bench.serving import Entry, ServingConfig, parse_counts, run_serving
    from triedec.bench.serving_report import serving_markdown, serving_plot

    methods = [m.strip() for m in (args.methods or "auto,ar").split(",") if m.strip()]
    for m in methods:
        Entry.parse(m)  # an unknown name or option fails before the model loads
    sizes = () if args.batch_sizes.strip().lower() == "none" else parse_counts(args.batch_sizes, "--batch-sizes")
    sampling = sampling_of(args)
    if not sampling.greedy and sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=0)  # request k: seed k, as the benchmark's prompt k
    config = ServingConfig(parse_counts(args.concurrency, "--concurrency"), args.max_new_tokens, sizes,
                           seed=args.order_seed, repeats=args.repeats, sampling=sampling,
                           setups=server_setups(args.server_setup))
    categories = args.categories.split(",") if args.categories else None
    if args.split is not None and args.dataset not in DATASETS:
        raise TriedecError("--split applies to the shipped datasets; a .jsonl file is sampled whole")
    part = args.split or ("evaluation" if args.dataset in DATASETS else "all")
    questions = select(split(load_questions(args.dataset), part), args.per_category, categories)
    lm = load_model(args)
    serve_args = ModelSpec.from_args(args).as_flags()
    results = run_serving(lm, methods, questions, config, serve_args, model_label(args),
                          progress=None if args.no_progress else lambda text: print(f"triedec: {text}",
                                                                                    file=sys.stderr))
    results = {"machine": machine_info(lm.device), "commit": source_commit(), "dataset": args.dataset, "split": part,
               "per_category": args.per_category, "command": "triedec " + " ".join(sys.argv[1:]), **results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = serving_markdown(results)
    (out / "results.md").write_text(text + "\n![tokens/s and latency against concurrency](serving.png)\n")
    serving_plot(results, out)
    print(text)
    print(f"results written to {args.out}/")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from triedec.bench.compare import compare_markdown, compare_results, read_results

    methods = [m for m in args.methods.split(",") if m] if args.methods else None
    report = compare_results(read_results(args.a), read_results(args.b), methods, args.cross_machine)
    print(json.dumps(report, indent=1) if args.json else compare_markdown(report, args.a, args.b))
    return 0


def cmd_bench(args: argparse.Namespace, extra_runners: Mapping[str, Any] | None = None) -> int:
    require_extra("bench", "triedec bench")
    from triedec.bench.datasets import DATASETS, load_questions, select
    from triedec.bench.harness import BenchConfig
    from triedec.bench.run import run_entries

    if args.serving:
        return cmd_serving(args)

    sampling = sampling_of(args)
    unmatched = [name for name in ("presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")
                 if getattr(sampling, name) != getattr(type(sampling)(), name)]
    if unmatched:
        raise TriedecError(f"triedec bench compares against transformers and llama.cpp, which take no "
                           f"{', '.join(unmatched)}: use them with `triedec bench --serving` or the API")
    if not sampling.greedy and sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=0)
    config = BenchConfig(max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup,
                         sampling=sampling, state=args.state, order_seed=args.order_seed)
    if args.per_category is not None and args.per_category < 1:
        raise TriedecError(f"--per-category must be a positive integer, got {args.per_category}")
    categories = args.categories.split(",") if args.categories else None
    select(load_questions(args.dataset), args.per_category, categories)  # fail fast on bad data
    if args.split is not None and args.dataset not in DATASETS:
        raise TriedecError("--split applies to the shipped datasets; a .jsonl file is sampled whole")
    lm = load_model(args)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        def progress(total: int) -> Any:
            return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)

    entries = args.methods or ("hf-greedy" if sampling.greedy else "hf-sample") + ",hf-pld,ar,pld"
    _, text = run_entries(
        lm, entries.split(","), args.beams, dataset=args.dataset, out=Path(args.out),
        per_category=args.per_category, categories=categories, part=args.split, config=config,
        model_name=model_label(args), model_path=args.model,
        option_defaults=given_options(args), extra_runners=extra_runners, progress=progress,
    )
    print(text)
    print(f"results written to {args.out}/")
    return 0


def main(argv: Sequence[str] | None = None, *, extra_runners: Mapping[str, Any] | None = None) -> int:
    """Entry point. ``extra_runners`` lets tests add benchmark-only methods."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_command_line(argv)  # --help exits here, before torch is imported
        given_options(args)  # an unknown flag is refused before any model loads
    except TriedecError as exc:  # the command's extra is missing, or a flag names no method option
        print(f"triedec: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="triedec: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per HTTP call (bench --serving)
    try:
        if args.command == "methods":
            return cmd_methods(args.markdown)
        if args.command == "bench":
            return cmd_bench(args, extra_runners)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "report":
            from triedec.bench.report import markdown
            from triedec.bench.run import rebuild_report

            print(markdown(rebuild_report(Path(args.out))))
            return 0
        if args.command == "serve":
            return cmd_serve(args)
        return cmd_generate(args)
    except TriedecError as exc:
        print(f"triedec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
