"""The ``triedec`` command line's flags: the parser, and what the flags build (the model, a
method's options, the server's configuration). Shared by :mod:`triedec.cli.main` and
:mod:`triedec.ray.app` (whose replicas parse the same ``triedec serve`` flags)."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from triedec.api.spec import DEFAULT_THREADS, THREADS_ENV, ModelSpec
from triedec.cli.method_flags import add_method_options, split_method_flags, takes_method_options

if TYPE_CHECKING:
    pass



COMMANDS = {
    "generate": "generate a completion and print it with speed stats",
    "methods": "list decoding methods and their options with defaults",
    "calibrate": "measure what a verification forward costs on this device and pick the fastest draft-tree size "
                 "(cached per model, host, device, threads, dtype and kernels)",
    "bench": "measure methods side by side on a dataset (Spec-Bench style)",
    "compare": "compare two bench results files per prompt (refused across machines unless --cross-machine)",
    "report": "rebuild a bench run's summary, results.md and plots from its measured samples with this version's "
              "statistics",
    "serve": "serve the model over an OpenAI-compatible HTTP API (chat and completions, streaming, /v1/models, "
             "/health, /metrics)",
}
"""Each command and its one-line help (what `triedec --help` lists)."""


def parse_command_line(argv: Sequence[str]) -> argparse.Namespace:
    """A ``triedec`` command line, parsed. Only the named command's flags are built (with none, the
    top level alone answers ``--help``, ``--version`` and the missing-command error), and a command's
    ``--help`` imports neither torch nor transformers. A command that takes method options keeps the
    flags it does not declare in ``args.method_flags`` (``(flag, text)`` pairs,
    :func:`~triedec.cli.method_flags.given_options` reads them); argparse's own errors exit with status 2, as always."""
    argv = list(argv)
    named = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(() if named is None else (named,))
    if named not in COMMANDS:
        return parser.parse_args(argv)
    at = argv.index(named) + 1
    command = command_parser(parser, named)
    if not takes_method_options(command):
        return parser.parse_args(argv)
    kept, flags = split_method_flags(command, argv[at:])
    args = parser.parse_args([*argv[:at], *kept])
    args.method_flags = flags
    return args


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The sub-parser of command ``name`` in the ``triedec`` parser."""
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    from triedec.core.params import DEFAULT_WEIGHTS, GROUP_SIZE, WEIGHT_CHOICES

    parser.add_argument(
        "--model", default=None,
        help="HF model directory, cached hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--dtype", default=None,
                        help="activations and unquantized weights: float32 (default; bfloat16 with --weights "
                             "int8/int4/int4-a8), bfloat16 or float16")
    parser.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHT_CHOICES,
                        help="linear weights: auto (default: int4-a8 for a GGUF file stored in 4 bits on a CPU "
                             "with AVX2 or AVX512-VNNI and no --dtype or bfloat16, else float), float (in "
                             f"--dtype), int8 (per output row), int4 (groups of {GROUP_SIZE}) or int4-a8 (int4's "
                             "weights, dot products on 8-bit activations as llama.cpp); quantized weights run with "
                             "bfloat16 activations on CPU. Every method returns ar's tokens in the same mode "
                             "(docs/precision.md)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--attn", default="sdpa", help="attention implementation: sdpa (default) or eager")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch CPU threads (default: ${THREADS_ENV} if set, else {DEFAULT_THREADS}; serve --ray: "
                             "per replica, and the CPUs Ray reserves for each)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file that replaces the tokenizer's own (as vLLM's "
                             "--chat-template; default: the tokenizer's)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "plain"),
                        help="auto (default): faster kernels where they apply (oneDNN pre-packed linears on CPU: fp32, "
                             "and bf16 where oneDNN has bf16 kernels) "
                             "and triedec's fixed-order tree attention (CPU), which makes every method bit-exact "
                             "against ar; plain: stock transformers (exact up to rounding)")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    from triedec.core.params import Sampling  # its defaults are the flags' defaults

    group = parser.add_argument_group("sampling (transformers' names, OpenAI's and vLLM's for the last four; "
                                      "greedy by default)")
    group.add_argument("--temperature", type=float, default=Sampling.temperature,
                       help="> 0 samples; 0 is greedy (default %(default)s)")
    group.add_argument("--top-k", type=int, default=Sampling.top_k,
                       help="keep the k most likely tokens (default %(default)s = off)")
    group.add_argument("--top-p", type=float, default=Sampling.top_p,
                       help="nucleus: keep the top tokens up to this mass (default %(default)s = off)")
    group.add_argument("--min-p", type=float, default=Sampling.min_p,
                       help="drop tokens below min-p x the top probability (default %(default)s = off)")
    group.add_argument("--repetition-penalty", type=float, default=Sampling.repetition_penalty,
                       help="CTRL penalty on tokens already in the prefix (default %(default)s = off)")
    group.add_argument("--seed", type=int, default=Sampling.seed,
                       help="sampling seed: the same seed gives the same text with every method "
                            "(generate: drawn and reported if absent; bench: default 0, prompt k uses seed + k)")
    group.add_argument("--presence-penalty", type=float, default=Sampling.presence_penalty,
                       help="OpenAI's: subtracted once from tokens already in the output, -2 to 2 "
                            "(default %(default)s = off)")
    group.add_argument("--frequency-penalty", type=float, default=Sampling.frequency_penalty,
                       help="OpenAI's: subtracted per occurrence in the output, -2 to 2 (default %(default)s = off)")
    group.add_argument("--logit-bias", type=_bias, default=Sampling.logit_bias, metavar="ID=BIAS[,ID=BIAS...]",
                       help="added to those token ids' logits, -100 to 100 (default: none)")
    group.add_argument("--min-tokens", type=int, default=Sampling.min_tokens,
                       help="no end-of-sequence, stop token or stop string before this many tokens "
                            "(default %(default)s = off)")


def _bias(text: str) -> tuple[tuple[int, float], ...]:
    """``--logit-bias 5=-100,17=2.5`` as (id, bias) pairs (checked by :class:`Sampling`)."""
    try:
        return tuple((int(i), float(b)) for i, b in (pair.split("=", 1) for pair in text.split(",") if pair))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS pairs separated by commas, got {text!r}") from None


def sampling_of(args: argparse.Namespace) -> Any:
    """The sampling flags as a validated :class:`~triedec.core.sampling.Sampling`."""
    from triedec.core.params import SAMPLING_FIELDS, Sampling

    return Sampling(**{name: getattr(args, name) for name in SAMPLING_FIELDS})


def load_model(args: argparse.Namespace) -> Any:
    """The :class:`~triedec.api.lm.LM` the model flags name, with torch's CPU threads set first."""
    return ModelSpec.from_args(args).load()


def model_label(args: argparse.Namespace) -> str:
    return args.model or "SmolLM2-135M-Instruct (embedded default, fp32)"


def installed_version() -> str:
    """triedec's installed version, or a note that it runs from a source tree (``src`` on
    ``PYTHONPATH``, no package metadata): ``--version`` answers either way."""
    from importlib import metadata

    try:
        return metadata.version("triedec")
    except metadata.PackageNotFoundError:
        return "(not installed: running from a source tree)"


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``triedec`` parser: every command with its flags (``commands`` None), or only the
    named ``commands`` with theirs and the others as stubs. ``build_parser(())`` is the top level
    alone: enough for ``triedec --help`` and ``--version``. Building a command's flags imports
    neither torch nor transformers (``serve``'s need the server extra installed, not imported).
    Method options are read by :func:`parse_command_line`, not declared here."""
    parser = argparse.ArgumentParser(
        prog="triedec", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Faster decoding of Hugging Face causal LMs, exactly: model-free drafts verified in one forward "
                    "along a shared token trie,\nreturning the tokens plain decoding returns.",
        epilog="examples:\n"
               "  triedec generate \"Why is the sky blue?\"            the embedded default model, method auto\n"
               "  triedec generate --method pld --max-new-tokens 64 \"def fib(n):\"\n"
               "  triedec serve --port 8000                          OpenAI-compatible server; playground at /\n"
               "  triedec methods                                    methods and their options\n"
               "  triedec bench --dataset spec-bench --per-category 5 --methods hf-greedy,ar,auto\n"
               "`triedec COMMAND --help` lists a command's flags; docs/cli.md has more.")
    parser.add_argument("--version", action="version", version=f"triedec {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS.items():
        command = sub.add_parser(name, help=text)
        if commands is None or name in commands:
            _COMMAND_FLAGS[name](command)
    return parser


def _generate_flags(gen: argparse.ArgumentParser) -> None:
    from triedec.core.params import DEFAULT_METHOD, MAX_NEW_TOKENS

    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (read from stdin if absent or '-')")
    gen.add_argument("--method", default=DEFAULT_METHOD,
                     help=f"decoding method (default {DEFAULT_METHOD}; see `triedec methods`)")
    gen.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                     help=f"most tokens to generate (default {MAX_NEW_TOKENS})")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    gen.add_argument("--raw", action="store_true",
                     help="tokenize the prompt as plain text instead of applying the chat template")
    gen.add_argument("--json", action="store_true", help="print the result and stats as JSON")
    _add_sampling_args(gen)
    _add_model_args(gen)
    add_method_options(gen)


def _methods_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true",
                        help="print the index docs/methods/README.md holds (a table generated from the registry)")


def _calibrate_flags(cal: argparse.ArgumentParser) -> None:
    from triedec.core.params import CALIBRATION_EFFORT_ENV, CALIBRATION_EFFORTS, DEFAULT_CALIBRATION_EFFORT

    efforts = "; ".join(f"{name}: {e.prompts} prompts x {e.max_new_tokens} tokens, {e.repeats} repeats"
                        for name, e in CALIBRATION_EFFORTS.items())
    cal.add_argument("--effort", choices=tuple(CALIBRATION_EFFORTS), default=None,
                     help=f"how much to measure ({efforts}; default: ${CALIBRATION_EFFORT_ENV} if set, "
                          f"else {DEFAULT_CALIBRATION_EFFORT})")
    full = CALIBRATION_EFFORTS[DEFAULT_CALIBRATION_EFFORT]
    cal.add_argument("--prompts", type=int, default=None,
                     help=f"calibration prompts, the first warms up (default: the effort's, {full.prompts} in full)")
    cal.add_argument("--max-new-tokens", type=int, default=None,
                     help=f"tokens per calibration prompt (default: the effort's, {full.max_new_tokens} in full)")
    cal.add_argument("--repeats", type=int, default=None,
                     help=f"timed repeats per tree size, median kept (default: the effort's, {full.repeats} in full)")
    cal.add_argument("--show", action="store_true",
                     help="print the cached calibration and measure nothing (exit status 1 if none is cached)")
    cal.add_argument("--json", action="store_true",
                     help="print the cost curve as JSON: forward_ms per tree size, hf_forward_ms (stock transformers' "
                          "own forward of 1 and 16 tokens on the same cache), and what was chosen")
    _add_model_args(cal)


def _bench_flags(bench: argparse.ArgumentParser) -> None:
    from triedec.core.params import MAX_NEW_TOKENS

    bench.add_argument("--methods", default=None,
                       help="comma-separated: hf-greedy (hf-sample with --temperature > 0), hf-pld, or triedec "
                            "methods, each optionally with inline options as name:key=value:key=value "
                            "(default hf-greedy,hf-pld,ar,pld; sampling: hf-sample,hf-pld,ar,pld); "
                            "llamacpp[:gguf=PATH] adds llama.cpp on the model's GGUF (extra triedec[llamacpp]; "
                            "quantized, tokens not compared)")
    bench.add_argument("--dataset", default="spec-bench",
                       help="spec-bench (default), humaneval, mbpp or a path to a .jsonl file (fields prompt or "
                            "turns)")
    bench.add_argument("--per-category", type=int, default=None,
                       help="questions per category: a fixed, evenly spaced sample (default: all)")
    bench.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    bench.add_argument("--split", choices=("evaluation", "tuning", "all"), default=None,
                       help="which part of a shipped dataset to sample: evaluation (default; never tuned on), "
                            "tuning (for tuning runs), all; a .jsonl file is sampled whole")
    bench.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                       help="tokens per prompt (default %(default)s); serving mode: each request's max_tokens")
    bench.add_argument("--state", choices=("cold", "warm"), default="cold",
                       help="cold (default): every method starts each prompt from no learned state (one "
                            "request); warm: learned state carries across the sample in file order, as in a "
                            "server, reset between repeats")
    bench.add_argument("--repeats", type=int, default=1,
                       help="timed runs per prompt and method, each in a fresh random order; the median is "
                            "reported (default 1; 3 for published runs); serving mode: runs of every phase, each "
                            "on a fresh server, with paired intervals over them")
    bench.add_argument("--order-seed", type=int, default=0,
                       help="seed of the per-prompt method orders; serving mode: of the phases' order (default 0)")
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
    bench.add_argument("--server-setup", action="append", default=None, metavar="NAME=FLAGS",
                       help="serving mode: a server setup to load, named, with its extra `triedec serve` flags "
                            "(repeatable; e.g. 'ray-2=--ray --replicas 2 --threads 1'; default: one plain process)")
    bench.add_argument("--batch-sizes", default="1,4,8,16",
                       help="serving mode: request counts for lm.generate_batch vs transformers' generate_batch "
                            "(default %(default)s; 'none' skips)")
    _add_sampling_args(bench)
    _add_model_args(bench)
    add_method_options(bench)


def _compare_flags(cmp: argparse.ArgumentParser) -> None:
    cmp.add_argument("a", help="results.json (or its directory): the base")
    cmp.add_argument("b", help="results.json (or its directory): compared with the base")
    cmp.add_argument("--methods", default=None, help="comma-separated methods to compare (default: every shared one)")
    cmp.add_argument("--cross-machine", action="store_true",
                     help="compare files from different machines anyway (the report says so)")
    cmp.add_argument("--json", action="store_true", help="print the comparison as JSON")


def _report_flags(rep: argparse.ArgumentParser) -> None:
    rep.add_argument("out", help="the run's output directory (holding results.json)")


def _serve_flags(srv: argparse.ArgumentParser) -> None:
    from triedec.core.errors import require_extra

    require_extra("server", "triedec serve")
    from triedec.api.decoders import DecoderLimits
    from triedec.core.limits import BatchLimits
    from triedec.core.params import DEFAULT_METHOD
    from triedec.core.settings import add_flags
    from triedec.server.config import DEFAULT_HOST, DEFAULT_PORT, SERVER_LIMITS, ServerConfig

    srv.add_argument("--method", default=DEFAULT_METHOD, help="default decoding method (a request may name another in "
                                                             f"its extra body; default {DEFAULT_METHOD})")
    srv.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default %(default)s)")
    srv.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s)")
    srv.add_argument("--model-name", "--served-model-name", dest="model_name", default=None,
                     help="the model id clients send and /v1/models lists (--served-model-name as vLLM spells it; "
                          "default: the model's directory name, or SmolLM2-135M-Instruct for the embedded default)")
    sec = srv.add_argument_group("security and limits (docs/serving.md: Security)")
    sec.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; each its own tenant); "
                          "without --api-key or --api-keys-file, TRIEDEC_API_KEY is used if set (default: "
                          "none: the server is open)")
    sec.add_argument("--api-keys-file", metavar="FILE",
                     help="keys, one per line, each optionally followed by a space and its tenant's name "
                          "(default: none)")
    sec.add_argument("--public-metrics", action="store_true", help="serve /metrics without a key")
    sec.add_argument("--metrics-key", metavar="KEY", default=None,
                     help="the operator's key for /metrics (server-wide counters): with it, tenants' keys cannot read "
                          "them; TRIEDEC_METRICS_KEY is used if this is not given (default: none: any API key reads "
                          "/metrics)")
    out = srv.add_argument_group("scaling out (docs/scaling-out.md)")
    # every plain setting's flag, generated from its field (triedec.core.settings)
    add_flags(srv, BatchLimits, SERVER_LIMITS)
    add_flags(srv, ServerConfig, groups={"security": sec, "scaling": out})
    add_flags(sec, DecoderLimits)
    out.add_argument("--redis-url", default=None, metavar="URL",
                     help="share learned state with every replica naming the same Redis, redis://HOST:PORT/DB "
                          "(extra triedec[redis]); TRIEDEC_REDIS_URL is used if this is not given (a URL with a "
                          "password stays out of the process list; default: none, learned state stays in this "
                          "process)")
    ray = srv.add_argument_group("replicas on Ray Serve (extra triedec[ray]; docs/scaling-out.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: engine replicas behind one HTTP endpoint, routed with affinity "
                          "(joins the Ray cluster at RAY_ADDRESS, else starts one on this machine)")
    ray.add_argument("--replicas", type=int, default=1, help="engine replicas to start with (default %(default)s)")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="autoscale up to this many replicas on queue length (default: --replicas, fixed)")
    ray.add_argument("--gateways", type=int, default=1,
                     help="gateway replicas (the HTTP ingress that routes and relays; each takes about a core under "
                          "load, docs/scaling-out.md; default %(default)s)")
    ray.add_argument("--affinity-slack", type=int, default=None,
                     help="requests by which a conversation's replica may lead the least loaded one before "
                          "power-of-two choices takes over (default: --max-running)")
    _add_model_args(srv)
    add_method_options(srv)


_COMMAND_FLAGS = {"generate": _generate_flags, "methods": _methods_flags, "calibrate": _calibrate_flags,
                  "bench": _bench_flags, "compare": _compare_flags, "report": _report_flags, "serve": _serve_flags}
"""Each command's flags (a command's parser is filled only when that command runs or all are built)."""
