"""How one forward over many requests passes through a stock transformers model (documented
extension points only; :mod:`triedec.model.adapter` drives it):

* :class:`ForwardItem`: one request's part of a forward (its tokens on top of its own KV cache);
* the **dispatcher**: attention functions registered with ``AttentionInterface`` (:data:`GQA_SDPA`,
  :data:`STOCK_SDPA`, :data:`EAGER`). Given an :class:`ItemBatch` (the ``triedec_batch`` keyword,
  which transformers hands to attention functions) it attends each item over its own cache, with
  triedec's fixed-order kernel or the model's own function; without one it is exactly the base
  function, with transformers' own masks;
* :class:`BatchCacheLayer`: the ``transformers.Cache`` layer that writes each item's new K/V into
  its own store;
* :class:`AttentionLayout`: which mask (sliding window or full) each layer needs.

See :mod:`triedec.model.adapter` for the quirks handled and why the result is exact.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from triedec.core.errors import TriedecError
from triedec.core.kvcache import KVCache
from triedec.model.attention import key_lists, tree_attention_items

GQA_SDPA = "triedec_sdpa"
"""the dispatcher over grouped-query sdpa (``kernels="auto"``)"""
STOCK_SDPA = "triedec_stock_sdpa"
"""the dispatcher over transformers' own sdpa (``kernels="plain"``)"""
EAGER = "triedec_eager"
"""the dispatcher over the model's own eager attention"""
BATCH_KEYWORD = "triedec_batch"
_FULL, _SLIDING = "full_attention", "sliding_attention"
AttentionFn = Callable[..., tuple[torch.Tensor, Any]]


def _gqa_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, except that queries under a mask read grouped K/V in place
    (``enable_gqa``) instead of copying them per head, and that torch's sdpa is called directly (the
    wrapper's per-call checks are paid per request and layer in a batched forward). The
    same arithmetic; anything special (soft-capping, position bias, dropout, a causal prompt
    without a mask) goes to transformers' function."""
    special = any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "cache")) or dropout
    if special or (attention_mask is None and query.shape[2] > 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=gqa)
    return out.transpose(1, 2), None


_EAGER_BY_CLASS: dict[type, AttentionFn] = {}


def _model_eager(module: nn.Module) -> AttentionFn:
    """The eager attention function of ``module``'s own modeling file (models define their own:
    Gemma's soft-capping, for example)."""
    found = _EAGER_BY_CLASS.get(type(module))
    if found is None:
        found = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if found is None:
            raise TriedecError(f"{type(module).__name__}: no eager_attention_forward in its modeling file; "
                               "load the model with attn_implementation='sdpa'")
        _EAGER_BY_CLASS[type(module)] = found
    return found


BASES: dict[str, Callable[[nn.Module], AttentionFn]] = {
    GQA_SDPA: lambda module: _gqa_sdpa,
    STOCK_SDPA: lambda module: sdpa_attention_forward,
    EAGER: _model_eager,
}
"""Each registered dispatcher's name -> the base attention function it calls for a module."""


def _dispatch(name: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The registered attention function ``name``: the base function, called once per item of a
    triedec batch (:class:`ItemBatch`), or as is outside triedec's forwards."""
    base = BASES[name](module)
    batch = kwargs.pop(BATCH_KEYWORD, None)
    if batch is None:
        return base(module, query, key, value, attention_mask, **kwargs)
    return batch.attend(module, query, base, kwargs)


for _name, _mask in ((GQA_SDPA, sdpa_mask), (STOCK_SDPA, sdpa_mask), (EAGER, eager_mask)):
    AttentionInterface.register(_name, partial(_dispatch, _name))
    AttentionMaskInterface.register(_name, _mask)


@dataclass(frozen=True)
class ForwardItem:
    """One request's part of a forward.

    ``tokens [T]`` at ``positions [T]`` go on top of ``cache`` (their K/V land in T pending slots).
    ``visible`` (bool) is ``[T, T]``: which of the new tokens each one attends to, every committed
    slot being visible (a draft tree's ancestry, a prompt chunk's causal triangle); or
    ``[T, cache.length + T]``: every slot spelled out (beam search's trie). ``keep``: how many of the
    last rows' logits to return (``-1``: all T)."""

    cache: KVCache
    tokens: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    keep: int = -1

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def rows(self) -> int:
        """Rows of logits returned."""
        return self.size if self.keep < 0 else min(self.keep, self.size)


def item_visibility(item: ForwardItem, layout: AttentionLayout) -> dict[str, torch.Tensor | None]:
    """Which slots each of the item's tokens attends to, per layer type: bool ``[T, length + T]``
    (``item.cache`` is staged), the window applied by each slot's position id; None where one
    query sees its whole cache (plain decoding's case: no list, no mask)."""
    cache, n = item.cache, item.size
    length = cache.length
    explicit = item.visible.shape[1] != n
    out: dict[str, torch.Tensor | None] = {}
    for kind, window in layout.windows.items():
        if n == 1 and not explicit and window is None and bool(item.visible.all()):
            out[kind] = None  # one query that sees its token sees everything (no mask built to say so)
            continue
        if explicit:
            visible = item.visible
        else:
            visible = torch.ones((n, length + n), dtype=torch.bool)
            visible[:, length:] = item.visible
        if window is not None:
            kpos = cache.positions()
            visible = visible & ((kpos[length:, None] - kpos[None, :]) < window)
        out[kind] = None if n == 1 and bool(visible.all()) else visible
    return out


def additive_mask(visible: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """``visible [T, S]`` as the additive float mask ``[1, 1, T, S]`` the models' own attention
    functions take: 0 where a token may attend, the dtype's minimum where it may not (a bool mask
    is silently wrong with ``eager``). None stays None (sdpa then takes its grouped-query path)."""
    if visible is None:
        return None
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None].to(device)


_UNSUPPORTED_BY_TREE_ATTENTION = ("s_aux", "sinks", "position_bias", "head_mask")


class ItemBatch:
    """The items of one forward: each item's bounds in the flattened row and what it sees per
    layer type. Handed to the dispatcher as the ``triedec_batch`` keyword.

    With ``exact`` (:attr:`triedec.model.adapter.ModelAdapter.exact_attention`), every item's attention is triedec's
    fixed-order kernel (:func:`triedec.model.attention.tree_attention`); otherwise the model's own
    function with additive masks. Each item's key lists or masks are built once per layer type,
    on the first layer that needs them."""

    def __init__(self, items: Sequence[ForwardItem], visibility: list[dict[str, torch.Tensor | None]],
                 kinds: tuple[str, ...], exact: bool, dtype: torch.dtype, device: torch.device) -> None:
        self.items, self.visibility, self.kinds = items, visibility, kinds
        self.exact, self.dtype, self.device = exact, dtype, device
        self.fell_back = False
        """Set when a layer asked for something the exact kernel does not do (attention sinks, a
        position bias, dropout, values of another head size than keys): that layer ran the
        model's own function."""
        self._prepared: dict[tuple[int, str, bool], Any] = {}
        self.bounds = []
        start = 0
        for item in items:
            self.bounds.append((start, start + item.size))
            start += item.size

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Each item's new K/V of ``layer`` (``[1, kv_heads, N, dim]``, the items' tokens in the
        row's order) into its own cache's pending slots."""
        if len(self.items) == 1:
            self.items[0].cache.write(layer, keys, values)
        else:
            for item, (start, stop) in zip(self.items, self.bounds, strict=True):
                item.cache.write(layer, keys[:, :, start:stop], values[:, :, start:stop])

    def _seen(self, index: int, kind: str, exact: bool) -> Any:
        key = (index, kind, exact)
        if key not in self._prepared:
            visible = self.visibility[index][kind]
            if exact:
                self._prepared[key] = None if visible is None else key_lists(visible)
            else:
                self._prepared[key] = additive_mask(visible, self.dtype, self.device)
        return self._prepared[key]

    def key_lists(self, index: int, kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Item ``index``'s key lists for layers of ``kind`` (:func:`~triedec.model.attention.key_lists`;
        None: each query sees every slot), built once per forward."""
        return self._seen(index, kind, True)

    def attend(self, module: nn.Module, query: torch.Tensor, base: AttentionFn,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
        """Attention of every item over its own cache: ``query [1, heads, N, dim]`` ->
        ``[1, N, heads, dim]``."""
        layer = module.layer_idx
        kind = self.kinds[layer]
        exact = self.exact and not kwargs.get("dropout") and not any(
            kwargs.get(k) is not None for k in _UNSUPPORTED_BY_TREE_ATTENTION)
        if self.exact and not exact:
            self.fell_back = True
        caches = [item.cache.view(layer) for item in self.items]
        if exact and not all(k.shape[-1] == v.shape[-1] == query.shape[-1] for k, v in caches):
            exact, self.fell_back = False, True  # values of another head size (latent attention)
        seen = [self._seen(index, kind, exact) for index in range(len(self.items))]
        if exact:  # every item in one call of the kernel
            scaling = kwargs.get("scaling")
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            edges = [start for start, _ in self.bounds] + [self.bounds[-1][1]]
            return tree_attention_items(query, caches, edges, seen, scale, kwargs.get("softcap")), None
        outs = [base(module, query[:, :, start:stop], keys, values, visible, **kwargs)[0]
                for (start, stop), (keys, values), visible in zip(self.bounds, caches, seen, strict=True)]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


class BatchCacheLayer(CacheLayerMixin):
    """One layer of a transformers ``Cache`` that writes each item's new K/V into its own store."""

    is_sliding = False

    def __init__(self, batch: ItemBatch, index: int) -> None:
        super().__init__()
        self.batch, self.index = batch, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers are allocated by each store on first write."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.batch.write(self.index, key_states, value_states)
        return key_states, value_states  # the dispatcher reads each item's own store

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


@dataclass(frozen=True)
class AttentionLayout:
    """Which mask each layer needs: ``windows`` maps a layer type to its sliding window (None =
    full attention); ``kinds[i]`` is layer i's type; ``per_type`` says whether the model takes a
    ``{layer_type: mask}`` dict."""

    windows: dict[str, int | None]
    kinds: tuple[str, ...]
    per_type: bool

    @property
    def no_windows(self) -> bool:
        return all(w is None for w in self.windows.values())

    @classmethod
    def from_config(cls, config: Any) -> AttentionLayout:
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        layers = int(config.num_hidden_layers)
        layer_types = getattr(config, "layer_types", None)
        if not layer_types:
            return cls({_FULL: window}, (_FULL,) * layers, per_type=False)
        kinds = set(layer_types)
        unknown = kinds - {_FULL, _SLIDING}
        if unknown:
            raise TriedecError(f"unsupported attention layer types {sorted(unknown)}: triedec handles "
                               f"{_FULL!r} and {_SLIDING!r}")
        if _SLIDING in kinds and not window:
            raise TriedecError("config has sliding_attention layers but no sliding_window")
        windows = {k: (window if k == _SLIDING else None) for k in kinds}
        return cls(windows, tuple(layer_types[:layers]), per_type=len(kinds) > 1)
