"""triedec's own forward for the decoder architectures it ships: Llama (the default SmolLM2),
Qwen2 (Llama's layers with q/k/v biases), Mistral (Llama's layers, a sliding window over every
layer where its config sets one), Qwen3 (Llama's layers with each head's q and k normed before
rotary), Phi-3 and Phi-4-mini (Llama's layers with q/k/v and gate/up each one linear, run as a
joined group; Phi-4-mini's rotary over the first part of each head), SmolLM3 (Llama's layers,
some without rotary), Granite (Llama's layers with embedding, residual, attention and logit
multipliers), OLMo 2 (norms on the sublayers' outputs only, q/k norms over the whole projection,
a rotary rounded once from float32 tables), Gemma 2 (Gemma's four norms a layer, soft-capped
attention scores and logits) and Gemma 3 (q/k norms, a norm after attention and after the MLP,
GeGLU, scaled embeddings, sliding-window layers with their own rotary base). docs/models.md has
the table.

:class:`ModelAdapter` runs a forward through transformers' modeling code (the model's ``forward``,
its decorators, mask builders and cache objects, and the attention dispatcher of
:mod:`triedec.model.dispatch`), which costs ~2,000 small Python-level operations a step. The
runner walks the same modules itself: per layer the norm, the q/k/v projections, the rotary
embedding (on the model's own ``rotary_emb`` output, gathered by position from a table of it
where the rope type is static (:class:`RotaryRows`): triedec's one-call kernel ``csrc/rotary.cpp``
on CPU, with the bits of transformers' ``apply_rotary_pos_emb``, which runs elsewhere),
each item's K/V written into its own cache, attention through the same :class:`ItemBatch`, the
output projection, the residual adds and the MLP, each module called on the same tensors in the
same order as transformers' modeling file calls it. So its logits are the same bits as the model's
own forward in every precision mode (``tests/test_runner.py`` checks ``torch.equal`` on tiny random
models of each architecture, on GGUF files of each the tests write, and on the default model);
what it saves is the plumbing.

Where the model runs on bfloat16 activations with triedec's fused RMS norms, SiLU or tanh-gelu and
triedec's fixed-order attention, and every linear is one the native code calls (the ``int4-a8``
mode's 8-bit-activation kernels, the torch ops the ``int8`` and ``int4`` modes' stand-ins call, or
bfloat16's oneDNN-packed linears), or on float32 activations with triedec's float32 linears and
transformers' own norms (which the native code calls as the same torch ops), the whole walk is one
native call instead (:func:`native_decoder`, ``csrc/decoder.cpp``): the same kernels and ops in the
same order, with no Python between layers, so again the same bits (the embedding's and the
logits' own scalings and the final soft-cap stay torch ops around that call). Elsewhere (a float32
layer whose outputs were padded, any other linear or norm) the walk is Python calls of the same
modules.

Anything else (another architecture, a module that is not of the expected shape, a partial
rotary where the modeling file has none) keeps transformers' forward: :func:`runner_for` returns None,
:func:`why_not_runner` says why in a user's words, and :attr:`ModelAdapter.runner` and
``runner_note`` name which one ran and why.
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from triedec.core.kvcache import KVCache
from triedec.model.dispatch import ItemBatch
from triedec.model.hugepages import place_weights
from triedec.model.linears import F32Linear, JoinedPart, LinearStandIn, PackedLinear, SplitLinear, joinable
from triedec.model.native import kernel_available, load_kernel
from triedec.model.precision import (
    NATIVE_LINEARS,
    Int4A8Linear,
    Int4Linear,
    Int5A8Linear,
    Int6A8Linear,
    Int8A8Linear,
    Int8Linear,
    KQuantA8Linear,
    ScaleMinA8Linear,
)
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

    attention_norm: str | None  # None: the layer norms its sublayers' outputs only (OLMo 2)
    attention_out_norm: str | None  # on the attention's output, before the residual add (Gemma 3)
    mlp_norm: str | None
    mlp_out_norm: str | None  # on the MLP's output, before the residual add (Gemma 3)
    qk_norms: bool
    rotary_by_kind: bool  # the rotary module takes the layer type (Gemma 3: local and global bases)
    fused: bool = False  # q/k/v in one ``qkv_proj``, gate and up in one ``gate_up_proj`` (Phi-3)
    act: str = "act_fn"  # the MLP's activation module
    qk_whole: bool = False  # the q/k norms take the whole projection, before it is split in heads (OLMo 2)
    multipliers: bool = False  # the config's embedding, residual and logit multipliers (Granite)
    wide_rotary: bool = False  # float32 rotary tables, each rotated element rounded once (OLMo 2)
    partial_rotary: bool = False  # its modeling file rotates the first part of a head where set (Phi-4-mini)


_LLAMA = _Architecture("input_layernorm", None, "post_attention_layernorm", None, False, False)
_GEMMA3 = _Architecture("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm", True, True)
_QWEN3 = _Architecture("input_layernorm", None, "post_attention_layernorm", None, True, False)
_PHI3 = _Architecture("input_layernorm", None, "post_attention_layernorm", None, False, False, True, "activation_fn",
                      partial_rotary=True)
_GEMMA2 = _Architecture("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm", False, False)
_OLMO2 = _Architecture(None, "post_attention_layernorm", None, "post_feedforward_layernorm", True, False,
                       qk_whole=True, wide_rotary=True)
# SmolLM3 and Granite are Llama's layers: SmolLM3's layers without rotary are each attention's
# ``use_rope``, Granite's multipliers its config's (read by DecoderRunner)
_ARCHITECTURES = {"LlamaForCausalLM": _LLAMA, "Qwen2ForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA,
                  "Qwen3ForCausalLM": _QWEN3, "Phi3ForCausalLM": _PHI3, "SmolLM3ForCausalLM": _LLAMA,
                  "GraniteForCausalLM": replace(_LLAMA, multipliers=True), "Olmo2ForCausalLM": _OLMO2,
                  "Gemma2ForCausalLM": _GEMMA2, "Gemma3ForCausalLM": _GEMMA3}
ARCHITECTURES = tuple(name.removesuffix("ForCausalLM") for name in _ARCHITECTURES)
"""The architectures the runner runs, as users name them."""
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
_FUSED_ATTENTION_PARTS = ("qkv_proj", "o_proj")
_FUSED_MLP_PARTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Layer:
    """One decoder layer's modules as the runner calls them, with its q/k/v and gate/up joined
    where :func:`join` could (None: the parts run)."""

    attention_norm: nn.Module | None  # None: OLMo 2's layers norm their sublayers' outputs only
    attn: nn.Module
    attention_out_norm: nn.Module | None
    mlp_norm: nn.Module | None
    mlp: nn.Module
    mlp_out_norm: nn.Module | None
    qk_norms: tuple[nn.Module, nn.Module] | None  # each head's q and k norms (Qwen3, Gemma 3; OLMo 2: whole)
    qkv: tuple[nn.Module, list[int]] | None  # joined (or fused, Phi-3) q | k | v and where each part ends
    gate_up: tuple[nn.Module, list[int]] | None
    kind: str
    act: nn.Module  # the MLP's activation
    rope: bool = True  # False: q and k stay unrotated (SmolLM3's layers without rotary)
    qk_whole: bool = False  # the q/k norms over the whole projection (OLMo 2)


def layer_kinds(layers: list[Layer]) -> list[str]:
    """The layers' kinds in the order the native forward numbers them (its rotary tables and key
    lists are given in this order)."""
    return sorted({layer.kind for layer in layers})


def why_not_runner(model: nn.Module) -> str | None:
    """Why triedec's runner does not run ``model``, in a user's words; None when it does: its
    architecture is one of :data:`ARCHITECTURES`, with every module where that modeling file puts it
    and no feature the runner leaves to transformers."""
    name = type(model).__name__
    arch = _ARCHITECTURES.get(name)
    if arch is None:
        return f"triedec's runner does not know {name} (it runs {', '.join(ARCHITECTURES)})"
    base = getattr(model, "model", None)
    moved = f"{name}'s modules are not where transformers' {name} puts them"
    if base is None or not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return moved
    norms = [n for n in (arch.attention_norm, arch.attention_out_norm, arch.mlp_norm, arch.mlp_out_norm) if n]
    attention_parts = (_FUSED_ATTENTION_PARTS if arch.fused else _ATTENTION_PARTS) + (
        ("q_norm", "k_norm") if arch.qk_norms else ())
    mlp_parts = (*(_FUSED_MLP_PARTS if arch.fused else _MLP_PARTS), arch.act)
    for layer in base.layers:
        if not all(hasattr(layer, name) for name in (*norms, "self_attn", "mlp")) \
                or not all(hasattr(layer.self_attn, name) for name in attention_parts) \
                or not all(hasattr(layer.mlp, name) for name in mlp_parts):
            return moved
    config = model.config
    partial = _partial_rotary(config)
    if partial != 1.0 and not arch.partial_rotary:
        return f"{name} rotates {partial:g} of each head (partial_rotary_factor): its modeling file does not"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"{name} slices its linears (pretraining_tp {config.pretraining_tp}): transformers' own forward does"
    if getattr(config, "use_bidirectional_attention", False):  # Gemma 3's encoder-like variant
        return f"{name} attends both ways (use_bidirectional_attention): not a causal decoder's attention"
    return None


def _partial_rotary(config: Any) -> float:
    """The share of each head the rotary embedding turns (``partial_rotary_factor``; 1: all)."""
    rope = getattr(config, "rope_parameters", None)
    nested = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(getattr(config, "partial_rotary_factor", None) or nested or 1.0)


def rotary_dim(config: Any, head_dim: int) -> int:
    """The features of a head the rotary embedding turns, the first ones (Phi-4-mini: 3/4 of them)."""
    return int(head_dim * _partial_rotary(config))


def runner_for(model: nn.Module) -> DecoderRunner | None:
    """triedec's runner for ``model`` when its architecture is one the runner reproduces exactly
    (:func:`why_not_runner` says None), else None."""
    if why_not_runner(model) is not None:
        return None
    return DecoderRunner(model, _ARCHITECTURES[type(model).__name__])


def join(parent: nn.Module, names: tuple[str, ...]) -> tuple[LinearStandIn, list[int]] | None:
    """The linears ``parent.<names>`` as one layer computing their outputs side by side (q, k and v;
    gate and up), where they are triedec's 8-bit-activation linears of one class that the class can
    join (:meth:`~triedec.model.precision.Int4A8Linear.joined`: each output keeps its bits, and the
    activations are quantized once for all) or its float32 ones
    (:class:`~triedec.model.linears.F32Linear`). In ``parent`` each is replaced by a
    :class:`~triedec.model.linears.JoinedPart` of it, so the weights are held once. Returns the joined layer and where
    each part ends, or None (the linears stay as they are). Linears an earlier join made parts of
    one layer (a second runner over the same model: ``triedec.LM(lm.model, ...)``) give that layer
    again, so the second runner joins what the first did and gets its native forward too."""
    parts = [getattr(parent, name) for name in names]
    if all(type(part) is JoinedPart for part in parts):
        joined, ends = parts[0].joined, []
        for part in parts:
            if part.joined is not joined or part.start != (ends[-1] if ends else 0):
                return None
            ends.append(part.stop)
        return (joined, ends) if ends[-1] == joined.out_features else None
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
    tanh-approximated), or None (``csrc/decoder.cpp`` calls neither). A :class:`RowActivation` is
    the module it wraps."""
    if isinstance(module, RowActivation):
        module = module.act
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
                    Int5A8Linear: ("a8-int5", "packed", "scales"), Int6A8Linear: ("a8-int6", "packed", "scales"),
                    KQuantA8Linear: ("a8-kquant", "packed", "scales_mins"),
                    ScaleMinA8Linear: ("a8-scale-min", "packed", "dm"),
                    Int8Linear: ("int8", "codes", "scale"),
                    Int4Linear: ("int4", "packed", "scales_and_zeros")}
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
        return kernel.NativeLinear("f32", layer.packed, None, layer.bias, layer.in_features, None, None)
    if type(layer) is PackedLinear:
        return kernel.NativeLinear([layer.packed], [0, layer.in_features], False, layer.bias, layer.out_features)
    if type(layer) is SplitLinear:
        bounds = [a for a, _ in layer.bounds] + [layer.bounds[-1][1]]
        return kernel.NativeLinear([p.packed for p in layer.parts], bounds, True, layer.bias, layer.out_features)
    kind, codes, scales = _DECODER_LINEARS[type(layer)]
    buffers = layer._buffers
    return kernel.NativeLinear(kind, buffers[codes], buffers[scales], layer.bias, layer.in_features,
                               buffers.get("highs"), buffers.get("supers"))


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


def _rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x [n, in]`` through a linear: a stand-in's rows, or a plain module's forward."""
    return layer.rows(x) if isinstance(layer, LinearStandIn) else layer(x)


def native_decoder(model: nn.Module, layers: list[Layer]) -> Any:
    """The native forward (``csrc/decoder.cpp``'s ``NativeDecoder``) of ``model``, whose layers
    :class:`DecoderRunner` has prepared, when every part of it runs on what that file calls, with
    the same arithmetic: bfloat16 activations, every linear and the head one of
    :data:`_DECODER_LINEARS` (the 8-bit-activation kernels, the int8 / int4 torch ops) or a bf16
    oneDNN-packed linear, alone or split, every norm triedec's RMS norm; or float32 activations,
    every linear and the head triedec's float32 linear, every norm transformers' own
    (:func:`_runs_natively`, :func:`_norm_variant`); every norm (Gemma 3's q/k and output norms
    too) of one variant and one epsilon, SiLU or tanh-gelu, one attention scale and soft-cap. The
    embedding's and the logits' scalings and the final soft-cap stay the runner's torch ops.
    Else None (the Python walk runs)."""
    config = model.config
    base = model.model
    dtype = base.embed_tokens.weight.dtype
    if next(model.parameters()).device.type != "cpu" or not kernel_available() \
            or dtype not in (torch.bfloat16, torch.float32):
        return None
    kernel = load_kernel()
    inputs = [n for layer in layers for n in (layer.attention_norm, layer.mlp_norm)]
    optional = [n for layer in layers for n in (layer.attention_out_norm, layer.mlp_out_norm)]
    qk = [n for layer in layers for n in layer.qk_norms or ()]
    norms = [base.norm, *(n for n in inputs + optional if n is not None), *qk]
    variants = [_norm_variant(n, dtype) for n in norms]
    softcaps = {getattr(layer.attn, "attn_logit_softcapping", None) for layer in layers}
    if None in variants or len(set(variants)) != 1 or len(softcaps) != 1 \
            or len({n is None for n in inputs}) > 1 or len({n is None for n in optional}) > 1 \
            or len(qk) not in (0, 2 * len(layers)):
        return None
    variant, eps = variants[0]
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
    head_dim = layers[0].attn.head_dim
    scales = {float(layer.attn.scaling) for layer in layers}
    activations = {_activation(layer.act) for layer in layers}
    if len(scales) != 1 or any(layer.attn.head_dim != head_dim for layer in layers) \
            or len(activations) != 1 or None in activations:
        return None
    kinds = layer_kinds(layers)
    built = []
    for layer in layers:
        attn, mlp = layer.attn, layer.mlp
        # a joined (or fused) group runs its one linear, else its parts
        groups = ([layer.qkv[0]] if layer.qkv else [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj],
                  [layer.gate_up[0]] if layer.gate_up else [mlp.gate_proj, mlp.up_proj], [mlp.down_proj])
        if not all(_runs_natively(m, dtype) for group in groups for m in group):
            return None
        q, o, gu, down = ([_native_linear(kernel, m) for m in group] for group in groups)
        norms = [None if norm is None else norm.weight
                 for norm in (layer.attention_norm, layer.mlp_norm, layer.attention_out_norm, layer.mlp_out_norm,
                              *(layer.qk_norms or (None, None)))]
        built.append(kernel.NativeLayer(norms[0], norms[1], q, o[0], gu, down[0], *norms[2:],
                                        kinds.index(layer.kind), layer.rope))
    if not _runs_natively(model.lm_head, dtype):
        return None
    softcap = softcaps.pop()
    return kernel.NativeDecoder(built, base.norm.weight, _native_linear(kernel, model.lm_head), heads, kv_heads,
                                head_dim, eps, scales.pop(), variant == "one-plus-weight",
                                activations.pop() == "gelu-tanh", float(softcap or 0.0),
                                float(_multipliers(model)[1] or 1.0),
                                _ARCHITECTURES[type(model).__name__].wide_rotary and dtype == torch.bfloat16,
                                rotary_dim(config, head_dim))


def _multipliers(model: nn.Module) -> tuple[float | None, float | None, float | None]:
    """Granite's ``(embedding, residual, logits)`` multipliers (its config's; the logits are divided
    by the last), or Nones for a model without them."""
    if not _ARCHITECTURES[type(model).__name__].multipliers:
        return None, None, None
    config = model.config
    return (float(config.embedding_multiplier), float(config.residual_multiplier), float(config.logits_scaling))


ACT_PAD = 64
"""Elements a row of an activation's input is padded to a multiple of (two AVX-512 vectors of
bfloat16: every build's step of torch's elementwise loop divides it)."""
ACT_ELEMENTS = 16384
"""Most elements one call of an activation takes: torch cuts a call among its threads past its
grain, 32,768 elements (silu), or past 16,384 (gelu, whose kernel then takes a thread's share of
the call as its grain)."""


def activated(act: nn.Module, gate: torch.Tensor) -> torch.Tensor:
    """``act(gate)`` (``gate [..., I]``) with every element through torch's vector function, as the
    native forward's ``gated_rows`` (csrc/decoder.cpp) computes it: torch's elementwise loop leaves a
    call's last elements past a multiple of two vectors to a scalar version (silu's ``std::exp``,
    gelu's ``std::tanh``) that can round differently, and cuts a call of over :data:`ACT_ELEMENTS`
    among its threads at points that need not fall on a vector, so which elements of a row went the
    scalar way depended on the rows beside it and on the thread count. Here the rows are padded to
    a multiple of :data:`ACT_PAD` and taken in calls of at most :data:`ACT_ELEMENTS` elements, so no
    element is in a tail or at a thread's cut and a row's bits depend on its own inputs only, at any
    width and thread count (on a GPU every element is already its own thread's: the call is left
    whole)."""
    width = gate.shape[-1]
    padded = -(-width // ACT_PAD) * ACT_PAD
    if gate.device.type != "cpu" or (padded == width and gate.numel() <= ACT_ELEMENTS and gate.is_contiguous()):
        return act(gate)
    rows = gate.reshape(-1, width)
    # the padded rows as one run of elements, in calls of ACT_ELEMENTS (a multiple of ACT_PAD): a
    # call may end inside a row, never inside a vector, so rows wider than a call are not cut
    # among threads either
    x = (rows if padded == width else torch.nn.functional.pad(rows, (0, padded - width))).reshape(-1)
    out = torch.cat([act(x[a : a + ACT_ELEMENTS]) for a in range(0, x.numel(), ACT_ELEMENTS)])
    return out.view(-1, padded)[:, :width].reshape(gate.shape)


class RowActivation(nn.Module):
    """An elementwise activation module run through :func:`activated`: what a model's own forward
    (the ``transformers`` runner) calls in place of its MLP's activation with ``kernels="auto"`` on
    CPU, so that a row's bits do not depend on the rows sharing the call there either."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activated(self.act, x)


_TORCH_ELEMENTWISE = (nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.ELU, nn.SELU, nn.CELU, nn.Softplus,
                      nn.LogSigmoid, nn.Hardswish, nn.Hardsigmoid, nn.Tanhshrink)
"""torch's activation modules that are elementwise and go through a vector function (their scalar
tail can round otherwise); the exact ones (ReLU and the like) need no wrapping."""


def _elementwise_activation(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's or transformers' elementwise activations with a
    transcendental or rounded part (every class of ``transformers.activations`` but the identity)."""
    kind = type(module)
    if kind.__module__ == "transformers.activations":
        return kind.__name__ not in ("LinearActivation", "ClassInstantier")
    return kind in _TORCH_ELEMENTWISE


def wrap_activations(model: nn.Module) -> int:
    """Replace, in place, every elementwise activation submodule of ``model`` (an MLP's ``act_fn``,
    GPT-2's ``act``, Phi's ``activation_fn``: wherever the model keeps one) with a
    :class:`RowActivation` around it. Returns how many were wrapped. Activations a modeling file
    calls as functions (``torch.tanh`` in a soft-cap) are not modules and keep torch's own call."""
    wrapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, RowActivation):
            continue
        for name, child in list(parent.named_children()):
            if _elementwise_activation(child):
                setattr(parent, name, RowActivation(child))
                wrapped += 1
    return wrapped


_Pair = tuple[torch.Tensor, torch.Tensor]
"""A rotary table's (cos, sin)."""


class RotaryRows:
    """A model's rotary ``(cos, sin)`` rows by position, computed once by its own rotary module and
    gathered for each forward's positions (a forward called the module on its positions: ~57 us of a
    one-token step on a 2-core EPYC, against ~22 us for the gathers).

    The same bits as the module's call on any positions: a row is ``cos(p * inv_freq)`` (and
    ``sin``) times the scaling, elementwise, and torch runs cos and sin of a contiguous tensor
    through their vector function on every element (a partial vector at the end, vml's ``map``),
    so a row does not depend on the positions that share the call (tests/test_runner.py compares
    the gathered rows with the module's own calls). Only for rope types whose frequencies never
    change (:meth:`static`): the dynamic and long-rope types recompute theirs from each call's
    positions. The table holds the next power of two (at least 1,024) of positions past the
    largest asked for, per activation dtype: ``4 x positions x rotary dim`` bytes in bfloat16."""

    SLICE = 4096
    """Most positions one call of the rotary module computes while the table is built."""

    def __init__(self, rotary: nn.Module, by_kind: bool) -> None:
        self.rotary, self.by_kind = rotary, by_kind
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[int, dict[str, _Pair]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def static(rotary: nn.Module) -> bool:
        """Whether ``rotary``'s frequencies are fixed (transformers' ``dynamic_rope_update`` leaves
        them alone): every layer type's ``rope_type`` known and neither dynamic nor long-rope."""
        types = getattr(rotary, "rope_type", None)
        names = list(types.values()) if isinstance(types, dict) else [types]
        return all(isinstance(t, str) and "dynamic" not in t and t != "longrope" for t in names)

    def at(self, positions: torch.Tensor, kinds: list[str], dtype: torch.dtype,
           device: torch.device) -> dict[str, _Pair]:
        """Each kind's ``(cos, sin)`` ``[1, N, dim]`` at ``positions [N]``, as the module gives them
        for an input of ``dtype`` on ``device``."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        have, tables = self._tables.get((dtype, device), (0, {}))
        if need > have:
            with self._lock:
                have, tables = self._tables.get((dtype, device), (0, {}))
                if need > have:
                    have = max(2 * have, 1 << max(need - 1, 1).bit_length(), 1024)
                    tables = {kind: self._compute(kind, have, dtype, device) for kind in dict.fromkeys(kinds)}
                    self._tables[(dtype, device)] = (have, tables)  # one assignment: readers see old or new
        index = positions.reshape(-1).to(device)
        return {kind: (cos.index_select(0, index)[None], sin.index_select(0, index)[None])
                for kind, (cos, sin) in tables.items()}

    @torch.inference_mode()
    def _compute(self, kind: str, count: int, dtype: torch.dtype, device: torch.device) -> _Pair:
        probe = torch.empty((1, 1, 1), dtype=dtype, device=device)  # the module reads its dtype and device
        parts = []
        for start in range(0, count, self.SLICE):
            ids = torch.arange(start, min(count, start + self.SLICE), device=device)[None]
            parts.append(self.rotary(probe, ids, kind) if self.by_kind else self.rotary(probe, ids))
        return torch.cat([c[0] for c, _ in parts]), torch.cat([s[0] for _, s in parts])


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
        head_dim = base.layers[0].self_attn.head_dim
        if arch.wide_rotary or rotary_dim(model.config, head_dim) != head_dim:
            # the modeling file's own function: OLMo 2's on float32 tables, Phi-4-mini's on part of a head
            self._rotate = sys.modules[type(model).__module__].apply_rotary_pos_emb
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self._rotary_by_kind = arch.rotary_by_kind
        self._rotary_rows = RotaryRows(self.rotary, arch.rotary_by_kind) if RotaryRows.static(self.rotary) else None
        self.norm = base.norm
        self.head = model.lm_head
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self._embedding_scale, self._residual_scale, self._logits_scale = _multipliers(model)
        kinds = getattr(model.config, "layer_types", None) or ()
        self.layers: list[Layer] = []
        config = model.config
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
        for index, layer in enumerate(base.layers[: config.num_hidden_layers]):
            if arch.fused:  # Phi-3: q | k | v and gate | up are one linear each already, a joined group
                head_dim = layer.self_attn.head_dim
                qkv = (layer.self_attn.qkv_proj, [heads * head_dim, (heads + kv_heads) * head_dim,
                                                  (heads + 2 * kv_heads) * head_dim])
                inter = layer.mlp.gate_up_proj.out_features // 2
                gate_up = (layer.mlp.gate_up_proj, [inter, 2 * inter])
            else:
                qkv = join(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
                gate_up = join(layer.mlp, ("gate_proj", "up_proj"))
            self.layers.append(Layer(
                getattr(layer, arch.attention_norm) if arch.attention_norm else None, layer.self_attn,
                getattr(layer, arch.attention_out_norm) if arch.attention_out_norm else None,
                getattr(layer, arch.mlp_norm) if arch.mlp_norm else None, layer.mlp,
                getattr(layer, arch.mlp_out_norm) if arch.mlp_out_norm else None,
                (layer.self_attn.q_norm, layer.self_attn.k_norm) if arch.qk_norms else None,
                qkv, gate_up, kinds[index] if index < len(kinds) else "full_attention", getattr(layer.mlp, arch.act),
                bool(getattr(layer.self_attn, "use_rope", True)), arch.qk_whole))
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
        if self._rotary_rows is not None:
            return self._rotary_rows.at(positions, self._kinds, hidden.dtype, hidden.device)
        if self._rotary_by_kind:
            return {kind: self.rotary(hidden, positions[None], kind) for kind in self._kinds}
        return dict.fromkeys(self._kinds, self.rotary(hidden, positions[None]))

    def _native_forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: ItemBatch,
                        keep: torch.Tensor | None) -> torch.Tensor:
        hidden = self._embedded(tokens)
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
        return self._scaled_logits(logits[None])

    def _embedded(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return hidden if self._embedding_scale is None else hidden * self._embedding_scale  # Granite

    def _scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits through the model's own last steps: Granite's division, Gemma's soft-cap."""
        if self._logits_scale is not None:
            logits = logits / self._logits_scale
        if self.softcap is not None:  # Gemma 2's and 3's final soft-capping, as their modeling files do it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: ItemBatch, keep: torch.Tensor | None,
                base: Any) -> torch.Tensor:
        """The logits ``[1, rows, vocab]`` of ``tokens [N]`` at ``positions [N]``, laid out and
        attending as ``batch`` says; ``keep``: the rows to return (None: all). ``base``: the
        attention function the dispatcher would call for a layer (:data:`~triedec.model.dispatch.BASES`)."""
        if self._native is not None and batch.exact:
            return self._native_forward(tokens, positions, batch, keep)
        hidden = self._embedded(tokens[None])
        rotary = self._rotary_tables(hidden, positions)
        n = tokens.shape[0]
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.attn, layer.mlp
            residual = hidden
            x = hidden if layer.attention_norm is None else layer.attention_norm(hidden)
            shape = (1, n, -1, attn.head_dim)
            if layer.qkv is None:
                query, key, value = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            else:
                joined, (q_end, k_end, _) = layer.qkv
                out = _rows(joined, x.reshape(n, -1))
                query, key, value = (part[None] for part in (out[:, :q_end], out[:, q_end:k_end], out[:, k_end:]))
            if layer.qk_whole:  # OLMo 2: over the whole projection, before the heads are split
                query, key = layer.qk_norms[0](query.contiguous()), layer.qk_norms[1](key.contiguous())
            query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))
            if layer.qk_norms is not None and not layer.qk_whole:
                query, key = layer.qk_norms[0](query), layer.qk_norms[1](key)
            if layer.rope:
                query, key = self._rotate(query, key, *rotary[layer.kind])
            batch.write(index, key, value)
            kwargs = {"dropout": 0.0, "scaling": attn.scaling, "sliding_window": getattr(attn, "sliding_window", None),
                      "softcap": getattr(attn, "attn_logit_softcapping", None)}
            out, _ = batch.attend(attn, query, base(attn), kwargs)
            out = attn.o_proj(out.reshape(1, n, -1).contiguous())
            hidden = residual + self._residual(out, layer.attention_out_norm)
            residual = hidden
            x = hidden if layer.mlp_norm is None else layer.mlp_norm(hidden)
            if layer.gate_up is None:
                gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            else:
                joined, (gate_end, _) = layer.gate_up
                out = _rows(joined, x.reshape(n, -1))
                gate = out[:, :gate_end].contiguous().view(1, n, -1)  # the activation on a dense tensor, as unjoined
                up = out[:, gate_end:].view(1, n, -1)
            out = mlp.down_proj(activated(layer.act, gate) * up)  # Phi-3 writes up * act(gate): the same product
            hidden = residual + self._residual(out, layer.mlp_out_norm)
        hidden = self.norm(hidden)
        if keep is not None:
            hidden = hidden[:, keep]
        return self._scaled_logits(self.head(hidden))

    def _residual(self, out: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        """What a sublayer adds to the residual: its output, through its output norm (Gemma, OLMo 2),
        times Granite's residual multiplier."""
        out = out if norm is None else norm(out)
        return out if self._residual_scale is None else out * self._residual_scale
