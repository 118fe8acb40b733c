"""triedec's own forward for the decoder architectures it ships: Llama (the default SmolLM2),
Qwen2 (Llama's layers with q/k/v biases), Mistral (Llama's layers, a sliding window over every
layer where its config sets one), Qwen3 (Llama's layers with each head's q and k normed before
rotary) and Gemma 3 (q/k norms, a norm after attention and after the MLP, GeGLU, scaled
embeddings, sliding-window layers with their own rotary base).

:class:`ModelAdapter` runs a forward through transformers' modeling code (the model's ``forward``,
its decorators, mask builders and cache objects, and the attention dispatcher of
:mod:`triedec.model.dispatch`), which costs ~2,000 small Python-level operations a step. The
runner walks the same modules itself: per layer the norm, the q/k/v projections, the rotary
embedding (on the model's own ``rotary_emb`` output: triedec's one-call kernel ``csrc/rotary.cpp``
on CPU, with the bits of transformers' ``apply_rotary_pos_emb``, which runs elsewhere),
each item's K/V written into its own cache, attention through the same :class:`ItemBatch`, the
output projection, the residual adds and the MLP, each module called on the same tensors in the
same order as transformers' modeling file calls it. So its logits are the same bits as the model's
own forward in every precision mode (``tests/test_runner.py`` checks ``torch.equal`` on tiny random
models of the three architectures and on the default model); what it saves is the plumbing.

Where the model runs on bfloat16 activations with triedec's fused RMS norms, SiLU or tanh-gelu and
triedec's fixed-order attention, and every linear is one the native code calls (the ``int4-a8``
mode's 8-bit-activation kernels, the torch ops the ``int8`` and ``int4`` modes' stand-ins call, or
bfloat16's oneDNN-packed linears), or on float32 activations with triedec's float32 linears and
transformers' own norms (which the native code calls as the same torch ops), the whole walk is one
native call instead (:func:`native_decoder`, ``csrc/decoder.cpp``): the same kernels and ops in the
same order, with no Python between layers, so again the same bits. Elsewhere (soft-capped logits,
a float32 layer whose outputs were padded, any other linear or norm) the walk is Python calls of
the same modules.

Anything else (another architecture, a module that is not of the expected shape) keeps
transformers' forward: :func:`runner_for` returns None, and :attr:`ModelAdapter.runner` names which
one ran.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from triedec.core.kvcache import KVCache
from triedec.model.dispatch import ItemBatch
from triedec.model.hugepages import place_weights
from triedec.model.linears import F32Linear, JoinedPart, LinearStandIn, PackedLinear, SplitLinear, joinable
from triedec.model.native import kernel_available, load_kernel
from triedec.model.precision import NATIVE_LINEARS, Int4A8Linear, Int4Linear, Int8A8Linear, Int8Linear
from triedec.model.rmsnorm import FusedRMSNorm, torch_ops_variant

RUNNER = "triedec"
"""How the stats name this runner."""
TRANSFORMERS = "transformers"
"""How the stats name transformers' own forward (the fallback)."""
RUNNERS = (RUNNER, TRANSFORMERS)


@dataclass(frozen=True)
class _Architecture:
    """Where a modeling file puts a decoder layer's parts: its norms by role (None: it has none
    there) and the attention's q/k norms."""

    attention_norm: str
    attention_out_norm: str | None  # on the attention's output, before the residual add (Gemma 3)
    mlp_norm: str
    mlp_out_norm: str | None  # on the MLP's output, before the residual add (Gemma 3)
    qk_norms: bool
    rotary_by_kind: bool  # the rotary module takes the layer type (Gemma 3: local and global bases)


_LLAMA = _Architecture("input_layernorm", None, "post_attention_layernorm", None, False, False)
_GEMMA3 = _Architecture("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm", True, True)
_QWEN3 = _Architecture("input_layernorm", None, "post_attention_layernorm", None, True, False)
_ARCHITECTURES = {"LlamaForCausalLM": _LLAMA, "Qwen2ForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA,
                  "Qwen3ForCausalLM": _QWEN3, "Gemma3ForCausalLM": _GEMMA3}
ARCHITECTURES = tuple(name.removesuffix("ForCausalLM") for name in _ARCHITECTURES)
"""The architectures the runner runs, as users name them."""
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


@dataclass(frozen=True)
class Layer:
    """One decoder layer's modules as the runner calls them, with its q/k/v and gate/up joined
    where :func:`join` could (None: the parts run)."""

    attention_norm: nn.Module
    attn: nn.Module
    attention_out_norm: nn.Module | None
    mlp_norm: nn.Module
    mlp: nn.Module
    mlp_out_norm: nn.Module | None
    qk_norms: tuple[nn.Module, nn.Module] | None  # each head's q and k norms (Gemma 3)
    qkv: tuple[LinearStandIn, list[int]] | None
    gate_up: tuple[LinearStandIn, list[int]] | None
    kind: str


def layer_kinds(layers: list[Layer]) -> list[str]:
    """The layers' kinds in the order the native forward numbers them (its rotary tables and key
    lists are given in this order)."""
    return sorted({layer.kind for layer in layers})


def runner_for(model: nn.Module) -> DecoderRunner | None:
    """triedec's runner for ``model`` when its architecture is one the runner reproduces exactly
    (:data:`ARCHITECTURES`, with every module where that modeling file puts it), else None."""
    arch = _ARCHITECTURES.get(type(model).__name__)
    if arch is None:
        return None
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    norms = [n for n in (arch.attention_norm, arch.attention_out_norm, arch.mlp_norm, arch.mlp_out_norm) if n]
    attention_parts = _ATTENTION_PARTS + (("q_norm", "k_norm") if arch.qk_norms else ())
    for layer in base.layers:
        if not all(hasattr(layer, name) for name in (*norms, "self_attn", "mlp")) \
                or not all(hasattr(layer.self_attn, name) for name in attention_parts) \
                or not all(hasattr(layer.mlp, name) for name in _MLP_PARTS):
            return None
    config = model.config
    if getattr(config, "pretraining_tp", 1) != 1:  # transformers' slicing of the head
        return None
    if getattr(config, "use_bidirectional_attention", False):  # Gemma 3's encoder-like variant
        return None
    return DecoderRunner(model, arch)


def join(parent: nn.Module, names: tuple[str, ...]) -> tuple[LinearStandIn, list[int]] | None:
    """The linears ``parent.<names>`` as one layer computing their outputs side by side (q, k and v;
    gate and up), where they are triedec's 8-bit-activation linears of one class that the class can
    join (:meth:`~triedec.model.precision.Int4A8Linear.joined`: each output keeps its bits, and the
    activations are quantized once for all) or its float32 ones
    (:class:`~triedec.model.linears.F32Linear`). In ``parent`` each is replaced by a
    :class:`~triedec.model.linears.JoinedPart` of it, so the weights are held once. Returns the joined layer and where
    each part ends, or None (the linears stay as they are)."""
    parts = [getattr(parent, name) for name in names]
    if type(parts[0]) not in (*NATIVE_LINEARS, F32Linear) or not joinable(parts):
        return None
    joined = type(parts[0]).joined(parts)
    ends, at = [], 0
    for name, part in zip(names, parts, strict=True):
        setattr(parent, name, JoinedPart(joined, at, at + part.out_features))
        at += part.out_features
        ends.append(at)
    return joined, ends


def _activation(module: nn.Module) -> str | None:
    """Which of torch's ops ``module`` (an MLP's ``act_fn``) is: ``"silu"`` (``nn.SiLU``,
    transformers' ``SiLUActivation``), ``"gelu-tanh"`` (transformers' ``GELUTanh``: torch's gelu,
    tanh-approximated), or None (``csrc/decoder.cpp`` calls neither)."""
    if type(module) is nn.SiLU or (type(module).__name__ == "SiLUActivation"
                                   and type(module).__module__ == "transformers.activations"):
        return "silu"
    act = getattr(module, "act", None)
    if type(module).__name__ == "GELUTanh" and type(module).__module__ == "transformers.activations" \
            and isinstance(act, functools.partial) and act.func is nn.functional.gelu and not act.args \
            and act.keywords == {"approximate": "tanh"}:
        return "gelu-tanh"
    return None


_DECODER_LINEARS = {Int4A8Linear: ("a8-int4", "packed", "scales_zeros"), Int8A8Linear: ("a8-int8", "packed", "scales"),
                    Int8Linear: ("int8", "codes", "scale"), Int4Linear: ("int4", "packed", "scales_and_zeros")}
"""The linears the native forward runs (``csrc/decoder.h``'s ``NativeLinear``): its kind for each
stand-in, and the stand-in's buffers it takes (codes, scales). triedec's 8-bit-activation kernels
(int4-a8) or the torch op the int8 and int4 modes' stand-ins call."""


def _runs_natively(layer: nn.Module, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the native forward can run ``layer`` on ``dtype`` activations: on bfloat16, one of
    :data:`_DECODER_LINEARS`, or a bf16 :class:`~triedec.model.linears.PackedLinear` (oneDNN), alone
    or as every piece of a :class:`~triedec.model.linears.SplitLinear`; on float32, an
    :class:`~triedec.model.linears.F32Linear` whose outputs need no padding."""
    if dtype == torch.float32:
        return type(layer) is F32Linear and layer.packed.shape[0] == layer.out_features
    if type(layer) in _DECODER_LINEARS:
        return True
    if type(layer) is SplitLinear:
        return all(type(p) is PackedLinear and p.packed.dtype == torch.bfloat16 and p.bias is None for p in layer.parts)
    return type(layer) is PackedLinear and layer.packed.dtype == torch.bfloat16


def _native_linear(kernel: Any, layer: nn.Module) -> Any:
    if type(layer) is F32Linear:
        return kernel.NativeLinear("f32", layer.packed, None, layer.bias, layer.in_features)
    if type(layer) is PackedLinear:
        return kernel.NativeLinear([layer.packed], [0, layer.in_features], False, layer.bias, layer.out_features)
    if type(layer) is SplitLinear:
        bounds = [a for a, _ in layer.bounds] + [layer.bounds[-1][1]]
        return kernel.NativeLinear([p.packed for p in layer.parts], bounds, True, layer.bias, layer.out_features)
    kind, codes, scales = _DECODER_LINEARS[type(layer)]
    buffers = layer._buffers
    return kernel.NativeLinear(kind, buffers[codes], buffers[scales], layer.bias, layer.in_features)


def _norm_variant(norm: nn.Module, dtype: torch.dtype) -> tuple[str, float] | None:
    """``(variant, eps)`` of the RMS norm the native forward runs for ``norm`` on ``dtype``
    activations, or None (it runs none that gives ``norm``'s bits): on bfloat16 triedec's fused
    norm (:class:`~triedec.model.rmsnorm.FusedRMSNorm`), on float32 transformers' own norm in its
    own torch ops (:func:`~triedec.model.rmsnorm.torch_ops_variant`)."""
    if dtype == torch.bfloat16:
        if type(norm) is FusedRMSNorm and norm.weight.dtype == torch.bfloat16:
            return norm.variant, norm.eps
        return None
    return torch_ops_variant(norm)


def _parts(layers: list[nn.Module], joined: tuple[LinearStandIn, list[int]] | None) -> list[nn.Module]:
    """The linears a joined group runs: the joined one, or the parts themselves."""
    return [joined[0]] if joined is not None else layers


def native_decoder(model: nn.Module, layers: list[Layer]) -> Any:
    """The native forward (``csrc/decoder.cpp``'s ``NativeDecoder``) of ``model``, whose layers
    :class:`DecoderRunner` has prepared, when every part of it runs on what that file calls, with
    the same arithmetic: bfloat16 activations, every linear and the head one of
    :data:`_DECODER_LINEARS` (the 8-bit-activation kernels, the int8 / int4 torch ops) or a bf16
    oneDNN-packed linear, alone or split, every norm triedec's RMS norm; or float32 activations,
    every linear and the head triedec's float32 linear, every norm transformers' own
    (:func:`_runs_natively`, :func:`_norm_variant`); every norm (Gemma 3's q/k and output norms
    too) of one variant and one epsilon, SiLU or tanh-gelu, one attention scale, no soft-capping.
    Else None (the Python walk runs)."""
    config = model.config
    base = model.model
    dtype = base.embed_tokens.weight.dtype
    if next(model.parameters()).device.type != "cpu" or not kernel_available() \
            or dtype not in (torch.bfloat16, torch.float32) \
            or getattr(config, "final_logit_softcapping", None) is not None \
            or getattr(config, "attn_logit_softcapping", None) is not None:
        return None
    kernel = load_kernel()
    optional = [n for layer in layers for n in (layer.attention_out_norm, layer.mlp_out_norm)]
    qk = [n for layer in layers for n in layer.qk_norms or ()]
    norms = [base.norm, *(n for layer in layers for n in (layer.attention_norm, layer.mlp_norm)), *qk,
             *(n for n in optional if n is not None)]
    variants = [_norm_variant(n, dtype) for n in norms]
    if None in variants or len(set(variants)) != 1 \
            or len({n is None for n in optional}) > 1 or len(qk) not in (0, 2 * len(layers)):
        return None
    variant, eps = variants[0]
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
    head_dim = layers[0].attn.head_dim
    scales = {float(layer.attn.scaling) for layer in layers}
    activations = {_activation(layer.mlp.act_fn) for layer in layers}
    if len(scales) != 1 or any(layer.attn.head_dim != head_dim for layer in layers) \
            or len(activations) != 1 or None in activations:
        return None
    kinds = layer_kinds(layers)
    built = []
    for layer in layers:
        attn, mlp = layer.attn, layer.mlp
        groups = (_parts([attn.q_proj, attn.k_proj, attn.v_proj], layer.qkv), [attn.o_proj],
                  _parts([mlp.gate_proj, mlp.up_proj], layer.gate_up), [mlp.down_proj])
        if not all(_runs_natively(m, dtype) for group in groups for m in group):
            return None
        q, o, gu, down = ([_native_linear(kernel, m) for m in group] for group in groups)
        extra = (layer.attention_out_norm, layer.mlp_out_norm, *(layer.qk_norms or (None, None)))
        built.append(kernel.NativeLayer(
            layer.attention_norm.weight, layer.mlp_norm.weight, q, o[0], gu, down[0],
            *(None if norm is None else norm.weight for norm in extra), kinds.index(layer.kind)))
    if not _runs_natively(model.lm_head, dtype):
        return None
    return kernel.NativeDecoder(built, base.norm.weight, _native_linear(kernel, model.lm_head), heads, kv_heads,
                                head_dim, eps, scales.pop(), variant == "one-plus-weight",
                                activations.pop() == "gelu-tanh")


class DecoderRunner:
    """One forward of a decoder of one of :data:`ARCHITECTURES` over an :class:`ItemBatch` (see
    the module doc).

    Construction joins each layer's q/k/v projections, and its gate and up projections, into one
    call each where the mode's linears can be joined with the same bits (:func:`join`: int4-a8, float32),
    and builds the native forward where it applies (:attr:`native`)."""

    def __init__(self, model: nn.Module, arch: _Architecture = _LLAMA) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rotate = apply_rotary_pos_emb  # Gemma 3's is the same function of the same tensors
        base = model.model
        if next(model.parameters()).device.type == "cpu" and kernel_available():
            kernel = load_kernel()
            self._rotate = lambda q, k, cos, sin: (kernel.rotary(q, cos, sin), kernel.rotary(k, cos, sin))
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self._rotary_by_kind = arch.rotary_by_kind
        self.norm = base.norm
        self.head = model.lm_head
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        kinds = getattr(model.config, "layer_types", None) or ()
        self.layers: list[Layer] = []
        for index, layer in enumerate(base.layers[: model.config.num_hidden_layers]):
            self.layers.append(Layer(
                getattr(layer, arch.attention_norm), layer.self_attn,
                getattr(layer, arch.attention_out_norm) if arch.attention_out_norm else None,
                getattr(layer, arch.mlp_norm), layer.mlp,
                getattr(layer, arch.mlp_out_norm) if arch.mlp_out_norm else None,
                (layer.self_attn.q_norm, layer.self_attn.k_norm) if arch.qk_norms else None,
                join(layer.self_attn, ("q_proj", "k_proj", "v_proj")), join(layer.mlp, ("gate_proj", "up_proj")),
                kinds[index] if index < len(kinds) else "full_attention"))
        self._kinds = layer_kinds(self.layers)
        place_weights(model)  # the joined layers' too, before the native forward takes them
        self._native = native_decoder(model, self.layers)
        self._kv = (int(model.config.num_key_value_heads or model.config.num_attention_heads),
                    self.layers[0].attn.head_dim)

    @property
    def native(self) -> bool:
        """Whether a forward can be one native call (:func:`native_decoder`); it is, for a batch on
        triedec's fixed-order attention."""
        return self._native is not None

    def _rotary_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[Any, Any]]:
        """Each layer kind's rotary ``(cos, sin)`` at ``positions`` (Gemma 3: its own base per kind)."""
        if self._rotary_by_kind:
            return {kind: self.rotary(hidden, positions[None], kind) for kind in self._kinds}
        return dict.fromkeys(self._kinds, self.rotary(hidden, positions[None]))

    def _native_forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: ItemBatch,
                        keep: torch.Tensor | None) -> torch.Tensor:
        hidden = self.embed(tokens)
        tables = self._rotary_tables(hidden, positions)
        kinds = self._kinds
        caches: list[KVCache] = [item.cache for item in batch.items]
        for cache in caches:
            cache.allocate(len(self.layers), *self._kv, hidden.dtype, hidden.device)
        seen = [[batch.key_lists(index, kind) for index in range(len(caches))] for kind in kinds]
        edges = [start for start, _ in batch.bounds] + [batch.bounds[-1][1]]
        logits = self._native.forward(
            hidden, [tables[kind][0][0].contiguous() for kind in kinds],
            [tables[kind][1][0].contiguous() for kind in kinds], edges,
            [cache.length for cache in caches], [cache.keys for cache in caches], [cache.values for cache in caches],
            [[None if s is None else s[0] for s in lists] for lists in seen],
            [[None if s is None else s[1] for s in lists] for lists in seen], keep)
        return logits[None]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: ItemBatch, keep: torch.Tensor | None,
                base: Any) -> torch.Tensor:
        """The logits ``[1, rows, vocab]`` of ``tokens [N]`` at ``positions [N]``, laid out and
        attending as ``batch`` says; ``keep``: the rows to return (None: all). ``base``: the
        attention function the dispatcher would call for a layer (:data:`~triedec.model.dispatch.BASES`)."""
        if self._native is not None and batch.exact:
            return self._native_forward(tokens, positions, batch, keep)
        hidden = self.embed(tokens[None])
        rotary = self._rotary_tables(hidden, positions)
        n = tokens.shape[0]
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.attn, layer.mlp
            residual = hidden
            x = layer.attention_norm(hidden)
            shape = (1, n, -1, attn.head_dim)
            if layer.qkv is None:
                query = attn.q_proj(x).view(shape).transpose(1, 2)
                key = attn.k_proj(x).view(shape).transpose(1, 2)
                value = attn.v_proj(x).view(shape).transpose(1, 2)
            else:
                joined, (q_end, k_end, _) = layer.qkv
                out = joined.rows(x.reshape(n, -1))
                query = out[:, :q_end].view(shape).transpose(1, 2)
                key = out[:, q_end:k_end].view(shape).transpose(1, 2)
                value = out[:, k_end:].view(shape).transpose(1, 2)
            if layer.qk_norms is not None:
                query, key = layer.qk_norms[0](query), layer.qk_norms[1](key)
            query, key = self._rotate(query, key, *rotary[layer.kind])
            batch.write(index, key, value)
            kwargs = {"dropout": 0.0, "scaling": attn.scaling, "sliding_window": getattr(attn, "sliding_window", None)}
            out, _ = batch.attend(attn, query, base(attn), kwargs)
            out = attn.o_proj(out.reshape(1, n, -1).contiguous())
            hidden = residual + (out if layer.attention_out_norm is None else layer.attention_out_norm(out))
            residual = hidden
            x = layer.mlp_norm(hidden)
            if layer.gate_up is None:
                gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            else:
                joined, (gate_end, _) = layer.gate_up
                out = joined.rows(x.reshape(n, -1))
                gate = out[:, :gate_end].contiguous().view(1, n, -1)  # the activation on a dense tensor, as unjoined
                up = out[:, gate_end:].view(1, n, -1)
            out = mlp.down_proj(mlp.act_fn(gate) * up)
            hidden = residual + (out if layer.mlp_out_norm is None else layer.mlp_out_norm(out))
        hidden = self.norm(hidden)
        if keep is not None:
            hidden = hidden[:, keep]
        logits = self.head(hidden)
        if self.softcap is not None:  # Gemma 2's and 3's final soft-capping, as their modeling files do it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
