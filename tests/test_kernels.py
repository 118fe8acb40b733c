"""The fast verifier's kernels: pre-packed oneDNN linears and grouped-query sdpa under tree masks.
They must compute what the stock modules compute (up to fp32 rounding), keep every method equal to
stock transformers, apply only where they can, and be recorded where they ran."""

from __future__ import annotations

import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import EOS, MODELS, alone, fake_cost, hf_greedy, random_prompts, tiny_gemma3, tiny_info, tiny_llama
from torch import nn

import triedec
from triedec.core.errors import TriedecError
from triedec.engine.methods import method
from triedec.engine.request import StopRule
from triedec.model.adapter import ModelAdapter, cache_keyword, returned_cache
from triedec.model.dispatch import GQA_SDPA, _gqa_sdpa
from triedec.model.linears import (
    F32Linear,
    PackedLinear,
    SplitLinear,
    invariant_linear,
    order_sensitive_linear,
    pack_linears,
    packing_available,
    row_invariant,
    split_linears,
)

needs_onednn = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                                  reason="this torch build has no oneDNN linear ops")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_computes_what_nn_linear_computes(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    packed = PackedLinear(linear)
    for shape in ((1, 64), (5, 64), (2, 7, 64)):
        x = torch.randn(*shape)
        with torch.inference_mode():
            assert torch.allclose(packed(x), linear(x), atol=1e-5, rtol=1e-5)
            assert packed(x).shape == (*shape[:-1], 96)


@needs_onednn
def test_pack_linears_swaps_every_linear_and_copies_only_a_tied_head():
    model = tiny_llama(vocab=64)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them
    linears = sum(type(m) is nn.Linear for m in model.modules())
    added = pack_linears(model)
    assert sum(isinstance(m, F32Linear) for m in model.modules()) == linears  # float32: triedec's own kernel
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert added == model.model.embed_tokens.weight.numel() * 4  # the tied head is the only copy
    if packing_available(torch.device("cpu"), torch.bfloat16):  # bf16 keeps oneDNN's
        bf16 = tiny_llama(vocab=64).to(torch.bfloat16)
        pack_linears(bf16)
        assert not any(type(m) in (nn.Linear, F32Linear) for m in bf16.modules())
        assert any(isinstance(m, PackedLinear) for m in bf16.modules())


def test_grouped_query_sdpa_equals_stock_sdpa_under_a_tree_mask():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 6, 5, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g), torch.randn(
        1, 2, 12, 16, generator=g)
    mask = torch.zeros(1, 1, 5, 12)
    mask[..., 8:] = torch.finfo(torch.float32).min * torch.tril(torch.ones(5, 4), -1).flip(1)[None, None]
    ours, _ = _gqa_sdpa(module, q, k, v, mask, scaling=0.25)
    stock, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert torch.allclose(ours, stock, atol=1e-6)
    ours, _ = _gqa_sdpa(module, q, k, v, None, scaling=0.25)  # no mask: the stock function itself
    stock, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25)
    assert torch.equal(ours, stock)


FAST = {
    "llama-sdpa": lambda: tiny_llama(attn="sdpa"),
    "gemma3-sdpa": lambda: tiny_gemma3(attn="sdpa"),
    "gemma3-eager": lambda: tiny_gemma3(attn="eager"),
}


@pytest.mark.parametrize("name", FAST)
def test_every_method_on_fast_kernels_equals_stock_transformers(name):
    """The model runs on triedec's kernels; the ground truth is an unmodified copy."""
    stock, fast = FAST[name](), FAST[name]()  # same seed: the same weights
    adapter = ModelAdapter(fast, "auto")
    assert adapter.kernels != "plain"
    assert "fixed-order-attention" in adapter.kernels and adapter.exactness == "bit-exact"
    info = tiny_info(cost=fake_cost())
    rule = StopRule(30, frozenset([EOS]))
    settings = {"ar": {}, "pld": {"min_expected": 0.0}, "recycling": {"nodes": 80}, "ngram-trie": {"sized": False},
                "lookahead": {}}
    decoders = {n: method(n).build(method(n).make_options(o), info) for n, o in settings.items()}
    for i, prompt in enumerate(random_prompts(seed=list(FAST).index(name) + 200, count=8)):
        truth = hf_greedy(stock, prompt, 30)
        for n, decoder in decoders.items():
            tokens, _ = alone(adapter, decoder, prompt, rule)
            assert tokens == truth, f"{n} differs on prompt {i}"


def test_the_cache_goes_by_the_name_this_transformers_takes_without_a_deprecation():
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` (the old name warns,
    and goes in 5.40): the verifier passes the name the model's forward declares."""
    model = tiny_llama()
    assert cache_keyword(model) in {"cache", "past_key_values"}
    assert cache_keyword(model) in inspect.signature(model.forward).parameters
    adapter = ModelAdapter(model, "plain")
    decoder = method("recycling").build(method("recycling").make_options({"nodes": 80}), tiny_info(cost=fake_cost()))
    prompt = random_prompts(seed=5, count=1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        tokens, _ = alone(adapter, decoder, prompt, StopRule(12, frozenset([EOS])))
    assert tokens == hf_greedy(tiny_llama(), prompt, 12)
    kv = object()
    assert returned_cache(SimpleNamespace(cache=kv)) is kv
    assert returned_cache(SimpleNamespace(past_key_values=kv)) is kv
    assert returned_cache(SimpleNamespace(cache=None, past_key_values=kv)) is kv
    assert returned_cache(SimpleNamespace()) is None


def test_kernels_apply_only_where_they_can_and_are_recorded(tiny_model_dir):
    fast = triedec.load(tiny_model_dir)
    plain = triedec.load(tiny_model_dir, kernels="plain")
    assert plain.adapter.kernels == "plain" and plain.reference_model() is plain.model
    if packing_available(torch.device("cpu"), torch.float32):
        assert fast.adapter.kernels == "f32-linear+row-activation+fixed-order-attention+triedec-runner+native-forward"
        reference = fast.reference_model()
        assert reference is not fast.model and not any(isinstance(m, F32Linear) for m in reference.modules())
        assert reference.config._attn_implementation == "sdpa" and fast.model.config._attn_implementation == GQA_SDPA
    out = fast.generate("Hello there", "pld", max_new_tokens=8, min_expected=0.0)
    assert out.stats.kernels == fast.adapter.kernels and out.stats.exactness == "bit-exact"
    assert out.token_ids == plain.generate("Hello there", "pld", max_new_tokens=8, min_expected=0.0).token_ids
    bf16 = triedec.load(tiny_model_dir, dtype="bfloat16")  # packed bf16 linears where oneDNN has bf16 kernels
    packed_bf16 = packing_available(torch.device("cpu"), torch.bfloat16)
    assert ("onednn" in bf16.adapter.kernels) == packed_bf16 and "fixed-order-attention" in bf16.adapter.kernels
    assert any(isinstance(m, PackedLinear) for m in bf16.model.modules()) == packed_bf16
    assert bf16.adapter.exactness == "bit-exact"
    eager = triedec.load(tiny_model_dir, attn_implementation="eager")  # triedec's attention in its forwards too
    assert "gqa-sdpa" not in eager.adapter.kernels and "fixed-order-attention" in eager.adapter.kernels
    assert plain.adapter.exactness == "up to rounding"
    with pytest.raises(TriedecError, match="kernels"):
        triedec.load(tiny_model_dir, kernels="fast")
    mine = tiny_llama()
    lm = triedec.LM(mine, plain.tokenizer)  # a model you pass is left untouched by default
    assert lm.adapter.kernels == "plain" and not any(isinstance(m, PackedLinear) for m in mine.modules())
    fast_mine = triedec.LM(tiny_llama(), plain.tokenizer, kernels="auto")
    if fast_mine.adapter.kernels != "plain":
        with pytest.raises(TriedecError, match="stock copy"):
            fast_mine.reference_model()


def test_the_calibration_is_kept_per_kernel_choice(tiny_model_dir, tmp_path):
    from triedec.api.calibration import calibration_path

    fast = triedec.load(tiny_model_dir, cache_dir=tmp_path)
    plain = triedec.load(tiny_model_dir, cache_dir=tmp_path, kernels="plain")
    assert fast.adapter.model_id == plain.adapter.model_id
    if fast.adapter.kernels != "plain":
        assert calibration_path(tmp_path, fast.adapter) != calibration_path(tmp_path, plain.adapter)


@pytest.mark.parametrize("name", ["llama-sdpa", "gemma3-sdpa"])
def test_beam_search_on_fast_kernels_equals_stock_transformers(name):
    from helpers import hf_beam

    from triedec.engine.beam import BeamOptions

    stock, fast = MODELS[name](), MODELS[name]()
    adapter = ModelAdapter(fast, "auto")
    decoder = method("beam").build(method("beam").make_options({"num_beams": 4}), tiny_info())
    for prompt in random_prompts(seed=5, count=4):
        tokens, _ = alone(adapter, decoder, prompt, StopRule(20, frozenset([EOS])))
        assert tokens == hf_beam(stock, prompt, BeamOptions(num_beams=4), 20, EOS)[0][0]


class _OrderByBatch(nn.Module):
    """A stand-in kernel like oneDNN on an AVX-512 EPYC: one row is summed over its input features
    in one order, several rows (past 32 input features) in another, so a row's bits depend on its
    batch; at most 32 features it is row-invariant."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.shape[0] == 1 or w.shape[1] <= 32:
            return torch.stack([(row[None] * w).sum(-1) for row in x])
        return torch.stack([(row[None] * w).flip(-1).sum(-1) for row in x])


def test_a_linear_whose_rows_depend_on_the_batch_is_split_into_pieces_that_do_not():
    torch.manual_seed(0)
    linear = nn.Linear(96, 24)
    assert not row_invariant(_OrderByBatch(linear), 96, torch.float32)  # the probe can fail
    verdicts: dict = {}
    fixed = invariant_linear(linear, _OrderByBatch, verdicts)
    assert isinstance(fixed, SplitLinear) and fixed.bounds == [(0, 32), (32, 64), (64, 96)]
    assert verdicts == {(24, 96): 3} and row_invariant(fixed, 96, torch.float32)
    x = torch.randn(5, 96)
    assert torch.allclose(fixed(x), linear(x), atol=1e-5)  # the same layer up to rounding, bias included
    assert isinstance(invariant_linear(nn.Linear(96, 24), _OrderByBatch, verdicts), SplitLinear)  # by shape
    small = nn.Linear(32, 8)
    assert isinstance(invariant_linear(small, _OrderByBatch), _OrderByBatch)  # invariant whole: kept whole


def test_the_verdict_does_not_rest_on_the_layers_own_weights():
    """A layer's own weights can hide a kernel whose order depends on the batch (all zeros here:
    every order sums them to 0; in Gemma 3 270M bf16, one down_proj whose weights passed the
    probe, so all 18 of its shape stayed whole and 3 of 12 prompts differed from ``ar``). The
    verdict is taken on an order-sensitive copy of the shape, so the zero layer is split too, and
    so is the next layer of its shape."""
    zero = nn.Linear(96, 24, bias=False)
    with torch.no_grad():
        zero.weight.zero_()
    assert row_invariant(_OrderByBatch(zero), 96, torch.float32)  # its own weights hide the kernel's order
    verdicts: dict = {}
    assert isinstance(invariant_linear(zero, _OrderByBatch, verdicts), SplitLinear)
    torch.manual_seed(1)
    real = nn.Linear(96, 24)
    fixed = invariant_linear(real, _OrderByBatch, verdicts)
    assert isinstance(fixed, SplitLinear) and row_invariant(fixed, 96, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_order_sensitive_probe_exposes_any_change_of_summation_order(dtype):
    """On :func:`order_sensitive_linear`'s weights and constant rows, summing the features in
    another order (reversed, in two halves, in blocks of 8) changes outputs by far more than a
    last bit, for every seed: the probe does not depend on luck."""
    for seed in range(5):
        probe = order_sensitive_linear(nn.Linear(256, 32).to(dtype), seed=seed)
        w = probe.weight.float()
        x = torch.ones(256)

        def in_order(terms: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(terms.shape[0])
            for k in range(terms.shape[1]):
                out = out + terms[:, k]
            return out

        forward = in_order(w * x)
        for other in (in_order((w * x).flip(-1)), in_order(w[:, :128] * x[:128]) + in_order(w[:, 128:] * x[128:]),
                      in_order(torch.stack([in_order(w[:, i:i + 8]) for i in range(0, 256, 8)], dim=1))):
            assert (forward.to(dtype) != other.to(dtype)).float().mean() > 0.5


def test_split_pieces_sit_on_64_feature_boundaries_and_cover_the_input():
    for features, pieces, bounds in [(1536, 2, [(0, 768), (768, 1536)]), (1000, 3, [(0, 384), (384, 768), (768, 1000)]),
                                     (40, 3, [(0, 14), (14, 28), (28, 40)])]:
        split = SplitLinear(nn.Linear(features, 4, bias=False), pieces, lambda part: part)
        assert split.bounds == bounds and "pieces" in repr(split)


def test_split_linears_leaves_every_bf16_linear_row_invariant():
    """Whatever this CPU's bf16 ``F.linear`` does (on the AVX-512 EPYC it sums a row alone in
    another order than in some batches at 16-128 input features, which only the order-sensitive
    probe showed), each layer after :func:`split_linears` gives a row the same bits alone and in
    any batch, and computes the same layer up to rounding; a layer already invariant stays whole."""
    torch.manual_seed(0)
    shapes = [(16, 32), (64, 32), (576, 32), (1536, 64)]
    model = nn.Sequential(*[nn.Linear(k, n) for k, n in shapes]).to(torch.bfloat16)
    before = [layer.weight.float() @ torch.eye(layer.in_features) for layer in model]
    split = split_linears(model)
    assert split == sum(isinstance(layer, SplitLinear) for layer in model)
    for layer, (k, n), weight in zip(model, shapes, before, strict=True):
        assert row_invariant(layer, k, torch.bfloat16, seed=3)
        probe = order_sensitive_linear(nn.Linear(k, n).to(torch.bfloat16), seed=3)  # the same kernel, exposed
        pieces = len(layer.bounds) if isinstance(layer, SplitLinear) else 1
        assert row_invariant(probe if pieces == 1 else SplitLinear(probe, pieces, lambda part: part), k, torch.bfloat16)
        if pieces == 1:
            assert type(layer) is nn.Linear  # kept whole, untouched
        x = torch.randn(3, k).to(torch.bfloat16)
        assert torch.allclose(layer(x).float(), x.float() @ weight.T + layer.bias.float(), atol=0.1, rtol=0.05)


def test_a_change_to_triedecs_compiled_kernels_is_calibrated_again(tiny_model_dir, tmp_path):
    """A calibration measures the kernels as built: the key names the build (its sources and flags),
    so a rebuilt extension is measured again instead of sized by the old one's costs."""
    from triedec.api.calibration import calibration_path
    from triedec.model.native import build_id

    fast = triedec.load(tiny_model_dir, cache_dir=tmp_path)
    plain = triedec.load(tiny_model_dir, cache_dir=tmp_path, kernels="plain")
    assert fast.adapter.exact_attention and fast.adapter.native_build == build_id()
    assert plain.adapter.native_build is None and "build" not in calibration_path(tmp_path, plain.adapter).name
    before = calibration_path(tmp_path, fast.adapter)
    assert build_id() in before.name
    isa, _, digest = build_id().rpartition("-")
    fast.adapter.native_build = f"{isa}-{'0' * len(digest)}"  # the same ISA, other sources
    assert calibration_path(tmp_path, fast.adapter) != before
