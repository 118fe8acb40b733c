"""Shared fixtures: tiny random-weight models (Llama, Gemma3-like with sliding windows) and the
embedded default model."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

torch.set_num_threads(2)

TINY_VOCAB = 48
EOS = 2


def tiny_llama(vocab: int = TINY_VOCAB, seed: int = 0, attn: str = "sdpa", max_pos: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3(vocab: int = TINY_VOCAB, seed: int = 0, attn: str = "sdpa", window: int = 6) -> Gemma3ForCausalLM:
    """Gemma3-like: sliding-window layers (small window) interleaved with full-attention layers."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        sliding_window=window, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, attn_implementation=attn,
    )
    return Gemma3ForCausalLM(cfg).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos=EOS) -> list[int]:
    """transformers' own greedy decoding: the ground truth."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def default_lm():
    import triedec

    return triedec.load()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_lm):
    """A saved tiny random Llama with the default model's tokenizer (and chat template)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = len(default_lm.tokenizer)
    model = tiny_llama(vocab=vocab, max_pos=512)
    model.generation_config.eos_token_id = default_lm.tokenizer.eos_token_id
    model.save_pretrained(path)
    default_lm.tokenizer.save_pretrained(path)
    return path
