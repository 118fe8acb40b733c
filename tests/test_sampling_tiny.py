"""Sampling on tiny random-weight models: every method returns ``ar``'s sampled tokens for the same
seed, ``ar`` samples from transformers' ``generate(do_sample=True)`` distribution, the greedy rule
with a repetition penalty equals transformers' greedy one, and bad input fails cleanly."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import (
    EOS,
    alone,
    chi_square_same,
    drain,
    fake_cost,
    fake_profile,
    peaked,
    tiny_gemma3,
    tiny_info,
    tiny_llama,
    together,
)
from helpers import random_prompts as prompts

from triedec.core.accept import acceptance_rule
from triedec.core.errors import TriedecError
from triedec.core.sampling import Sampling
from triedec.core.tree import TokenTree
from triedec.drafters import BaseDrafter, method_spec
from triedec.engine.batch import speculative_decode
from triedec.engine.methods import method
from triedec.engine.request import StopRule
from triedec.model.adapter import ModelAdapter

SETTINGS = [
    Sampling(temperature=0.3), Sampling(temperature=0.7), Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_p=0.9), Sampling(temperature=1.0, top_k=5),
    Sampling(temperature=0.7, repetition_penalty=1.3), Sampling(temperature=1.0, min_p=0.1, top_p=0.95),
]
"""Temperatures 0.3 / 0.7 / 1.0, with and without top-p / top-k / min-p / repetition penalty."""

METHODS = [
    ("pld", {"min_expected": 0.0}), ("pld", {"min_ngram": 1, "num_tokens": 6, "num_matches": 4, "min_expected": 0.0}),
    ("ngram-trie", {"sized": False}), ("ngram-trie", {}), ("recycling", {"nodes": 80}), ("recycling", {}),
    ("lookahead", {}), ("lookahead", {"verify": "independent", "window": 3, "ngram": 4}),
]


def build(name: str, options: dict, info):
    spec = method_spec(name)
    return spec.factory(spec.make_options(options), info)


def sample(adapter, drafter, prompt, sampling, max_new_tokens=30, eos=-1, documents=(), cost=None):
    rule = StopRule(max_new_tokens, frozenset([eos]))
    return drain(speculative_decode(adapter, drafter, prompt, rule, documents, acceptance_rule(sampling), cost))


class SampledOracle(BaseDrafter):
    """Drafts the known sampled continuation, partly cut and mixed with wrong branches (siblings of
    the right tokens), so that every acceptance length occurs."""

    def __init__(self, truth: list[int], prompt_len: int, seed: int, vocab: int, full: bool = False) -> None:
        self.truth, self.prompt_len, self.vocab, self.full = truth, prompt_len, vocab, full
        self.rng = random.Random(seed)

    def propose(self, context):
        done = len(context) - self.prompt_len
        if self.full:
            return TokenTree.from_sequences(context[-1], [self.truth[done : done + 12]])
        right = self.truth[done : done + self.rng.randint(0, 8)]
        keep = self.rng.randint(0, len(right))
        seqs = [[*right[: self.rng.randint(0, keep)], self.rng.randrange(self.vocab)] for _ in range(3)]
        seqs.append(right[:keep])
        self.rng.shuffle(seqs)
        return TokenTree.from_sequences(context[-1], seqs)


@pytest.mark.parametrize("model_name", ["llama", "gemma3"])
def test_every_method_returns_ar_sampled_tokens(model_name):
    """Every drafter (and settings that draft a lot) x every sampling setting x several seeds:
    exactly ar's tokens with the same seed; drafts were accepted along the way."""
    model = peaked(tiny_llama(seed=3) if model_name == "llama" else tiny_gemma3(seed=4, window=5))
    adapter = ModelAdapter(model)
    info = tiny_info(cost=fake_cost(), profile=fake_profile(nodes=12))
    drafters = [(name, options, build(name, options, info)) for name, options in METHODS]
    accepted = 0
    for i, prompt in enumerate(prompts(seed=5, count=6)):
        for j, setting in enumerate(SETTINGS):
            seed = 1000 * i + j
            sampling = Sampling(**{**setting.as_dict(), "seed": seed})
            truth, _ = sample(adapter, build("ar", {}, info), prompt, sampling)
            assert truth == sample(adapter, build("ar", {}, info), prompt, sampling)[0], "a rerun differs"
            for name, options, drafter in drafters:
                got, stats = sample(adapter, drafter, prompt, sampling, cost=info.cost)
                assert got == truth, f"{name} {options} differs: prompt {i}, {sampling}"
                accepted += sum(n - 1 for n in stats.accepted_per_step)
                assert stats.seed == seed
            oracle, stats = sample(adapter, SampledOracle(truth, len(prompt), seed, model.config.vocab_size),
                                   prompt, sampling)
            assert oracle == truth
            accepted += sum(n - 1 for n in stats.accepted_per_step)
    assert accepted > 500


def test_seeds_change_the_output_and_the_same_seed_reproduces_it():
    model = peaked(tiny_llama(seed=3))
    adapter = ModelAdapter(model)
    info = tiny_info()
    prompt = [5, 9, 13, 5, 9]
    outs = {seed: sample(adapter, build("ar", {}, info), prompt, Sampling(temperature=1.0, seed=seed))[0]
            for seed in range(6)}
    assert len({tuple(v) for v in outs.values()}) > 3
    assert outs[2] == sample(adapter, build("pld", {"min_expected": 0.0}, info), prompt,
                             Sampling(temperature=1.0, seed=2))[0]


def test_stops_inside_accepted_sampled_drafts():
    """EOS (a stop token) and max_new_tokens falling inside a fully accepted sampled draft."""
    model = peaked(tiny_llama(seed=5))
    adapter = ModelAdapter(model)
    info = tiny_info()
    prompt = [5, 9, 13, 5, 9]
    sampling = Sampling(temperature=0.7, top_p=0.95, seed=42)
    truth, _ = sample(adapter, build("ar", {}, info), prompt, sampling, max_new_tokens=30)
    stop_tok = truth[6]
    cut = truth[: truth.index(stop_tok) + 1]
    vocab = model.config.vocab_size
    got, stats = sample(adapter, SampledOracle(truth, len(prompt), 0, vocab, full=True), prompt, sampling, 30,
                        eos=stop_tok)
    assert got == cut == sample(adapter, build("ar", {}, info), prompt, sampling, 30, eos=stop_tok)[0]
    assert stats.stop_reason == "eos" and max(stats.accepted_per_step) > 1
    for limit in (1, 2, 5, 11):
        got, stats = sample(adapter, SampledOracle(truth, len(prompt), 0, vocab, full=True), prompt, sampling, limit)
        assert got == truth[:limit]
        assert stats.stop_reason == "length"


def test_sampled_requests_in_one_batch_equal_their_solo_outputs():
    """Per-request state: four sampled requests with different seeds, decoded together by one
    engine batch on one shared decoder, return what they return alone."""
    model = peaked(tiny_llama(seed=3))
    adapter = ModelAdapter(model)
    found = method("pld")
    decoder = found.build(found.make_options({"min_expected": 0.0}), tiny_info())
    rule = StopRule(25, frozenset([EOS]))
    batch = prompts(seed=77, count=4)
    settings = [Sampling(temperature=0.8, seed=s) for s in range(4)]
    solo = [alone(adapter, decoder, p, rule, (), s)[0] for p, s in zip(batch, settings, strict=True)]
    runs = [decoder.start(p, rule, (), s) for p, s in zip(batch, settings, strict=True)]
    outs, _ = together(adapter, runs, arrivals=[0, 2, 2, 7])
    assert [t for t, _ in outs] == solo


# ---- distribution: triedec's sampled ar vs transformers' generate(do_sample=True) -------------

DISTRIBUTION_SETTINGS = [
    Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=8), Sampling(temperature=0.9, top_p=0.8),
    Sampling(temperature=1.0, min_p=0.1, repetition_penalty=1.3),
]


def hf_samples(model, prompt: list[int], s: Sampling, n: int, tokens: int) -> list[tuple[int, ...]]:
    """``n`` independent samples of the first ``tokens`` new tokens (up to and including EOS) from
    transformers' own sampling (one batched call, torch's RNG seeded: deterministic)."""
    torch.manual_seed(1234)
    extra = {"top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p or None, "repetition_penalty": s.repetition_penalty}
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt] * n), attention_mask=torch.ones(n, len(prompt), dtype=torch.long),
                             do_sample=True, temperature=s.temperature, max_new_tokens=tokens, pad_token_id=0,
                             eos_token_id=EOS, **extra)
    rows = [row[len(prompt):] for row in out.tolist()]
    return [tuple(row[: row.index(EOS) + 1] if EOS in row else row) for row in rows]


@pytest.mark.parametrize("index", range(len(DISTRIBUTION_SETTINGS)))
def test_sampled_ar_has_transformers_distribution(index):
    """The first 3 tokens (up to EOS) over 2,000 fixed seeds against 2,000 of transformers' samples:
    a chi-square test per setting (deterministic: fixed seeds on both sides). The same test rejects
    a temperature off by 0.3, so it has the power to see a wrong distribution."""
    setting = DISTRIBUTION_SETTINGS[index]
    model = peaked(tiny_llama(seed=11), scale=12.0)
    adapter = ModelAdapter(model)
    drafter = build("ar", {}, tiny_info())
    prompt = [5, 9, 13, 5, 9, 21]
    ours = [tuple(sample(adapter, drafter, prompt, Sampling(**{**setting.as_dict(), "seed": seed}), 3, EOS)[0])
            for seed in range(2000)]
    stat, p = chi_square_same(ours, hf_samples(model, prompt, setting, 2000, 3))
    assert p > 0.001, f"{setting}: chi-square {stat:.1f}, p = {p:.2g}"
    off = Sampling(**{**setting.as_dict(), "temperature": setting.temperature + 0.3})
    assert chi_square_same(ours, hf_samples(model, prompt, off, 2000, 3))[1] < 0.001


# ---- greedy with a repetition penalty ----------------------------------------------------------


def test_greedy_with_repetition_penalty_equals_transformers():
    model = peaked(tiny_llama(seed=7), scale=5.0)
    adapter = ModelAdapter(model)
    info = tiny_info(cost=fake_cost())
    for i, prompt in enumerate(prompts(seed=9, count=6)):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, repetition_penalty=1.4,
                                 eos_token_id=EOS, pad_token_id=0, attention_mask=torch.ones(1, len(prompt),
                                                                                             dtype=torch.long))
        truth = out[0, len(prompt):].tolist()
        for name, options in [("ar", {}), *METHODS[:5]]:
            got, _ = sample(adapter, build(name, options, info), prompt, Sampling(repetition_penalty=1.4), 30, EOS)
            assert got == truth, f"{name} {options}, prompt {i}"


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.2}, {"top_k": -3}, {"min_p": 2.0},
    {"repetition_penalty": 0.0}, {"seed": -5}, {"seed": "abc"}, {"temperature": "0.7"},
])
def test_bad_sampling_input_through_the_api_fails_before_anything_runs(tiny_model_dir, bad):
    import triedec

    lm = triedec.load(tiny_model_dir)
    seen = []
    with pytest.raises(TriedecError, match=next(iter(bad))):
        lm.generate("Hello there", "pld", max_new_tokens=8, on_tokens=seen.append, **bad)
    assert seen == []


def test_beam_refuses_sampling_and_the_api_reports_the_seed(tiny_model_dir):
    import triedec

    lm = triedec.load(tiny_model_dir)
    with pytest.raises(TriedecError, match="beam search does not sample"):
        lm.generate("Hello there", "beam", max_new_tokens=8, temperature=0.7)
    with pytest.raises(TriedecError, match="beam search"):
        lm.generate("Hello there", "beam", max_new_tokens=8, repetition_penalty=1.2)
    assert lm.generate("Hello there", "beam", max_new_tokens=4, seed=3).token_ids  # a seed alone is harmless
    first = lm.generate("Tell me a story", "pld", max_new_tokens=12, temperature=0.9)
    assert isinstance(first.stats.seed, int)
    again = lm.generate("Tell me a story", "ngram-trie", max_new_tokens=12, temperature=0.9, seed=first.stats.seed)
    assert again.token_ids == first.token_ids
    assert lm.generate("Tell me a story", "ar", max_new_tokens=12).stats.seed is None
    with pytest.raises(TriedecError, match="generation arguments"):
        from dataclasses import dataclass

        from triedec import register

        @dataclass(frozen=True)
        class Clashing:
            temperature: float = 1.0

        register("clashing-options", Clashing, "test")(BaseDrafter)
