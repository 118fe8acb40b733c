"""Exact by construction: a token's logits are a function of the model and its prefix alone, bit for
bit (``torch.equal``), whatever tree, batch or place in the forward's row carries them.

* the kernel (:mod:`triedec.model.attention`): a query's output alone, inside a call of many queries,
  over its keys compacted or scattered in a bigger cache, one head alone or beside the heads that
  share its K/V, for random shapes, groups, head sizes (vector and scalar paths) and dtypes;
* whole models with ``kernels="auto"`` (GQA, sliding windows, tied and untied heads; float32,
  bfloat16, int8 and int4 weights): every node of
  a random tree, on a prefix committed by random prompt chunks, at a random place in a forward
  beside other requests' chunks on caches of other lengths, equals plain decoding's logits for
  the same prefix, one token per forward;
* the load-time self-test says ``bit-exact`` there and ``up to rounding`` on stock kernels (which
  shows the comparison can fail);
* sampled decoding at temperature 1.0 on a model whose distributions are not peaked: every method
  returns ``ar``'s tokens, alone and batched under a verify budget that cuts trees to other sizes
  from step to step.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import (
    EOS,
    TINY_VOCAB,
    alone,
    fake_cost,
    fake_profile,
    random_prompts,
    tiny_gemma3,
    tiny_info,
    tiny_llama,
    together,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triedec.core.errors import TriedecError
from triedec.core.sampling import Sampling
from triedec.engine.batch import BatchLimits
from triedec.engine.methods import method
from triedec.engine.request import StopRule
from triedec.model.adapter import (
    BIT_EXACT,
    UP_TO_ROUNDING,
    ForwardItem,
    ModelAdapter,
    check_row_invariance,
    unvouched,
)
from triedec.model.attention import key_lists, tree_attention, tree_attention_items
from triedec.model.precision import Precision
from triedec.model.runner import TRANSFORMERS
from triedec.model.source import quantize

# ---- the kernel ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_kernel_gives_a_query_the_same_bits_in_any_call_and_any_layout(data):
    kv_heads = data.draw(st.integers(1, 3), label="kv_heads")
    group = data.draw(st.integers(1, 7), label="group")  # heads sharing K/V are computed as teams of 1-3
    dim = data.draw(st.sampled_from([4, 8, 12, 16, 64]), label="dim")  # 4, 12: the scalar path
    slots = data.draw(st.integers(1, 200), label="slots")
    queries = data.draw(st.integers(1, 10), label="queries")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), label="dtype")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    q = torch.randn(1, kv_heads * group, queries, dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, slots, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, slots, dim, generator=gen).to(dtype)
    visible = torch.rand(queries, slots, generator=gen) < data.draw(st.floats(0.05, 1.0), label="density")
    # the layouts of a forward beside keys scattered at random: a prompt chunk (query t sees slots
    # up to base + t, so its last keys are scored one at a time) and a tree (a shared cache, then
    # some of the tree's slots)
    layout = data.draw(st.sampled_from(["random", "chunk", "tree"]), label="layout")
    if layout == "chunk":
        base = max(slots - queries, 0)
        visible = torch.arange(slots)[None, :] <= base + torch.arange(queries)[:, None]
    elif layout == "tree":
        shared = data.draw(st.integers(0, slots), label="shared cache")
        start = data.draw(st.integers(0, max(shared - 1, 0)), label="first shared slot")
        visible[:, start:shared] = True
        visible[:, :start] = False
    visible[torch.arange(queries), torch.randint(0, slots, (queries,), generator=gen)] = True
    scale = dim**-0.5
    together = tree_attention(q, k, v, key_lists(visible), scale)
    for t in range(queries):
        one = tree_attention(q[:, :, t : t + 1], k, v, key_lists(visible[t : t + 1]), scale)
        assert torch.equal(one[0, 0], together[0, t]), f"query {t} alone"
        seen = visible[t].nonzero()[:, 0]
        compact = tree_attention(q[:, :, t : t + 1], k[:, :, seen], v[:, :, seen], None, scale)
        assert torch.equal(compact[0, 0], together[0, t]), f"query {t} over its keys compacted"
        # the same keys scattered over a bigger cache (views with another stride), junk between
        spread = slots + int(seen.numel()) + 3
        where = torch.sort(torch.randperm(spread, generator=gen)[: seen.numel()]).values
        big_k = torch.randn(1, kv_heads, spread + 5, dim, generator=gen).to(dtype)
        big_v = torch.randn(1, kv_heads, spread + 5, dim, generator=gen).to(dtype)
        big_k[:, :, where], big_v[:, :, where] = k[:, :, seen], v[:, :, seen]
        row = torch.zeros(1, spread, dtype=torch.bool)
        row[0, where] = True
        scattered = tree_attention(q[:, :, t : t + 1], big_k.narrow(2, 0, spread), big_v.narrow(2, 0, spread),
                                   key_lists(row), scale)
        assert torch.equal(scattered[0, 0], together[0, t]), f"query {t} over its keys scattered"
        # one head alone on its key/value head (no team: the single-output path) gives the bits
        # its team gave
        h = data.draw(st.integers(0, kv_heads * group - 1), label="head")
        g = h // group
        single = tree_attention(q[:, h : h + 1, t : t + 1], k[:, g : g + 1], v[:, g : g + 1],
                                key_lists(visible[t : t + 1]), scale)
        assert torch.equal(single[0, 0, 0], together[0, t, h]), f"query {t}, head {h} alone"
    mask = visible[None, None]
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1), attn_mask=mask,
        scale=scale).transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(together.float(), reference, atol=tol, rtol=tol)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_kernel_gives_each_item_of_a_many_item_call_the_bits_of_a_call_of_its_own(data):
    """One call for every request of a forward (:func:`tree_attention_items`), each request on its
    own K/V of its own length, with or without key lists: every output equals its item's own call."""
    kv_heads = data.draw(st.integers(1, 3), label="kv_heads")
    group = data.draw(st.integers(1, 4), label="group")
    dim = data.draw(st.sampled_from([8, 12, 64]), label="dim")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), label="dtype")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=5), label="sizes")
    query = torch.randn(1, kv_heads * group, sum(sizes), dim, generator=gen).to(dtype)
    caches, seen, alone = [], [], []
    at = 0
    for size in sizes:
        slots = data.draw(st.integers(1, 70), label="slots")
        k = torch.randn(1, kv_heads, slots, dim, generator=gen).to(dtype)
        v = torch.randn(1, kv_heads, slots, dim, generator=gen).to(dtype)
        if data.draw(st.booleans(), label="listed"):
            visible = torch.rand(size, slots, generator=gen) < 0.5
            visible[torch.arange(size), torch.randint(0, slots, (size,), generator=gen)] = True
            lists = key_lists(visible)
        else:
            lists = None
        caches.append((k, v))
        seen.append(lists)
        alone.append(tree_attention(query[:, :, at : at + size], k, v, lists, dim**-0.5))
        at += size
    edges = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    together = tree_attention_items(query, caches, edges, seen, dim**-0.5)
    assert torch.equal(together, torch.cat(alone, dim=1))
    with pytest.raises(RuntimeError, match="bounds"):
        tree_attention_items(query, caches, [0, *edges[1:-1], edges[-1] + 1], seen, dim**-0.5)


def test_kernel_refuses_a_query_that_sees_nothing_and_unsupported_dtypes():
    visible = torch.tensor([[True, False], [False, False]])
    with pytest.raises(TriedecError, match="at least one key"):
        key_lists(visible)
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    with pytest.raises(TriedecError, match="runs"):
        tree_attention(q, q, q, None, 0.5)


# ---- whole models -------------------------------------------------------------------------------


def _tied_llama():
    model = tiny_llama(seed=5)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _in_mode(model, dtype=None, weights="float"):
    """``model`` in a precision mode (:mod:`triedec.model.precision`)."""
    precision = Precision.of(dtype, weights)
    if precision.quantized:
        quantize(model, precision)
    return model.to(precision.dtype) if not precision.quantized else model


MODELS = {
    "llama-gqa-untied": lambda: tiny_llama(seed=2),
    "llama-tied": _tied_llama,
    "gemma3-sliding-windows-tied": lambda: tiny_gemma3(seed=3, window=4),
    "llama-bfloat16": lambda: _in_mode(tiny_llama(seed=2), "bfloat16"),
    "llama-tied-int8": lambda: _in_mode(_tied_llama(), weights="int8"),
    "gemma3-sliding-windows-int4": lambda: _in_mode(tiny_gemma3(seed=3, window=4), weights="int4"),
    # intermediate sizes no multiple of a vector: torch's silu leaves a call's last elements to its
    # scalar std::exp, so the activation is applied on padded whole rows (runner.activated, the
    # native forward's gated_rows); before, 24-30 of 30 seeds failed on these two
    "llama-odd-intermediate-native": lambda: tiny_llama(seed=2, intermediate=104),
    "llama-odd-intermediate-walk": lambda: tiny_llama(seed=2, intermediate=100),
    # the model's own forward (architectures the runner does not run): its MLP's act_fn is wrapped
    # (runner.RowActivation); before, 8-10 of 10 seeds failed
    "llama-odd-intermediate-transformers": lambda: tiny_llama(seed=2, intermediate=104),
}
RUNNER_OF = {"llama-odd-intermediate-transformers": TRANSFORMERS}
"""Models run on another runner than the default's."""


@pytest.fixture(scope="module")
def exact_adapters():
    return {name: ModelAdapter(make(), "auto", runner=RUNNER_OF.get(name)) for name, make in MODELS.items()}


class PlainDecoding:
    """Plain decoding's logits for any prefix: one token per forward, committed prefixes shared
    through a trie of cache clones."""

    def __init__(self, adapter: ModelAdapter, capacity: int = 96) -> None:
        self.adapter, self.capacity = adapter, capacity
        self.known: dict[tuple[int, ...], tuple[torch.Tensor, object]] = {}

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """Logits after the last token of ``prefix``."""
        return self._state(prefix)[0]

    def _state(self, prefix: tuple[int, ...]):
        if prefix not in self.known:
            shorter = prefix[:-1]
            cache = self._state(shorter)[1].clone() if shorter else self.adapter.new_cache(self.capacity)
            row = self.adapter.forward(cache, torch.tensor(prefix[-1:]), torch.tensor([len(prefix) - 1]),
                                       torch.ones((1, 1), dtype=torch.bool))[0]
            cache.commit([0])
            self.known[prefix] = (row, cache)
        return self.known[prefix]


def _chunked_prefill(adapter, cache, tokens, sizes, others):
    """Commit ``tokens`` into ``cache`` through causal chunks of ``sizes``, each forward also
    carrying ``others`` (other requests' chunks) before it. Returns the chunks' logits rows."""
    rows, at = [], 0
    for size in sizes:
        piece = torch.tensor(tokens[at : at + size])
        item = ForwardItem(cache, piece, torch.arange(at, at + size), torch.ones((size, size), dtype=torch.bool).tril())
        extra = [o() for o in others]
        rows += list(adapter.forward_batch([*extra, item])[-1])
        for e in extra:
            e.cache.commit([])
        cache.commit(list(range(size)))
        at += size
    return rows


def _other_request(adapter, gen: random.Random):
    """A factory of another request's forward item: a cache with a few committed tokens and a
    causal chunk of new ones."""
    committed = [gen.randrange(TINY_VOCAB) for _ in range(gen.randint(0, 9))]
    cache = adapter.new_cache(64)
    if committed:
        adapter.prefill(cache, torch.tensor(committed))
        cache.commit(list(range(len(committed))))
    size = gen.randint(1, 6)
    chunk = torch.tensor([gen.randrange(TINY_VOCAB) for _ in range(size)])
    return lambda: ForwardItem(cache, chunk, torch.arange(len(committed), len(committed) + size),
                               torch.ones((size, size), dtype=torch.bool).tril())


def _forest(parents: list[int], tokens: list[int]) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Draft nodes whose parent is an earlier node or the committed prefix (-1): each node's path
    of tokens from the prefix, and the visibility ``[n, n]`` (a node sees itself and its
    ancestors)."""
    n = len(parents)
    paths: list[tuple[int, ...]] = []
    visible = torch.zeros((n, n), dtype=torch.bool)
    for i, p in enumerate(parents):
        paths.append((*(paths[p] if p >= 0 else ()), tokens[i]))
        if p >= 0:
            visible[i] = visible[p]
        visible[i, i] = True
    return paths, visible


@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31))
def test_every_tree_node_gets_plain_decodings_logits(exact_adapters, name, seed):
    adapter = exact_adapters[name]
    assert adapter.exactness == BIT_EXACT, adapter.invariance.detail
    gen = random.Random(seed)
    plain = PlainDecoding(adapter)
    prefix = [gen.randrange(TINY_VOCAB) for _ in range(gen.randint(1, 20))]
    sizes, left = [], len(prefix)
    while left:
        sizes.append(gen.randint(1, left))
        left -= sizes[-1]
    others = [_other_request(adapter, gen) for _ in range(gen.randint(0, 2))]
    cache = adapter.new_cache(64)
    chunk_rows = _chunked_prefill(adapter, cache, prefix, sizes, others)
    for i, row in enumerate(chunk_rows):
        assert torch.equal(row, plain.logits(tuple(prefix[: i + 1]))), f"prompt chunk row {i}"
    # a random tree on top: node i's parent is an earlier node or the committed prefix (-1)
    nodes = gen.randint(1, 10)
    parents = [gen.randint(-1, i - 1) for i in range(nodes)]
    tokens = [gen.randrange(TINY_VOCAB) for _ in range(nodes)]
    paths, visible = _forest(parents, tokens)
    positions = torch.tensor([len(prefix) + len(p) - 1 for p in paths])
    mine = ForwardItem(cache, torch.tensor(tokens), positions, visible)
    items = [o() for o in others] + [_other_request(adapter, gen)() for _ in range(gen.randint(0, 2))]
    place = gen.randint(0, len(items))
    items.insert(place, mine)
    rows = adapter.forward_batch(items)[place]
    for i in range(nodes):
        assert torch.equal(rows[i], plain.logits((*prefix, *paths[i]))), f"tree node {i} (depth {len(paths[i])})"


@pytest.mark.default_model
def test_default_model_tree_nodes_get_plain_decodings_logits(default_lm):
    adapter = default_lm.adapter
    assert adapter.exactness == BIT_EXACT, adapter.invariance.detail
    gen = random.Random(7)
    plain = PlainDecoding(adapter, capacity=64)
    prefix = default_lm.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    vocab = adapter.vocab_size
    cache = adapter.new_cache(64)
    other = _other_request(adapter, gen)
    rows = _chunked_prefill(adapter, cache, prefix, [5, len(prefix) - 5], [other])
    assert all(torch.equal(r, plain.logits(tuple(prefix[: i + 1]))) for i, r in enumerate(rows))
    parents, tokens = [-1, 0, 0, 1, -1, 4], [gen.randrange(vocab) for _ in range(6)]
    paths, visible = _forest(parents, tokens)
    positions = torch.tensor([len(prefix) + len(p) - 1 for p in paths])
    out = adapter.forward_batch([other(), ForwardItem(cache, torch.tensor(tokens), positions, visible)])[1]
    for i in range(6):
        assert torch.equal(out[i], plain.logits((*prefix, *paths[i]))), f"node {i}"


def test_self_test_says_bit_exact_on_triedecs_kernels_and_up_to_rounding_on_stock_ones(exact_adapters):
    for adapter in exact_adapters.values():
        assert adapter.invariance.exact and adapter.exactness == BIT_EXACT
        assert "fixed-order-attention" in adapter.kernels
    stock = ModelAdapter(tiny_llama(seed=2), "plain")  # MKL linears and torch's sdpa
    assert stock.exactness == UP_TO_ROUNDING and not stock.invariance.exact
    assert "differ" in stock.invariance.detail
    assert check_row_invariance(stock, length=6, seed=3).exact is False


def test_a_gpu_is_up_to_rounding_whatever_a_sample_of_shapes_shows():
    # an H100 in bfloat16 passed the self-test while auto returned other tokens than ar: no sample vouches there
    assert unvouched(torch.device("cpu")) is None
    for device in (torch.device("cuda"), torch.device("cuda", 1), torch.device("mps")):
        verdict = unvouched(device)
        assert verdict is not None and not verdict.exact and verdict.guarantee == UP_TO_ROUNDING
        assert device.type in verdict.detail


# ---- sampling at temperature 1.0, tokens equal ar's --------------------------------------------

SAMPLED_METHODS = [("pld", {"min_expected": 0.0}), ("ngram-trie", {"sized": False}), ("recycling", {"nodes": 40}),
                   ("lookahead", {}), ("auto", {})]


COST = fake_cost()


def _decoder(name, options):
    found = method(name)
    return found.build(found.make_options(options), tiny_info(cost=COST, profile=fake_profile(nodes=12)))


@pytest.mark.parametrize("name", ["llama-gqa-untied", "gemma3-sliding-windows-tied", "gemma3-sliding-windows-int4"])
def test_sampled_methods_return_ars_tokens_at_temperature_one(exact_adapters, name):
    """Hundreds of draws from unpeaked distributions (every token has mass), where a logit that
    moved by rounding would sooner or later move a draw across a CDF edge."""
    adapter = exact_adapters[name]
    rule = StopRule(40, frozenset([EOS]))
    ar = _decoder("ar", {})
    decoders = [(n, o, _decoder(n, o)) for n, o in SAMPLED_METHODS]
    draws = accepted = 0
    for i, prompt in enumerate(random_prompts(seed=11, count=10)):
        sampling = Sampling(temperature=1.0, seed=100 + i)
        truth, _ = alone(adapter, ar, prompt, rule, (), sampling)
        draws += len(truth)
        for n, o, decoder in decoders:
            got, outcome = alone(adapter, decoder, prompt, rule, (), sampling, cost=COST)
            assert got == truth, f"{n} {o}: prompt {i}"
            accepted += outcome.stats.new_tokens - outcome.stats.steps
    assert draws >= 200 and accepted > 0


def test_sampled_batch_under_a_small_verify_budget_returns_ars_tokens(exact_adapters):
    """Six sampled requests share each forward under a budget of 10 tokens: the allocator cuts the
    trees to other sizes from step to step, and every request still returns its solo ar tokens."""
    adapter = exact_adapters["llama-gqa-untied"]
    rule = StopRule(30, frozenset([EOS]))
    batch = random_prompts(seed=23, count=6)
    samplings = [Sampling(temperature=1.0, seed=s) for s in range(6)]
    ar = _decoder("ar", {})
    truth = [alone(adapter, ar, p, rule, (), s)[0] for p, s in zip(batch, samplings, strict=True)]
    for name, options in SAMPLED_METHODS:
        decoder = _decoder(name, options)
        runs = [decoder.start(p, rule, (), s) for p, s in zip(batch, samplings, strict=True)]
        outs, _ = together(adapter, runs, cost=COST, limits=BatchLimits(max_tokens_per_forward=10),
                           arrivals=[0, 0, 1, 3, 3, 6])
        assert [t for t, _ in outs] == truth, name


def test_a_layer_the_kernel_cannot_run_falls_back_to_the_models_function_and_says_so():
    """Values of another head size than keys (latent attention) or attention sinks: the layer runs
    the model's own function, and the batch records that the forward was not fixed-order."""
    from types import SimpleNamespace

    from triedec.core.kvcache import KVCache
    from triedec.model.dispatch import ItemBatch

    visible = torch.ones((2, 2), dtype=torch.bool).tril()

    def item_with_values(dim: int) -> ForwardItem:
        cache = KVCache(8)
        item = ForwardItem(cache, torch.tensor([1, 2]), torch.tensor([0, 1]), visible)
        cache.stage(item.positions)
        cache.write(0, torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, dim))
        return item

    calls = []

    def base(module, query, keys, values, mask, **kwargs):
        calls.append(mask)
        return torch.zeros(1, query.shape[2], query.shape[1], values.shape[-1]), None

    module = SimpleNamespace(layer_idx=0)
    cases = [(item_with_values(4), {}, True), (item_with_values(8), {"s_aux": torch.zeros(2)}, True),
             (item_with_values(8), {}, False)]
    for item, kwargs, fallback in cases:
        before = len(calls)
        batch = ItemBatch([item], [{"full_attention": visible}], ("full_attention",), True, torch.float32,
                       torch.device("cpu"))
        out, _ = batch.attend(module, torch.randn(1, 2, 2, 8), base, kwargs)
        assert batch.fell_back is fallback and len(calls) == before + fallback
        assert out.shape == (1, 2, 2, item.cache.view(0)[1].shape[-1])
        if fallback:
            assert calls[-1].shape == (1, 1, 2, 2)  # an additive mask, as the models' functions take
