"""Fewer small ops per layer: a model's RMS norms swapped for triedec's one-call kernel
(``csrc/rms_norm.cpp``), as quantizers swap linears (no forked modeling code, no monkey-patching).

transformers' RMS norm is ~8 torch ops (casts, ``pow``, ``mean``, ``rsqrt``, two products), each
paying torch's per-op overhead on a tiny row, twice per layer and once more at the end.
:class:`FusedRMSNorm` is one call into C++ whose
rows are summed in a fixed order, so a row gets the same bits alone or inside any call (see the
source). It computes what the module it replaces computes, in the same float32 operations, except
the order of the sum of squares, so outputs differ from stock ones by rounding at most.

:func:`fuse_norms` swaps the norms whose arithmetic it recognises: a module whose class name ends
in ``RMSNorm``, with a 1-D weight in the input's dtype and an ``eps`` or ``variance_epsilon``, is
swapped for the variant (``w * x̂``, Llama and most others, or ``(1 + w) * x̂``, Gemma) whose
outputs on seeded rows agree with the module's own to within 4 units in the last place; any other
module stays as it is. Pure torch: nothing here knows transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from triedec.model.native import load_kernel

VARIANTS = ("weight", "one-plus-weight")
"""The RMS norms :class:`FusedRMSNorm` computes: ``y = w * round(x * r)`` or ``y = round(x * r *
(1 + w))``, ``r = 1 / sqrt(mean(x^2) + eps)``."""
PROBE_ROWS = 64
"""Seeded rows :func:`fusable_variant` compares a norm's outputs on."""
ULPS = 4
"""How far, in units in the last place of the dtype, a fused output may be from the module's own
(torch's ``rsqrt`` is not correctly rounded; the sum of squares is in another order)."""


class FusedRMSNorm(nn.Module):
    """An RMS norm in one call of triedec's kernel: ``x [..., D] -> [..., D]`` in ``x``'s dtype
    (float32, bfloat16 or float16, CPU; the weight in the same dtype). ``variant`` is one of
    :data:`VARIANTS`. Inference only; nothing is mutated."""

    def __init__(self, weight: torch.Tensor, eps: float, variant: str) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps, self.variant = float(eps), variant
        self._one_plus = variant == "one-plus-weight"
        load_kernel()  # refused here, with the reason, when triedec's kernels cannot be built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return load_kernel().rms_norm(x, self._parameters["weight"], self.eps, self._one_plus)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, variant={self.variant}"


def norm_epsilon(module: nn.Module) -> float | None:
    """An RMS norm module's epsilon (``variance_epsilon`` or ``eps``), or None."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    return None


def fusable_variant(module: nn.Module, seed: int = 0) -> str | None:
    """The variant of :class:`FusedRMSNorm` that computes what ``module`` computes (its outputs on
    :data:`PROBE_ROWS` seeded rows within :data:`ULPS` units in the last place of the module's own,
    in its dtype), or None: not an RMS norm by name, no usable weight or epsilon, a dtype the kernel
    does not run, or arithmetic it does not recognise."""
    weight, eps = getattr(module, "weight", None), norm_epsilon(module)
    if not type(module).__name__.endswith("RMSNorm") or eps is None or not isinstance(weight, torch.Tensor) \
            or weight.dim() != 1 or weight.device.type != "cpu" \
            or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    probe = _probe(module, weight, seed)
    if probe is None:
        return None
    x, expected = probe
    with torch.no_grad():
        for variant in VARIANTS:
            got = FusedRMSNorm(weight, eps, variant)(x)
            if _within_ulps(got, expected):
                return variant
    return None


def torch_ops_variant(module: nn.Module) -> tuple[str, float] | None:
    """``(variant, eps)`` of transformers' own float32 RMS norm in its own torch ops (the native
    forward's ``aten_rms_norm``, ``csrc/decoder.h``) whose outputs are ``torch.equal`` to a float32
    ``module``'s on :data:`PROBE_ROWS` seeded rows, or None."""
    weight, eps = getattr(module, "weight", None), norm_epsilon(module)
    if isinstance(module, FusedRMSNorm) or eps is None or not isinstance(weight, torch.Tensor) \
            or weight.dtype != torch.float32 or weight.dim() != 1:
        return None
    probe = _probe(module, weight, 0)
    if probe is None:
        return None
    x, expected = probe
    kernel = load_kernel()
    with torch.no_grad():
        for variant in VARIANTS:
            if torch.equal(kernel.aten_rms_norm(x, weight, eps, variant == "one-plus-weight"), expected):
                return variant, eps
    return None


def _probe(module: nn.Module, weight: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:data:`PROBE_ROWS` seeded rows in ``weight``'s dtype and ``module``'s outputs on them, or None
    when the module does not take plain ``[rows, D]`` rows to rows of that shape and dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(PROBE_ROWS, weight.shape[0], generator=gen) * 4).to(weight.dtype)
    with torch.no_grad():
        try:
            expected = module(x)
        except Exception:  # a module that does not take a plain [rows, D] input is left alone
            return None
    if not isinstance(expected, torch.Tensor) or expected.shape != x.shape or expected.dtype != x.dtype:
        return None
    return x, expected


def _within_ulps(got: torch.Tensor, expected: torch.Tensor) -> bool:
    eps = torch.finfo(expected.dtype).eps
    a, b = got.double(), expected.double()
    tolerance = ULPS * eps * b.abs() + torch.finfo(expected.dtype).tiny
    return bool(torch.isfinite(a).all()) and bool(((a - b).abs() <= tolerance).all())


@dataclass(frozen=True)
class Fused:
    """What :func:`fuse_norms` did: norms swapped, and modules named like RMS norms left as they
    were (arithmetic not recognised)."""

    norms: int
    kept: int


def fuse_norms(model: nn.Module) -> Fused:
    """Swap every RMS norm of ``model`` whose arithmetic :func:`fusable_variant` recognises for a
    :class:`FusedRMSNorm`, in place."""
    norms = kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedRMSNorm) or not type(child).__name__.endswith("RMSNorm"):
                continue
            variant = fusable_variant(child)
            if variant is None:
                kept += 1
                continue
            weight = child.weight
            assert isinstance(weight, torch.Tensor)
            setattr(parent, name, FusedRMSNorm(weight, norm_epsilon(child) or 0.0, variant))
            norms += 1
    return Fused(norms, kept)
