"""Sampling on the embedded default model (SmolLM2-135M-Instruct): every method returns ``ar``'s
sampled tokens for the same seed, stops included, in the mode a plain load gives it (int4-a8 on a
CPU with the vector kernels); and in float32 ``ar`` follows transformers' sampling distribution for
the first token."""

from __future__ import annotations

import pytest
import torch
from helpers import ARTICLE, PROMPTS

from triedec.core.sampling import Sampling, draw, process, seen_tokens, uniform

SETTINGS = [
    {"temperature": 0.7},
    {"temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.2},
    {"temperature": 0.3, "top_k": 20},
    {"temperature": 0.7, "min_p": 0.05, "top_p": 0.95},
]
METHODS = [("pld", {}), ("pld", {"min_expected": 0.0}), ("ngram-trie", {}), ("recycling", {}),
           ("recycling", {"nodes": 24}), ("lookahead", {}), ("lookahead", {"verify": "independent"}), ("auto", {})]
PROMPT_INDEXES = [2, 6, 12, 17, 19, 20]


@pytest.mark.default_model
@pytest.mark.parametrize("index", PROMPT_INDEXES)
def test_every_method_returns_ar_sampled_tokens(default_mode_lm, index):
    prompt = PROMPTS[index]
    setting = {**SETTINGS[index % len(SETTINGS)], "seed": 100 + index}
    truth = default_mode_lm.generate(prompt, "ar", max_new_tokens=40, **setting)
    assert truth.stats.seed == 100 + index
    for name, options in METHODS:
        got = default_mode_lm.generate(prompt, name, max_new_tokens=40, **setting, **options)
        assert got.token_ids == truth.token_ids, f"{name} {options} differs with {setting}"


@pytest.mark.default_model
def test_sampled_stop_string_and_stop_token_inside_accepted_drafts(default_mode_lm):
    """A summary that repeats the article: pld accepts long drafts, and a stop string or stop token
    taken from well inside the answer ends every method at the same token."""
    prompt = [{"role": "user", "content": f"Repeat this article word for word.\n\n{ARTICLE}"}]
    setting = {"temperature": 0.5, "seed": 7}
    full = default_mode_lm.generate(prompt, "ar", max_new_tokens=60, **setting)
    words = full.text.split()
    stop = " ".join(words[8:10])
    stop_tok = full.token_ids[20]
    cut = full.token_ids[: full.token_ids.index(stop_tok) + 1]
    long_accept = False
    # drafts not sized by the measured cost model, so that long drafts go whatever the host's load
    for name, options in (("ar", {}), ("pld", {"min_expected": 0.0}), ("ngram-trie", {"sized": False})):
        by_string = default_mode_lm.generate(prompt, name, max_new_tokens=60, stop=stop, **setting, **options)
        assert by_string.stats.stop_reason == "stop_string"
        assert by_string.text.endswith(stop) and stop not in by_string.text[: -len(stop)]
        assert by_string.token_ids == default_mode_lm.generate(prompt, "ar", max_new_tokens=60, stop=stop,
                                                          **setting).token_ids
        by_token = default_mode_lm.generate(prompt, name, max_new_tokens=60, stop_token_ids=[stop_tok], **setting,
                                            **options)
        assert by_token.token_ids == cut and by_token.stats.stop_reason == "eos"
        long_accept |= max(by_token.stats.accepted_per_step) > 3
    assert long_accept  # the stop fell inside an accepted draft at least once


@pytest.mark.default_model
def test_first_token_follows_transformers_processed_distribution(default_lm):
    """triedec's processed distribution of the first token equals transformers' own processed
    scores (``generate(output_scores=True)``) on the default model; 250 seeds of the sampler's
    first token land where those probabilities say, and ``ar`` draws exactly those tokens
    (checked end to end for the first 12 seeds)."""
    prompt = PROMPTS[1]
    ids = default_lm.encode(prompt)
    s = Sampling(temperature=0.8, top_p=0.9, top_k=30, repetition_penalty=1.1)
    with torch.inference_mode():
        out = default_lm.reference_model().generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=True,
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, repetition_penalty=s.repetition_penalty,
            max_new_tokens=1, output_scores=True, return_dict_in_generate=True)
        logits = default_lm.reference_model()(torch.tensor([ids])).logits[0, -1]
    theirs = out.scores[0][0].softmax(-1)
    ours = process(logits, seen_tokens(ids), s).softmax(-1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    processed = process(logits, seen_tokens(ids), s)
    firsts = [draw(processed, uniform(seed, 0)) for seed in range(250)]
    for seed in range(12):
        out = default_lm.generate(ids, "ar", max_new_tokens=1, seed=seed,
                                  **{k: v for k, v in s.as_dict().items() if k != "seed"})
        assert out.token_ids == [firsts[seed]], seed
    for token in set(firsts) | set(torch.topk(ours, 3).indices.tolist()):
        share = firsts.count(token) / len(firsts)
        p = float(ours[token])
        assert abs(share - p) < 4 * (p * (1 - p) / len(firsts)) ** 0.5 + 1e-3, (token, share, p)
