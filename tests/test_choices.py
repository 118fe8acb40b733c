"""Several answers in one request: ``n`` choices (streamed too), a list of prompts, ``best_of``,
beam search's n best hypotheses, vLLM's ``prompt_logprobs``, and the tokenizer routes
(``/tokenize``, ``/detokenize``, ``/tokenizer_info``) that clients such as lm-evaluation-harness
build token-id prompts with. Every choice equals the library's run of the same prompt and seed."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from triedec.api.generation import GenerationRequest
from triedec.core.sampling import Sampling
from triedec.engine.batch import Batch, BatchLimits
from triedec.server.schemas import MAX_CHOICES

MODEL = "tiny"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
OTHER = "The sea was calm that night, and"
CHAT = [{"role": "user", "content": "Tell me a story about the sea."}]


def events(base, path, body):
    """The JSON payloads of a streamed response, ``[DONE]`` left out."""
    out = []
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def test_streamed_n_choices_join_to_the_unstreamed_ones(base, lm):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 10, "n": 3, "temperature": 0.9, "seed": 11,
            "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    texts, entries, reasons, usage = ["", "", ""], [[], [], []], [None] * 3, None
    for payload in events(base, "/v1/chat/completions", body):
        if payload.get("usage"):
            usage = payload["usage"]
        for choice in payload["choices"]:
            i = choice["index"]
            texts[i] += choice["delta"].get("content") or ""
            entries[i] += (choice["logprobs"] or {}).get("content", [])
            reasons[i] = choice["finish_reason"] or reasons[i]
    for i, choice in enumerate(whole["choices"]):
        assert choice["index"] == i
        assert texts[i] == choice["message"]["content"]
        assert entries[i] == choice["logprobs"]["content"]
        assert reasons[i] == choice["finish_reason"]
        want = lm.generate(CHAT, "auto", chat=True, max_new_tokens=10, temperature=0.9, seed=11 + i)
        assert texts[i] == want.text
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: usage[k] for k in counts} == {k: whole["usage"][k] for k in counts}
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again: from the prefix trie


@pytest.mark.parametrize("as_ids", [False, True], ids=["texts", "token-ids"])
def test_a_list_of_prompts_gets_each_prompts_n_choices_in_order(base, lm, as_ids):
    prompts = [PROMPT, OTHER]
    sent = [lm.encode(p) for p in prompts] if as_ids else prompts
    body = {"model": MODEL, "prompt": sent, "max_tokens": 8, "n": 2, "temperature": 0.8, "seed": 5, "logprobs": 1}
    out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    completion = 0
    for i, prompt in enumerate(prompts):
        for j in range(2):
            want = lm.generate(prompt, "ar", max_new_tokens=8, temperature=0.8, seed=5 + j, logprobs=1)
            choice = out["choices"][2 * i + j]
            assert choice["text"] == want.text
            assert choice["logprobs"]["token_logprobs"] == [e.logprob for e in want.logprobs]
            completion += len(want.token_ids)
    assert out["usage"]["prompt_tokens"] == sum(len(lm.encode(p)) for p in prompts)
    assert out["usage"]["completion_tokens"] == completion
    streamed = ["", "", "", ""]
    for payload in events(base, "/v1/completions", body):
        for choice in payload["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [c["text"] for c in out["choices"]]


def test_best_of_returns_the_n_candidates_with_the_highest_logprob_sums(base, lm):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "n": 2, "best_of": 5, "temperature": 1.0,
            "seed": 3}
    out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    runs = [lm.generate(PROMPT, "ar", max_new_tokens=8, temperature=1.0, seed=3 + i, logprobs=0) for i in range(5)]
    ranked = sorted(runs, key=lambda r: -sum(e.logprob for e in r.logprobs))
    assert [c["text"] for c in out["choices"]] == [r.text for r in ranked[:2]]
    assert all(c["logprobs"] is None for c in out["choices"])  # ranked by them, shown only when asked
    assert out["usage"]["completion_tokens"] == sum(len(r.token_ids) for r in runs)  # every candidate's tokens


def test_beam_n_returns_its_n_best_hypotheses(base, lm):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "n": 3, "method": "beam",
            "method_options": {"num_beams": 4}}
    out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    want = lm.generate(PROMPT, "beam", max_new_tokens=8, num_beams=4, num_return_sequences=3)
    assert [c["text"] for c in out["choices"]] == [lm.decode_result(h.token_ids) for h in want.sequences]
    assert len(out["choices"]) == 3


@pytest.mark.parametrize(("body", "param"), [
    ({"n": MAX_CHOICES + 1}, "n"),
    ({"n": 0}, "n"),
    ({"prompt": ["a", "b", "c"], "n": 6}, "prompt"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": MAX_CHOICES + 1}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"n": 5, "method": "beam"}, "n"),
    ({"n": 2, "method": "beam", "stream": True}, "n"),
    ({"best_of": 2, "method": "beam"}, "best_of"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": ["a", ""]}, "prompt"),
])
def test_past_a_cap_or_in_conflict_gets_a_400_naming_the_field(base, body, param):
    payload = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **body}
    response = httpx.post(f"{base}/v1/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_prompt_logprobs_in_vllms_shape(base, lm):
    """vLLM's ``prompt_logprobs: k``: ``None`` for the first prompt token, then a dict from token
    id to ``{logprob, rank, decoded_token}`` holding the prompt's own token (its rank in the
    vocabulary) and the k most likely; values equal the library's, which equal
    ``torch.log_softmax`` of transformers' logits. Chat carries them at the top level."""
    out = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                      "prompt_logprobs": 2}, timeout=60).json()
    ids = lm.encode(PROMPT)
    scored = out["choices"][0]["prompt_logprobs"]
    assert out["choices"][0]["logprobs"] is None and scored[0] is None and len(scored) == len(ids)
    want = lm.generate(PROMPT, "ar", max_new_tokens=1, logprobs=2, prompt_logprobs=True)
    with torch.no_grad():
        logp = torch.log_softmax(lm.reference_model()(torch.tensor([ids])).logits[0].float(), dim=-1)
    for position, (entry, item) in enumerate(zip(scored[1:], want.prompt_logprobs, strict=True), 1):
        token = ids[position]
        own = entry[str(token)]
        assert own["logprob"] == item.logprob
        assert own["rank"] == int((logp[position - 1] > logp[position - 1, token]).sum()) + 1
        assert own["decoded_token"] == lm.tokenizer.decode([token])
        top = sorted(((v["rank"], int(t)) for t, v in entry.items() if int(t) != token or v["rank"] <= 2))
        assert [t for _, t in top][:2] == [t for t, _ in item.top]
    chat = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                           "prompt_logprobs": 0}, timeout=60).json()
    assert len(chat["prompt_logprobs"]) == len(lm.encode(CHAT, chat=True))
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # k = 0: the prompt's own token only


def test_the_tokenizer_routes_as_vllm_spells_them(base, lm):
    tokenize = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}, timeout=60)
    found = tokenize.json()
    assert found["tokens"] == lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert found["count"] == len(found["tokens"]) and found["max_model_len"] == lm.max_context
    chat = httpx.post(f"{base}/tokenize", json={"messages": CHAT, "return_token_strs": True}, timeout=60).json()
    assert chat["tokens"] == lm.encode(CHAT, chat=True)
    assert chat["token_strs"] == lm.tokenizer.convert_ids_to_tokens(chat["tokens"])
    back = httpx.post(f"{base}/detokenize", json={"tokens": found["tokens"]}, timeout=60).json()
    assert back == {"prompt": lm.tokenizer.decode(found["tokens"])}
    info = httpx.get(f"{base}/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == lm.tokenizer.eos_token and info["chat_template"] == lm.tokenizer.chat_template
    eos = httpx.post(f"{base}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                     timeout=60).json()
    assert eos["tokens"] == [lm.tokenizer.eos_token_id]  # what lm-eval's remote tokenizer reads the EOS id from
    for path, body, status, param in (
        ("/detokenize", {"tokens": [lm.adapter.vocab_size]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"prompt": "x" * (lm.max_context * lm.prompts.max_token_bytes + 8)}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ):
        response = httpx.post(f"{base}{path}", json=body, timeout=60)
        assert response.status_code == status, (path, body, response.text)
        assert response.json()["error"]["param"] == param, (path, body, response.text)


@pytest.mark.parametrize("method", ["ar", "auto", "pld", "recycling"])
def test_runs_of_one_group_with_one_prompt_compute_its_kv_once(lm, method):
    """Four sampled runs of one prompt in one group (a request's choices) and one of another
    group: the group's prompt is prefilled once (the rest copy its KV and compute only the rows
    they need themselves: recycling, which seeds its matrix from every prompt row's logits by
    default, all of them), the other group's on its own; every run returns its solo tokens."""
    ids = lm.encode(PROMPT * 4)
    requests = [GenerationRequest(ids, method, {}, 10, sampling=Sampling(temperature=0.9, seed=s))
                for s in range(5)]
    runs = [lm.start(r) for r in requests]
    batch = Batch(lm.adapter, lm.cost_model(), BatchLimits(max_prefill_tokens=64))
    for i, run in enumerate(runs):
        batch.submit(run, group="other" if i == 4 else "mine", request_id=f"r{i}")
    prefilled = 0
    while not batch.idle:
        prefilled += batch.step().plan.prefill_tokens
    batch.close()
    own = [len(ids) - r.cacheable_prefix for r in runs[1:4]]
    assert prefilled == 2 * len(ids) + sum(own)
    assert all(o < len(ids) for o in own) == (method != "recycling")
    for request, run in zip(requests, runs, strict=True):
        assert list(run.take()) == lm.generate(ids, method, max_new_tokens=10, temperature=0.9,
                                                seed=request.sampling.seed).token_ids


def test_the_fields_through_the_openai_client(client, lm):
    """``n`` streamed, ``best_of``, ``echo`` streamed, a list of prompts and vLLM's
    ``prompt_logprobs`` (extra body), as the ``openai`` client sends and parses them."""
    streamed = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, temperature=0.9,
                                                seed=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [lm.generate(CHAT, "ar", chat=True, max_new_tokens=6, temperature=0.9, seed=2 + i).text
                        for i in range(2)]
    best = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=1, best_of=3, temperature=1.0,
                                     seed=9)
    runs = [lm.generate(PROMPT, "ar", max_new_tokens=6, temperature=1.0, seed=9 + i, logprobs=0) for i in range(3)]
    assert best.choices[0].text == max(runs, key=lambda r: sum(e.logprob for e in r.logprobs)).text
    echoed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, stream=True) if c.choices)
    assert echoed == lm.tokenizer.decode(lm.encode(PROMPT), skip_special_tokens=True) + \
        lm.generate(PROMPT, "auto", max_new_tokens=4).text
    several = client.completions.create(model=MODEL, prompt=[PROMPT, OTHER], max_tokens=4,
                                        extra_body={"prompt_logprobs": 1})
    assert [c.text for c in several.choices] == [lm.generate(p, "auto", max_new_tokens=4).text for p in (PROMPT, OTHER)]
    scored = several.choices[1].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(lm.encode(OTHER))
