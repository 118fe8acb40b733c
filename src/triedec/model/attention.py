"""Tree attention with a fixed reduction order: triedec's own compiled kernel.

:func:`tree_attention` computes, for each query and head, softmax-weighted values over exactly the
key slots that query sees, summing in an order fixed by each key's rank among them (see
``csrc/tree_attention.cpp``). A query therefore gets the same bits whatever else the call holds:
alone (plain decoding), at any depth of a draft tree of any shape, beside prompt-chunk rows, with
sliding windows or grouped-query heads. torch's sdpa gives no such promise (on this CPU a query
alone and the same query inside a call of 2-64 queries differ in the last bits), and a torch
upgrade could change how any of its kernels sum, so invariance rests on this file instead.

The kernel is C++ (``csrc/tree_attention.cpp``), built with triedec's other kernels the first
time one is needed (:mod:`triedec.model.native`). Pure torch: nothing here knows transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triedec.core.errors import TriedecError
from triedec.model.native import load_kernel

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes the kernel runs (it computes in float32 and rounds each output once)."""


def key_lists(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key slots each query sees, from bool ``visible [T, S]``: ``(offsets [T + 1] int64,
    indices int32)``, query t seeing ``indices[offsets[t]:offsets[t + 1]]`` (ascending). Computed
    once per forward and reused by every layer of the same type."""
    counts = visible.sum(dim=1)
    if bool((counts == 0).any()):
        raise TriedecError("every query must see at least one key")
    offsets = torch.zeros(visible.shape[0] + 1, dtype=torch.long)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    return offsets, visible.nonzero()[:, 1].to(torch.int32)


def tree_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   seen: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
                   softcap: float | None = None) -> torch.Tensor:
    """Attention of ``query [1, heads, T, dim]`` over ``keys``/``values [1, kv_heads, S, dim]``
    (views are fine: only the feature dimension must be contiguous). ``seen`` is
    :func:`key_lists` of a bool ``[T, S]`` visibility, or None (every query sees every slot).
    ``heads`` must be a multiple of ``kv_heads`` (grouped-query heads read their group's K/V in
    place). ``softcap``: scores become ``softcap * tanh(score / softcap)``. Returns
    ``[1, T, heads, dim]`` in the query's dtype (transformers' attention layout). CPU tensors of a
    dtype in :data:`DTYPES`; nothing is mutated."""
    if query.dtype not in DTYPES:
        raise TriedecError(f"tree attention runs {[str(d) for d in DTYPES]}, not {query.dtype}")
    kernel = load_kernel()
    offsets, indices = seen if seen is not None else (None, None)
    out = kernel.tree_attention(query[0], keys[0], values[0], offsets, indices, float(scale), float(softcap or 0.0))
    return out[None]


def tree_attention_items(query: torch.Tensor, caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         bounds: Sequence[int], seen: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                         scale: float, softcap: float | None = None) -> torch.Tensor:
    """:func:`tree_attention` for several items in one call (one parallel loop, one crossing into
    C++): item k's queries are ``query[:, :, bounds[k]:bounds[k + 1]]`` and attend over its own
    ``caches[k]`` (keys, values ``[1, kv_heads, S_k, dim]``) with its own ``seen[k]``. Every
    output is bit-identical to what :func:`tree_attention` gives that item alone. Returns ``[1, T,
    heads, dim]``; nothing is mutated."""
    if query.dtype not in DTYPES:
        raise TriedecError(f"tree attention runs {[str(d) for d in DTYPES]}, not {query.dtype}")
    kernel = load_kernel()
    out = kernel.tree_attention_items(query[0], [k[0] for k, _ in caches], [v[0] for _, v in caches], list(bounds),
                                      [None if s is None else s[0] for s in seen],
                                      [None if s is None else s[1] for s in seen], float(scale), float(softcap or 0.0))
    return out[None]
