"""What ``triedec serve``'s flags build: the :class:`~triedec.server.ServerConfig` (and the API
keys), from a parsed command line or from Ray Serve's ``key=value`` application arguments, read
by the same flag declarations (:func:`triedec.cli.flags.build_parser`). Used by :mod:`triedec.cli.main`
and :mod:`triedec.ray.app`."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from triedec.cli.flags import build_parser, command_parser
from triedec.cli.method_flags import method_options, option_table
from triedec.core.errors import TriedecError


def api_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """The server's API keys: --api-key and --api-keys-file, else ``TRIEDEC_API_KEY`` (as vLLM
    reads ``VLLM_API_KEY``); None when there are none."""
    from triedec.server.auth import ApiKeys

    given = list(args.api_key)
    if not given and not args.api_keys_file and environ.get("TRIEDEC_API_KEY"):
        given = [environ["TRIEDEC_API_KEY"]]
    metrics_key = getattr(args, "metrics_key", None) or environ.get("TRIEDEC_METRICS_KEY") or None
    return ApiKeys.load(given, args.api_keys_file, public_metrics=args.public_metrics, metrics_key=metrics_key)


def serve_values(pairs: Mapping[str, object]) -> argparse.Namespace:
    """``triedec serve``'s flags given as ``key=value`` pairs (Ray Serve's application arguments):
    each key is a flag's name with underscores (``max_running=8`` is ``--max-running``;
    ``public_metrics=true`` a switch), each value read and checked by that flag's own declaration,
    the others at their defaults. No command line is built; errors name the key, never the value
    (it may be a secret)."""
    srv = command_parser(build_parser(("serve",)), "serve")
    values = {a.dest: a.default for a in srv._actions if a.dest != "help"}
    method_flags: list[tuple[str, str]] = []
    options: dict[str, tuple[str, str]] | None = None  # the method options' flags, read once if needed
    for key, given in pairs.items():
        flag = "--" + str(key).replace("_", "-")
        action = srv._option_string_actions.get(flag)
        if action is not None:
            values[action.dest] = _read_flag(action, str(key), str(given))
            continue
        options = option_table() if options is None else options
        if flag in options:
            method_flags.append((flag, str(given)))
        else:
            raise TriedecError(f"unknown application argument {key}= (neither a `triedec serve` flag nor a method "
                               "option)")
    return argparse.Namespace(command="serve", **{**values, "method_flags": method_flags})


def _read_flag(action: argparse.Action, key: str, text: str) -> object:
    """``text`` as the flag ``action`` would read it (a switch takes true or false)."""
    if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
        if text.lower() not in ("true", "false"):
            raise TriedecError(f"{key}= must be true or false")
        return text.lower() == "true"
    if isinstance(action, argparse._AppendAction):
        return [text]
    try:
        value = action.type(text) if callable(action.type) else text
    except ValueError:
        kind = getattr(action.type, "__name__", "a value")
        raise TriedecError(f"{key}= must be {'an' if kind == 'int' else 'a'} {kind}") from None
    if action.choices is not None and value not in action.choices:
        raise TriedecError(f"{key}= must be one of {', '.join(map(str, action.choices))}")
    return value


def server_config(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """The :class:`~triedec.server.ServerConfig` the ``serve`` flags describe: its plain settings
    (and the engine's and built methods' limits) read from their generated flags, the method and
    its options, the model's name, the API keys (the flags or ``TRIEDEC_API_KEY``) and the Redis
    URL (the flag or ``TRIEDEC_REDIS_URL``); validated."""
    from triedec.api.decoders import DecoderLimits
    from triedec.core.limits import BatchLimits
    from triedec.core.settings import values_of
    from triedec.server.config import ServerConfig

    if not 0 < args.port < 65536:
        raise TriedecError(f"--port must lie in 1..65535, got {args.port}")
    values = vars(args)
    name = args.model_name or (Path(args.model).name if args.model else "SmolLM2-135M-Instruct")
    return ServerConfig(method=args.method, method_options=method_options(args, args.method), model_name=name,
                        limits=BatchLimits(**values_of(BatchLimits, values)),
                        decoders=DecoderLimits(**values_of(DecoderLimits, values)),
                        api_keys=api_keys(args, environ),
                        redis_url=args.redis_url or environ.get("TRIEDEC_REDIS_URL") or None,
                        **values_of(ServerConfig, values))
