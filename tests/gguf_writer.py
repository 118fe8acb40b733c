"""GGUF files written by the tests with the ``gguf`` package's writer, from tiny random Hugging
Face models: the real loading path (``triedec.load("x.gguf")``) on families no offline GGUF exists
for, with no download.

:func:`write_gguf` writes what llama.cpp's ``convert_hf_to_gguf.py`` writes for the families
transformers' GGUF loader reads (its metadata keys, tensor names and the two transforms it undoes:
Llama's q/k row permutation, Gemma's ``norm - 1``), the byte-level BPE tokenizer of
:func:`helpers.tiny_tokenizer` as a ``gpt2`` tokenizer, and each 2-D weight in the block type
``kind`` says:

* ``"Q8_0"`` (also ``"Q4_0"``, ``"Q5_0"``, ...): the weights quantized by ``gguf.quants.quantize``;
* ``"Q4_K_M"``: a Q4_K_M-like mix, the K-quant blocks made directly (``gguf`` has no K-quant
  quantizer): random codes and sub-block scales under a fixed small super-block scale, so those
  layers' weights are whatever their blocks decode to (the model's own are not kept); Q5_K for
  the attention's q (Phi-3's fused q/k/v), Q5_0 (by ``gguf.quants``) for its k and output, Q4_K
  for the MLP's gate and up, Q6_K for the attention's v, the MLP's down and the head, Q8_0 for the
  embedding;
* ``"legacy"``: the legacy types of scale and minimum: Q4_0 for the attention's q, k and v, Q4_1 for
  its output and the MLP's gate and up, Q5_1 for the MLP's down, Q8_0 for the head and the
  embedding (all by ``gguf.quants``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants

ARCHS = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2,
         "qwen3": MODEL_ARCH.QWEN3, "phi3": MODEL_ARCH.PHI3, "gemma2": MODEL_ARCH.GEMMA2,
         "gemma3": MODEL_ARCH.GEMMA3}
"""The GGUF architectures written, by ``general.architecture``."""
_K_BLOCK = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176, GGMLQuantizationType.Q6_K: 210}
_HALF_SCALE = np.array([0.004], dtype=np.float16).view(np.uint8)  # every K-quant super-block's d (and dmin)


def _permute(weights: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (transformers' loader reverses it for ``llama``)."""
    if heads != kv_heads:
        heads = kv_heads
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _k_blocks(rows: int, cols: int, kind: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols / 256 * block bytes]`` of random K-quant blocks under a small fixed scale."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, _K_BLOCK[kind]), dtype=np.uint8)
    if kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        # d, dmin (fp16), 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits,) 128 of codes
        blocks[..., 0:2] = _HALF_SCALE
        blocks[..., 2:4] = _HALF_SCALE
    else:  # Q6_K: 128 bytes low bits, 64 high bits, 16 int8 scales, d (fp16)
        blocks[..., 192:208] = rng.integers(-32, 32, size=(rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
        blocks[..., 208:210] = _HALF_SCALE
    return blocks.reshape(rows, -1)


def _block_type(gguf_name: str, kind: str) -> GGMLQuantizationType:
    if kind == "legacy":
        if gguf_name.startswith(("token_embd", "output")):
            return GGMLQuantizationType.Q8_0
        if any(part in gguf_name for part in ("attn_q", "attn_k", "attn_v")):  # also Phi-3's attn_qkv
            return GGMLQuantizationType.Q4_0
        return GGMLQuantizationType.Q5_1 if "ffn_down" in gguf_name else GGMLQuantizationType.Q4_1
    if kind != "Q4_K_M":
        return GGMLQuantizationType[kind]
    if gguf_name.startswith("token_embd"):
        return GGMLQuantizationType.Q8_0
    if "attn_q" in gguf_name:  # also Phi-3's attn_qkv
        return GGMLQuantizationType.Q5_K
    if any(part in gguf_name for part in ("attn_k", "attn_output")):
        return GGMLQuantizationType.Q5_0  # as Qwen2.5-Coder's and Gemma 3's Q4_K_M files store them
    if any(part in gguf_name for part in ("attn_v", "ffn_down", "output")):
        return GGMLQuantizationType.Q6_K
    return GGMLQuantizationType.Q4_K


def write_gguf(model: Any, tokenizer: Any, path: Path, arch: str, kind: str = "Q8_0", seed: int = 0) -> Path:
    """``model`` (a tiny random decoder of family ``arch``, one of :data:`ARCHS`) and ``tokenizer``
    written to ``path`` as a GGUF file whose 2-D weights are blocks of ``kind`` (module doc)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))  # Gemma 3: per layer kind
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])  # control or normal
    merged = json.loads(tokenizer.backend_tokenizer.model.__getstate__())["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merged])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    # Gemma's tokenizer class needs an unknown token; a byte-level BPE never produces one
    writer.add_unk_token_id(tokenizer.pad_token_id if tokenizer.unk_token_id is None else tokenizer.unk_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    names = get_tensor_name_map(ARCHS[arch], config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    state = model.state_dict()
    if "lm_head.weight" in state and getattr(config, "tie_word_embeddings", False):
        del state["lm_head.weight"]
    for hf_name, tensor in state.items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        gguf_name = f"{gguf_name}.{suffix}"
        data = tensor.detach().to(torch.float32).numpy().copy()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1  # the loader subtracts it
        if arch == "llama" and ".attn_q." in gguf_name:
            data = _permute(data, heads, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            data = _permute(data, heads, kv_heads)
        if data.ndim != 2:
            writer.add_tensor(gguf_name, data)
            continue
        block = _block_type(gguf_name, kind)
        if block in _K_BLOCK:
            writer.add_tensor(gguf_name, _k_blocks(*data.shape, block, rng), raw_dtype=block)
        else:
            writer.add_tensor(gguf_name, quants.quantize(data, block), raw_dtype=block)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
