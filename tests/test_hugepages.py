"""The packed weights in one mapping advised for huge pages (:mod:`triedec.model.hugepages`): the
same values, so the same logits bit for bit, every packed linear moved once, nothing moved where
there is too little or no support."""

from __future__ import annotations

import copy
import mmap
import random
import types

import pytest
import torch
from helpers import TINY_VOCAB
from transformers import LlamaConfig, LlamaForCausalLM

from triedec.core.tree import TokenTree
from triedec.model import hugepages
from triedec.model.adapter import ForwardItem, ModelAdapter
from triedec.model.hugepages import ALIGN, HUGE_PAGE, in_placed_memory, place_weights
from triedec.model.linears import LinearStandIn
from triedec.model.precision import Precision
from triedec.model.runner import RUNNER
from triedec.model.source import quantize

pytestmark = pytest.mark.skipif(not hugepages.huge_pages_supported(), reason="no MADV_HUGEPAGE on this platform")


def _llama(weights: str, hidden: int = 512, seed: int = 0) -> LlamaForCausalLM:
    """A Llama whose packed linears hold a few MiB (over one huge page), in ``weights``."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=2, bos_token_id=1, pad_token_id=0, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    quantize(model, Precision.of(None, weights))
    return model


def _packed(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    return [(m, name, t) for m in model.modules() if isinstance(m, LinearStandIn)
            for name, t in m._buffers.items() if t is not None]


def _rows(adapter: ModelAdapter, seed: int) -> list[torch.Tensor]:
    """A prompt chunk, then a random tree on it: every row's logits."""
    gen = random.Random(seed)
    cache = adapter.new_cache(64)
    prompt = [gen.randrange(TINY_VOCAB) for _ in range(gen.randint(3, 12))]
    n = len(prompt)
    out = list(adapter.forward_batch([ForwardItem(cache, torch.tensor(prompt), torch.arange(n),
                                                  torch.ones((n, n), dtype=torch.bool).tril())])[0])
    cache.commit(list(range(n)))
    nodes = gen.randint(1, 8)
    tree = TokenTree(tuple(gen.randrange(TINY_VOCAB) for _ in range(nodes)),
                     tuple(-1 if i == 0 else gen.randrange(i) for i in range(nodes)))
    tokens, positions, visible = torch.tensor(tree.tokens), tree.positions(n)[0], tree.ancestry
    out += list(adapter.forward_batch([ForwardItem(cache, tokens, positions, visible)])[0])
    return out


@pytest.mark.parametrize("weights", ["int4-a8", "int8", "int4"])
def test_placed_weights_give_the_same_bits_and_live_in_one_aligned_mapping(weights, monkeypatch):
    model = _llama(weights)
    unplaced = copy.deepcopy(model)
    with monkeypatch.context() as m:
        m.setattr(hugepages, "huge_pages_supported", lambda: False)
        plain = ModelAdapter(unplaced, "auto")
    assert not any(in_placed_memory(t) for _, _, t in _packed(unplaced))
    before = {(id(mod), name): (mod, t.clone()) for mod, name, t in _packed(model)}  # mod held: no id reused
    placed = ModelAdapter(model, "auto")  # places them (the runner's joined layers too)
    found = _packed(model)
    assert found and all(in_placed_memory(t) for _, _, t in found)
    assert all(t.data_ptr() % ALIGN == 0 for _, _, t in found)
    storages = {t.untyped_storage().data_ptr() for _, _, t in found}
    assert len(storages) == 1  # one mapping
    for mod, name, t in found:  # the parts a join left alone keep their values
        if (id(mod), name) in before:
            assert torch.equal(before[(id(mod), name)][1], t)
    for seed in range(4):
        for a, b in zip(_rows(plain, seed), _rows(placed, seed), strict=True):
            assert torch.equal(a, b)


def test_the_native_forward_runs_on_the_placed_weights():
    model = _llama("int4-a8")
    adapter = ModelAdapter(model, "auto", runner=RUNNER)
    assert adapter.native_forward
    joined = [m for m in model.modules() if isinstance(m, LinearStandIn) and m._buffers]
    assert len(joined) == 2 * 4 + 1  # per layer q/k/v joined, o, gate/up joined, down; the head
    assert all(in_placed_memory(t) for m in joined for t in m._buffers.values())


def test_placing_twice_moves_nothing_and_small_models_stay():
    model = _llama("int4-a8")
    assert place_weights(model) >= HUGE_PAGE
    pointers = [t.data_ptr() for _, _, t in _packed(model)]
    assert place_weights(model) == 0
    assert [t.data_ptr() for _, _, t in _packed(model)] == pointers
    small = _llama("int4-a8", hidden=64)  # under one huge page in all
    assert place_weights(small) == 0
    assert not any(in_placed_memory(t) for _, _, t in _packed(small))


def test_a_refused_advice_leaves_the_weights_where_they_are(monkeypatch):
    model = _llama("int4-a8")
    pointers = [t.data_ptr() for _, _, t in _packed(model)]

    class Refusing(mmap.mmap):  # as a kernel without transparent huge pages answers
        def madvise(self, *args: int) -> None:
            raise OSError(22, "Invalid argument")

    fake = types.SimpleNamespace(mmap=Refusing, **{k: getattr(mmap, k) for k in dir(mmap) if k.isupper()})
    monkeypatch.setattr(hugepages, "mmap", fake)
    assert place_weights(model) == 0
    assert [t.data_ptr() for _, _, t in _packed(model)] == pointers
