"""The only module that knows transformers internals, with :mod:`triedec.model.dispatch` (how one
forward over many items passes through the model), which it drives, and :mod:`triedec.model.runner`
(triedec's own walk of a Llama-family, Qwen3 or Gemma 3 model's layers, which it runs instead of the model's
``forward`` with ``kernels="auto"``).

:class:`ModelAdapter` runs **one forward over many requests**: each :class:`ForwardItem` is one
request's new tokens (a draft tree, a prompt chunk, beam leaves) on top of its own
:class:`~triedec.core.kvcache.KVCache`, with an explicit visibility matrix and explicit position ids.
The items' tokens are laid out as one flattened row, so every linear layer streams the weights
once for all of them; attention is computed per item, over that item's own cache only, so its work
grows with each request's own context, never with (all tokens) x (all contexts). Logits come back
per item. What to keep afterwards is the caller's business (``KVCache.commit`` / ``select``).

How, on stock transformers models (documented extension points only):
* a ``transformers.Cache`` whose layers write each item's new K/V into its own preallocated store;
* an attention function registered with ``AttentionInterface`` (a *dispatcher*): given the batch
  (passed as the ``triedec_batch`` keyword, which transformers hands to attention functions), it
  calls the model's own attention function once per item, on the item's slice of the queries, its
  cache and its mask; without it (a plain ``model.generate``) it is exactly the model's own
  function, with transformers' own masks (the dispatcher is registered with the base function's
  mask builder). Outside triedec's forwards the model therefore behaves exactly as before;
* a 4D placeholder mask, which transformers passes through untouched (the dispatcher builds each
  item's mask itself).

Quirks handled here (checked on transformers 5.x):
* masks are additive float (0 / dtype minimum): a bool mask is silently wrong with ``eager``;
* flash-attention kernels ignore custom masks: refused;
* sliding-window layers (Gemma 3): each layer type gets its own mask, the window applied from each
  slot's recorded position id, so it is right for trees and trie-shaped beam caches alike;
* default position ids would be ``arange + cache length`` (wrong for tree tokens): always passed;
* one query that sees its whole cache gets no mask at all, so sdpa takes its grouped-query path;
* under a tree mask, stock ``sdpa`` copies the grouped K/V once per query head (``repeat_kv``,
  per layer and step, growing with the cache); outside triedec's forwards, with
  ``kernels="auto"``, the base function is ``_gqa_sdpa``, which lets torch's sdpa read the groups
  in place (``enable_gqa``) and is otherwise the stock function.

**Exact by construction.** A row's logits never depend on the tree, the batch or its place in the
row when every op computes a row the same way whatever the number of rows. With
``kernels="auto"`` on CPU, attention in triedec's forwards is :func:`triedec.model.attention.tree_attention`,
whose sums run in an order fixed by each key's rank among the keys its query sees, and the linears
are oneDNN's pre-packed ones, whose rows are bit-identical for any number of rows (MKL's
``nn.Linear`` is not: its small-batch paths sum in another order); every other op works row by
row. In bfloat16, ``F.linear`` and torch's weight-only int8/int4 kernels (:mod:`triedec.model.precision`)
are row-invariant too on the CPUs measured. :func:`check_row_invariance` confirms it at construction
(:attr:`ModelAdapter.exactness`), and ``tests/test_invariance.py`` checks it on random trees and batches.

**Kernels.** ``ModelAdapter(model, kernels="auto")`` speeds the model up in place where the
technique applies (oneDNN pre-packed linears on CPU: fp32, and bf16 where oneDNN has bf16
kernels) and runs the fixed-order attention in its forwards (CPU). ``kernels="plain"`` keeps
stock transformers' kernels. Either way
:attr:`ModelAdapter.kernels` names what the model runs (quantized weights included, which the
model brings with it from loading), and the stats and calibration record it.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from triedec.core.errors import TriedecError
from triedec.core.kvcache import KVCache
from triedec.core.tree import TokenTree
from triedec.model.attention import DTYPES
from triedec.model.dispatch import (
    BASES,
    BATCH_KEYWORD,
    EAGER,
    GQA_SDPA,
    STOCK_SDPA,
    AttentionLayout,
    BatchCacheLayer,
    ForwardItem,
    ItemBatch,
    item_visibility,
)
from triedec.model.hugepages import place_weights
from triedec.model.linears import F32Linear, PackedLinear, pack_linears, packing_available, split_linears
from triedec.model.native import build_id, kernel_available
from triedec.model.precision import NATIVE_LINEARS, precision_of
from triedec.model.rmsnorm import FusedRMSNorm, fuse_norms
from triedec.model.runner import (
    RUNNER,
    RUNNERS,
    TRANSFORMERS,
    RowActivation,
    runner_for,
    why_not_runner,
    wrap_activations,
)

SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations a model may be loaded with (flash attention ignores tree masks)."""


def check_attention(attn: str) -> None:
    """Raise :class:`TriedecError` unless a model may be loaded with attention ``attn``."""
    if attn not in SUPPORTED_ATTENTION:
        hint = " (flash-attention ignores custom tree masks)" if "flash" in str(attn) else ""
        raise TriedecError(f"attention implementation {attn!r} is not supported{hint}; "
                           f"use one of {SUPPORTED_ATTENTION}")

KERNELS = ("auto", "plain")
FIXED_ORDER_ATTENTION = "fixed-order-attention"
"""How :func:`describe_kernels` names triedec's own tree attention (:mod:`triedec.model.attention`)."""


_RECURRENT_KINDS = {"linear_attention": "linear-attention", "conv": "short-convolution", "mamba": "Mamba",
                    "recurrent": "recurrent", "ssm": "state-space"}
"""``layer_types`` entries of layers with a state carried across tokens, and how an error names them."""
_RECURRENT_MODULES = {"GatedDeltaNet": "Gated DeltaNet", "ShortConv": "short-convolution", "Mamba": "Mamba",
                      "RecurrentBlock": "recurrent", "Rwkv": "RWKV", "Lru": "recurrent"}
"""Parts of module class names that mark such layers (transformers' names), and how an error names them."""


def recurrent_layers(model: torch.nn.Module) -> list[str]:
    """The kinds of layer ``model`` has that carry a recurrent state from token to token (Qwen3.5's
    Gated DeltaNet, LFM2's convolutions, Granite 4's and Falcon-H1's Mamba, RWKV), by its config's
    ``layer_types`` and its modules' class names; empty for an attention-only decoder."""
    found: dict[str, None] = {}
    text = model.config.get_text_config() if hasattr(model, "config") else None
    for kind in getattr(text, "layer_types", None) or ():
        if str(kind) in _RECURRENT_KINDS:
            found[_RECURRENT_KINDS[str(kind)]] = None
    for module in model.modules():
        name = type(module).__name__
        for key, kind in _RECURRENT_MODULES.items():
            if key in name:
                found[kind] = None
    return list(found)


def check_attention_only(model: torch.nn.Module) -> None:
    """Raise :class:`TriedecError` naming what is missing when ``model`` has recurrent layers:
    triedec verifies a tree of drafts in one forward, each node attending to its own ancestors; a
    layer whose state runs through the tokens in order has one state per node there, which triedec
    does not keep (nor does any engine for model-free trees)."""
    kinds = recurrent_layers(model)
    if kinds:
        raise TriedecError(
            f"{type(model).__name__} has {', '.join(kinds)} layers, whose state runs through the tokens in order; "
            "triedec verifies a tree of drafts in one forward and keeps attention's K/V per node, not a recurrent "
            "state per node, so it cannot run this model (attention-only decoders only; docs/models.md)")


def cache_keyword(model: PreTrainedModel) -> str:
    """The name ``model.forward`` takes its KV cache by: ``cache`` (transformers from 5.24, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier 5.x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The cache a forward's or ``generate``'s output carries, under either name (see
    :func:`cache_keyword`); ``None`` when it has none."""
    found = getattr(output, "cache", None)
    return found if found is not None else getattr(output, "past_key_values", None)


def apply_kernels(model: PreTrainedModel, kernels: str) -> None:
    """Speed ``model`` up in place (``"auto"``: what applies on its device and dtype) or keep its
    kernels (``"plain"``); either way route its attention through triedec's dispatcher (see the
    module doc), which is the model's own function outside triedec's forwards."""
    if kernels not in KERNELS:
        raise TriedecError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    param = next(model.parameters())
    if kernels == "auto" and param.device.type == "cpu" and param.dtype != torch.float32 and kernel_available():
        fuse_norms(model)  # float32 keeps transformers' own norms: it is the mode that reproduces transformers
    if kernels == "auto" and packing_available(param.device, param.dtype):
        pack_linears(model)
    elif kernels == "auto" and param.device.type == "cpu" and param.dtype != torch.float32:
        split_linears(model)  # bf16 linears too long to be row-invariant whole on this CPU, in pieces
    attn = model.config._attn_implementation
    if attn in ("sdpa", STOCK_SDPA, GQA_SDPA):
        model.set_attn_implementation(GQA_SDPA if kernels == "auto" else STOCK_SDPA)
    elif attn == "eager":
        model.set_attn_implementation(EAGER)


def exact_attention_applies(model: PreTrainedModel, kernels: str) -> bool:
    """Whether triedec's fixed-order tree attention (:mod:`triedec.model.attention`) runs ``model``'s
    forwards: ``kernels="auto"``, a CPU model in a dtype the kernel runs, and the kernel built
    (building it if needed)."""
    param = next(model.parameters())
    return kernels == "auto" and param.device.type == "cpu" and param.dtype in DTYPES and kernel_available()


ROW_ACTIVATION = "row-activation"
"""How :func:`describe_kernels` names activations applied on whole padded rows on CPU: triedec's
runner (:func:`~triedec.model.runner.activated`, the native ``gated_rows``) and, on the
``transformers`` runner with ``kernels="auto"``, the model's own activation modules wrapped in
:class:`~triedec.model.runner.RowActivation`."""
OWN_RUNNER = "triedec-runner"
"""How :func:`describe_kernels` names triedec's own runner (:mod:`triedec.model.runner`)."""
NATIVE_FORWARD = "native-forward"
"""How :func:`describe_kernels` names the runner's forward in one native call
(:func:`triedec.model.runner.native_decoder`)."""


def describe_kernels(model: PreTrainedModel, weights: str = "float", exact_attention: bool = False,
                     runner: bool = False, native: bool = False, cpu: bool = True) -> str:
    """What ``model`` runs: ``plain``, or the techniques applied, joined by ``+`` (``weights``: how
    its linear weights are stored, :attr:`triedec.model.precision.Precision.weights`; ``runner``:
    whether triedec's own runner walks its layers; ``native``: whether that walk is one native call;
    ``cpu``: whether it runs on the CPU, where the runner takes its activations on whole rows)."""
    used = []
    if weights != "float":
        used.append(f"{weights}-weights")
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        used.append("onednn-packed-linear")
    if any(isinstance(m, F32Linear) for m in model.modules()):
        used.append("f32-linear")
    if any(isinstance(m, FusedRMSNorm) for m in model.modules()):
        used.append("fused-rmsnorm")
    if any(isinstance(m, RowActivation) for m in model.modules()) or (runner and cpu):
        used.append(ROW_ACTIVATION)  # the runner applies its activations on whole rows itself
    if exact_attention:
        used.append(FIXED_ORDER_ATTENTION)
    elif getattr(model.config, "_attn_implementation", None) == GQA_SDPA:
        used.append("gqa-sdpa")
    if runner:
        used.append(OWN_RUNNER)
    if native:
        used.append(NATIVE_FORWARD)
    return "+".join(used) or "plain"


class ModelAdapter:
    """Forwards of a Hugging Face causal LM over many requests' trees, each on its own
    preallocated KV cache.

    Construction routes the model's attention through triedec's dispatcher (and, with
    ``kernels="auto"``, swaps in faster kernels); forwards then mutate only the :class:`KVCache`
    objects passed in.
    """

    def __init__(self, model: PreTrainedModel, kernels: str = "plain", runner: str | None = None) -> None:
        if runner not in (None, *RUNNERS):
            raise TriedecError(f"runner must be one of {RUNNERS} or None, got {runner!r}")
        config = model.config
        attn = getattr(config, "_attn_implementation", None) or "eager"
        if attn not in BASES:
            check_attention(attn)
        if getattr(config, "is_encoder_decoder", False):
            raise TriedecError(f"{type(model).__name__} is an encoder-decoder model, not a causal LM")
        check_attention_only(model)
        self.model = model
        self.config = config
        text = config.get_text_config()
        self.layout = AttentionLayout.from_config(text)
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self.device = next(model.parameters()).device
        self.precision = precision_of(model)
        """The precision mode the model is in (:mod:`triedec.model.precision`): activation dtype, weights."""
        self.dtype = self.precision.dtype
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_keyword = cache_keyword(model)
        apply_kernels(model, kernels)
        self.exact_attention = exact_attention_applies(model, kernels)
        """Whether triedec's forwards run its fixed-order tree attention (else the model's own)."""
        wanted = runner == RUNNER or (runner is None and kernels == "auto")
        self._runner = runner_for(model) if wanted else None
        if runner == RUNNER and self._runner is None:
            raise TriedecError(f"{why_not_runner(model)}; use runner='{TRANSFORMERS}'")
        if self._runner is None and kernels == "auto" and self.device.type == "cpu":
            wrap_activations(model)  # the runner applies its activations on whole rows itself
        place_weights(model)  # a no-op for what the runner placed
        self.runner = TRANSFORMERS if self._runner is None else RUNNER
        """Which code runs a forward: ``triedec`` (its own runner, :mod:`triedec.model.runner`: by
        default with ``kernels="auto"`` on the architectures it runs) or ``transformers`` (the model's
        own forward: ``kernels="plain"``, or any other architecture). ``runner=`` picks one."""
        if self._runner is not None:
            note = ""
        elif wanted:
            note = (f"{why_not_runner(model)}: its steps run transformers' forward, ~2,000 small operations a "
                    "step, slower (docs/models.md)")
        else:
            note = "runner='transformers' was asked for" if runner == TRANSFORMERS else "kernels='plain'"
        self.runner_note = note
        """Why the runner is ``transformers``, in a user's words (empty when it is ``triedec``)."""
        self.native_forward = self._runner is not None and self._runner.native and self.exact_attention
        """Whether a forward is one native call (:func:`triedec.model.runner.native_decoder`)."""
        self.kernels = describe_kernels(model, self.precision.weights, self.exact_attention,
                                        self._runner is not None, self.native_forward, self.device.type == "cpu")
        """What the model runs: ``plain`` or the techniques applied (see the module doc)."""
        native = self.exact_attention or any(isinstance(m, (FusedRMSNorm, *NATIVE_LINEARS)) for m in model.modules())
        self.native_build = build_id() if native else None
        """The build of triedec's compiled kernels the model runs (:func:`triedec.model.native.build_id`:
        a change of their sources or flags changes it), None when it runs none of them."""
        self._placeholder = torch.zeros((1, 1, 1, 1), dtype=self.dtype, device=self.device)
        self.fell_back = False
        """Set once a forward ran a layer on the model's own attention although
        :attr:`exact_attention` is on (a feature the kernel does not do); see :attr:`exactness`."""
        self.invariance = unvouched(self.device) or check_row_invariance(self)
        """The load-time self-test (:func:`check_row_invariance`): whether a row's logits are the
        same bits alone and inside a batched forward of trees and prompt chunks; on a device
        triedec has no fixed-order kernels for, :func:`unvouched`'s verdict instead."""

    @property
    def exactness(self) -> str:
        """The guarantee this model's forwards give: :data:`BIT_EXACT` (a token's logits are the
        same bits whatever tree, batch or load carries it, checked at load) or
        :data:`UP_TO_ROUNDING`."""
        return UP_TO_ROUNDING if self.fell_back else self.invariance.guarantee

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

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes in a cache (every layer)."""
        text = self.config.get_text_config()
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        return 2 * self._num_layers() * heads * dim * torch.tensor([], dtype=self.dtype).element_size()

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(capacity)

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on CPU): call before reading a clock."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- forwards -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_batch(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """One forward over every item (see :class:`ForwardItem`): their tokens as one row, each
        item attending to its own cache. The new K/V land in each cache's pending slots (commit or
        drop them afterwards). Returns each item's float logits ``[item.rows, vocab]``."""
        if not items:
            raise TriedecError("a forward needs at least one item")
        if len({id(item.cache) for item in items}) != len(items):
            raise TriedecError("each item of a forward needs a cache of its own")
        for item in items:
            n = item.size
            if n < 1 or item.positions.shape != (n,) or item.visible.dim() != 2 or item.visible.shape[0] != n \
                    or item.visible.shape[1] not in (n, item.cache.length + n):
                raise TriedecError(f"a forward item of {n} tokens needs positions [{n}] and visibility [{n}, {n}] "
                                   f"or [{n}, {item.cache.length + n}]; got {list(item.positions.shape)} and "
                                   f"{list(item.visible.shape)}")
        for item in items:
            item.cache.stage(item.positions)
        visibility = [item_visibility(item, self.layout) for item in items]
        batch = ItemBatch(items, visibility, self.layout.kinds, self.exact_attention, self.dtype, self.device)
        if len(items) == 1:  # a request's step alone: its own tensors, no copies
            tokens = items[0].tokens.reshape(-1).to(self.device)
            positions = items[0].positions.reshape(-1).to(self.device)
        else:
            tokens = torch.cat([item.tokens.reshape(-1) for item in items]).to(self.device)
            positions = torch.cat([item.positions.reshape(-1) for item in items]).to(self.device)
        rows = [(stop - item.rows, stop) for item, (_, stop) in zip(items, batch.bounds, strict=True)]
        everything = sum(b - a for a, b in rows) == tokens.numel()
        keep = None if everything else torch.cat([torch.arange(a, b) for a, b in rows])
        kwargs: dict[str, Any] = {}
        if keep is not None and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep.to(self.device)  # the LM head runs on these rows only
        placeholder = {k: self._placeholder for k in self.layout.windows} if self.layout.per_type \
            else self._placeholder
        try:
            if self._runner is not None:
                attention = BASES[self.model.config._attn_implementation]
                logits = self._runner.forward(tokens, positions, batch, None if keep is None else keep.to(self.device),
                                              attention)[0]
            else:
                layers = [BatchCacheLayer(batch, i) for i in range(self._num_layers())]
                out = self.model(
                    input_ids=tokens[None], position_ids=positions[None], attention_mask=placeholder,
                    use_cache=True, **{BATCH_KEYWORD: batch}, **kwargs, **{self._cache_keyword: Cache(layers=layers)},
                )
                logits = out.logits[0]
        finally:
            self.fell_back = self.fell_back or batch.fell_back
        if keep is not None and not self._takes_logits_to_keep and self._runner is None:
            logits = logits[keep.to(logits.device)]
        logits = logits.float()
        found, at = [], 0
        for a, b in rows:
            found.append(logits[at : at + b - a])
            at += b - a
        return found

    def prefill(self, cache: KVCache, tokens: torch.Tensor, keep_last: int = 1) -> torch.Tensor:
        """Causal forward of ``tokens [T]`` at positions ``0..T-1`` on an empty ``cache``; the T
        slots are left pending. Returns the logits of the last ``keep_last`` tokens:
        ``[min(keep_last, T), vocab]``."""
        if cache.length or cache.pending:
            raise TriedecError("prefill needs an empty cache")
        n = tokens.numel()
        causal = torch.ones((n, n), dtype=torch.bool).tril_()
        item = ForwardItem(cache, tokens, torch.arange(n), causal, max(1, min(keep_last, n)))
        return self.forward_batch([item])[0]

    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run ``tokens [T]`` at ``positions [T]`` on top of ``cache`` alone (a one-item
        :meth:`forward_batch`); ``visible`` as :class:`ForwardItem`'s. Returns float logits
        ``[T, vocab]`` (``[1, vocab]`` for the last token only if ``last_only``)."""
        return self.forward_batch([ForwardItem(cache, tokens, positions, visible, 1 if last_only else -1)])[0]

    def _num_layers(self) -> int:
        return int(self.config.get_text_config().num_hidden_layers)


BIT_EXACT = "bit-exact"
UP_TO_ROUNDING = "up to rounding"


@dataclass(frozen=True)
class Invariance:
    """The outcome of :func:`check_row_invariance`: ``exact`` when every compared row was
    ``torch.equal``; ``detail`` says what was compared, or which rows differed and by how much."""

    exact: bool
    detail: str

    @property
    def guarantee(self) -> str:
        return BIT_EXACT if self.exact else UP_TO_ROUNDING


def unvouched(device: torch.device) -> Invariance | None:
    """The verdict for a device no load-time sample can vouch for: any but a CPU. triedec has no
    fixed-order kernels there, and GPU libraries pick a kernel (tiling, split-K, GEMV or GEMM) by
    each call's shape, so a sample of row counts that passes says nothing of the others. Measured
    on an H100 in bfloat16: the self-test passed while ``auto`` returned other tokens than ``ar``
    on 4 of 6 prompts (``benchmarks/precision-modes-h100-gpu``). ``None`` on a CPU, where
    :func:`check_row_invariance` decides."""
    if device.type == "cpu":
        return None
    return Invariance(False, f"not checked on {device.type}: triedec has no fixed-order kernels there, and the "
                             f"library's kernels change with each call's shape")


_SELF_TEST_CHUNK = 40
"""Tokens of the other request's prompt chunk in the self-test's batched forward: with the tree,
the forward carries 48 rows, past the row counts where GEMM kernels switch their blocking."""


@torch.inference_mode()
def check_row_invariance(adapter: ModelAdapter, length: int = 8, seed: int = 0) -> Invariance:
    """The load-time self-test: does a row get the same logits, bit for bit, whatever forward
    carries it? Random tokens (seeded) are decoded one per forward (plain decoding: the
    reference), then the same sequence goes through the arrangements a run uses: a causal prompt
    chunk of its first half, then its second half as the main path of a draft tree with a sibling
    beside every node but the root and a leaf below the last, second in a forward after another
    request's prompt chunk on a cache of another length (48 rows in that forward). Every linear,
    norm, rotary embedding, attention and the LM head is on the path. About ``length + 3`` forwards."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, adapter.vocab_size, (length,), generator=gen)
    cache = adapter.new_cache(length)
    reference, alone = [], torch.ones((1, 1), dtype=torch.bool)
    for i in range(length):
        reference.append(adapter.forward(cache, seq[i : i + 1], torch.tensor([i]), alone)[0])
        cache.commit([0])
    half = length // 2
    mine = adapter.new_cache(2 * length)
    chunk = adapter.prefill(mine, seq[:half], keep_last=half)
    mine.commit(list(range(half)))
    other_tokens = torch.randint(0, adapter.vocab_size, (3 + _SELF_TEST_CHUNK,), generator=gen)
    other = adapter.new_cache(3 + _SELF_TEST_CHUNK)
    adapter.prefill(other, other_tokens[:3])
    other.commit([0, 1, 2])
    # the tree: the second half as its main path, a random sibling beside every node but the root,
    # a random leaf below the last
    noise = torch.randint(0, adapter.vocab_size, (length - half,), generator=gen).tolist()
    tokens, parents, main = [int(seq[half])], [-1], [0]
    for k in range(1, length - half):
        tokens += [int(seq[half + k]), noise[k]]
        parents += [main[-1], main[-1]]
        main.append(len(tokens) - 2)
    tree = TokenTree((*tokens, noise[0]), (*parents, main[-1]))
    causal = torch.ones((_SELF_TEST_CHUNK, _SELF_TEST_CHUNK), dtype=torch.bool).tril()
    chunk_item = ForwardItem(other, other_tokens[3:], torch.arange(3, 3 + _SELF_TEST_CHUNK), causal)
    tree_item = ForwardItem(mine, torch.tensor(tree.tokens), tree.positions(half)[0], tree.ancestry)
    tree_logits = adapter.forward_batch([chunk_item, tree_item])[1]
    got = [*chunk, *tree_logits[main]]
    differ = [i for i in range(length) if not torch.equal(got[i], reference[i])]
    if not differ:
        return Invariance(True, f"{length} tokens decoded one at a time equal, bit for bit, the same rows in a prompt "
                                f"chunk and in a draft tree batched with another request")
    worst = max(float((got[i] - reference[i]).abs().max()) for i in differ)
    return Invariance(False, f"{len(differ)} of {length} rows differ from plain decoding's when carried by a prompt "
                             f"chunk or a batched draft tree (by up to {worst:.2g} in a logit)")
