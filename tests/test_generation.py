"""GenerationRequest: one validated value that every way in builds, and LM.start its one entry point."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import triedec
from triedec.api.generation import MAX_NEW_TOKENS, GenerationRequest
from triedec.api.lm import LM
from triedec.core.errors import TriedecError
from triedec.core.sampling import Sampling
from triedec.drafters.base import BaseDrafter
from triedec.drafters.registry import register, reserved_option_names
from triedec.engine.beam import BeamOptions
from triedec.engine.methods import methods


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return triedec.load(tiny_model_dir)


def test_defaults_live_in_one_place():
    request = GenerationRequest("hi")
    assert request.max_new_tokens == MAX_NEW_TOKENS == 256
    assert request.sampling == Sampling() and request.sampling.greedy
    assert request.method == "auto"
    assert request.options == methods()["auto"].make_options({})
    # the keyword form's defaults are the same values
    assert GenerationRequest.of("hi") == request


def test_the_keyword_names_are_the_ones_drafter_options_may_not_take():
    """Every named keyword of the keyword forms is reserved (declared from their signatures, no
    list by hand), and registering a method whose options take one is refused, naming the form."""
    keywords = set(inspect.signature(GenerationRequest.of).parameters) - {"options"}
    wrapper = {name for f in (LM.generate, LM.stream, LM.generate_batch) for name in inspect.signature(f).parameters}
    wrapper -= {"self", "kwargs", "prompts"}
    reserved = reserved_option_names()
    assert set(reserved) == keywords | wrapper
    assert {"seed", "max_new_tokens", "progress", "max_running", "on_tokens", "prompt", "method"} <= set(reserved)
    assert reserved["progress"] == "LM.generate_batch" and reserved["seed"] == "GenerationRequest.of"

    @dataclasses.dataclass(frozen=True)
    class Clashing:
        max_running: int = 1

    with pytest.raises(TriedecError, match=r"\['max_running'\] are generation arguments of LM.generate_batch"):
        register("clashing-max-running", Clashing, "test")(BaseDrafter)
    assert "clashing-max-running" not in methods()


def test_which_loop_runs_a_method_is_declared_where_it_registers_not_read_from_its_name(monkeypatch):
    from dataclasses import dataclass

    from helpers import fake_cost, fake_profile, tiny_info

    from triedec.drafters import registry
    from triedec.engine.beam import BeamSearchDecoder
    from triedec.engine.methods import SpeculativeDecoder, method

    info = tiny_info(cost=fake_cost(), profile=fake_profile())
    for name, found in methods().items():
        decoder = found.build(found.make_options({}), info)
        assert found.equals == ("beam-search" if found.spec.own_loop else "greedy")
        assert isinstance(decoder, BeamSearchDecoder if found.spec.own_loop else SpeculativeDecoder), name
    assert [name for name, found in methods().items() if found.spec.own_loop] == ["beam"]

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # registrations below are undone
    with pytest.raises(TriedecError, match="'beam' is already registered"):
        triedec.register("beam", registry.NoOptions, "a drafter that wants beam's name")(triedec.BaseDrafter)

    @dataclass(frozen=True)
    class Options:
        width: int = 2

    class Own(BeamSearchDecoder):  # a third method with a loop of its own, found by what it declares
        pass

    triedec.register("own-loop-test", Options, "test", own_loop=True, equals="beam-search")(Own)
    found = method("own-loop-test")
    assert found.equals == "beam-search" and type(found.build(Options(), info)) is Own
    with pytest.raises(TriedecError, match="equals must be"):
        triedec.register("bad-contract", Options, "test", equals="sampled")(triedec.BaseDrafter)


def test_values_are_normalised_and_options_typed():
    request = GenerationRequest([1, 2, 3], "beam", {"num_beams": 3}, 5, "END", [7], ["doc", [4, 5]])
    assert request.prompt == (1, 2, 3)
    assert request.stop == ("END",)
    assert request.stop_token_ids == (7,)
    assert request.context == ("doc", (4, 5))
    assert request.options == BeamOptions(num_beams=3)
    # an options value is taken as it is; replacing a field validates again
    assert GenerationRequest([1], "beam", BeamOptions(num_beams=2)).options.num_beams == 2
    with pytest.raises(TriedecError, match="max_new_tokens"):
        dataclasses.replace(request, max_new_tokens=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": [1, -1]}, ">= 0"),
    ({"prompt": [{"role": "user"}]}, "content"),
    ({"prompt": "\ud800"}, "lone surrogate"),
    ({"prompt": 3}, "prompt must be"),
    ({"method": "nope"}, "unknown method"),
    ({"method": "pld", "options": {"bogus": 1}}, "bogus"),
    ({"method": "beam", "options": BeamOptions()}, None),
    ({"method": "pld", "options": BeamOptions()}, "must be a mapping"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"stop": [3]}, "stop strings must be strings"),
    ({"stop": [""]}, "non-empty"),
    ({"stop": 5}, "stop must be"),
    ({"stop_token_ids": [-2]}, "stop token id"),
    ({"stop_token_ids": "ab"}, "list of token ids"),
    ({"context": "one document"}, "wrap a single document"),
    ({"context": [[1, "x"]]}, "context document"),
    ({"chat": "yes"}, "chat must be"),
    ({"sampling": {"temperature": 1}}, "Sampling"),
])
def test_bad_values_are_refused_where_the_request_is_built(kwargs, message):
    values = {"prompt": "hi", **kwargs}
    if message is None:
        GenerationRequest(**values)
        return
    with pytest.raises(TriedecError, match=message):
        GenerationRequest(**values)


@settings(max_examples=60, deadline=None)
@given(st.integers(-3, 300), st.floats(-1, 3) | st.just(float("nan")), st.integers(-2, 5))
def test_a_request_either_validates_or_raises_triedec_error(max_new, temperature, top_k):
    try:
        request = GenerationRequest.of("hi", "ar", max_new_tokens=max_new, temperature=temperature, top_k=top_k)
    except TriedecError:
        assert max_new < 1 or not temperature >= 0 or top_k < 0
    else:
        assert request.max_new_tokens == max_new and request.sampling.top_k == top_k


def test_start_takes_only_a_request(tiny_lm):
    with pytest.raises(TriedecError, match="GenerationRequest"):
        tiny_lm.start("hello")  # type: ignore[arg-type]
    with pytest.raises(TriedecError, match="not both"):
        tiny_lm.generate(GenerationRequest("hello"), max_new_tokens=3)


def test_model_checks_run_at_start(tiny_lm):
    vocab = tiny_lm.adapter.vocab_size
    with pytest.raises(TriedecError, match="token ids must lie"):
        tiny_lm.start(GenerationRequest([vocab]))
    with pytest.raises(TriedecError, match="stop token id"):
        tiny_lm.start(GenerationRequest([1], stop_token_ids=[vocab]))
    with pytest.raises(TriedecError, match="context document"):
        tiny_lm.start(GenerationRequest([1], context=[[vocab]]))
    with pytest.raises(TriedecError, match="context of"):
        tiny_lm.start(GenerationRequest([1], max_new_tokens=tiny_lm.max_context))


@pytest.mark.parametrize("method", ["ar", "pld", "auto", "beam"])
def test_every_form_gives_the_same_tokens(tiny_lm, method):
    prompt = "the cat sat on the mat and the cat sat on the"
    request = GenerationRequest(prompt, method, max_new_tokens=12, stop_token_ids=(), sampling=Sampling())
    whole = tiny_lm.generate(request)
    keywords = tiny_lm.generate(prompt, method, max_new_tokens=12)
    streamed = [t for step in tiny_lm.stream(request) for t in step]
    batched = tiny_lm.generate_batch([request, request], progress=False)
    assert whole.token_ids == keywords.token_ids == streamed
    assert [r.token_ids for r in batched] == [whole.token_ids] * 2


def test_a_sampling_request_without_a_seed_gets_one_and_reruns_with_it(tiny_lm):
    request = GenerationRequest("the cat", "pld", max_new_tokens=8, sampling=Sampling(temperature=1.0))
    first = tiny_lm.generate(request)
    assert first.stats.seed is not None
    again = tiny_lm.generate(dataclasses.replace(request, sampling=Sampling(temperature=1.0, seed=first.stats.seed)))
    assert again.token_ids == first.token_ids


def test_tokenizing_from_many_threads_at_once_gives_each_call_its_own_setting():
    """transformers' fast tokenizers keep ``split_special_tokens`` as state of the shared tokenizer,
    set by each call; a server tokenizes on many threads at once. Chat prompts (special tokens kept)
    and completions (special tokens split) encoded side by side must get the ids each gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import tiny_tokenizer

    from triedec.api.prompts import Prompts

    prompts = Prompts(tiny_tokenizer(), 400)
    chat = [{"role": "user", "content": "Tell me about the sea."}]
    text = "<|im_start|>user says <|im_end|> twice <|im_start|>"
    alone = {"chat": prompts.encode(chat), "split": prompts.encode(text, split_special=True),
             "kept": prompts.encode(text, split_special=False)}
    assert alone["split"] != alone["kept"]  # the setting matters for this text

    def encode(i: int) -> bool:
        kind = ("chat", "split", "kept")[i % 3]
        for _ in range(60):
            got = prompts.encode(chat) if kind == "chat" else prompts.encode(text, split_special=kind == "split")
            if got != alone[kind]:
                return False
        return True

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert all(pool.map(encode, range(24)))
