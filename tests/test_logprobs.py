"""Logprobs: every method reports ``ar``'s values bit for bit (greedy, sampled, raw and processed,
alone and in a batch under a small forward budget); raw values are ``torch.log_softmax`` of the
model's own float32 logits for the same prefix; the server returns them in OpenAI's shapes."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from helpers import together

from triedec.api.generation import GenerationRequest
from triedec.api.text import token_bytes, token_label
from triedec.bench.load import serving
from triedec.core.errors import TriedecError
from triedec.core.logprobs import MAX_TOP_LOGPROBS, Logprobs, TokenLogprob, token_logprob
from triedec.core.sampling import Sampling, process, seen_tokens
from triedec.engine.batch import BatchLimits
from triedec.engine.methods import methods
from triedec.server import ServerConfig, create_app

MODEL = "tiny"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
SPECULATIVE = [m for m in methods() if m != "beam"]
ASKS = [
    pytest.param({}, id="greedy-raw"),
    pytest.param({"repetition_penalty": 1.3, "logprobs_mode": "processed"}, id="greedy-penalty-processed"),
    pytest.param({"temperature": 0.8, "seed": 3}, id="sampled-raw"),
    pytest.param({"temperature": 0.7, "top_k": 8, "top_p": 0.9, "seed": 5, "logprobs_mode": "processed"},
                 id="sampled-processed"),
]


@pytest.mark.parametrize("ask", ASKS)
def test_every_method_reports_ars_logprobs_bit_for_bit(lm, ask):
    want = lm.generate(PROMPT, "ar", max_new_tokens=40, logprobs=5, **ask)
    assert len(want.logprobs) == len(want.token_ids) == 40
    assert [i.token for i in want.logprobs] == want.token_ids
    for name in SPECULATIVE:
        got = lm.generate(PROMPT, name, max_new_tokens=40, logprobs=5, **ask)
        assert got.token_ids == want.token_ids, name
        assert got.logprobs == want.logprobs, name  # floats compared exactly, not to a tolerance


def test_in_a_batch_under_a_small_forward_budget_the_logprobs_are_ars(lm):
    """Several requests share each forward (trees cut by a budget of a few tokens), mixed with
    requests that ask for no logprobs; each one's logprobs equal its ``ar`` run alone."""
    prompts = [PROMPT, "The sea was calm and the sky", PROMPT + PROMPT[:30], "1, 2, 3, 4, 5, 6,"]
    asks = [{"logprobs": 3}, {"logprobs": 0, "temperature": 0.9, "seed": 11}, {},
            {"logprobs": 20, "logprobs_mode": "processed", "temperature": 0.6, "top_k": 4, "seed": 2}]
    alone = [lm.generate(p, "ar", max_new_tokens=24, **a) for p, a in zip(prompts, asks, strict=True)]
    for name in ("auto", "pld", "recycling"):
        requests = [GenerationRequest.of(p, name, max_new_tokens=24, **a) for p, a in zip(prompts, asks, strict=True)]
        runs = [lm.start(r) for r in requests]
        logprobs: list[list[TokenLogprob]] = [[] for _ in runs]

        class Collect:  # take the logprobs as the tokens are taken
            def __init__(self, run, into):
                self.run, self.into = run, into

            def __getattr__(self, name):
                return getattr(self.run, name)

            def take(self):
                fresh = self.run.take()
                self.into += self.run.take_logprobs()
                return fresh

        outs, _ = together(lm.adapter, [Collect(r, lp) for r, lp in zip(runs, logprobs, strict=True)],
                           cost=lm.cost_model(), limits=BatchLimits(max_tokens_per_forward=6))
        for (tokens, _), lp, want in zip(outs, logprobs, alone, strict=True):
            assert tokens == want.token_ids, name
            assert tuple(lp) == want.logprobs, name


def test_raw_logprobs_are_log_softmax_of_the_models_float32_logits(lm):
    """Each raw logprob and alternative is ``torch.log_softmax`` of the float32 logits that the
    model's own forward gives for the token's prefix (transformers' forward, not triedec's)."""
    out = lm.generate(PROMPT, "auto", max_new_tokens=12, logprobs=4, temperature=0.8, seed=9)
    ids = lm.encode(PROMPT)
    model = lm.reference_model()
    with torch.no_grad():
        logits = model(torch.tensor([ids + out.token_ids])).logits[0].float()
    for j, item in enumerate(out.logprobs):
        row = torch.log_softmax(logits[len(ids) - 1 + j], dim=-1)
        assert math.isclose(item.logprob, float(row[item.token]), rel_tol=0, abs_tol=1e-5)
        top = torch.topk(row, 4)
        assert [t for t, _ in item.top] == top.indices.tolist()
        for (_, value), want in zip(item.top, top.values.tolist(), strict=True):
            assert math.isclose(value, want, rel_tol=0, abs_tol=1e-5)


def test_token_logprob_is_the_rows_log_softmax_in_float32():
    row = torch.tensor([0.5, 2.0, -1.0, 2.0, float("-inf")], dtype=torch.bfloat16)
    got = token_logprob(row, 2, 4)
    want = torch.log_softmax(row.float(), dim=-1)
    assert got.token == 2 and got.logprob == float(want[2])
    assert got.top == ((1, float(want[1])), (3, float(want[3])), (0, float(want[0])), (2, float(want[2])))
    # an excluded token (-inf) is never listed as an alternative
    assert all(t != 4 for t, _ in token_logprob(row, 1, 5).top)


def test_processed_logprobs_describe_the_distribution_the_token_was_drawn_from(lm):
    sampling = {"temperature": 0.7, "top_k": 3, "repetition_penalty": 1.2, "seed": 4}
    out = lm.generate(PROMPT, "ar", max_new_tokens=6, logprobs=3, logprobs_mode="processed", **sampling)
    ids = lm.encode(PROMPT)
    model = lm.reference_model()
    with torch.no_grad():
        logits = model(torch.tensor([ids + out.token_ids])).logits[0].float()
    for j, item in enumerate(out.logprobs):
        processed = process(logits[len(ids) - 1 + j], seen_tokens(ids, out.token_ids[:j]), Sampling(**sampling))
        want = torch.log_softmax(processed, dim=-1)
        assert math.isclose(item.logprob, float(want[item.token]), abs_tol=1e-5)
        assert len(item.top) == 3  # top_k=3 leaves three tokens with mass
        assert math.isclose(sum(math.exp(v) for _, v in item.top), 1.0, abs_tol=1e-4)


@pytest.mark.parametrize("bad", [{"logprobs": 21}, {"logprobs": -1}, {"logprobs": True},
                                 {"logprobs": 2, "logprobs_mode": "softmax"}])
def test_bad_logprobs_arguments_fail_before_anything_runs(bad):
    with pytest.raises(TriedecError, match="logprobs"):
        GenerationRequest.of("hi", **bad)


def test_beam_search_refuses_logprobs(lm):
    with pytest.raises(TriedecError, match="beam search does not report logprobs"):
        lm.generate("hi", "beam", num_beams=2, max_new_tokens=4, logprobs=1)


def test_without_logprobs_nothing_is_computed(lm):
    assert lm.generate(PROMPT, "auto", max_new_tokens=8).logprobs == ()
    assert Logprobs().top == 0 and MAX_TOP_LOGPROBS == 20


# ---- over HTTP ---------------------------------------------------------------------------------


CHAT = [{"role": "user", "content": "Write fibonacci in Python."}]


def chat_entries(lm, items):
    tok = lm.tokenizer
    return [(token_label(tok, i.token), i.logprob, token_bytes(tok, i.token),
             [(token_label(tok, t), v, token_bytes(tok, t)) for t, v in i.top]) for i in items]


@pytest.mark.parametrize("method", ["ar", "auto", "pld"])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_through_the_openai_client_equal_the_librarys(client, lm, method, stream):
    sampling = {"temperature": 0.8, "seed": 21}
    want = lm.generate(CHAT, "ar", max_new_tokens=20, logprobs=3, chat=True, **sampling)
    extra = {"method": method}
    args = dict(model=MODEL, messages=CHAT, max_tokens=20, logprobs=True, top_logprobs=3, extra_body=extra,
                **sampling)
    if stream:
        content, text = [], ""
        for chunk in client.chat.completions.create(stream=True, **args):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    else:
        out = client.chat.completions.create(**args)
        content, text = out.choices[0].logprobs.content, out.choices[0].message.content
    assert text == want.text
    got = [(c.token, c.logprob, c.bytes, [(t.token, t.logprob, t.bytes) for t in c.top_logprobs]) for c in content]
    assert got == chat_entries(lm, want.logprobs)
    # the bytes of the tokens spell the text (no stop string here)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace").startswith(text[:5])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_in_openais_legacy_shape(client, lm, stream):
    want = lm.generate(PROMPT, "ar", max_new_tokens=16, logprobs=2)
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=2, extra_body={"method": "auto"})
    if stream:
        tokens, values, tops, offsets, text = [], [], [], [], ""
        for chunk in client.completions.create(stream=True, **args):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                lp = chunk.choices[0].logprobs
                tokens += lp.tokens
                values += lp.token_logprobs
                tops += lp.top_logprobs
                offsets += lp.text_offset
            if chunk.choices:
                text += chunk.choices[0].text
    else:
        out = client.completions.create(**args)
        lp = out.choices[0].logprobs
        tokens, values, tops, offsets, text = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, \
            out.choices[0].text
    assert text == want.text
    assert values == [i.logprob for i in want.logprobs]
    assert tokens == [token_label(lm.tokenizer, t) for t in want.token_ids]
    for top, item in zip(tops, want.logprobs, strict=True):
        assert max(top.values()) == item.top[0][1]  # what lm-eval's greedy check reads
        assert top[token_label(lm.tokenizer, item.token)] == item.logprob
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "logprobs_mode": "nope"}, "logprobs_mode"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 2, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "method": "beam"}, None),
])
def test_bad_logprobs_fields_get_400s_naming_the_field(base, path, body, param):
    payload = {"model": MODEL, "max_tokens": 4, **body}
    payload.update({"messages": CHAT} if "chat" in path else {"prompt": "hi"})
    response = httpx.post(f"{base}{path}", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if 21 in body.values():  # past the cap: the message names it
        assert "[0, 20] (this server's cap), got 21" in error["message"]
    assert error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "seed": 7}], ids=["greedy", "sampled"])
def test_on_the_default_model_every_method_reports_ars_logprobs(default_lm, sampling):
    messages = [{"role": "user", "content": "Repeat this list twice: apple, pear, plum, fig, kiwi, lime."}]
    want = default_lm.generate(messages, "ar", max_new_tokens=40, logprobs=5, **sampling)
    for name in ("auto", "pld", "recycling", "lookahead"):
        got = default_lm.generate(messages, name, max_new_tokens=40, logprobs=5, **sampling)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs, name


# ---- prompt logprobs and completions' echo (what lm-evaluation-harness's loglikelihood sends) ------


def test_prompt_logprobs_score_every_prompt_token_across_chunks(lm):
    """Past several prefill chunks: each prompt token after the first, scored after the tokens
    before it, as ``torch.log_softmax`` of the model's own forward over the whole prompt."""
    prompt = PROMPT * 6
    ids = lm.encode(prompt)
    assert len(ids) > 2 * 128  # three prefill chunks
    out = lm.generate(prompt, "auto", max_new_tokens=2, logprobs=2, prompt_logprobs=True)
    assert [i.token for i in out.prompt_logprobs] == ids[1:] and len(out.logprobs) == 2
    with torch.no_grad():
        logp = torch.log_softmax(lm.reference_model()(torch.tensor([ids])).logits[0].float(), dim=-1)
    for j, item in enumerate(out.prompt_logprobs):
        assert math.isclose(item.logprob, float(logp[j, ids[j + 1]]), abs_tol=1e-5)
        assert item.top[0][0] == int(logp[j].argmax())
    # every method scores the prompt with the same bits, and its tokens' logprobs are ar's
    want = lm.generate(prompt, "ar", max_new_tokens=2, logprobs=2, prompt_logprobs=True)
    assert (want.prompt_logprobs, want.logprobs) == (out.prompt_logprobs, out.logprobs)


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's ``local-completions`` reads from an ``echo`` response
    (its ``parse_logprobs``): the continuation's summed logprob, and whether it is greedy."""
    values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(values), all(v == max(top.values()) for v, top in zip(values, tops, strict=True))


def test_echo_scores_the_prompt_as_lm_eval_reads_it(base, lm):
    context, continuation = lm.encode("The capital of France is"), lm.encode(" Paris, of course.")
    ids = context + continuation
    payload = {"model": MODEL, "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
               "seed": 1234}
    response = httpx.post(f"{base}/v1/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    want = lm.generate(ids, "ar", max_new_tokens=1, logprobs=1, prompt_logprobs=True)
    assert logprobs["token_logprobs"][1:] == [i.logprob for i in (*want.prompt_logprobs, *want.logprobs)]
    assert choice["text"] == lm.tokenizer.decode(ids, skip_special_tokens=True) + want.text
    with torch.no_grad():
        logp = torch.log_softmax(lm.reference_model()(torch.tensor([ids])).logits[0].float(), dim=-1)
    total, greedy = lm_eval_loglikelihood(choice, len(context))
    truth = sum(float(logp[i - 1, ids[i]]) for i in range(len(context), len(ids)))
    assert math.isclose(total, truth, abs_tol=1e-4)
    assert greedy == all(int(logp[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
    assert response.json()["usage"]["completion_tokens"] == 1


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, lm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    ids = lm.encode(PROMPT)
    choice = out.choices[0]
    assert choice.text == lm.tokenizer.decode(ids, skip_special_tokens=True)
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    want = lm.generate(PROMPT, "ar", max_new_tokens=1, prompt_logprobs=True)
    assert choice.logprobs.token_logprobs[1:] == [i.logprob for i in want.prompt_logprobs]
    assert out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    # echo without logprobs returns the prompt's text, then the completion's
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True)
    assert plain.choices[0].text == choice.text + lm.generate(PROMPT, "auto", max_new_tokens=5).text


def test_echo_streams_as_it_answers_at_once(base):
    """Streamed, the echoed prompt (text and logprobs) comes first, then the completion's chunks:
    joined, they are the unstreamed answer, bit for bit; ``max_tokens`` 0 needs ``echo``."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "echo": True, "logprobs": 1, "temperature": 0.6,
            "seed": 4}
    whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
    for tokens in (5, 0):
        if tokens == 0:
            body["max_tokens"] = 0
            whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
        text, lists = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    for key, values in (choice["logprobs"] or {}).items():
                        lists[key] += values
        assert text == whole["text"] and lists == whole["logprobs"], tokens
    response = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens", response.text


def test_a_prompt_token_the_processed_distribution_excludes_shows_as_vllms_floor(base):
    """Scored under ``processed`` with top_k=1, most prompt tokens have no mass (-inf): the JSON
    shows -9999.0 for them, as vLLM does (JSON has no infinity), never a 500."""
    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0.5,
               "top_k": 1, "seed": 1, "logprobs_mode": "processed"}
    response = httpx.post(f"{base}/v1/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    values = response.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert -9999.0 in values and all(v == -9999.0 or v == 0.0 for v in values)


# ---- n: several choices for one prompt ----------------------------------------------------------


def test_n_sampled_choices_are_seeded_seed_plus_i_and_each_equals_its_solo_run(client, lm):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, n=3, temperature=0.9, seed=40,
                                         logprobs=True, top_logprobs=1, extra_body={"method": "auto"})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, choice in enumerate(out.choices):
        want = lm.generate(CHAT, "ar", max_new_tokens=12, chat=True, temperature=0.9, seed=40 + i, logprobs=1)
        assert choice.message.content == want.text
        assert [c.logprob for c in choice.logprobs.content] == [x.logprob for x in want.logprobs]
    total = sum(len(lm.generate(CHAT, "ar", max_new_tokens=12, chat=True, temperature=0.9, seed=40 + i).token_ids)
                for i in range(3))
    assert out.usage.completion_tokens == total
    assert [c["seed"] for c in out.model_extra["triedec"]["choices"]] == [40, 41, 42]


def test_n_without_a_seed_draws_one_and_greedy_choices_are_equal(base, lm):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "n": 4, "temperature": 0.8}
    ext = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["triedec"]
    seeds = [c["seed"] for c in ext["choices"]]
    assert seeds == [seeds[0] + i for i in range(4)]
    greedy = httpx.post(f"{base}/v1/completions", json={**body, "temperature": 0}, timeout=60).json()
    texts = [c["text"] for c in greedy["choices"]]
    assert texts == [lm.generate(PROMPT, "auto", max_new_tokens=6).text] * 4


def test_n_counts_in_the_tenants_share(lm):
    config = ServerConfig(model_name=MODEL, method="ar", tenant_max_running=2, tenant_max_queued=0)
    with serving(create_app(lm, config)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json={**body, "n": 2}, timeout=60).status_code == 200
        refused = httpx.post(f"{url}/v1/completions", json={**body, "n": 3}, timeout=60)
        assert refused.status_code == 429, refused.text


def test_choices_refused_half_way_free_what_was_submitted(lm):
    """With one slot and one place in the queue, one of three choices is refused (503): the
    choices already submitted are cancelled, and the server answers the next request as usual."""
    config = ServerConfig(model_name=MODEL, method="ar", limits=BatchLimits(max_running=1), max_queue=1)
    with serving(create_app(lm, config)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        refused = httpx.post(f"{url}/v1/completions", json={**body, "n": 3}, timeout=60)
        assert refused.status_code == 503, refused.text
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert again.status_code == 200, again.text
        health = httpx.get(f"{url}/health", timeout=60).json()
        assert health["running"] == 0 and health["waiting"] == 0, health
