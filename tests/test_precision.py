"""Precision modes (:mod:`triedec.model.precision`): bfloat16, int8 and int4 weights.

* the quantizers: codes in range, each weight within half a step of its group's grid, a weight
  already on a bf16 grid recovered exactly, the layers computing ``x @ dequantized.T``;
* each kernel gives a row the same bits alone and inside calls of 2-64 rows (what keeps every
  method lossless in the mode);
* whole tiny models in each mode: the load-time self-test says bit-exact, and every method returns
  ``ar``'s tokens greedy and sampled; ``ar`` returns stock transformers' greedy tokens in the same
  mode, or departs from them first at a near-tie (a few bf16 steps apart in transformers' logits);
* loading: the mode's defaults and refusals, what is recorded, a calibration per mode, the flags;
* the default model: in int4 its GGUF file's own Q4_1 codes are kept, and every method returns
  ``ar``'s tokens.

(Tree-level bit-exactness in every mode is in ``test_invariance.py``, whose models include them.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    EOS,
    OracleDrafter,
    alone,
    drain,
    fake_cost,
    fake_profile,
    hf_beam,
    hf_greedy,
    peaked,
    random_prompts,
    tiny_info,
    tiny_llama,
    together,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import triedec
from triedec.core.errors import TriedecError
from triedec.core.sampling import Sampling
from triedec.engine.methods import method
from triedec.engine.request import Request, StopRule
from triedec.model.adapter import BIT_EXACT, ModelAdapter
from triedec.model.native import kernel_available, load_kernel
from triedec.model.precision import (
    GROUP_SIZE,
    Int4A8Linear,
    Int4Linear,
    Int8A8Linear,
    Int8Linear,
    Precision,
    dequantize_int4,
    layer_mix,
    on_4bit_grid,
    precision_of,
    quantize_int4,
    quantize_int8_groups,
    quantize_linears,
)
from triedec.model.source import ModelSource, quantize

# ---- the mode value -----------------------------------------------------------------------------


def test_the_mode_fills_its_dtype_and_refuses_what_no_kernel_runs():
    assert Precision.of() == Precision(torch.float32, "float")
    assert Precision.of("bf16") == Precision(torch.bfloat16, "float")
    assert Precision.of(weights="int4") == Precision(torch.bfloat16, "int4")
    assert Precision.of("bfloat16", "int8").name == "int8-bfloat16"
    assert Precision.of(weights="int4").name == f"int4g{GROUP_SIZE}-bfloat16"
    assert Precision.of(torch.float16).name == "float16"
    assert Precision("bf16", "int4") == Precision(torch.bfloat16, "int4")  # a dtype's name is resolved
    with pytest.raises(TriedecError, match="bfloat16 activations"):
        Precision.of("float32", "int4")
    with pytest.raises(TriedecError, match="weights must be one of"):
        Precision.of(weights="int3")
    with pytest.raises(TriedecError, match="unknown dtype"):
        Precision.of("float8")
    with pytest.raises(TriedecError, match="not supported"):
        Precision.of(torch.float64)
    with pytest.raises(TriedecError, match="CPU only"):
        Precision.of(weights="int8").check_device("cuda")
    Precision.of("bfloat16").check_device("cuda")  # bf16 weights run anywhere


# ---- the quantizers -----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.sampled_from([16, 32, 48]), groups=st.integers(1, 4),
       spread=st.floats(1e-3, 10.0))
def test_int4_codes_stay_within_half_a_step_of_each_weight(seed, rows, groups, spread):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, groups * GROUP_SIZE, generator=gen) * spread
    codes, scale, zero = quantize_int4(weight)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert scale.shape == zero.shape == (groups, rows) and scale.dtype == zero.dtype == torch.bfloat16
    error = (dequantize_int4(codes, scale, zero) - weight).abs()
    step = scale.float().T.repeat_interleave(GROUP_SIZE, dim=1)
    # half a step, plus the bf16 rounding of zero and scale (which can stretch the grid's ends)
    slack = 2**-8 * (zero.float().abs().T.repeat_interleave(GROUP_SIZE, dim=1) + 8 * step)
    assert bool((error <= step / 2 + slack + 1e-6).all())


def test_int4_recovers_a_weight_already_on_a_bf16_grid_exactly():
    """As a Q4_0/Q4_1 file's dequantized values: codes times a scale plus a minimum, every group
    spanning its full 0..15 range."""
    gen = torch.Generator().manual_seed(3)
    rows, groups = 32, 3
    codes = torch.randint(0, 16, (rows, groups * GROUP_SIZE), generator=gen, dtype=torch.int32)
    codes[:, ::GROUP_SIZE], codes[:, 1::GROUP_SIZE] = 0, 15
    scale = (torch.rand(groups, rows, generator=gen) * 0.1 + 0.01).to(torch.bfloat16)
    zero = (torch.randn(groups, rows, generator=gen) * 0.1).to(torch.bfloat16)
    weight = dequantize_int4(codes, scale, zero)
    got_codes, got_scale, got_zero = quantize_int4(weight)
    assert torch.equal(got_codes, codes)
    assert torch.equal(dequantize_int4(got_codes, got_scale, got_zero), weight)


@pytest.mark.parametrize("bias", [False, True])
def test_quantized_layers_compute_x_times_their_dequantized_weight(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    x = torch.randn(5, 3, 64).to(torch.bfloat16)
    int8, int4 = Int8Linear(linear), Int4Linear(linear)
    codes, scale, zero = quantize_int4(linear.weight)
    for layer, weight in ((int8, int8.dequantized()), (int4, dequantize_int4(codes, scale, zero))):
        want = x.float() @ weight.T + (linear.bias.detach().to(torch.bfloat16).float() if bias else 0)
        got = layer(x)
        assert got.shape == (5, 3, 48) and got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want, atol=0.05, rtol=0.02)
    # the weight each layer multiplies by is close to the float one
    assert (int8.dequantized() - linear.weight).abs().max() <= int8.scale.float().max()
    with pytest.raises(TriedecError, match="divisible by 16"):
        Int4Linear(nn.Linear(64, 40))


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_each_kernel_gives_a_row_the_same_bits_in_any_call(kind):
    """The linears each mode runs: bf16's is what the bf16 mode swaps in (oneDNN's pre-packed
    linear where oneDNN has bf16 kernels for this CPU, else torch's bf16 ``nn.Linear``, split
    where the probe finds its rows change with the batch: stock bf16 ``nn.Linear`` is not
    row-invariant at 64 rows on a Xeon whose oneDNN takes its AMX path), int8's and int4's
    torch's weight-only kernels."""
    from triedec.model.linears import PackedLinear, invariant_linear, packing_available

    torch.manual_seed(1)
    linear = nn.Linear(576, 192)
    bf16 = PackedLinear if packing_available(torch.device("cpu"), torch.bfloat16) else (lambda part: part)
    layer = {"bf16": lambda: invariant_linear(nn.Linear(576, 192).to(torch.bfloat16), bf16),
             "int8": lambda: Int8Linear(linear), "int4": lambda: Int4Linear(linear)}[kind]()
    x = torch.randn(64, 576).to(torch.bfloat16)
    with torch.inference_mode():
        alone_rows = [layer(x[i : i + 1]) for i in range(64)]
        for m in (2, 3, 4, 5, 8, 16, 17, 32, 64):
            out = layer(x[:m])
            assert all(torch.equal(out[i : i + 1], alone_rows[i]) for i in range(m)), f"{kind}: {m} rows"


def _q4k_like(rows: int, groups: int, seed: int, low: int = 2, high: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K file's dequantized values: per group of 32, ``d * q - m`` with codes in ``low..high``
    only (its quantizer need not use 0 or 15), some groups with no two neighbouring codes (even
    codes only); float32 arithmetic, as the file's loader computes them. Returns ``(weight, q)``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(low, high + 1, (rows, groups, GROUP_SIZE), generator=gen)
    q[::3] = q[::3] // 2 * 2
    d = torch.rand(rows, groups, 1, generator=gen) * 0.02 + 0.001
    m = torch.rand(rows, groups, 1, generator=gen) * 0.1
    return (d * q.float() - m).reshape(rows, groups * GROUP_SIZE), q.reshape(rows, groups * GROUP_SIZE)


def test_int4_keeps_a_4_bit_files_codes_whatever_range_they_use():
    """Q4_K blocks: the codes are the file's up to a shift per group, and each weight is the
    file's value within the bf16 rounding of the group's step and base, where ``(max - min) / 15``
    (the rule for values on no grid) would have moved weights by up to half a step."""
    weight, q = _q4k_like(32, 4, seed=1)
    codes, scale, zero = quantize_int4(weight)
    groups = codes.reshape(32, 4, GROUP_SIZE) - q.reshape(32, 4, GROUP_SIZE)
    odd_too = torch.ones(32, dtype=torch.bool)
    odd_too[::3] = False  # rows of even codes only lie on a grid twice as coarse too, and get it
    assert bool((groups[odd_too] == groups[odd_too][..., :1]).all())  # the file's codes, shifted per group
    step = scale.float().T.repeat_interleave(GROUP_SIZE, dim=1)
    base = zero.float().abs().T.repeat_interleave(GROUP_SIZE, dim=1)
    moved = (dequantize_int4(codes, scale, zero) - weight).abs()
    assert bool((moved <= 2**-8 * (base + 16 * step)).all())  # bf16's rounding of the base and the step only
    span = weight.reshape(32, 4, GROUP_SIZE)
    naive = ((span.amax(-1) - span.amin(-1)) / 15)[..., None]
    off_grid = ((span - span.amin(-1, keepdim=True)) / naive)
    assert float((off_grid - off_grid.round()).abs().max()) > 0.25  # the naive grid would not hold them


def test_no_grid_is_found_in_weights_on_none():
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(64, 8 * GROUP_SIZE, generator=gen)
    assert on_4bit_grid(normal) == 0.0 and on_4bit_grid(normal.bfloat16().float()) == 0.0
    six_bit = (torch.randint(0, 64, (64, 8 * GROUP_SIZE), generator=gen).float() * 0.01 - 0.3)  # Q6_K-like
    assert on_4bit_grid(six_bit) < 0.01
    assert on_4bit_grid(_q4k_like(64, 8, seed=2)[0]) == 1.0
    assert on_4bit_grid(torch.zeros(16, GROUP_SIZE)) == 0.0  # a constant group has no step


def _q8_0_like(rows: int, groups: int, seed: int, magnitude: float = 0.05) -> torch.Tensor:
    """A Q8_0 file's dequantized values, quantized as llama.cpp does: per group of 32, ``d = max |x|
    / 127`` stored in fp16, codes ``round(x / d)`` (against the unrounded ``d``), ``w = fp16(d) * q``
    in float32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups, GROUP_SIZE, generator=gen) * magnitude
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(x * (1 / d))
    return (d.half().float() * q).reshape(rows, groups * GROUP_SIZE)


def _q5_0_like(rows: int, groups: int, seed: int) -> torch.Tensor:
    """A Q5_0 file's dequantized values as llama.cpp makes them: ``d = max / -16`` (``max`` the value
    of largest magnitude, with its sign, so ``d`` takes either sign), codes ``min(31, trunc(x / d +
    16.5))``, ``w = fp16(d) * (q - 16)``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups, GROUP_SIZE, generator=gen) * 0.04
    at = x.abs().argmax(dim=-1, keepdim=True)
    d = x.gather(-1, at) / -16
    q = torch.trunc(x * (1 / d) + 16.5).clamp(max=31)
    return (d.half().float() * (q - 16)).reshape(rows, groups * GROUP_SIZE)


def test_int8_keeps_a_q8_0_or_q5_0_files_values_bit_for_bit():
    """The int8 layers of int4-a8 (:func:`quantize_int8_groups`): a Q8_0 or Q5_0 block, either sign
    of Q5_0's scale and a Q8_0 scale below fp16's normal range included, is kept exactly; a group on
    no such grid gets llama.cpp's Q8_0 scale and the nearest codes under it."""
    blocks = torch.cat([_q8_0_like(16, 3, seed=1), _q5_0_like(16, 3, seed=2),
                        _q8_0_like(16, 2, seed=3, magnitude=1e-3)], dim=1)
    codes, scale = quantize_int8_groups(blocks)
    assert scale.dtype == torch.float16 and codes.dtype == torch.int8
    assert (scale[:, 6:].float() < 2**-14).all()  # the tiny groups' scales are fp16 subnormals, kept
    kept = codes.float() * scale.float().repeat_interleave(GROUP_SIZE, dim=1)
    assert torch.equal(kept, blocks)
    assert codes[:, 3 * GROUP_SIZE : 6 * GROUP_SIZE].abs().amax() == 16  # Q5_0's codes, not spread to 127
    gen = torch.Generator().manual_seed(4)
    plain = torch.randn(32, 4 * GROUP_SIZE, generator=gen) * torch.logspace(-6, 0, 4).repeat_interleave(GROUP_SIZE)
    codes, scale = quantize_int8_groups(plain)
    llama_scale = (plain.reshape(32, 4, GROUP_SIZE).abs().amax(dim=-1) / 127).clamp_min(2**-14).half()
    assert torch.equal(scale, llama_scale)
    per_weight = scale.float().repeat_interleave(GROUP_SIZE, dim=1)
    assert torch.equal(codes.float(), (plain / per_weight).round().clamp(-127, 127))
    assert ((codes.float() * per_weight - plain).abs() <= per_weight / 2).all()
    with pytest.raises(TriedecError, match="finite"):
        quantize_int8_groups(torch.full((16, GROUP_SIZE), float("inf")))
    with pytest.raises(TriedecError, match="magnitude"):
        quantize_int8_groups(torch.full((16, GROUP_SIZE), 1e8))


def test_a_gguf_layer_stored_with_more_bits_goes_to_int8_not_int4():
    """A Q4_K_M file keeps some layers at 6 bits: from a GGUF, the int4 modes put those in int8
    (on 8-bit activations in int4-a8) and keep the 4-bit ones' codes; a file with no 4-bit layer,
    or weights not from a GGUF, are quantized as asked."""
    def file_like() -> nn.Module:
        model = tiny_llama(seed=6)
        with torch.no_grad():
            for i, layer in enumerate(model.modules()):
                if type(layer) is nn.Linear and layer is not model.lm_head:
                    rows, features = layer.weight.shape
                    layer.weight.copy_(_q4k_like(rows, features // GROUP_SIZE, seed=i)[0])
            down = model.model.layers[1].mlp.down_proj
            down.weight.copy_(torch.randint(0, 64, down.weight.shape).float() * 0.002 - 0.06)  # 6 bits
        return model

    for weights, int4_kind, int8_kind in (("int4", Int4Linear, Int8Linear), ("int4-a8", Int4A8Linear, Int8A8Linear)):
        model = file_like()
        done = quantize_linears(model, weights, head=model.lm_head, from_gguf=True)
        assert done.finer == 1 and done.layers == 2 * 7 + 1
        assert isinstance(model.model.layers[1].mlp.down_proj, int8_kind)
        assert isinstance(model.model.layers[0].mlp.down_proj, int4_kind)
        plain = file_like()
        assert quantize_linears(plain, weights, head=plain.lm_head).finer == 0  # not from a GGUF: as asked
        assert isinstance(plain.model.layers[1].mlp.down_proj, int4_kind)
    no_4bit = tiny_llama(seed=7)  # an F16 file, say: no layer on a 4-bit grid
    assert quantize_linears(no_4bit, "int4", head=no_4bit.lm_head, from_gguf=True).finer == 0
    assert isinstance(no_4bit.model.layers[1].mlp.down_proj, Int4Linear)


def test_quantize_linears_counts_what_it_keeps_and_leaves_a_tied_embedding():
    model = tiny_llama(seed=4)
    model.lm_head.weight = model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight.detach().clone()
    done = quantize_linears(model, "int4")
    assert done.layers == 2 * 7 + 1 and done.kept == 0
    assert isinstance(model.lm_head, Int4Linear) and torch.equal(model.model.embed_tokens.weight, embedding)
    again = tiny_llama(seed=4)
    quantize(again, Precision.of(weights="int4"))  # what load does: the LM head in int8
    assert isinstance(again.lm_head, Int8Linear) and isinstance(again.model.layers[0].mlp.up_proj, Int4Linear)
    assert precision_of(again) == Precision.of(weights="int4")
    odd = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 64))  # 40 rows; 40 input features
    assert quantize_linears(odd, "int4").kept == 2
    with pytest.raises(TriedecError, match="'int8', 'int4' or 'int4-a8'"):
        quantize_linears(model, "float")


# ---- whole models in each mode ------------------------------------------------------------------

MODES = {"bfloat16": Precision.of("bfloat16"), "int8": Precision.of(weights="int8"),
         "int4": Precision.of(weights="int4"), "int4-a8": Precision.of(weights="int4-a8")}


def _in_mode(model: nn.Module, precision: Precision) -> nn.Module:
    if precision.quantized:
        quantize(model, precision)
    else:
        model.to(precision.dtype)
    return model


SETTINGS = {"ar": {}, "pld": {"min_expected": 0.0}, "recycling": {"nodes": 40}, "ngram-trie": {"sized": False},
            "lookahead": {}, "auto": {}}


def _decoders():
    info = tiny_info(cost=fake_cost(), profile=fake_profile(nodes=12))
    return {n: method(n).build(method(n).make_options(o), info) for n, o in SETTINGS.items()}


def _agrees_up_to_a_near_tie(stock: nn.Module, prompt: list[int], ours: list[int], theirs: list[int]) -> bool:
    """Equal, or first different where stock's own logits for the two tokens are within a few
    bf16 steps of each other: its attention sums in another order than triedec's, and in bf16 that
    moves a logit by about a step (transformers is the reference up to rounding; ``ar`` is the
    bit-exact one)."""
    if ours == theirs:
        return True
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    with torch.inference_mode():
        logits = stock(torch.tensor([prompt + theirs[:at]])).logits[0, -1].float()
    step = 2.0 ** (torch.floor(torch.log2(logits.abs().max())) - 7)
    return bool((logits[theirs[at]] - logits[ours[at]]).abs() <= 4 * step)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_method_returns_ars_tokens_and_transformers_greedy_tokens_in_the_mode(mode):
    precision = MODES[mode]
    stock = _in_mode(peaked(tiny_llama(seed=8)), precision)
    fast = _in_mode(peaked(tiny_llama(seed=8)), precision)
    adapter = ModelAdapter(fast, "auto")
    assert adapter.precision == precision and adapter.exactness == BIT_EXACT, adapter.invariance.detail
    if precision.quantized:
        assert adapter.kernels.startswith(f"{precision.weights}-weights+")
    decoders = _decoders()
    rule = StopRule(24, frozenset([EOS]))
    shared, compared = 0, 0
    for i, prompt in enumerate(random_prompts(seed=31, count=6)):
        truth, _ = alone(adapter, decoders["ar"], prompt, rule)
        reference = hf_greedy(stock, prompt, 24)
        assert _agrees_up_to_a_near_tie(stock, prompt, truth, reference), f"ar vs transformers on prompt {i}"
        pairs = zip(truth, reference, strict=False)
        shared += next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(truth), len(reference)))
        compared += len(reference)
        for name, decoder in decoders.items():
            assert alone(adapter, decoder, prompt, rule)[0] == truth, f"{name} on prompt {i}"
        sampling = Sampling(temperature=1.0, seed=i)
        sampled, _ = alone(adapter, decoders["ar"], prompt, rule, (), sampling)
        for name, decoder in decoders.items():
            got, _ = alone(adapter, decoder, prompt, rule, (), sampling, cost=fake_cost())
            assert got == sampled, f"{name} sampled on prompt {i}"
    # the near-tie check is not vacuous: transformers' tokens up to the first difference make up
    # most of its output (measured 79-82% in every mode on an AVX-512 EPYC, where its bf16 attention
    # differs from the AVX2 one's: 2-4 of the 6 outputs equal whole there, 3+ on the AVX2 EPYC)
    assert shared >= 2 * compared // 3, f"only {shared} of {compared} tokens before the first difference"


@pytest.mark.parametrize("mode", list(MODES))
def test_stops_inside_accepted_drafts_cut_the_same_tokens_in_the_mode(mode):
    """In each mode, requests sharing forwards whose stop (a stop token, EOS or max_new_tokens)
    falls inside drafts that are accepted whole or in part: each returns ``ar``'s tokens in the same
    mode up to and including the stop, and nothing after it."""
    precision = MODES[mode]
    adapter = ModelAdapter(_in_mode(peaked(tiny_llama(seed=9)), precision), "auto")
    assert adapter.exactness == BIT_EXACT, adapter.invariance.detail
    ar = _decoders()["ar"]
    runs, want = [], []
    for i, prompt in enumerate(random_prompts(seed=17, count=6)):
        truth, _ = alone(adapter, ar, prompt, StopRule(30, frozenset([-1])))
        if i % 2 == 0:
            stop_token = truth[4 + i]
            rule = StopRule(30, frozenset([stop_token]))
            want.append((truth[: truth.index(stop_token) + 1], "eos"))
        else:
            limit = [1, 6, 11][i // 2]
            rule = StopRule(limit, frozenset([-1]))
            want.append((truth[:limit], "length"))
        runs.append(Request(OracleDrafter(truth, len(prompt), seed=i), prompt, rule))
    outs, _ = together(adapter, runs, cost=fake_cost(), arrivals=[0, 0, 1, 1, 2, 3])
    for i, ((tokens, outcome), (expected, reason)) in enumerate(zip(outs, want, strict=True)):
        assert tokens == expected and outcome.stats.stop_reason == reason, f"request {i}"


@pytest.mark.parametrize("mode", list(MODES))
def test_beam_search_returns_transformers_hypotheses_in_the_mode(mode):
    """Trie beam search against transformers' beam search on the same model in the same mode, on
    three tiny models x 8 prompts. transformers' attention sums in another order, which moves a
    bf16 log-prob by about a step, so the reference holds up to rounding: where a rank holds the same
    tokens on both sides its scores are within 0.04 (measured: 0.014 at most over the modes); the
    best hypothesis is the same on at least 3 prompts in 4 (measured 21-23 of 24) and every
    hypothesis on most (15-21 of 24). Where a rank differs, a near-tie went the other way at some
    step and the beams went on from different prefixes: no bound on its score. (Bit-exactness in the
    mode is ``ar``'s and the invariance tests'.)"""
    from triedec.engine.beam import BeamOptions, beam_search

    precision = MODES[mode]
    whole = best = total = 0
    for seed in (8, 9, 10):
        stock = _in_mode(peaked(tiny_llama(seed=seed)), precision)
        adapter = ModelAdapter(_in_mode(peaked(tiny_llama(seed=seed)), precision), "auto")
        for i, prompt in enumerate(random_prompts(seed=41, count=8)):
            options = BeamOptions(num_beams=[2, 3, 4, 6][i % 4], num_return_sequences=[1, 2, 2, 3][i % 4])
            _, result = drain(beam_search(adapter, prompt, options, StopRule(12, frozenset([EOS]))))
            theirs = hf_beam(stock, prompt, options, 12, EOS)
            ours = [(list(h.token_ids), h.score) for h in result.sequences]
            assert len(ours) == len(theirs) == options.num_return_sequences
            for (tokens, a), (their_tokens, b) in zip(ours, theirs, strict=True):
                if tokens == their_tokens:
                    assert a == pytest.approx(b, abs=0.04), f"model {seed}, prompt {i}"
            whole += [t for t, _ in ours] == [t for t, _ in theirs]
            best += ours[0][0] == theirs[0][0]
            total += 1
    assert best >= 0.75 * total and whole > total / 2


# ---- loading ------------------------------------------------------------------------------------


def test_the_calibration_key_follows_which_layers_are_int4_and_which_int8(tiny_model_dir, tmp_path):
    # a calibration measured before a change of which layers go to int8 must not be reused after it
    from triedec.api.calibration import calibration_path, device_key
    from triedec.model.linears import JoinedPart

    unjoined = triedec.load(tiny_model_dir, cache_dir=tmp_path, weights="int4-a8", kernels="plain").adapter.model
    int4 = sum(type(m) is Int4A8Linear for m in unjoined.modules())
    int8 = sum(type(m) is Int8A8Linear for m in unjoined.modules())
    lm = triedec.load(tiny_model_dir, cache_dir=tmp_path, weights="int4-a8")  # its runner joins q/k/v, gate/up
    model, before, mix = lm.adapter.model, calibration_path(tmp_path, lm.adapter), layer_mix(lm.adapter.model)
    assert any(isinstance(m, JoinedPart) for m in model.modules())
    assert int4 > 0 and mix == f"int4x{int4}-int8x0-int8g32x{int8}" == layer_mix(unjoined)
    assert mix in device_key(lm.adapter)
    parent, name, child = next((p, n, c) for p in model.modules() for n, c in p.named_children()
                               if type(c) is Int4A8Linear and not isinstance(p, JoinedPart))
    setattr(parent, name, Int8A8Linear(nn.Linear(child.in_features, child.out_features)))
    assert layer_mix(model) == f"int4x{int4 - 1}-int8x0-int8g32x{int8 + 1}"
    assert calibration_path(tmp_path, lm.adapter) != before
    plain = triedec.load(tiny_model_dir, cache_dir=tmp_path)
    assert "int4x" not in device_key(plain.adapter)  # float modes keep their keys


def test_load_in_each_mode_records_it_and_keeps_a_calibration_per_mode(tiny_model_dir, tmp_path):
    from triedec.api.calibration import calibration_path

    lms = {name: triedec.load(tiny_model_dir, cache_dir=tmp_path, **kwargs) for name, kwargs in
           {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"weights": "int8"},
            "int4": {"weights": "int4"}, "int4-a8": {"weights": "int4-a8"}}.items()}
    assert {n: lm.adapter.precision.name for n, lm in lms.items()} == {
        "float32": "float32", "bfloat16": "bfloat16", "int8": "int8-bfloat16", "int4": f"int4g{GROUP_SIZE}-bfloat16",
        "int4-a8": f"int4g{GROUP_SIZE}a8-bfloat16"}
    assert len({calibration_path(tmp_path, lm.adapter) for lm in lms.values()}) == 5
    assert len({lm.adapter.model_id for lm in lms.values()}) == 1  # learned state is shared across modes
    int4 = lms["int4"]
    assert all(lm.adapter.exactness == BIT_EXACT for lm in lms.values())
    reference = int4.reference_model()  # stock transformers, in the same mode
    assert reference is not int4.model and precision_of(reference) == int4.adapter.precision
    out = int4.generate("Hello there", "pld", max_new_tokens=8, min_expected=0.0)
    assert out.stats.kernels == int4.adapter.kernels
    assert out.token_ids == int4.generate("Hello there", "ar", max_new_tokens=8).token_ids
    with pytest.raises(TriedecError, match="bfloat16 activations"):
        triedec.load(tiny_model_dir, dtype="float32", weights="int4")
    with pytest.raises(TriedecError, match="weights must be one of"):
        triedec.load(tiny_model_dir, weights="nf4")


def test_the_model_flags_carry_the_mode_and_give_it_back(tiny_model_dir):
    from triedec.cli.flags import ModelSpec, build_parser

    parser = build_parser(["generate"])
    args = parser.parse_args(["generate", "hi", "--model", str(tiny_model_dir), "--weights", "int4"])
    spec = ModelSpec.from_args(args)
    assert spec.source.weights == "int4" and spec.source.dtype is None
    assert spec.source.precision == Precision(torch.bfloat16, "int4")
    again = ModelSpec.from_args(parser.parse_args(["generate", "hi", *spec.as_flags()]))
    assert again == spec
    spec.check()
    with pytest.raises(TriedecError, match="bfloat16 activations"):  # refused as the value is built
        ModelSource(str(tiny_model_dir), "float32", "int8")
    with pytest.raises(TriedecError, match="not a model directory"):
        ModelSpec(ModelSource(str(tiny_model_dir / "missing"))).check()
    with pytest.raises(TriedecError, match="not supported"):
        ModelSource(attn_implementation="flash_attention_2")
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--weights", "int2"])


def test_weights_auto_picks_int4_a8_only_for_a_4_bit_gguf_on_a_cpu_with_the_vector_kernels(tiny_model_dir,
                                                                                           monkeypatch):
    """``weights="auto"`` (the default): an HF checkpoint keeps float32; int4-a8 needs a CPU device,
    no dtype or bfloat16, a CPU the vector kernels run on, and a file whose layers are 4-bit
    (:func:`stored_in_4bit`: a GGUF file's grids, not random weights)."""
    from triedec.model import source as source_module
    from triedec.model.isa import supported
    from triedec.model.precision import quantize_int4, stored_in_4bit

    lm = triedec.load(tiny_model_dir)
    assert lm.adapter.precision == Precision(torch.float32, "float")
    assert ModelSource(str(tiny_model_dir)).precision is None  # resolved when it loads
    assert ModelSource().a8_applies() is any(isa != "portable" for isa in supported())
    assert not ModelSource(dtype="float32").a8_applies() and not ModelSource(device="cuda").a8_applies()
    if ModelSource().a8_applies():
        assert ModelSource(dtype="bfloat16").a8_applies() and ModelSource(dtype=torch.bfloat16).a8_applies()
    monkeypatch.setattr(source_module, "supported", lambda: ("portable",))
    assert not ModelSource().a8_applies()
    model = tiny_llama(seed=3)
    assert not stored_in_4bit(model, model.lm_head)
    with torch.no_grad():  # every layer's weight put on its 4-bit grid, as a Q4 file's dequantized values are
        for layer in model.modules():
            if type(layer) is nn.Linear and layer is not model.lm_head:
                codes, scale, zero = quantize_int4(layer.weight)
                grouped = codes.float().reshape(codes.shape[0], -1, GROUP_SIZE)
                groups = (grouped - 8) * scale.t().float()[..., None] + zero.t().float()[..., None]
                layer.weight.copy_(groups.reshape(layer.weight.shape))
    assert stored_in_4bit(model, model.lm_head)
    with pytest.raises(TriedecError, match="weights must be one of"):
        ModelSource(weights="nf4")


# ---- the default model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_int4():
    return triedec.load(weights="int4")


@pytest.mark.default_model
def test_the_default_ggufs_own_q4_1_codes_are_kept_in_int4(default_int4):
    """The file stores each linear but the head as Q4_1 blocks (codes 0..15, an fp16 scale and
    minimum per 32 weights). int4 mode quantizes the dequantized weights with the same group size:
    every code is the file's (rows of q and k come permuted as transformers un-permutes them), and
    each weight is within a bf16 rounding of its group's scale and minimum of the file's value."""
    import numpy as np
    from gguf import GGUFReader

    from triedec.model.source import default_model_path

    reader = GGUFReader(default_model_path())
    names = {"ffn_down": "mlp.down_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj"}
    model = default_int4.reference_model()
    modules = dict(model.named_modules())
    assert isinstance(model.lm_head, Int8Linear)  # the head: int8 (the file keeps it at 8 bits, Q8_0)
    checked, worst = 0, 0.0
    for tensor in reader.tensors:
        if tensor.tensor_type.name != "Q4_1":
            continue
        _, layer, kind, _ = tensor.name.split(".")
        blocks = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, 20)
        low, high = blocks[..., 4:] & 15, blocks[..., 4:] >> 4
        file_codes = np.concatenate([low, high], axis=-1).reshape(blocks.shape[0], -1)
        layer_module = modules[f"model.layers.{layer}.{names[kind]}"]
        assert isinstance(layer_module, Int4Linear)
        ours = _unpacked_codes(layer_module)
        if kind in ("attn_q", "attn_k"):  # compare the rows as sets: the order is permuted
            assert sorted(map(bytes, ours.astype(np.uint8))) == sorted(map(bytes, file_codes.astype(np.uint8)))
        else:
            assert np.array_equal(ours, file_codes), tensor.name
            scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            low_end = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            file_values = file_codes.reshape(blocks.shape[0], -1, GROUP_SIZE) * scale[..., None] + low_end[..., None]
            ours_values = dequantize_int4(torch.from_numpy(ours), layer_module.scales_and_zeros[..., 0],
                                          layer_module.scales_and_zeros[..., 1]).numpy()
            moved = np.abs(ours_values.reshape(file_values.shape) - file_values) / (15 * scale[..., None])
            worst = max(worst, float(moved.max()))
        checked += 1
    assert checked == 210
    assert worst < 2**-7  # measured: 0.49% of a group's range at most


@pytest.mark.default_model
@pytest.mark.skipif(not kernel_available(), reason="int4-a8 needs triedec's kernels")
def test_the_default_ggufs_q4_1_layers_are_held_as_its_own_blocks_in_int4_a8():
    """In int4-a8 every linear the file stores as Q4_1 blocks (210: all but the head, Q8_0) is held
    as those blocks (:class:`ScaleMinA8Linear`, read from the file, no grid search): its values
    are the file's (``gguf``'s dequantize) bit for bit, rows of q and k in transformers' order, at
    the file's 5 bits a weight."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    from triedec.model.precision import ScaleMinA8Linear
    from triedec.model.source import default_model_path

    model = triedec.load(weights="int4-a8", kernels="plain").adapter.model  # plain: q/k/v and gate/up unjoined
    modules = dict(model.named_modules())
    names = {"ffn_down": "mlp.down_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj"}
    checked = 0
    for tensor in GGUFReader(default_model_path()).tensors:
        if tensor.tensor_type.name != "Q4_1":
            continue
        _, layer, kind, _ = tensor.name.split(".")
        module = modules[f"model.layers.{layer}.{names[kind]}"]
        assert type(module) is ScaleMinA8Linear and module.kind == "Q4_1", tensor.name
        ours = module.dequantized().numpy().view(np.uint32)
        file_values = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)).view(np.uint32)
        if kind in ("attn_q", "attn_k"):  # the rows as sets: transformers un-permutes them
            assert sorted(map(bytes, ours)) == sorted(map(bytes, file_values)), tensor.name
        else:
            assert np.array_equal(ours, file_values), tensor.name
        assert module.packed.numel() + module.dm.numel() * 2 == module.in_features * module.out_features * 5 // 8
        checked += 1
    assert checked == 210


def _unpacked_codes(layer: Int4Linear):
    """The codes an :class:`Int4Linear` holds, read back through its own kernel: the product of
    one-hot rows with the weight, with scale 1 and zero 8 (so ``w = q``), is ``q`` itself."""
    eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
    unit = torch.stack([torch.ones_like(layer.scales_and_zeros[..., 0]),
                        torch.full_like(layer.scales_and_zeros[..., 1], 8.0)], dim=-1)
    with torch.inference_mode():
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, GROUP_SIZE, unit)
    return codes.T.float().round().to(torch.int32).numpy()


def _every_method_returns_ars_tokens(lm: triedec.LM) -> None:
    assert lm.adapter.exactness == BIT_EXACT, lm.adapter.invariance.detail
    prompts = ["Write a Python function that returns the n-th Fibonacci number.",
               "Summarize: the cat sat on the mat because the mat was warm and the cat was cold."]
    for prompt in prompts:
        truth = lm.generate(prompt, "ar", max_new_tokens=40).token_ids
        for name in ("auto", "pld", "recycling", "ngram-trie", "lookahead"):
            assert lm.generate(prompt, name, max_new_tokens=40).token_ids == truth, name
        sampled = lm.generate(prompt, "ar", max_new_tokens=40, temperature=0.7, seed=5).token_ids
        assert lm.generate(prompt, "auto", max_new_tokens=40, temperature=0.7, seed=5).token_ids == sampled


def _gguf_files() -> list[Path]:
    """The default model's GGUF, and the other models' where ``scripts/get-models.sh`` put them."""
    from triedec.model.source import default_model_path

    return [Path(default_model_path()), *sorted((Path(__file__).parent.parent / "models").glob("*.gguf"))]


@pytest.mark.default_model
@pytest.mark.parametrize("path", _gguf_files(), ids=lambda p: p.name)
def test_a_ggufs_q8_0_and_q5_0_blocks_are_kept_bit_for_bit_in_int4_a8s_int8(path):
    """The first two Q8_0 and two Q5_0 tensors of the file of up to 40M weights (the larger
    embeddings are left out for time), dequantized as transformers loads it (``gguf.dequantize``) and quantized by
    :func:`quantize_int8_groups`, every group's scale is the file's own fp16 ``d`` (Q5_0: ``|d|``),
    and codes times scale give the file's values exactly (Q8_0: the codes are the file's bytes)."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    seen = {"Q8_0": 0, "Q5_0": 0}
    for tensor in GGUFReader(path).tensors:
        kind = tensor.tensor_type.name
        if kind not in seen or seen[kind] >= 2 or tensor.shape[1] % 16 or tensor.n_elements > 40_000_000:
            continue
        seen[kind] += 1
        values = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)))
        rows = values.shape[0]
        codes, scale = quantize_int8_groups(values)
        blocks = np.asarray(tensor.data).reshape(rows, -1, 34 if kind == "Q8_0" else 22)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
        assert torch.equal(scale, d.abs()), tensor.name
        assert torch.equal(codes.float() * scale.float().repeat_interleave(GROUP_SIZE, dim=1), values), tensor.name
        if kind == "Q8_0":
            assert torch.equal(codes, torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, -1))
    assert seen["Q8_0"] >= 1  # every file here stores its embedding or head as Q8_0 ...
    assert seen["Q5_0"] >= 1 or path.name.endswith("Q4_1.gguf")  # ... the Q4_K_M ones their attention as Q5_0


@pytest.mark.default_model
@pytest.mark.parametrize("path", _gguf_files()[1:] or [None], ids=lambda p: p.name if p else "none")
def test_a_ggufs_q6_k_blocks_are_found_again_bit_for_bit(path):
    """The Q6_K tensors of a Q4_K_M file (``scripts/get-models.sh``; the default file has none),
    dequantized as transformers loads them: :func:`q6_codes` finds each one's codes, int8 scales
    and float32 super-block scales, whose product is the file's values bit for bit (the codes are
    the file's up to a sign, or a factor a half-block's codes all share, moved into its scale)."""
    if path is None:
        pytest.skip("no Q4_K_M file here (scripts/get-models.sh puts them in models/)")
    import numpy as np
    from gguf import GGUFReader, dequantize

    from triedec.model.precision import _q6_values, q6_codes

    seen = 0
    for tensor in GGUFReader(path).tensors:
        if tensor.tensor_type.name != "Q6_K" or tensor.n_elements > 40_000_000:
            continue
        seen += 1
        values = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)))
        found = q6_codes(values)
        assert found is not None, tensor.name
        assert torch.equal(_q6_values(*found).float(), values), tensor.name
    assert seen >= 1


@pytest.mark.default_model
def test_every_method_returns_ars_tokens_on_the_default_model_in_int4(default_int4):
    _every_method_returns_ars_tokens(default_int4)


@pytest.mark.default_model
@pytest.mark.skipif(not (kernel_available() and load_kernel().a8_linears_vectorized()),
                    reason="int4-a8 runs its portable path on this CPU (neither AVX512-VNNI nor AVX2): minutes per "
                           "default-model calibration; the tiny-model tests cover the mode here")
def test_every_method_returns_ars_tokens_on_the_default_model_in_int4_a8():
    lm = triedec.load()  # weights="auto": the file's own 4-bit codes on int4-a8, on a CPU with the vector kernels
    assert lm.adapter.precision == Precision(torch.bfloat16, "int4-a8")
    assert "int4-a8-weights" in lm.adapter.kernels and "fused-rmsnorm" in lm.adapter.kernels
    assert lm.adapter.native_forward and lm.adapter.kernels.endswith("+triedec-runner+native-forward")
    _every_method_returns_ars_tokens(lm)
