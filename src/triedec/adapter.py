"""The only module that knows transformers internals.

:class:`ModelAdapter` runs one forward of arbitrary tokens (a draft tree, a prompt, the newest
beam leaves) on top of a :class:`~triedec.kvcache.KVCache`, with an explicit visibility matrix and
explicit position ids, and returns logits for every token. What to keep afterwards is the caller's
business (``KVCache.commit`` / ``KVCache.select``).

Quirks handled here (checked on transformers 5.x):
* a 4D float mask ``[1, 1, q, k]`` is used as-is by ``sdpa`` and ``eager``; a bool mask is silently
  wrong with ``eager``, so masks are always additive float (0 / dtype minimum);
* flash-attention kernels ignore custom masks: refused;
* models with sliding-window layers take a ``{layer_type: mask}`` dict; the window is applied from
  each slot's recorded position id, so it is right for trees and trie-shaped beam caches alike;
* default position ids would be ``arange + cache length`` (wrong for tree tokens): always passed;
* the KV cache is a ``transformers.Cache`` whose layers write into our preallocated buffers;
* under a tree mask, stock ``sdpa`` copies the grouped K/V once per query head (``repeat_kv``,
  ~1 ms per layer on a 512-token cache here); the ``triedec_sdpa`` attention function registered
  below (``AttentionInterface``, a documented extension point) lets torch's sdpa read the groups in
  place (``enable_gqa``) and is otherwise the stock function.

**Kernels.** ``ModelAdapter(model, kernels="auto")`` speeds the model up in place where the
technique applies: oneDNN pre-packed linears (:mod:`triedec.kernels`; CPU, fp32) and
``triedec_sdpa`` (models on ``sdpa``). ``kernels="plain"`` leaves the model untouched. Either way
:attr:`ModelAdapter.kernels` names what the model runs, and the stats and calibration record it.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from triedec.errors import TriedecError
from triedec.kernels import PackedLinear, pack_linears, packing_available
from triedec.kvcache import KVCache
from triedec.tree import additive_mask

GQA_SDPA = "triedec_sdpa"
SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations a model may be loaded with (flash attention ignores tree masks)."""
KERNELS = ("auto", "plain")
_FULL, _SLIDING = "full_attention", "sliding_attention"


def _gqa_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, except that several queries under a mask read grouped K/V
    in place (``enable_gqa``) instead of copying them per head. The same arithmetic."""
    groups = getattr(module, "num_key_value_groups", 1)
    special = any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "cache")) or dropout
    if attention_mask is None or groups == 1 or query.shape[2] == 1 or special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, _gqa_sdpa)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def apply_kernels(model: PreTrainedModel, kernels: str) -> None:
    """Speed ``model`` up in place (``"auto"``: what applies on its device and dtype) or leave it
    (``"plain"``). See the module doc."""
    if kernels not in KERNELS:
        raise TriedecError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "plain":
        return
    param = next(model.parameters())
    if packing_available(param.device, param.dtype):
        pack_linears(model)
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(GQA_SDPA)


def describe_kernels(model: PreTrainedModel) -> str:
    """What ``model`` runs: ``plain``, or the techniques applied, joined by ``+``."""
    used = []
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        used.append("onednn-packed-linear")
    if getattr(model.config, "_attn_implementation", None) == GQA_SDPA:
        used.append("gqa-sdpa")
    return "+".join(used) or "plain"


class _SlotLayer(CacheLayerMixin):
    """One layer of a transformers ``Cache`` backed by a :class:`KVCache`."""

    is_sliding = False

    def __init__(self, store: KVCache, index: int) -> None:
        super().__init__()
        self.store, self.index = store, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers are allocated by the store on first write."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.length

    def get_max_length(self) -> int:
        return self.store.capacity


@dataclass(frozen=True)
class AttentionLayout:
    """Which mask each layer needs: ``windows`` maps a layer type to its sliding window (None =
    full attention). ``per_type`` says whether the model takes a ``{layer_type: mask}`` dict."""

    windows: dict[str, int | None]
    per_type: bool

    @property
    def no_windows(self) -> bool:
        return all(w is None for w in self.windows.values())

    @classmethod
    def from_config(cls, config: object) -> AttentionLayout:
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        layer_types = getattr(config, "layer_types", None)
        if not layer_types:
            return cls({_FULL: window}, per_type=False)
        kinds = set(layer_types)
        unknown = kinds - {_FULL, _SLIDING}
        if unknown:
            raise TriedecError(f"unsupported attention layer types {sorted(unknown)}: triedec handles "
                               f"{_FULL!r} and {_SLIDING!r}")
        if _SLIDING in kinds and not window:
            raise TriedecError("config has sliding_attention layers but no sliding_window")
        windows = {k: (window if k == _SLIDING else None) for k in kinds}
        return cls(windows, per_type=len(kinds) > 1)


class ModelAdapter:
    """Tree-masked forwards of a Hugging Face causal LM on a preallocated KV cache.

    The adapter never mutates the model; it mutates only the :class:`KVCache` passed to it.
    """

    def __init__(self, model: PreTrainedModel, kernels: str = "plain") -> None:
        config = model.config
        attn = getattr(config, "_attn_implementation", None) or "eager"
        if attn not in (*SUPPORTED_ATTENTION, GQA_SDPA):
            hint = " (flash-attention ignores custom tree masks)" if "flash" in attn else ""
            raise TriedecError(
                f"attention implementation {attn!r} is not supported{hint}; use one of {SUPPORTED_ATTENTION}"
            )
        if getattr(config, "is_encoder_decoder", False):
            raise TriedecError(f"{type(model).__name__} is an encoder-decoder model, not a causal LM")
        self.model = model
        self.config = config
        self.layout = AttentionLayout.from_config(config.get_text_config())
        head = model.get_output_embeddings()
        self.vocab_size = int(head.out_features if isinstance(head, PackedLinear) else head.weight.shape[0])
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        apply_kernels(model, kernels)
        self.kernels = describe_kernels(model)
        """What the model runs: ``plain`` or the techniques applied (see the module doc)."""
        self._sdpa = config._attn_implementation in ("sdpa", GQA_SDPA)

    @cached_property
    def model_id(self) -> str:
        """A fingerprint of the weights: architecture, shapes, and the signs of a sample of the
        input embeddings (kept exactly by any float dtype, so the same model gets the same id
        whatever its path or dtype)."""
        emb = self.model.get_input_embeddings().weight
        rows = torch.linspace(0, emb.shape[0] - 1, 64).long().to(emb.device)
        digest = hashlib.sha256()
        digest.update(f"{type(self.model).__name__}|{tuple(emb.shape)}|{self.vocab_size}|{self._num_layers()}".encode())
        digest.update((emb.detach()[rows] > 0).cpu().numpy().tobytes())
        return digest.hexdigest()[:16]

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(capacity)

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on CPU): call before reading a clock."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _masks(self, cache: KVCache, visible: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive masks ``[1, 1, T, length + T]`` per layer type, the window applied by position."""
        kpos = cache.positions()
        qpos = kpos[cache.length :]
        masks = {}
        for kind, window in self.layout.windows.items():
            vis = visible if window is None else visible & ((qpos[:, None] - kpos[None, :]) < window)
            masks[kind] = additive_mask(vis.to(self.device), self.dtype)
        return masks if self.layout.per_type else next(iter(masks.values()))

    @torch.inference_mode()
    def prefill(self, cache: KVCache, tokens: torch.Tensor, keep_last: int = 1) -> torch.Tensor:
        """Causal forward of ``tokens [T]`` at positions ``0..T-1`` on an empty ``cache``.

        transformers builds the (causal, sliding-window) masks itself here; the T slots are left
        pending. Returns the logits of the last ``keep_last`` tokens: ``[min(keep_last, T), vocab]``.
        """
        if cache.length or cache.pending:
            raise TriedecError("prefill needs an empty cache")
        positions = torch.arange(tokens.numel())
        cache.stage(positions)
        return self._run(tokens, positions, cache, None, max(1, min(keep_last, tokens.numel())))

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run ``tokens [T]`` at ``positions [T]`` on top of ``cache``.

        ``visible [T, cache.length + T]`` (bool) says which committed slots and which of the new
        tokens each new token attends to. The new K/V land in T pending slots of ``cache``; commit
        or drop them afterwards. Returns float logits ``[T, vocab]`` (``[1, vocab]`` for the last
        token only if ``last_only``).
        """
        n = tokens.numel()
        if visible.shape != (n, cache.length + n):
            raise TriedecError(f"visibility must be [{n}, {cache.length + n}], got {list(visible.shape)}")
        cache.stage(positions)
        # One query that sees every slot, without sliding windows: no mask at all, which lets sdpa
        # use its grouped-query kernel instead of copying K/V per head (what transformers' own
        # decode step does).
        plain = n == 1 and self._sdpa and self.layout.no_windows and bool(visible.all())
        masks = None if plain else self._masks(cache, visible)
        return self._run(tokens, positions, cache, masks, 1 if last_only else n)

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        masks: torch.Tensor | dict[str, torch.Tensor] | None,
        keep_last: int,
    ) -> torch.Tensor:
        """The model call; ``cache`` has the T pending slots staged. Logits ``[keep_last, vocab]``."""
        hf_cache = Cache(layers=[_SlotLayer(cache, i) for i in range(self._num_layers())])
        kwargs = {}
        if keep_last < tokens.numel() and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep_last  # the LM head runs on these positions only
        out = self.model(
            input_ids=tokens.to(self.device)[None],
            position_ids=positions.to(self.device)[None],
            attention_mask=masks,
            past_key_values=hf_cache,
            use_cache=True,
            **kwargs,
        )
        logits = out.logits[0]
        return logits[-keep_last:].float()

    def _num_layers(self) -> int:
        return int(self.config.get_text_config().num_hidden_layers)
