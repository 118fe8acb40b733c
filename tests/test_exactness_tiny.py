"""Differential exactness on tiny random-weight models: every method, and an adversarial oracle
drafter, must reproduce transformers' greedy output token for token."""

from __future__ import annotations

import threading

import pytest
from helpers import (
    EOS,
    MODELS,
    OracleDrafter,
    alone,
    fake_cost,
    fake_profile,
    hf_greedy,
    run,
    tiny_gemma3,
    tiny_info,
    tiny_llama,
    together,
)
from helpers import random_prompts as prompts

from triedec.core.costmodel import CostModel
from triedec.core.tree import TokenTree
from triedec.drafters import method_spec
from triedec.engine.methods import method
from triedec.engine.request import StopRule
from triedec.model.adapter import ModelAdapter


def build(name: str, options: dict, info):
    spec = method_spec(name)
    return spec.factory(spec.make_options(options), info)


@pytest.mark.parametrize("name", MODELS)
def test_registered_methods_equal_transformers_greedy(name):
    model = MODELS[name]()
    info = tiny_info(cost=fake_cost())
    pld_variants = [  # min_expected=0: always draft when there is a match, to exercise verification
        {},
        {"min_expected": 0.0},
        {"max_ngram": 1, "min_ngram": 1, "num_tokens": 3, "num_matches": 5, "min_expected": 0.0},
        {"min_ngram": 1, "num_tokens": 20, "num_matches": 1, "min_expected": 0.0},
    ]
    for i, prompt in enumerate(prompts(seed=list(MODELS).index(name) + 100, count=12)):
        new = [24, 40][i % 2]
        truth = hf_greedy(model, prompt, new)
        ar, stats = run(model, build("ar", {}, info), prompt, new, cost=info.cost)
        assert ar == truth, f"ar differs on prompt {i}"
        assert stats.steps == len(truth) - 1 and stats.computed_tokens == stats.steps
        pld, _ = run(model, build("pld", pld_variants[i % len(pld_variants)], info), prompt, new, cost=info.cost)
        assert pld == truth, f"pld differs on prompt {i}"


@pytest.mark.parametrize("name", ["llama-sdpa", "gemma3-sdpa", "gemma3-eager"])
def test_adversarial_trees_equal_transformers_greedy(name):
    model = MODELS[name]()
    for i, prompt in enumerate(prompts(seed=7, count=15)):
        new = 30
        truth = hf_greedy(model, prompt, new, eos=-1)  # no EOS: long outputs
        got, stats = run(model, OracleDrafter(truth, len(prompt), seed=i), prompt, new, eos=-1)
        assert got == truth, f"prompt {i}"
        assert stats.stop_reason == "length"


def test_gemma3_context_longer_than_window_with_long_accepts():
    """Window 4, prompts of 30+ tokens, drafts accepted 8 deep: masks must apply the window."""
    model = tiny_gemma3(window=4, seed=3)
    for i, prompt in enumerate(prompts(seed=11, count=8)):
        prompt = (prompt * 5)[:35]
        truth = hf_greedy(model, prompt, 40, eos=-1)
        got, _ = run(model, OracleDrafter(truth, len(prompt), seed=100 + i), prompt, 40, eos=-1)
        assert got == truth


def test_stop_inside_an_accepted_draft():
    """EOS and max_new_tokens falling inside a fully accepted draft: nothing past them is kept."""
    model = tiny_llama(seed=5)
    prompt = [5, 9, 13, 5, 9]
    truth = hf_greedy(model, prompt, 30, eos=-1)
    stop_tok = truth[6]
    first = truth.index(stop_tok)

    class FullOracle(OracleDrafter):
        def propose(self, context):
            done = len(context) - self.prompt_len
            return TokenTree.from_sequences(context[-1], [self.truth[done : done + 12]])

    got, stats = run(model, FullOracle(truth, len(prompt), 0), prompt, 30, eos=stop_tok)
    assert got == truth[: first + 1] == hf_greedy(model, prompt, 30, eos=stop_tok)
    assert stats.stop_reason == "eos"
    for limit in (1, 2, 5, 11):
        got, stats = run(model, FullOracle(truth, len(prompt), 0), prompt, limit, eos=-1)
        assert got == truth[:limit]
        assert stats.stop_reason == "length" and stats.new_tokens == limit


@pytest.mark.parametrize("name", MODELS)
def test_recycling_equals_transformers_greedy(name):
    """Tree sizes from 1 node to the paper's 80, the calibrated choice (nodes=0), k below the
    template's ranks, and prefill seeding; one drafter per setting, hot across prompts."""
    model = MODELS[name]()
    info = tiny_info(cost=fake_cost(), profile=fake_profile(nodes=12))
    settings = [{"nodes": 80}, {"nodes": 1}, {"nodes": 4}, {"nodes": 24}, {}, {"nodes": 80, "k": 3},
                {"nodes": 16, "seed_prefill": 0}, {"nodes": 16, "seed_prefill": 5}]
    drafters = [build("recycling", s, info) for s in settings]
    accepted = 0
    for i, prompt in enumerate(prompts(seed=list(MODELS).index(name) + 1, count=14)):
        truth = hf_greedy(model, prompt, 40)
        for setting, drafter in zip(settings, drafters, strict=True):
            got, stats = run(model, drafter, prompt, 40, cost=info.cost)
            assert got == truth, f"recycling {setting} differs on prompt {i}"
            accepted += sum(n - 1 for n in stats.accepted_per_step)
    assert accepted > 100  # drafts were accepted, so verification was exercised


@pytest.mark.parametrize("name", MODELS)
def test_ngram_trie_equals_transformers_greedy(name):
    """The paper's fixed num_draft, the device-sized default (flat and steep cost curves), short
    windows, Lp = 1, and the trie updated with the output; documents passed as context."""
    model = MODELS[name]()
    flat = fake_cost()
    steep = CostModel({t: 0.05 * t for t in (1, 2, 4, 8, 16, 32, 64, 81)})
    settings = [({"sized": False}, flat), ({}, flat), ({}, steep), ({"n": 4, "prefix": 2, "sized": False}, flat),
                ({"prefix": 1, "num_draft": 5, "sized": False}, flat), ({"update": True, "sized": False}, flat),
                ({"update": True}, flat)]
    drafters = [build("ngram-trie", s, tiny_info(cost=c)) for s, c in settings]
    accepted = 0
    for i, prompt in enumerate(prompts(seed=list(MODELS).index(name) + 20, count=12)):
        truth = hf_greedy(model, prompt, 40)
        documents = [truth[5:30]] if i % 3 == 0 else []  # a document that holds part of the answer
        for (setting, cost), drafter in zip(settings, drafters, strict=True):
            got, stats = run(model, drafter, prompt, 40, documents=documents, cost=cost)
            assert got == truth, f"ngram-trie {setting} differs on prompt {i}"
            accepted += sum(n - 1 for n in stats.accepted_per_step)
    assert accepted > 100


@pytest.mark.parametrize("name", MODELS)
def test_lookahead_equals_transformers_greedy(name):
    """Both verification modes, several windows and n-gram sizes, tight trie budgets."""
    model = MODELS[name]()
    info = tiny_info()
    settings = [{"verify": "independent"}, {}, {"window": 2, "ngram": 2}, {"window": 6, "ngram": 5, "guesses": 7},
                {"budget": 3, "depth": 1}, {"verify": "independent", "window": 3, "ngram": 4, "window_seed": 3}]
    computed = {"independent": 0, "trie": 0}
    accepted = 0
    for i, prompt in enumerate(prompts(seed=list(MODELS).index(name) + 40, count=10)):
        truth = hf_greedy(model, prompt, 40)
        for setting in settings:
            got, stats = run(model, build("lookahead", setting, info), prompt, 40)
            assert got == truth, f"lookahead {setting} differs on prompt {i}"
            accepted += sum(n - 1 for n in stats.accepted_per_step)
            own = stats.drafter  # the two branches, as proposed (the engine may cut the last tree)
            assert stats.computed_tokens <= stats.steps + own["lookahead_tokens"] + own["verify_tokens"]
            if setting in ({"verify": "independent"}, {}):
                computed[setting.get("verify", "trie")] += stats.computed_tokens
    assert accepted > 50
    assert computed["trie"] <= computed["independent"]


# ---- concurrency: per-request state never leaks between overlapping requests -------------------


def footprint(outcome) -> object:
    """What a request's own state decides besides its tokens: how many tokens each step accepted
    (drafts are a function of the request alone with these options), or beam search's ranking."""
    return getattr(outcome.stats, "accepted_per_step", None), outcome.sequences


# Options under which what a drafter proposes depends on its own request only (pld always drafts
# a match, ngram-trie sends num_draft nodes): shared learned state cannot change the steps.
REQUEST_ONLY = {"ar": {}, "pld": {"min_expected": 0.0}, "ngram-trie": {"sized": False}, "lookahead": {},
                "beam": {"num_beams": 3}}


@pytest.mark.parametrize("name", [*REQUEST_ONLY, "recycling"])
def test_requests_of_one_method_in_one_batch_equal_their_solo_outputs(name):
    """Two (and four) requests of the same method and options, decoded together by one engine
    batch on one shared decoder, each return exactly what they return alone: the same tokens and,
    where drafts depend only on the request, the same steps. (Recycling's matrix is shared by
    design: its drafts may differ, its tokens may not.)"""
    model = tiny_llama(seed=3)
    adapter = ModelAdapter(model)
    found = method(name)
    options = REQUEST_ONLY.get(name, {"nodes": 80})
    info = tiny_info(cost=fake_cost())
    rule = StopRule(30, frozenset([EOS]))
    batch = prompts(seed=77, count=4)
    solo = [alone(adapter, found.build(found.make_options(options), info), p, rule) for p in batch]
    if name not in ("ar", "beam"):  # drafts were accepted, so the step structure is worth comparing
        assert any(max(footprint(o)[0]) > 1 for _, o in solo)
    for group in (batch[:2], batch):
        decoder = found.build(found.make_options(options), info)
        runs = [decoder.start(p, rule) for p in group]
        outs, _ = together(adapter, runs, arrivals=[0, 3, 1, 5][: len(group)])
        assert [t for t, _ in outs] == [t for t, _ in solo[: len(group)]]
        if name in REQUEST_ONLY:
            assert [footprint(o) for _, o in outs] == [footprint(o) for _, o in solo[: len(group)]]


def test_threads_sharing_one_lm_get_their_solo_outputs(tiny_model_dir):
    """The API from several threads at once (what a server does): same answers as one by one."""
    import triedec

    lm = triedec.load(tiny_model_dir)
    texts = ["Hello there", "one two three one two", "Tell me a story", "def quicksort(arr):"]
    jobs = [(t, m) for t in texts for m in ("pld", "lookahead", "recycling")]
    options = {"pld": {"min_expected": 0.0}, "lookahead": {}, "recycling": {"nodes": 80}}
    solo = {job: lm.generate(job[0], job[1], max_new_tokens=16, **options[job[1]]).token_ids for job in jobs}
    got: dict = {}
    errors: list = []

    def work(job):
        try:
            got[job] = lm.generate(job[0], job[1], max_new_tokens=16, **options[job[1]]).token_ids
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == solo
