"""triedec's own runner (:mod:`triedec.model.runner`) against transformers' forward of the same
model in the same precision mode and kernels: the same logits, bit for bit (``torch.equal``), for
random trees on chunked prompts batched beside other requests (Llama with grouped and multi-query
attention, tied and untied heads; Qwen2 with q/k/v biases; Qwen3's q/k norms; Mistral's window;
Phi-3's fused projections; SmolLM3's layers without rotary; Granite's multipliers; OLMo 2's output
norms and whole-projection q/k norms; Gemma 2's soft-capped scores and logits; Gemma 3 with
sliding-window and full layers, q/k norms and soft-capped logits), and the architectures it does
not run keep transformers' forward."""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch
from helpers import TINY_VOCAB, tiny_gemma3, tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from triedec.core.errors import TriedecError
from triedec.model.adapter import BIT_EXACT, NATIVE_FORWARD, OWN_RUNNER, ForwardItem, ModelAdapter
from triedec.model.linears import packing_available
from triedec.model.precision import Precision
from triedec.model.runner import RUNNER, TRANSFORMERS
from triedec.model.source import quantize


def _tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises biases to zero: give them values
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _tiny_qwen3(seed: int = 0):
    """A tiny Qwen3: Llama's layers with each head's q and k normed (random norm weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                      attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1, 0.5)
    return model


def _tiny_mistral(seed: int = 0, window: int | None = 5):
    """A tiny Mistral: Llama's layers, every one under a sliding window of ``window`` tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        sliding_window=window, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                        attn_implementation="sdpa")
    return MistralForCausalLM(cfg).eval()


def _tiny_phi3(seed: int = 0, partial: float = 1.0):
    """A tiny Phi-3: Llama's layers with q/k/v in one linear and gate/up in one; ``partial`` < 1:
    Phi-4-mini's rotary over the first part of each head."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    cfg = Phi3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     original_max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                     partial_rotary_factor=partial, attn_implementation="sdpa")
    return Phi3ForCausalLM(cfg).eval()


def _random_norms(model, suffixes: tuple[str, ...] = ("norm.weight", "layernorm.weight")):
    """``model`` with its RMS norms' weights random (transformers initialises them to one or zero)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.normal_(float(param.mean()), 0.5)
    return model


def _tiny_smollm3(seed: int = 0):
    """A tiny SmolLM3: Llama's layers, the second without rotary."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(seed)
    cfg = SmolLM3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        no_rope_layers=[1, 0], eos_token_id=2, bos_token_id=1, pad_token_id=0,
                        attn_implementation="sdpa")
    return SmolLM3ForCausalLM(cfg).eval()


def _tiny_granite(seed: int = 0):
    """A tiny Granite: Llama's layers with embedding, residual, attention and logit multipliers."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(seed)
    cfg = GraniteConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        embedding_multiplier=3.0, residual_multiplier=0.22, attention_multiplier=0.07,
                        logits_scaling=4.0, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                        attn_implementation="sdpa")
    return GraniteForCausalLM(cfg).eval()


def _tiny_olmo2(seed: int = 0):
    """A tiny OLMo 2: norms on the attention's and the MLP's outputs only, q/k norms over the whole
    projections (random norm weights)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(seed)
    cfg = Olmo2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=2, bos_token_id=1, pad_token_id=0, attn_implementation="sdpa")
    return _random_norms(Olmo2ForCausalLM(cfg).eval())


def _tiny_gemma2(seed: int = 0):
    """A tiny Gemma 2: Gemma 3's four norms a layer without q/k norms, sliding-window and full layers,
    soft-capped attention scores and logits (caps small enough to bite)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                       max_position_embeddings=512, sliding_window=6,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                       eos_token_id=2, bos_token_id=1, pad_token_id=0, attn_implementation="eager")
    return _random_norms(Gemma2ForCausalLM(cfg).eval())


def _mqa_llama(seed: int = 0):
    model = tiny_llama(seed=seed)
    cfg = copy.deepcopy(model.config)
    cfg.num_key_value_heads = 1  # multi-query attention, the head untied
    torch.manual_seed(seed)
    return type(model)(cfg).eval()


def _tiny_gemma3(seed: int = 0, softcap: float | None = None):
    """The tiny Gemma 3 (a window of 6, sliding and full layers, multi-query) with random norm
    weights (transformers starts them at zero: ``1 + w`` would be 1) and, optionally, Gemma 2's
    final soft-capping."""
    model = tiny_gemma3(seed=seed)
    model.config.final_logit_softcapping = softcap
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.5)
    return model


def _in_mode(model, dtype=None, weights="float"):
    precision = Precision.of(dtype, weights)
    if precision.quantized:
        quantize(model, precision)
        return model
    return model.to(precision.dtype)


def _gguf_like_with_int8_parts(seed: int = 0):
    """A tiny Llama in int4-a8 as from a GGUF file with mixed blocks (a Q4_K_M file's 6-bit layers):
    every linear's weight on a 4-bit grid but v and down, which int4-a8 then keeps in int8, so the
    runner cannot join q/k/v and runs the parts."""
    from torch import nn

    from triedec.model.precision import quantize_int4

    model = tiny_llama(seed=seed)
    with torch.no_grad():
        for name, layer in model.named_modules():
            if type(layer) is nn.Linear and layer is not model.lm_head and not name.endswith(("v_proj", "down_proj")):
                codes, scale, zero = quantize_int4(layer.weight)
                grouped = codes.float().reshape(codes.shape[0], -1, 32)
                snapped = (grouped - 8) * scale.t().float()[..., None] + zero.t().float()[..., None]
                layer.weight.copy_(snapped.reshape(layer.weight.shape))
    quantize(model, Precision.of(None, "int4-a8"), from_gguf=True)
    return model


def _split_bfloat16(seed: int = 0):
    """A tiny Llama in bfloat16 whose down projections are :class:`SplitLinear` over two pieces of
    oneDNN-packed linears (what a long input gets where oneDNN's sum order depends on the rows),
    the rest packed when the adapter loads it."""
    from torch import nn

    from triedec.model.linears import PackedLinear, SplitLinear

    model = _in_mode(tiny_llama(seed=seed), "bfloat16")
    for layer in model.model.layers:
        down = layer.mlp.down_proj
        assert type(down) is nn.Linear
        layer.mlp.down_proj = SplitLinear(down, 2, PackedLinear)
    return model


MODELS = {
    "llama-gqa-float32": lambda: tiny_llama(seed=2),
    "llama-mqa-bfloat16": lambda: _in_mode(_mqa_llama(seed=4), "bfloat16"),
    "llama-int8": lambda: _in_mode(tiny_llama(seed=6), weights="int8"),
    "llama-int4": lambda: _in_mode(tiny_llama(seed=7), weights="int4"),
    "qwen2-bias-int8": lambda: _in_mode(_tiny_qwen2(seed=16), weights="int8"),
    "gemma3-int4": lambda: _in_mode(_tiny_gemma3(seed=17), weights="int4"),
    "qwen2-bias-bfloat16": lambda: _in_mode(_tiny_qwen2(seed=18), "bfloat16"),
    "llama-int4-a8": lambda: _in_mode(tiny_llama(seed=8), weights="int4-a8"),
    "llama-int8-parts-int4-a8": lambda: _gguf_like_with_int8_parts(seed=10),
    "qwen2-bias-tied-float32": lambda: _tiny_qwen2(seed=3),
    "qwen2-bias-int4-a8": lambda: _in_mode(_tiny_qwen2(seed=9), weights="int4-a8"),
    "gemma3-float32": lambda: _tiny_gemma3(seed=13),
    "gemma3-softcap-bfloat16": lambda: _in_mode(_tiny_gemma3(seed=14, softcap=3.0), "bfloat16"),
    "gemma3-int4-a8": lambda: _in_mode(_tiny_gemma3(seed=15), weights="int4-a8"),
    "qwen3-float32": lambda: _tiny_qwen3(seed=21),
    "qwen3-int4-a8": lambda: _in_mode(_tiny_qwen3(seed=22), weights="int4-a8"),
    "qwen3-int8": lambda: _in_mode(_tiny_qwen3(seed=23), weights="int8"),
    "mistral-window-float32": lambda: _tiny_mistral(seed=24),
    "mistral-window-int4-a8": lambda: _in_mode(_tiny_mistral(seed=25), weights="int4-a8"),
    "mistral-int4": lambda: _in_mode(_tiny_mistral(seed=26, window=None), weights="int4"),
    "phi3-float32": lambda: _tiny_phi3(seed=27),
    "phi3-int4-a8": lambda: _in_mode(_tiny_phi3(seed=28), weights="int4-a8"),
    "phi3-int8": lambda: _in_mode(_tiny_phi3(seed=29), weights="int8"),
    "phi4-partial-float32": lambda: _tiny_phi3(seed=42, partial=0.75),
    "phi4-partial-int4-a8": lambda: _in_mode(_tiny_phi3(seed=43, partial=0.75), weights="int4-a8"),
    "smollm3-float32": lambda: _tiny_smollm3(seed=30),
    "smollm3-int4-a8": lambda: _in_mode(_tiny_smollm3(seed=31), weights="int4-a8"),
    "granite-float32": lambda: _tiny_granite(seed=32),
    "granite-int4-a8": lambda: _in_mode(_tiny_granite(seed=33), weights="int4-a8"),
    "granite-int8": lambda: _in_mode(_tiny_granite(seed=34), weights="int8"),
    "olmo2-float32": lambda: _tiny_olmo2(seed=35),
    "olmo2-int4-a8": lambda: _in_mode(_tiny_olmo2(seed=36), weights="int4-a8"),
    "gemma2-float32": lambda: _tiny_gemma2(seed=37),
    "gemma2-int4-a8": lambda: _in_mode(_tiny_gemma2(seed=38), weights="int4-a8"),
    "gemma2-int4": lambda: _in_mode(_tiny_gemma2(seed=39), weights="int4"),
    # a head of 50 outputs: triedec's float32 linear pads it to 64, so the Python walk runs
    "llama-padded-head-float32": lambda: tiny_llama(seed=20, vocab=50),
}
NATIVE = {"llama-int4-a8", "qwen2-bias-int4-a8", "llama-int8-parts-int4-a8", "gemma3-int4-a8",
          "llama-int8", "llama-int4", "qwen2-bias-int8", "gemma3-int4",
          "llama-gqa-float32", "qwen2-bias-tied-float32", "gemma3-float32", "qwen3-float32", "qwen3-int4-a8",
          "qwen3-int8", "mistral-window-float32", "mistral-window-int4-a8", "mistral-int4", "phi3-float32",
          "phi3-int4-a8", "phi3-int8", "smollm3-float32", "smollm3-int4-a8", "granite-float32", "granite-int4-a8",
          "granite-int8", "olmo2-float32", "olmo2-int4-a8", "gemma2-float32", "gemma2-int4-a8", "gemma2-int4",
          "phi4-partial-float32", "phi4-partial-int4-a8"}
"""The models whose forward is one native call (bf16 activations, every linear on triedec's
8-bit-activation kernels, the int8 / int4 modes' torch ops or bf16 oneDNN, triedec's norms; or
float32 activations, triedec's float32 linears, transformers' own norms)."""
if packing_available(torch.device("cpu"), torch.bfloat16):  # oneDNN has bf16 kernels for this CPU
    MODELS["llama-split-bfloat16"] = lambda: _split_bfloat16(seed=19)
    NATIVE |= {"llama-mqa-bfloat16", "qwen2-bias-bfloat16", "llama-split-bfloat16", "gemma3-softcap-bfloat16"}


@pytest.fixture(scope="module")
def adapter_pairs():
    """Per model: (triedec's runner, transformers' forward), each on its own copy (the maker called
    twice: it is seeded; a oneDNN-packed weight cannot be deep-copied), both kernels="auto"."""
    return {name: (ModelAdapter(make(), "auto", runner=RUNNER), ModelAdapter(make(), "auto", runner=TRANSFORMERS))
            for name, make in MODELS.items()}


def _forward_both(pair, gen: random.Random) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same random forwards on both adapters (each on caches of its own): prompt chunks of
    several requests, then a batch of random trees on them. Returns every row each produced."""
    outs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    requests = []
    for _ in range(gen.randint(1, 3)):
        prompt = [gen.randrange(TINY_VOCAB) for _ in range(gen.randint(1, 12))]
        sizes, left = [], len(prompt)
        while left:
            sizes.append(gen.randint(1, left))
            left -= sizes[-1]
        requests.append((prompt, sizes))
    tree_seed = gen.random()
    for side, adapter in enumerate(pair):
        caches = [adapter.new_cache(64) for _ in requests]
        for cache, (prompt, sizes) in zip(caches, requests, strict=True):
            at = 0
            for size in sizes:
                causal = torch.ones((size, size), dtype=torch.bool).tril()
                item = ForwardItem(cache, torch.tensor(prompt[at : at + size]), torch.arange(at, at + size), causal)
                outs[side].extend(adapter.forward_batch([item])[0])
                cache.commit(list(range(size)))
                at += size
        tree_gen = random.Random(tree_seed)
        items = []
        for cache, (prompt, _) in zip(caches, requests, strict=True):
            nodes = tree_gen.randint(1, 8)
            parents = [tree_gen.randint(-1, i - 1) for i in range(nodes)]
            visible = torch.zeros((nodes, nodes), dtype=torch.bool)
            depth = []
            for i, p in enumerate(parents):
                if p >= 0:
                    visible[i] = visible[p]
                visible[i, i] = True
                depth.append(1 + (depth[p] if p >= 0 else 0))
            tokens = torch.tensor([tree_gen.randrange(TINY_VOCAB) for _ in range(nodes)])
            positions = torch.tensor([len(prompt) + d - 1 for d in depth])
            items.append(ForwardItem(cache, tokens, positions, visible, keep=tree_gen.choice([-1, 1, nodes])))
        for rows in adapter.forward_batch(items):
            outs[side].extend(rows)
    return outs


@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31))
def test_the_runner_gives_transformers_forwards_bits(adapter_pairs, name, seed):
    mine, theirs = adapter_pairs[name]
    assert (mine.runner, theirs.runner) == (RUNNER, TRANSFORMERS)
    native = name in NATIVE
    assert mine.native_forward is native and not theirs.native_forward
    assert mine.kernels == f"{theirs.kernels}+{OWN_RUNNER}" + (f"+{NATIVE_FORWARD}" if native else "")
    assert mine.exactness == BIT_EXACT
    got, expected = _forward_both((mine, theirs), random.Random(seed))
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"row {i}: differs by up to {float((a - b).abs().max()):.3g}"


ROTARY_MODELS = {"llama": lambda: tiny_llama(seed=3), "gemma3-by-kind": lambda: _tiny_gemma3(seed=4),
                 "olmo2-float32-tables": lambda: _tiny_olmo2(seed=5),
                 "phi4-partial": lambda: _tiny_phi3(seed=6, partial=0.75)}


@pytest.mark.parametrize("name", list(ROTARY_MODELS))
def test_the_runners_rotary_rows_are_the_rotary_modules_own_bits_at_any_positions(name):
    runner = ModelAdapter(ROTARY_MODELS[name](), "auto", runner=RUNNER)._runner
    rows = runner._rotary_rows
    assert rows is not None  # the rope type is static: the runner gathers from its table
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        probe = torch.empty((1, 1, 1), dtype=dtype)
        for n in (1, 2, 3, 5, 16, 33, 600):  # past the first table's 1,024 positions and its 4,096 slices
            positions = torch.randint(0, 5000, (n,), generator=gen)
            got = rows.at(positions, runner._kinds, dtype, probe.device)
            assert set(got) == set(runner._kinds)
            for kind, (cos, sin) in got.items():
                args = (probe, positions[None], kind) if rows.by_kind else (probe, positions[None])
                want_cos, want_sin = runner.rotary(*args)
                assert cos.dtype == want_cos.dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_a_dynamic_rope_type_is_computed_on_each_forwards_positions():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    mine = ModelAdapter(LlamaForCausalLM(config).eval(), "auto", runner=RUNNER)
    assert mine._runner._rotary_rows is None  # its frequencies follow the positions past 16
    torch.manual_seed(7)
    theirs = ModelAdapter(LlamaForCausalLM(config).eval(), "auto", runner=TRANSFORMERS)
    outs: dict[str, list[torch.Tensor]] = {RUNNER: [], TRANSFORMERS: []}
    for adapter in (mine, theirs):
        cache = adapter.new_cache(64)
        tokens = torch.arange(3, 43) % TINY_VOCAB
        for at in range(0, 40, 10):
            causal = torch.ones((10, 10), dtype=torch.bool).tril()
            item = ForwardItem(cache, tokens[at : at + 10], torch.arange(at, at + 10), causal)
            outs[adapter.runner].append(adapter.forward_batch([item])[0])
            cache.commit(list(range(10)))
    for a, b in zip(outs[RUNNER], outs[TRANSFORMERS], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["silu", "gelu-tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_activations_row_has_the_bits_of_the_row_alone_whatever_the_rows_and_threads(kind, dtype):
    from triedec.model.runner import activated

    act = torch.nn.SiLU() if kind == "silu" else torch.nn.GELU(approximate="tanh")
    gen = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    try:
        for width, rows, count in ((100, 7, 1), (104, 401, 3), (1536, 101, 5), (96, 343, 2), (36_900, 3, 3)):
            torch.set_num_threads(count)  # a call of over 32,768 elements is cut among the threads
            gate = (4 * torch.randn((1, rows, width), generator=gen)).to(dtype)
            got = activated(act, gate)
            torch.set_num_threads(1)
            assert torch.equal(got, activated(act, gate)), f"{width} x {rows}: {count} threads against 1"
            torch.set_num_threads(count)
            assert got.shape == gate.shape and got.dtype == dtype
            for r in range(rows):
                alone = activated(act, gate[:, r : r + 1].clone())
                assert torch.equal(got[0, r], alone[0, 0]), f"{width} x {rows} on {count} threads: row {r}"
                assert torch.allclose(got[0, r].float(), act(gate[0, r].float()), rtol=1e-2, atol=1e-3)
    finally:
        torch.set_num_threads(threads)


def test_a_native_prompt_chunk_gives_each_row_the_bits_of_a_smaller_chunk_on_any_threads():
    adapter = ModelAdapter(tiny_llama(seed=4, intermediate=104, max_pos=1024), "auto", runner=RUNNER)
    assert adapter.native_forward
    tokens = torch.tensor([random.Random(4).randrange(TINY_VOCAB) for _ in range(401)])
    threads = torch.get_num_threads()
    outs = []
    try:
        for count, sizes in ((3, [401]), (1, [150, 251])):
            torch.set_num_threads(count)
            cache, rows, at = adapter.new_cache(512), [], 0
            for size in sizes:
                causal = torch.ones((size, size), dtype=torch.bool).tril()
                item = ForwardItem(cache, tokens[at : at + size], torch.arange(at, at + size), causal)
                rows.append(adapter.forward_batch([item])[0])
                cache.commit(list(range(size)))
                at += size
            outs.append(torch.cat(rows))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_kernels_auto_runs_triedecs_runner_and_plain_transformers_forward():
    assert ModelAdapter(tiny_llama(seed=1), "auto").runner == RUNNER
    assert ModelAdapter(tiny_llama(seed=1), "plain").runner == TRANSFORMERS
    assert ModelAdapter(tiny_llama(seed=1), "plain", runner=RUNNER).runner == RUNNER


def test_an_architecture_the_runner_does_not_run_keeps_transformers_forward():
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(1)
    olmo = OlmoForCausalLM(OlmoConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      attn_implementation="sdpa")).eval()
    adapter = ModelAdapter(copy.deepcopy(olmo), "auto")
    assert adapter.runner == TRANSFORMERS and adapter.exactness == BIT_EXACT
    runs = r"\(it runs Llama, Qwen2, Mistral, Qwen3, Phi3, SmolLM3, Granite, Olmo2, Gemma2, Gemma3\)"
    assert re.match(rf"triedec's runner does not know OlmoForCausalLM {runs}: its steps run transformers' forward",
                    adapter.runner_note), adapter.runner_note
    with pytest.raises(TriedecError, match=rf"does not know OlmoForCausalLM {runs}; use runner='transformers'"):
        ModelAdapter(olmo, "auto", runner=RUNNER)
    with pytest.raises(TriedecError, match="runner must be one of"):
        ModelAdapter(tiny_llama(seed=1), "auto", runner="vllm")
    assert ModelAdapter(tiny_llama(seed=1), "auto").runner_note == ""
    assert ModelAdapter(tiny_llama(seed=1), "plain").runner_note == "kernels='plain'"


@pytest.mark.parametrize("family", ["lfm2", "qwen3.5", "granite-hybrid"])
def test_a_model_with_recurrent_layers_gets_an_error_naming_them(family):
    """Tree verification keeps K/V per node, not a recurrent state per node: such a model is refused
    with the layers named, not run to wrong tokens."""
    import transformers as tf

    small = {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    if family == "lfm2":
        model = tf.Lfm2ForCausalLM(tf.Lfm2Config(**small, layer_types=["conv", "full_attention"]))
        named = "short-convolution"
    elif family == "qwen3.5":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(
            **small, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16))
        named = "Gated DeltaNet"
    else:
        model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(
            **small, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
            num_local_experts=0, shared_intermediate_size=128))
        named = "Mamba"
    with pytest.raises(TriedecError, match=rf"{type(model).__name__} has .*{named}.* layers, whose state runs "
                                           r"through the tokens in order"):
        ModelAdapter(model.eval(), "auto")


def test_float32_greedy_through_the_runner_equals_transformers_generate():
    """The runner in float32 with transformers' own kernels (``kernels="plain"``) and with
    triedec's (``"auto"``): plain decoding's tokens equal stock ``generate``'s."""
    from helpers import EOS, alone, hf_greedy, tiny_info

    from triedec.engine.methods import method
    from triedec.engine.request import StopRule

    prompt = [5, 9, 14, 3, 22, 7]
    expected = hf_greedy(tiny_llama(seed=11), prompt, 24)
    ar = method("ar")
    for kernels in ("plain", "auto"):
        adapter = ModelAdapter(tiny_llama(seed=11), kernels, runner=RUNNER)
        got, _ = alone(adapter, ar.build(ar.make_options({}), tiny_info()), prompt, StopRule(24, frozenset([EOS])))
        assert got == expected, kernels


def test_joined_projections_hold_the_weights_once_and_keep_the_models_own_forward():
    """In int4-a8 the runner joins each layer's q/k/v and gate/up projections (one kernel call and
    one activation quantization each); the model's modules become parts of the joined layers, so
    transformers' own forward of that model still gives the unjoined model's logits."""
    from triedec.model.precision import Int4A8Linear
    from triedec.model.runner import JoinedPart

    model = _in_mode(tiny_llama(seed=12), weights="int4-a8")
    unjoined = copy.deepcopy(model)
    adapter = ModelAdapter(model, "auto")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(m, JoinedPart) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    assert attn.q_proj.joined is attn.v_proj.joined and isinstance(attn.q_proj.joined, Int4A8Linear)
    # per layer: the joined q/k/v, the joined gate/up, o and down
    assert sum(isinstance(m, Int4A8Linear) for m in model.modules()) == 4 * len(model.model.layers)
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, unjoined(ids).logits)
    assert adapter.runner == RUNNER


@pytest.mark.default_model
@pytest.mark.parametrize("weights", ["float", "int4-a8"])
def test_the_runner_gives_transformers_bits_on_the_default_model(weights):
    """The default model in float32 and int4-a8 (its q/k/v and gate/up joined; the forward one
    native call; int4 mode's native forward is checked on the tiny models, ``*-int4``): a prompt in
    two chunks, then a draft tree beside another request's chunk, through triedec's runner and
    through transformers' forward on the same kernels: every row ``torch.equal``."""
    import triedec

    mine = triedec.load(weights=weights).adapter
    theirs = ModelAdapter(triedec.load(weights=weights, kernels="plain").model, "auto", runner=TRANSFORMERS)
    assert (mine.runner, theirs.runner) == (RUNNER, TRANSFORMERS)
    assert mine.native_forward
    assert mine.kernels == f"{theirs.kernels}+{OWN_RUNNER}+{NATIVE_FORWARD}"
    prompt = torch.tensor([1, 4093, 314, 253, 1345, 28, 1116, 335, 260, 6372, 2761, 47, 2])
    tree = torch.tensor([[True, False, False, False], [True, True, False, False],
                         [True, False, True, False], [True, True, False, True]])
    rows = []
    for adapter in (mine, theirs):
        cache, other = adapter.new_cache(32), adapter.new_cache(32)
        got = list(adapter.forward_batch([ForwardItem(cache, prompt[:5], torch.arange(5),
                                                      torch.ones((5, 5), dtype=torch.bool).tril())])[0])
        cache.commit(list(range(5)))
        got += adapter.forward_batch([ForwardItem(cache, prompt[5:], torch.arange(5, 13),
                                                  torch.ones((8, 8), dtype=torch.bool).tril(), keep=2)])[0]
        cache.commit(list(range(8)))
        chunk = ForwardItem(other, prompt[:7], torch.arange(7), torch.ones((7, 7), dtype=torch.bool).tril())
        draft = ForwardItem(cache, torch.tensor([504, 281, 2114, 30]), torch.tensor([13, 14, 14, 15]), tree)
        for part in adapter.forward_batch([chunk, draft]):
            got += part
        rows.append(got)
    assert len(rows[0]) == len(rows[1]) == 5 + 2 + 7 + 4
    for i, (a, b) in enumerate(zip(*rows, strict=True)):
        assert torch.equal(a, b), f"row {i}"


@pytest.mark.parametrize("name", ["llama-int4-a8", "qwen3-float32", "llama-int8", "phi3-int4-a8", "gemma3-int4"])
def test_a_second_runner_over_a_prepared_model_joins_again_and_runs_natively(adapter_pairs, name):
    """``triedec.LM(lm.model, ...)`` over a model a runner has prepared (its q/k/v and gate/up
    already parts of one joined linear each) finds those joined linears again: the same kernels,
    the native forward, and every row the first runner's bits."""
    mine, _ = adapter_pairs[name]
    again = ModelAdapter(mine.model, "auto", runner=RUNNER)
    assert again.native_forward and again.kernels == mine.kernels
    first, second = mine._runner.layers[0], again._runner.layers[0]
    assert (first.qkv is None) == (second.qkv is None) and (first.gate_up is None) == (second.gate_up is None)
    if first.qkv is not None:
        assert second.qkv[0] is first.qkv[0] and second.qkv[1] == first.qkv[1]
    got, expected = _forward_both((again, mine), random.Random(11))
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"row {i}"


def test_a_gguf_like_models_int8_parts_run_unjoined_in_the_native_forward(adapter_pairs):
    from triedec.model.precision import Int8A8Linear

    model = adapter_pairs["llama-int8-parts-int4-a8"][0].model
    attn = model.model.layers[0].self_attn
    assert type(attn.v_proj) is Int8A8Linear and type(model.model.layers[0].mlp.down_proj) is Int8A8Linear
    assert adapter_pairs["llama-int8-parts-int4-a8"][0]._runner.layers[0].qkv is None  # q/k/v not joined


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_the_native_forward_gives_the_same_bits_on_one_and_two_threads(adapter_pairs, name):
    """The native forward's kernels split each output among threads, never a sum: the same random
    forwards (prompt chunks, then trees beside other requests) on 1 and on 2 threads give every row
    the same bits."""
    mine, _ = adapter_pairs[name]
    assert mine.native_forward
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        rows.append(_forward_both((mine, mine), random.Random(7))[0])
    assert len(rows[0]) == len(rows[1])
    for i, (a, b) in enumerate(zip(*rows, strict=True)):
        assert torch.equal(a, b), f"row {i}"


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_the_native_forward_gives_the_same_bits_on_every_installed_kernel_library(adapter_pairs, name):
    """The ISA decides the speed only, for the whole native forward too (its elementwise steps
    included): the same random forwards on each kernel library this CPU runs give every row the
    same bits."""
    from triedec.model.native import load_kernel, switchable_libraries

    kernel, libraries = load_kernel(), switchable_libraries()
    if len(libraries) < 2:
        pytest.skip("fewer than two installed kernel libraries run on this CPU")
    mine, _ = adapter_pairs[name]
    fastest, rows = kernel.isa(), {}
    try:
        for isa, path in libraries.items():
            assert kernel.use_kernels(str(path)) == isa
            rows[isa] = _forward_both((mine, mine), random.Random(5))[0]
    finally:
        kernel.use_kernels(str(libraries[fastest]))
    first, *others = rows.values()
    for other in others:
        assert len(other) == len(first)
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


FAMILIES = {"phi3": _tiny_phi3, "phi4-partial": lambda seed: _tiny_phi3(seed=seed, partial=0.75),
            "smollm3": _tiny_smollm3, "granite": _tiny_granite, "olmo2": _tiny_olmo2, "gemma2": _tiny_gemma2,
            "qwen3": _tiny_qwen3, "mistral": _tiny_mistral}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_on_the_runner_gives_stock_transformers_greedy_tokens(family):
    """Each family the runner added, in float32 on its native forward: every method's tokens are
    stock transformers' greedy tokens (an unmodified copy decoding with its own forward)."""
    from helpers import EOS, alone, fake_cost, hf_greedy, random_prompts, tiny_info

    from triedec.engine.methods import method
    from triedec.engine.request import StopRule

    stock, fast = FAMILIES[family](seed=40), FAMILIES[family](seed=40)
    adapter = ModelAdapter(fast, "auto")
    assert adapter.runner == RUNNER and adapter.native_forward
    info = tiny_info(cost=fake_cost())
    settings = {"ar": {}, "pld": {"min_expected": 0.0}, "recycling": {"nodes": 80}, "ngram-trie": {"sized": False},
                "lookahead": {}, "auto": {}}
    decoders = {n: method(n).build(method(n).make_options(o), info) for n, o in settings.items()}
    rule = StopRule(20, frozenset([EOS]))
    for i, prompt in enumerate(random_prompts(seed=300 + list(FAMILIES).index(family), count=4)):
        truth = hf_greedy(stock, prompt, 20)
        for n, decoder in decoders.items():
            tokens, _ = alone(adapter, decoder, prompt, rule)
            assert tokens == truth, f"{n} differs on prompt {i}"


def _gguf_family(family: str, vocab: int, tokenizer):
    """A tiny random model of ``family`` sized for K-quant blocks (rows of 256 features), with
    ``tokenizer``'s special ids."""
    import transformers as tf

    torch.manual_seed(41)
    common = {"vocab_size": vocab, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
              "pad_token_id": tokenizer.pad_token_id, "attn_implementation": "sdpa"}
    window = {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}
    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=128)),  # the loader assumes 128
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**common, original_max_position_embeddings=512)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**{**common, "attn_implementation": "eager"},
                                                               head_dim=64, **window)),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, head_dim=64, **window)),
    }
    return _random_norms(configs[family]().eval())


GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
"""The families transformers' GGUF loader reads (Mistral's files are ``llama`` ones: gguf-py has no
``mistral`` architecture)."""


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M", "legacy"])
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_a_gguf_file_of_each_family_loads_onto_the_runner_with_transformers_bits(tmp_path, monkeypatch, family,
                                                                                 kind):
    """A GGUF file the test writes (tests/gguf_writer.py: Q8_0, a Q4_K_M-like mix of Q4_K, Q5_K,
    Q5_0, Q6_K and Q8_0 blocks, or a mix of the legacy Q4_0, Q4_1 and Q5_1) loaded as a user loads
    one, ``triedec.load("x.gguf")``: triedec's runner in one native call, its logits ``torch.equal``
    to transformers' own loading of the same file in the same precision mode on transformers'
    forward, and every method ``ar``'s tokens. The Q5_0 layers are held at their 5 bits and give the
    bits of the same codes held in int8; the Q6_K layers at their own 6.6 bits, the file's values;
    the Q4_K, Q5_K, Q4_0, Q4_1 and Q5_1 layers as the file's own blocks (read from it, Llama's q and
    k rows in transformers' order), their values bit for bit; the legacy ones at the file's bits."""
    from gguf_writer import write_gguf
    from helpers import tiny_tokenizer
    from transformers import AutoModelForCausalLM

    import triedec
    from triedec.model import precision
    from triedec.model.linears import JoinedPart
    from triedec.model.precision import (
        Int5A8Linear,
        Int6A8Linear,
        KQuantA8Linear,
        ScaleMinA8Linear,
        linear_weight_bytes,
    )
    from triedec.model.source import gguf_linear_bytes, quantize

    tokenizer = tiny_tokenizer()
    path = write_gguf(_gguf_family(family, len(tokenizer), tokenizer), tokenizer, tmp_path / f"{family}.gguf",
                      family, kind)
    lm = triedec.load(path, cache_dir=tmp_path / "cache")
    adapter = lm.adapter
    assert adapter.runner == RUNNER and adapter.native_forward, adapter.runner_note
    assert adapter.precision.weights == ("float" if kind == "Q8_0" else "int4-a8")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert type(reference) is type(lm.model)
    plain = {name: m.weight.detach().clone() for name, m in reference.named_modules() if type(m) is torch.nn.Linear}
    if adapter.precision.weights != "float":
        quantize(reference, adapter.precision, from_gguf=True, gguf_file=path)
    theirs = ModelAdapter(reference, "auto", runner=TRANSFORMERS)
    got, expected = _forward_both((adapter, theirs), random.Random(7))
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"row {i}: differs by up to {float((a - b).abs().max()):.3g}"
    if kind == "Q4_K_M":  # a token reads each block near its bits (Q6_K 6.625 for 6.56, Q4_K and Q5_K +0.25)
        from gguf import GGMLQuantizationType, GGUFReader

        stored = [t.tensor_type for t in GGUFReader(str(path)).tensors]
        held = [type(m) for m in lm.model.modules()]
        q5_0, q6_k = stored.count(GGMLQuantizationType.Q5_0), stored.count(GGMLQuantizationType.Q6_K)
        assert q5_0 and held.count(Int5A8Linear) == q5_0  # each at its bits
        assert q6_k and held.count(Int6A8Linear) == q6_k
        kquants = {name: m for name, m in reference.named_modules() if type(m) is KQuantA8Linear}
        assert [m.bits for m in kquants.values()].count(4) == stored.count(GGMLQuantizationType.Q4_K)
        assert [m.bits for m in kquants.values()].count(5) == stored.count(GGMLQuantizationType.Q5_K) > 0
        assert all(torch.equal(m.dequantized(), plain[name]) for name, m in kquants.items())  # the file's values
        ratio = linear_weight_bytes(lm.model) / gguf_linear_bytes(path)
        assert 1.0 < ratio < 1.1, ratio
        widened = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        chosen = precision._a8_linear
        monkeypatch.setattr(precision, "_a8_linear", lambda linear: precision.Int8A8Linear(linear) if type(
            chosen(linear)) is Int5A8Linear else chosen(linear))  # the Q5_0 codes in int8, the rest as they were
        quantize(widened, adapter.precision, from_gguf=True, gguf_file=path)
        assert not any(type(m) is Int5A8Linear for m in widened.modules())
        got, expected = _forward_both((adapter, ModelAdapter(widened, "auto")), random.Random(8))
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    if kind == "legacy":  # every layer but the head as the file's blocks, its values and bits
        from gguf import GGMLQuantizationType, GGUFReader

        stored = [t.tensor_type for t in GGUFReader(str(path)).tensors]
        own = {name: m for name, m in reference.named_modules() if type(m) is ScaleMinA8Linear}
        assert [m.bits for m in own.values()].count(4) == stored.count(GGMLQuantizationType.Q4_0) + stored.count(
            GGMLQuantizationType.Q4_1) > 0
        assert [m.bits for m in own.values()].count(5) == stored.count(GGMLQuantizationType.Q5_1) > 0
        assert all(torch.equal(m.dequantized(), plain[name]) for name, m in own.items())  # the file's values
        assert sum(type(m) is ScaleMinA8Linear for m in lm.model.modules()) == len(own) - (
            sum(type(m) is JoinedPart for m in lm.model.modules()) - len({id(m.joined) for m in lm.model.modules()
                                                                         if type(m) is JoinedPart}))
        assert linear_weight_bytes(lm.model) == gguf_linear_bytes(path)  # the file's bytes: every block at its bits
    prompt = "one two three four five six seven eight nine ten. Repeat: one two three"
    ar = lm.generate(prompt, "ar", max_new_tokens=16).token_ids
    for name in ("pld", "lookahead", "auto"):
        assert lm.generate(prompt, name, max_new_tokens=16).token_ids == ar, name


def test_the_models_own_forward_gets_its_activations_on_whole_rows_and_the_runner_still_reads_them():
    from triedec.model.adapter import ROW_ACTIVATION
    from triedec.model.runner import RowActivation, wrap_activations

    model = tiny_llama(seed=2, intermediate=104)
    stock = ModelAdapter(model, "auto", runner=TRANSFORMERS)
    acts = [layer.mlp.act_fn for layer in model.model.layers]
    assert all(isinstance(a, RowActivation) and "SiLU" in type(a.act).__name__ for a in acts), acts
    assert ROW_ACTIVATION in stock.kernels and stock.exactness == BIT_EXACT
    assert wrap_activations(model) == 0  # never wrapped twice
    # the runner on the same (wrapped) model still knows its activation: the native forward runs it
    assert ModelAdapter(model, "auto", runner=RUNNER).native_forward
    # its own runner applies activations on whole rows itself (and says so); kernels="plain" keeps
    # the model's calls
    fresh = tiny_llama(seed=2, intermediate=104)
    assert ROW_ACTIVATION in ModelAdapter(fresh, "auto", runner=RUNNER).kernels
    assert not any(isinstance(m, RowActivation) for m in fresh.modules())
    ModelAdapter(fresh, "plain")
    assert not any(isinstance(m, RowActivation) for m in fresh.modules())
