"""Token Recycling without a model: the tree template, the adjacency matrix (update semantics,
cold rows, persistence), the profile's size choice and the drafter with its sessions."""

from __future__ import annotations

import pytest
import torch
from helpers import CPU, fake_cost, fake_profile, leaves, monotone_rates
from hypothesis import given, settings
from hypothesis import strategies as st

from triedec.core.accept import Acceptance
from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError
from triedec.core.tree import TokenTree
from triedec.drafters import ModelInfo, Verified, method_spec
from triedec.drafters.matrix import AdjacencyMatrix
from triedec.drafters.recycling import RecyclingDrafter, RecyclingOptions, _Plan, fill
from triedec.drafters.template import (
    PAPER_TEMPLATE,
    RecyclingProfile,
    TreeTemplate,
    best_nodes,
    expected_speeds,
)


def info(vocab: int = 50, nodes: int | None = None, model_id: str = "m1") -> ModelInfo:
    return ModelInfo(vocab, CPU, model_id, fake_cost(), {"recycling": fake_profile(nodes)})


def verified(tree: TokenTree, logits: torch.Tensor, path: tuple[int, ...] = (0,)) -> Verified:
    return Verified(tree, logits, Acceptance(path, (*(tree.tokens[i] for i in path[1:]), 0)))


# ---- the template ------------------------------------------------------------------------------


def test_paper_template_shape():
    t = PAPER_TEMPLATE
    assert t.size == 80 and t.depth == 6
    assert [stop - start for start, stop in t.layers] == [8, 21, 25, 15, 8, 3]
    tree = TokenTree(tuple(range(81)), (-1, *t.parents))
    assert len(leaves(tree)) == 40 and tree.max_depth == 6
    assert t.with_max_rank(8) == t
    assert all(max(p) < 2 for p in t.with_max_rank(2).paths)


def test_template_validation():
    with pytest.raises(TriedecError, match="twice"):
        TreeTemplate(((0,), (0,)))
    with pytest.raises(TriedecError, match="no parent"):
        TreeTemplate(((0,), (1, 0)))
    with pytest.raises(TriedecError, match="non-negative"):
        TreeTemplate(((-1,),))
    assert TreeTemplate(((0, 0), (0,))).paths == ((0,), (0, 0))  # kept breadth-first


def test_top_keeps_the_most_accepted_nodes_on_a_hand_made_example():
    t = TreeTemplate(((0,), (1,), (0, 0), (0, 1), (1, 0)))
    rates = [0.9, 0.3, 0.5, 0.1, 0.2]
    assert t.top(3, rates).paths == ((0,), (1,), (0, 0))
    assert t.top(2, rates).paths == ((0,), (0, 0))
    assert t.top(0, rates).paths == ()
    with pytest.raises(TriedecError):
        t.top(6, rates)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 80), st.lists(st.floats(0, 1), min_size=80, max_size=80))
def test_top_is_a_closed_subtree_of_the_requested_size(n, rates):
    kept = PAPER_TEMPLATE.top(n, rates)
    assert kept.size == n
    assert all(len(p) == 1 or p[:-1] in set(kept.paths) for p in kept.paths)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 80), st.integers(0, 10_000))
def test_top_equals_the_n_highest_rates_when_children_never_beat_parents(n, seed):
    rates = monotone_rates(seed)
    kept = set(PAPER_TEMPLATE.top(n, rates).paths)
    threshold = sorted(rates, reverse=True)[n - 1] if n else float("inf")
    assert all(r >= threshold for p, r in zip(PAPER_TEMPLATE.paths, rates, strict=True) if p in kept)


# ---- the adjacency matrix ----------------------------------------------------------------------


def test_update_writes_topk_rows_and_last_write_wins():
    m = AdjacencyMatrix(vocab_size=10, k=2, device=CPU)
    logits = torch.zeros(3, 10)
    logits[0, [7, 1]] = torch.tensor([5.0, 4.0])  # token 3 at position 0 -> (7, 1)
    logits[1, [2, 9]] = torch.tensor([3.0, 6.0])  # token 5 -> (9, 2)
    logits[2, [4, 8]] = torch.tensor([1.0, 2.0])  # token 3 again at position 2 -> (8, 4): wins
    m.update([3, 5, 3], logits)
    assert m.table[3].tolist() == [8, 4]
    assert m.table[5].tolist() == [9, 2]
    assert m.filled.nonzero().flatten().tolist() == [3, 5]
    assert m.table[0].tolist() == [0, 0] and m.filled_share() == pytest.approx(0.2)
    m.update([5], logits[:1])  # a later step overwrites the whole row
    assert m.table[5].tolist() == [7, 1]


def test_update_over_a_real_vocabulary_writes_torch_topk_and_marks_rows_written():
    m = AdjacencyMatrix(vocab_size=49152, k=8, device=CPU)
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0))
    m.update([11, 7, 11, 40000], logits)
    want = logits.topk(8, dim=-1).indices
    assert torch.equal(m.table[[7, 11, 40000]], want[[1, 2, 3]])
    assert m.filled.nonzero().flatten().tolist() == [7, 11, 40000]
    assert [token for token, _ in m.take_written()] == [7, 11, 40000]
    assert not m.written.any()


def test_expand_follows_ranks_and_marks_cold_rows():
    m = AdjacencyMatrix(vocab_size=10, k=2, device=CPU)
    m.table[4] = torch.tensor([6, 7])
    m.table[6] = torch.tensor([8, 9])
    m.filled[[4, 6]] = True
    t = TreeTemplate(((0,), (1,), (0, 0), (0, 1), (1, 0)))
    tokens, usable = fill(m, 4, t, _Plan.of(t, CPU))
    assert tokens[:5] == [4, 6, 7, 8, 9]
    assert usable == [True, True, True, True, True, False]  # (1, 0) hangs off token 7: a cold row


def test_fresh_drafter_proposes_nothing_and_grows_only_from_written_rows():
    d = RecyclingDrafter(RecyclingOptions(nodes=80), info(50)).begin([1, 2, 3])
    assert d.propose([1, 2, 3]).size == 1  # every row cold: root only, never token 0 drafts
    logits = torch.zeros(1, 50)
    logits[0, torch.arange(10, 18)] = torch.arange(8, 0, -1).float()  # row 3 -> 10..17
    d.observe(verified(TokenTree.root_only(3), logits))
    tree = d.propose([1, 2, 3]).tree
    assert tree.tokens == (3, *range(10, 18)) and tree.max_depth == 1  # rows 10..17 are cold


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 4, 16, 80]))
def test_every_proposed_node_comes_from_a_written_row(seed, nodes):
    g = torch.Generator().manual_seed(seed)
    d = RecyclingDrafter(RecyclingOptions(nodes=nodes), info(30))
    d.matrix.table = torch.randint(30, (30, 8), generator=g)
    d.matrix.filled = torch.rand(30, generator=g) < 0.6
    root = int(torch.randint(30, (1,), generator=g))
    draft = d.begin([root]).propose([root])
    tree = draft.tree
    assert draft.required == tree.size  # nodes=N: sent whole
    table, filled = d.matrix.table, d.matrix.filled
    for i in range(1, tree.size):
        parent_token = tree.tokens[tree.parents[i]]
        assert filled[parent_token]
        assert tree.tokens[i] in table[parent_token].tolist()
    assert tree.size - 1 <= nodes


def test_drafter_counts_proposed_and_accepted_template_nodes():
    d = RecyclingDrafter(RecyclingOptions(nodes=80), info(50))
    s = d.begin([3])
    logits = torch.zeros(1, 50)
    logits[0, torch.arange(10, 18)] = torch.arange(8, 0, -1).float()
    s.observe(verified(TokenTree.root_only(3), logits))
    tree = s.propose([3]).tree
    s.observe(verified(tree, torch.zeros(tree.size, 50), path=(0, 2)))  # accepts rank 1 = token 11
    assert d.node_proposed[:8].tolist() == [1] * 8 and d.node_proposed[8:].sum() == 0
    assert d.node_accepted.tolist() == [0, 1] + [0] * 78
    assert d.steps == 1


def test_tree_size_comes_from_the_profile():
    sized_by_profile = RecyclingDrafter(RecyclingOptions(), info(nodes=12))
    assert sized_by_profile.template.size == 12
    s = sized_by_profile.begin([3])
    s.observe(verified(TokenTree((3,), (-1,)), torch.randn(1, 50)))
    draft = s.propose([1, 3])
    assert draft.required == 1 and 1 < draft.size <= 13  # offered best first, with the calibrated rates
    assert list(draft.chances[1:]) == sorted(draft.chances[1:], reverse=True)
    plain = RecyclingDrafter(RecyclingOptions(), info(nodes=0)).begin([3])  # drafting does not pay here
    plain.observe(verified(TokenTree((3,), (-1,)), torch.randn(1, 50)))
    assert plain.propose([1, 3]).tree == TokenTree((3,), (-1,))
    rates = monotone_rates()
    d = RecyclingDrafter(RecyclingOptions(nodes=20), info())
    assert d.template == PAPER_TEMPLATE.top(20, rates)
    assert RecyclingDrafter(RecyclingOptions(nodes=80), ModelInfo(50, CPU)).template == PAPER_TEMPLATE
    with pytest.raises(TriedecError, match="profile"):
        RecyclingDrafter(RecyclingOptions(nodes=0), ModelInfo(50, CPU))
    spec = method_spec("recycling")
    assert spec.needs(RecyclingOptions()) == {"cost", "recycling"} and spec.needs(RecyclingOptions(nodes=80)) == set()


@pytest.mark.parametrize(
    "bad", [{"nodes": -1}, {"nodes": 81}, {"nodes": 2.5}, {"k": 0}, {"k": True}, {"state": 3}, {"depth": 2},
            {"seed_prefill": -1}, {"seed_prefill": True}]
)
def test_bad_options_are_refused(bad):
    with pytest.raises(TriedecError):
        method_spec("recycling").make_options(bad)


# ---- persistence -------------------------------------------------------------------------------


def warmed(vocab: int = 50, model_id: str = "m1", state: str = "") -> RecyclingDrafter:
    d = RecyclingDrafter(RecyclingOptions(nodes=80, state=state), info(vocab, model_id=model_id))
    g = torch.Generator().manual_seed(1)
    tree = TokenTree(tuple(range(5, 25)), (-1, *range(19)))
    d.begin([5]).observe(verified(tree, torch.randn(tree.size, vocab, generator=g)))
    return d


def test_state_round_trip(tmp_path):
    path = tmp_path / "state" / "recycling.safetensors"
    d = warmed(state=str(path))
    d.begin([5]).end()
    assert not path.exists()  # written when the engine persists (idle, every few requests, shutdown)
    d.persist()
    assert path.stat().st_mode & 0o777 == 0o600
    loaded = RecyclingDrafter(RecyclingOptions(nodes=80, state=str(path)), info(50))
    assert torch.equal(loaded.matrix.table, d.matrix.table)
    assert torch.equal(loaded.matrix.filled, d.matrix.filled)
    assert loaded.begin([7]).propose([7]) == d.begin([7]).propose([7])


def test_mismatched_or_corrupt_state_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    warmed().matrix.save(path, "m1")
    with pytest.raises(TriedecError, match="another model"):
        RecyclingDrafter(RecyclingOptions(nodes=80, state=str(path)), info(50, model_id="m2"))
    with pytest.raises(TriedecError, match="vocabulary"):
        RecyclingDrafter(RecyclingOptions(nodes=80, state=str(path)), info(60))
    with pytest.raises(TriedecError, match="k=8"):
        RecyclingDrafter(RecyclingOptions(nodes=80, k=4, state=str(path)), info(50))
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(TriedecError, match="not a readable state"):
        RecyclingDrafter(RecyclingOptions(nodes=80, state=str(corrupt)), info(50))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(TriedecError, match="not a readable state"):
        RecyclingDrafter(RecyclingOptions(nodes=80, state=str(garbage)), info(50))
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"table": torch.zeros(50, 8, dtype=torch.long)}, str(other))
    with pytest.raises(TriedecError, match="not a triedec recycling state"):
        RecyclingDrafter(RecyclingOptions(nodes=80, state=str(other)), info(50))
    bad_values = tmp_path / "bad-values.safetensors"
    m = AdjacencyMatrix(50, 8, CPU)
    m.table[0, 0] = 99  # a token id outside the vocabulary
    m.save(bad_values, "m1")
    with pytest.raises(TriedecError, match="corrupt"):
        RecyclingDrafter(RecyclingOptions(nodes=80, state=str(bad_values)), info(50))


# ---- the profile and the size choice -----------------------------------------------------------


def test_expected_speed_and_choice_on_a_hand_made_curve():
    rates = [0.0] * 80
    rates[0], rates[8] = 0.8, 0.6  # node (0,) and node (0, 0)
    cost = CostModel({1: 0.10, 2: 0.30, 3: 0.12, 81: 0.5})
    rows = {r["nodes"]: r for r in expected_speeds(rates, cost)}
    assert rows[0]["tokens_per_step"] == 1.0 and rows[0]["tokens_per_s"] == pytest.approx(10.0)
    assert rows[1]["tokens_per_step"] == pytest.approx(1.8)
    assert rows[2]["tokens_per_step"] == pytest.approx(2.4)  # (0,) then (0, 0)
    assert rows[2]["tokens_per_s"] == pytest.approx(20.0)
    assert best_nodes(rates, cost) == 2
    assert best_nodes([0.0] * 80, cost) == 0  # nothing is ever accepted: do not draft


@pytest.mark.parametrize("bad", [{"rates": (0.5,) * 79}, {"rates": (1.5,) * 80}, {"nodes": 81}, {"nodes": -1},
                                 {"nodes": True}])
def test_profile_validation(bad):
    with pytest.raises(TriedecError):
        RecyclingProfile(**{"rates": (0.5,) * 80, "nodes": 3, **bad})
    assert RecyclingProfile((0.5,) * 80, 3).rates_for(PAPER_TEMPLATE.top(2, [0.5] * 80)) == [0.5, 0.5]
