"""``model.generate(..., custom_generate=triedec.custom_generate, method=...)`` against transformers
itself: the same tensor layout and tokens as greedy ``generate``, the streamer, eos_token_id, sampling
reproducible under ``torch.manual_seed``, and clear refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import EOS, hf_greedy, peaked, tiny_llama
from helpers import random_prompts as prompts
from transformers.generation.streamers import BaseStreamer

import triedec
from triedec import TriedecError


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def generate(model, prompt, **kwargs):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)


@pytest.mark.parametrize("method,options", [("pld", {"min_expected": 0.0}), ("ar", {}), ("lookahead", {}),
                                            ("ngram-trie", {"sized": False}), ("recycling", {"nodes": 80}),
                                            ("auto", {"sized": False}), (None, {})])
def test_same_tensor_and_tokens_as_greedy_generate(method, options):
    """None: the default method (auto, sized by the device's measured cost curve)."""
    model = tiny_llama(seed=3)
    chosen = {} if method is None else {"method": method, "method_options": options}
    for prompt in prompts(seed=21, count=6):
        want = generate(model, prompt, do_sample=False, max_new_tokens=24, eos_token_id=EOS)
        got = generate(model, prompt, do_sample=False, max_new_tokens=24, eos_token_id=EOS,
                       custom_generate=triedec.custom_generate, **chosen)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)
        assert got[0, len(prompt):].tolist() == hf_greedy(model, prompt, 24)


def test_streamer_eos_and_return_dict():
    model = tiny_llama(seed=3)
    prompt = [5, 9, 13, 5, 9, 13, 5]
    truth = hf_greedy(model, prompt, 30, eos=-1)
    stop = truth[7]
    streamer = Collect()
    out = generate(model, prompt, max_new_tokens=30, eos_token_id=stop, triedec_streamer=streamer,
                   custom_generate=triedec.custom_generate, method="pld", method_options={"min_expected": 0.0},
                   return_dict_in_generate=True)
    new = out.sequences[0, len(prompt):].tolist()
    assert new == truth[: truth.index(stop) + 1]
    assert streamer.puts[0] == prompt  # the prompt first, as generate does, then the new tokens
    assert [t for put in streamer.puts[1:] for t in put] == new and streamer.ended
    assert len(streamer.puts) > 2  # token batches arrived as they were accepted


def test_transformers_still_drops_streamer_for_a_callable_custom_generate():
    """The documented reason for ``triedec_streamer``: transformers puts the prompt into
    ``streamer=`` and does not pass the streamer on. If this fails, transformers now forwards it
    (triedec then feeds it too): update the docs."""
    model = tiny_llama(seed=3)
    streamer = Collect()
    generate(model, [5, 9, 13], max_new_tokens=6, eos_token_id=EOS, streamer=streamer,
             custom_generate=triedec.custom_generate, method="ar")
    assert streamer.puts == [[5, 9, 13]] and not streamer.ended


def test_sampling_is_reproducible_with_torch_manual_seed_and_equal_across_methods():
    model = peaked(tiny_llama(seed=3))
    prompt = [5, 9, 13, 5, 9]
    outs = []
    for method in ("ar", "pld", "lookahead"):
        torch.manual_seed(7)
        outs.append(generate(model, prompt, do_sample=True, temperature=0.8, top_k=0, top_p=0.9, max_new_tokens=20,
                             eos_token_id=EOS, custom_generate=triedec.custom_generate, method=method))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.manual_seed(8)
    other = generate(model, prompt, do_sample=True, temperature=0.8, top_k=0, max_new_tokens=20, eos_token_id=EOS,
                     custom_generate=triedec.custom_generate, method="ar")
    assert not torch.equal(other, outs[0])


def test_the_default_model_matches_greedy_generate(default_lm):
    model = default_lm.reference_model()
    ids = default_lm.encode([{"role": "user", "content": "Name three colours of the rainbow."}])
    want = generate(model, ids, do_sample=False, max_new_tokens=32)
    got = generate(model, ids, do_sample=False, max_new_tokens=32, custom_generate=triedec.custom_generate,
                   method="pld", method_options={"min_expected": 0.0})
    assert torch.equal(got, want)


@pytest.mark.parametrize("kwargs,message", [
    ({"input_ids": torch.tensor([[5, 6], [7, 8]])}, "one sequence"),
    ({"min_new_tokens": 5}, "does not support the logits processor"),
    ({"no_repeat_ngram_size": 2}, "NoRepeatNGram"),
    ({"method": "warp"}, "unknown method"),
    ({"method": "pld", "method_options": {"bogus": 1}}, "unknown option"),
    ({"method": "beam", "do_sample": True}, "beam search does not sample"),
    ({"method": "recycling"}, "hands custom_generate no tokenizer"),
])
def test_bad_calls_are_refused_clearly(kwargs, message):
    model = tiny_llama(seed=3)
    ids = kwargs.pop("input_ids", torch.tensor([[5, 9, 13]]))
    with pytest.raises(TriedecError, match=message), torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=8,
                       custom_generate=triedec.custom_generate, **kwargs)
