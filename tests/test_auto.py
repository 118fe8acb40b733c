"""Method ``auto``: exact (greedy against transformers, sampled against ``ar``) on tiny models
with every source in play, the cross-request output store (bounds, eviction, persistence,
refusals), concurrency, and its per-source counters."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import EOS, MODELS, drain, fake_cost, hf_greedy, peaked, run, tiny_info, tiny_llama
from helpers import random_prompts as prompts

from triedec.core.accept import Acceptance, acceptance_rule
from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError
from triedec.core.sampling import Sampling
from triedec.drafters import method_spec
from triedec.drafters.auto import SOURCES, AutoDrafter, _Node
from triedec.drafters.base import Verified
from triedec.drafters.state import save_state
from triedec.drafters.store import KEYS, LEAD, PER_KEY, STORE_FORMAT, OutputStore
from triedec.engine.batch import StopRule, speculative_decode
from triedec.model.adapter import ModelAdapter


def build(options: dict, info):
    spec = method_spec("auto")
    return spec.factory(spec.make_options(options), info)


@pytest.mark.parametrize("name", MODELS)
def test_auto_equals_transformers_greedy(name):
    """Flat and steep cost curves and unsized; each prompt asked twice, so the second pass drafts
    from the store of earlier outputs too."""
    model = MODELS[name]()
    steep = CostModel({t: 0.05 * t for t in (1, 2, 4, 8, 16, 32, 64, 81)})
    drafters = [(build({}, tiny_info(cost=fake_cost())), fake_cost()), (build({}, tiny_info(cost=steep)), steep),
                (build({"sized": False, "max_nodes": 20}, tiny_info()), steep)]
    batch = prompts(seed=list(MODELS).index(name) + 60, count=8)
    accepted = 0
    for i, prompt in enumerate(batch + batch):
        truth = hf_greedy(model, prompt, 40)
        documents = [truth[5:25]] if i % 4 == 0 else []
        for drafter, cost in drafters:
            got, stats = run(model, drafter, prompt, 40, documents=documents, cost=cost)
            assert got == truth, f"auto differs on prompt {i}"
            accepted += sum(n - 1 for n in stats.accepted_per_step)
    assert accepted > 100
    counters = drafters[0][0].stats()
    assert all(counters[f"{s}_proposed"] > 0 for s in SOURCES)
    assert counters["store_outputs"] > 0


def test_auto_sampled_equals_ar():
    model = peaked(tiny_llama(seed=3))
    adapter = ModelAdapter(model)
    info = tiny_info(cost=fake_cost())
    drafter, ar = build({}, info), method_spec("ar").factory(method_spec("ar").make_options({}), info)
    rule = StopRule(30, frozenset([EOS]))
    for i, prompt in enumerate(prompts(seed=5, count=6) * 2):
        sampling = Sampling(temperature=[0.3, 0.7, 1.0][i % 3], top_p=0.95, seed=i)
        truth, _ = drain(speculative_decode(adapter, ar, prompt, rule, (), acceptance_rule(sampling)))
        got, _ = drain(speculative_decode(adapter, drafter, prompt, rule, (), acceptance_rule(sampling), info.cost))
        assert got == truth


def test_concurrent_requests_get_their_solo_outputs():
    model = tiny_llama(seed=3)
    drafter = build({}, tiny_info(cost=fake_cost()))
    batch = prompts(seed=9, count=6)
    solo = [hf_greedy(model, p, 30) for p in batch]
    got: dict[int, list[int]] = {}

    def work(i):
        got[i] = run(model, drafter, batch[i], 30, cost=fake_cost())[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(batch))] == solo


def test_store_keeps_recent_continuations_within_its_bound():
    store = OutputStore(capacity=30)
    store.add([1, 2, 3, 4, 5, 6])
    store.add([9, 1, 2, 3, 7, 8])
    assert store.continuations([0, 1, 2, 3], depth=3) == [((7, 8), 3), ((4, 5, 6), 3)]  # most recent first
    assert store.continuations([9, 1, 2, 3], depth=3) == [((7, 8), 4), ((4, 5, 6), 3)]  # longest match first
    assert store.continuations([0, 1, 2, 3], depth=3, count=1) == [((7, 8), 3)]
    assert store.continuations([1, 2], depth=3) == []  # shorter than the key
    for i in range(10):
        store.add([100 + i, 1, 2, 3, 50 + i, 60 + i])
    assert store.tokens <= 30 and len(store.docs) == 5
    assert all(p[0] in store.docs for places in store.index.values() for p in places)  # evicted ones left the index
    assert all(len(places) <= PER_KEY for places in store.index.values())
    assert store.continuations([1, 2, 3], depth=1) == [((59,), 3), ((58,), 3)]
    store.add([1, 2])  # too short to index
    store.add(list(range(40)))  # longer than the whole store: not kept
    assert store.tokens <= 30 and len(store.docs) == 5
    assert min(KEYS) == 3


def test_store_finds_an_answer_from_its_first_token_when_its_question_comes_again():
    """Each output is kept after the end of its prompt (its lead): the same question asked again
    (rephrased at its start) matches the whole lead, so its earlier answer is drafted from the
    first token, even after many newer outputs crowded the short key."""
    store = OutputStore(10_000)
    template = [90, 91, 92]  # the chat template's "assistant" header ends every prompt
    question = list(range(100, 140))
    store.add([7, 8, 9, 10], lead=[1, 2, *question, *template])
    for i in range(2 * PER_KEY):  # other questions: the template key now points elsewhere
        store.add([50 + i, 60 + i, 70 + i], lead=[200 + i, 201 + i, *template])
    assert all(len(doc) <= LEAD + 4 for doc, _ in store.docs.values())  # only the prompt's end is kept
    found = store.continuations([5, 5, *question, *template], depth=4)
    assert found[0] == ((7, 8, 9, 10), LEAD)  # whole lead matched: longest first
    assert store.continuations([*question, *template, 7, 8], depth=2)[0] == ((9, 10), LEAD)
    assert store.continuations([3, 3, 3, *template], depth=1)[0][1] == 3  # only the template: a short match


def test_store_persists_atomically_and_refuses_other_models_and_corrupt_files(tmp_path):
    path = tmp_path / "store.safetensors"
    store = OutputStore(1000)
    store.add([5, 6, 7, 8, 9])
    store.add([1, 2, 3, 4])
    store.save(path, "model-a")
    assert not list(tmp_path.glob("*.tmp"))
    again = OutputStore(1000)
    again.load(path, "model-a", vocab_size=48)
    assert list(again.docs.values()) == [((5, 6, 7, 8, 9), 0), ((1, 2, 3, 4), 0)]
    assert again.continuations([5, 6, 7], 4) == [((8, 9), 3)]
    leads = OutputStore(1000)
    leads.add([20, 21, 22], lead=[30, 31, 32, 33])
    leads.save(path, "model-a")
    again = OutputStore(1000)
    again.load(path, "model-a", vocab_size=48)
    assert list(again.docs.values()) == [((30, 31, 32, 33, 20, 21, 22), 4)]
    assert again.continuations([32, 33], 2) == [] and again.continuations([31, 32, 33], 2) == [((20, 21), 3)]
    save_state(path, {"tokens": torch.tensor([5, 6, 7, 8]), "lengths": torch.tensor([4])},  # no leads: an older file
               {"format": STORE_FORMAT, "model_id": "model-a"})
    again = OutputStore(1000)
    again.load(path, "model-a", vocab_size=48)
    assert list(again.docs.values()) == [((5, 6, 7, 8), 0)]
    with pytest.raises(TriedecError, match="another model"):
        OutputStore(1000).load(path, "model-b", vocab_size=48)
    with pytest.raises(TriedecError, match="corrupt"):
        OutputStore(1000).load(path, "model-a", vocab_size=6)  # token ids beyond the vocabulary
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(TriedecError, match="not a readable store"):
        OutputStore(1000).load(bad, "model-a", vocab_size=48)


def test_store_option_carries_outputs_across_drafters(tmp_path):
    """store=PATH: written when the request's batch goes idle, loaded by the next drafter (another
    process, say);
    the second drafter drafts the first one's answer from the store at once."""
    model = tiny_llama(seed=3)
    path = tmp_path / "auto-store.safetensors"
    info = tiny_info(cost=fake_cost())
    prompt = prompts(seed=3, count=1)[0]
    first, _ = run(model, build({"store": str(path)}, info), prompt, 40, eos=-1)
    assert path.exists()
    second = build({"store": str(path)}, info)
    assert second.stats()["store_outputs"] == 1
    got, stats = run(model, second, prompt, 40, eos=-1)
    assert got == first
    assert stats.drafter["store_accepted"] > 10


@pytest.mark.parametrize("bad,message", [
    ({"max_nodes": 0}, "max_nodes"), ({"n": 1}, "n must be"), ({"store_capacity": -1}, "store_capacity"),
    ({"store": 3}, "store must be"), ({"sized": "yes"}, "sized"), ({"depth": 0}, "depth"),
])
def test_bad_options(bad, message):
    with pytest.raises(TriedecError, match=message):
        build(bad, tiny_info())


def test_unsized_auto_sends_every_ranked_node_and_sized_can_send_none():
    model = tiny_llama(seed=3)
    prompt = [5, 9, 13, 5, 9, 13, 5, 9]
    expensive = CostModel({1: 0.01, 2: 1.0, 81: 2.0})  # any draft costs 100 steps: never worth it
    _, stats = run(model, build({}, tiny_info(cost=expensive)), prompt, 20, cost=expensive)
    assert stats.computed_tokens == stats.steps  # root-only trees
    _, stats = run(model, build({"sized": False}, tiny_info()), prompt, 20, cost=expensive)
    assert stats.computed_tokens > stats.steps  # sent whole, whatever the cost


def test_chances_merge_evidence_and_siblings_share_one_parent():
    """A node proposed by two kinds combines their evidence; children whose chances given the
    parent add up to more than 1 are scaled down together (at most one child is accepted)."""
    drafter = build({}, tiny_info())
    session = drafter.begin([1, 2, 3])
    ctx, store, rec = AutoDrafter.PRIOR["context"], AutoDrafter.PRIOR["store"], AutoDrafter.PRIOR["recycling"]
    nodes = {
        (5,): _Node(5, (), {("context", 3): 1.0}),
        (6,): _Node(6, (), {("store", 8): 1.0, ("recycling", 0): 1.0}),
        (5, 7): _Node(7, (5,), {("context", 3): 0.5}),
    }
    chance = session.score(nodes)
    merged = 1 - (1 - store) * (1 - rec)
    total = ctx + merged
    assert total > 1
    assert chance[(5,)] == pytest.approx(ctx / total)
    assert chance[(6,)] == pytest.approx(merged / total)
    assert chance[(5,)] + chance[(6,)] == pytest.approx(1.0)
    assert chance[(5, 7)] == pytest.approx(chance[(5,)] * 0.5 * ctx)  # alone: not scaled


def test_rates_are_calibrated_per_unit_of_base_and_skipped_keys_relax_to_the_prior():
    """Nodes of base 0.5 accepted half the time: base * rate -> 0.5 (rate -> 1), so the chance
    estimate matches what was measured whatever the base; a key that stops being sent drifts back."""
    drafter = build({}, tiny_info())
    kind = ("context", 2)
    for i in range(400):
        drafter.learn([({kind: 0.5}, 1, i % 2 == 0)], hot=False, skipped=set())
    key = AutoDrafter.key(kind, 1, False)
    assert 0.5 * drafter.rate(key) == pytest.approx(0.5, abs=0.08)
    assert drafter.rate(AutoDrafter.key(kind, 1, True)) == AutoDrafter.PRIOR["context"]  # hot is apart
    assert AutoDrafter.key(kind, 30, False) == AutoDrafter.key(kind, 4, False)  # deep nodes share a key
    for _ in range(400):
        drafter.learn([({kind: 1.0}, 1, False)], hot=False, skipped=set())
    low = drafter.rate(key)
    assert low < 0.05
    for _ in range(300):
        drafter.learn([], hot=False, skipped={key})
    assert low < drafter.rate(key) < AutoDrafter.PRIOR["context"]
    assert drafter.stats()["context_accepted"] == 200


def test_a_root_only_step_costs_no_lookup_and_a_drafting_step_catches_up():
    """The context trie is not built when a request begins; a step asked for the root alone
    (plain, or skipped by the gate) neither feeds the trie nor recycles its row; the first drafting
    step builds it from the documents, the prompt and the tokens since, and recycles its verified
    rows even when it found nothing to propose (so an empty matrix fills)."""
    drafter = build({"sized": False}, tiny_info())
    prompt = [5, 6, 7, 8, 5, 6, 7]
    session = drafter.begin(prompt, documents=[[40, 41, 42]])
    fed, nodes = session.fed, session.trie.size
    assert (fed, nodes) == (0, 0)  # nothing built yet
    row = torch.zeros(1, drafter.vocab_size)
    row[0, 9] = 1.0
    for token in (8, 5):
        context = prompt + ([8] if token == 5 else [])
        draft = session.propose(context, 1)
        assert draft.tree.tokens == (context[-1],)
        session.observe(Verified(draft.tree, row, Acceptance((0,), (token,))))
    assert (session.fed, session.trie.size) == (fed, nodes)  # nothing fed, nothing recycled
    assert not drafter.matrix.filled.any()
    context = [*prompt, 8, 5]
    draft = session.propose(context)  # drafting: the trie catches up, and drafts 6 7 8 after "8 5"
    assert session.fed == len(context) and session.trie.size > nodes
    assert session.trie.node([40, 41, 42]) is not None and session.trie.node([6, 7, 8, 5]) is not None
    assert draft.tree.tokens[:2] == (5, 6)
    session.observe(Verified(draft.tree.truncated(1), row, Acceptance((0,), (6,)), (0,), draft.size))
    assert drafter.matrix.filled[5] and drafter.matrix.table[5, 0] == 9  # the root's row, recycled

    empty = drafter.begin([1, 2, 3])  # no match anywhere: a drafting step proposes the root alone
    draft = empty.propose([1, 2, 3])
    assert draft.size == 1
    empty.observe(Verified(draft.tree, row, Acceptance((0,), (4,))))
    assert drafter.matrix.filled[3]  # still recycled: the matrix fills from nothing
