"""Trie beam search (``beam``) vs transformers' own beam search: same hypotheses (tokens) and
scores (within 1e-4), on tiny random models (Llama; Gemma3-like with sliding windows; sdpa and
eager) across many prompts and settings, and on the embedded default model."""

from __future__ import annotations

import pytest
import torch
from helpers import EOS, PROMPTS, TINY_VOCAB, drain, hf_beam, hf_greedy, tiny_gemma3, tiny_llama

from triedec.core.errors import TriedecError
from triedec.engine.batch import StopRule
from triedec.engine.beam import BeamOptions, BeamScorer, beam_search
from triedec.engine.methods import method
from triedec.model.adapter import ModelAdapter


def run_beam(model, prompt, options: BeamOptions, max_new_tokens: int, eos) -> tuple[list[list[int]], object]:
    """triedec's beam search; also checks that the streamed chunks add up to the best hypothesis."""
    eos_ids = frozenset([eos] if isinstance(eos, int) else eos)
    streamed, result = drain(beam_search(ModelAdapter(model), prompt, options, StopRule(max_new_tokens, eos_ids)))
    assert streamed == list(result.sequences[0].token_ids)
    return result


def assert_same(ours, theirs) -> None:
    assert [list(h.token_ids) for h in ours.sequences] == [t for t, _ in theirs]
    for h, (_, score) in zip(ours.sequences, theirs, strict=True):
        assert h.score == pytest.approx(score, abs=1e-4)


def tiny_prompts(seed: int, count: int, low: int = 3, high: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def frequent_eos(model, prompt: list[int]) -> int:
    """An EOS that beams will actually meet: the 4th token greedy decoding produces."""
    return hf_greedy(model, prompt, 4, eos=None)[-1]


MODELS = {
    "llama-sdpa": lambda: tiny_llama(seed=1),
    "llama-eager": lambda: tiny_llama(seed=2, attn="eager"),
    "gemma3-sdpa": lambda: tiny_gemma3(seed=3),
    "gemma3-eager": lambda: tiny_gemma3(seed=4, attn="eager"),
}
SETTINGS = [  # (num_beams, length_penalty, early_stopping, num_return_sequences)
    (2, 1.0, False, 1), (3, 1.0, True, 2), (4, 0.0, "never", 4), (4, 2.0, False, 2), (8, 1.0, False, 3),
    (8, -0.5, True, 1), (5, 1.0, "never", 5), (15, 1.0, False, 2),
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "b{}-lp{}-es{}-n{}".format(*s))
def test_tiny_models_equal_transformers_beam_search(name, setting):
    b, lp, es, n = setting
    model = MODELS[name]()
    options = BeamOptions(num_beams=b, length_penalty=lp, early_stopping=es, num_return_sequences=n)
    for i, prompt in enumerate(tiny_prompts(seed=10 * SETTINGS.index(setting) + list(MODELS).index(name), count=4)):
        eos = frequent_eos(model, prompt) if i % 2 else EOS
        max_new = 12 + 4 * i
        assert_same(run_beam(model, prompt, options, max_new, eos), hf_beam(model, prompt, options, max_new, eos))


def test_several_stop_tokens_widen_the_candidates_like_transformers():
    model = tiny_llama(seed=5)
    options = BeamOptions(num_beams=4, num_return_sequences=4)
    for prompt in tiny_prompts(seed=6, count=4):
        greedy = hf_greedy(model, prompt, 6, eos=None)
        eos = sorted({greedy[2], greedy[-1], EOS})
        assert_same(run_beam(model, prompt, options, 16, eos), hf_beam(model, prompt, options, 16, eos))


@pytest.mark.parametrize("name", ["llama-sdpa", "gemma3-sdpa"])
def test_one_beam_is_greedy(name):
    model = MODELS[name]()
    for prompt in tiny_prompts(seed=7, count=6):
        ours = run_beam(model, prompt, BeamOptions(num_beams=1), 20, EOS)
        assert list(ours.sequences[0].token_ids) == hf_greedy(model, prompt, 20)


@pytest.mark.parametrize("name", ["llama-sdpa", "gemma3-eager"])
def test_garbage_collection_never_changes_the_output(name):
    """Compacting every step, every 15 steps, never (only when full, which also grows the cache)."""
    model = MODELS[name]()
    for prompt in tiny_prompts(seed=8, count=3):
        results = {g: run_beam(model, prompt, BeamOptions(num_beams=6, num_return_sequences=3, gc_every=g), 60,
                               frequent_eos(model, prompt)) for g in (1, 15, 0)}
        tokens = {g: [h.token_ids for h in r.sequences] for g, r in results.items()}
        scores = {g: [h.score for h in r.sequences] for g, r in results.items()}
        assert tokens[1] == tokens[15] == tokens[0]
        assert scores[1] == pytest.approx(scores[0], abs=1e-5) and scores[15] == pytest.approx(scores[0], abs=1e-5)
        every = results[1].stats
        assert every.gc_runs > 0 and every.peak_kv_tokens <= results[0].stats.peak_kv_tokens
        assert every.peak_kv_tokens < every.hf_peak_kv_tokens


def test_kv_is_shared_prompt_once():
    model = tiny_llama(seed=9)
    prompt = list(range(3, 43))
    result = run_beam(model, prompt, BeamOptions(num_beams=8, gc_every=1), 10, EOS)
    s = result.stats
    # the prompt is held once; after compaction at most b paths of at most `steps` tokens remain
    assert s.peak_kv_tokens <= len(prompt) + 8 * s.steps + 8
    assert s.hf_peak_kv_tokens == 8 * (len(prompt) + s.steps)
    assert s.computed_tokens == 8 * s.steps


# ---- the pure scorer ---------------------------------------------------------------------------


def test_scorer_first_step_takes_candidates_from_one_beam_only():
    scorer = BeamScorer(BeamOptions(num_beams=3), prompt_len=5, max_new_tokens=10, eos_token_ids=frozenset({0}))
    log_probs = torch.log_softmax(torch.tensor([[0.0, 3.0, 2.0, 1.0, 0.5, -1.0]]), dim=-1).expand(3, -1)
    parents, tokens = scorer.step(log_probs)
    assert parents == [0, 0, 0] and tokens == [1, 2, 3]
    assert scorer.stable_prefix() == () and not scorer.done


def test_scorer_finishes_on_eos_and_at_max_length():
    scorer = BeamScorer(BeamOptions(num_beams=2, num_return_sequences=2), 4, 2, frozenset({0}))
    first = torch.log_softmax(torch.tensor([5.0, 1.0, 0.0, -1.0]), dim=-1)
    scorer.step(first.expand(2, -1))  # EOS (token 0) is the best: a finished hypothesis of length 1
    assert scorer.finished[0] == (0,) and bool(scorer.is_finished[0, 0])
    assert scorer.running == [(1,), (2,)]
    scorer.step(torch.log_softmax(torch.zeros(2, 4), dim=-1))  # max length: everything finishes
    assert scorer.done
    hyps = scorer.results()
    assert hyps[0].token_ids == (0,) and hyps[0].score == pytest.approx(float(first[0]), abs=1e-6)
    assert len(hyps[1].token_ids) == 2


@pytest.mark.parametrize(
    "bad", [{"num_beams": 0}, {"num_beams": 2, "num_return_sequences": 3}, {"do_sample": True},
            {"early_stopping": "sometimes"}, {"early_stopping": 1}, {"gc_every": -1}, {"length_penalty": float("nan")},
            {"num_return_sequences": 0}, {"beams": 3}]
)
def test_bad_beam_options_are_refused(bad):
    with pytest.raises(TriedecError):
        method("beam").make_options(bad)


# ---- the embedded default model ----------------------------------------------------------------


def default_prompts():
    code = [
        "def is_prime(n: int) -> bool:\n",
        "import json\n\ndef load_config(path):\n    \"\"\"Read a JSON config file.\"\"\"\n",
    ]
    return [*PROMPTS, *code]


BEAM_PROMPTS = (0, 3, 5, 6, 9, 17, 14, 12, 18, 20, 21, 22)
"""12 of the 24 prompts (each kind: chat, several turns, the article, translation, code, the long
context, raw text, token ids), to keep the suite inside its time; the long context (~1,000
tokens) gets 2 beams, not 8 (transformers' own 8-beam search of it took ~40 s)."""


@pytest.mark.default_model
@pytest.mark.parametrize("k", range(len(BEAM_PROMPTS)))
def test_default_model_equals_transformers_beam_search(default_lm, k):
    """12 prompts (chat, code, raw text, token ids), b cycling through 1, 2, 4, 8."""
    prompt = default_prompts()[BEAM_PROMPTS[k]]
    ids = default_lm.encode(prompt)
    b = (1, 2, 4, 8)[k % 4]
    n = min(b, 2)
    out = default_lm.generate(ids, "beam", max_new_tokens=24, num_beams=b, num_return_sequences=n)
    if b == 1:  # transformers runs greedy decoding for num_beams=1
        with torch.inference_mode():
            greedy = default_lm.reference_model().generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                               attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out.token_ids == greedy[0, len(ids):].tolist()
        return
    theirs = hf_beam(default_lm.reference_model(), ids, BeamOptions(num_beams=b, num_return_sequences=n), 24,
                     sorted(default_lm.eos_token_ids))
    assert [list(h.token_ids) for h in out.sequences] == [t for t, _ in theirs]
    assert out.token_ids == theirs[0][0]
    for h, (_, score) in zip(out.sequences, theirs, strict=True):
        assert h.score == pytest.approx(score, abs=1e-4)
    assert out.stats.peak_kv_tokens < out.stats.hf_peak_kv_tokens


@pytest.mark.default_model
def test_lm_refuses_bad_beam_requests(default_lm):
    with pytest.raises(TriedecError, match="num_return_sequences"):
        default_lm.generate("Hi", "beam", num_beams=2, num_return_sequences=3)
    with pytest.raises(TriedecError, match="unknown option"):
        default_lm.generate("Hi", "beam", num_beams=2, do_sample=True)
    with pytest.raises(TriedecError, match="context documents"):
        default_lm.generate("Hi", "beam", num_beams=2, context=["a document"])
    with pytest.raises(TriedecError, match="stop strings"):
        default_lm.generate("Hi", "beam", num_beams=2, stop="\n")
    with pytest.raises(TriedecError, match="unknown option"):
        default_lm.generate("Hi", "beam", num_beams=2, nodes=3)
    with pytest.raises(TriedecError, match=r"unknown method.*beam"):
        default_lm.generate("Hi", "beams")
    with pytest.raises(TriedecError, match="empty"):
        default_lm.generate("", "beam")

