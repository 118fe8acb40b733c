"""triedec's own compiled kernels besides tree attention (``csrc/``): the fused RMS norm
(:mod:`triedec.model.rmsnorm`), the linears whose dot products run on 8-bit activations
(``int4-a8`` mode, :mod:`triedec.model.precision`) and the float32 linear (:mod:`triedec.model.linears`).
Each must compute what it claims (against a float64 reference or the module it replaces), give a
row the same bits alone and inside any call, and, for the linears, give the same bits on the vector
path and the portable one."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import tiny_gemma3, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from triedec.core.errors import TriedecError
from triedec.model.adapter import ModelAdapter
from triedec.model.linears import F32Linear, pack_f32, unpack_f32
from triedec.model.native import OPENMP, load_kernel, switchable_libraries
from triedec.model.opcheck import quantized_activations
from triedec.model.precision import (
    GROUP_SIZE,
    Int4A8Linear,
    Int5A8Linear,
    Int8A8Linear,
    Int8Linear,
    Precision,
    dequantize_int4,
    pack_int4,
    pack_int5,
    pack_int8,
    pack_int8_scales,
    pack_scales_zeros,
    quantize_int4,
    quantize_int8_groups,
    unpack_int4,
    unpack_int5,
    unpack_int8,
    unpack_int8_scales,
    unpack_scales_zeros,
)
from triedec.model.rmsnorm import FusedRMSNorm, fusable_variant, fuse_norms
from triedec.model.source import quantize

KERNEL = load_kernel()


# ---- the fused RMS norm ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_fused_norm_is_recognised_and_computes_what_the_stock_norm_computes(kind, dtype):
    torch.manual_seed(0)
    stock = (LlamaRMSNorm(96, eps=1e-5) if kind == "llama" else Gemma3RMSNorm(96, eps=1e-6)).to(dtype)
    with torch.no_grad():
        stock.weight.normal_()
    variant = fusable_variant(stock)
    assert variant == ("weight" if kind == "llama" else "one-plus-weight")
    fused = FusedRMSNorm(stock.weight, 1e-5 if kind == "llama" else 1e-6, variant)
    x = (torch.randn(3, 40, 96) * 3).to(dtype)
    with torch.inference_mode():
        got, expected = fused(x), stock(x)
    assert got.dtype == dtype and got.shape == x.shape
    eps = torch.finfo(dtype).eps
    assert ((got.double() - expected.double()).abs() <= 4 * eps * expected.double().abs() + 1e-30).all()
    if dtype != torch.float32:
        assert (got == expected).float().mean() > 0.99  # one rounding away at most, and rarely


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), features=st.integers(1, 300), seed=st.integers(0, 10**6),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_a_fused_norm_gives_a_row_the_same_bits_alone_and_in_any_call(rows, features, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(features, generator=gen).to(dtype)
    x = (torch.randn(rows, features, generator=gen) * 5).to(dtype)
    for variant in ("weight", "one-plus-weight"):
        norm = FusedRMSNorm(weight, 1e-6, variant)
        together = norm(x)
        alone = torch.cat([norm(x[i : i + 1]) for i in range(rows)])
        assert torch.equal(together, alone)
        assert torch.equal(norm(x.t().contiguous().t()), together)  # strided rows: the same bits


def test_only_norms_whose_arithmetic_is_recognised_are_swapped():
    class OddRMSNorm(nn.Module):  # named like one, computes something else
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))
            self.eps = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    holder = nn.Sequential(OddRMSNorm(), LlamaRMSNorm(16))
    done = fuse_norms(holder)
    assert (done.norms, done.kept) == (1, 1)
    assert isinstance(holder[0], OddRMSNorm) and isinstance(holder[1], FusedRMSNorm)
    with pytest.raises(ValueError, match="variant"):
        FusedRMSNorm(torch.ones(4), 1e-6, "layer-norm")


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_norms_are_fused_in_bf16_modes_and_not_in_float32(build):
    for precision, fused in ((Precision.of("float32"), False), (Precision.of("bfloat16"), True),
                             (Precision.of(weights="int4-a8"), True)):
        model = build(seed=3)
        if precision.quantized:
            quantize(model, precision)
        else:
            model.to(precision.dtype)
        adapter = ModelAdapter(model, "auto")
        assert any(isinstance(m, FusedRMSNorm) for m in model.modules()) == fused
        assert ("fused-rmsnorm" in adapter.kernels) == fused
        assert adapter.exactness == "bit-exact", adapter.invariance.detail


def test_the_kernel_refuses_bad_input_with_a_message():
    with pytest.raises(RuntimeError, match="weight must be"):
        KERNEL.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), 1e-6, False)
    with pytest.raises(RuntimeError, match="share a dtype"):
        KERNEL.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6, False)


# ---- rotary embeddings ---------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 5), tokens=st.integers(1, 9), half=st.integers(1, 40), seed=st.integers(0, 10**6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), transposed=st.booleans())
def test_the_rotary_kernel_gives_transformers_bits(heads, tokens, half, seed, dtype, transposed):
    """``rotary`` against transformers' ``apply_rotary_pos_emb`` (rotate-half) on the model's own
    cos and sin: ``torch.equal`` in every dtype, for a query laid out as the projection leaves it
    (a transposed view) or dense, and odd head sizes' halves."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(seed)
    dim = 2 * half
    if transposed:  # [1, T, H, D] from the projection, seen as [1, H, T, D]
        x = torch.randn(1, tokens, heads, dim, generator=generator).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(1, heads, tokens, dim, generator=generator).to(dtype)
    angles = torch.rand(1, tokens, half, generator=generator) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = (emb.cos() * 1.25).to(dtype), (emb.sin() * 1.25).to(dtype)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    with torch.inference_mode():
        got = KERNEL.rotary(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="share a dtype"):
        KERNEL.rotary(x.float() if dtype != torch.float32 else x.double(), cos, sin)


# ---- the linears on 8-bit activations ------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(vectors=st.integers(1, 9), groups=st.integers(1, 5), rows=st.integers(1, 19), seed=st.integers(0, 10**6),
       bias=st.booleans())
def test_the_int4_kernel_computes_int4_weights_times_quantized_activations(vectors, groups, rows, seed, bias):
    """Against float64: the dequantized int4 weight times the dequantized 8-bit activations, within
    float32 rounding of the result; a row alone equals the row in the call; vector and portable
    paths give the same bits; and the packing round-trips (blocks of 64 outputs, the last one short
    when 16 * vectors is not a multiple of 64)."""
    torch.manual_seed(seed)
    linear = nn.Linear(GROUP_SIZE * groups, 16 * vectors, bias=bias)
    layer = Int4A8Linear(linear)
    codes, scale, zero = quantize_int4(linear.weight)
    assert torch.equal(layer.codes(), codes)
    assert all(torch.equal(a, b) for a, b in zip(layer.scale_and_zero(), (scale, zero), strict=True))
    x = (torch.randn(rows, linear.in_features) * 2).to(torch.bfloat16)
    x[0, :GROUP_SIZE] = 0  # a group of zeros quantizes to zeros
    with torch.inference_mode():
        got = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
        portable = KERNEL.int4_linear(x, layer.packed, layer.scales_zeros, True)
    assert torch.equal(got, alone)
    assert torch.equal(got, portable if layer.bias is None else portable + layer.bias)
    exact = quantized_activations(x)  # the kernels' view of x, in float64
    product = exact @ dequantize_int4(codes, scale, zero).double().T
    expected = product if layer.bias is None else product + layer.bias.double()
    scale_of_terms = (exact.abs() @ dequantize_int4(codes, scale, zero).double().abs().T).clamp_min(1e-3)
    # the product rounded to bf16 once (and the sum with the bias once more), float32 sums before
    tolerance = 2**-8 * (product.abs() + expected.abs()) + 1e-5 * scale_of_terms * groups
    assert ((got.double() - expected).abs() <= tolerance).all()


@settings(max_examples=20, deadline=None)
@given(vectors=st.integers(1, 6), groups=st.integers(1, 4), rows=st.integers(1, 13), seed=st.integers(0, 10**6),
       bias=st.booleans())
def test_the_int8_kernel_computes_int8_weights_times_quantized_activations(vectors, groups, rows, seed, bias):
    """Against float64, as for int4: codes and an fp16 scale per output and group of 32
    (:func:`quantize_int8_groups`), scales differing from group to group; alone = in the call;
    vector = portable."""
    torch.manual_seed(seed)
    linear = nn.Linear(GROUP_SIZE * groups, 16 * vectors, bias=bias)
    with torch.no_grad():  # groups of very different magnitudes: one scale per row would not do
        linear.weight.mul_(torch.logspace(-3, 1, groups).repeat_interleave(GROUP_SIZE))
    layer = Int8A8Linear(linear)
    codes, scale = quantize_int8_groups(linear.weight)
    assert all(torch.equal(a, b) for a, b in zip(layer.codes_and_scales(), (codes, scale), strict=True))
    weight = layer.dequantized().double()
    assert ((weight - linear.weight.double()).abs() <= scale.double().repeat_interleave(GROUP_SIZE, dim=1) / 2).all()
    x = (torch.randn(rows, linear.in_features) * 2).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
        portable = KERNEL.int8_linear(x, layer.packed, layer.scales, True)
    assert torch.equal(got, alone)
    assert torch.equal(got, portable if layer.bias is None else portable + layer.bias)
    exact = quantized_activations(x)  # the kernels' view of x, in float64
    product = exact @ weight.T
    expected = product if layer.bias is None else product + layer.bias.double()
    scale_of_terms = (exact.abs() @ weight.abs().T).clamp_min(1e-3)
    tolerance = 2**-8 * (product.abs() + expected.abs()) + 1e-5 * scale_of_terms * groups
    assert ((got.double() - expected).abs() <= tolerance).all()


def test_a_group_too_small_to_scale_quantizes_to_zeros_on_both_paths():
    """A group whose largest |x| is below 1e-30 (127 / max would overflow float32) counts as zeros:
    the output is that of the other groups alone, the same bits on both paths."""
    layer = Int4A8Linear(nn.Linear(64, 32, bias=False))
    x = torch.randn(3, 64).to(torch.bfloat16)
    tiny = x.clone()
    tiny[:, :GROUP_SIZE] = 1e-35
    zero = x.clone()
    zero[:, :GROUP_SIZE] = 0
    with torch.inference_mode():
        got = layer(tiny)
        assert torch.equal(got, layer(zero))
        assert torch.equal(got, KERNEL.int4_linear(tiny, layer.packed, layer.scales_zeros, True))


def test_activations_quantize_ties_to_even_and_clamp_on_every_path():
    """The activations' quantization, seen whole: int8 codes of 1 on the diagonal at scale 1 make
    output n the quantized x'_n times a, and a group whose largest |x| is 127 has a = 1, 127 / max
    = 1, so x' is x rounded to an integer. Halves (bf16 holds every k + 1/2 below 128) must round
    to even, as torch.round does, the same bits on the vector path and the portable one; a group of
    two magnitudes checks the scaling (x * (127 / max), clamped to +-127) against the same float32
    operations in torch."""
    K = N = 4 * GROUP_SIZE
    halves = torch.arange(-126.5, 127.0, 1.0)  # 254 ties, every one representable in bf16
    x = torch.zeros(3, K)
    for row in range(3):
        for g in range(K // GROUP_SIZE):
            group = halves[torch.randperm(len(halves), generator=torch.Generator().manual_seed(10 * row + g))]
            x[row, g * GROUP_SIZE : (g + 1) * GROUP_SIZE] = group[:GROUP_SIZE]
            x[row, g * GROUP_SIZE + (row + g) % GROUP_SIZE] = 127.0 if (row + g) % 2 else -127.0
    x[2, :GROUP_SIZE] *= 2.0**-70  # a = 2^-70: the same ties at a tiny scale
    x[1, 3 * GROUP_SIZE :] = torch.linspace(-300.0, 300.0, GROUP_SIZE)  # max 300: 127 / 300 scales
    x = x.to(torch.bfloat16)
    layer = Int8A8Linear(nn.Linear(K, N, bias=False))
    layer.packed.copy_(pack_int8(torch.eye(N, K, dtype=torch.int8)))
    layer.scales.copy_(pack_int8_scales(torch.ones(N, K // GROUP_SIZE).half()))
    groups = x.float().reshape(3, -1, GROUP_SIZE)  # the contract's float32 operations, in torch
    top = groups.abs().amax(dim=-1, keepdim=True)
    codes = torch.round(groups * (127.0 / top)).clamp(-127, 127)
    expected = (codes * (top / 127.0)).reshape(x.shape).to(torch.bfloat16)
    with torch.inference_mode():
        vector = KERNEL.int8_linear(x, layer.packed, layer.scales, False)
        portable = KERNEL.int8_linear(x, layer.packed, layer.scales, True)
    assert torch.equal(vector, portable)
    assert torch.equal(vector, expected)
    ties = x.float()[0, GROUP_SIZE : 2 * GROUP_SIZE]
    assert torch.equal(vector.float()[0, GROUP_SIZE : 2 * GROUP_SIZE], torch.round(ties))  # half to even
    assert (torch.round(ties) != torch.trunc(ties + 0.5 * ties.sign())).any()  # some tie went down


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_codes_times_the_largest_activations_sum_exactly_on_every_path(sign):
    """The integer sums at their extremes: every int4 code 15 and every int8 code +-127 (a sign per
    output), times activations that all quantize to +-127. The AVX2 path sums products in 16-bit
    lanes before widening (int4: a group's 32 products; int8: pairs), so an overflow there would
    show here; the result must be the float64 product, on the vector and the portable path alike."""
    K, N, rows = 4 * GROUP_SIZE, 80, 3  # a block of 64 outputs and a short one of 16
    x = torch.full((rows, K), sign * 3.0).to(torch.bfloat16)
    x[1] *= 0.5
    int4 = Int4A8Linear(nn.Linear(K, N, bias=False))
    scale = torch.full((K // GROUP_SIZE, N), 2.0**-6).bfloat16()
    zero = torch.full((K // GROUP_SIZE, N), 2.0**-4).bfloat16()
    int4.packed.copy_(pack_int4(torch.full((N, K), 15, dtype=torch.int32)))
    int4.scales_zeros.copy_(pack_scales_zeros(scale, zero))
    int8 = Int8A8Linear(nn.Linear(K, N, bias=False))
    codes = torch.where(torch.arange(N)[:, None] % 2 == 0, 127, -127).to(torch.int8).expand(N, K).contiguous()
    int8.packed.copy_(pack_int8(codes))
    int8.scales.copy_(pack_int8_scales(torch.full((N, K // GROUP_SIZE), 2.0**-7).half()))
    with torch.inference_mode():
        got4, got8 = int4(x), int8(x)
        assert torch.equal(got4, KERNEL.int4_linear(x, int4.packed, int4.scales_zeros, True))
        assert torch.equal(got8, KERNEL.int8_linear(x, int8.packed, int8.scales, True))
    weight4 = dequantize_int4(unpack_int4(int4.packed), scale, zero).double()
    weight8 = codes.double() * 2.0**-7
    assert torch.equal(got4, (x.double() @ weight4.T).to(torch.bfloat16))
    assert torch.equal(got8, (x.double() @ weight8.T).to(torch.bfloat16))


def test_outputs_round_to_bf16_as_torch_rounds_them_infinities_and_nans_too():
    """The vector paths round 16 outputs at a time to bf16 with c10's rounding (nearest even on the
    bits, any NaN to 0x7FC0; not the instruction, which flushes subnormals): rows of activations
    from 1e-38 (zeros: below the quantizer's 1e-30) to 3e38 times large scales give tiny, infinite
    and NaN outputs (an infinity of each sign in one sum), the same bits as the portable path,
    alone and in calls of 16 rows or more."""
    generator = torch.Generator().manual_seed(4)
    linear = nn.Linear(4 * GROUP_SIZE, 80, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 4 * GROUP_SIZE, generator=generator) * 3e4)
    int8 = Int8A8Linear(linear)
    magnitudes = torch.tensor([1e-38, 2e-30, 1e-20, 1.0, 1e30, 3e38]).repeat(4)[:21]
    x = (torch.randn(21, 4 * GROUP_SIZE, generator=generator) * magnitudes[:, None]).to(torch.bfloat16)
    with torch.inference_mode():
        got = KERNEL.int8_linear(x, int8.packed, int8.scales, False)
        portable = KERNEL.int8_linear(x, int8.packed, int8.scales, True)
        alone = torch.cat([KERNEL.int8_linear(x[i : i + 1], int8.packed, int8.scales, False) for i in range(21)])
    bits = got.view(torch.int16)
    assert torch.equal(bits, portable.view(torch.int16)) and torch.equal(bits, alone.view(torch.int16))
    assert got.float().isinf().any() and got.float().isnan().any() and (got[0] == 0).all()
    assert ((got.float().abs() > 0) & (got.float().abs() < 1e-20)).any()


def test_calls_from_several_threads_at_once_each_get_their_own_rows():
    """Each call quantizes its activations into a buffer of its calling thread's own: calls of
    different sizes from several threads at once give what each gives alone."""
    int4 = Int4A8Linear(nn.Linear(96, 80, bias=False))
    int8 = Int8A8Linear(nn.Linear(96, 80, bias=False))
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(rows, 96, generator=generator).to(torch.bfloat16) for rows in (1, 3, 7, 16, 2, 5, 11, 4)]
    with torch.inference_mode():
        alone = [(int4(x), int8(x)) for x in inputs]

        def run(i: int) -> bool:
            x = inputs[i % len(inputs)]
            return all(torch.equal(int4(x), alone[i % len(inputs)][0]) and
                       torch.equal(int8(x), alone[i % len(inputs)][1]) for _ in range(20))

        with ThreadPoolExecutor(max_workers=4) as pool:
            assert all(pool.map(run, range(16)))


def attention_cases(generator: torch.Generator) -> list[tuple]:
    """Tree attention's arguments with grouped heads as the shipped models have them (teams of 3, 2
    and 1 query heads on a key/value head), keys past several 64-key chunks and odd counts, every
    key or a listed subset per query, in each dtype."""
    cases = []
    shapes = ((torch.bfloat16, (9, 3), 64, 203), (torch.float16, (14, 2), 64, 70),
              (torch.bfloat16, (4, 1), 256, 37), (torch.float32, (5, 5), 40, 129))
    for dtype, (heads, kv_heads), features, slots in shapes:
        q = torch.randn(heads, 3, features, generator=generator).to(dtype)
        k, v = (torch.randn(kv_heads, slots, features, generator=generator).to(dtype) for _ in range(2))
        picks = (torch.randint(0, slots, (slots // 2 + 1,), generator=generator) for _ in range(3))
        lists = [sorted(set(p.tolist())) for p in picks]
        offsets = torch.tensor([0, *itertools.accumulate(len(keys) for keys in lists)])
        indices = torch.tensor([i for keys in lists for i in keys], dtype=torch.int32)
        cases += [(q, k, v, None, None, features ** -0.5, 0.0), (q, k, v, offsets, indices, 0.1, 50.0)]
    return cases


@pytest.mark.skipif(not OPENMP, reason="torch here runs no OpenMP: the kernels run on the calling thread")
def test_the_kernels_run_on_torchs_threads_and_give_the_same_bits_on_any_number():
    """Built with OpenMP, a kernel's parallel loop runs on ``torch.set_num_threads`` threads (built
    without it, it silently ran on one); every output is computed by one thread in a fixed order, so
    1 and 2 threads give the same bits."""
    generator = torch.Generator().manual_seed(5)
    # 4 blocks of outputs and 7 rows in 3 tiles: 1 thread cuts each block's tiles into 2 work
    # items, 2 threads into 3
    int4 = Int4A8Linear(nn.Linear(96, 208, bias=False))
    int8 = Int8A8Linear(nn.Linear(96, 208, bias=False))
    f32 = F32Linear(nn.Linear(96, 208))
    x = torch.randn(7, 96, generator=generator).to(torch.bfloat16)
    norm_x, norm_w = torch.randn(300, 64, generator=generator), torch.randn(64, generator=generator)
    q, k, v = (torch.randn(4, n, 32, generator=generator) for n in (9, 40, 40))
    attention = attention_cases(generator)
    before = torch.get_num_threads()
    outputs = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert KERNEL.parallel_threads() == threads
            with torch.inference_mode():
                outputs[threads] = (int4(x), int8(x), f32(x.float()), KERNEL.rms_norm(norm_x, norm_w, 1e-6, False),
                                    KERNEL.tree_attention(q, k, v, None, None, 32 ** -0.5, 0.0),
                                    *(KERNEL.tree_attention(*case) for case in attention))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(outputs[1], outputs[2], strict=True))


def test_packings_round_trip():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (80, 96), dtype=torch.int32)  # one full block of 64 outputs and one of 16
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)
    scale, zero = torch.randn(3, 80).bfloat16(), torch.randn(3, 80).bfloat16()
    assert all(torch.equal(a, b) for a, b in zip(unpack_scales_zeros(pack_scales_zeros(scale, zero)), (scale, zero),
                                                   strict=True))
    signed = torch.randint(-127, 128, (80, 64), dtype=torch.int8)  # a block of 64 outputs and one of 16
    assert torch.equal(unpack_int8(pack_int8(signed)), signed)
    scales = torch.randn(80, 2).half()
    assert torch.equal(unpack_int8_scales(pack_int8_scales(scales)), scales)


def test_the_linears_refuse_bad_input_with_a_message():
    layer = Int4A8Linear(nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNEL.int4_linear(torch.ones(2, 64), layer.packed, layer.scales_zeros, False)
    with pytest.raises(RuntimeError, match="features must match"):
        KERNEL.int4_linear(torch.ones(2, 32, dtype=torch.bfloat16), layer.packed, layer.scales_zeros, False)
    with pytest.raises(TriedecError, match="divisible by 16"):
        Int4A8Linear(nn.Linear(64, 24))
    with pytest.raises(TriedecError, match="divisible by 16"):
        Int8A8Linear(nn.Linear(40, 32))
    int8 = Int8A8Linear(nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match="float16"):
        KERNEL.int8_linear(torch.ones(2, 64, dtype=torch.bfloat16), int8.packed, int8.scales.float(), False)


# ---- the float32 linear ---------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(vectors=st.integers(1, 9), features=st.integers(1, 70), rows=st.integers(1, 11), seed=st.integers(0, 2**16),
       bias=st.booleans(), pad=st.integers(0, 15))
def test_the_float32_linear_computes_the_product_and_a_row_alone_as_in_any_call(vectors, features, rows, seed, bias,
                                                                                 pad):
    """Against a float64 reference within the error bound of a sum of ``features`` float32 terms;
    each row the same bits alone as in the call (outputs padded to 16 and back included)."""
    generator = torch.Generator().manual_seed(seed)
    out = max(1, vectors * 16 - pad)
    linear = nn.Linear(features, out, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out, features, generator=generator))
        if bias:
            linear.bias.copy_(torch.randn(out, generator=generator))
    layer = F32Linear(linear)
    x = torch.randn(rows, features, generator=generator)
    with torch.inference_mode():
        y = layer(x)
        exact = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
        bound = (features + 2) * 2.0**-23 * ((x.double().abs() @ linear.weight.double().abs().T)
                                            + (linear.bias.double().abs() if bias else 0))
        assert y.shape == (rows, out) and bool(((y.double() - exact).abs() <= bound + 1e-30).all())
        assert all(torch.equal(layer(x[r : r + 1]), y[r : r + 1]) for r in range(rows))
    assert torch.equal(unpack_f32(layer.packed)[:out], linear.weight.detach())


def test_the_float32_linear_sums_in_input_order_with_fused_multiply_adds():
    """Output 0: 2^24 + 1 rounds to 2^24 (ties to even), then - 2^24: 0, where any other order
    gives 1. Output 1: -(1 + 2^-11), then + (1 + 2^-12)^2 fused: 2^-24, where a rounded product
    gives 0."""
    w = torch.zeros(16, 3)
    w[0] = torch.tensor([2.0**24, 1.0, -(2.0**24)])
    w[1] = torch.tensor([-(1 + 2.0**-11), 1 + 2.0**-12, 0.0])
    x = torch.tensor([[1.0, 1.0, 1.0]])
    x2 = torch.tensor([[1.0, 1 + 2.0**-12, 0.0]])
    y = KERNEL.f32_linear(torch.cat([x, x2]), pack_f32(w), None)
    assert y[0, 0].item() == 0.0 and y[1, 1].item() == 2.0**-24


def test_float32_linears_join_with_each_output_s_own_bits():
    torch.manual_seed(3)
    parts = [F32Linear(nn.Linear(48, n)) for n in (64, 16, 100)]
    joined = F32Linear.joined(parts)
    x = torch.randn(5, 48)
    with torch.inference_mode():
        assert torch.equal(joined(x), torch.cat([p(x) for p in parts], dim=1))
    with pytest.raises(ValueError, match="one input size"):
        F32Linear.joined([parts[0], F32Linear(nn.Linear(32, 16))])
    with pytest.raises(RuntimeError, match="float32"):
        KERNEL.f32_linear(torch.ones(2, 48, dtype=torch.bfloat16), joined.packed, None)
    with pytest.raises(RuntimeError, match="features must match"):
        KERNEL.f32_linear(torch.ones(2, 40), joined.packed, None)


def test_int4_a8_mode_runs_the_8_bit_kernels_and_keeps_int4s_codes():
    model = tiny_llama(seed=5)
    int4, a8 = tiny_llama(seed=5), model
    quantize(int4, Precision.of(weights="int4"))
    quantize(a8, Precision.of(weights="int4-a8"))
    assert isinstance(a8.lm_head, Int8A8Linear) and isinstance(int4.lm_head, Int8Linear)
    proj = a8.model.layers[0].self_attn.q_proj
    assert isinstance(proj, Int4A8Linear)
    stock = int4.model.layers[0].self_attn.q_proj
    eye = torch.eye(proj.in_features, dtype=torch.bfloat16)
    unit = torch.stack([torch.ones_like(stock.scales_and_zeros[..., 0]),
                        torch.full_like(stock.scales_and_zeros[..., 1], 8.0)], dim=-1)
    int4_codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, stock.packed, GROUP_SIZE, unit).T.to(torch.int32)
    assert torch.equal(proj.codes(), int4_codes)  # the same codes as int4 mode's


# ---- one build per instruction set ----------------------------------------------------------------


def test_the_fastest_installed_build_this_cpu_runs_is_the_one_loaded():
    from triedec.model.isa import ISAS, supported

    libraries = switchable_libraries()
    assert supported()[-1] == "portable" and set(supported()) <= set(ISAS)
    assert supported(frozenset()) == ("portable",)
    assert "avx2" in supported(frozenset(ISAS["avx2"][1])) and "avx512vnni" not in supported(frozenset(ISAS["avx2"][1]))
    assert supported(frozenset(ISAS["avx512amx"][1]))[0] == "avx512amx"  # AMX-INT8 first where the CPU has it
    assert "avx512amx" not in supported(frozenset(ISAS["avx512vnni"][1]))
    if not libraries:
        pytest.skip("triedec was installed without its kernels' builds (they were built on first use)")
    assert KERNEL.isa() == next(isa for isa in supported() if isa in libraries)


def test_the_install_builds_only_what_the_compiler_takes():
    """setup.py skips a build whose flags the compiler refuses (an older GCC without AMX's), so
    the install goes on with the others; this machine's compiler takes every build's flags."""
    import shutil

    from triedec.model.isa import ISAS, buildable, compiler_accepts

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here")
    assert not compiler_accepts(("-mno-such-instruction-set",), "c++")
    assert all(compiler_accepts(ISAS[name][0], "c++") for name in buildable())
    assert compiler_accepts(("-O2",), "no-such-compiler-anywhere")  # none found: the build says why


def test_a_library_built_from_other_sources_or_no_library_is_refused(tmp_path):
    """The extension loads only a kernel library built from its own sources: another file, or a
    library whose digest differs, is refused with the reason and the library in use stays."""
    libraries = switchable_libraries()
    if not libraries:
        pytest.skip("triedec was installed without its kernels' builds (they were built on first use)")
    before = KERNEL.isa()
    with pytest.raises(RuntimeError, match="cannot load the kernel library"):
        KERNEL.use_kernels(str(tmp_path / "missing.so"))
    with pytest.raises(RuntimeError, match="not a triedec kernel library"):
        KERNEL.use_kernels(torch._C.__file__)
    assert KERNEL.isa() == before


def _same_bits_on_every_build(run: Callable[[], Sequence[torch.Tensor]]) -> None:
    """run() under each kernel library this CPU runs (the fastest loaded again after): the
    same bits from every one. Skips where fewer than two builds run here."""
    libraries = switchable_libraries()
    if len(libraries) < 2:
        pytest.skip("fewer than two installed builds run on this CPU")
    outputs = []
    fastest = KERNEL.isa()
    try:
        with torch.inference_mode():
            for isa, path in libraries.items():
                assert KERNEL.use_kernels(str(path)) == isa == KERNEL.isa()
                outputs.append(list(run()))
    finally:
        KERNEL.use_kernels(str(libraries[fastest]))
    assert KERNEL.isa() == fastest
    first, *others = outputs
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_every_installed_build_gives_the_same_bits():
    """The ISA decides the speed only: every kernel library this CPU runs (vector and portable
    paths alike) gives the int4, int8 and float32 linears, the RMS norm and tree attention the same bits."""
    generator = torch.Generator().manual_seed(11)
    int4 = Int4A8Linear(nn.Linear(96, 208, bias=False))
    int8 = Int8A8Linear(nn.Linear(96, 208, bias=False))
    f32 = F32Linear(nn.Linear(96, 208))
    x = torch.randn(7, 96, generator=generator).to(torch.bfloat16)
    many = torch.randn(37, 96, generator=generator).to(torch.bfloat16)  # two AMX tiles of 16 rows and 5 more
    x32 = torch.randn(9, 96, generator=generator)  # tiles of 4, 4 and 1 rows on AVX-512
    norm_x, norm_w = torch.randn(300, 64, generator=generator), torch.randn(64, generator=generator)
    q, k, v = (torch.randn(4, n, 32, generator=generator) for n in (9, 40, 40))
    attention = attention_cases(generator)
    _same_bits_on_every_build(lambda: (KERNEL.int4_linear(x, int4.packed, int4.scales_zeros, False),
                                       KERNEL.int8_linear(x, int8.packed, int8.scales, False),
                                       KERNEL.int4_linear(many, int4.packed, int4.scales_zeros, False),
                                       KERNEL.int8_linear(many, int8.packed, int8.scales, False),
                                       KERNEL.f32_linear(x32, f32.packed, f32.padded_bias),
                                       KERNEL.rms_norm(norm_x, norm_w, 1e-6, False),
                                       KERNEL.tree_attention(q, k, v, None, None, 32 ** -0.5, 0.0),
                                       *(KERNEL.tree_attention(*case) for case in attention)))


# ---- the machine's limits, measured (scripts/roofline.py) ------------------------------------------


def test_the_probes_count_what_they_did_and_refuse_bad_input():
    """dot_peak's count is iterations x 12 chains x the build's multiply-adds an instruction x the
    threads, whatever the machine's speed; stream_read reads every byte (a changed byte changes its
    checksum) and refuses anything but contiguous uint8."""
    width = {"avx512amx": 64, "avx512vnni": 64, "avxvnni": 32, "avxvnni_evex": 32, "avx2": 32, "portable": 4}
    threads = torch.get_num_threads()  # one share per intra-op thread (run inline without OpenMP)
    done = KERNEL.dot_peak(100)
    assert KERNEL.dot_peak(0) == 0 and KERNEL.dot_peak(200) == 2 * done
    if KERNEL.isa() in width:
        assert done == 100 * 12 * width[KERNEL.isa()] * threads
    zeros = torch.zeros(3 << 20, dtype=torch.uint8)
    assert KERNEL.stream_read(zeros) == 0
    for at in (0, 1 << 20, (3 << 20) - 1):
        one = zeros.clone()
        one[at] = 7
        assert KERNEL.stream_read(one) != 0
    with pytest.raises(RuntimeError, match="uint8"):
        KERNEL.stream_read(torch.zeros(8, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="iterations"):
        KERNEL.dot_peak(-1)


# ---- the op-level harness (triedec.model.opcheck, scripts/ops.py) ---------------------------------


def test_every_op_of_the_harness_is_within_its_bound_and_the_same_bits_on_every_library():
    """ggml's test-backend-ops for triedec: each op of the table on each of its shapes, against
    its float64 reference within its bound, on every installed library this CPU runs, with the
    first library's bits; and the bound bites (a perturbed output fails it)."""
    from triedec.model.opcheck import OPS, check

    results = check()
    assert {r.op for r in results} == {op.name for op in OPS}
    assert len({r.isa for r in results}) == max(1, len(switchable_libraries()))
    bad = [r for r in results if not r.ok]
    assert not bad, bad
    op = OPS[0]
    inputs = op.build(op.check_shapes[1], torch.Generator().manual_seed(0))
    expected = op.reference(inputs)
    allowed = op.bound(inputs, expected)
    with torch.inference_mode():
        got = op.run(KERNEL, inputs).double()
    assert ((got - expected).abs() <= allowed).all()
    assert not ((got * (1 + 2**-6) - expected).abs() <= allowed).all()


def test_the_harness_times_each_op_with_its_shares():
    """--perf's numbers have their shape (no speed is asserted: benchmarks measure speed)."""
    from triedec.model.opcheck import OPS, perf

    peak, rate, timed = perf(repeats=2, trials=1, stream_mib=8, ops=OPS[:1] + OPS[-1:])
    assert peak > 0 and rate > 0
    assert [t.op for t in timed] == [OPS[0].name] * len(OPS[0].perf_shapes) + [OPS[-1].name] * len(OPS[-1].perf_shapes)
    assert all(t.seconds > 0 and t.memory_share > 0 for t in timed)
    assert all((t.peak_share is not None) == (t.op == OPS[0].name) for t in timed)


# ---- 5-bit weights (a GGUF Q5_0 layer at its own bits) ----------------------------------------------


def _q5_0_linear(vectors: int, groups: int, seed: int) -> nn.Linear:
    """A linear whose weights are a Q5_0 file's as transformers dequantizes them
    (:func:`triedec.model.opcheck.q5_0_weights`: codes in -16..15, -16 in every group, an fp16 ``d``
    of either sign per group)."""
    from triedec.model.opcheck import q5_0_weights

    linear = nn.Linear(GROUP_SIZE * groups, 16 * vectors, bias=False)
    with torch.no_grad():
        linear.weight.copy_(q5_0_weights(16 * vectors, GROUP_SIZE * groups, torch.Generator().manual_seed(seed)))
    return linear


@settings(max_examples=20, deadline=None)
@given(vectors=st.integers(1, 9), groups=st.integers(1, 5), rows=st.integers(1, 19), seed=st.integers(0, 10**6))
def test_the_int5_kernel_gives_the_int8_kernels_bits_on_a_q5_0_layers_codes(vectors, groups, rows, seed):
    """A Q5_0 layer held at 5 bits (:class:`Int5A8Linear`) multiplies to the same bits as the same
    codes and scales held in int8 (:class:`Int8A8Linear`), on the vector path and the portable one,
    alone and in any call; its packing round-trips; and it holds 5.5 bits a weight."""
    linear = _q5_0_linear(vectors, groups, seed)
    five, eight = Int5A8Linear(linear), Int8A8Linear(linear)
    assert torch.equal(five.dequantized(), eight.dequantized())
    codes, _ = five.codes_and_scales()
    assert int(codes.min()) >= -16 and int(codes.max()) <= 15
    assert torch.equal(unpack_int5(*pack_int5(codes)), codes)
    held = sum(t.numel() * t.element_size() for t in (five.packed, five.highs, five.scales))
    assert held * 8 == linear.in_features * linear.out_features * 5.5
    x = (torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)
    with torch.inference_mode():
        got = five(x)
        assert torch.equal(got, eight(x))
        assert torch.equal(got, KERNEL.int5_linear(x, five.packed, five.highs, five.scales, True))
        assert torch.equal(got, torch.cat([five(x[i : i + 1]) for i in range(rows)]))
        other = Int5A8Linear(_q5_0_linear(1, groups, seed + 1))
        joined = Int5A8Linear.joined([five, other])  # as the runner joins q, k and v
        assert type(joined) is Int5A8Linear
        assert torch.equal(joined(x), torch.cat([got, other(x)], dim=1))


def test_the_int5_kernel_gives_the_same_bits_on_every_installed_build():
    five = Int5A8Linear(_q5_0_linear(13, 3, 5))
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _same_bits_on_every_build(lambda: [KERNEL.int5_linear(x, five.packed, five.highs, five.scales, False)])


def test_only_codes_a_q5_0_block_holds_go_to_5_bits():
    """int4-a8 holds a layer in 5 bits only where every group's codes fit (-16..15, or -15..16 for a
    negative ``d``); a Q8_0-like layer stays int8, and Int5A8Linear refuses it."""
    from triedec.model.precision import _a8_linear, fits_int5

    assert type(_a8_linear(_q5_0_linear(2, 2, 1))) is Int5A8Linear
    plain = nn.Linear(64, 32)
    assert type(_a8_linear(plain)) is Int8A8Linear
    assert not fits_int5(quantize_int8_groups(plain.weight.detach())[0])
    with pytest.raises(TriedecError, match=r"-16\.\.15"):
        Int5A8Linear(plain)
    with pytest.raises(RuntimeError, match="highs must be"):
        five = Int5A8Linear(_q5_0_linear(2, 2, 1))
        KERNEL.int5_linear(torch.zeros(1, 64, dtype=torch.bfloat16), five.packed, five.highs[:, :1].contiguous(),
                           five.scales, False)


# ---- 6-bit weights (a GGUF Q6_K layer at its own bits) ----------------------------------------------


def _q6_k_blocks(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random Q6_K blocks (any codes, int8 scales over -128..127, an fp16 ``d`` of either sign and
    of magnitudes 1e-5..1) dequantized by the ``gguf`` package, as transformers loads a file."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = rng.integers(-128, 128, size=(rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
    d = np.exp(rng.uniform(np.log(1e-5), 0.0, size=(rows, cols // 256))) * rng.choice([-1.0, 1.0], (rows, cols // 256))
    blocks[..., 208:210] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // 256, 2)
    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks.reshape(rows, -1), GGMLQuantizationType.Q6_K)))


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


@settings(max_examples=15, deadline=None)
@given(vectors=st.integers(1, 9), blocks=st.integers(1, 3), rows=st.integers(1, 19), seed=st.integers(0, 10**6))
def test_a_q6_k_layer_is_held_at_its_bits_with_its_values_and_one_rows_bits_in_any_call(vectors, blocks, rows,
                                                                                        seed):
    """Q6_K blocks as transformers loads them (``gguf``'s dequantize) are found again exactly
    (:func:`q6_codes`: codes in -32..31, an int8 scale per 16, a float32 one per 256), held at 6.6
    bits a weight (:class:`Int6A8Linear`; the packing round-trips) and multiplied within the op
    harness's bound of a float64 reference, with the same bits on the vector path and the portable
    one, alone and in any call, and joined as the runner joins q, k and v."""
    from triedec.model.opcheck import OPS
    from triedec.model.precision import Int6A8Linear, pack_int6, q6_codes, unpack_int6

    weight = _q6_k_blocks(16 * vectors, 256 * blocks, seed)
    found = q6_codes(weight)
    assert found is not None
    codes = found[0]
    assert int(codes.min()) >= -32 and int(codes.max()) <= 31
    assert torch.equal(unpack_int6(*pack_int6(codes)), codes)
    six = Int6A8Linear(_linear_of(weight))
    assert torch.equal(six.dequantized(), weight)  # the file's values, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(six.parts(), found, strict=True))
    held = sum(t.numel() * t.element_size() for t in (six.packed, six.highs, six.scales, six.supers))
    assert held * 8 == weight.numel() * 6.625
    x = (torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)
    op = next(o for o in OPS if o.name == "linear int6-a8")
    inputs = {"layer": six, "x": x, "weight": weight.double()}
    with torch.inference_mode():
        got = six(x)
        expected = op.reference(inputs)
        assert ((got.double() - expected).abs() <= op.bound(inputs, expected)).all()
        assert torch.equal(got, KERNEL.int6_linear(x, six.packed, six.highs, six.scales, six.supers, True))
        assert torch.equal(got, torch.cat([six(x[i : i + 1]) for i in range(rows)]))
        other = Int6A8Linear(_linear_of(_q6_k_blocks(16, 256 * blocks, seed + 1)))
        joined = Int6A8Linear.joined([six, other])
        assert torch.equal(joined(x), torch.cat([got, other(x)], dim=1))


def test_the_int6_kernel_gives_the_same_bits_on_every_installed_build():
    from triedec.model.precision import Int6A8Linear

    six = Int6A8Linear(_linear_of(_q6_k_blocks(13 * 16, 512, 5)))
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _same_bits_on_every_build(lambda: [KERNEL.int6_linear(x, six.packed, six.highs, six.scales, six.supers, False)])


def test_only_a_q6_k_layers_values_go_to_6_bits():
    """int4-a8 holds a layer as Q6_K only where its values are a Q6_K block's and its input
    features whole super-blocks; a Q5_0 layer keeps its 5 bits, others stay int8, and
    Int6A8Linear refuses them; the kernel checks its buffers' shapes."""
    from triedec.model.precision import Int6A8Linear, _a8_linear, q6_codes

    assert type(_a8_linear(_linear_of(_q6_k_blocks(32, 512, 1)))) is Int6A8Linear
    assert type(_a8_linear(_q5_0_linear(2, 8, 1))) is Int5A8Linear  # fewer bits first
    plain = nn.Linear(512, 32)
    assert q6_codes(plain.weight.detach()) is None
    assert type(_a8_linear(plain)) is Int8A8Linear
    assert q6_codes(_q6_k_blocks(16, 512, 2)[:, :384]) is None  # not whole super-blocks
    with pytest.raises(TriedecError, match="Q6_K"):
        Int6A8Linear(plain)
    six = Int6A8Linear(_linear_of(_q6_k_blocks(16, 256, 1)))
    with pytest.raises(RuntimeError, match="supers must be"):
        KERNEL.int6_linear(torch.zeros(1, 256, dtype=torch.bfloat16), six.packed, six.highs, six.scales,
                           six.supers.double(), False)


# ---- a GGUF Q4_K or Q5_K layer's own blocks (codes, scales and mins) ----------------------------------


def _kquant_raw(kind: str, rows: int, cols: int, seed: int):
    """Random Q4_K or Q5_K blocks ``[rows, cols / 256 * bytes]`` (uint8: any codes, scales and mins, an
    fp16 ``d`` and ``dmin`` of either sign and of magnitudes 1e-5..1) and their values as the ``gguf``
    package dequantizes them, as transformers loads a file."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    size = {"Q4_K": 144, "Q5_K": 176}[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    shape = (rows, cols // 256, 2)
    halves = np.exp(rng.uniform(np.log(1e-5), 0.0, size=shape)) * rng.choice([-1.0, 1.0], shape)
    blocks[..., 0:4] = halves.astype(np.float16).view(np.uint8).reshape(rows, cols // 256, 4)
    raw = blocks.reshape(rows, -1)
    return raw, torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[kind])))


@settings(max_examples=15, deadline=None)
@given(kind=st.sampled_from(["Q4_K", "Q5_K"]), vectors=st.integers(1, 9), blocks=st.integers(1, 3),
       rows=st.integers(1, 19), seed=st.integers(0, 10**6))
def test_a_k_quant_layer_is_held_as_its_files_blocks_with_their_values_and_one_rows_bits_in_any_call(
        kind, vectors, blocks, rows, seed):
    """A Q4_K or Q5_K tensor's blocks, as the file stores them, are read (:func:`parse_kquant`) into
    parts whose values are the ``gguf`` package's dequantized ones bit for bit, held at 4.75 or 5.75
    bits a weight (:class:`KQuantA8Linear`; the packing round-trips) and multiplied within the op
    harness's bound of a float64 reference, with the same bits on the vector path and the portable
    one, alone and in any call, and joined as the runner joins q, k and v."""
    from triedec.model.gguf_blocks import parse_kquant
    from triedec.model.opcheck import OPS
    from triedec.model.precision import KQuantA8Linear

    raw, weight = _kquant_raw(kind, 16 * vectors, 256 * blocks, seed)
    parts = parse_kquant(raw, kind)
    assert torch.equal(parts.values(), weight)  # the file's values, bit for bit
    layer = KQuantA8Linear(_linear_of(weight), parts)
    assert torch.equal(layer.dequantized(), weight)
    back = layer.parts()
    assert all(torch.equal(getattr(back, f), getattr(parts, f)) for f in ("codes", "scales", "mins", "d", "dmin"))
    held = sum(t.numel() * t.element_size() for t in (layer.packed, layer.highs, layer.scales_mins, layer.supers))
    assert held * 8 == weight.numel() * (4.75 if kind == "Q4_K" else 5.75)
    x = (torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)
    op = next(o for o in OPS if o.name == f"linear {kind.lower()}-a8")
    step = parts.d.repeat_interleave(8, dim=1) * parts.scales.float()
    size = (step.repeat_interleave(GROUP_SIZE, dim=1) * parts.codes.float()
            + (parts.dmin.abs().repeat_interleave(8, dim=1) * parts.mins.float()).repeat_interleave(GROUP_SIZE, dim=1))
    inputs = {"layer": layer, "x": x, "weight": weight.double(), "magnitude": size.double()}
    with torch.inference_mode():
        got = layer(x)
        expected = op.reference(inputs)
        assert ((got.double() - expected).abs() <= op.bound(inputs, expected)).all()
        assert torch.equal(got, KERNEL.kquant_linear(x, layer.packed, layer.highs, layer.scales_mins, layer.supers,
                                                     True))
        assert torch.equal(got, torch.cat([layer(x[i : i + 1]) for i in range(rows)]))
        raw2, weight2 = _kquant_raw(kind, 16, 256 * blocks, seed + 1)
        other = KQuantA8Linear(_linear_of(weight2), parse_kquant(raw2, kind))
        joined = KQuantA8Linear.joined([layer, other])
        assert torch.equal(joined(x), torch.cat([got, other(x)], dim=1))


def test_the_k_quant_kernel_gives_the_same_bits_on_every_installed_build():
    from triedec.model.gguf_blocks import parse_kquant
    from triedec.model.precision import KQuantA8Linear

    layers = [KQuantA8Linear(_linear_of(w), parse_kquant(raw, kind))
              for kind in ("Q4_K", "Q5_K") for raw, w in [_kquant_raw(kind, 13 * 16, 512, 5)]]
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _same_bits_on_every_build(lambda: [KERNEL.kquant_linear(x, m.packed, m.highs, m.scales_mins, m.supers, False)
                                       for m in layers])


def test_k_quant_layers_refuse_what_they_cannot_hold():
    """KQuantA8Linear refuses a shape its kernel cannot take and blocks of another shape; layers of
    Q4_K and Q5_K do not join; the kernel checks its buffers' shapes."""
    from triedec.model.gguf_blocks import parse_kquant
    from triedec.model.precision import KQuantA8Linear

    raw, weight = _kquant_raw("Q4_K", 16, 256, 1)
    parts = parse_kquant(raw, "Q4_K")
    with pytest.raises(TriedecError, match="input features by 256"):
        KQuantA8Linear(nn.Linear(384, 16), parts)
    with pytest.raises(TriedecError, match="blocks must be"):
        KQuantA8Linear(nn.Linear(512, 16), parts)
    four = KQuantA8Linear(_linear_of(weight), parts)
    raw5, weight5 = _kquant_raw("Q5_K", 16, 256, 2)
    five = KQuantA8Linear(_linear_of(weight5), parse_kquant(raw5, "Q5_K"))
    with pytest.raises(TriedecError, match="one block type"):
        KQuantA8Linear.joined([four, five])
    with pytest.raises(RuntimeError, match="supers must be"):
        KERNEL.kquant_linear(torch.zeros(1, 256, dtype=torch.bfloat16), four.packed, four.highs, four.scales_mins,
                             four.supers.double(), False)
    with pytest.raises(RuntimeError, match="highs must be"):
        KERNEL.kquant_linear(torch.zeros(1, 256, dtype=torch.bfloat16), four.packed, five.highs[:, :3],
                             four.scales_mins, four.supers, False)


def test_a_files_own_blocks_are_found_for_the_linears_they_became(tmp_path):
    """:func:`file_block_layers` reads a file's Q4_K, Q5_K, Q4_0, Q4_1 and Q5_1 tensors and gives each
    to the linear whose weight is its values, also with the rows in another order (transformers' q/k
    unpermuting), in that linear's row order, and to one linear only where two have the same values;
    a linear of other values, or of a tensor of another block type, gets none."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    from triedec.model.gguf_blocks import file_block_layers

    raw4, w4 = _kquant_raw("Q4_K", 32, 512, 3)
    raw5, w5 = _kquant_raw("Q5_K", 48, 256, 4)
    legacy = {kind: _scale_min_raw(kind, 32, 96, seed) for seed, kind in enumerate(("Q4_0", "Q4_1", "Q5_1"))}
    writer = GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("a.weight", raw4, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("b.weight", raw5, raw_dtype=GGMLQuantizationType.Q5_K)
    writer.add_tensor("c.weight", np.ones((16, 256), dtype=np.float32))
    for kind, (raw, _) in legacy.items():
        writer.add_tensor(f"{kind}.weight", raw, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    order = torch.randperm(48, generator=torch.Generator().manual_seed(0))
    same, shuffled = _linear_of(w4), _linear_of(w5[order])
    other, plain = _linear_of(w4 + 1), _linear_of(torch.ones(16, 256))
    flipped = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    q4_0, q4_1, q5_1 = (_linear_of(legacy["Q4_0"][1][flipped]), _linear_of(legacy["Q4_1"][1]),
                        _linear_of(legacy["Q5_1"][1]))
    twin = _linear_of(legacy["Q4_1"][1])  # the same values as q4_1: one of the two gets the tensor
    found = file_block_layers(tmp_path / "k.gguf", [other, same, shuffled, plain, q4_0, q4_1, twin, q5_1])
    assert set(found) == {id(same), id(shuffled), id(q4_0), id(q4_1), id(q5_1)}
    assert found[id(same)].bits == 4 and torch.equal(found[id(same)].values(), w4)
    assert found[id(shuffled)].bits == 5 and torch.equal(found[id(shuffled)].values(), w5[order])
    for linear, kind in ((q4_0, "Q4_0"), (q4_1, "Q4_1"), (q5_1, "Q5_1")):
        parts = found[id(linear)]
        assert parts.kind == kind and torch.equal(parts.values(), linear.weight.detach())


# ---- a GGUF Q4_0, Q4_1 or Q5_1 layer's own blocks (codes, scales and minimums) -------------------------


def _scale_min_raw(kind: str, rows: int, cols: int, seed: int):
    """Random Q4_0, Q4_1 or Q5_1 blocks ``[rows, cols / 32 * bytes]`` (uint8: any codes, an fp16 ``d``
    and ``m`` of either sign and of magnitudes 1e-5..1, some blocks with a zero ``d``) and their
    values as the ``gguf`` package dequantizes them, as transformers loads a file."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    size, halves = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q5_1": (24, 2)}[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    shape = (rows, cols // 32, halves)
    scales = np.exp(rng.uniform(np.log(1e-5), 0.0, size=shape)) * rng.choice([-1.0, 1.0], shape)
    scales[..., 0] *= rng.random(shape[:2]) > 0.05  # a constant block: d = 0
    blocks[..., 0:2 * halves] = scales.astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2 * halves)
    raw = blocks.reshape(rows, -1)
    return raw, torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[kind])))


@settings(max_examples=15, deadline=None)
@given(kind=st.sampled_from(["Q4_0", "Q4_1", "Q5_1"]), vectors=st.integers(1, 9), groups=st.integers(1, 9),
       rows=st.integers(1, 19), seed=st.integers(0, 10**6))
def test_a_scale_min_layer_is_held_as_its_files_blocks_with_their_values_and_one_rows_bits_in_any_call(
        kind, vectors, groups, rows, seed):
    """A Q4_0, Q4_1 or Q5_1 tensor's blocks, as the file stores them, are read
    (:func:`parse_scale_min`) into parts whose values are the ``gguf`` package's dequantized ones bit
    for bit, held at the file's 4.5, 5 or 6 bits a weight (:class:`ScaleMinA8Linear`; the packing
    round-trips) and multiplied within the op harness's bound of a float64 reference, with the same
    bits on the vector path and the portable one, alone and in any call (a Q4_0 layer's: those of
    the same blocks held with ``m = -8 d`` stored), and joined as the runner joins q, k and v."""
    from triedec.model.gguf_blocks import parse_scale_min
    from triedec.model.opcheck import OPS
    from triedec.model.precision import ScaleMinA8Linear, ScaleMinParts

    raw, weight = _scale_min_raw(kind, 16 * vectors, 32 * groups, seed)
    parts = parse_scale_min(raw, kind)
    assert parts is not None and parts.kind == kind
    values = parts.values()
    assert torch.equal(values, weight) and torch.equal(values.view(torch.int32), weight.view(torch.int32))
    layer = ScaleMinA8Linear(_linear_of(weight), parts)
    assert torch.equal(layer.dequantized().view(torch.int32), weight.view(torch.int32))  # bit for bit, -0 too
    back = layer.parts()
    assert back.kind == kind and all(torch.equal(getattr(back, f), getattr(parts, f)) for f in ("codes", "d", "m"))
    held = sum(t.numel() * t.element_size() for t in (layer.packed, layer.highs, layer.dm))
    assert held * 8 == weight.numel() * {"Q4_0": 4.5, "Q4_1": 5, "Q5_1": 6}[kind]
    x = (torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)
    op = next(o for o in OPS if o.name == f"linear {kind.lower()}-a8")
    size = (parts.d.abs().repeat_interleave(GROUP_SIZE, dim=1) * parts.codes.float()
            + parts.m.abs().repeat_interleave(GROUP_SIZE, dim=1))
    inputs = {"layer": layer, "x": x, "weight": weight.double(), "magnitude": size.double()}
    with torch.inference_mode():
        got = layer(x)
        expected = op.reference(inputs)
        assert ((got.double() - expected).abs() <= op.bound(inputs, expected)).all()
        assert torch.equal(got, KERNEL.scale_min_linear(x, layer.packed, layer.highs, layer.dm, True))
        assert torch.equal(got, torch.cat([layer(x[i : i + 1]) for i in range(rows)]))
        if kind == "Q4_0":  # d alone, m = -8 d in the kernel: the bits of d and m = -8 d stored
            stored = ScaleMinA8Linear(_linear_of(weight), ScaleMinParts("Q4_1", parts.codes, parts.d, parts.m))
            assert stored.dm.shape[1] == 2 and torch.equal(got, stored(x))
        raw2, weight2 = _scale_min_raw(kind, 16, 32 * groups, seed + 1)
        other = ScaleMinA8Linear(_linear_of(weight2), parse_scale_min(raw2, kind))
        joined = ScaleMinA8Linear.joined([layer, other])
        assert torch.equal(joined(x), torch.cat([got, other(x)], dim=1))


def test_the_scale_min_kernel_gives_the_same_bits_on_every_installed_build():
    from triedec.model.gguf_blocks import parse_scale_min
    from triedec.model.precision import ScaleMinA8Linear

    layers = [ScaleMinA8Linear(_linear_of(w), parse_scale_min(raw, kind))
              for kind in ("Q4_0", "Q4_1", "Q5_1") for raw, w in [_scale_min_raw(kind, 13 * 16, 160, 5)]]
    x = torch.randn(35, 160, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # 2 AMX tiles + 3
    _same_bits_on_every_build(lambda: [KERNEL.scale_min_linear(x[:r], m.packed, m.highs, m.dm, False)
                                       for m in layers for r in (11, 35)])


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["int4", "int8", "Q4_0", "Q4_1"]), vectors=st.integers(1, 9), groups=st.integers(1, 7),
       rows=st.sampled_from([16, 17, 23, 32, 35, 48, 50]), seed=st.integers(0, 10**6))
def test_calls_of_16_rows_and_more_give_each_row_the_bits_it_gets_alone(kind, vectors, groups, rows, seed):
    """Calls of 16 rows or more (a tree, a batch, a prompt chunk): on an AMX-INT8 build the tile
    unit sums the first multiple of 16 rows and the register tiles the rest
    (``csrc/x86/amx/a8_linears.h``), elsewhere the register tiles all of them; either way a row gets
    the bits it gets alone, in any cut of the call and on the portable path, over odd and even
    counts of groups and blocks of 1-4 vectors."""
    from triedec.model.gguf_blocks import parse_scale_min
    from triedec.model.precision import ScaleMinA8Linear

    torch.manual_seed(seed)
    if kind in ("int4", "int8"):
        linear = nn.Linear(GROUP_SIZE * groups, 16 * vectors, bias=False)
        layer = Int4A8Linear(linear) if kind == "int4" else Int8A8Linear(linear)
        call = ((lambda x, p: KERNEL.int4_linear(x, layer.packed, layer.scales_zeros, p)) if kind == "int4"
                else (lambda x, p: KERNEL.int8_linear(x, layer.packed, layer.scales, p)))
    else:
        raw, weight = _scale_min_raw(kind, 16 * vectors, 32 * groups, seed)
        layer = ScaleMinA8Linear(_linear_of(weight), parse_scale_min(raw, kind))
        call = lambda x, p: KERNEL.scale_min_linear(x, layer.packed, layer.highs, layer.dm, p)  # noqa: E731
    x = (torch.randn(rows, GROUP_SIZE * groups, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)
    x[1, :GROUP_SIZE] = 0  # a group of zeros, inside the first 16 rows
    with torch.inference_mode():
        got = call(x, False)
        assert torch.equal(got, call(x, True))
        assert torch.equal(got, torch.cat([call(x[i : i + 1], False) for i in range(rows)]))
        assert torch.equal(got, torch.cat([call(x[:7], False), call(x[7:], False)]))  # 16 rows from 7 on
        assert torch.equal(got, torch.cat([call(x[:16], False), call(x[16:], False)]) if rows > 16 else got)


def test_scale_min_layers_refuse_what_they_cannot_hold():
    """ScaleMinA8Linear refuses a shape its kernel cannot take and blocks of another shape; layers of
    two block types do not join; the kernel checks its buffers' shapes and dtypes; a Q4_0 tensor
    whose ``-8 d`` overflows fp16 is not read."""
    import numpy as np

    from triedec.model.gguf_blocks import parse_scale_min
    from triedec.model.precision import ScaleMinA8Linear

    raw, weight = _scale_min_raw("Q4_1", 16, 64, 1)
    parts = parse_scale_min(raw, "Q4_1")
    with pytest.raises(TriedecError, match="input features by 32"):
        ScaleMinA8Linear(nn.Linear(48, 16), parts)
    with pytest.raises(TriedecError, match="blocks must be"):
        ScaleMinA8Linear(nn.Linear(96, 16), parts)
    four = ScaleMinA8Linear(_linear_of(weight), parts)
    raw0, weight0 = _scale_min_raw("Q4_0", 16, 64, 2)
    zero = ScaleMinA8Linear(_linear_of(weight0), parse_scale_min(raw0, "Q4_0"))
    with pytest.raises(TriedecError, match="one block type"):
        ScaleMinA8Linear.joined([four, zero])
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dm must be"):
        KERNEL.scale_min_linear(x, four.packed, four.highs, four.dm.float(), False)
    with pytest.raises(RuntimeError, match="highs must be"):
        KERNEL.scale_min_linear(x, four.packed, torch.zeros(16, 3, dtype=torch.uint8), four.dm, False)
    huge = raw0.copy()
    huge[0, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)
    assert parse_scale_min(huge, "Q4_0") is None


def test_the_tensor_table_is_the_gguf_readers_and_steps_over_any_metadata(tmp_path):
    """:func:`tensor_table` gives the tensors ``gguf.GGUFReader`` gives (names, block types,
    shapes, bytes), past metadata of every value type (strings, arrays of strings and of numbers,
    nested arrays) and a file's own alignment; it refuses a file that is not GGUF."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    from triedec.model.gguf_blocks import tensor_table

    raw4, _ = _kquant_raw("Q4_K", 32, 512, 3)
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_string("a.text", "héllo")
    writer.add_array("a.words", ["one", "twö", "", "three"])
    writer.add_array("a.numbers", [1.5, 2.5, 3.5])
    writer.add_array("a.nested", [[1, 2], [3]])
    writer.add_bool("a.flag", True)
    writer.add_uint64("a.big", 2**40)
    writer.add_int8("a.small", -3)
    writer.add_float64("a.real", 0.25)
    writer.add_tensor("a.weight", raw4, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("b.weight", np.arange(48, dtype=np.float32).reshape(3, 16))
    writer.add_tensor("c.weight", np.arange(7, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    table, reader = tensor_table(path), GGUFReader(str(path)).tensors
    assert [t.name for t in table] == [t.name for t in reader] == ["a.weight", "b.weight", "c.weight"]
    for mine, theirs in zip(table, reader, strict=True):
        assert mine.kind == theirs.tensor_type.name and mine.shape == tuple(int(x) for x in theirs.shape)
        assert np.array_equal(np.asarray(mine.data), np.asarray(theirs.data).view(np.uint8).reshape(-1))
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        tensor_table(tmp_path / "not.gguf")
