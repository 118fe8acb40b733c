"""Differential exactness on the embedded default model (SmolLM2-135M-Instruct): in float32,
``pld`` == ``ar`` == transformers ``generate(do_sample=False)``, token for token; in the default
mode (``triedec.load()``: int4-a8 on a CPU with the vector kernels), ``ngram-trie``, ``auto``,
``lookahead`` and ``recycling`` == that mode's ``ar`` on the same prompts (a method's tokens are
``ar``'s in any mode, by construction, and the default mode runs a step ~4x faster than float32:
the suite's time)."""

from __future__ import annotations

import pytest
import torch
from helpers import ARTICLE, PROMPTS, hf_generate

import triedec


@pytest.fixture(scope="module")
def hf_truth(default_lm):
    """``hf_truth(index)``: transformers' greedy 40 new tokens for ``PROMPTS[index]``, computed once
    per module (greedy decoding's first k tokens do not depend on the length limit)."""
    cache: dict[int, list[int]] = {}

    def truth(index: int) -> list[int]:
        if index not in cache:
            cache[index] = hf_generate(default_lm, default_lm.encode(PROMPTS[index]), 40)
        return cache[index]

    return truth


@pytest.fixture(scope="module")
def mode_truth(default_mode_lm):
    """``mode_truth(index)``: the default mode's greedy ``ar`` 40 new tokens for ``PROMPTS[index]``,
    computed once per module."""
    cache: dict[int, list[int]] = {}

    def truth(index: int) -> list[int]:
        if index not in cache:
            cache[index] = default_mode_lm.generate(PROMPTS[index], "ar", max_new_tokens=40).token_ids
        return cache[index]

    return truth


EXACT = (0, 4, 5, 6, 8, 10, 12, 14, 16, 17, 18, 20, 21)
"""The prompts compared with transformers here (13 of the 22: each kind once or more -- short
chat, system prompt, several turns, the article, translation, code, arithmetic, the long context,
plain text, raw token ids -- to keep the suite inside its time; the tiny models' property tests
cover the rest of the space)."""


@pytest.mark.default_model
@pytest.mark.parametrize("k", range(len(EXACT)))
def test_pld_equals_ar_equals_transformers(default_lm, default_mode_lm, hf_truth, mode_truth, k):
    index = EXACT[k]
    prompt = PROMPTS[index]
    truth = hf_truth(index)
    ar = default_lm.generate(prompt, "ar", max_new_tokens=40)
    pld = default_lm.generate(prompt, "pld", max_new_tokens=40)
    assert ar.token_ids == truth
    assert pld.token_ids == truth
    assert pld.stats.new_tokens == len(truth)
    assert pld.text == default_lm.tokenizer.decode(truth, skip_special_tokens=True)
    in_mode = mode_truth(index)
    trie_options = ({"sized": False}, {"sized": False, "update": True}, {"sized": False, "n": 6, "prefix": 2})
    assert default_mode_lm.generate(prompt, "ngram-trie", max_new_tokens=40, **trie_options[k % 3]).token_ids == in_mode
    if k % 2 == 0:  # auto, its store filling up across the prompts
        assert default_mode_lm.generate(prompt, "auto", max_new_tokens=40).token_ids == in_mode


@pytest.mark.default_model
def test_pld_variants_and_eager_attention(default_lm):
    prompt = PROMPTS[6]
    truth = hf_generate(default_lm, default_lm.encode(prompt), 48)
    for opts in ({"max_ngram": 1, "min_ngram": 1, "num_tokens": 4, "num_matches": 6, "min_expected": 0.0},
                 {"min_ngram": 1, "num_tokens": 30, "num_matches": 1, "min_expected": 0.0}):
        assert default_lm.generate(prompt, "pld", max_new_tokens=48, **opts).token_ids == truth
    eager = triedec.load(weights="float", attn_implementation="eager")
    assert eager.generate(prompt, "pld", max_new_tokens=48).token_ids == truth


@pytest.mark.default_model
def test_stop_string_inside_an_accepted_draft(default_lm):
    prompt = PROMPTS[6]
    full = default_lm.generate(prompt, "ar", max_new_tokens=40)
    words = full.text.split()
    stop = " ".join(words[3:5])  # a stop string well inside the answer
    ids = default_lm.encode(prompt)
    with torch.inference_mode():
        ref = default_lm.reference_model().generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=40, stop_strings=[stop],
            tokenizer=default_lm.tokenizer, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )[0, len(ids):].tolist()
    for method in ("ar", "pld", "auto"):
        out = default_lm.generate(prompt, method, max_new_tokens=40, stop=stop)
        assert out.token_ids == ref
        assert out.stats.stop_reason == "stop_string"
        assert out.text.endswith(stop) and stop not in out.text[: -len(stop)]


@pytest.mark.default_model
def test_stop_token_ids_and_streaming(default_lm):
    prompt = PROMPTS[7]
    full = default_lm.generate(prompt, "pld", max_new_tokens=30)
    stop_tok = full.token_ids[10]
    cut = full.token_ids[: full.token_ids.index(stop_tok) + 1]
    chunks = []
    out = default_lm.generate(prompt, "pld", max_new_tokens=30, stop_token_ids=[stop_tok], on_tokens=chunks.append)
    assert out.token_ids == cut
    assert [t for c in chunks for t in c] == cut
    steps = default_lm.stream(prompt, "pld", max_new_tokens=30)
    streamed = [t for chunk in steps for t in chunk]
    assert streamed == full.token_ids


@pytest.mark.default_model
def test_stats_are_consistent(default_lm):
    out = default_lm.generate(PROMPTS[6], "pld", max_new_tokens=48)
    s = out.stats
    assert s.new_tokens == len(out.token_ids) == 1 + sum(s.accepted_per_step)
    assert s.steps == len(s.accepted_per_step)
    assert s.mean_accepted == pytest.approx((s.new_tokens - 1) / s.steps)
    assert s.computed_tokens >= s.steps
    assert s.tokens_per_s == pytest.approx(s.new_tokens / s.seconds)
    assert s.prompt_tokens == len(default_lm.encode(PROMPTS[6]))


@pytest.fixture(scope="module")
def calibrated_lm(default_mode_lm, tmp_path_factory):
    """The default model in the default mode with a quick calibration of its own (in a temporary
    cache directory): a second ``triedec.LM`` over ``default_mode_lm``'s prepared model, with
    ``kernels="auto"`` (without it an LM keeps the model's own attention, exact "up to rounding"),
    so it runs the same kernels and native forward, bit-exact."""
    lm = triedec.LM(default_mode_lm.model, default_mode_lm.tokenizer, kernels="auto",
                    cache_dir=tmp_path_factory.mktemp("cache"), reference=default_mode_lm.reference_model)
    assert lm.adapter.kernels == default_mode_lm.adapter.kernels and lm.adapter.exactness == "bit-exact"
    cal = lm.recalibrate(prompts=2, max_new_tokens=16, repeats=1)
    profile = cal.profiles["recycling"]
    assert 0 <= profile.nodes <= 80 and sum(profile.rates) > 0
    return lm


RECYCLING_SIZES = (80, 8, 24, 0, 3, 48)  # 0 = the calibrated size


@pytest.mark.default_model
@pytest.mark.parametrize("k", range(len(EXACT)))
def test_recycling_equals_ar(calibrated_lm, mode_truth, k):
    """Several tree sizes (the paper's 80 nodes among them), one hot drafter per size across prompts."""
    index = EXACT[k]
    prompt = PROMPTS[index]
    truth = mode_truth(index)  # the same model object as calibrated_lm's
    nodes = RECYCLING_SIZES[k % len(RECYCLING_SIZES)]
    out = calibrated_lm.generate(prompt, "recycling", max_new_tokens=40, nodes=nodes)
    assert out.token_ids == truth
    assert calibrated_lm.generate(prompt, "ngram-trie", max_new_tokens=40).token_ids == truth  # device-sized
    s = out.stats
    assert s.new_tokens == 1 + sum(s.accepted_per_step)
    assert 0 < s.drafter["matrix_rows_filled"] < 1
    assert all(0 <= r <= 1 for r in s.acceptance_by_depth)


@pytest.mark.default_model
def test_recycling_is_hot_across_requests(calibrated_lm):
    """The same drafter serves later requests: its matrix only grows, and a repeated request
    drafts from the start (paper's hot start)."""
    prompt = PROMPTS[14]
    first = calibrated_lm.generate(prompt, "recycling", max_new_tokens=32, nodes=80, seed_prefill=0)
    filled = first.stats.drafter["matrix_rows_filled"]
    again = calibrated_lm.generate(prompt, "recycling", max_new_tokens=32, nodes=80, seed_prefill=0)
    assert again.token_ids == first.token_ids
    assert again.stats.drafter["matrix_rows_filled"] >= filled
    assert again.stats.mean_accepted > first.stats.mean_accepted


@pytest.mark.default_model
def test_ngram_trie_drafts_from_context_documents(default_lm):
    """Documents passed as ``context`` feed the trie but never change the output."""
    prompt = [{"role": "user", "content": "Copy the first two sentences of the article you were given, word for word."}]
    truth = hf_generate(default_lm, default_lm.encode(prompt), 48)
    plain = default_lm.generate(prompt, "ngram-trie", max_new_tokens=48, sized=False)
    with_doc = default_lm.generate(prompt, "ngram-trie", max_new_tokens=48, sized=False, context=[ARTICLE])
    assert plain.token_ids == with_doc.token_ids == truth
    assert with_doc.stats.drafter["trie_nodes"] > plain.stats.drafter["trie_nodes"]


@pytest.mark.default_model
@pytest.mark.parametrize("index", [0, 6, 12, 14, 18, 20])
def test_lookahead_equals_ar(default_mode_lm, mode_truth, index):
    prompt = PROMPTS[index]
    truth = mode_truth(index)[:32]
    for verify in ("independent", "trie"):
        out = default_mode_lm.generate(prompt, "lookahead", max_new_tokens=32, verify=verify)
        assert out.token_ids == truth, verify
