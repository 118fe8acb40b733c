"""Faster CPU kernels for the verifier, applied by swapping modules for equivalent ones (as
quantizers do): no forked modeling code, no monkey-patching.

On CPU, ``nn.Linear`` in fp32 runs MKL's sgemm, whose small-batch paths are slow on some CPUs: on
the 2-core AMD EPYC measured here a 2-row matmul costs twice a 1-row one and a 16-row one 1.4x, so
verifying a tree of a few tokens cost ~2x a plain step. oneDNN with weights reordered once into its
blocked layout ("pre-packed") streams them faster at every batch size and is nearly flat from 1 to
16 rows (``benchmarks/verifier-cpu``). :class:`PackedLinear` is an ``nn.Linear`` whose weight is
stored that way; :func:`pack_linears` swaps every ``nn.Linear`` of a model for one.

Pure torch (nothing here knows transformers). Outputs equal ``nn.Linear``'s up to fp32 rounding,
as between any two fp32 GEMM kernels (summation order differs).
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 16
"""Rows oneDNN's weight layout is chosen for: the tree sizes verified on a CPU (1-32 tokens)."""


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN pre-packed linears can run here: CPU, fp32, and a torch build with oneDNN."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and ops is not None and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class LinearStandIn(nn.Module):
    """Base of the modules that stand in for an ``nn.Linear`` (inference only): a subclass gives
    :meth:`rows`, the layer over a ``[rows, in_features]`` matrix (bias included); the reshape of
    any leading dimensions and the repr are here. ``in_features`` and ``out_features`` are the
    replaced linear's."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, in_features] -> [rows, out_features]``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rows(x.reshape(-1, self.in_features))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}{self.repr_extra()}, "
                f"bias={getattr(self, 'bias', None) is not None}")

    def repr_extra(self) -> str:
        """More ``, name=value`` pairs for the repr (none by default)."""
        return ""


class PackedLinear(LinearStandIn):
    """``y = x W^T + b`` with ``W`` pre-packed for oneDNN (fp32, CPU, inference only).

    The packed weight is a plain attribute, not a parameter: the module has no gradient and is not
    part of ``state_dict`` (load the model without packing to train or save it)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__(linear)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), batch_hint)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` (fp32, CPU) for a :class:`PackedLinear`, in place.

    A linear whose weight is shared with another module (a tied LM head) gets a packed copy; the
    other module keeps the original. The parameters left (embeddings, norms) are then copied into
    memory of their own: loaders map the weights file into memory, and the mapping, with every
    page of the replaced weights that packing read, stays resident as long as any tensor still
    points into it. Returns the bytes of packed weights added beyond the ones freed (the tied
    copies): the net extra memory."""
    shared = {id(p) for name, m in model.named_modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    added = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                if id(child.weight) in shared:
                    added += child.weight.numel() * child.weight.element_size()
                setattr(parent, name, PackedLinear(child))
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return added
