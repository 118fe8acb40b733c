"""Bad input gets a TriedecError naming the problem, before any output."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

import triedec
from triedec import TriedecError
from triedec.model.adapter import ModelAdapter


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return triedec.load(tiny_model_dir)


@pytest.mark.parametrize(
    "prompt,kwargs,message",
    [
        ("", {}, "empty"),
        ([], {}, "empty"),
        ([{"role": "user", "content": "hi"}, 3], {}, "prompt must be"),
        ([10**9], {}, "token ids"),
        ("hi", {"method": "nope"}, "unknown method"),
        ("hi", {"method": "pld", "bogus": 1}, "unknown option"),
        ("hi", {"method": "ar", "max_ngram": 2}, "unknown option"),
        ("hi", {"max_new_tokens": 0}, "max_new_tokens"),
        ("hi", {"max_new_tokens": -5}, "max_new_tokens"),
        ("hi", {"max_new_tokens": 2.5}, "max_new_tokens"),
        ("hi", {"method": "pld", "num_tokens": 0}, "num_tokens"),
        ("hi", {"method": "pld", "num_matches": -1}, "num_matches"),
        ("hi", {"method": "pld", "min_ngram": 3, "max_ngram": 2}, "min_ngram"),
        ("hi", {"stop": [""]}, "stop strings"),
        ("hi", {"stop_token_ids": [-1]}, "stop token"),
        ("hi", {"max_new_tokens": 600}, "context"),
        ("word " * 600, {"max_new_tokens": 1}, "context"),
        ([{"role": "user"}], {}, "'content' must be a string, got missing"),
        ([{"role": 3, "content": "hi"}], {}, "'role' must be a string, got a int"),
        ([{"role": "user", "content": None}], {}, "'content' must be a string"),
        ("hi", {"context": "some text"}, "context must be a list of documents"),
        ("hi", {"context": [3.5]}, "context document"),
        ("hi", {"context": [[10**9]]}, "context document"),
    ],
)
def test_generate_refuses_bad_input(tiny_lm, prompt, kwargs, message):
    calls = []
    with pytest.raises(TriedecError, match=message):
        tiny_lm.generate(prompt, on_tokens=calls.append, **kwargs)
    assert calls == []  # no partial output


def test_flash_attention_is_refused(tiny_model_dir):
    with pytest.raises(TriedecError, match="flash-attention ignores custom tree masks"):
        triedec.load(tiny_model_dir, attn_implementation="flash_attention_2")
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(TriedecError, match="flash"):
        ModelAdapter(model)


def test_unknown_dtype_and_missing_paths(tmp_path, tiny_model_dir):
    with pytest.raises(TriedecError, match="dtype"):
        triedec.load(tiny_model_dir, dtype="float8")
    with pytest.raises(TriedecError, match="not a model directory"):
        triedec.load(tmp_path / "missing")
    with pytest.raises(TriedecError, match="GGUF file not found"):
        triedec.load(tmp_path / "missing.gguf")
    with pytest.raises(TriedecError, match="cannot read a model config"):
        triedec.load(tmp_path)  # exists, but holds no model


def test_non_causal_models_are_refused(tmp_path):
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(bert)
    with pytest.raises(TriedecError, match="not a causal LM"):
        triedec.load(bert)
    t5 = tmp_path / "t5"
    T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                        d_kv=16)).save_pretrained(t5)
    with pytest.raises(TriedecError, match="encoder-decoder"):
        triedec.load(t5)


def test_default_method_is_auto_and_gives_ar_tokens(tiny_lm):
    out = tiny_lm.generate("one two three one two three", max_new_tokens=20)
    assert "store_outputs" in out.stats.drafter  # auto's counters
    assert out.token_ids == tiny_lm.generate("one two three one two three", "ar", max_new_tokens=20).token_ids


def test_tiny_model_directory_loads_and_matches_transformers(tiny_lm):
    out = tiny_lm.generate("hello there", "pld", max_new_tokens=20)
    ids = tiny_lm.encode("hello there")
    with torch.inference_mode():
        ref = tiny_lm.reference_model().generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert out.token_ids == ref[0, len(ids):].tolist()
