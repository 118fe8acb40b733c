"""triedec's own forward for the decoder architectures it ships: Llama (the default SmolLM2) and
Qwen2 (Llama's layers with q/k/v biases).

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
models of both architectures and on the default model); what it saves is the plumbing.

Where every part of the model runs on triedec's kernels (the ``int4-a8`` mode: 8-bit-activation
linears, fused RMS norms, SiLU, triedec's fixed-order attention with one kind of layer), the whole
walk is one native call instead (:func:`native_decoder`, ``csrc/decoder.cpp``): the same kernels in
the same order, with no Python between layers, so again the same bits. Elsewhere the walk is
Python calls of the same modules.

Anything else (another architecture, a module that is not of the expected shape) keeps
transformers' forward: :func:`runner_for` returns None, and :attr:`ModelAdapter.runner` names which
one ran.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from triedec.core.kvcache import KVCache
from triedec.model.dispatch import ItemBatch
from triedec.model.linears import JoinedPart, LinearStandIn
from triedec.model.native import kernel_available, load_kernel
from triedec.model.precision import NATIVE_LINEARS, Int4A8Linear, joinable
from triedec.model.rmsnorm import FusedRMSNorm

RUNNER = "triedec"
"""How the stats name this runner."""
TRANSFORMERS = "transformers"
"""How the stats name transformers' own forward (the fallback)."""
RUNNERS = (RUNNER, TRANSFORMERS)

_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def runner_for(model: nn.Module) -> DecoderRunner | None:
    """triedec's runner for ``model`` when its architecture is one the runner reproduces exactly
    (:data:`_ARCHITECTURES`, with every module where that modeling file puts it), else None."""
    if type(model).__name__ not in _ARCHITECTURES:
        return None
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    for layer in base.layers:
        if not all(hasattr(layer, name) for name in _LAYER_PARTS) \
                or not all(hasattr(layer.self_attn, name) for name in _ATTENTION_PARTS) \
                or not all(hasattr(layer.mlp, name) for name in _MLP_PARTS):
            return None
    if getattr(model.config, "pretraining_tp", 1) != 1:  # transformers' slicing of the head
        return None
    return DecoderRunner(model)


def join(parent: nn.Module, names: tuple[str, ...]) -> tuple[LinearStandIn, list[int]] | None:
    """The linears ``parent.<names>`` as one layer computing their outputs side by side (q, k and v;
    gate and up), where they are triedec's 8-bit-activation linears of one class that the class can
    join (:meth:`~triedec.model.precision.Int4A8Linear.joined`: each output keeps its bits, and the
    activations are quantized once for all). In ``parent`` each is replaced by a
    :class:`~triedec.model.linears.JoinedPart` of it, so the weights are held once. Returns the joined layer and where
    each part ends, or None (the linears stay as they are)."""
    parts = [getattr(parent, name) for name in names]
    if type(parts[0]) not in NATIVE_LINEARS or not joinable(parts):
        return None
    joined = type(parts[0]).joined(parts)
    ends, at = [], 0
    for name, part in zip(names, parts, strict=True):
        setattr(parent, name, JoinedPart(joined, at, at + part.out_features))
        at += part.out_features
        ends.append(at)
    return joined, ends


def _silu_classes() -> tuple[type, ...]:
    """The activation modules that are torch's SiLU (``csrc/decoder.cpp`` calls torch's ``silu``)."""
    try:
        from transformers.activations import SiLUActivation  # forward: nn.functional.silu
    except ImportError:
        return (nn.SiLU,)
    return (nn.SiLU, SiLUActivation)


_SILU = _silu_classes()


def _native_linear(kernel: Any, layer: nn.Module) -> Any:
    buffers = layer._buffers
    if type(layer) is Int4A8Linear:
        return kernel.NativeLinear(True, buffers["packed"], buffers["scales_zeros"], layer.bias)
    return kernel.NativeLinear(False, buffers["packed"], buffers["scales"], layer.bias)


def _parts(layers: list[nn.Module], joined: tuple[LinearStandIn, list[int]] | None) -> list[nn.Module]:
    """The linears a joined group runs: the joined one, or the parts themselves."""
    return [joined[0]] if joined is not None else layers


def native_decoder(model: nn.Module, layers: list[tuple[Any, ...]]) -> Any:
    """The native forward (``csrc/decoder.cpp``'s ``NativeDecoder``) of ``model``, whose layers
    :class:`DecoderRunner` has prepared, when every part of it runs on triedec's kernels with the
    arithmetic that file reproduces: bfloat16 activations, every linear and the head on the
    8-bit-activation kernels (:data:`~triedec.model.precision.NATIVE_LINEARS`), every norm
    triedec's RMS norm of the ``weight`` kind with one epsilon, SiLU, one attention scale. Else
    None (the Python walk runs)."""
    config = model.config
    base = model.model
    if next(model.parameters()).device.type != "cpu" or not kernel_available() \
            or base.embed_tokens.weight.dtype != torch.bfloat16 or getattr(config, "hidden_act", None) != "silu":
        return None
    norms = [base.norm] + [n for first, _, second, _, _, _ in layers for n in (first, second)]
    if not all(type(n) is FusedRMSNorm and n.variant == "weight" and n.weight.dtype == torch.bfloat16 for n in norms) \
            or len({n.eps for n in norms}) != 1:
        return None
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
    head_dim = layers[0][1].head_dim
    scales = {float(attn.scaling) for _, attn, _, _, _, _ in layers}
    if len(scales) != 1 or any(attn.head_dim != head_dim for _, attn, _, _, _, _ in layers):
        return None
    kernel = load_kernel()
    built = []
    for first, attn, second, mlp, qkv, gate_up in layers:
        if type(mlp.act_fn) not in _SILU:
            return None
        groups = (_parts([attn.q_proj, attn.k_proj, attn.v_proj], qkv), [attn.o_proj],
                  _parts([mlp.gate_proj, mlp.up_proj], gate_up), [mlp.down_proj])
        if not all(type(m) in NATIVE_LINEARS for group in groups for m in group):
            return None
        q, o, gu, down = ([_native_linear(kernel, m) for m in group] for group in groups)
        built.append(kernel.NativeLayer(first.weight, second.weight, q, o[0], gu, down[0]))
    if type(model.lm_head) not in NATIVE_LINEARS:
        return None
    return kernel.NativeDecoder(built, base.norm.weight, _native_linear(kernel, model.lm_head), heads, kv_heads,
                                head_dim, base.norm.eps, scales.pop())


class DecoderRunner:
    """One forward of a Llama-family decoder over an :class:`ItemBatch` (see the module doc).

    Construction joins each layer's q/k/v projections, and its gate and up projections, into one
    call each where the mode's linears can be joined with the same bits (:func:`join`: int4-a8),
    and builds the native forward where it applies (:attr:`native`)."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rotate = apply_rotary_pos_emb
        base = model.model
        if next(model.parameters()).device.type == "cpu" and kernel_available():
            kernel = load_kernel()
            self._rotate = lambda q, k, cos, sin: (kernel.rotary(q, cos, sin), kernel.rotary(k, cos, sin))
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.head = model.lm_head
        self.layers = []
        for layer in base.layers[: model.config.num_hidden_layers]:
            qkv = join(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
            gate_up = join(layer.mlp, ("gate_proj", "up_proj"))
            self.layers.append((layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp,
                                qkv, gate_up))
        self._native = native_decoder(model, self.layers)
        self._kv = (int(model.config.num_key_value_heads or model.config.num_attention_heads),
                    self.layers[0][1].head_dim)

    @property
    def native(self) -> bool:
        """Whether a forward can be one native call (:func:`native_decoder`); it is, for a batch on
        triedec's fixed-order attention whose layers are of one kind."""
        return self._native is not None

    def _native_forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: ItemBatch,
                        keep: torch.Tensor | None) -> torch.Tensor:
        hidden = self.embed(tokens)
        cos, sin = self.rotary(hidden, positions[None])
        kind = batch.kinds[0]
        caches: list[KVCache] = [item.cache for item in batch.items]
        for cache in caches:
            cache.allocate(len(self.layers), *self._kv, hidden.dtype, hidden.device)
        seen = [batch.key_lists(index, kind) for index in range(len(caches))]
        edges = [start for start, _ in batch.bounds] + [batch.bounds[-1][1]]
        logits = self._native.forward(
            hidden, cos[0].contiguous(), sin[0].contiguous(), edges,
            [cache.length for cache in caches], [cache.keys for cache in caches], [cache.values for cache in caches],
            [None if s is None else s[0] for s in seen], [None if s is None else s[1] for s in seen], keep)
        return logits[None]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: ItemBatch, keep: torch.Tensor | None,
                base: Any) -> torch.Tensor:
        """The logits ``[1, rows, vocab]`` of ``tokens [N]`` at ``positions [N]``, laid out and
        attending as ``batch`` says; ``keep``: the rows to return (None: all). ``base``: the
        attention function the dispatcher would call for a layer (:data:`~triedec.model.dispatch.BASES`)."""
        if self._native is not None and batch.exact and len(set(batch.kinds)) == 1:
            return self._native_forward(tokens, positions, batch, keep)
        hidden = self.embed(tokens[None])
        cos, sin = self.rotary(hidden, positions[None])
        n = tokens.shape[0]
        for index, (first_norm, attn, second_norm, mlp, qkv, gate_up) in enumerate(self.layers):
            residual = hidden
            x = first_norm(hidden)
            shape = (1, n, -1, attn.head_dim)
            if qkv is None:
                query = attn.q_proj(x).view(shape).transpose(1, 2)
                key = attn.k_proj(x).view(shape).transpose(1, 2)
                value = attn.v_proj(x).view(shape).transpose(1, 2)
            else:
                joined, (q_end, k_end, _) = qkv
                out = joined.rows(x.reshape(n, -1))
                query = out[:, :q_end].view(shape).transpose(1, 2)
                key = out[:, q_end:k_end].view(shape).transpose(1, 2)
                value = out[:, k_end:].view(shape).transpose(1, 2)
            query, key = self._rotate(query, key, cos, sin)
            batch.write(index, key, value)
            out, _ = batch.attend(attn, query, base(attn), {"dropout": 0.0, "scaling": attn.scaling})
            hidden = residual + attn.o_proj(out.reshape(1, n, -1).contiguous())
            residual = hidden
            x = second_norm(hidden)
            if gate_up is None:
                gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            else:
                joined, (gate_end, _) = gate_up
                out = joined.rows(x.reshape(n, -1))
                gate = out[:, :gate_end].contiguous().view(1, n, -1)  # the activation on a dense tensor, as unjoined
                up = out[:, gate_end:].view(1, n, -1)
            hidden = residual + mlp.down_proj(mlp.act_fn(gate) * up)
        hidden = self.norm(hidden)
        if keep is not None:
            hidden = hidden[:, keep]
        return self.head(hidden)
