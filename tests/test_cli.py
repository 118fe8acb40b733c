"""The triedec command, end to end on a saved tiny model."""

from __future__ import annotations

import io
import json
import sys

import pytest

from triedec.cli import main


def run_cli(capsys, *argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(capsys, tiny_model_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "pld",
                           "--max-new-tokens", "12", "--pld-num-tokens", "5", "--json", "Hello")
    assert code == 0
    data = json.loads(out)
    assert data["method"] == "pld"
    assert len(data["token_ids"]) == data["stats"]["new_tokens"] <= 12
    for key in ("new_tokens", "steps", "mean_accepted", "computed_tokens", "seconds", "tokens_per_s"):
        assert key in data["stats"]


def test_generate_streams_text_and_stats_from_stdin(capsys, monkeypatch, tiny_model_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "ar",
                           "--max-new-tokens", "8", stdin="Tell me a story", monkeypatch=monkeypatch)
    assert code == 0
    assert "[ar] " in out and "tok/s" in out and "tokens/step" in out


def test_methods_lists_options_with_defaults(capsys):
    code, out, _ = run_cli(capsys, "methods")
    assert code == 0
    assert "ar:" in out and "pld:" in out and "--pld-num-tokens  (default 10)" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--method", "nope", "hi"], "unknown method"),
        (["generate", "--pld-max-ngram", "0", "hi"], "max_ngram must be a positive integer"),
        (["generate", "--method", "ar", "--pld-num-tokens", "3", "hi"], "option of method 'pld'"),
        (["generate", "--max-new-tokens", "0", "hi"], "max_new_tokens"),
        (["generate", "--attn", "flash_attention_2", "hi"], "flash-attention"),
        (["generate", "--threads", "0", "hi"], "threads"),
        (["generate", "   "], "empty"),
    ],
)
def test_cli_errors_are_clear(capsys, tiny_model_dir, argv, message):
    code, out, err = run_cli(capsys, *argv[:1], "--model", str(tiny_model_dir), *argv[1:])
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


def test_calibrate_then_recycling_with_a_state_file(capsys, monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setenv("TRIEDEC_CACHE", str(tmp_path / "cache"))
    code, out, _ = run_cli(capsys, "calibrate", "--model", str(tiny_model_dir), "--prompts", "2",
                           "--max-new-tokens", "8", "--repeats", "1")
    assert code == 0 and "chosen**" in out and "draft nodes per step" in out
    assert len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == 1
    code, out, _ = run_cli(capsys, "calibrate", "--model", str(tiny_model_dir), "--show")
    assert code == 0 and "chosen**" in out

    state = tmp_path / "warm.safetensors"
    argv = ["generate", "--model", str(tiny_model_dir), "--method", "recycling", "--max-new-tokens", "10",
            "--recycling-state", str(state), "--json", "Hello there"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and state.is_file()
    first = json.loads(out)
    assert 0 < first["stats"]["drafter"]["matrix_rows_filled"] < 1
    code, out, _ = run_cli(capsys, *argv)  # starts from the saved matrix
    assert code == 0 and json.loads(out)["token_ids"] == first["token_ids"]

    state.write_bytes(b"not a state file")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "not a readable state file" in err
