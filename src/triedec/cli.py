"""The ``triedec`` command: thin; it parses, calls the library, prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from triedec.errors import TriedecError
from triedec.methods import method, methods
from triedec.sampling import Sampling

DEFAULT_THREADS = 2


def _option_flags(method_name: str, options: type, option: str) -> list[str]:
    """``--METHOD-OPTION``, plus the short alias the options class declares (``CLI_ALIASES``)."""
    aliases = getattr(options, "CLI_ALIASES", {})
    return [f"--{method_name}-{option.replace('_', '-')}", *([aliases[option]] if option in aliases else [])]


def _add_method_options(parser: argparse.ArgumentParser) -> None:
    """One flag per method option (text, read by the method's option parser once the method is known)."""
    group = parser.add_argument_group("method options (see `triedec methods`)")
    for name, found in methods().items():
        for field in dataclasses.fields(found.spec.options):
            group.add_argument(*_option_flags(name, found.spec.options, field.name), dest=f"opt:{name}:{field.name}",
                               default=None, metavar="VALUE", help=f"{name}: {field.name} (default {field.default})")


def given_options(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """The method-option flags given, as text: ``{method: {option: text}}``."""
    given: dict[str, dict[str, str]] = {}
    for key, value in vars(args).items():
        if key.startswith("opt:") and value is not None:
            _, owner, option = key.split(":")
            given.setdefault(owner, {})[option] = value
    return given


def method_options(args: argparse.Namespace, method_name: str) -> dict[str, object]:
    """The option flags given for ``method_name``, parsed; flags of other methods are refused."""
    given = given_options(args)
    for owner, options in given.items():
        if owner != method_name:
            flag = _option_flags(owner, method(owner).spec.options, next(iter(options)))[-1]
            raise TriedecError(f"{flag} is an option of method {owner!r}, not {method_name!r}")
    return method(method_name).spec.parse_options(given.get(method_name, {}))


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
    parser.add_argument("--kernels", default="auto", choices=("auto", "plain"),
                        help="auto (default): faster kernels where they apply (oneDNN pre-packed linears on CPU fp32, "
                             "grouped-query sdpa under tree masks); plain: stock transformers")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (transformers' names; greedy by default)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy; > 0 samples")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the top tokens up to this mass "
                                                                 "(default 1 = off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability "
                                                                 "(default 0 = off)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL penalty on tokens already in "
                                                                              "the prefix (default 1 = off)")
    group.add_argument("--seed", type=int, default=None,
                       help="sampling seed: the same seed gives the same text with every method "
                            "(generate: drawn and reported if absent; bench: default 0, prompt k uses seed + k)")


def sampling_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as ``LM.generate`` keyword arguments."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty, "seed": args.seed}


def load_model(args: argparse.Namespace) -> Any:
    """The :class:`~triedec.lm.LM` the model flags name, with torch's CPU threads set first."""
    import torch

    from triedec.lm import load

    if args.threads < 1:
        raise TriedecError(f"--threads must be positive, got {args.threads}")
    torch.set_num_threads(args.threads)
    return load(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn, kernels=args.kernels)


def _model_name(args: argparse.Namespace) -> str:
    return args.model or "SmolLM2-135M-Instruct (embedded default, fp32)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triedec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion and print it with speed stats")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (read from stdin if absent or '-')")
    gen.add_argument("--method", default="auto", help="decoding method (default auto; see `triedec methods`)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true",
                     help="tokenize the prompt as plain text instead of applying the chat template")
    gen.add_argument("--json", action="store_true", help="print the result and stats as JSON")
    _add_sampling_args(gen)
    _add_model_args(gen)
    _add_method_options(gen)

    sub.add_parser("methods", help="list decoding methods and their options with defaults")

    cal = sub.add_parser("calibrate", help="measure what a verification forward costs on this device and pick "
                                           "the fastest draft-tree size (cached per model + device + dtype)")
    cal.add_argument("--prompts", type=int, default=6, help="calibration prompts (the first warms up; default 6)")
    cal.add_argument("--max-new-tokens", type=int, default=96, help="tokens per calibration prompt (default 96)")
    cal.add_argument("--repeats", type=int, default=5, help="timed repeats per tree size (median; default 5)")
    cal.add_argument("--show", action="store_true", help="print the cached calibration; measure only if none")
    cal.add_argument("--json", action="store_true",
                     help="print the cost curve as JSON: forward_ms per tree size, hf_forward_ms (stock transformers' "
                          "own forward of 1 and 16 tokens on the same cache), and what was chosen")
    _add_model_args(cal)

    bench = sub.add_parser("bench", help="measure methods side by side on a dataset (Spec-Bench style)")
    bench.add_argument("--methods", default=None,
                       help="comma-separated: hf-greedy (hf-sample with --temperature > 0), hf-pld, or triedec "
                            "methods, each optionally with inline options as name:key=value:key=value "
                            "(default hf-greedy,hf-pld,ar,pld; sampling: hf-sample,hf-pld,ar,pld); "
                            "llamacpp[:gguf=PATH] adds llama.cpp on the model's GGUF (extra triedec[llamacpp]; "
                            "quantized, tokens not compared)")
    bench.add_argument("--dataset", default="spec-bench",
                       help="spec-bench, humaneval, mbpp or a path to a .jsonl file (fields prompt or turns)")
    bench.add_argument("--per-category", type=int, default=None,
                       help="questions per category: a fixed, evenly spaced sample (default: all)")
    bench.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    bench.add_argument("--split", choices=("evaluation", "tuning", "all"), default=None,
                       help="which part of a shipped dataset to sample: evaluation (default; never tuned on), "
                            "tuning (for tuning runs), all; a .jsonl file is sampled whole")
    bench.add_argument("--max-new-tokens", type=int, default=256)
    bench.add_argument("--state", choices=("cold", "warm"), default="cold",
                       help="cold (default): every method starts each prompt from no learned state (one "
                            "request); warm: learned state carries across the sample in file order, as in a "
                            "server, reset between repeats")
    bench.add_argument("--repeats", type=int, default=1,
                       help="timed runs per prompt and method, each in a fresh random order; the median is "
                            "reported (3 for published runs)")
    bench.add_argument("--order-seed", type=int, default=0, help="seed of the per-prompt method orders (default 0)")
    bench.add_argument("--warmup", type=int, default=1,
                       help="warm-up prompts (outside the sample) every method runs first, untimed (default 1)")
    bench.add_argument("--out", default="bench-results", help="output directory (default %(default)s)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--beams", default="3,8,15",
                       help="beam widths for --methods hf-beam,beam (beam-search benchmark; default %(default)s)")
    bench.add_argument("--serving", action="store_true",
                       help="serving mode: total tokens/s and p50/p95 latency against concurrency through a real "
                            "server (fresh per phase), with the openai client; --methods are triedec methods "
                            "(default auto,ar), --max-new-tokens is each request's max_tokens")
    bench.add_argument("--concurrency", default="1,2,4,8,16",
                       help="serving mode: concurrencies to load the server with (default %(default)s)")
    bench.add_argument("--batch-sizes", default="1,4,8,16",
                       help="serving mode: request counts for lm.generate_batch vs transformers' generate_batch "
                            "(default %(default)s; 'none' skips)")
    _add_sampling_args(bench)
    _add_model_args(bench)
    _add_method_options(bench)

    cmp = sub.add_parser("compare", help="compare two bench results files per prompt (refused across machines "
                                         "unless --cross-machine)")
    cmp.add_argument("a", help="results.json (or its directory): the base")
    cmp.add_argument("b", help="results.json (or its directory): compared with the base")
    cmp.add_argument("--methods", default=None, help="comma-separated methods to compare (default: every shared one)")
    cmp.add_argument("--cross-machine", action="store_true",
                     help="compare files from different machines anyway (the report says so)")
    cmp.add_argument("--json", action="store_true", help="print the comparison as JSON")

    rep = sub.add_parser("report", help="rebuild a bench run's summary, results.md and plots from its measured "
                                        "samples with this version's statistics")
    rep.add_argument("out", help="the run's output directory (holding results.json)")

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (chat and completions, "
                                       "streaming, /v1/models, /health, /metrics)")
    srv.add_argument("--method", default="auto", help="default decoding method (a request may name another in its "
                                                     "extra body; default auto)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    srv.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    srv.add_argument("--model-name", default=None,
                     help="the model id clients send and /v1/models lists (default: the model's directory name, or "
                          "SmolLM2-135M-Instruct for the embedded default)")
    srv.add_argument("--max-running", type=int, default=16,
                     help="requests decoded together, one forward per step for all (default %(default)s)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests that may wait; one more gets 503 (default %(default)s)")
    srv.add_argument("--max-tokens-per-forward", type=int, default=512,
                     help="tokens one forward carries at most: draft nodes and prompt chunks (default %(default)s)")
    srv.add_argument("--max-prefill-tokens", type=int, default=256,
                     help="prompt tokens per forward beside the running requests, in 128-token chunks "
                          "(default %(default)s)")
    srv.add_argument("--max-kv-mib", type=int, default=4096,
                     help="KV cache memory the running requests may reserve, MiB (default %(default)s; 0 = no cap)")
    srv.add_argument("--persist-every", type=int, default=16,
                     help="finished requests between writes of learned-state files; they are also written when "
                          "idle and at shutdown (default %(default)s)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (default 1 MiB)")
    srv.add_argument("--max-tokens", type=int, default=256,
                     help="max_tokens when a request gives none (default %(default)s)")
    srv.add_argument("--drain-seconds", type=float, default=30.0,
                     help="on SIGTERM, how long in-flight requests may finish (default %(default)s)")
    sec = srv.add_argument_group("security and limits (README: Security)")
    sec.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; each its own tenant); "
                          "without --api-key or --api-keys-file, TRIEDEC_API_KEY is used if set")
    sec.add_argument("--api-keys-file", metavar="FILE",
                     help="keys, one per line, each optionally followed by a space and its tenant's name")
    sec.add_argument("--public-metrics", action="store_true", help="serve /metrics without a key")
    sec.add_argument("--learning", choices=("shared", "tenant", "off"), default=None,
                     help="whose learned state (auto's store, the recycling matrix, acceptance rates) a request "
                          "drafts from: shared (everyone's), tenant (its own tenant's), off (nothing learned is kept); "
                          "default: tenant with keys, shared without")
    sec.add_argument("--max-tenants", type=int, default=64,
                     help="tenants whose learned state is kept in memory (default %(default)s)")
    sec.add_argument("--tenant-max-running", type=int, default=None,
                     help="requests of one tenant decoded at once (default: up to --max-running)")
    sec.add_argument("--tenant-max-queued", type=int, default=None,
                     help="requests of one tenant waiting beyond those; one more gets 429 (default: up to --max-queue)")
    sec.add_argument("--max-request-seconds", type=float, default=None,
                     help="a request's whole time, queue included: past it, it ends with what it has "
                          "(finish_reason length), or 408 before its first token (default: no limit)")
    sec.add_argument("--max-tokens-limit", type=int, default=4096,
                     help="the most max_tokens a request may ask for (default %(default)s)")
    sec.add_argument("--body-seconds", type=float, default=30.0,
                     help="a request body must arrive within this time, else 408 (default %(default)s)")
    sec.add_argument("--send-seconds", type=float, default=60.0,
                     help="a client that takes no response data for this long is disconnected (default %(default)s)")
    out = srv.add_argument_group("scaling out (README: Scaling out)")
    out.add_argument("--redis-url", default=None, metavar="URL",
                     help="share learned state with every replica naming the same Redis, redis://HOST:PORT/DB "
                          "(extra triedec[redis]); TRIEDEC_REDIS_URL is used if this is not given (a URL with a "
                          "password stays out of the process list)")
    out.add_argument("--share-interval", type=float, default=0.5,
                     help="seconds between two exchanges of learned state through Redis (default %(default)s)")
    out.add_argument("--share-max-entries", type=int, default=1_000,
                     help="entries each Redis stream of learned state keeps, about (default %(default)s)")
    _add_model_args(srv)
    _add_method_options(srv)
    return parser


def cmd_methods() -> int:
    for name, found in methods().items():
        print(f"{name}: {found.description}")
        for field in dataclasses.fields(found.spec.options):
            default = "auto" if field.default is None else field.default
            print(f"    {', '.join(_option_flags(name, found.spec.options, field.name))}  (default {default})")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from triedec.calibration import calibration_path
    from triedec.drafters.base import profile_specs

    for flag in ("prompts", "max_new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            raise TriedecError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.prompts < 2:
        raise TriedecError("--prompts must be at least 2 (the first one warms up)")
    lm = load_model(args)
    specs = profile_specs()
    if args.show:
        cal = lm.calibration(frozenset({"cost", *specs}))
    else:
        cal = lm.recalibrate(prompts=args.prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    path = calibration_path(lm.cache_dir, lm.adapter)
    cost = cal.cost
    reference = cal.details.get("reference_forward_seconds", {})
    if args.json:
        print(json.dumps({
            "model_id": cal.model_id, "device": cal.device, "dtype": cal.dtype, "kernels": lm.adapter.kernels,
            **cost.surface_ms(),
            "hf_forward_ms": {str(t): round(s * 1000, 2) for t, s in reference.items()},
            "ratio_to_hf1": {str(t): round(s / reference["1"], 3) for t, s in cost.forward_seconds.items()}
            if "1" in reference else {},
            "profiles": {name: specs[name].dump(p) for name, p in cal.profiles.items()},
            "file": str(path),
        }, indent=1))
        return 0
    print(f"device {cal.device}; model {cal.model_id}; each request on a {cost.context_tokens}-token cache")
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
              + f"; triedec's kernels: {lm.adapter.kernels}")
    for name, profile in cal.profiles.items():
        print("\n".join(specs[name].describe(profile, cost)))
    print(f"saved in {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise TriedecError("the prompt is empty")
    options = method_options(args, args.method)
    sampling = sampling_args(args)
    Sampling(**sampling)  # bad values fail before the model loads
    lm = load_model(args)
    lm.decoder(args.method, **options)  # build (and validate) the method before any output
    chat = not args.raw and lm.has_chat_template
    printer = _StreamPrinter(lm.tokenizer, args.stop or ()) if not args.json else None
    result = lm.generate(
        prompt, args.method, max_new_tokens=args.max_new_tokens, stop=args.stop, chat=chat,
        on_tokens=printer, **sampling, **options,
    )
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
    """Prints text as tokens arrive (a :class:`~triedec.text.TextStream`: incomplete characters
    are held back, and the text ends right after a stop string, as the library's does)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        from triedec.text import TextStream

        self.text = TextStream(tokenizer, stops, keep_stop=True)

    def __call__(self, new: list[int]) -> None:
        sys.stdout.write(self.text.add(new))
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write(self.text.finish())
        sys.stdout.flush()


def _api_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """The server's API keys: --api-key and --api-keys-file, else ``TRIEDEC_API_KEY`` (as vLLM
    reads ``VLLM_API_KEY``); None when there are none."""
    from triedec.server.auth import ApiKeys

    given = list(args.api_key)
    if not given and not args.api_keys_file and environ.get("TRIEDEC_API_KEY"):
        given = [environ["TRIEDEC_API_KEY"]]
    return ApiKeys.load(given, args.api_keys_file, public_metrics=args.public_metrics)


def cmd_serve(args: argparse.Namespace) -> int:
    from triedec.server import ServerConfig, serve

    if not 0 < args.port < 65536:
        raise TriedecError(f"--port must lie in 1..65535, got {args.port}")
    options = method_options(args, args.method)
    name = args.model_name or (Path(args.model).name if args.model else "SmolLM2-135M-Instruct")
    if args.max_kv_mib < 0:
        raise TriedecError(f"--max-kv-mib must be >= 0, got {args.max_kv_mib}")
    keys = _api_keys(args, os.environ)
    config = ServerConfig(method=args.method, method_options=options, model_name=name, max_running=args.max_running,
                          max_queue=args.max_queue, max_tokens_per_forward=args.max_tokens_per_forward,
                          max_prefill_tokens=args.max_prefill_tokens,
                          max_kv_bytes=args.max_kv_mib << 20 if args.max_kv_mib else None,
                          persist_every=args.persist_every, max_body_bytes=args.max_body_bytes,
                          default_max_tokens=args.max_tokens, drain_seconds=args.drain_seconds,
                          api_keys=keys, learning=args.learning, max_tenants=args.max_tenants,
                          tenant_max_running=args.tenant_max_running, tenant_max_queued=args.tenant_max_queued,
                          max_request_seconds=args.max_request_seconds, max_tokens_limit=args.max_tokens_limit,
                          body_seconds=args.body_seconds, send_seconds=args.send_seconds,
                          redis_url=args.redis_url or os.environ.get("TRIEDEC_REDIS_URL") or None,
                          share_interval=args.share_interval, share_max_entries=args.share_max_entries)
    logging.getLogger("triedec.server").info(
        "API keys: %s; learning: %s; learned state shared through Redis: %s",
        keys or "none (the server is open to anyone who can reach it)", config.tenancy().learning,
        "yes" if config.redis_url else "no")
    lm = load_model(args)
    serve(lm, config, host=args.host, port=args.port)
    return 0


def cmd_serving(args: argparse.Namespace) -> int:
    from triedec.bench.datasets import DATASETS, load_questions, select, split
    from triedec.bench.report import machine_info, source_commit
    from triedec.bench.serving import ServingConfig, parse_counts, run_serving, serving_markdown, serving_plot

    if not Sampling(**sampling_args(args)).plain:
        raise TriedecError("the serving benchmark is greedy: run it without --temperature and --repetition-penalty")
    from triedec.bench.serving import Entry

    methods = [m.strip() for m in (args.methods or "auto,ar").split(",") if m.strip()]
    for m in methods:
        Entry.parse(m)  # an unknown name or option fails before the model loads
    sizes = () if args.batch_sizes.strip().lower() == "none" else parse_counts(args.batch_sizes, "--batch-sizes")
    config = ServingConfig(parse_counts(args.concurrency, "--concurrency"), args.max_new_tokens, sizes)
    categories = args.categories.split(",") if args.categories else None
    if args.split is not None and args.dataset not in DATASETS:
        raise TriedecError("--split applies to the shipped datasets; a .jsonl file is sampled whole")
    part = args.split or ("evaluation" if args.dataset in DATASETS else "all")
    questions = select(split(load_questions(args.dataset), part), args.per_category, categories)
    lm = load_model(args)
    serve_args = [*(["--model", args.model] if args.model else []), "--dtype", args.dtype, "--device", args.device,
                  "--attn", args.attn, "--threads", str(args.threads), "--kernels", args.kernels]
    results = run_serving(lm, methods, questions, config, serve_args, _model_name(args),
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
    from triedec.bench.datasets import DATASETS, load_questions, select
    from triedec.bench.harness import BenchConfig
    from triedec.bench.run import run_entries

    if args.serving:
        return cmd_serving(args)

    sampling = Sampling(**sampling_args(args))
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
        model_name=_model_name(args), model_path=args.model,
        option_defaults=given_options(args), extra_runners=extra_runners, progress=progress,
    )
    print(text)
    print(f"results written to {args.out}/")
    return 0


def main(argv: Sequence[str] | None = None, *, extra_runners: Mapping[str, Any] | None = None) -> int:
    """Entry point. ``extra_runners`` lets tests add benchmark-only methods."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="triedec: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per HTTP call (bench --serving)
    try:
        if args.command == "methods":
            return cmd_methods()
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
