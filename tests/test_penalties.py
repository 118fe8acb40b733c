"""OpenAI's presence and frequency penalties and logit bias, vLLM's min_tokens, ignore_eos and
stop_token_ids: what they mean (against a loop written here from their definitions), exact inside
trees (every method returns ``ar``'s tokens and logprobs, greedy and sampled, alone and batched),
and through the server."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from helpers import together

from triedec.api.generation import GenerationRequest
from triedec.core.errors import TriedecError
from triedec.core.sampling import Sampling
from triedec.engine.batch import BatchLimits
from triedec.engine.methods import methods

MODEL = "tiny"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
SPECULATIVE = [m for m in methods() if m != "beam"]


def reference_greedy(lm, ids: list[int], n: int, presence: float = 0.0, frequency: float = 0.0,
                     bias: dict[int, float] | None = None, min_tokens: int = 0) -> list[int]:
    """Greedy decoding with the fields' definitions written out: bias added, stop ids masked
    before min_tokens, each output token's logit minus frequency x its count + presence; the
    model's own forward over the whole prefix each step (transformers, float32)."""
    model, out = lm.reference_model(), []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([ids + out])).logits[0, -1].float().clone()
        for t, b in (bias or {}).items():
            row[t] += b
        if len(out) < min_tokens:
            row[sorted(lm.eos_token_ids)] = float("-inf")
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        out.append(int(row.argmax()))
        if out[-1] in lm.eos_token_ids and len(out) >= min_tokens:
            break
    return out


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 0.8}, {"presence_penalty": -0.5, "frequency_penalty": 1.2},
    {"logit_bias": {7: 5.0, 11: -100.0}},
])
def test_greedy_with_the_fields_follows_their_definition(lm, fields):
    ids = lm.encode(PROMPT)
    bias = fields.get("logit_bias")
    want = reference_greedy(lm, ids, 24, fields.get("presence_penalty", 0.0), fields.get("frequency_penalty", 0.0),
                            bias)
    got = lm.generate(ids, "ar", max_new_tokens=24, **fields).token_ids
    assert got == want
    assert got != lm.generate(ids, "ar", max_new_tokens=24).token_ids  # the field changed something


def test_logit_bias_forces_and_forbids_tokens(lm):
    ids = lm.encode(PROMPT)
    plain = lm.generate(ids, "auto", max_new_tokens=8).token_ids
    forced = lm.generate(ids, "auto", max_new_tokens=8, logit_bias={plain[3]: 100.0})
    assert forced.token_ids == [plain[3]] * 8
    banned = lm.generate(ids, "auto", max_new_tokens=8, logit_bias={t: -100.0 for t in set(plain)})
    assert not set(banned.token_ids) & set(plain)


def test_min_tokens_holds_back_stops_and_ignore_eos_ignores_the_models_eos(lm):
    ids = lm.encode(PROMPT)
    eos = min(lm.eos_token_ids)
    # biased toward EOS: it stops at once, unless min_tokens holds it back or ignore_eos ignores it
    assert lm.generate(ids, "auto", max_new_tokens=10, logit_bias={eos: 100.0}).token_ids == [eos]
    held = lm.generate(ids, "auto", max_new_tokens=10, logit_bias={eos: 100.0}, min_tokens=4)
    assert len(held.token_ids) == 5 and eos not in held.token_ids[:4] and held.token_ids[4] == eos
    assert held.stats.stop_reason == "eos"
    assert held.token_ids == reference_greedy(lm, ids, 10, bias={eos: 100.0}, min_tokens=4)
    ignored = lm.generate(ids, "auto", max_new_tokens=6, logit_bias={eos: 100.0}, ignore_eos=True)
    assert ignored.token_ids == [eos] * 6 and ignored.stats.stop_reason == "length"
    # a stop token id still stops with ignore_eos; a stop string waits for min_tokens
    first = lm.generate(ids, "ar", max_new_tokens=6).token_ids
    assert lm.generate(ids, "auto", max_new_tokens=6, ignore_eos=True, stop_token_ids=[first[1]]).token_ids == first[:2]
    text = lm.generate(ids, "ar", max_new_tokens=12).text
    stop = text[:3] if text[:3].strip() else text[:6]
    early = lm.generate(ids, "pld", max_new_tokens=12, stop=stop, min_tokens=8)
    assert len(early.token_ids) >= 8


ASKS = [
    pytest.param({"presence_penalty": 1.0, "frequency_penalty": 0.5}, id="greedy-penalties"),
    pytest.param({"logit_bias": {5: 3.0, 9: -2.0}, "min_tokens": 30, "repetition_penalty": 1.1}, id="greedy-bias"),
    pytest.param({"temperature": 0.8, "seed": 3, "presence_penalty": 0.7, "logit_bias": {13: 4.0}}, id="sampled"),
    pytest.param({"temperature": 0.9, "top_k": 10, "seed": 8, "frequency_penalty": 1.5, "min_tokens": 20},
                 id="sampled-filters"),
]


@pytest.mark.parametrize("ask", ASKS)
def test_every_method_returns_ars_tokens_and_logprobs_with_the_fields(lm, ask):
    want = lm.generate(PROMPT, "ar", max_new_tokens=40, logprobs=3, logprobs_mode="processed", **ask)
    for name in SPECULATIVE:
        got = lm.generate(PROMPT, name, max_new_tokens=40, logprobs=3, logprobs_mode="processed", **ask)
        assert got.token_ids == want.token_ids, name
        assert got.logprobs == want.logprobs, name


def test_batched_under_a_small_budget_each_request_equals_its_ar_run(lm):
    prompts = [PROMPT, "The sea was calm and the sky", PROMPT + PROMPT[:40]]
    asks = [a.values[0] for a in ASKS[:3]]
    alone = [lm.generate(p, "ar", max_new_tokens=24, **a).token_ids for p, a in zip(prompts, asks, strict=True)]
    for name in ("auto", "ngram-trie"):
        runs = [lm.start(GenerationRequest.of(p, name, max_new_tokens=24, **a)) for p, a in zip(prompts, asks,
                                                                                                   strict=True)]
        outs, _ = together(lm.adapter, runs, cost=lm.cost_model(), limits=BatchLimits(max_tokens_per_forward=5))
        assert [t for t, _ in outs] == alone, name


@pytest.mark.parametrize("bad", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logit_bias": {"x": 1.0}}, {"logit_bias": {5: 101}},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {i: 1.0 for i in range(1025)}}, {"min_tokens": -1},
    {"ignore_eos": "yes"},
])
def test_bad_values_fail_before_anything_runs(bad):
    with pytest.raises(TriedecError, match=next(iter(bad))):
        GenerationRequest.of("hi", **bad)


def test_logit_bias_ids_are_checked_against_the_vocabulary_and_beam_refuses_the_fields(lm):
    with pytest.raises(TriedecError, match="logit_bias token id"):
        lm.generate("hi", logit_bias={10**6: 1.0})
    with pytest.raises(TriedecError, match="beam search does not sample and applies no penalty"):
        lm.generate("hi", "beam", num_beams=2, max_new_tokens=4, presence_penalty=1.0)
    assert Sampling(logit_bias={"12": 1, 3: -2}).logit_bias == ((3, -2.0), (12, 1.0))
    held = Sampling(min_tokens=3)
    assert not held.plain and held.adjusts and not held.reads_prefix


# ---- over HTTP ---------------------------------------------------------------------------------


def test_the_fields_through_the_openai_client(base, lm):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Count: one, two, three, four, five"}]
    fields = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "temperature": 0.7, "seed": 5}
    eos = min(lm.eos_token_ids)
    want = lm.generate(messages, "ar", max_new_tokens=16, chat=True, logit_bias={eos: 100.0}, min_tokens=3,
                       ignore_eos=True, stop_token_ids=[], **fields)
    for stream in (False, True):
        args = dict(model=MODEL, messages=messages, max_tokens=16, logit_bias={str(eos): 100}, **fields,
                    extra_body={"min_tokens": 3, "ignore_eos": True})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                           if c.choices)
        else:
            out = client.chat.completions.create(**args)
            text = out.choices[0].message.content
            assert out.usage.completion_tokens == 16 == len(want.token_ids)
        assert text == want.text
    plain = lm.generate(PROMPT, "ar", max_new_tokens=8).token_ids
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"stop_token_ids": [plain[2]]})
    assert out.choices[0].text == lm.tokenizer.decode(plain[:3], skip_special_tokens=True)


@pytest.mark.parametrize(("body", "param"), [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"min_tokens": -2}, "min_tokens"),
    ({"method": "beam", "frequency_penalty": 1}, None),
])
def test_bad_fields_get_400s(base, body, param):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = httpx.post(f"{base}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param

