"""Property tests for the draft tree: the attention mask derived from it, positions, merging, ancestry."""

import itertools

import pytest
import torch
from helpers import leaves, path_to, root_paths
from hypothesis import given, settings
from hypothesis import strategies as st

from triedec.core.errors import TriedecError
from triedec.core.kvcache import KVCache
from triedec.core.tree import TokenTree
from triedec.model.dispatch import AttentionLayout, ForwardItem, additive_mask, item_visibility

sequences = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=6), min_size=0, max_size=8)


def prefixes(seqs):
    return {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}


def node_sequence(tree, i):
    return tuple(tree.tokens[j] for j in path_to(tree, i)[1:])


def staged(tree, cache_len):
    cache = KVCache(cache_len + tree.size)
    cache.length = cache_len
    cache._positions[:cache_len] = torch.arange(cache_len)
    cache.stage(tree.positions(cache_len)[0])
    return ForwardItem(cache, torch.tensor(tree.tokens), tree.positions(cache_len)[0], tree.ancestry)


@given(seqs=sequences, cache_len=st.integers(0, 7), window=st.one_of(st.none(), st.integers(1, 6)))
def test_mask_row_is_cache_plus_ancestors_plus_self_within_the_window(seqs, cache_len, window):
    tree = TokenTree.from_sequences(9, seqs)
    layout = AttentionLayout({"full_attention": window}, ("full_attention",), per_type=False)
    visible = item_visibility(staged(tree, cache_len), layout)["full_attention"]
    mask = additive_mask(visible, torch.float32, torch.device("cpu"))
    if mask is None:  # one query that sees its whole cache: no mask at all
        assert tree.size == 1 and (window is None or cache_len < window)
        return
    assert mask.shape == (1, 1, tree.size, cache_len + tree.size)
    blocked = torch.finfo(torch.float32).min
    for i in range(tree.size):
        row = mask[0, 0, i]
        position = cache_len + tree.depths[i]
        for j in range(cache_len):
            near = window is None or position - j < window
            assert row[j].item() == (0.0 if near else blocked)
        expected = set(path_to(tree, i))
        for j in range(tree.size):
            near = window is None or tree.depths[i] - tree.depths[j] < window
            assert row[cache_len + j].item() == (0.0 if j in expected and near else blocked)


@given(seqs=sequences, cache_len=st.integers(0, 100))
def test_positions_are_cache_length_plus_depth(seqs, cache_len):
    tree = TokenTree.from_sequences(1, seqs)
    pos = tree.positions(cache_len)
    assert pos.shape == (1, tree.size)
    for i in range(tree.size):
        assert pos[0, i].item() == cache_len + len(path_to(tree, i)) - 1 == cache_len + tree.depths[i]


@given(seqs=sequences)
def test_merging_never_duplicates_a_prefix(seqs):
    tree = TokenTree.from_sequences(0, seqs)
    node_seqs = [node_sequence(tree, i) for i in range(1, tree.size)]
    assert len(node_seqs) == len(set(node_seqs))  # every prefix once
    assert set(node_seqs) == prefixes(seqs)  # and exactly the prefixes of the inputs
    for children in tree.children:  # siblings never share a token
        assert len(children) == len(set(children))


@given(seqs=sequences)
def test_ancestry_rows_are_the_root_paths(seqs):
    tree = TokenTree.from_sequences(0, seqs)
    for i in range(tree.size):
        assert set(tree.ancestry[i].nonzero().flatten().tolist()) == set(path_to(tree, i))
    paths = root_paths(tree)
    ends = [p[-1] for p in paths]
    assert sorted(ends) == sorted(leaves(tree))
    assert len(ends) == len(set(ends))
    covered = {i for p in paths for i in p}
    assert covered == set(range(tree.size))
    for p in paths:
        assert p[0] == 0
        assert all(tree.parents[b] == a for a, b in itertools.pairwise(p))


@given(seqs=sequences, budget=st.integers(1, 12), depth=st.integers(0, 4))
@settings(max_examples=50)
def test_truncate_and_prune_keep_valid_subtrees(seqs, budget, depth):
    tree = TokenTree.from_sequences(0, seqs)
    small = tree.truncated(budget)
    assert small.size == min(budget, tree.size)
    assert small.tokens == tree.tokens[: small.size]
    pruned = tree.pruned(depth)
    assert pruned.max_depth <= depth
    assert {node_sequence(pruned, i) for i in range(pruned.size)} == {
        node_sequence(tree, i) for i in range(tree.size) if tree.depths[i] <= depth
    }


def test_from_sequences_hand_made():
    tree = TokenTree.from_sequences(7, [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]])
    assert tree.tokens == (7, 1, 2, 3, 4, 5)
    assert tree.parents == (-1, 0, 1, 2, 2, 0)
    assert tree.depths == (0, 1, 2, 3, 3, 1)
    assert root_paths(tree) == [(0, 1, 2, 3), (0, 1, 2, 4), (0, 5)]


def test_max_nodes_limits_the_merge():
    tree = TokenTree.from_sequences(7, [[1, 2, 3], [4, 5]], max_nodes=5)
    assert tree.tokens == (7, 1, 2, 3, 4)


@pytest.mark.parametrize(
    "tokens,parents",
    [((), ()), ((1, 2), (-1,)), ((1, 2), (0, 0)), ((1, 2, 3), (-1, 2, 0)), ((1, -2), (-1, 0))],
)
def test_invalid_trees_are_refused(tokens, parents):
    with pytest.raises(TriedecError):
        TokenTree(tokens, parents)
