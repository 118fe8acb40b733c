"""Lookahead decoding's pure parts: the lookahead branch as a tree, the n-gram pool, the Jacobi
update, trie vs independent verification (trie never computes more), options."""

from __future__ import annotations

import pytest
import torch
from helpers import path_to
from hypothesis import given, settings
from hypothesis import strategies as st

from triedec.core.accept import Acceptance
from triedec.core.errors import TriedecError
from triedec.drafters import ModelInfo, method_spec
from triedec.drafters.base import Verified
from triedec.drafters.lookahead import LookaheadDrafter, LookaheadOptions, NgramPool, verification_branch

INFO = ModelInfo(50, torch.device("cpu"))


def test_lookahead_branch_is_a_tree_with_positions_of_the_jacobi_window():
    d = LookaheadDrafter(LookaheadOptions(window=3, ngram=4), INFO).begin([5, 6, 7, 8])
    d.window = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]  # [level][column]
    draft = d.propose([1, 2, 9])
    tree = draft.tree
    assert draft.required == tree.size  # a fixed structure: verified whole
    assert tree.size == 1 + 3 * 3  # root + W * (N - 1), nothing in the pool yet
    depth = {tok: tree.depths[i] for i, tok in enumerate(tree.tokens)}
    for level, row in enumerate(d.window):
        for col, tok in enumerate(row):
            assert depth[tok] == col + 1 + level  # level j, column c guesses position +c+j
    # column 2's top sees the root, level-0 columns 0..2 and its own levels 1..2, nothing else
    top = tree.tokens.index(32)
    assert [tree.tokens[i] for i in path_to(tree, top)] == [9, 10, 11, 12, 22, 32]
    assert [tree.tokens[i] for i in d._tops] == [30, 31, 32]


def test_jacobi_update_fills_the_pool_and_shifts_the_window():
    d = LookaheadDrafter(LookaheadOptions(window=2, ngram=3, guesses=2), INFO).begin([5, 6])
    d.window = [[10, 11], [20, 21]]
    tree = d.propose([9]).tree
    logits = torch.zeros(tree.size, 50)
    logits[d._tops[0], 40] = 1.0  # the model's next guess for column 0 ...
    logits[d._tops[1], 41] = 1.0  # ... and column 1
    d.observe(Verified(tree, logits, Acceptance((0,), (0,))))
    assert d.pool.candidates(10) == [(20, 40)] and d.pool.candidates(11) == [(21, 41)]
    assert d.window == [[20, 21], [40, 41]]
    draft = d.propose([10])  # the root 10 now has a verified candidate
    assert draft.size == 1 + 4 + 2
    cut = Verified(draft.tree.truncated(3), logits[:3], Acceptance((0,), (0,)), (0, 1, 2), draft.size)
    d.observe(cut)  # a cut tree (near max_new_tokens) teaches nothing
    assert d.window == [[20, 21], [40, 41]]


def test_pool_keeps_the_most_recent_g_per_key():
    pool = NgramPool(2)
    for gram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [2, 2, 2]):
        pool.add(gram)
    assert pool.candidates(1) == [(6, 7), (2, 3)] and len(pool) == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=8), st.integers(1, 40),
       st.integers(1, 6))
def test_trie_verification_never_computes_more_than_independent(candidates, budget, depth):
    ind_tokens, _ = verification_branch(candidates, "independent", budget, depth)
    trie_tokens, trie_parents = verification_branch(candidates, "trie", budget, depth)
    assert len(ind_tokens) == sum(len(c) for c in candidates)
    assert len(trie_tokens) <= min(len(ind_tokens), budget)
    assert all(p < i + 1 for i, p in enumerate(trie_parents))  # parents precede children


def test_trie_merges_shared_prefixes():
    cands = [(1, 2, 3), (1, 2, 4), (1, 5, 6)]
    assert len(verification_branch(cands, "independent", 99, 9)[0]) == 9
    assert len(verification_branch(cands, "trie", 99, 9)[0]) == 6  # 1, 2, 3, 4, 5, 6
    assert len(verification_branch(cands, "trie", 4, 9)[0]) == 4
    assert len(verification_branch(cands, "trie", 99, 1)[0]) == 1


@pytest.mark.parametrize(
    "bad", [{"window": 1}, {"ngram": 1}, {"guesses": 0}, {"budget": 0}, {"verify": "both"}, {"depth": -1},
            {"window": 2.0}, {"window_seed": "x"}, {"size": 3}]
)
def test_bad_options_are_refused(bad):
    with pytest.raises(TriedecError):
        method_spec("lookahead").make_options(bad)
