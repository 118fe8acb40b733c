"""A GGUF file's own blocks (K-quants, and the legacy scale-and-min types) for the linears of a
model loaded from it.

transformers' GGUF loader hands triedec dequantized float32 weights. For some block types the
file's codes and scales can be found again in those values (``precision.quantize_int8_groups``,
``precision.q6_codes``); a Q4_K or Q5_K block's, ``w = d * sc * q - dmin * m``, cannot in
general, since the difference is rounded, and a Q4_0, Q4_1 or Q5_1 block's fp16 ``d`` and ``m``
can only be approximated from them (``precision.quantize_int4``'s grid search, bf16 scale and zero,
6.4 s for the default model's layers). So this module reads those blocks from the file itself (its
tensor table, memory-mapped) and finds the linear each tensor became: the one whose weight equals
the tensor's dequantized values, up to an order of its rows (transformers reverses llama.cpp's q/k
row permutation). A layer is given its file's blocks only where every value matches bit for bit;
anything else keeps the float path.
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

from triedec.core.params import GROUP_SIZE
from triedec.model.precision import SUPER_BLOCK, FileBlocks, KQuantParts, ScaleMinParts

log = logging.getLogger(__name__)

_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q4_0": 18, "Q4_1": 20, "Q5_1": 24}
"""The block types read here and the bytes of one block: a super-block of 256 weights (K-quants),
a group of 32 (Q4_0, Q4_1, Q5_1)."""

_BLOCK_WEIGHTS = {"Q4_K": SUPER_BLOCK, "Q5_K": SUPER_BLOCK, "Q4_0": GROUP_SIZE, "Q4_1": GROUP_SIZE, "Q5_1": GROUP_SIZE}


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


def parse_scale_min(blocks: np.ndarray, kind: str) -> ScaleMinParts | None:
    """The parts of ``blocks`` ``[N, K / 32 * bytes]`` (uint8, a Q4_0, Q4_1 or Q5_1 tensor's rows
    as the file stores them; llama.cpp's ``block_q4_0`` (fp16 ``d``, 16 bytes of nibbles),
    ``block_q4_1`` (``d``, ``m``, nibbles), ``block_q5_1`` (``d``, ``m``, 4 bytes of fifth bits,
    nibbles); byte ``j``'s low nibble is weight ``j``, its high one weight ``16 + j``). None for a
    Q4_0 tensor whose ``-8 d`` would overflow fp16 (no real file has one)."""
    size = _BLOCK_BYTES[kind]
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, size)  # one row per group of 32
    d = b[:, 0:2].copy().view(np.float16)
    if kind == "Q4_0":
        with np.errstate(over="ignore"):
            m = d * np.float16(-8)
        if not np.isfinite(m).all():
            return None
    else:
        m = b[:, 2:4].copy().view(np.float16)
    qs = b[:, size - 16:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    if kind == "Q5_1":  # bit i of the 32 bits: weight i's fifth bit
        high = b[:, 4:8].copy().view("<u4")
        codes = codes | (((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)

    def rows(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))

    return ScaleMinParts(kind, rows(codes), rows(d.astype(np.float32)), rows(m.astype(np.float32)))


def _row_keys(weight: torch.Tensor) -> torch.Tensor:
    """A 64-bit key per row of the float32 ``weight [N, K]``, from its values' bits, a zero's sign
    aside (rows equal as ``torch.equal`` compares them, equal keys; other rows, other keys but with a
    chance of ~2^-64)."""
    k = weight.shape[1]
    mult = torch.randint(-(2**62), 2**62, (k,), dtype=torch.int64, generator=torch.Generator().manual_seed(k))
    bits = (weight + 0.0).contiguous().view(torch.int32).to(torch.int64)  # + 0.0: -0 is +0
    return (bits * mult).sum(dim=1)  # wraps: exact mod 2^64


def _row_order(weight: torch.Tensor, values: torch.Tensor, keys: torch.Tensor | None = None
               ) -> torch.Tensor | None:
    """The row order ``p`` with ``weight == values[p]`` bit for bit, or None. ``keys``:
    ``_row_keys(weight)``, where the caller has them."""
    if weight.shape != values.shape:
        return None
    if torch.equal(weight, values):
        return torch.arange(weight.shape[0])
    keys = _row_keys(weight) if keys is None else keys
    order = torch.empty(weight.shape[0], dtype=torch.int64)
    order[keys.argsort()] = _row_keys(values).argsort()
    return order if torch.equal(weight, values[order]) else None


def _parse(tensor: FileTensor, n: int) -> FileBlocks | None:
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n, -1)
    return parse_kquant(raw, tensor.kind) if tensor.kind in ("Q4_K", "Q5_K") else parse_scale_min(raw, tensor.kind)


def file_block_layers(path: str | os.PathLike[str], linears: Iterable[nn.Linear]) -> dict[int, FileBlocks]:
    """For the ``linears`` of a model loaded from the GGUF file at ``path`` (float32 weights), the
    file's Q4_K, Q5_K, Q4_0, Q4_1 and Q5_1 blocks of each whose weight is such a tensor's values,
    bit for bit (its rows in the model's order), by the module's id. A tensor is matched to a linear
    of its shape by the multiset of its rows (:func:`_row_keys`), then checked value by value.
    Tensors that match no linear are left out."""
    by_key: dict[tuple[int, int, bytes], list[tuple[nn.Linear, torch.Tensor]]] = {}
    shapes: set[tuple[int, int]] = set()
    for linear in linears:
        if linear.in_features % GROUP_SIZE == 0 and linear.weight.dtype == torch.float32:
            keys = _row_keys(linear.weight.detach())
            shape = (linear.out_features, linear.in_features)
            by_key.setdefault((*shape, keys.sort().values.numpy().tobytes()), []).append((linear, keys))
            shapes.add(shape)
    found: dict[int, FileBlocks] = {}
    if not by_key:
        return found
    for tensor in tensor_table(path):
        kind = tensor.kind
        if kind not in _BLOCK_BYTES or len(tensor.shape) != 2:
            continue
        cols, n = (int(x) for x in tensor.shape)  # GGUF lists the fastest-moving dimension first
        if (n, cols) not in shapes or cols % _BLOCK_WEIGHTS[kind]:
            continue
        parts = _parse(tensor, n)
        if parts is None:
            continue
        values = parts.values()  # the gguf package's dequantized values, bit for bit
        candidates = by_key.get((n, cols, _row_keys(values).sort().values.numpy().tobytes()), [])
        for linear, keys in candidates:
            if id(linear) in found:
                continue
            order = _row_order(linear.weight.detach(), values, keys)  # checks every value
            if order is not None:
                found[id(linear)] = parts.rows(order)
                break
        else:
            log.debug("%s: no linear has its %s values; those layers keep the float path", tensor.name, kind)
    return found
