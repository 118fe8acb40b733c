"""Structured output and tool calls over HTTP (docs/structured-output.md), on a real server on
loopback driven by real clients: the ``openai`` client's ``parse`` with a Pydantic model, LangChain's
``with_structured_output`` and ``bind_tools``, and tool-calling round trips through ``tools`` /
``tool_calls``, streamed and not. Every method returns ``ar``'s text under the same grammar, in a
batch with unconstrained requests and under a small verify budget; bad grammars and tools are
400s that say why."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from triedec.bench.load import serving
from triedec.core.grammar import MAX_GRAMMAR_BYTES
from triedec.core.limits import BatchLimits
from triedec.server import ServerConfig, create_app

TEMPLATE = Path(__file__).resolve().parents[1] / "docs" / "templates" / "chatml-tools.jinja"
METHODS = ["ar", "pld", "ngram-trie", "recycling", "lookahead", "auto"]


class Address(BaseModel):
    street: str
    city: str
    postcode: str | None


class Person(BaseModel):
    name: str
    age: int
    height_m: float
    role: Literal["admin", "user", "guest"]
    languages: list[str] = Field(max_length=4)  # a sampled small model may list words without end
    address: Address
    motto: str


EXTRACT = [{"role": "user", "content": (
    'Extract the person as JSON. Ada "the Enchantress" Lovelace, aged 36, 1.65 m tall, lives at 12 St James\'s '
    "Square, London (postcode SW1Y 4JH). She is an admin and writes in English, French and C:\\Notes. "
    'Her motto: "That brain of mine is something more than merely mortal."')}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def smol(default_mode_lm):
    """The default model served with a chat template that renders tools, under a small verify
    budget (24 tokens a forward: drafts are cut); the ``openai`` client for it."""
    tokenizer = default_mode_lm.tokenizer
    before = tokenizer.chat_template
    tokenizer.chat_template = TEMPLATE.read_text()
    try:
        config = ServerConfig(model_name="smol", method="auto", limits=BatchLimits(max_tokens_per_forward=24))
        with serving(create_app(default_mode_lm, config)) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        tokenizer.chat_template = before


def test_the_shipped_template_renders_a_plain_chat_as_the_models_own(default_mode_lm):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    tokenizer = default_mode_lm.tokenizer
    own = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in (chat, chat[1:])]
    ours = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True,
                                          chat_template=TEMPLATE.read_text()) for c in (chat, chat[1:])]
    assert ours == own


def test_parse_with_a_pydantic_model_every_method_equals_ar_in_a_batch(smol):
    """``parse`` (strict json_schema) for every method, greedy and sampled, sent at once beside
    unconstrained requests: every output validates, and every method's text is ``ar``'s."""
    schema = Person.model_json_schema()

    def parsed(method: str, temperature: float):
        return smol.chat.completions.parse(model="smol", messages=EXTRACT, response_format=Person, max_tokens=200,
                                           temperature=temperature, seed=11, extra_body={"method": method})

    def free(i: int):
        return smol.chat.completions.create(model="smol", messages=[{"role": "user", "content": f"Count to {i}."}],
                                            max_tokens=40, extra_body={"method": "auto"})

    with ThreadPoolExecutor(16) as pool:
        jobs = {(m, t): pool.submit(parsed, m, t) for m in METHODS for t in (0.0, 0.8)}
        others = [pool.submit(free, i) for i in range(4)]
        results = {key: job.result() for key, job in jobs.items()}
        assert all(o.result().choices[0].message.content for o in others)
    for (method, temperature), out in results.items():
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (method, temperature, choice.message.content)
        assert isinstance(choice.message.parsed, Person)
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert choice.message.content == results["ar", temperature].choices[0].message.content, method
    forced = sum(r.model_extra["triedec"]["tokens_per_step"] for r in results.values())
    assert forced > len(results)  # more than one token a step on average: forced tokens were drafted
    for (method, _), out in results.items():
        ext = out.model_extra["triedec"]
        assert 0 < ext["grammar_seconds"] < ext["seconds"]
        # ar decodes one token a forward: nothing drafted, so nothing forced; the others draft them
        assert (ext["forced_tokens"] == 0) == (method == "ar"), (method, ext["forced_tokens"])
        assert ext["forced_tokens"] <= out.usage.completion_tokens
    greedy = results["auto", 0.0].choices[0].message.parsed
    assert greedy.role in ("admin", "user", "guest") and isinstance(greedy.address, Address)


def test_json_object_guided_choice_and_regex(smol):
    ask = "Reply with a JSON object with the keys name and age for Ada Lovelace, aged 36."
    out = smol.chat.completions.create(model="smol", messages=[{"role": "user", "content": ask}], max_tokens=60,
                                       response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].message.content) == {"name": "Ada Lovelace", "age": 36}
    out = smol.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].message.content in ("yes", "no") and out.model_extra["triedec"]["stop_reason"] == "grammar"
    free = smol.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Is the sky blue?"}],
                                        max_tokens=4)
    assert "grammar_seconds" not in free.model_extra["triedec"] and "forced_tokens" not in free.model_extra["triedec"]
    out = smol.completions.create(model="smol", prompt="The year the war ended:", max_tokens=8,
                                  extra_body={"guided_regex": r" [12][0-9]{3}"})
    text = out.choices[0].text
    assert len(text) == 5 and text[1:].isdigit()
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    out = smol.completions.create(model="smol", prompt="Q: Is water wet?\nA:", max_tokens=8,
                                  extra_body={"guided_grammar": gbnf})
    assert out.choices[0].text in ("The answer is yes.", "The answer is no.")


def _streamed_calls(chunks) -> tuple[str, list[dict], str]:
    """A streamed reply's text, calls (their deltas joined by index) and finish reason."""
    text, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, [calls[i] for i in sorted(calls)], reason


def test_a_tool_calling_round_trip_streamed_and_not(smol):
    out = smol.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER, ADD], max_tokens=120,
                                       tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "add")
    spec = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), spec)
    streamed = smol.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER, ADD], max_tokens=120,
                                            tool_choice="required", parallel_tool_calls=False, stream=True)
    text, calls, reason = _streamed_calls(streamed)
    assert text == "" and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")
    # the call's result goes back; the model answers in text
    history = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = smol.chat.completions.create(model="smol", messages=history, tools=[WEATHER, ADD], max_tokens=60,
                                         tool_choice="none")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_tool_choice_named_auto_and_parallel(smol):
    named = {"type": "function", "function": {"name": "add"}}
    for stream in (False, True):
        out = smol.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER, ADD], max_tokens=80,
                                           tool_choice=named, stream=stream)
        if stream:
            _, calls, reason = _streamed_calls(out)
            names = [c["name"] for c in calls]
        else:
            reason, names = out.choices[0].finish_reason, [c.function.name for c in out.choices[0].message.tool_calls]
        assert names == ["add"] and reason == "tool_calls"
    # auto: a greeting is answered in text, streamed as text
    hello = [{"role": "user", "content": "Say hello to me."}]
    out = smol.chat.completions.create(model="smol", messages=hello, tools=[WEATHER], max_tokens=40)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    text, calls, _ = _streamed_calls(smol.chat.completions.create(model="smol", messages=hello, tools=[WEATHER],
                                                                  max_tokens=40, stream=True))
    assert text == out.choices[0].message.content and calls == []
    # required with parallel calls allowed: each call valid, however many the model makes
    out = smol.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER], max_tokens=200,
                                       tool_choice="required")
    for call in out.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_response_format_with_tools_a_call_or_json_content(smol):
    """``tools`` with ``response_format``: the reply is calls, or content valid against the schema
    (never free text); every method returns ``ar``'s reply, sampled; ``guided_*`` with tools is a
    400 that names the field, and so is a broken schema beside valid tools."""
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}

    def ask(method: str, messages, stream: bool = False):
        return smol.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], response_format=fmt,
                                            max_tokens=200, temperature=0.8, seed=5, stream=stream,
                                            extra_body={"method": method})

    with ThreadPoolExecutor(6) as pool:
        replies = dict(zip(METHODS, pool.map(lambda m: ask(m, EXTRACT), METHODS), strict=True))
    for method, out in replies.items():
        message = out.choices[0].message
        assert (message.content, message.tool_calls) == (replies["ar"].choices[0].message.content,
                                                         replies["ar"].choices[0].message.tool_calls), method
    message = replies["ar"].choices[0].message
    if message.tool_calls:
        assert message.content is None and replies["ar"].choices[0].finish_reason == "tool_calls"
    else:
        jsonschema.validate(json.loads(message.content), schema)
    weather = smol.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER], response_format=fmt,
                                           max_tokens=200)
    reply = weather.choices[0].message
    if reply.tool_calls:
        for call in reply.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    else:
        jsonschema.validate(json.loads(reply.content), schema)
    for extra, param in (({"guided_regex": "[a-z]+"}, "guided_regex"),
                         ({"response_format": {"type": "json_schema", "json_schema": {
                             "name": "x", "schema": {"type": "objekt"}}}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as info:
            smol.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER], max_tokens=8,
                                         **({} if "response_format" not in extra else extra),
                                         extra_body={k: v for k, v in extra.items() if k != "response_format"})
        assert info.value.body["param"] == param, info.value.body


def test_tools_whose_grammar_is_too_large_are_a_400(smol):
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "description": "d" * 1000}}}}} for i in range(100)]
    with pytest.raises(openai.BadRequestError) as caught:
        smol.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=many, tool_choice="required",
                                     max_tokens=8)
    assert caught.value.body["param"] == "tools" and "limit" in caught.value.body["message"]


def test_every_method_returns_ars_tool_calls(smol):
    def ask(method: str):
        return smol.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER, ADD], max_tokens=100,
                                            tool_choice="required", temperature=0.7, seed=5,
                                            extra_body={"method": method})

    with ThreadPoolExecutor(len(METHODS)) as pool:
        outs = dict(zip(METHODS, pool.map(ask, METHODS), strict=True))
    want = [(c.function.name, c.function.arguments) for c in outs["ar"].choices[0].message.tool_calls]
    for method, out in outs.items():
        assert [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls] == want, method


def test_langchain_structured_output_and_tools(smol):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="smol", base_url=str(smol.base_url), api_key="unused", max_retries=0, max_tokens=200,
                      temperature=0)
    person = chat.with_structured_output(Person, method="json_schema").invoke(EXTRACT[0]["content"])
    assert isinstance(person, Person)
    message = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK_WEATHER[0]["content"])
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])


def _status(base: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    response = httpx.post(f"{base}{path}", json=body, timeout=60)
    return response.status_code, response.json()


def test_bad_grammars_and_tools_are_clear_400s(base):
    """On the tiny model (its chat template renders no tools)."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format", "grammar"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "regex grammar"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_grammar": "root ::= (("}, "guided_grammar", "gbnf"),
        ({"guided_json": {"type": "string", "description": "x" * MAX_GRAMMAR_BYTES}}, "guided_json", "limit"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one"),
        ({"tools": [WEATHER]}, "tools", "no tool format"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not among"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"functions": [{"name": "f"}]}, None, "deprecated functions"),
    ]
    for extra, param, words in cases:
        status, body = _status(base, {**chat, **extra})
        assert status == 400, (extra, body)
        assert words in body["error"]["message"], (extra, body)
        if param is not None:
            assert body["error"]["param"] == param, (extra, body)
    # the same server still answers
    status, body = _status(base, {**chat, "tools": [WEATHER], "tool_choice": "none"})
    assert status == 200 and body["choices"][0]["message"]["content"] is not None


def test_a_grammar_the_model_cannot_finish_ends_at_length(base):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "guided_regex": "a{10}"}
    status, out = _status(base, body, "/v1/completions")
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["text"] == "a" * len(out["choices"][0]["text"])


def test_a_tag_the_tokenizer_holds_as_one_token_is_asked_for_as_that_token(default_mode_lm):
    """Qwen2.5's tokenizer holds ``<tool_call>`` and ``</tool_call>`` as added tokens, which its
    model writes as one token each: the calls' grammar asks for those tokens (llguidance does not
    match an added token against the tag's text; found on Qwen2.5-Coder-0.5B, where a required
    call failed on its first token)."""
    import copy

    from triedec.api.grammar import Grammars
    from triedec.api.tools import Tools, tool_format

    tok = copy.deepcopy(default_mode_lm.tokenizer)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATE.read_text()
    opening, closing = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    fmt = tool_format(tok)
    assert fmt.tokens == (("<tool_call>", opening), ("</tool_call>", closing))
    assert fmt.lark("}\n</tool_call>") == f'"}}\\n" <[{closing}]>'
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    state = grammars.state(fmt.grammar(Tools.of([WEATHER], "required")))
    forced = state.forced(64)
    assert forced[0] == opening and state.admits([], opening)
    state.commit(forced)
    text = tok.decode(forced, skip_special_tokens=True)
    assert text.startswith('<tool_call>\n{"name": "get_weather"'), text
    # without the added tokens the tag is text, as before
    assert tool_format(default_mode_lm.tokenizer).tokens == ()


def test_a_required_call_cut_by_max_tokens_keeps_its_shape(smol):
    """A reply that must be calls and is cut by max_tokens is calls still: content null and
    finish_reason length, streamed and not; a call cut after its name comes with that name and the
    arguments written so far."""
    for cut in (2, 8, 16):
        options = {"model": "smol", "messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required",
                   "max_tokens": cut}
        choice = smol.chat.completions.create(**options).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, choice
        for call in choice.message.tool_calls or ():
            assert call.function.name == "get_weather"
        chunks = list(smol.chat.completions.create(**options, stream=True))
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
