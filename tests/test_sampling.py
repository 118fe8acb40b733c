"""The sampling core without a model: parameters, processing against transformers' own processors,
position-keyed uniforms, inverse-CDF draws, and the acceptance rule on hand-made distributions."""

from __future__ import annotations

import math
import random

import pytest
import torch
from helpers import chi_square_same
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from triedec.core.accept import GreedyRule, SamplingRule, acceptance_rule, walk
from triedec.core.errors import TriedecError
from triedec.core.sampling import DRAW_BLOCK, Sampling, draw, process, seen_tokens, uniform
from triedec.core.tree import TokenTree

# ---- parameters --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": "hot"},
    {"temperature": True}, {"top_k": -1}, {"top_k": 2.5}, {"top_k": True}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_p": -0.2}, {"top_p": None}, {"min_p": -0.01}, {"min_p": 1.01}, {"repetition_penalty": 0.0},
    {"repetition_penalty": -1.0}, {"seed": -1}, {"seed": 2**64}, {"seed": 1.5}, {"seed": "7"}, {"seed": False},
])
def test_bad_sampling_values_get_a_clear_error(bad):
    name = next(iter(bad))
    with pytest.raises(TriedecError, match=name):
        Sampling(**bad)


def test_defaults_are_greedy_and_temperature_zero_is_greedy():
    assert Sampling().greedy and Sampling().plain
    assert Sampling(temperature=0, top_p=0.5, seed=3).greedy
    assert not Sampling(repetition_penalty=1.2).plain
    assert not Sampling(temperature=0.7, seed=1).greedy
    assert isinstance(acceptance_rule(Sampling()), GreedyRule)
    assert isinstance(acceptance_rule(Sampling(temperature=0.5, seed=9)), SamplingRule)
    with pytest.raises(TriedecError, match="seed"):
        acceptance_rule(Sampling(temperature=0.5))


# ---- processing equals transformers' processors -----------------------------------------------

SETTINGS = [
    Sampling(temperature=1.0), Sampling(temperature=0.7), Sampling(temperature=0.7, top_k=5),
    Sampling(temperature=0.9, top_p=0.8), Sampling(temperature=1.3, min_p=0.1),
    Sampling(temperature=0.5, repetition_penalty=1.3), Sampling(temperature=0.6, repetition_penalty=0.8),
    Sampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
]


def transformers_processed(logits: torch.Tensor, prefix: list[int], s: Sampling) -> torch.Tensor:
    """The same row through transformers' own processors, in generate's order."""
    ids, scores = torch.tensor([prefix]), logits[None].clone()
    steps = []
    if s.repetition_penalty != 1.0:
        steps.append(RepetitionPenaltyLogitsProcessor(float(s.repetition_penalty)))
    if s.temperature != 1.0:
        steps.append(TemperatureLogitsWarper(float(s.temperature)))
    if s.top_k:
        steps.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        steps.append(TopPLogitsWarper(s.top_p))
    if s.min_p:
        steps.append(MinPLogitsWarper(s.min_p))
    for step in steps:
        scores = step(ids, scores)
    return scores[0]


@pytest.mark.parametrize("index", range(len(SETTINGS)))
def test_process_equals_transformers_processors(index):
    s = SETTINGS[index]
    g = torch.Generator().manual_seed(index)
    for trial in range(20):
        logits = torch.randn(300, generator=g) * (1 + trial % 4)
        prefix = torch.randint(0, 300, (1 + trial * 3,), generator=g).tolist()
        ours = process(logits, seen_tokens(prefix), s)
        theirs = transformers_processed(logits, prefix, s)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), f"filtered tokens differ (trial {trial})"
        kept = ~torch.isinf(ours)
        torch.testing.assert_close(ours[kept], theirs[kept])


def test_repetition_penalty_sees_each_token_once():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = process(logits, seen_tokens([0, 0, 1], [0]), Sampling(temperature=1.0, repetition_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]


# ---- uniforms and draws ------------------------------------------------------------------------


def test_uniform_depends_only_on_seed_and_position():
    values = [uniform(7, i) for i in range(2000)]
    assert values == [uniform(7, i) for i in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert values != [uniform(8, i) for i in range(2000)]
    assert len(set(values)) == len(values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02
    assert uniform(2**64 - 1, 10**9) == uniform(2**64 - 1, 10**9)
    # equal-width bins are equally full (chi-square against a fair histogram)
    bins = [int(v * 10) for v in values]
    assert chi_square_same(bins, list(range(10)) * 200)[1] > 0.001


def test_draw_is_the_inverse_cdf_in_token_order():
    logits = torch.tensor([0.1, 0.0, 0.6, 0.3]).log()  # token 1 has probability 0
    cases = {0.0: 0, 0.05: 0, 0.0999: 0, 0.1001: 2, 0.5: 2, 0.6999: 2, 0.7001: 3, 0.999999: 3}
    for u, token in cases.items():
        assert draw(logits, u) == token, u
    assert draw(torch.tensor([-math.inf, 1.0, -math.inf]), 0.9999999999999999) == 1


@given(st.integers(1, 700), st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 2**31), st.floats(0.0, 0.9))
@settings(max_examples=300, deadline=None)
def test_a_draw_is_the_float64_inverse_cdf_but_where_rounding_decides(vocab, u, seed, excluded):
    """The block-wise draw against the inverse CDF of one float64 cumulative sum over the row: the
    same token, unless the target lies within rounding of a boundary between two tokens; never a
    token without mass; rows of any length (blocks of 256, the last one short)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * 4
    logits[torch.rand(vocab, generator=gen) < excluded] = -math.inf
    if not torch.isfinite(logits).any():
        logits[vocab // 2] = 0.0
    token = draw(logits, u)
    assert math.isfinite(float(logits[token]))
    weights = torch.exp(logits.double() - logits.double().max())
    cdf = torch.cumsum(weights, 0)
    target = u * float(cdf[-1])
    reference = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
    if reference != token:
        boundary = float(cdf[min(token, reference)])
        assert abs(boundary - target) <= 1e-6 * float(cdf[-1]), (token, reference)


@given(st.sampled_from([256, 512, 4096, 49152, 300, 49153]), st.integers(0, 2**31), st.floats(0.5, 8.0))
@settings(max_examples=40, deadline=None)
def test_a_draw_from_whole_blocks_skips_the_padded_copy_and_draws_the_same_token(vocab, seed, spread):
    """A row of whole 256-token blocks is summed in place, without the padded copy: the same token
    as the padded form draws (the same row with one excluded token appended, which takes that
    path: a block of zeros after the same sums), for many uniforms, targets at block ends too."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * spread
    us = [float(v) for v in torch.rand(64, generator=gen, dtype=torch.float64)]
    weights = torch.exp(logits.double() - logits.double().max())
    ends = torch.cumsum(weights.reshape(-1)[: vocab // DRAW_BLOCK * DRAW_BLOCK].reshape(-1, DRAW_BLOCK).sum(1), 0)
    us += [min(float(e / weights.sum()), 1 - 2**-53) for e in ends[:8]]  # right at a block's end
    padded = torch.cat([logits, torch.tensor([-math.inf])])
    for u in us:
        assert draw(logits, u) == draw(padded, u), u


def test_draws_follow_the_distribution():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    got = [draw(p.log(), uniform(11, i)) for i in range(4000)]
    rng = random.Random(0)
    want = rng.choices(range(4), weights=p.tolist(), k=4000)
    assert chi_square_same(got, want)[1] > 0.001


# ---- the acceptance rule on hand-made distributions ----------------------------------------------


def fixed_logits(tree: TokenTree, by_prefix: dict[tuple[int, ...], list[float]], vocab: int) -> torch.Tensor:
    """Logits ``[T, V]`` for each node from its path's tokens (a model that depends on the prefix)."""
    rows = []
    for i in range(tree.size):
        path, node = [], i
        while node > 0:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        probs = by_prefix.get(tuple(reversed(path)), [1.0] * vocab)
        rows.append(torch.tensor(probs, dtype=torch.float32).log())
    return torch.stack(rows)


def test_emitted_tokens_follow_p_for_trees_with_siblings():
    """Root distribution p over 5 tokens; the tree drafts tokens 1 and 3 under the root (siblings)
    and 0, 4 under token 1. Over 3,000 seeds, the first emitted token follows p, and the second
    (after an accepted 1) follows p(. | 1), whatever the drafts."""
    vocab = 5
    p_root = [0.1, 0.4, 0.05, 0.3, 0.15]
    p_after_1 = [0.5, 0.1, 0.1, 0.1, 0.2]
    tree = TokenTree.from_sequences(9, [[1, 0], [3], [1, 4]])
    logits = fixed_logits(tree, {(): p_root, (1,): p_after_1}, vocab)
    rule_samples = [SamplingRule(Sampling(temperature=1.0), seed).accept(tree, logits, [9], 0) for seed in range(3000)]
    first = [a.tokens[0] for a in rule_samples]
    rng = random.Random(1)
    assert chi_square_same(first, rng.choices(range(vocab), weights=p_root, k=3000))[1] > 0.001
    second = [a.tokens[1] for a in rule_samples if a.tokens[0] == 1]
    assert len(second) > 1000
    assert chi_square_same(second, rng.choices(range(vocab), weights=p_after_1, k=len(second)))[1] > 0.001
    # accepted drafts are exactly the drawn tokens that the tree holds
    for a in rule_samples:
        assert len(a.path) == len(a.tokens)
        assert [tree.tokens[i] for i in a.path[1:]] == list(a.tokens[:-1])
        assert a.tokens[0] in (1, 3) or len(a.path) == 1
    # the test has power: the wrong distribution is rejected
    assert chi_square_same(first, rng.choices(range(vocab), weights=p_after_1, k=3000))[1] < 1e-6


def test_repeated_sibling_tokens_follow_every_matching_branch():
    """Lookahead's independent branches repeat tokens among siblings; the walk follows each."""
    tree = TokenTree((9, 1, 1, 2), (-1, 0, 0, 2))
    logits = fixed_logits(tree, {(): [0.0, 1.0, 0.0], (1,): [0.0, 0.0, 1.0]}, 3)
    a = SamplingRule(Sampling(temperature=1.0), 0).accept(tree, logits, [9], 0)
    assert a.path == (0, 2, 3) and a.tokens[:2] == (1, 2)


def _fake_model(vocab: int, salt: int):
    """Deterministic logits as a function of the whole prefix (a stand-in for a causal LM)."""
    def logits(prefix: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((salt, prefix)) % 2**31)
        return torch.randn(vocab, generator=g) * 3

    return logits


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    salt=st.integers(0, 1000),
    drafts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), max_size=5),
    setting=st.sampled_from(SETTINGS),
    position=st.integers(0, 50),
)
def test_tree_acceptance_is_a_prefix_of_sequential_sampling(seed, salt, drafts, setting, position):
    """For any tree, the tokens a step emits are exactly the next tokens that plain (one token per
    step) sampling with the same seed emits: same distribution per prefix, same uniform per
    position. Drafts partly copy that true continuation so that deep accepts happen."""
    vocab, context = 6, [3, 1, 4]
    model = _fake_model(vocab, salt)
    truth: list[int] = []
    for i in range(8):  # sequential sampling: what ar does
        prefix = tuple(truth)
        row = process(model(prefix), seen_tokens(context, prefix), setting)
        truth.append(draw(row, uniform(seed, position + i)))
    sequences = [truth[: len(d)] if k % 2 else d for k, d in enumerate(drafts)]
    tree = TokenTree.from_sequences(context[-1], sequences)
    logits = torch.stack([model(tuple(tree.tokens[j] for j in _path(tree, i)[1:])) for i in range(tree.size)])
    got = SamplingRule(setting, seed).accept(tree, logits, context, position)
    assert list(got.tokens) == truth[: len(got.tokens)]
    greedy = acceptance_rule(Sampling(repetition_penalty=setting.repetition_penalty)).accept(tree, logits, context, 0)
    assert [tree.tokens[i] for i in greedy.path[1:]] == list(greedy.tokens[:-1])


def _path(tree: TokenTree, node: int) -> list[int]:
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return list(reversed(path))


def test_walk_asks_only_for_nodes_it_reaches():
    tree = TokenTree.from_sequences(0, [[1, 2, 3], [4, 5]])
    asked = []

    def choose(i):
        asked.append(i)
        return {0: 1, 1: 2, 2: 7}.get(i, 0)

    a = walk(tree, choose)
    assert a.tokens == (1, 2, 7) and a.path == (0, 1, 2)
    assert set(asked) == {0, 1, 2}
