"""The triedec command, end to end on a saved tiny model."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

from triedec.cli.flags import build_parser
from triedec.cli.main import main


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


def test_generate_and_serve_default_to_auto(capsys, tiny_model_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--max-new-tokens", "12", "--json", "Hi")
    assert code == 0
    default = json.loads(out)
    assert default["method"] == "auto"
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "ar",
                           "--max-new-tokens", "12", "--json", "Hi")
    assert json.loads(out)["token_ids"] == default["token_ids"]
    assert build_parser().parse_args(["serve"]).method == "auto"


def test_generate_streams_text_and_stats_from_stdin(capsys, monkeypatch, tiny_model_dir):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "ar",
                             "--max-new-tokens", "8", stdin="Tell me a story", monkeypatch=monkeypatch)
    assert code == 0
    assert "[ar] " in out and "tok/s" in out and "tokens/step" in out and "| triedec runner" in out
    assert "Loading weights" not in err and "it/s]" not in err  # transformers' own progress bars stay quiet
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # and are switched back on for the caller


def test_generate_cuts_the_streamed_text_after_a_stop_string(capsys, tiny_model_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "ar", "--raw",
                           "--max-new-tokens", "30", "--json", "one two three one two")
    full = json.loads(out)["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "ar", "--raw",
                           "--max-new-tokens", "30", "--stop", stop, "one two three one two")
    assert code == 0
    streamed = out.split("\n[ar] ")[0]
    assert streamed == full[: full.index(stop) + len(stop)]  # the library's semantics: the stop string kept


def test_methods_lists_options_with_defaults(capsys):
    code, out, _ = run_cli(capsys, "methods")
    assert code == 0
    assert "ar:" in out and "pld:" in out and "--pld-num-tokens  (default 10, at most 256)" in out
    assert "beam:" in out and "--num-beams  (default 4, at most 64)" in out


def test_generate_beam(capsys, tiny_model_dir):
    argv = ["generate", "--model", str(tiny_model_dir), "--method", "beam", "--num-beams", "3",
            "--num-return-sequences", "2", "--early-stopping", "never", "--max-new-tokens", "8", "Hello"]
    code, out, _ = run_cli(capsys, *argv, "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["sequences"]) == 2 and data["token_ids"] == data["sequences"][0]["token_ids"]
    assert data["sequences"][0]["score"] >= data["sequences"][1]["score"]
    assert data["stats"]["num_beams"] == 3 and data["stats"]["peak_kv_tokens"] < data["stats"]["hf_peak_kv_tokens"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and "[beam] " in out and "3 beams" in out and "hypothesis 2" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "pld", "--num-beams", "2"], "option of method 'beam'"),
        (["--method", "beam", "--num-beams", "0"], "num_beams"),
        (["--method", "beam", "--num-beams", "2", "--num-return-sequences", "3"], "cannot exceed"),
        (["--method", "beam", "--stop", "x"], "stop strings"),
        (["--method", "beam", "--pld-num-tokens", "3"], "option of method 'pld'"),
    ],
)
def test_generate_beam_bad_input(capsys, tiny_model_dir, argv, message):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), *argv, "Hello")
    assert code == 2 and message in err and out == ""


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--method", "nope", "hi"], "unknown method"),
        (["generate", "--method", "pld", "--pld-max-ngram", "0", "hi"], "max_ngram must be a positive integer"),
        (["generate", "--method", "ar", "--pld-num-tokens", "3", "hi"], "option of method 'pld'"),
        (["generate", "--max-new-tokens", "0", "hi"], "max_new_tokens"),
        (["generate", "--attn", "flash_attention_2", "hi"], "flash-attention"),
        (["generate", "--threads", "0", "hi"], "threads"),
        (["generate", "   "], "empty"),
        (["generate", "--temperature", "-1", "hi"], "temperature must be >= 0"),
        (["generate", "--top-p", "0", "hi"], "top_p must lie in (0, 1]"),
        (["generate", "--top-k", "-2", "hi"], "top_k must be an integer >= 0"),
        (["generate", "--min-p", "1.5", "hi"], "min_p"),
        (["generate", "--repetition-penalty", "0", "hi"], "repetition_penalty must lie in [1e-06, 1e+06]"),
        (["generate", "--seed", "-1", "--temperature", "0.5", "hi"], "seed must be an integer"),
        (["generate", "--method", "beam", "--temperature", "0.5", "hi"], "beam search does not sample"),
        (["generate", "--presence-penalty", "3", "hi"], "presence_penalty must lie in [-2, 2]"),
        (["generate", "--logit-bias", "5=200", "hi"], "logit_bias values must lie in [-100, 100]"),
        (["generate", "--min-tokens", "-1", "hi"], "min_tokens must be an integer >= 0"),
        (["bench", "--frequency-penalty", "1"], "which take no frequency_penalty"),
        (["serve", "--port", "0"], "--port"),
        (["serve", "--method", "nope"], "unknown method"),
        (["serve", "--max-running", "0"], "max_running"),
        (["serve", "--max-queue", "-1"], "max_queue"),
        (["serve", "--method", "ar", "--pld-num-tokens", "3"], "option of method 'pld'"),
        (["serve", "--replicas", "2"], "need --ray"),
        (["serve", "--max-replicas", "3"], "need --ray"),
        (["bench", "--serving", "--server-setup", "noequals"], "NAME=FLAGS"),
        (["bench", "--serving", "--server-setup", "x=--port 1"], "may not set --port"),
        (["bench", "--serving", "--server-setup", "x=--no-such-flag"], "bad flags"),
        (["bench", "--serving", "--server-setup", "x=", "--server-setup", "x=--ray"], "distinct names"),
    ],
)
def test_cli_errors_are_clear(capsys, tiny_model_dir, argv, message):
    code, out, err = run_cli(capsys, *argv[:1], "--model", str(tiny_model_dir), *argv[1:])
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


def test_calibrate_show_only_reads(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """With nothing cached, --show says so and measures nothing (no file appears)."""
    monkeypatch.setenv("TRIEDEC_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, "calibrate", "--model", str(tiny_model_dir), "--show")
    assert code == 1 and out == "" and "no calibration cached" in err and "triedec calibrate" in err
    assert not list((tmp_path / "cache").glob("calibration/*.json"))


def test_the_calibration_cache_is_keyed_by_host():
    from triedec.core.machine import host_key

    key = host_key()
    assert f"-{os.cpu_count()}cores-" in key and len(key.rsplit("-", 1)[1]) == 8  # CPU model, cores, flags digest
    assert key == host_key()  # stable


def test_calibrate_then_recycling_with_a_state_file(capsys, monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setenv("TRIEDEC_CACHE", str(tmp_path / "cache"))
    code, out, _ = run_cli(capsys, "calibrate", "--model", str(tiny_model_dir), "--prompts", "2",
                           "--max-new-tokens", "8", "--repeats", "1")
    assert code == 0 and "chosen**" in out and "draft nodes per step" in out
    assert len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == 1
    code, out, _ = run_cli(capsys, "calibrate", "--model", str(tiny_model_dir), "--show")
    assert code == 0 and "chosen**" in out and "custom effort" in out
    code, out, _ = run_cli(capsys, "calibrate", "--model", str(tiny_model_dir), "--show", "--json")
    curve = json.loads(out)
    assert code == 0 and {"1", "2", "4", "8", "16", "32", "64"} <= set(curve["forward_ms"])
    assert set(curve["hf_forward_ms"]) == {"1", "16"} and all(v > 0 for v in curve["hf_forward_ms"].values())
    hf1, ratio = curve["hf_forward_ms"]["1"], curve["forward_ms"]["1"] / curve["hf_forward_ms"]["1"]
    # both printed to 0.01 ms (a tiny model's forward is a fraction of a millisecond), the ratio to 0.001
    assert curve["ratio_to_hf1"]["1"] == pytest.approx(ratio, abs=0.005 * (1 + ratio) / hf1 + 0.0005)
    assert curve["kernels"] and 0 <= curve["profiles"]["recycling"]["nodes"] <= 80
    assert curve["effort"] == "custom"  # prompts, tokens and repeats given by hand
    assert {"2", "16"} <= set(curve["batch_forward_ms"]) and curve["context_ms_per_1k_tokens"] >= 0

    state = tmp_path / "warm.safetensors"
    argv = ["generate", "--model", str(tiny_model_dir), "--method", "recycling", "--max-new-tokens", "10",
            "--recycling-state", str(state), "--json", "Hello there"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and state.is_file()  # written when the request's batch went idle
    first = json.loads(out)
    assert 0 < first["stats"]["drafter"]["matrix_rows_filled"] < 1
    code, out, _ = run_cli(capsys, *argv)  # starts from the saved matrix
    assert code == 0 and json.loads(out)["token_ids"] == first["token_ids"]

    state.write_bytes(b"not a state file")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "not a readable state file" in err


def test_a_malformed_logit_bias_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--logit-bias", "5:2", "hi"])
    assert exited.value.code == 2
    assert "argument --logit-bias: expected ID=BIAS pairs separated by commas, got '5:2'" in capsys.readouterr().err


def test_generate_takes_openais_sampling_fields(capsys, tiny_model_dir):
    import triedec

    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--max-new-tokens", "10", "--json",
                           "--presence-penalty", "1.5", "--logit-bias", "7=4,11=-100", "--min-tokens", "3", "Hello")
    assert code == 0
    want = triedec.load(tiny_model_dir).generate("Hello", max_new_tokens=10, presence_penalty=1.5,
                                                 logit_bias={7: 4.0, 11: -100.0}, min_tokens=3)
    assert json.loads(out)["token_ids"] == want.token_ids


def test_generate_ngram_trie_and_lookahead(capsys, tiny_model_dir):
    for extra in (["--method", "lookahead", "--verify", "independent"], ["--method", "lookahead"],
                  ["--method", "ngram-trie", "--ngram-trie-sized", "false", "--ngram-trie-update", "true"]):
        code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--max-new-tokens", "10",
                               "--json", *extra, "Hello Hello Hello")
        assert code == 0
        assert json.loads(out)["stats"]["computed_tokens"] > 0
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "pld", "--verify", "trie",
                           "Hi")
    assert code == 2 and "option of method 'lookahead'" in err


def test_generate_sampling_is_reproducible_across_methods(capsys, tiny_model_dir):
    """--temperature/--top-p/--seed: the same seed gives the same tokens with every method; the
    seed is reported; without --seed one is drawn and reported."""
    base = ["generate", "--model", str(tiny_model_dir), "--max-new-tokens", "16", "--json", "--temperature", "0.8",
            "--top-p", "0.95", "--top-k", "40", "--min-p", "0.01", "--repetition-penalty", "1.1"]
    outs = {}
    for method in ("ar", "pld", "ngram-trie", "lookahead", "recycling"):
        extra = ["--recycling-nodes", "8"] if method == "recycling" else []
        code, out, _ = run_cli(capsys, *base, "--method", method, "--seed", "5", *extra, "Tell me a story")
        assert code == 0
        data = json.loads(out)
        assert data["stats"]["seed"] == 5
        outs[method] = data["token_ids"]
    assert all(v == outs["ar"] for v in outs.values())
    code, out, _ = run_cli(capsys, *base, "--method", "pld", "Tell me a story")
    drawn = json.loads(out)["stats"]["seed"]
    assert isinstance(drawn, int)
    code, out, _ = run_cli(capsys, *base, "--method", "ar", "--seed", str(drawn), "Tell me a story")
    assert json.loads(out)["token_ids"] == json.loads(run_cli(capsys, *base, "--method", "ar", "--seed", str(drawn),
                                                              "Tell me a story")[1])["token_ids"]
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--max-new-tokens", "8",
                           "--temperature", "0.7", "--seed", "3", "--method", "pld", "Hello")
    assert code == 0 and "seed 3" in out


def test_chat_template_replaces_the_tokenizers(capsys, tmp_path, tiny_model_dir):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>"
                        "{% endif %}")
    from triedec.api.spec import ModelSpec
    from triedec.cli.flags import build_parser

    args = build_parser().parse_args(["generate", "--model", str(tiny_model_dir), "--chat-template", str(template),
                                      "hi"])
    lm = ModelSpec.from_args(args).load()
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                            add_generation_prompt=True)
    assert text == "<<hello>>=>"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--chat-template", str(broken), "hi")
    assert code == 2 and "--chat-template does not render" in err
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--chat-template",
                           str(tmp_path / "missing.jinja"), "hi")
    assert code == 2 and "cannot read it" in err


def test_every_flag_states_its_default():
    """Each command's options say their default in --help (switches default to off)."""
    import argparse

    from triedec.cli.flags import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    silent = [f"{name} {action.option_strings[0]}" for name, parser in commands.choices.items()
              for action in parser._actions
              if action.option_strings and not isinstance(action, argparse._HelpAction | argparse._StoreTrueAction
                                                          | argparse._StoreFalseAction | argparse._VersionAction)
              and "default" not in (action.help or "")]
    assert silent == []


def test_the_top_level_help_imports_no_torch_and_lists_every_command():
    """`triedec --help` and `--version` answer from the top-level parser alone, without torch or
    transformers (a second instead of several), and it lists the same commands as the full one."""
    import argparse
    import subprocess

    code = ("import sys\nfrom triedec.cli.main import main\n"
            "for argv in (['--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit as done:\n        assert done.code == 0\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "triedec 0.1.0" in done.stdout and "{generate,methods,calibrate" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"

    def commands(parser):
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return [(c.dest, c.help) for c in sub._choices_actions]

    assert commands(build_parser(())) == commands(build_parser())


def test_version_answers_from_a_source_tree_without_package_metadata(monkeypatch):
    # `PYTHONPATH=src python -m triedec.cli.main ...` (as on a machine triedec is copied to) has no metadata
    from importlib import metadata

    from triedec.cli.flags import installed_version

    assert installed_version() == metadata.version("triedec")

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert "source tree" in installed_version()
    with pytest.raises(SystemExit) as done:
        build_parser(()).parse_args(["--version"])
    assert done.value.code == 0


def test_every_commands_help_imports_no_torch():
    """`triedec COMMAND --help` is generated from torch-free declarations (method options are read
    generically, the server's settings need neither its app nor the model): well under a second."""
    import subprocess

    from triedec.cli.flags import COMMANDS

    code = ("import sys\nfrom triedec.cli.main import main\n"
            f"for command in {sorted(COMMANDS)!r}:\n"
            "    try:\n        main([command, '--help'])\n"
            "    except SystemExit as done:\n        assert done.code == 0\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'fastapi') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert done.stdout.count("--METHOD-OPTION VALUE") == 3  # generate, bench, serve
    assert "--max-kv-mib" in done.stdout and "--tenant-max-running" in done.stdout  # serve's generated flags


def test_method_options_are_read_from_the_flags_a_command_does_not_declare():
    from triedec.cli.flags import parse_command_line
    from triedec.cli.method_flags import given_options, method_options

    args = parse_command_line(["generate", "--method", "pld", "--pld-max-ngram", "5", "--max-new", "8", "hello"])
    assert args.prompt == "hello" and args.max_new_tokens == 8  # the option's value is not the prompt
    assert args.method_flags == [("--pld-max-ngram", "5")] and method_options(args, "pld") == {"max_ngram": 5}
    args = parse_command_line(["generate", "--pld-max-ngram=4", "--num-beams", "3", "--beam-num-beams", "2",
                               "--num-beams", "5", "--", "--pld-max-ngram"])
    assert args.prompt == "--pld-max-ngram"  # after --, a token is the prompt
    assert given_options(args) == {"pld": {"max_ngram": "4"}, "beam": {"num_beams": "5"}}  # the last one wins
    with pytest.raises(SystemExit) as exited:
        parse_command_line(["generate", "hello", "--pld-max-ngram"])
    assert exited.value.code == 2
    with pytest.raises(SystemExit):  # a command without method options refuses what it does not declare
        parse_command_line(["calibrate", "--pld-max-ngram", "5"])


def test_a_flag_that_is_no_method_option_is_refused_before_the_model_loads(capsys):
    code, _, err = run_cli(capsys, "generate", "--model", "/no/such/model", "--bogus-flag", "1", "hi")
    assert code == 2 and "unrecognized argument --bogus-flag" in err and "triedec methods" in err
    code, _, err = run_cli(capsys, "generate", "--model", "/no/such/model", "--method", "ar", "--pld-max-ngram", "5",
                           "hi")
    assert code == 2 and "--pld-max-ngram is an option of method 'pld', not 'ar'" in err


BLOCK = "import sys\nfor m in {mods!r}:\n    sys.modules[m] = None  # as if not installed\n"


@pytest.mark.parametrize("argv, extra", [(["serve"], "server"), (["bench", "--methods", "ar"], "bench")])
def test_a_command_whose_extra_is_missing_says_which_to_install(argv, extra):
    """The core install has no server or plotting stack; a command that needs one names its extra."""
    import subprocess

    code = BLOCK.format(mods=["fastapi", "matplotlib"]) + (
        f"from triedec.cli.main import main\nsys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert f"pip install 'triedec[{extra}]'" in done.stderr and "Traceback" not in done.stderr


def test_generate_needs_no_extra(tiny_model_dir):
    """The library and `triedec generate` run with no server, plotting or HTTP client installed,
    and import none of them."""
    import subprocess

    heavy = ["fastapi", "uvicorn", "prometheus_client", "starlette", "pydantic", "matplotlib", "httpx", "openai"]
    code = BLOCK.format(mods=heavy) + (
        f"from triedec.cli.main import main\nassert main(['generate', '--model', {str(tiny_model_dir)!r}, "
        "'--method', 'ar', '--max-new-tokens', '4', '--json', 'hello']) == 0\n"
        f"print('loaded:', sorted(m for m in {heavy!r} if sys.modules.get(m) is not None))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "loaded: []"


def test_serve_logs_the_models_precision_runner_and_kernels_at_startup(capsys, caplog, monkeypatch, tiny_model_dir):
    import logging

    import triedec.server

    served = []
    monkeypatch.setattr(triedec.server, "serve", lambda lm, config, host, port: served.append((lm, port)))
    with caplog.at_level(logging.INFO, logger="triedec.server"):
        code, _, _ = run_cli(capsys, "serve", "--model", str(tiny_model_dir), "--port", "8971")
    assert code == 0 and served and served[0][1] == 8971
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model: "))
    # --weights auto (the default) chose float32 for an HF checkpoint, and the line says it chose
    assert "precision float32 (--weights auto); runner: triedec; kernels: " in line
    assert line.endswith("+triedec-runner+native-forward (bit-exact)")


def test_serve_says_in_words_why_a_model_runs_on_transformers_forward(capsys, caplog, monkeypatch, tmp_path):
    """A family triedec's runner does not know (OLMo 1) still serves, on transformers' forward, and
    the startup line says so and why."""
    import logging

    from helpers import tiny_tokenizer
    from transformers import OlmoConfig, OlmoForCausalLM

    import triedec.server

    tokenizer = tiny_tokenizer()
    OlmoForCausalLM(OlmoConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(triedec.server, "serve", lambda lm, config, host, port: None)
    with caplog.at_level(logging.INFO, logger="triedec.server"):
        code, _, _ = run_cli(capsys, "serve", "--model", str(tmp_path), "--port", "8972")
    assert code == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model: "))
    assert "runner: transformers (triedec's runner does not know OlmoForCausalLM (it runs Llama, " in line
    assert "its steps run transformers' forward, ~2,000 small operations a step, slower (docs/models.md))" in line


def test_threads_come_from_the_flag_then_the_environment_then_the_default(monkeypatch):
    """``--threads`` wins; without it ``TRIEDEC_THREADS`` (what the suite's workers set, so the
    processes they start share their calibration); without either, 2. A bad value is named."""
    from triedec.api.spec import DEFAULT_THREADS, THREADS_ENV, ModelSpec
    from triedec.core.errors import TriedecError

    def threads(*flags: str) -> int:
        return ModelSpec.from_args(build_parser().parse_args(["generate", *flags, "hi"])).threads

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert threads() == DEFAULT_THREADS == ModelSpec().threads == 2
    monkeypatch.setenv(THREADS_ENV, "3")
    assert threads() == 3 == ModelSpec().threads
    assert threads("--threads", "1") == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(TriedecError, match=THREADS_ENV):
            threads()
    assert threads("--threads", "4") == 4  # the flag given: the environment is not read
