"""Precision modes: what a loaded model's weights and activations are stored in.

A decoding step on a CPU is bound by reading the weights, so the mode sets the step's speed:

* ``float`` weights (the default): every weight in the activation dtype, ``float32`` unless
  ``dtype`` says ``bfloat16`` or ``float16``;
* ``int8``: each linear layer's weight quantized to int8, symmetric, one scale per output row
  (``scale = max |w| / 127``, rounded to bf16 first; the codes are then ``round(w / scale)``);
* ``int4``: each linear layer's weight quantized to 4 bits in groups of :data:`GROUP_SIZE`
  consecutive input features, affine (per group a bf16 ``scale`` and bf16 ``zero``, ``w = (q - 8)
  * scale + zero`` with ``q`` in 0..15, the layout torch's int4 CPU kernel reads), the LM head
  int8 as above (see :func:`quantize_linears`). Q4_0/Q4_1 GGUF files use the same group size, so
  their codes are recovered (see ``docs/precision.md``).

Quantized weights run with ``bfloat16`` activations (torch's weight-only CPU kernels,
``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu``; with float32 activations they take a
reference path 10-30x slower). Embeddings, norms and everything else stay in the activation
dtype. A linear the int4 kernel cannot take (output rows not a multiple of 16, or input features
not a multiple of the group size) stays unquantized, and :func:`quantize_linears` counts it.

Every kernel used here computes a row the same way whatever other rows share the call (measured by
``tests/test_precision.py`` and the load-time self-test), which is what keeps speculative decoding
lossless in every mode: each method returns the tokens plain decoding returns *in the same mode*.
Pure torch (nothing here knows transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from triedec.errors import TriedecError
from triedec.kernels import LinearStandIn
from triedec.params import GROUP_SIZE, WEIGHTS

QUANTIZED_DTYPE = torch.bfloat16
"""The activation dtype quantized weights run with."""
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
        """``float32``, ``bfloat16``, ``int8-bfloat16``, ``int4g32-bfloat16``: what results record."""
        weights = {"float": "", "int8": "int8-", "int4": f"int4g{GROUP_SIZE}-"}[self.weights]
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
        return _plus_bias(torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale), self.bias)


class Int4Linear(LinearStandIn):
    """``y = x w^T + b`` with ``w = (q - 8) * scale + zero`` per group of :data:`GROUP_SIZE` input
    features: 4-bit codes ``q`` packed for torch's CPU kernel, and ``scales_and_zeros [in /
    GROUP_SIZE, out, 2]`` (bf16 ``scale`` and ``zero``; inference only; bf16 activations)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        if not int4_fits(linear):
            raise TriedecError(f"int4 needs output rows divisible by 16 and input features by {GROUP_SIZE}, "
                               f"got {self.out_features}x{self.in_features}")
        codes, scale, zero = quantize_int4(linear.weight.detach())
        self.register_buffer("scales_and_zeros", torch.stack(
            [scale.to(QUANTIZED_DTYPE), zero.to(QUANTIZED_DTYPE)], dim=-1).contiguous())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1))
        self.bias = _bias(linear)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return _plus_bias(torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros),
                          self.bias)

    def repr_extra(self) -> str:
        return f", group_size={GROUP_SIZE}"


def int4_fits(linear: nn.Linear) -> bool:
    """Whether torch's int4 CPU kernel takes this layer's shape."""
    return linear.out_features % 16 == 0 and linear.in_features % GROUP_SIZE == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [out, in] int32 in 0..15, scale, zero)`` with ``scale`` and ``zero`` bf16
    ``[in / GROUP_SIZE, out]``: per group, ``scale = (max - min) / 15`` and ``zero = min + 8 *
    scale``, both rounded to bf16 first; the codes are then the nearest ones under those rounded
    values, so the weight the kernel multiplies by is ``(q - 8) * scale + zero`` exactly."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(QUANTIZED_DTYPE)
    zero = (low + 8 * scale.float()).to(QUANTIZED_DTYPE)
    base = zero.float() - 8 * scale.float()
    codes = torch.round((groups - base[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return codes.reshape(out_features, in_features).to(torch.int32), scale.T.contiguous(), zero.T.contiguous()


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
    """What :func:`quantize_linears` did: layers quantized, and layers left unquantized because
    the kernel could not take their shape."""

    layers: int
    kept: int


def quantize_linears(model: nn.Module, weights: str, head: nn.Module | None = None) -> Quantized:
    """Swap every ``nn.Linear`` of ``model`` for an :class:`Int8Linear` or :class:`Int4Linear`
    (``weights``), in place, quantizing from the weights as they are (quantize from float32 for
    the best codes, then cast the rest of the model to bfloat16). ``head``, the LM head, is int8
    in both modes: as 4-bit GGUF files keep their output layer at 6-8 bits, because the logits are
    the most sensitive product of the model (on the default model, int4 with a 4-bit head agreed
    with float32's greedy token at 92% of positions, with an int8 head at 99%, and ran no slower).
    A weight shared with another module (a tied LM head's embedding) stays as it is in that
    module."""
    if weights not in ("int8", "int4"):
        raise TriedecError(f"quantize_linears takes 'int8' or 'int4', got {weights!r}")
    layers = kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if weights == "int4" and child is not head and not int4_fits(child):
                kept += 1
                continue
            int8 = weights == "int8" or child is head
            setattr(parent, name, Int8Linear(child) if int8 else Int4Linear(child))
            layers += 1
    return Quantized(layers, kept)


def precision_of(model: nn.Module) -> Precision:
    """The mode ``model`` is in: its first floating parameter's dtype (the embeddings'), and its
    linears' weights (``int4`` or ``int8`` when it holds such layers)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    kinds = {type(m) for m in model.modules()}
    weights = "int4" if Int4Linear in kinds else "int8" if Int8Linear in kinds else "float"
    return Precision(dtype, weights)
