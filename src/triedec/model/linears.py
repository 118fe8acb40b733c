"""Faster CPU kernels for the verifier, applied by swapping modules for equivalent ones (as
quantizers do): no forked modeling code, no monkey-patching.

On CPU, ``nn.Linear`` in fp32 runs MKL's sgemm, whose small-batch paths are slow on some CPUs (a
few rows can cost several times one row, so verifying a small tree costs much more than a plain
step). oneDNN with weights reordered once into its blocked layout ("pre-packed") streams them faster
at every batch size and is nearly flat over a few rows (the measurement: ``benchmarks/verifier-cpu``).
:class:`PackedLinear` is an ``nn.Linear`` whose weight is stored that way (fp32, and bf16 where
oneDNN has bf16 kernels for the CPU); :func:`pack_linears` swaps every ``nn.Linear`` of a model for
one. A layer whose rows are not bit-identical alone and in
a batch on this CPU (checked per shape at load, :func:`row_invariant`) is split along its input
features into pieces that are (:class:`SplitLinear`).

In float32 on a CPU, :func:`pack_linears` uses triedec's own kernel instead (:class:`F32Linear`,
``csrc/f32_linears.cpp``): each output summed over the input features in order, so a row's bits
never depend on its batch or the thread count (no probe, no split), and one row streams the weights
at this machine's memory rate (~37 GB/s on 2 cores against oneDNN's ~25, docs/kernels.md).

Pure torch (nothing here knows transformers). Outputs equal ``nn.Linear``'s up to rounding, as
between any two GEMM kernels (summation order differs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from triedec.core.errors import TriedecError
from triedec.model.native import kernel_available, load_kernel

PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes :class:`PackedLinear` packs (bf16 where the CPU has oneDNN's bf16 kernels)."""

BATCH_HINT = 16
"""Rows oneDNN's weight layout is chosen for: the tree sizes verified on a CPU (1-32 tokens)."""


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN pre-packed linears can run here: CPU, a dtype of :data:`PACKED_DTYPES` (bf16
    only where oneDNN says the CPU has bf16 kernels), and a torch build with oneDNN."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not (device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and ops is not None and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(getattr(ops, "_is_mkldnn_bf16_supported", lambda: False)())


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
        shape = x.shape
        return self.rows(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}{self.repr_extra()}, "
                f"bias={getattr(self, 'bias', None) is not None}")

    def repr_extra(self) -> str:
        """More ``, name=value`` pairs for the repr (none by default)."""
        return ""


class JoinedPart(LinearStandIn):
    """What stands in the model for one of several linears made one
    (:func:`triedec.model.runner.join`): its outputs of the joined layer's, so the model's own
    forward still runs (computing the whole joined layer for each part; triedec's runner calls the
    joined layer once instead)."""

    def __init__(self, joined: LinearStandIn, start: int, stop: int) -> None:
        super().__init__(nn.Linear(joined.in_features, stop - start, bias=False, device="meta"))
        self.joined, self.start, self.stop = joined, start, stop

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.joined.rows(x)[:, self.start : self.stop].contiguous()

    def repr_extra(self) -> str:
        return f", outputs {self.start}..{self.stop} of a joined {type(self.joined).__name__}"


class PackedLinear(LinearStandIn):
    """``y = x W^T + b`` with ``W`` pre-packed for oneDNN (fp32, CPU, inference only).

    The packed weight is a plain attribute, not a parameter: the module has no gradient and is not
    part of ``state_dict`` (load the model without packing to train or save it)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__(linear)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), batch_hint)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._op = torch.ops.mkldnn._linear_pointwise.default

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self._parameters.get("bias"), "none", [], "")


VECTOR = 16
"""Outputs per vector of triedec's packed linears (a 64-byte register of 32-bit lanes)."""
BLOCK = 64
"""Outputs per block of triedec's packed linears (one sequential stream per block)."""


def blocked(values: torch.Tensor) -> torch.Tensor:
    """``values [N, G, S, W]`` (per output, group of input features, step, width) flat in the
    order triedec's kernels read them: per block of :data:`BLOCK` outputs (the last may hold
    fewer), per group, per step, per :data:`VECTOR` outputs, per output, the step's ``W`` values."""
    _, groups, steps, width = values.shape
    parts = [block.reshape(block.shape[0] // VECTOR, VECTOR, groups, steps, width).permute(2, 3, 0, 1, 4).reshape(-1)
             for block in values.split(BLOCK)]
    return torch.cat(parts)


def unblocked(flat: torch.Tensor, n: int, groups: int, steps: int, width: int) -> torch.Tensor:
    """The ``values [n, groups, steps, width]`` that :func:`blocked` laid out as ``flat``."""
    rows, per_output = [], groups * steps * width
    for b in range(0, n, BLOCK):
        vectors = min(BLOCK, n - b) // VECTOR
        block = flat[b * per_output : (b + vectors * VECTOR) * per_output]
        rows.append(block.reshape(groups, steps, vectors, VECTOR, width).permute(2, 3, 0, 1, 4)
                    .reshape(vectors * VECTOR, groups, steps, width))
    return torch.cat(rows)


_Stand = TypeVar("_Stand", bound=LinearStandIn)


def joinable(layers: Sequence[LinearStandIn]) -> bool:
    """Whether ``layers`` can be joined into one (``joined``): at least one, of one class, input
    size, code width (``bits``) and block type (``kind``), where a class holds several, all with a
    bias or none (a zero bias added to a layer without one could turn a -0 into +0)."""
    return bool(layers) and len({(type(m), m.in_features, m.bias is None, getattr(m, "bits", None),
                                  getattr(m, "kind", None)) for m in layers}) == 1


def empty_join(cls: type[_Stand], layers: Sequence[LinearStandIn]) -> _Stand:
    """A ``cls`` of ``layers``' input size and their outputs together, its buffers not set yet;
    refused unless :func:`joinable`."""
    if not joinable(layers):
        raise TriedecError("joined layers need one class, one input size, and biases on all or none")
    joined = cls.__new__(cls)
    LinearStandIn.__init__(joined, nn.Linear(layers[0].in_features, sum(m.out_features for m in layers),
                                             bias=False, device="meta"))
    return joined


def joined_bias(layers: Sequence[LinearStandIn]) -> nn.Parameter | None:
    """``layers``' biases side by side (None when they have none)."""
    if layers[0].bias is None:
        return None
    return nn.Parameter(torch.cat([m.bias.detach() for m in layers]), requires_grad=False)


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` float32 (``N`` a multiple of :data:`VECTOR`) in ``csrc/f32_linears.cpp``'s
    order (:func:`blocked`, one feature a group): per block of :data:`BLOCK` outputs, per input
    feature, the block's outputs side by side. Shape ``[N, K]``, values in that order."""
    n, k = weight.shape
    if n % VECTOR:
        raise ValueError(f"output features must be a multiple of {VECTOR}, got {n}")
    return blocked(weight.detach().to(torch.float32)[:, :, None, None]).view(n, k)


def unpack_f32(packed: torch.Tensor) -> torch.Tensor:
    """The ``[N, K]`` weight :func:`pack_f32` packed."""
    n, k = packed.shape
    return unblocked(packed.reshape(-1), n, k, 1, 1)[..., 0, 0]


class F32Linear(LinearStandIn):
    """``y = x W^T + b`` in float32 on triedec's kernel (``csrc/f32_linears.cpp``; CPU, inference
    only): output ``n`` of a row is ``fma(x_k, w_nk, y)`` over ``k`` in order from 0, then plus the
    bias, so a row gets the same bits alone or in any batch, on any thread count and every ISA's
    build. The weight is packed once (:func:`pack_f32`; outputs padded to a multiple of 16 with
    zero rows, dropped from the result) into a buffer: no gradient, not in ``state_dict``, moved
    onto huge pages by :func:`~triedec.model.hugepages.place_weights` with the other packed linears'."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        load_kernel()  # built (or the reason it cannot be) before the first forward
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32).clone(), requires_grad=False)
        self._pack(linear.weight.detach().to(torch.float32))

    def _pack(self, weight: torch.Tensor) -> None:
        """Store ``weight [out_features, in_features]`` and the bias the kernel adds, both padded
        to a multiple of :data:`VECTOR` outputs."""
        pad = -self.out_features % VECTOR
        with torch.no_grad():
            self.register_buffer("packed", pack_f32(torch.cat([weight, weight.new_zeros(pad, self.in_features)])),
                                 persistent=False)
            bias = self.bias
            self.register_buffer("padded_bias", None if bias is None else torch.cat([bias.detach(),
                                                                                     bias.new_zeros(pad)]),
                                 persistent=False)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        out = load_kernel().f32_linear(x, self._buffers["packed"], self._buffers["padded_bias"])
        return out if out.shape[1] == self.out_features else out[:, : self.out_features].contiguous()

    def weight_matrix(self) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight this layer multiplies by."""
        return unpack_f32(self.packed)[: self.out_features]

    @classmethod
    def joined(cls, layers: Sequence[F32Linear]) -> F32Linear:
        """One layer computing ``layers``' outputs side by side, each with the bits it has alone
        (an output's sum is its own). Needs one input size, biases on all or none (:func:`joinable`)."""
        joined = empty_join(cls, layers)
        joined.bias = joined_bias(layers)
        joined._pack(torch.cat([m.weight_matrix() for m in layers]))
        return joined


PROBE_ROWS = (2, 3, 5, 8, 17, 33, 64)
"""Row counts :func:`row_invariant` compares with rows computed one at a time (up to a forward of
several requests' trees)."""
MAX_PIECES = 8
"""Most pieces :func:`invariant_linear` splits a layer's input features into."""


def row_invariant(layer: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                  seed: int = 0) -> bool:
    """Whether ``layer`` (``[rows, in_features] -> [rows, out]``) gives each row the same bits
    alone as inside calls of :data:`PROBE_ROWS` rows, on seeded random rows and on constant rows
    (each row one power of two times ones, which on :func:`order_sensitive_linear`'s weights makes
    every output depend on the order its input features are summed in)."""
    gen = torch.Generator().manual_seed(seed)
    n = max(PROBE_ROWS)
    scales = 2.0 ** torch.randint(-2, 3, (n, 1), generator=gen) * (1 - 2 * torch.randint(0, 2, (n, 1), generator=gen))
    probes = (torch.randn(n, in_features, generator=gen).to(dtype), (scales * torch.ones(n, in_features)).to(dtype))
    with torch.no_grad():
        for x in probes:
            alone = torch.cat([layer(x[i : i + 1]) for i in range(n)])
            if not all(torch.equal(layer(x[:m]), alone[:m]) for m in PROBE_ROWS):
                return False
    return True


def order_sensitive_linear(linear: nn.Linear, seed: int = 0) -> nn.Linear:
    """A linear of ``linear``'s shape, dtype and device, no bias, whose outputs on constant input
    rows depend on the order a kernel sums the input features in, whatever that order: each output
    row's weights are pairs ``+b, -b`` of large values (2^12 to 2^17; 2^7 to 2^12 in float16),
    which cancel exactly, and small ones (below 1) that carry the sum, shuffled. Added in any
    order, the partial sums are large, so the small terms are rounded by amounts that depend on
    which came before them, several times an output's last bit (tested: reversing, halving or
    blocking the sum changes most outputs). A real layer's weights need not be like this (zeros, or a
    narrow range, can hide a kernel whose order depends on the batch); a kernel's order depends on
    the shape and dtype alone, so the verdict on this layer is the verdict for every layer of its
    shape."""
    out_features, in_features = linear.out_features, linear.in_features
    gen = torch.Generator().manual_seed(seed)
    rows = min(out_features, ORDER_SENSITIVE_ROWS)  # distinct rows, repeated to the layer's height
    pairs = in_features // 4
    top = 12 if linear.weight.dtype == torch.float16 else 17  # float16's largest is 65504
    big = (2.0 ** torch.randint(top - 5, top, (rows, pairs), generator=gen)
           * (1 + torch.rand(rows, pairs, generator=gen))).to(linear.weight.dtype).float()
    rest = in_features - 2 * pairs
    small = ((2 * torch.rand(rows, rest, generator=gen) - 1)
             * 2.0 ** -torch.randint(0, 3, (rows, rest), generator=gen).float())
    weight = torch.cat([big, -big, small], dim=1)
    weight = torch.gather(weight, 1, torch.argsort(torch.rand(rows, in_features, generator=gen), dim=1))
    probe = nn.Linear(in_features, out_features, bias=False, device="meta")  # no init: its weight is set here
    tiled = weight.to(linear.weight.dtype).repeat(-(-out_features // rows), 1)[:out_features]
    probe.weight = nn.Parameter(tiled.to(linear.weight.device), requires_grad=False)
    return probe


ORDER_SENSITIVE_ROWS = 4096
"""Most distinct weight rows :func:`order_sensitive_linear` draws (then repeats to the layer's
height): drawing and shuffling every row of a 262,144-row LM head is slow. Fewer distinct
rows show a kernel's order less surely: with 64, one seed of three missed the order of oneDNN's
bf16 GEMM over 2,432 input features that 896 distinct rows showed for every seed."""
PROBE_SEEDS = (0, 1)
"""Seeds of the order-sensitive copies :func:`invariant_linear` probes a shape with: a verdict of
row-invariant needs every one."""


class SplitLinear(LinearStandIn):
    """``y = x[:, K_0] W_0^T + x[:, K_1] W_1^T + ... (+ b)``: the layer over consecutive pieces of
    its input features, each piece a layer of its own (``make`` of the piece's ``nn.Linear``), the
    partial outputs added in piece order, the bias last. Some GEMM kernels sum a long input in
    another order for one row than for several (oneDNN on an AVX-512 EPYC, fp32 and bf16, past
    1024 input features, measured), so a row's output would depend on its batch; each piece short
    enough is row-invariant, and so is their sum. The outputs differ from the whole layer's by
    rounding only."""

    def __init__(self, linear: nn.Linear, pieces: int, make: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__(linear)
        size = -(-self.in_features // pieces)
        size = -(-size // 64) * 64 if size > 64 else size  # pieces on 64-feature boundaries where they can be
        self.bounds = [(a, min(a + size, self.in_features)) for a in range(0, self.in_features, size)]
        weight = linear.weight.detach()
        parts = []
        for a, b in self.bounds:
            part = nn.Linear(b - a, self.out_features, bias=False, device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                part.weight.copy_(weight[:, a:b])
            parts.append(make(part))
        self.parts = nn.ModuleList(parts)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        out = None
        for (a, b), part in zip(self.bounds, self.parts, strict=True):
            piece = part(x[:, a:b])
            out = piece if out is None else out + piece
        assert out is not None
        return out if self.bias is None else out + self.bias

    def repr_extra(self) -> str:
        return f", pieces={len(self.bounds)}"


def invariant_linear(linear: nn.Linear, make: Callable[[nn.Linear], nn.Module],
                     verdicts: dict[tuple[int, int], int] | None = None) -> nn.Module:
    """``make(linear)`` if layers of its shape are :func:`row_invariant`, else a
    :class:`SplitLinear` over the fewest pieces (2 to :data:`MAX_PIECES`) whose pieces are; else
    ``make(linear)`` all the same (the load-time self-test then reports ``up to rounding``). The
    verdict is taken on :func:`order_sensitive_linear`'s copy of the shape, not on ``linear``'s
    own weights, which may hide the kernel's order, with each seed of :data:`PROBE_SEEDS`;
    ``verdicts`` caches the pieces chosen per ``(out_features, in_features)``, which is all the
    choice depends on."""
    verdicts = {} if verdicts is None else verdicts
    shape = (linear.out_features, linear.in_features)
    if shape not in verdicts:
        def invariant(pieces: int) -> bool:  # one probe at a time: an LM head's copy is as large as the head
            for seed in PROBE_SEEDS:
                probe = order_sensitive_linear(linear, seed)
                layer = make(probe) if pieces == 1 else SplitLinear(probe, pieces, make)
                if not row_invariant(layer, linear.in_features, linear.weight.dtype):
                    return False
            return True

        verdicts[shape] = next((pieces for pieces in range(1, min(MAX_PIECES, linear.in_features) + 1)
                                if invariant(pieces)), 1)
    pieces = verdicts[shape]
    return make(linear) if pieces == 1 else SplitLinear(linear, pieces, make)


def pack_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` (CPU, a dtype of :data:`PACKED_DTYPES`) for an
    :class:`F32Linear` (float32, where triedec's kernels are built) or a :class:`PackedLinear` (or,
    where its rows are not invariant whole, a :class:`SplitLinear` of them:
    :func:`invariant_linear`), in place.

    A linear whose weight is shared with another module (a tied LM head) gets a packed copy; the
    other module keeps the original. The parameters left (embeddings, norms) are then copied into
    memory of their own: loaders map the weights file into memory, and the mapping, with every
    page of the replaced weights that packing read, stays resident as long as any tensor still
    points into it. Returns the bytes of packed weights added beyond the ones freed (the tied
    copies): the net extra memory."""
    shared = {id(p) for name, m in model.named_modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    added = 0
    verdicts: dict[tuple[int, int], int] = {}
    own = kernel_available()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in PACKED_DTYPES:
                if id(child.weight) in shared:
                    added += child.weight.numel() * child.weight.element_size()
                if own and child.weight.dtype == torch.float32:
                    setattr(parent, name, F32Linear(child))
                else:
                    setattr(parent, name, invariant_linear(child, PackedLinear, verdicts))
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return added


def split_linears(model: nn.Module) -> int:
    """Swap every CPU ``nn.Linear`` of ``model`` whose rows are not :func:`row_invariant` (bf16
    ``F.linear`` past 1024 input features on an AVX-512 EPYC, measured) for a
    :class:`SplitLinear` of ``nn.Linear`` pieces that are, in place; returns how many were
    swapped. Layers that are invariant whole stay as they are."""
    verdicts: dict[tuple[int, int], int] = {}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                replaced = invariant_linear(child, lambda part: part, verdicts)
                if isinstance(replaced, SplitLinear):
                    setattr(parent, name, replaced)
                    swapped += 1
    return swapped
