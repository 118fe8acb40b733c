"""A GGUF file's own K-quant blocks for the linears of a model loaded from it.

transformers' GGUF loader hands triedec dequantized float32 weights. For most block types the
file's codes and scales can be found again in those values (``precision.quantize_int8_groups``,
``precision.q6_codes``); a Q4_K or Q5_K block's, ``w = d * sc * q - dmin * m``, cannot in
general, since the difference is rounded. So this module reads those blocks from the file itself
(the ``gguf`` package's reader, memory-mapped) and finds the linear each tensor became: the one
whose weight equals the tensor's dequantized values, up to an order of its rows (transformers
reverses llama.cpp's q/k row permutation). A layer is given its file's blocks only where every
value matches bit for bit; anything else keeps the float path.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from triedec.model.precision import SUPER_BLOCK, KQuantParts

log = logging.getLogger(__name__)

_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176}
"""The K-quant block types read here and the bytes of one super-block of 256 weights."""


@dataclass(frozen=True)
class FileTensor:
    """One entry of a GGUF file's tensor table: its name, block type (``Q4_K``, ``F32``, ...),
    shape as the file lists it (the fastest-moving dimension first) and raw bytes (read-only,
    memory-mapped)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes of each scalar ``GGUFValueType`` (8 is a string, 9 an array)."""


def tensor_table(path: str | os.PathLike[str]) -> list[FileTensor]:
    """The tensor table of the little-endian GGUF file at ``path`` (versions 2 and 3), its data
    memory-mapped. The metadata is stepped over, not parsed: ``gguf.GGUFReader`` builds every
    metadata value first, 7.6 s for the default file's 49k-token vocabulary on a 2-core EPYC,
    where this takes milliseconds. It gives the same tensors as that reader (tested)."""
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

    data = np.memmap(path, mode="r")
    buf = memoryview(data)
    offs = 0

    def take(fmt: str) -> tuple:
        nonlocal offs
        values = struct.unpack_from(fmt, buf, offs)
        offs += struct.calcsize(fmt)
        return values

    def text() -> str:
        nonlocal offs
        (length,) = take("<Q")
        offs += length
        return bytes(buf[offs - length:offs]).decode("utf-8")

    def skip(kind: int) -> None:
        nonlocal offs
        if kind == 8:
            (length,) = take("<Q")  # (not offs += take(...): that would add to offs as it was before take)
            offs += length
        elif kind == 9:
            item, count = take("<IQ")
            if item in _SCALAR_BYTES:
                offs += _SCALAR_BYTES[item] * count
            else:
                for _ in range(count):
                    skip(item)
        elif kind in _SCALAR_BYTES:
            offs += _SCALAR_BYTES[kind]
        else:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

    magic, version, count, kv_count = take("<IIQQ")
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3")
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = text()
        (kind,) = take("<I")
        if key == "general.alignment" and kind == 4:
            (alignment,) = take("<I")
        else:
            skip(kind)
    infos = []
    for _ in range(count):
        name = text()
        (dims,) = take("<I")
        shape = take(f"<{dims}Q")
        kind, offset = take("<IQ")
        infos.append((name, GGMLQuantizationType(kind), tuple(int(x) for x in shape), offset))
    start = offs + (-offs % alignment)
    tensors = []
    for name, kind, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        n = int(np.prod(shape, dtype=np.int64))
        at = start + offset
        tensors.append(FileTensor(name, kind.name, shape, data[at:at + n // block * size]))
    return tensors


def parse_kquant(blocks: np.ndarray, kind: str) -> KQuantParts:
    """The parts of ``blocks`` ``[N, K / 256 * bytes]`` (uint8, a Q4_K or Q5_K tensor's rows as the
    file stores them; llama.cpp's ``block_q4_K`` / ``block_q5_K``: fp16 ``d`` and ``dmin``, 12
    bytes of 6-bit scales and mins, for Q5_K 32 bytes of fifth bits, 128 bytes of low nibbles)."""
    from gguf.quants import Q4_K

    size = _BLOCK_BYTES[kind]
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, size)  # one row per super-block
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    qs = b[:, size - 128:]
    # 32 bytes hold groups 2c (low nibbles) and 2c + 1 (high nibbles), c = 0..3
    low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    codes = low.reshape(-1, 8, 32)
    if kind == "Q5_K":  # bit j of the 32 bytes of fifth bits: group j's
        fifth = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        codes = codes | (fifth << 4)

    def rows(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))

    return KQuantParts(5 if kind == "Q5_K" else 4, rows(codes), rows(sc), rows(m), rows(d), rows(dmin))


def _row_order(weight: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """The row order ``p`` with ``weight == values[p]`` bit for bit, or None."""
    if weight.shape != values.shape:
        return None
    if torch.equal(weight, values):
        return torch.arange(weight.shape[0])
    probe = torch.randn(weight.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    order = torch.empty(weight.shape[0], dtype=torch.int64)
    order[(weight.double() @ probe).argsort()] = (values.double() @ probe).argsort()
    return order if torch.equal(weight, values[order]) else None


def file_kquant_layers(path: str | os.PathLike[str], linears: Iterable[nn.Linear]) -> dict[int, KQuantParts]:
    """For the ``linears`` of a model loaded from the GGUF file at ``path`` (float32 weights), the
    file's Q4_K and Q5_K blocks of each whose weight is such a tensor's values, bit for bit (its
    rows in the model's order), by the module's id. Tensors that match no linear are left out."""
    by_shape: dict[tuple[int, int], list[nn.Linear]] = {}
    for linear in linears:
        if linear.in_features % SUPER_BLOCK == 0 and linear.weight.dtype == torch.float32:
            by_shape.setdefault((linear.out_features, linear.in_features), []).append(linear)
    found: dict[int, KQuantParts] = {}
    if not by_shape:
        return found
    for tensor in tensor_table(path):
        kind = tensor.kind
        if kind not in _BLOCK_BYTES or len(tensor.shape) != 2:
            continue
        cols, n = (int(x) for x in tensor.shape)  # GGUF lists the fastest-moving dimension first
        candidates = [m for m in by_shape.get((n, cols), []) if id(m) not in found]
        if not candidates:
            continue
        parts = parse_kquant(np.asarray(tensor.data, dtype=np.uint8).reshape(n, -1), kind)
        values = parts.values()  # the gguf package's dequantized values, bit for bit
        for linear in candidates:
            order = _row_order(linear.weight.detach(), values)  # checks every value
            if order is not None:
                found[id(linear)] = parts.rows(order)
                break
        else:
            log.debug("%s: no linear has its %s values; those layers keep the float path", tensor.name, kind)
    return found
