"""Each server setting declared once: its field carries the flag, `triedec serve` and the Ray app's
key=value pairs both read into the same fields, and the defaults agree everywhere."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from triedec.api.decoders import DecoderLimits
from triedec.cli.flags import build_parser
from triedec.cli.serve_config import serve_values, server_config
from triedec.core.errors import TriedecError
from triedec.core.settings import MIB, add_flags, flagged, setting, values_of
from triedec.engine.batch import BatchLimits
from triedec.server.config import SERVER_LIMITS, ServerConfig


@dataclasses.dataclass(frozen=True)
class Knobs:
    count: int = setting(3, help="how many")
    cap_bytes: int | None = setting(2 * MIB, flag="--cap-mib", scale=MIB, unit="MiB", none="no cap", help="a cap")
    wait: float | None = setting(None, kind=float, none="forever", help="a wait")
    mode: str = setting("a", choices=("a", "b"), help="a mode")
    plain: int = 7  # not a setting: no flag


def parse(argv, cls=Knobs, defaults=None):
    parser = argparse.ArgumentParser()
    add_flags(parser, cls, defaults)
    return parser, vars(parser.parse_args(argv))


def test_flags_are_generated_from_the_fields_with_their_defaults_and_units():
    parser, values = parse([])
    assert values_of(Knobs, values) == {"count": 3, "cap_bytes": 2 * MIB, "wait": None, "mode": "a"}
    text = parser.format_help()
    assert "--cap-mib CAP_MIB" in text and "(default 2; 0 = no cap)" in text and "(default forever)" in text
    assert "--plain" not in text
    _, values = parse(["--count", "5", "--cap-mib", "0", "--wait", "1.5", "--mode", "b"])
    assert Knobs(**values_of(Knobs, values)) == Knobs(count=5, cap_bytes=None, wait=1.5, mode="b")
    _, values = parse([], defaults=Knobs(count=9, cap_bytes=None))
    assert values_of(Knobs, values)["count"] == 9 and values_of(Knobs, values)["cap_bytes"] is None
    with pytest.raises(TriedecError, match="--cap-mib must be >= 0"):
        values_of(Knobs, parse(["--cap-mib", "-1"])[1])


def test_every_server_setting_has_one_flag_in_triedec_serve():
    (commands,) = [a for a in build_parser(("serve",))._actions if isinstance(a, argparse._SubParsersAction)]
    dests = [a.dest for a in commands.choices["serve"]._actions]
    settings = [f.name for cls in (ServerConfig, BatchLimits, DecoderLimits) for f, _ in flagged(cls)]
    assert len(settings) == len(set(settings)) and set(settings) <= set(dests)
    assert len(settings) >= 20  # the limits, the queue, times, tenancy, sharing, built methods


def test_the_defaults_agree_between_the_fields_the_flags_and_the_ray_pairs():
    args = build_parser(("serve",)).parse_args(["serve"])
    config = server_config(args, {})
    assert config == ServerConfig(model_name="SmolLM2-135M-Instruct")
    assert config.limits == SERVER_LIMITS and config.decoders == DecoderLimits()
    assert server_config(serve_values({}), {}) == config


def test_the_flags_and_the_ray_pairs_build_the_same_config():
    given = {"max_running": "3", "max_kv_mib": "0", "max_learned_mib": "10", "learning": "off",
             "share_interval": "2", "max_request_seconds": "9.5", "max_tokens": "100", "max_methods": "5",
             "tenant_max_queued": "1", "public_metrics": "true", "api_key": "sk-a-long-enough-key-0"}
    argv = ["serve"]
    for key, value in given.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value == "true" else [flag, value]
    from_flags = server_config(build_parser(("serve",)).parse_args(argv), {})
    from_pairs = server_config(serve_values(given), {})
    assert from_flags == from_pairs
    assert from_flags.limits == dataclasses.replace(SERVER_LIMITS, max_running=3, max_kv_bytes=None)
    assert from_flags.decoders == DecoderLimits(total=5, total_bytes=10 * MIB)
    assert (from_flags.learning, from_flags.share_interval, from_flags.max_request_seconds) == ("off", 2.0, 9.5)
    assert (from_flags.default_max_tokens, from_flags.tenant_max_queued) == (100, 1)
    assert from_flags.api_keys is not None and from_flags.api_keys.public_metrics
