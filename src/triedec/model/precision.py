"""Precision modes: what a loaded model's weights and activations are stored in.

A decoding step on a CPU is bound by reading the weights, so the mode sets the step's speed:

* ``float`` weights: every weight in the activation dtype, ``float32`` unless ``dtype`` says
  ``bfloat16`` or ``float16`` (what ``weights="auto"``, the loading default, gives anything but a
  4-bit GGUF file: :class:`triedec.model.source.ModelSource`);
* ``int8``: each linear layer's weight quantized to int8, symmetric, one scale per output row
  (``scale = max |w| / 127``, rounded to bf16 first; the codes are then ``round(w / scale)``);
* ``int4``: each linear layer's weight quantized to 4 bits in groups of :data:`GROUP_SIZE`
  consecutive input features, affine (per group a bf16 ``scale`` and bf16 ``zero``, ``w = (q - 8)
  * scale + zero`` with ``q`` in 0..15, the layout torch's int4 CPU kernel reads), the LM head
  int8 as above (see :func:`quantize_linears`). Q4_0/Q4_1 GGUF files use the same group size, so
  their codes are recovered (see ``docs/precision.md``);
* ``int4-a8``: int4's weights (the same codes, scales and zeros), whose dot products run on the
  activations quantized to int8 per row and group of :data:`GROUP_SIZE` features, as llama.cpp
  runs a Q4 file: triedec's own kernel (``csrc/a8_linears.cpp``; AVX512-VNNI where the CPU has it,
  else AVX2, else a portable path, all giving the same bits); the LM head, and the layers a 4-bit GGUF stored
  with more bits, int8 with an fp16 scale per output and group of :data:`GROUP_SIZE` (GGUF's Q8_0
  layout, :func:`quantize_int8_groups`: a file's Q8_0 and Q5_0 blocks are kept bit for bit; Q5_0
  layers held at their 5.5 bits, :class:`Int5A8Linear`, and Q6_K layers, whose scale changes every
  16 weights, at their 6.6 bits with their values, :class:`Int6A8Linear`); loaded from a GGUF
  file, its Q4_K and Q5_K layers (:class:`KQuantA8Linear`) and Q4_0, Q4_1 and Q5_1 layers
  (:class:`ScaleMinA8Linear`) are the file's own blocks, read from it
  (:mod:`triedec.model.gguf_blocks`). What ``weights="auto"`` gives a GGUF file stored in 4 bits
  on a CPU with AVX2 or AVX512-VNNI.

Quantized weights run with ``bfloat16`` activations (torch's weight-only CPU kernels,
``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu``; with float32 activations they take a
reference path many times slower). Embeddings, norms and everything else stay in the activation
dtype. A linear the int4 kernel cannot take (output rows not a multiple of 16, or input features
not a multiple of the group size) stays unquantized, and :func:`quantize_linears` counts it.

Every kernel used here computes a row the same way whatever other rows share the call (measured by
``tests/test_precision.py`` and the load-time self-test), which is what keeps speculative decoding
lossless in every mode: each method returns the tokens plain decoding returns *in the same mode*.
Pure torch (nothing here knows transformers).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from triedec.core.errors import TriedecError
from triedec.core.params import GROUP_SIZE, WEIGHTS
from triedec.model.linears import VECTOR, JoinedPart, LinearStandIn, blocked, empty_join, joined_bias, unblocked
from triedec.model.native import load_kernel

QUANTIZED_DTYPE = torch.bfloat16
"""The activation dtype quantized weights run with."""
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype from a ``torch.dtype`` or one of its names (``float32``, ``bf16``, ...)."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise TriedecError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise TriedecError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")


@dataclass(frozen=True)
class Precision:
    """A precision mode: the activation ``dtype`` and how the linear weights are stored.

    Build it with :meth:`of`, which fills the dtype (float32, or bfloat16 for quantized weights)
    and refuses combinations no kernel runs."""

    dtype: torch.dtype = torch.float32
    weights: str = "float"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise TriedecError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        if self.weights != "float" and self.dtype != QUANTIZED_DTYPE:
            raise TriedecError(f"weights={self.weights!r} runs with bfloat16 activations (torch's weight-only CPU "
                               f"kernels); pass dtype='bfloat16' or leave dtype unset, not {_name(self.dtype)}")

    @classmethod
    def of(cls, dtype: torch.dtype | str | None = None, weights: str = "float") -> Precision:
        """The mode for ``dtype`` (``None``: float32, or bfloat16 when ``weights`` are quantized)
        and ``weights`` (one of :data:`WEIGHTS`)."""
        if dtype is None:  # an unknown ``weights`` is refused by the constructor
            return cls(QUANTIZED_DTYPE if weights != "float" else torch.float32, weights)
        return cls(resolve_dtype(dtype), weights)

    @property
    def quantized(self) -> bool:
        return self.weights != "float"

    @property
    def name(self) -> str:
        """``float32``, ``bfloat16``, ``int8-bfloat16``, ``int4g32-bfloat16``, ``int4g32a8-bfloat16``:
        what results record."""
        weights = {"float": "", "int8": "int8-", "int4": f"int4g{GROUP_SIZE}-", "int4-a8": f"int4g{GROUP_SIZE}a8-"}[
            self.weights]
        return f"{weights}{_name(self.dtype)}"

    def check_device(self, device: torch.device | str) -> None:
        if self.quantized and torch.device(device).type != "cpu":
            raise TriedecError(f"weights={self.weights!r} runs on CPU only (torch's weight-only CPU kernels); "
                               f"use bfloat16 weights on {torch.device(device).type}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Int8Linear(LinearStandIn):
    """``y = x (q * scale)^T + b``: int8 weight ``q [out, in]``, bf16 ``scale [out]`` (inference
    only; bf16 activations)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        with torch.no_grad():
            weight = linear.weight.detach().float()
            scale = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(QUANTIZED_DTYPE)
            codes = torch.round(weight / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.bias = _bias(linear)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``[out, in]`` in float32 (exact)."""
        return self.codes.float() * self.scale.float()[:, None]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers  # read directly: skips a module attribute lookup, paid by every layer every step
        return _plus_bias(_INT8_MM(x, buffers["codes"], buffers["scale"]), self.bias)


class Int4Linear(LinearStandIn):
    """``y = x w^T + b`` with ``w = (q - 8) * scale + zero`` per group of :data:`GROUP_SIZE` input
    features: 4-bit codes ``q`` packed for torch's CPU kernel, and ``scales_and_zeros [in /
    GROUP_SIZE, out, 2]`` (bf16 ``scale`` and ``zero``; inference only; bf16 activations).
    ``steps``: the weight's :func:`grid_steps`, where the caller has them (:func:`quantize_int4`)."""

    def __init__(self, linear: nn.Linear, steps: torch.Tensor | None = None) -> None:
        super().__init__(linear)
        if not int4_fits(linear):
            raise TriedecError(f"int4 needs output rows divisible by 16 and input features by {GROUP_SIZE}, "
                               f"got {self.out_features}x{self.in_features}")
        codes, scale, zero = quantize_int4(linear.weight.detach(), steps)
        self.register_buffer("scales_and_zeros", torch.stack(
            [scale.to(QUANTIZED_DTYPE), zero.to(QUANTIZED_DTYPE)], dim=-1).contiguous())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1))
        self.bias = _bias(linear)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return _plus_bias(_INT4_MM(x, buffers["packed"], GROUP_SIZE, buffers["scales_and_zeros"]), self.bias)

    def repr_extra(self) -> str:
        return f", group_size={GROUP_SIZE}"


class Int4A8Linear(LinearStandIn):
    """``y = x w^T + b`` with :class:`Int4Linear`'s weights (the same codes, scales and zeros),
    computed by triedec's kernel on ``x`` quantized to int8 per row and group of :data:`GROUP_SIZE`
    features (``csrc/a8_linears.cpp`` gives the exact arithmetic): integer dot products per group,
    exact in any order, then a fixed float32 sum over the groups, so a row gets the same bits in any
    call, on any CPU. Codes, scales and zeros are stored packed for the kernel
    (:func:`pack_int4`, :func:`pack_scales_zeros`). Inference only; bf16 activations. ``steps`` as
    for :class:`Int4Linear`."""

    def __init__(self, linear: nn.Linear, steps: torch.Tensor | None = None) -> None:
        super().__init__(linear)
        if not int4_fits(linear):
            raise TriedecError(f"int4 needs output rows divisible by 16 and input features by {GROUP_SIZE}, "
                               f"got {self.out_features}x{self.in_features}")
        load_kernel()  # refused here, with the reason, when triedec's kernels cannot be built
        codes, scale, zero = quantize_int4(linear.weight.detach(), steps)
        self.register_buffer("packed", pack_int4(codes))
        self.register_buffer("scales_zeros", pack_scales_zeros(scale, zero))
        self.bias = _bias(linear)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes ``[out, in]`` (int32, 0..15)."""
        return unpack_int4(self.packed)

    def scale_and_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bf16 ``scale`` and ``zero`` ``[in / GROUP_SIZE, out]``."""
        return unpack_scales_zeros(self.scales_zeros)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        out = load_kernel().int4_linear(x, buffers["packed"], buffers["scales_zeros"], False)
        return _plus_bias(out, self.bias)

    @classmethod
    def joined(cls, layers: Sequence[Int4A8Linear]) -> Int4A8Linear:
        """One layer whose outputs are ``layers``' outputs side by side (a layer's q, k and v
        projections as one call), for layers of one input size, all with biases or none. Each
        output keeps its codes, scale, zero and bias, and the kernel computes an output from those
        and its row alone, in a fixed order: every output gets the bits its own layer gives it."""
        joined = empty_join(cls, layers)
        scales, zeros = zip(*(m.scale_and_zero() for m in layers), strict=True)
        joined.register_buffer("packed", pack_int4(torch.cat([m.codes() for m in layers])))
        joined.register_buffer("scales_zeros", pack_scales_zeros(torch.cat(scales, dim=1), torch.cat(zeros, dim=1)))
        joined.bias = joined_bias(layers)
        return joined

    def repr_extra(self) -> str:
        return f", group_size={GROUP_SIZE}, activations=int8"


class Int8A8Linear(LinearStandIn):
    """``y = x w^T + b`` with ``w = q * scale``: int8 codes ``q`` and an fp16 ``scale`` per output
    and group of :data:`GROUP_SIZE` input features (a GGUF Q8_0 block's format; a Q8_0 or Q5_0
    file's blocks keep their values exactly: :func:`quantize_int8_groups`), computed by triedec's
    kernel on ``x`` quantized to int8 per row and group of :data:`GROUP_SIZE` features
    (``csrc/a8_linears.cpp``): the LM head of ``int4-a8`` mode, and the layers a 4-bit file stored
    with more bits. Output rows a multiple of 16, input features of :data:`GROUP_SIZE`. Inference
    only; bf16 activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        if not int4_fits(linear):
            raise TriedecError(f"the int8 kernel on 8-bit activations needs output rows divisible by 16 and input "
                               f"features by {GROUP_SIZE}, got {self.out_features}x{self.in_features}")
        load_kernel()
        codes, scale = quantize_int8_groups(linear.weight.detach())
        self.register_buffer("packed", pack_int8(codes))
        self.register_buffer("scales", pack_int8_scales(scale))
        self.bias = _bias(linear)

    def codes_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 codes ``[out, in]`` and the fp16 scales ``[out, in / GROUP_SIZE]``."""
        return unpack_int8(self.packed), unpack_int8_scales(self.scales)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``[out, in]`` in float32 (exact)."""
        codes, scale = self.codes_and_scales()
        return codes.float() * scale.float().repeat_interleave(GROUP_SIZE, dim=1)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return _plus_bias(load_kernel().int8_linear(x, buffers["packed"], buffers["scales"], False), self.bias)

    @classmethod
    def joined(cls, layers: Sequence[Int8A8Linear]) -> Int8A8Linear:
        """As :meth:`Int4A8Linear.joined`: the outputs of ``layers`` side by side, each with its own bits."""
        joined = empty_join(cls, layers)
        codes, scales = zip(*(m.codes_and_scales() for m in layers), strict=True)
        joined.register_buffer("packed", pack_int8(torch.cat(codes)))
        joined.register_buffer("scales", pack_int8_scales(torch.cat(scales)))
        joined.bias = joined_bias(layers)
        return joined

    def repr_extra(self) -> str:
        return f", group_size={GROUP_SIZE}, activations=int8"


class Int5A8Linear(Int8A8Linear):
    """:class:`Int8A8Linear` whose codes all lie in -16..15 (a GGUF Q5_0 file's layers, as
    :func:`quantize_int8_groups` keeps them), held in 5 bits a weight plus the fp16 scale per group
    (5.5 bits, the file's) instead of 8.5: the low 4 bits of ``u = q + 16`` in int4's order
    (``packed``) and a plane of the fifth bits (``highs``), ``csrc/a8_linears.cpp``. Its kernel
    sums the same integers with the same float steps as the int8 one, so it gives the same bits
    as :class:`Int8A8Linear` on the same weights (tests/test_native_kernels.py)."""

    def __init__(self, linear: nn.Linear, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        LinearStandIn.__init__(self, linear)
        if not int4_fits(linear):
            raise TriedecError(f"the int5 kernel on 8-bit activations needs output rows divisible by 16 and input "
                               f"features by {GROUP_SIZE}, got {self.out_features}x{self.in_features}")
        load_kernel()
        codes, scale = int5_codes(linear.weight.detach(), quantized)
        self._pack(codes, scale)
        self.bias = _bias(linear)

    def _pack(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        packed, highs = pack_int5(codes)
        self.register_buffer("packed", packed)
        self.register_buffer("highs", highs)
        self.register_buffer("scales", pack_int8_scales(scale))

    def codes_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_int5(self.packed, self.highs), unpack_int8_scales(self.scales)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return _plus_bias(load_kernel().int5_linear(x, buffers["packed"], buffers["highs"], buffers["scales"], False),
                          self.bias)

    @classmethod
    def joined(cls, layers: Sequence[Int8A8Linear]) -> Int5A8Linear:
        joined = empty_join(cls, layers)
        codes, scales = zip(*(m.codes_and_scales() for m in layers), strict=True)
        joined._pack(torch.cat(codes), torch.cat(scales))
        joined.bias = joined_bias(layers)
        return joined

    def repr_extra(self) -> str:
        return f", group_size={GROUP_SIZE}, bits=5, activations=int8"


def fits_int5(codes: torch.Tensor) -> bool:
    """Whether each group of :data:`GROUP_SIZE` int8 ``codes [N, K]`` lies in -16..15 or in -15..16
    (a Q5_0 block's codes, ``d`` of either sign): :class:`Int5A8Linear` holds them."""
    groups = codes.reshape(codes.shape[0], -1, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    return bool(codes.numel()) and bool((((low >= -16) & (high <= 15)) | ((low >= -15) & (high <= 16))).all())


def int5_codes(weight: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8_groups`'s codes and scales of ``weight``, each group whose codes reach
    16 negated with its scale (so every code is in -16..15): ``a D s`` with both signs flipped is the
    same float, bit for bit (``fma(-(a D), -s, y) = fma(a D, s, y)``). Raises when a group does not
    fit (:func:`fits_int5`). ``quantized``: that function's result, when the caller has it."""
    codes, scale = quantize_int8_groups(weight) if quantized is None else quantized
    if not fits_int5(codes):
        raise TriedecError("an int5 layer's codes must lie in -16..15 or -15..16 per group (a Q5_0 block's)")
    groups = codes.reshape(codes.shape[0], -1, GROUP_SIZE)
    flip = groups.amax(-1) > 15
    codes = torch.where(flip[..., None], -groups, groups).reshape(codes.shape)
    return codes, torch.where(flip, -scale, scale)


def pack_int5(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` in -16..15 as :class:`Int5A8Linear` holds them: ``u = codes + 16``'s low
    4 bits in :func:`pack_int4`'s order ``[N, K / 2]``, and its fifth bits ``[N, K / 8]``: per
    block, group, step of 8 features and 16 outputs, two 64-bit masks (little-endian), the first's
    bit ``4i + j`` the fifth bit of output ``i``'s feature ``j`` of the step (byte ``4i + j``'s low
    nibble), the second's of its feature ``4 + j`` (that byte's high nibble)."""
    n, k = codes.shape
    u = (codes.to(torch.int16) + 16).to(torch.uint8)
    masks = _plane_masks(u >> 4)
    return pack_int4(u & 0x0F), masks.contiguous().view(torch.uint8).reshape(n, k // 8).contiguous()


def unpack_int5(packed: torch.Tensor, highs: torch.Tensor) -> torch.Tensor:
    """The codes ``[N, K]`` (int8) that :func:`pack_int5` packed."""
    n, k = packed.shape[0], packed.shape[1] * 2
    high = _plane_bits(highs.reshape(-1).view(torch.int64).reshape(-1, 2), n, k)
    return (unpack_int4(packed) + 16 * high - 16).to(torch.int8)


def _plane_masks(bits: torch.Tensor) -> torch.Tensor:
    """A plane of one bit per weight, ``bits [N, K]`` (0 or 1), as int5's masks: per block, group,
    step of 8 features and 16 outputs, two int64 (bit ``4i + j``: output ``i``'s feature ``j`` of the
    step, then its feature ``4 + j``). Shape ``[steps, 2]``."""
    n, k = bits.shape
    high = bits.to(torch.int64).reshape(n, k // GROUP_SIZE, 4, 2, 4)  # n, g, m, half, j
    per_output = (high << torch.arange(4)).sum(-1)  # n, g, m, half: 4 bits of output n
    flat = blocked(per_output).reshape(-1, VECTOR, 2)
    return (flat << (4 * torch.arange(VECTOR))[None, :, None]).sum(1)  # [steps, 2]: bits 4i + j


def _plane_bits(masks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The plane ``[n, k]`` (int32, 0 or 1) that :func:`_plane_masks` gave as ``masks [steps, 2]``."""
    bits = (masks.reshape(-1, 1, 2) >> (4 * torch.arange(VECTOR))[None, :, None]) & 0x0F  # steps, i, half
    per_output = unblocked(bits.reshape(-1), n, k // GROUP_SIZE, 4, 2)  # n, g, m, half
    return ((per_output[..., None] >> torch.arange(4)) & 1).reshape(n, k).to(torch.int32)  # n, g, m, half, j


SUPER_BLOCK = 256
"""Input features per super-block of a GGUF K-quant (Q6_K's float scale ``d``)."""
HALF_GROUP = GROUP_SIZE // 2
"""Input features per Q6_K sub-block (its int8 scale)."""


class Int6A8Linear(LinearStandIn):
    """``y = x w^T + b`` with ``w = q * S * d``: a GGUF Q6_K layer at its own 6.6 bits a weight
    (the file's 6.56), codes ``q`` in -32..31, an int8 ``S`` per output and :data:`HALF_GROUP`
    input features and a float32 ``d`` per output and :data:`SUPER_BLOCK` (:func:`q6_codes` finds
    them in the file's dequantized values, bit for bit), computed by triedec's kernel on ``x``
    quantized to int8 per row and group of :data:`GROUP_SIZE` features (``csrc/a8_linears.cpp``:
    per group the two half sums times their ``S`` in int32, then one float step as int8's on the
    super-block's ``d``): ``u = q + 32``'s low 4 bits in int4's order (``packed``), its top two
    bits beside them (``highs``, :func:`pack_int6`), ``scales`` int8 ``[K / 16, N]`` and ``supers``
    float32 ``[K / 256, N]`` in the kernel's block order. Output rows a multiple of 16, input
    features of :data:`SUPER_BLOCK`. Inference only; bf16 activations."""

    def __init__(self, linear: nn.Linear,
                 quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__(linear)
        if linear.out_features % 16 or linear.in_features % SUPER_BLOCK:
            raise TriedecError(f"the int6 kernel needs output rows divisible by 16 and input features by "
                               f"{SUPER_BLOCK}, got {self.out_features}x{self.in_features}")
        load_kernel()
        found = q6_codes(linear.weight.detach()) if quantized is None else quantized
        if found is None:
            raise TriedecError("an int6 layer's weights must be a Q6_K block's: q * S * d, q in -32..31, an int8 S "
                               f"per {HALF_GROUP} and one d per {SUPER_BLOCK} input features")
        self._pack(*found)
        self.bias = _bias(linear)

    def _pack(self, codes: torch.Tensor, subs: torch.Tensor, supers: torch.Tensor) -> None:
        packed, highs = pack_int6(codes)
        self.register_buffer("packed", packed)
        self.register_buffer("highs", highs)
        self.register_buffer("scales", blocked(subs[..., None, None]).reshape(subs.shape[1], -1).contiguous())
        self.register_buffer("supers", blocked(supers.float()[..., None, None]).reshape(supers.shape[1], -1)
                             .contiguous())

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes ``[out, in]`` (int8), the scales ``S [out, in / 16]`` (int8) and ``d [out, in /
        256]`` (float32)."""
        n = self.out_features
        subs = unblocked(self.scales.reshape(-1), n, self.scales.shape[0], 1, 1)[..., 0, 0]
        supers = unblocked(self.supers.reshape(-1), n, self.supers.shape[0], 1, 1)[..., 0, 0]
        return unpack_int6(self.packed, self.highs), subs, supers

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``[out, in]`` in float32 (exact: a Q6_K block's values)."""
        codes, subs, supers = self.parts()
        return _q6_values(codes, subs, supers).float()

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        out = load_kernel().int6_linear(x, buffers["packed"], buffers["highs"], buffers["scales"], buffers["supers"],
                                        False)
        return _plus_bias(out, self.bias)

    @classmethod
    def joined(cls, layers: Sequence[Int6A8Linear]) -> Int6A8Linear:
        """As :meth:`Int4A8Linear.joined`: the outputs of ``layers`` side by side, each with its own bits."""
        joined = empty_join(cls, layers)
        codes, subs, supers = zip(*(m.parts() for m in layers), strict=True)
        joined._pack(torch.cat(codes), torch.cat(subs), torch.cat(supers))
        joined.bias = joined_bias(layers)
        return joined

    def repr_extra(self) -> str:
        return f", super_block={SUPER_BLOCK}, bits=6, activations=int8"


@dataclass(frozen=True)
class KQuantParts:
    """A GGUF Q4_K or Q5_K layer's blocks as the file holds them, ``w = d * sc * q - dmin * m``:
    ``codes [N, K]`` (uint8, 0..15 or 0..31), ``scales`` and ``mins`` ``[N, K / 32]`` (uint8,
    0..63), ``d`` and ``dmin`` ``[N, K / 256]`` (float32, the file's fp16 values); ``bits`` 4 or 5.
    :mod:`triedec.model.gguf_blocks` reads them from the file."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    def values(self) -> torch.Tensor:
        """The weight ``[N, K]`` in float32 as the ``gguf`` package dequantizes it, bit for bit:
        ``(d * sc) * q - dmin * m``, each product and the difference one float32 operation."""
        step = (self.d[..., None] * self.scales.float().reshape(*self.d.shape, 8)).reshape(self.scales.shape)
        low = (self.dmin[..., None] * self.mins.float().reshape(*self.dmin.shape, 8)).reshape(self.mins.shape)
        q = self.codes.float().reshape(*self.scales.shape, GROUP_SIZE)
        return (step[..., None] * q - low[..., None]).reshape(self.codes.shape)

    def rows(self, order: torch.Tensor) -> KQuantParts:
        """These blocks with their rows (outputs) in ``order``: row ``i`` is this one's ``order[i]``."""
        return KQuantParts(self.bits, self.codes[order], self.scales[order], self.mins[order], self.d[order],
                           self.dmin[order])


class KQuantA8Linear(LinearStandIn):
    """``y = x w^T + b`` with a GGUF Q4_K or Q5_K layer's own blocks, ``w = d * sc * q - dmin * m``
    (:class:`KQuantParts`, read from the file: its values bit for bit), at 4.75 or 5.75 bits a
    weight (the file's 4.5 and 5.5), computed by triedec's kernel on ``x`` quantized to int8 per row
    and group of :data:`GROUP_SIZE` features (``csrc/a8_linears.cpp``, ``kquant_linear``: per group
    ``I = sc D`` and ``J = m Q`` in int32, then ``y = fma(a I, d, y); y = fma(a J, -dmin, y)``):
    the codes in int4's layout (``packed``) with, for Q5_K, int5's plane of fifth bits
    (``highs``; ``[N, 0]`` for Q4_K), ``scales_mins`` int8 ``[K / 32, 2, N]`` and ``supers``
    float32 ``[K / 256, 2, N]`` (``d``, ``-dmin``) in the kernel's block order. Output rows a
    multiple of 16, input features of :data:`SUPER_BLOCK`. Inference only; bf16 activations."""

    def __init__(self, linear: nn.Linear, parts: KQuantParts) -> None:
        super().__init__(linear)
        if linear.out_features % 16 or linear.in_features % SUPER_BLOCK:
            raise TriedecError(f"the K-quant kernel needs output rows divisible by 16 and input features by "
                               f"{SUPER_BLOCK}, got {self.out_features}x{self.in_features}")
        if parts.codes.shape != (self.out_features, self.in_features) or parts.bits not in (4, 5):
            raise TriedecError(f"a Q4_K or Q5_K layer's blocks must be [{self.out_features}, {self.in_features}], "
                               f"got {tuple(parts.codes.shape)} at {parts.bits} bits")
        load_kernel()
        self.bits = parts.bits
        self._pack(parts)
        self.bias = _bias(linear)

    def _pack(self, parts: KQuantParts) -> None:
        n = parts.codes.shape[0]
        if parts.bits == 5:
            packed, highs = pack_int5(parts.codes.to(torch.int16) - 16)
        else:
            packed, highs = pack_int4(parts.codes), torch.zeros(n, 0, dtype=torch.uint8)
        self.register_buffer("packed", packed)
        self.register_buffer("highs", highs)
        both = torch.stack([parts.scales, parts.mins], dim=-1).to(torch.int8)[..., None]
        self.register_buffer("scales_mins", blocked(both).reshape(-1, 2, n).contiguous())
        supers = torch.stack([parts.d, -parts.dmin], dim=-1).float()[..., None]
        self.register_buffer("supers", blocked(supers).reshape(-1, 2, n).contiguous())

    def parts(self) -> KQuantParts:
        """The blocks this layer holds (:class:`KQuantParts`)."""
        n, k = self.out_features, self.in_features
        codes = (unpack_int5(self.packed, self.highs).to(torch.int16) + 16 if self.bits == 5
                 else unpack_int4(self.packed))
        both = unblocked(self.scales_mins.reshape(-1), n, k // GROUP_SIZE, 2, 1)
        supers = unblocked(self.supers.reshape(-1), n, k // SUPER_BLOCK, 2, 1)
        return KQuantParts(self.bits, codes.to(torch.uint8), both[:, :, 0, 0].to(torch.uint8),
                           both[:, :, 1, 0].to(torch.uint8), supers[:, :, 0, 0].contiguous(),
                           (-supers[:, :, 1, 0]).contiguous())

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``[out, in]`` in float32 (the file's values)."""
        return self.parts().values()

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        out = load_kernel().kquant_linear(x, buffers["packed"], buffers["highs"], buffers["scales_mins"],
                                          buffers["supers"], False)
        return _plus_bias(out, self.bias)

    @classmethod
    def joined(cls, layers: Sequence[KQuantA8Linear]) -> KQuantA8Linear:
        """As :meth:`Int4A8Linear.joined`, for layers of one block type: the outputs side by side,
        each with its own bits."""
        if len({m.bits for m in layers}) != 1:
            raise TriedecError("only K-quant layers of one block type (Q4_K or Q5_K) join")
        joined = empty_join(cls, layers)
        parts = [m.parts() for m in layers]
        joined.bits = layers[0].bits
        joined._pack(KQuantParts(joined.bits, *(torch.cat([getattr(p, f) for p in parts])
                                                for f in ("codes", "scales", "mins", "d", "dmin"))))
        joined.bias = joined_bias(layers)
        return joined

    def repr_extra(self) -> str:
        return f", super_block={SUPER_BLOCK}, bits={self.bits}, mins=True, activations=int8"


SCALE_MIN_KINDS = ("Q4_0", "Q4_1", "Q5_1")
"""The GGUF block types :class:`ScaleMinA8Linear` holds: ``w = d * q + m`` per group of 32."""


@dataclass(frozen=True)
class ScaleMinParts:
    """A GGUF Q4_0, Q4_1 or Q5_1 layer's blocks as the file holds them, ``w = d * q + m``: ``codes
    [N, K]`` (uint8, 0..15, or 0..31 for Q5_1), ``d`` and ``m`` ``[N, K / 32]`` (float32, the file's
    fp16 values; a Q4_0 block, ``w = d * (q - 8)``, has ``m = -8 d``, exact in fp16); ``kind`` the
    block type (:data:`SCALE_MIN_KINDS`). :mod:`triedec.model.gguf_blocks` reads them from the file."""

    kind: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def bits(self) -> int:
        """The codes' width: 5 for Q5_1, else 4."""
        return 5 if self.kind == "Q5_1" else 4

    def values(self) -> torch.Tensor:
        """The weight ``[N, K]`` in float32 as the ``gguf`` package dequantizes it, bit for bit:
        ``d * q + m``, the product and the sum one float32 operation each; for Q4_0 ``d * (q -
        8)``, the same number (``d * q`` and ``8 d`` are exact in float32) but for the sign of a
        zero."""
        q = self.codes.float().reshape(*self.d.shape, GROUP_SIZE)
        if self.kind == "Q4_0":
            return (self.d[..., None] * (q - 8)).reshape(self.codes.shape)
        return (self.d[..., None] * q + self.m[..., None]).reshape(self.codes.shape)

    def rows(self, order: torch.Tensor) -> ScaleMinParts:
        """These blocks with their rows (outputs) in ``order``: row ``i`` is this one's ``order[i]``."""
        return ScaleMinParts(self.kind, self.codes[order], self.d[order], self.m[order])


class ScaleMinA8Linear(LinearStandIn):
    """``y = x w^T + b`` with a GGUF Q4_0, Q4_1 or Q5_1 layer's own blocks, ``w = d * q + m``
    (:class:`ScaleMinParts`, read from the file: its values bit for bit), at the file's bits: 4.5,
    5 and 6 a weight, computed by triedec's kernel on ``x`` quantized to int8 per row and group of
    :data:`GROUP_SIZE` features (``csrc/a8_linears.cpp``, ``scale_min_linear``: per group ``D`` in
    int32, then ``y = fma(a D, d, y); y = fma(a Q, m, y)``, int4's float steps; for Q4_0 ``m = -8
    d``, computed): the codes in int4's layout (``packed``) with, for Q5_1, int5's plane of fifth
    bits (``highs``; ``[N, 0]`` for 4-bit codes), and ``dm`` fp16 ``[K / 32, 2, N]`` in int4's order
    of scales and zeros (Q4_0: its ``d`` alone, ``[K / 32, 1, N]``). Output rows a multiple of 16,
    input features of :data:`GROUP_SIZE`. Inference only; bf16 activations."""

    def __init__(self, linear: nn.Linear, parts: ScaleMinParts) -> None:
        super().__init__(linear)
        if not int4_fits(linear):
            raise TriedecError(f"the scale-min kernel needs output rows divisible by 16 and input features by "
                               f"{GROUP_SIZE}, got {self.out_features}x{self.in_features}")
        if parts.codes.shape != (self.out_features, self.in_features) or parts.kind not in SCALE_MIN_KINDS:
            raise TriedecError(f"a Q4_0, Q4_1 or Q5_1 layer's blocks must be [{self.out_features}, "
                               f"{self.in_features}], got {tuple(parts.codes.shape)} of {parts.kind}")
        load_kernel()
        self.kind, self.bits = parts.kind, parts.bits
        self._pack(parts)
        self.bias = _bias(linear)

    def _pack(self, parts: ScaleMinParts) -> None:
        n = parts.codes.shape[0]
        if parts.bits == 5:
            packed, highs = pack_int5(parts.codes.to(torch.int16) - 16)
        else:
            packed, highs = pack_int4(parts.codes), torch.zeros(n, 0, dtype=torch.uint8)
        self.register_buffer("packed", packed)
        self.register_buffer("highs", highs)
        numbers = [parts.d] if parts.kind == "Q4_0" else [parts.d, parts.m]  # Q4_0: m = -8 d, in the kernel
        both = torch.stack(numbers, dim=-1).to(torch.float16)[..., None]
        self.register_buffer("dm", blocked(both).reshape(-1, len(numbers), n).contiguous())

    def parts(self) -> ScaleMinParts:
        """The blocks this layer holds (:class:`ScaleMinParts`)."""
        n, k = self.out_features, self.in_features
        codes = (unpack_int5(self.packed, self.highs).to(torch.int16) + 16 if self.bits == 5
                 else unpack_int4(self.packed))
        both = unblocked(self.dm.reshape(-1), n, k // GROUP_SIZE, self.dm.shape[1], 1).float()
        d = both[:, :, 0, 0].contiguous()
        m = d * -8 if self.kind == "Q4_0" else both[:, :, 1, 0].contiguous()
        return ScaleMinParts(self.kind, codes.to(torch.uint8), d, m)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``[out, in]`` in float32 (the file's values)."""
        return self.parts().values()

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        out = load_kernel().scale_min_linear(x, buffers["packed"], buffers["highs"], buffers["dm"], False)
        return _plus_bias(out, self.bias)

    @classmethod
    def joined(cls, layers: Sequence[ScaleMinA8Linear]) -> ScaleMinA8Linear:
        """As :meth:`Int4A8Linear.joined`, for layers of one block type: the outputs side by side,
        each with its own bits."""
        if len({m.kind for m in layers}) != 1:
            raise TriedecError("only scale-min layers of one block type (Q4_0, Q4_1 or Q5_1) join")
        joined = empty_join(cls, layers)
        parts = [m.parts() for m in layers]
        joined.kind, joined.bits = layers[0].kind, layers[0].bits
        joined._pack(ScaleMinParts(joined.kind, *(torch.cat([getattr(p, f) for p in parts])
                                                  for f in ("codes", "d", "m"))))
        joined.bias = joined_bias(layers)
        return joined

    def repr_extra(self) -> str:
        return f", group_size={GROUP_SIZE}, kind={self.kind}, activations=int8"


FileBlocks = KQuantParts | ScaleMinParts
"""A layer's blocks as a GGUF file holds them, for the kernel that reads those blocks."""


def file_block_layer(linear: nn.Linear, parts: FileBlocks) -> KQuantA8Linear | ScaleMinA8Linear:
    """The stand-in that holds ``parts``, a file's own blocks of ``linear``."""
    return KQuantA8Linear(linear, parts) if isinstance(parts, KQuantParts) else ScaleMinA8Linear(linear, parts)


def pack_int6(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` in -32..31 as :class:`Int6A8Linear` holds them: ``u = codes + 32``'s low 4
    bits in :func:`pack_int4`'s order ``[N, K / 2]``, and its top two bits ``u >> 4`` ``[N, K /
    4]``: per block, group, step of 8 features and 16 outputs (64 bytes of :func:`pack_int4`), 32
    bytes, byte ``k`` holding in bits 0-1 the top bits of the code in the low nibble of the step's
    byte ``k``, in bits 2-3 of byte ``32 + k``'s low nibble, in bits 4-5 of byte ``k``'s high
    nibble and in bits 6-7 of byte ``32 + k``'s high nibble."""
    n, k = codes.shape
    u = (codes.to(torch.int16) + 32).to(torch.uint8)
    tops = (u >> 4).reshape(n, k // GROUP_SIZE, 4, 2, 4)  # n, g, m, nibble, j
    low, high = (blocked(tops[..., half, :]).reshape(-1, 2, 32) for half in (0, 1))  # [steps, byte // 32, byte % 32]
    packed_tops = low[:, 0] | (low[:, 1] << 2) | (high[:, 0] << 4) | (high[:, 1] << 6)
    return pack_int4(u & 0x0F), packed_tops.reshape(n, k // 4).contiguous()


def unpack_int6(packed: torch.Tensor, highs: torch.Tensor) -> torch.Tensor:
    """The codes ``[N, K]`` (int8) that :func:`pack_int6` packed."""
    n, k = packed.shape[0], packed.shape[1] * 2
    tops = highs.reshape(-1, 1, 32).to(torch.int32)
    low = torch.cat([tops & 3, (tops >> 2) & 3], dim=1).reshape(-1)  # the step's 64 bytes in order
    high = torch.cat([(tops >> 4) & 3, (tops >> 6) & 3], dim=1).reshape(-1)
    per_byte = [unblocked(t, n, k // GROUP_SIZE, 4, 4) for t in (low, high)]  # n, g, m, j
    top = torch.stack(per_byte, dim=3).reshape(n, k)
    return (unpack_int4(packed) + 16 * top - 32).to(torch.int8)


def _q6_values(codes: torch.Tensor, subs: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """``codes * S * d`` in float64 (exact), ``[N, K]``."""
    scale = subs.double().repeat_interleave(HALF_GROUP, dim=1) * supers.double().repeat_interleave(SUPER_BLOCK, dim=1)
    return codes.double() * scale


def _gcd_last(values: torch.Tensor) -> torch.Tensor:
    """The greatest common divisor (non-negative) over the last dimension of int64 ``values``, whose
    length is a power of two."""
    while values.shape[-1] > 1:
        values = torch.gcd(values[..., 0::2], values[..., 1::2])
    return values[..., 0].abs()


def _q6_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`q6_codes` of some rows."""
    n, k = weight.shape
    w = weight.double().reshape(n, k // SUPER_BLOCK, SUPER_BLOCK)
    if not torch.isfinite(w).all():
        return None
    _, exponent = torch.frexp(w.float())  # w = m 2^e, |m| in [0.5, 1): w / 2^(e - 24) is a whole number
    lowest = torch.where(w != 0, exponent.double() - 24, torch.full_like(w, 1e9))
    # the lowest set bit of each value: 2^(e - 24) times the largest power of two dividing w / 2^(e - 24)
    whole = (w / torch.exp2(lowest.clamp(max=1000))).abs().round()
    twos = torch.where(w != 0, torch.log2((whole.to(torch.int64) & -whole.to(torch.int64)).double()), 0.0)
    base = torch.where(w != 0, lowest + twos, torch.full_like(w, 1e9)).amin(dim=-1, keepdim=True)  # [n, T, 1]
    base = torch.where(base > 1e8, torch.zeros_like(base), base)  # an all-zero super-block
    ints = w / torch.exp2(base)  # whole numbers, exactly
    if ints.abs().max() >= 2.0**31:
        return None
    ints = ints.to(torch.int64)
    common = _gcd_last(ints)  # [n, T]
    ints = ints // common.clamp_min(1)[..., None]
    halves = ints.reshape(n, k // SUPER_BLOCK, SUPER_BLOCK // HALF_GROUP, HALF_GROUP)
    sub = _gcd_last(halves)  # [n, T, 16]: the largest S; q the smallest codes
    codes = halves // sub.clamp_min(1)[..., None]
    for factor in range(2, 33):  # a half whose codes share a factor: S over it, where S > 128
        big = sub > 128
        if not big.any():
            break
        fits = big & (sub % factor == 0) & (sub // factor <= 128)
        sub = torch.where(fits, sub // factor, sub)
        codes = torch.where(fits[..., None], codes * factor, codes)
    # S and q may each change sign, and so may the super-block's d (all its codes then flip): S must
    # fit int8, -128..127, and q -32..31 (S = 128 only as -128; a code 32 only as -32)
    def fits(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = codes.amin(-1), codes.amax(-1)
        keep = (sub <= 127) & (low >= -32) & (high <= 31)
        return keep, ~keep & (sub <= 128) & (low >= -31) & (high <= 32)  # else -S, -q

    keep, flip = fits(codes)
    negate = ~(keep | flip).all(-1)  # [n, T]: this d does not fit; try -d
    if bool(negate.any()):
        codes = torch.where(negate[..., None, None], -codes, codes)
        keep, flip = fits(codes)
    if not bool((keep | flip).all()):
        return None
    sub = torch.where(flip, -sub, sub)
    codes = torch.where(flip[..., None], -codes, codes)
    supers = torch.where(negate, -1.0, 1.0) * common.double() * torch.exp2(base[..., 0])
    if not torch.equal(supers.float().double(), supers):
        return None
    found = codes.reshape(n, k).to(torch.int8), sub.reshape(n, -1).to(torch.int8), supers.float()
    return found if torch.equal(_q6_values(*found), weight.double()) else None


def q6_codes(weight: torch.Tensor, rows_at_once: int = 1024
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(codes [out, in] int8 in -32..31, S [out, in / 16] int8, d [out, in / 256] float32)``
    with ``weight == codes * S * d`` exactly, where ``weight``'s values are a GGUF Q6_K block's
    (``d * S * (q - 32)``, as the ``gguf`` package and transformers dequantize it: exact in
    float32), else None. Per super-block ``d`` is the largest common step of its 256 values (the
    file's ``d`` times a power of two or a common factor of all its ``S * q``), per 16 ``S`` the
    largest common factor left (its sign, and a shared factor of the codes, moved so that ``S``
    fits int8 and the codes -32..31): the same values, one representation of them. Checked on the
    first rows before the rest (a layer of other values fails there), ``rows_at_once`` at a time."""
    n, k = weight.shape
    if n == 0 or k % SUPER_BLOCK:
        return None
    starts = [0, *range(min(n, 16), n, rows_at_once), n]  # 16 rows first, then rows_at_once at a time
    parts = []
    for start, end in itertools.pairwise(starts):
        found = _q6_rows(weight[start:end])
        if found is None:
            return None
        parts.append(found)
    codes, subs, supers = (torch.cat(p) for p in zip(*parts, strict=True))
    return codes, subs, supers


GGUF_INT8_LEVELS = (127, 16)
"""The largest ``|code|`` of a GGUF block that :func:`quantize_int8_groups` keeps as it is: Q8_0's
(``d = max |w| / 127``, codes -127..127) and Q5_0's (``d = max / -16``, codes -16..15 times the
sign of ``d``)."""

SMALLEST_SCALE = 2.0**-14
"""The least scale :func:`quantize_int8_groups` gives a group it quantizes: fp16's smallest normal
number (a smaller one would lose bits to subnormal rounding; the group's codes then span less than
-127..127)."""


NATIVE_LINEARS = (Int4A8Linear, Int8A8Linear, Int5A8Linear, Int6A8Linear, KQuantA8Linear, ScaleMinA8Linear)
"""The stand-ins that run triedec's compiled kernels (``csrc/a8_linears.cpp``)."""


def quantize_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [out, in] int8 in -127..127, scale [out, in / GROUP_SIZE] float16)``: ``weight [out,
    in]`` as ``codes * scale`` per group of :data:`GROUP_SIZE` input features. A group whose values
    are exactly ``d * c`` for an fp16 ``d`` and whole ``c`` whose largest ``|c|`` is one of
    :data:`GGUF_INT8_LEVELS` (a GGUF file's Q8_0 or Q5_0 block, as transformers dequantizes it)
    keeps ``d`` and ``c``: the weight is the file's, bit for bit. Any other group gets the scale
    llama.cpp's Q8_0 gives it, ``max |w| / 127`` rounded to fp16 (here at least
    :data:`SMALLEST_SCALE`), and the nearest codes under that rounded scale, ``round(w / scale)``.
    Weights beyond fp16's range times 127, or not finite, are refused."""
    out_features, in_features = weight.shape
    groups = weight_groups(weight)
    amax = groups.abs().amax(dim=-1)
    largest = float(amax.max()) if amax.numel() else 0.0
    if not torch.isfinite(amax).all() or largest > 127 * torch.finfo(torch.float16).max:
        raise TriedecError(f"int8 with fp16 scales takes finite weights of magnitude up to "
                           f"{127 * torch.finfo(torch.float16).max:.3g}; this layer's largest is {largest:.3g}")
    scale = (amax / 127).clamp_min(SMALLEST_SCALE).to(torch.float16).float()
    for levels in GGUF_INT8_LEVELS:
        step = amax / levels
        fp16 = step.to(torch.float16).float()
        whole = (groups / fp16.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round()
        exact = (fp16 == step) & (amax > 0) & (whole * fp16[..., None] == groups).all(dim=-1)
        scale = torch.where(exact, fp16, scale)
    codes = (groups / scale[..., None]).round().clamp_(-127, 127)
    return codes.reshape(out_features, in_features).to(torch.int8), scale.to(torch.float16).contiguous()


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit ``codes [N, K]`` (0..15; N a multiple of 16, K of :data:`GROUP_SIZE`) in the order
    triedec's int4 kernel reads them (``csrc/a8_linears.cpp``): per block of 64 outputs
    (the last may hold fewer), per group of 32 features, per step of 8, per 16 outputs: 64 bytes,
    byte ``4i + j`` holding output ``i``'s feature ``j`` of the step in its low nibble and feature
    ``4 + j`` in its high one. Shape ``[N, K / 2]`` uint8, bytes in that order."""
    n, k = codes.shape
    t = codes.to(torch.uint8).reshape(n, k // GROUP_SIZE, 4, 2, 4)  # n, g, m, half, j
    return blocked(t[..., 0, :] | (t[..., 1, :] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The codes ``[N, K]`` (int32) that :func:`pack_int4` packed."""
    n, k = packed.shape[0], packed.shape[1] * 2
    nibbles = unblocked(packed.reshape(-1), n, k // GROUP_SIZE, 4, 4)  # n, g, m, j
    return torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3).reshape(n, k).to(torch.int32)


def pack_scales_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """int4's bf16 ``scale`` and ``zero`` ``[K / GROUP_SIZE, N]`` in the order triedec's int4 kernel
    reads them beside the codes (``csrc/a8_linears.cpp``): per block of 64 outputs and
    group, the block's scales, then its zeros. Shape ``[K / GROUP_SIZE, 2, N]``, bytes in that
    order."""
    groups, n = scale.shape
    both = torch.stack([scale.T, zero.T], dim=-1)[..., None]  # n, g, (scale, zero), 1
    return blocked(both).to(QUANTIZED_DTYPE).reshape(groups, 2, n).contiguous()


def unpack_scales_zeros(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``scale`` and ``zero`` ``[K / GROUP_SIZE, N]`` that :func:`pack_scales_zeros` packed."""
    groups, _, n = packed.shape
    both = unblocked(packed.reshape(-1), n, groups, 2, 1)
    return both[:, :, 0, 0].T.contiguous(), both[:, :, 1, 0].T.contiguous()


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 ``codes [N, K]`` (N a multiple of 16, K of :data:`GROUP_SIZE`) in the order triedec's
    int8 kernel reads them (``csrc/a8_linears.cpp``): per block of 64 outputs (the last
    may hold fewer), per group of 32 features, per step of 4, per 16 outputs: 64 bytes, byte ``4i +
    j`` holding ``codes[output i, feature j of the step] + 128``. Shape ``[N, K]`` uint8, bytes in
    that order."""
    n, k = codes.shape
    shifted = (codes.to(torch.int16) + 128).to(torch.uint8).reshape(n, k // GROUP_SIZE, GROUP_SIZE // 4, 4)
    return blocked(shifted).reshape(n, k).contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The int8 codes ``[N, K]`` that :func:`pack_int8` packed."""
    n, k = packed.shape
    shifted = unblocked(packed.reshape(-1), n, k // GROUP_SIZE, GROUP_SIZE // 4, 4).reshape(n, k)
    return (shifted.to(torch.int16) - 128).to(torch.int8)


def pack_int8_scales(scale: torch.Tensor) -> torch.Tensor:
    """int8's fp16 ``scale [N, K / GROUP_SIZE]`` in the order triedec's int8 kernel reads them: per
    block of 64 outputs and group, the block's scales. Shape ``[K / GROUP_SIZE, N]``,
    bytes in that order."""
    n, groups = scale.shape
    return blocked(scale[..., None, None]).to(torch.float16).reshape(groups, n).contiguous()


def unpack_int8_scales(packed: torch.Tensor) -> torch.Tensor:
    """The scales ``[N, K / GROUP_SIZE]`` that :func:`pack_int8_scales` packed."""
    groups, n = packed.shape
    return unblocked(packed.reshape(-1), n, groups, 1, 1)[..., 0, 0]


def int4_fits(linear: nn.Linear) -> bool:
    """Whether torch's int4 CPU kernel takes this layer's shape."""
    return linear.out_features % 16 == 0 and linear.in_features % GROUP_SIZE == 0


GRID_TOLERANCE = 1e-3
"""How far from a whole number of steps (in steps) a value may lie and still count as on a
group's grid (dequantized file values carry float32 rounding, ~1e-6 of a step)."""


def weight_groups(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` as float32 groups ``[out, in / GROUP_SIZE, GROUP_SIZE]`` of input features."""
    out_features, in_features = weight.shape
    return weight.detach().float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)


def grid_steps(groups: torch.Tensor) -> torch.Tensor:
    """For float32 ``groups [..., GROUP_SIZE]``, each group's step where its values lie on a grid
    of at most 16 levels (``low + k * step``, ``k`` in 0..15: a 4-bit file's group, whatever codes
    it uses), else 0 (also for a constant group). The grid's step is the smallest gap between two
    values, or that gap over 2, 3 or 4 (when no two neighbouring codes are present); the step
    returned is the span over its whole number of steps, which averages the values' rounding."""
    ordered = groups.sort(dim=-1).values
    low, high = ordered[..., :1], ordered[..., -1:]
    gaps = ordered.diff(dim=-1)
    span = (high - low).squeeze(-1)
    gaps = torch.where(gaps > span[..., None] * 1e-4, gaps, torch.full_like(gaps, float("inf")))
    smallest = gaps.amin(dim=-1)
    found = torch.zeros_like(span).reshape(-1)
    values, lows, smallest, span = groups.reshape(-1, groups.shape[-1]), low.reshape(-1, 1), smallest.reshape(-1), \
        span.reshape(-1)
    left = torch.arange(found.numel())  # the groups no grid has fitted yet
    for divisor in (1, 2, 3, 4):  # any grid that fits holds the values exactly; the coarsest wins
        step = smallest[left] / divisor
        k = (values[left] - lows[left]) / step[:, None]
        fits = ((k - k.round()).abs() <= GRID_TOLERANCE).all(dim=-1) & (k.round().amax(dim=-1) <= 15)
        fits &= torch.isfinite(step) & (span[left] > 0)
        found[left[fits]] = step[fits]
        left = left[~fits]
    found, span = found.reshape(low.shape[:-1]), span.reshape(low.shape[:-1])
    levels = (span / found).round()  # the step from the whole span: (max - min) / 15 for a Q4_1 block
    return torch.where(found > 0, span / levels, found)


def quantize_int4(weight: torch.Tensor, steps: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [out, in] int32 in 0..15, scale, zero)`` with ``scale`` and ``zero`` bf16
    ``[in / GROUP_SIZE, out]``. Per group of :data:`GROUP_SIZE` input features: where the values
    already lie on a grid of at most 16 levels (:func:`grid_steps`: a 4-bit GGUF block, Q4_0,
    Q4_1 or Q4_K, whose codes need not span 0..15), ``scale`` is the grid's step and the lowest
    value is code 0, so the codes are the file's up to a shift; elsewhere ``scale = (max - min) /
    15``. Then ``zero = low + 8 * scale``, both rounded to bf16 first, and the codes are the nearest
    ones under those rounded values, so the weight the kernel multiplies by is ``(q - 8) * scale +
    zero`` exactly. ``steps``: ``grid_steps(weight_groups(weight))`` if the caller has them already
    (:func:`quantize_linears` does, from a GGUF: the sort inside is most of the cost)."""
    out_features, in_features = weight.shape
    groups = weight_groups(weight)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    step = grid_steps(groups) if steps is None else steps
    scale = torch.where(step > 0, step, (high - low) / 15)
    scale = scale.clamp_min(torch.finfo(torch.float32).tiny).to(QUANTIZED_DTYPE)
    zero = (low + 8 * scale.float()).to(QUANTIZED_DTYPE)
    base = zero.float() - 8 * scale.float()
    codes = torch.round((groups - base[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return codes.reshape(out_features, in_features).to(torch.int32), scale.T.contiguous(), zero.T.contiguous()


def on_4bit_grid(weight: torch.Tensor) -> float:
    """The share of ``weight``'s groups of :data:`GROUP_SIZE` input features whose values lie on a
    grid of at most 16 levels (:func:`grid_steps`)."""
    return float((grid_steps(weight_groups(weight)) > 0).float().mean())


FINER_THAN_4BIT = 0.5
"""In a GGUF file with 4-bit layers (``quantize_linears(..., from_gguf=True)``), a layer with
fewer of its groups on a 4-bit grid than this was stored with more bits (Q5_0, Q6_K, Q8_0, F16:
a Q4_K_M file keeps some layers at 5 and 6 bits) and is quantized to int8, not to int4 (in
int4-a8 its own blocks where a kernel holds them: :func:`_a8_linear`). A Q4_K or Q5_K layer given
its file's blocks (``quantize_linears(..., file_blocks=)``) is held as those and needs no grid; a
Q5_K one without them goes to int8 by this rule. In a 4-bit layer every group is on a grid; in a
6-bit one almost none is."""


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that int4 ``codes`` with ``scale`` and ``zero`` stand for."""
    out_features, in_features = codes.shape
    per_element_scale = scale.float().T.repeat_interleave(GROUP_SIZE, dim=1)
    per_element_zero = zero.float().T.repeat_interleave(GROUP_SIZE, dim=1)
    assert per_element_scale.shape == (out_features, in_features)
    return (codes.float() - 8) * per_element_scale + per_element_zero


def _plus_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


def _bias(linear: nn.Linear) -> nn.Parameter | None:
    if linear.bias is None:
        return None
    return nn.Parameter(linear.bias.detach().to(QUANTIZED_DTYPE).clone(), requires_grad=False)


@dataclass(frozen=True)
class Quantized:
    """What :func:`quantize_linears` did: layers quantized, layers left unquantized because the
    kernel could not take their shape, and layers of a 4-bit file stored with more bits, put in
    int8 instead of int4 (counted in ``layers`` too)."""

    layers: int
    kept: int
    finer: int = 0


def quantize_linears(model: nn.Module, weights: str, head: nn.Module | None = None,
                     from_gguf: bool = False, file_blocks: Mapping[int, FileBlocks] | None = None) -> Quantized:
    """Swap every ``nn.Linear`` of ``model`` for an :class:`Int8Linear`, :class:`Int4Linear` or
    :class:`Int4A8Linear` (``weights``: ``int8``, ``int4``, ``int4-a8``), in place, quantizing from
    the weights as they are (quantize from float32 for the best codes, then cast the rest of the
    model to bfloat16). ``head``, the LM head, is int8 in every mode (on 8-bit activations in
    ``int4-a8``, :class:`Int8A8Linear`): as 4-bit GGUF files keep their output layer at 6-8 bits,
    because the logits are the most sensitive product of the model (on the default model, int4 with a 4-bit head agreed
    with float32's greedy token at 92% of positions, with an int8 head at 99%, and ran no slower).
    ``from_gguf``: the weights are a GGUF file's dequantized values; if some of its layers are
    4-bit, the int4 modes keep their codes (:func:`quantize_int4`) and quantize the layers the
    file stored with more bits (:data:`FINER_THAN_4BIT`) to int8, like the head, not to 4 bits (a
    file with no 4-bit layer is quantized as asked). ``file_blocks``: in ``int4-a8``, the file's own
    Q4_K, Q5_K, Q4_0, Q4_1 and Q5_1 blocks of some linears, by the module's id
    (:func:`triedec.model.gguf_blocks.file_block_layers`): those layers (but the head) are held as
    :class:`KQuantA8Linear` or :class:`ScaleMinA8Linear`, at the file's values (Q4_0, Q4_1 and
    Q5_1 also at its bits). A weight shared with another module (a
    tied LM head's embedding) stays as it is in that module."""
    if weights not in ("int8", "int4", "int4-a8"):
        raise TriedecError(f"quantize_linears takes 'int8', 'int4' or 'int4-a8', got {weights!r}")
    layers = kept = finer = 0
    # the linears held as the file's own blocks: those need no grid (and the head is never one)
    own = {id(m): file_blocks[id(m)] for m in model.modules()
           if weights == "int4-a8" and file_blocks and type(m) is nn.Linear and m is not head
           and id(m) in file_blocks and m.out_features % 16 == 0}
    stored_finer: set[int] = set()
    steps: dict[int, torch.Tensor] = {}  # each int4 layer's grid_steps, computed once (they decide int4 or int8 too)
    if from_gguf and weights != "int8":
        steps = _grid_steps(model, head, skip=own.keys())
        shares = {key: float((step > 0).float().mean()) for key, step in steps.items()}
        four_bit = any(parts.bits == 4 for parts in own.values())
        if four_bit or any(share >= FINER_THAN_4BIT for share in shares.values()):
            stored_finer = {key for key, share in shares.items() if share < FINER_THAN_4BIT}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if weights != "int8" and child is not head and not int4_fits(child):
                kept += 1
                continue
            blocks = own.get(id(child))
            if blocks is not None:
                setattr(parent, name, file_block_layer(child, blocks))
                layers += 1
                continue
            as_int8 = weights == "int8" or child is head
            if not as_int8 and id(child) in stored_finer:
                as_int8, finer = True, finer + 1
            if as_int8 and weights == "int4-a8" and int4_fits(child):
                setattr(parent, name, _a8_linear(child))
            elif as_int8:
                setattr(parent, name, Int8Linear(child))
            else:
                stand_in = Int4Linear if weights == "int4" else Int4A8Linear
                setattr(parent, name, stand_in(child, steps.pop(id(child), None)))
            layers += 1
    return Quantized(layers, kept, finer)


def _a8_linear(linear: nn.Linear) -> Int8A8Linear | Int6A8Linear:
    """An 8-bit-activation linear of ``linear``'s weights: :class:`Int5A8Linear` where their int8
    codes all fit 5 bits (a Q5_0 file's layer: the file's bytes, the same bits), else
    :class:`Int6A8Linear` where they are a Q6_K layer's values (:func:`q6_codes`: the file's values
    at its bits), else :class:`Int8A8Linear`."""
    quantized = quantize_int8_groups(linear.weight.detach())
    if fits_int5(quantized[0]):
        return Int5A8Linear(linear, quantized)
    six = q6_codes(linear.weight.detach()) if linear.out_features % 16 == 0 else None
    return Int6A8Linear(linear, six) if six is not None else Int8A8Linear(linear)


def _grid_steps(model: nn.Module, head: nn.Module | None, skip: Iterable[int] = ()) -> dict[int, torch.Tensor]:
    """Each int4-sized linear's :func:`grid_steps` but the head's and those whose ids are in ``skip``,
    by the module's id."""
    skipped = set(skip)
    return {id(m): grid_steps(weight_groups(m.weight)) for m in model.modules()
            if type(m) is nn.Linear and m is not head and int4_fits(m) and id(m) not in skipped}


def stored_in_4bit(model: nn.Module, head: nn.Module | None = None) -> bool:
    """Whether a GGUF file's dequantized ``model`` (float weights) has layers stored in 4 bits: a
    linear other than ``head`` whose groups lie on grids of 16 levels, :data:`FINER_THAN_4BIT` of
    them or more (the rule by which :func:`quantize_linears` keeps a file's codes)."""
    return any(float((grid_steps(weight_groups(m.weight)) > 0).float().mean()) >= FINER_THAN_4BIT
               for m in model.modules() if type(m) is nn.Linear and m is not head and int4_fits(m))


def layer_mix(model: nn.Module) -> str:
    """How many of ``model``'s linears are stored in int4, in int8 per row (:class:`Int8Linear`) and
    in int8 per group (:class:`Int8A8Linear`), and in 5 bits per group and in Q6_K's 6 bits where
    there are any (:class:`Int5A8Linear`, :class:`Int6A8Linear`), and a file's own Q4_K and Q5_K
    blocks (:class:`KQuantA8Linear`: ``-q4kxN``, ``-q5kxN``) and Q4_0/Q4_1 and Q5_1 ones
    (:class:`ScaleMinA8Linear`: ``-sm4xN``, ``-sm5xN``): ``int4x27-int8x0-int8g32x100``
    (the rest, left
    unquantized for their shape, follow from the architecture; layers the runner joined count as the
    layers they join). Loads of the same file in the same mode have the same mix; which layers go
    to int8 (:data:`FINER_THAN_4BIT`, the head) changes it, and with it the cost of a forward, so
    the calibration's key includes it (:func:`triedec.api.calibration.device_key`)."""
    modules = list(model.modules())
    joined = {id(m.joined) for m in modules if isinstance(m, JoinedPart)}  # counted as the layers they join
    layers = [m.joined if isinstance(m, JoinedPart) else m for m in modules if id(m) not in joined]
    kinds = [type(m) for m in layers]
    int4 = sum(kind in (Int4Linear, Int4A8Linear) for kind in kinds)
    int8 = sum(kind is Int8Linear for kind in kinds)
    grouped = sum(kind is Int8A8Linear for kind in kinds)
    five = sum(kind is Int5A8Linear for kind in kinds)  # named only where there are any (older keys stay)
    six = sum(kind is Int6A8Linear for kind in kinds)
    kq = {bits: sum(isinstance(m, KQuantA8Linear) and m.bits == bits for m in layers) for bits in (4, 5)}
    sm = {bits: sum(isinstance(m, ScaleMinA8Linear) and m.bits == bits for m in layers) for bits in (4, 5)}
    return (f"int4x{int4}-int8x{int8}-int8g{GROUP_SIZE}x{grouped}" + (f"-int5g{GROUP_SIZE}x{five}" if five else "")
            + (f"-q6kx{six}" if six else "") + "".join(f"-q{bits}kx{kq[bits]}" for bits in (4, 5) if kq[bits])
            + "".join(f"-sm{bits}x{sm[bits]}" for bits in (4, 5) if sm[bits]))


def precision_of(model: nn.Module) -> Precision:
    """The mode ``model`` is in: its first floating parameter's dtype (the embeddings'), and its
    linears' weights (``int4-a8``, ``int4`` or ``int8`` when it holds such layers)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    kinds = {type(m) for m in model.modules()}
    weights = "int4-a8" if kinds & set(NATIVE_LINEARS) else "int4" if Int4Linear in kinds \
        else "int8" if Int8Linear in kinds else "float"
    return Precision(dtype, weights)


def linear_weight_bytes(model: nn.Module) -> int:
    """The bytes a one-token forward reads for ``model``'s linears and head as they are held (each
    storage counted once: a joined group's parts share theirs; biases left out): the packed codes
    and scales of triedec's linears, a plain linear's weight."""
    storages: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, JoinedPart):
            continue
        if isinstance(module, LinearStandIn):
            tensors = [t for name, t in module._buffers.items() if t is not None and name != "bias"]
        elif isinstance(module, nn.Linear):
            tensors = [module.weight]
        else:
            continue
        for t in tensors:  # by address: the weights may share one mapping (model/hugepages.py)
            storages[t.data_ptr()] = t.numel() * t.element_size()
    return sum(storages.values())
