"""Differential exactness on tiny random-weight models: every method, and an adversarial oracle
drafter, must reproduce transformers' greedy output token for token."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from conftest import EOS, TINY_VOCAB, hf_greedy, tiny_gemma3, tiny_llama

from triedec.adapter import ModelAdapter
from triedec.drafters import BaseDrafter, ModelInfo, method_spec
from triedec.engine import StopRule, speculative_decode
from triedec.tree import TokenTree

MODELS = {
    "llama-sdpa": lambda: tiny_llama(attn="sdpa"),
    "llama-eager": lambda: tiny_llama(attn="eager"),
    "gemma3-sdpa": lambda: tiny_gemma3(attn="sdpa"),
    "gemma3-eager": lambda: tiny_gemma3(attn="eager"),
}


class OracleDrafter(BaseDrafter):
    """Test-only drafter: proposes trees that mix the true greedy continuation (known in advance)
    with wrong branches, at random depths, so every acceptance length and branch layout occurs."""

    def __init__(self, truth: list[int], prompt_len: int, seed: int, vocab: int = TINY_VOCAB) -> None:
        self.truth, self.prompt_len, self.vocab = truth, prompt_len, vocab
        self.rng = random.Random(seed)

    def propose(self, context):
        done = len(context) - self.prompt_len
        right = self.truth[done : done + self.rng.randint(0, 8)]
        keep = self.rng.randint(0, len(right))
        seqs = []
        for _ in range(self.rng.randint(0, 4)):  # wrong branches off the correct path
            cut = self.rng.randint(0, keep)
            seqs.append(right[:cut] + [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 4))])
        seqs.append(right[:keep] if self.rng.random() < 0.5 else right)
        self.rng.shuffle(seqs)
        return TokenTree.from_sequences(context[-1], seqs)


def run(model, drafter, prompt, max_new_tokens, eos=EOS):
    gen = speculative_decode(ModelAdapter(model), drafter, prompt, StopRule(max_new_tokens, frozenset([eos])))
    tokens = []
    try:
        while True:
            tokens += next(gen)
    except StopIteration as stop:
        return tokens, stop.value


def prompts(seed: int, count: int, vocab: int = TINY_VOCAB):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(1, 40)
        # half the prompts repeat a motif so that prompt lookup finds matches
        if rng.random() < 0.5:
            motif = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
            out.append((motif * 12)[:n])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(n)])
    return out


@pytest.mark.parametrize("name", MODELS)
def test_registered_methods_equal_transformers_greedy(name):
    model = MODELS[name]()
    info = ModelInfo(TINY_VOCAB, torch.device("cpu"))
    pld_variants = [  # min_expected=0: always draft when there is a match, to exercise verification
        {},
        {"min_expected": 0.0},
        {"max_ngram": 1, "min_ngram": 1, "num_tokens": 3, "num_matches": 5, "min_expected": 0.0},
        {"min_ngram": 1, "num_tokens": 20, "num_matches": 1, "min_expected": 0.0},
    ]
    for i, prompt in enumerate(prompts(seed=list(MODELS).index(name) + 100, count=12)):
        new = [24, 40][i % 2]
        truth = hf_greedy(model, prompt, new)
        ar, stats = run(model, method_spec("ar").factory(method_spec("ar").make_options({}), info), prompt, new)
        assert ar == truth, f"ar differs on prompt {i}"
        assert stats.steps == len(truth) - 1 and stats.computed_tokens == stats.steps
        spec = method_spec("pld")
        opts = spec.make_options(pld_variants[i % len(pld_variants)])
        pld, _ = run(model, spec.factory(opts, info), prompt, new)
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
    from test_recycling import fake_calibration

    model = MODELS[name]()
    cal = fake_calibration(nodes=12)
    info = ModelInfo(TINY_VOCAB, torch.device("cpu"), "tiny", lambda: cal)
    spec = method_spec("recycling")
    settings = [{"nodes": 80}, {"nodes": 1}, {"nodes": 4}, {"nodes": 24}, {}, {"nodes": 80, "k": 3},
                {"nodes": 16, "seed_prefill": 0}, {"nodes": 16, "seed_prefill": 5}]
    drafters = [spec.factory(spec.make_options(s), info) for s in settings]
    accepted = 0
    for i, prompt in enumerate(prompts(seed=list(MODELS).index(name) + 1, count=14)):
        truth = hf_greedy(model, prompt, 40)
        for setting, drafter in zip(settings, drafters, strict=True):
            got, stats = run(model, drafter, prompt, 40)
            assert got == truth, f"recycling {setting} differs on prompt {i}"
            accepted += sum(n - 1 for n in stats.accepted_per_step)
    assert accepted > 100  # drafts were accepted, so verification was exercised


@pytest.mark.parametrize("name", MODELS)
def test_ngram_trie_equals_transformers_greedy(name):
    """The paper's fixed num_draft, the device-sized default (flat and steep cost curves), short
    windows, Lp = 1, and the trie updated with the output; documents passed as context."""
    from test_recycling import fake_calibration

    model = MODELS[name]()
    flat = fake_calibration()
    steep = replace(flat, forward_seconds={t: 0.05 * t for t in (1, 2, 4, 8, 16, 32, 64, 81)})
    spec = method_spec("ngram-trie")
    settings = [({"sized": False}, flat), ({}, flat), ({}, steep), ({"n": 4, "prefix": 2, "sized": False}, flat),
                ({"prefix": 1, "num_draft": 5, "sized": False}, flat), ({"update": True, "sized": False}, flat),
                ({"update": True}, flat)]
    drafters = [spec.factory(spec.make_options(s), ModelInfo(TINY_VOCAB, torch.device("cpu"), "tiny", lambda c=c: c))
                for s, c in settings]
    accepted = 0
    for i, prompt in enumerate(prompts(seed=list(MODELS).index(name) + 20, count=12)):
        truth = hf_greedy(model, prompt, 40)
        documents = [truth[5:30]] if i % 3 == 0 else []  # a document that holds part of the answer
        for (setting, _), drafter in zip(settings, drafters, strict=True):
            gen = speculative_decode(ModelAdapter(model), drafter, prompt, StopRule(40, frozenset([EOS])), documents)
            got = []
            try:
                while True:
                    got += next(gen)
            except StopIteration as stop:
                stats = stop.value
            assert got == truth, f"ngram-trie {setting} differs on prompt {i}"
            accepted += sum(n - 1 for n in stats.accepted_per_step)
    assert accepted > 100


@pytest.mark.parametrize("name", MODELS)
def test_lookahead_equals_transformers_greedy(name):
    """Both verification modes, several windows and n-gram sizes, tight trie budgets."""
    model = MODELS[name]()
    info = ModelInfo(TINY_VOCAB, torch.device("cpu"))
    spec = method_spec("lookahead")
    settings = [{"verify": "independent"}, {}, {"window": 2, "ngram": 2}, {"window": 6, "ngram": 5, "guesses": 7},
                {"budget": 3, "depth": 1}, {"verify": "independent", "window": 3, "ngram": 4, "seed": 3}]
    computed = {"independent": 0, "trie": 0}
    accepted = 0
    for i, prompt in enumerate(prompts(seed=list(MODELS).index(name) + 40, count=10)):
        truth = hf_greedy(model, prompt, 40)
        for setting in settings:
            drafter = spec.factory(spec.make_options(setting), info)
            got, stats = run(model, drafter, prompt, 40)
            assert got == truth, f"lookahead {setting} differs on prompt {i}"
            accepted += sum(n - 1 for n in stats.accepted_per_step)
            own = drafter.stats()  # the two branches, as proposed (the engine may cut the last tree)
            assert stats.computed_tokens <= stats.steps + own["lookahead_tokens"] + own["verify_tokens"]
            if setting in ({"verify": "independent"}, {}):
                computed[setting.get("verify", "trie")] += stats.computed_tokens
    assert accepted > 50
    assert computed["trie"] <= computed["independent"]
