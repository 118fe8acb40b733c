"""The prefix trie (docs/serving.md: the prefix trie): KV kept across requests, a hit bit-identical
to a miss. The trie alone on made-up caches (sharing, splitting, eviction under the cap, scopes),
then on the tiny model: every method, greedy and sampled, every request's tokens and logprobs
the same bits with the trie as without, over random conversations with random cancels mid-prefill
and mid-decode, several requests at once; a cached continuation drafted; other scopes never hit."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triedec.api.generation import GenerationRequest
from triedec.core.kvcache import KVCache
from triedec.core.prefixtrie import PrefixTrie
from triedec.engine.batch import Batch

LAYERS, HEADS, DIM = 2, 2, 4
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # float32 K and V a token


def _cache(tokens: list[int], capacity: int = 64) -> KVCache:
    """A cache whose slot i holds rows made from (i, tokens[: i + 1]): a function of the prefix,
    as a model's K/V are."""
    cache = KVCache(capacity)
    cache.allocate(LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"))
    for i in range(len(tokens)):
        value = float(hash(tuple(tokens[: i + 1])) % 10_007)
        for layer in range(LAYERS):
            cache.keys[layer][0, :, i] = value + layer
            cache.values[layer][0, :, i] = -value - layer
        cache._positions[i] = i
    cache.length = len(tokens)
    return cache


def _same_rows(a: KVCache, b: KVCache, n: int) -> bool:
    return all(torch.equal(x[:, :, :n], y[:, :, :n]) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values),
                                                                       strict=True)) \
        and torch.equal(a._positions[:n], b._positions[:n])


def test_a_prefix_is_restored_as_it_was_computed_and_shared_where_sequences_agree():
    trie = PrefixTrie(1 << 20)
    first, second = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]
    assert trie.insert("s", first, _cache(first)) == 6
    assert trie.insert("s", second, _cache(second)) == 2  # 1, 2, 3 shared: the node split after them
    assert trie.insert("s", first, _cache(first)) == 0
    assert trie.stats.tokens == 8 and trie.stats.bytes == 8 * PER_TOKEN
    for tokens, most, want in [([1, 2, 3, 4, 5, 6, 7], 99, 6), ([1, 2, 3, 9, 9, 1], 4, 4), ([1, 2, 7], 99, 2),
                               ([8, 1], 99, 0)]:
        cache = KVCache(64)
        assert trie.restore("s", tokens, most, cache) == (want, [])
        assert cache.length == want
        if want:
            assert _same_rows(cache, _cache(tokens[:want]), want)
    assert trie.restore("another scope", first, 99, KVCache(64)) == (0, [])
    assert trie.continuation("s", [1, 2, 3, 4]) == [5, 6]
    assert trie.continuation("s", [1, 2, 3, 9, 9]) == []
    stats = trie.stats
    assert (stats.lookups, stats.hits, stats.cached_tokens) == (5, 3, 12)


def test_the_least_recently_used_leaves_go_first_and_the_cap_is_never_passed():
    trie = PrefixTrie(10 * PER_TOKEN)
    trie.insert("s", [1, 2, 3, 4], _cache([1, 2, 3, 4]))
    trie.insert("s", [5, 6, 7, 8], _cache([5, 6, 7, 8]))
    trie.restore("s", [1, 2, 3, 4], 4, KVCache(8))  # [1..4] is now the more recently used
    trie.insert("s", [9, 9, 9, 9], _cache([9, 9, 9, 9]))  # room for it: [5..8] goes
    assert trie.stats.bytes <= 10 * PER_TOKEN and trie.stats.evictions == 1
    assert trie.restore("s", [5, 6, 7, 8], 4, KVCache(8))[0] == 0
    assert trie.restore("s", [1, 2, 3, 4], 4, KVCache(8))[0] == 4
    assert trie.insert("s", list(range(20, 40)), _cache(list(range(20, 40)))) == 0  # larger than the cap: not kept
    rng = random.Random(0)
    for _ in range(50):  # a flood of distinct sequences
        tokens = [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
        trie.insert(rng.choice("abc"), tokens, _cache(tokens))
        assert trie.stats.bytes <= 10 * PER_TOKEN


def _decode(lm, requests, prefix=None, cancel=None, arrivals=None):
    """The requests in one batch (request i submitted before step ``arrivals[i]``, cancelled
    before step ``cancel[i]``): each one's (tokens, logprobs, cached tokens), None if cancelled."""
    batch = Batch(lm.adapter, lm.cost_model(), lm.limits, prefix=prefix)
    runs = [lm.start(r) for r in requests]
    arrivals = arrivals or [0] * len(runs)
    cancel = cancel or {}
    out: list[list] = [[[], []] for _ in runs]
    step = 0
    while step <= max(arrivals) or not batch.idle:
        for i, run in enumerate(runs):
            if arrivals[i] == step:
                batch.submit(run, request_id=f"r{i}")
            if cancel.get(i) == step:
                batch.cancel(f"r{i}")
        batch.step()
        for i, run in enumerate(runs):
            out[i][0] += run.take()
            out[i][1] += run.take_logprobs()
        step += 1
    batch.close()
    return [None if i in cancel else (t, lp, runs[i].outcome.stats.cached_tokens)
            for i, (t, lp) in enumerate(out)]


TURNS = ["Tell me a story about the sea.", "And the ships?", "one two three four five six seven eight",
         "def f(x):\n    return x", "Summarize it in one sentence, please."]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), method=st.sampled_from(["ar", "pld", "ngram-trie", "recycling", "lookahead",
                                                           "auto"]),
       sampled=st.booleans())
def test_a_hit_is_the_bits_of_a_miss_over_random_conversations_with_cancels(lm, seed, method, sampled):
    """Random conversations (each turn the earlier turns, the answers and a new question; some
    asked twice, some beside each other), decoded in batches that carry the trie from one to the
    next, with random cancels mid-prefill and mid-decode: every request that finished returns the
    tokens and logprobs (same floats) it returns with no trie, and the later turns hit (but with
    recycling, which observes every prompt row's logits: it takes no prompt KV from anyone)."""
    rng = random.Random(seed)
    options = {"max_new_tokens": rng.choice([6, 12]), "temperature": 0.8 if sampled else 0.0, "logprobs": 2}
    trie = PrefixTrie(8 << 20)
    history = [rng.choice(TURNS) * rng.randrange(1, 4)]
    hits = 0
    for _ in range(2):
        prompts = [history[-1], history[-1] + " " + rng.choice(TURNS), history[-1]]
        requests = [GenerationRequest.of(p, method, seed=rng.randrange(1000), **options) for p in prompts]
        cancel = {1: rng.choice([0, 1, 2])} if rng.random() < 0.5 else {}
        arrivals = [0, rng.randrange(3), rng.randrange(3)]
        want = _decode(lm, requests, None, cancel, arrivals)
        got = _decode(lm, requests, trie, cancel, arrivals)
        for w, g in zip(want, got, strict=True):
            if w is not None:
                assert g is not None and g[0] == w[0] and g[1] == w[1]
                hits += g[2] > 0
        answer = lm.decode_result(want[0][0])
        history.append(f"{history[-1]} {answer} {rng.choice(TURNS)}")
    assert (hits > 0 and trie.stats.hits > 0) is (method != "recycling")


@pytest.mark.parametrize("mode", ["int4-a8", "int8", "int4", "bfloat16"])
def test_a_hit_is_the_bits_of_a_miss_in_the_other_precision_modes(tiny_model_dir, mode):
    import triedec

    lm = triedec.load(tiny_model_dir, **({"dtype": mode} if mode == "bfloat16" else {"weights": mode}))
    if lm.adapter.exactness != "bit-exact":
        pytest.skip(f"{mode} is not bit-exact here: no trie")
    prompt = "Tell me a story about the sea and the ships and the city. " * 4
    requests = [GenerationRequest.of(prompt + q, "auto", max_new_tokens=10, logprobs=3) for q in ("A?", "B?", "A?")]
    trie = PrefixTrie(8 << 20)
    want = _decode(lm, requests)
    got = [_decode(lm, [r], trie)[0] for r in requests]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert got[0][2] == 0 and got[1][2] > 0 and got[2][2] > 0


def test_a_request_asked_again_drafts_what_was_answered(lm):
    """The same prompt again: its whole answer is in the trie past the prompt, and a method that
    drafts from documents (ngram-trie) gets it as one, so the second ask takes fewer steps than
    it does without the trie; the tokens are the same."""
    request = GenerationRequest.of("Tell me a story about the sea and the city.", "ngram-trie", max_new_tokens=24)

    def second_ask(trie):
        _decode(lm, [request], trie)
        batch = Batch(lm.adapter, lm.cost_model(), lm.limits, prefix=trie)
        run = lm.start(request)
        batch.submit(run)
        while not batch.idle:
            batch.step()
        return run.generated, run.outcome.stats

    with_trie, without = second_ask(PrefixTrie(8 << 20)), second_ask(None)
    assert with_trie[0] == without[0]
    assert with_trie[1].cached_tokens > 0 and with_trie[1].steps < without[1].steps


def test_a_scoring_request_takes_rows_only_with_the_scores_it_asks_for(lm):
    """A request that scores its prompt (``prompt_logprobs``, lm-eval's answer choices) takes rows
    from the trie only where an earlier request left scores of the same kind beside them, up to one
    token before its prompt leaves theirs: a question's context is then computed once for all its
    choices, and every choice's scores are the bits they are without the trie."""
    trie = PrefixTrie(8 << 20)
    context = "Question: which of these is the sea and which the city? Answer:"
    plain = _decode(lm, [GenerationRequest.of(context + " the sea", "ar", max_new_tokens=1)], trie)[0]
    assert plain[2] == 0
    choices = [context + answer for answer in (" the sea", " the city", " both of them")]
    requests = [GenerationRequest.of(c, "ar", max_new_tokens=1, logprobs=2, prompt_logprobs=True) for c in choices]
    want = [_decode(lm, [r])[0] for r in requests]
    got = [_decode(lm, [r], trie)[0] for r in requests]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert got[0][2] == 0  # the plain request left rows but no scores
    context_tokens = len(lm.encode(context))
    assert all(context_tokens - 2 <= g[2] < len(lm.encode(c)) for g, c in zip(got[1:], choices[1:], strict=True))
    other_kind = GenerationRequest.of(choices[1], "ar", max_new_tokens=1, logprobs=5, prompt_logprobs=True)
    assert _decode(lm, [other_kind], trie)[0][2] == 0  # scores of another kind: no rows


def test_other_scopes_never_hit(lm):
    trie = PrefixTrie(8 << 20)
    prompt = "Tell me a story about the sea and the city."
    _decode(lm, [GenerationRequest.of(prompt, "ar", max_new_tokens=4)], trie)
    run = lm.start(GenerationRequest.of(prompt, "ar", max_new_tokens=4))
    run.cache_scope = ("bob", None)
    batch = Batch(lm.adapter, lm.cost_model(), lm.limits, prefix=trie)
    batch.submit(run)
    while not batch.idle:
        batch.step()
    assert run.outcome.stats.cached_tokens == 0


def test_a_list_of_prompts_that_share_a_context_computes_it_once(lm, monkeypatch):
    """One question's answer choices in one batch, each scored (what lm-eval sends as a list): the
    first computes the context, the others copy its rows and scores and compute only their own
    tokens; every choice's scores are the bits they are alone."""
    context = "Question: which of these is the sea and which the city, and why would anyone ask? Answer:"
    choices = [context + answer for answer in (" the sea", " the city", " both of them", " neither")]
    requests = [GenerationRequest.of(c, "ar", max_new_tokens=1, logprobs=2, prompt_logprobs=True) for c in choices]
    alone = [_decode(lm, [r])[0] for r in requests]
    rows = []
    forward = lm.adapter.forward_batch

    def counting(items):
        rows.append(sum(i.size for i in items))
        return forward(items)

    monkeypatch.setattr(lm.adapter, "forward_batch", counting)
    together = _decode(lm, requests)
    assert [t[:2] for t in together] == [a[:2] for a in alone]
    prompts = [len(lm.encode(c)) for c in choices]
    shared = len(lm.encode(context)) - 2
    assert sum(rows) <= sum(prompts) - 3 * shared + 4  # the context once, then each choice's own tokens
