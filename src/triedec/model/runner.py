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

Anything else (another architecture, a module that is not of the expected shape) keeps
transformers' forward: :func:`runner_for` returns None, and :attr:`ModelAdapter.runner` names which
one ran. This is the first step of the runner issue 54 describes (one native call per forward);
today the layers are still Python calls of triedec's kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from triedec.model.dispatch import ItemBatch
from triedec.model.linears import JoinedPart, LinearStandIn
from triedec.model.native import kernel_available, load_kernel
from triedec.model.precision import NATIVE_LINEARS, joinable

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


class DecoderRunner:
    """One forward of a Llama-family decoder over an :class:`ItemBatch` (see the module doc).

    Construction joins each layer's q/k/v projections, and its gate and up projections, into one
    call each where the mode's linears can be joined with the same bits (:func:`join`: int4-a8)."""

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

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: ItemBatch, keep: torch.Tensor | None,
                base: Any) -> torch.Tensor:
        """The logits ``[1, rows, vocab]`` of ``tokens [N]`` at ``positions [N]``, laid out and
        attending as ``batch`` says; ``keep``: the rows to return (None: all). ``base``: the
        attention function the dispatcher would call for a layer (:data:`~triedec.model.dispatch.BASES`)."""
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
