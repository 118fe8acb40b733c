"""The N-Gram Trie drafter's pure parts: trie construction against a direct transcription of the
paper's Algorithm 1 (hand-made lists and hypothesis), back-off matching, heap selection, sizing,
options."""

from __future__ import annotations

import pytest
import torch
from helpers import fake_cost, sized, verified_part
from hypothesis import given, settings
from hypothesis import strategies as st

from triedec.core.accept import Acceptance
from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError
from triedec.drafters import ModelInfo, method_spec
from triedec.drafters.ngram_trie import NgramTrieDrafter, NgramTrieOptions
from triedec.drafters.trie import NgramTrie


def algorithm_1(tokens: list[int], n: int, lp: int) -> dict[tuple[int, ...], int]:
    """The paper's construction, literally: windows T[i:i+n] (shorter at the end), prefix P =
    window[:Lp], suffix S = window[Lp:], keys P[j:] + S for j in 0..Lp-1, +1 per node per key."""
    freq: dict[tuple[int, ...], int] = {}
    for i in range(len(tokens)):
        window = tokens[i : i + n]
        prefix, suffix = window[:lp], window[lp:]
        for j in range(lp):
            key = prefix[j:] + suffix if j < len(prefix) else []
            for d in range(1, len(key) + 1):
                freq[tuple(key[:d])] = freq.get(tuple(key[:d]), 0) + 1
    return freq


def as_paths(trie: NgramTrie) -> dict[tuple[int, ...], int]:
    out = {}
    for v in range(1, trie.size + 1):
        path, u = [], v
        while u:
            path.append(trie.token[u])
            u = trie.parent[u]
        out[tuple(reversed(path))] = trie.freq[v]
    return out


def test_hand_made_trie_with_sub_prefix_nodes_and_frequencies():
    # n = 3, Lp = 2 over [1, 2, 3]: windows [1,2,3] -> keys [1,2,3], [2,3]; [2,3] -> keys [2,3], [3];
    # [3] -> key [3]
    trie = NgramTrie(3, 2)
    trie.add([1, 2, 3])
    assert as_paths(trie) == {(1,): 1, (1, 2): 1, (1, 2, 3): 1, (2,): 2, (2, 3): 2, (3,): 2}


def test_hand_made_sentence():
    # "a b c a b d", n = 4, Lp = 2: "a b" occurs twice, with continuations "c a" and "d"
    a, b, c, d = 1, 2, 3, 4
    trie = NgramTrie(4, 2)
    trie.add([a, b, c, a, b, d])
    paths = as_paths(trie)
    assert paths == algorithm_1([a, b, c, a, b, d], 4, 2)
    # "a b" starts the keys of windows 0 and 3 and window 2's sub-prefix key "a b d"
    assert paths[(a, b)] == 3 and paths[(a, b, c)] == 1 and paths[(a, b, d)] == 2
    assert paths[(b, c)] == 2 and paths[(b, c, a)] == 2  # the sub-prefix "b" of window 0 and window 1's key


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(2, 7), st.data())
def test_streamed_construction_equals_algorithm_1(tokens, n, data):
    lp = data.draw(st.integers(1, n - 1))
    trie = NgramTrie(n, lp)
    cut = data.draw(st.integers(0, len(tokens)))
    stream = trie.add(tokens[:cut])
    trie.add(tokens[cut:], stream)  # continued in two pieces: same as one
    assert as_paths(trie) == algorithm_1(tokens, n, lp)
    assert trie.size <= n * len(tokens)  # memory linear in the context
    for v in range(1, trie.size + 1):  # a child's frequency never exceeds its parent's
        assert trie.parent[v] == 0 or trie.freq[v] <= trie.freq[trie.parent[v]]


def looped(n: int, lp: int, documents: list[list[int]]) -> tuple[NgramTrie, object]:
    """The trie built token by token (:meth:`NgramTrie.add`'s loop)."""
    trie = NgramTrie(n, lp)
    stream = None
    for doc in documents:
        stream = trie.add(doc)
    return trie, stream


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), max_size=90), min_size=1, max_size=3), st.integers(2, 13),
       st.lists(st.integers(0, 5), max_size=20), st.data())
def test_building_at_once_makes_the_token_loops_trie_node_for_node(documents, n, more, data):
    """:meth:`NgramTrie.build` (numpy, one pass over sorted keys) against the token loop: the same
    nodes with the same ids, parents, tokens, frequencies and children, the same open paths, and
    the same trie after more tokens are added to the stream; and the paper's frequencies."""
    lp = data.draw(st.integers(1, n - 1))
    expected, expected_stream = looped(n, lp, documents)
    trie = NgramTrie(n, lp)
    stream = trie.build(documents)
    assert (stream.length, stream.open) == (expected_stream.length, expected_stream.open)
    assert (trie.children, trie.freq, trie.parent, trie.token) == (
        expected.children, expected.freq, expected.parent, expected.token)
    trie.add(more, stream)
    expected.add(more, expected_stream)
    assert (trie.children, trie.freq, trie.parent, trie.token) == (
        expected.children, expected.freq, expected.parent, expected.token)
    long = [*documents[0], *range(100, 100 + 64)]
    direct = NgramTrie(n, lp)
    direct.build([long])
    assert as_paths(direct) == algorithm_1(long, n, lp) == as_paths(looped(n, lp, [long])[0])
    with pytest.raises(TriedecError):
        direct.build(documents)  # only an empty trie


def test_documents_do_not_share_windows():
    trie = NgramTrie(4, 1)
    trie.add([1, 2])
    trie.add([3, 4])
    assert trie.node([2, 3]) is None and trie.node([1, 2]) is not None


def test_match_backs_off_from_lp_to_one():
    trie = NgramTrie(5, 3)
    trie.add([7, 8, 9, 1, 2, 3, 4])
    assert trie.match([7, 8, 9]) == (trie.node([7, 8, 9]), 3)
    assert trie.match([5, 8, 9]) == (trie.node([8, 9]), 2)  # [5, 8, 9] is not a path
    assert trie.match([5, 6, 9]) == (trie.node([9]), 1)
    assert trie.match([4]) == (0, 0)  # a path, but nothing follows it
    assert trie.match([6]) == (0, 0)


def test_heap_keeps_the_most_frequent_nodes_as_a_closed_subtree():
    trie = NgramTrie(4, 1)
    for doc in ([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5, 6]):
        trie.add(doc)
    root = trie.node([1])
    top = trie.top(root, 3)
    assert [trie.token[v] for v in top] == [2, 3, 4]  # freqs 3, 2, then 1 (4 and 5 tie: 4 is older)
    assert all(trie.parent[v] == root or trie.parent[v] in top[:i] for i, v in enumerate(top))
    assert len(trie.top(root, 100)) == 5


def info(cost):
    return ModelInfo(50, torch.device("cpu"), "m", cost)


def test_drafter_proposes_the_matched_continuations_as_a_tree():
    drafter = NgramTrieDrafter(NgramTrieOptions(n=4, prefix=2, sized=False, num_draft=4), info(fake_cost()))
    d = drafter.begin([1, 2, 3, 9, 1, 2, 4, 9], documents=[[8, 8, 8]])
    draft = d.propose([5, 1, 2])
    tree = draft.tree
    assert tree.root == 2 and sorted(tree.tokens[1:]) == [3, 4, 9, 9]
    assert {tree.tokens[i] for i in range(1, tree.size) if tree.parents[i] == 0} == {3, 4}
    assert draft.required == draft.size  # sized=False: sent whole
    assert list(draft.chances[1:]) == sorted(draft.chances[1:], reverse=True)  # best first
    assert d.propose([5, 6, 7]).size == 1  # no match: nothing drafted
    assert d.propose([8, 8]).size > 1  # from the document
    assert d.propose([5, 1, 2], max_nodes=3).size == 3  # never more than the engine asks for


def test_sizing_drafts_only_what_the_cost_curve_pays_for():
    flat = CostModel({1: 0.1, 81: 0.1})
    steep = CostModel({1: 0.1, 2: 1.0, 81: 50.0})
    prompt = [1, 2, 3, 4] * 5
    for cost, expect_drafts in ((flat, True), (steep, False), (None, True)):  # None: size as for a flat curve
        d = NgramTrieDrafter(NgramTrieOptions(), info(cost)).begin(prompt)
        assert (sized(d.propose([*prompt, 1]), cost).size > 1) == expect_drafts
    assert method_spec("ngram-trie").needs(NgramTrieOptions()) == {"cost"}
    assert method_spec("ngram-trie").needs(NgramTrieOptions(sized=False)) == frozenset()


def test_agreement_rate_learns_per_match_length_and_is_probed_again():
    """rho falls when drafts are rejected (per matched suffix length, and per whether the last
    step accepted drafts), the sized drafter then stops drafting, and skipped steps move rho back
    toward the prior until it drafts again."""
    cost = CostModel({1: 0.1, 2: 0.15, 81: 0.3})
    shared = NgramTrieDrafter(NgramTrieOptions(prefix=2), info(cost))
    d = shared.begin([1, 2, 3] * 6)
    assert shared.rho(2) == shared.PRIOR_RHO
    logits = torch.zeros(64, 50)

    def step(context, acceptance):
        found = verified_part(d.propose(context), cost, logits, acceptance)
        d.observe(found)
        return found.tree

    failures = 0
    while step([1, 2, 3, 1, 2], Acceptance((0,), (7,))).size > 1:  # nothing accepted
        failures += 1
        assert failures < 20
    low = shared.rho(2)
    assert failures >= 2 and low < 0.5 and shared.rho(1) == shared.PRIOR_RHO  # only the length that failed
    skipped = 1
    while sized(draft := d.propose([1, 2, 3, 1, 2]), cost).size == 1:
        d.observe(verified_part(draft, cost, logits, Acceptance((0,), (7,))))  # not verified: relaxes
        skipped += 1
        assert skipped < 500
    assert skipped > 5 and shared.rho(2) > low  # probed again, after a while
    before = shared.rho(2)
    d.observe(verified_part(draft, None, logits, Acceptance((0, 1, 2), (3, 1, 5))))
    assert shared.rho(2) > before and shared.rho(2, hot=True) == shared.PRIOR_RHO  # 2 accepted, 1 rejected
    assert "rho_m2" in shared.stats()
    assert step([1, 2, 3, 1, 2, 3, 1], Acceptance((0,), (7,))).size > 1  # after a step that accepted drafts
    assert shared.rho(2, hot=True) < shared.PRIOR_RHO and "rho_m2_hot" in shared.stats()


def test_update_inserts_the_output():
    for update in (False, True):
        d = NgramTrieDrafter(NgramTrieOptions(n=4, prefix=1, sized=False, update=update), info(None)).begin([1, 2])
        d.propose([1, 2, 30, 31, 32])
        assert (d.trie.node([30, 31]) is not None) == update


@pytest.mark.parametrize(
    "bad", [{"n": 1}, {"n": 4, "prefix": 4}, {"prefix": 0}, {"num_draft": 0}, {"sized": "yes"}, {"update": 1},
            {"n": 2.5}, {"window": 3}]
)
def test_bad_options_are_refused(bad):
    with pytest.raises(TriedecError):
        method_spec("ngram-trie").make_options(bad)
