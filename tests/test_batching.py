"""Continuous batching: one forward verifies every running request's tree, and a request's tokens
never depend on what else runs in the same forward.

Checked differentially: many requests of different prompt lengths (prompts longer than a prefill
chunk among them), arriving at different steps, mixed methods and sampling settings, stops inside
accepted drafts and cancellation mid-stream, each against its solo output and transformers'
greedy decoding; the batched forward bit for bit on triedec's kernels; admission by KV memory;
``generate_batch``."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from helpers import (
    EOS,
    TINY_VOCAB,
    alone,
    drain,
    fake_profile,
    hf_beam,
    hf_greedy,
    peaked,
    tiny_gemma3,
    tiny_info,
    tiny_llama,
    together,
)
from helpers import random_prompts as prompts

import triedec
from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError
from triedec.core.limits import PREFILL_CHUNK
from triedec.core.sampling import Sampling
from triedec.core.tree import TokenTree
from triedec.drafters import BaseDrafter, BaseSession, Draft
from triedec.engine.batch import Batch, BatchLimits, run_alone
from triedec.engine.methods import method
from triedec.engine.request import Request, StopRule
from triedec.model.adapter import ForwardItem, ModelAdapter
from triedec.model.linears import packing_available

# drafts cost little up to 16 tokens, then more; more requests cost more: the allocator has work to do
COST = CostModel({1: 0.06, 4: 0.065, 16: 0.08, 64: 0.2}, 256, {}, {2: {2: 0.07, 32: 0.12}, 8: {8: 0.1, 64: 0.3}})


def build(name: str, options: dict, info):
    return method(name).build(method(name).make_options(options), info)


def long_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts of 1 to ~300 tokens: some span several prefill chunks."""
    rng = random.Random(seed)
    out = prompts(seed, count)
    for i in range(0, count, 3):
        motif = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(3, 9))]
        out[i] = (motif * 60)[: rng.randint(PREFILL_CHUNK + 1, 2 * PREFILL_CHUNK + 40)]
    return out


MIXED = [("ar", {}), ("pld", {}), ("ngram-trie", {}), ("auto", {}), ("lookahead", {}), ("recycling", {}),
         ("pld", {"min_expected": 0.0}), ("ngram-trie", {"sized": False}), ("auto", {"sized": False})]


@pytest.mark.parametrize("model_name", ["llama", "gemma3"])
def test_mixed_requests_arriving_at_different_steps_equal_transformers_greedy(model_name):
    """Twelve greedy requests of every method (device-sized ones under a cost model, so the
    allocator sizes their trees together), prompts from 1 token to over two prefill chunks,
    joining at different steps: each equals transformers' greedy decoding and its own solo run."""
    model = tiny_llama(seed=8, max_pos=1024) if model_name == "llama" else tiny_gemma3(seed=9, window=7)
    adapter = ModelAdapter(model)
    info = tiny_info(cost=COST, profile=fake_profile(nodes=12))
    decoders = [build(name, options, info) for name, options in MIXED]
    batch_prompts = long_prompts(seed=31, count=12)
    rules = [StopRule([40, 25, 33][i % 3], frozenset([EOS])) for i in range(len(batch_prompts))]
    runs = [decoders[i % len(decoders)].start(p, r) for i, (p, r) in enumerate(zip(batch_prompts, rules, strict=True))]
    arrivals = [0, 0, 1, 3, 3, 4, 8, 9, 15, 16, 20, 30]
    outs, steps = together(adapter, runs, cost=COST, limits=BatchLimits(max_running=6), arrivals=arrivals)
    drafted = 0
    for i, ((tokens, outcome), prompt, rule) in enumerate(zip(outs, batch_prompts, rules, strict=True)):
        truth = hf_greedy(model, prompt, rule.max_new_tokens)
        assert tokens == truth, f"request {i} ({MIXED[i % len(MIXED)]}) differs from transformers"
        assert outcome.stats.new_tokens == len(tokens)
        drafted += outcome.stats.verified_nodes
    assert drafted > 50  # trees were verified in shared forwards
    assert steps < sum(len(t) for t, _ in outs)  # far fewer forwards than tokens


def test_sampled_requests_with_mixed_settings_equal_ar_at_the_same_seed():
    """Sampling: every method, several settings and seeds in one batch; each request returns ar's
    tokens for its seed, as it does alone."""
    model = peaked(tiny_llama(seed=3))
    adapter = ModelAdapter(model)
    info = tiny_info(cost=COST, profile=fake_profile(nodes=12))
    settings = [Sampling(temperature=0.8, seed=1), Sampling(temperature=1.0, top_k=5, seed=2),
                Sampling(temperature=0.7, top_p=0.9, min_p=0.05, seed=3), Sampling(),
                Sampling(temperature=0.9, repetition_penalty=1.2, seed=4), Sampling(repetition_penalty=1.3)]
    ar = build("ar", {}, info)
    runs, truths = [], []
    for i, prompt in enumerate(long_prompts(seed=5, count=12)):
        name, options = MIXED[i % len(MIXED)]
        sampling = settings[i % len(settings)]
        rule = StopRule(30, frozenset([EOS]))
        truths.append(alone(adapter, ar, prompt, rule, (), sampling)[0])
        runs.append(build(name, options, info).start(prompt, rule, (), sampling))
    outs, _ = together(adapter, runs, cost=COST, arrivals=[0, 1, 1, 2, 3, 5, 8, 8, 9, 13, 21, 34])
    assert [t for t, _ in outs] == truths


class Oracle(BaseDrafter):
    """Drafts the known continuation (12 tokens), so that stops fall inside accepted drafts."""

    def __init__(self, truth: list[int], prompt_len: int) -> None:
        self.truth, self.prompt_len = truth, prompt_len

    def propose(self, context):
        done = len(context) - self.prompt_len
        return TokenTree.from_sequences(context[-1], [self.truth[done : done + 12]])


def test_stops_inside_accepted_drafts_in_a_batch():
    """EOS, a stop token and max_new_tokens falling inside fully accepted drafts, for requests
    that share forwards: nothing past the stop is kept, for any of them."""
    model = tiny_llama(seed=5)
    adapter = ModelAdapter(model)
    runs, want = [], []
    for i, prompt in enumerate(prompts(seed=13, count=8)):
        truth = hf_greedy(model, prompt, 30, eos=-1)
        if i % 3 == 0:
            stop_tok = truth[5 + i % 4]
            rule = StopRule(30, frozenset([stop_tok]))
            want.append((truth[: truth.index(stop_tok) + 1], "eos"))
        else:
            limit = [1, 2, 7, 11, 13][i % 5]
            rule = StopRule(limit, frozenset([-1]))
            want.append((truth[:limit], "length"))
        runs.append(Request(Oracle(truth, len(prompt)), prompt, rule))
    outs, _ = together(adapter, runs, arrivals=[0, 0, 0, 1, 1, 2, 4, 6])
    for (tokens, outcome), (expected, reason) in zip(outs, want, strict=True):
        assert tokens == expected and outcome.stats.stop_reason == reason


class Spy(BaseDrafter):
    """Counts sessions begun and ended."""

    def __init__(self) -> None:
        self.begun = self.ended = 0

    def begin(self, prompt, documents=()):
        self.begun += 1
        spy = self

        class Session(BaseSession):
            def propose(self, context, max_nodes=256):
                return Draft.root_only(context[-1])

            def end(self):
                spy.ended += 1

        return Session()


def test_a_cancelled_request_leaves_at_once_and_the_others_are_unaffected():
    model = tiny_llama(seed=6)
    adapter = ModelAdapter(model)
    spy = Spy()
    batch_prompts = prompts(seed=21, count=4)
    rule = StopRule(30, frozenset([-1]))
    runs = [Request(spy, p, rule) for p in batch_prompts]
    outs, _ = together(adapter, runs, limits=BatchLimits(max_running=3), arrivals=[0, 0, 1, 2], cancel={1: 5, 3: 4})
    assert spy.begun == 3 and spy.ended == 3  # the one cancelled while it waited for a slot never began
    assert outs[3][0] == []
    assert runs[1].cache is None and runs[1].done and 0 < len(outs[1][0]) < 30
    for i in (0, 2):
        assert outs[i][0] == hf_greedy(model, batch_prompts[i], 30, eos=-1)


def test_beam_search_runs_beside_the_batch():
    model = tiny_llama(seed=4)
    adapter = ModelAdapter(model)
    info = tiny_info()
    beam, ar = build("beam", {"num_beams": 3}, info), build("ar", {}, info)
    rule = StopRule(12, frozenset([EOS]))
    batch_prompts = prompts(seed=41, count=4)
    runs = [(beam if i % 2 else ar).start(p, rule) for i, p in enumerate(batch_prompts)]
    outs, _ = together(adapter, runs, arrivals=[0, 1, 1, 3])
    for i, ((tokens, outcome), p) in enumerate(zip(outs, batch_prompts, strict=True)):
        if i % 2:
            hyps = hf_beam(model, p, beam.options, 12, EOS)
            assert tokens == hyps[0][0] and [list(h.token_ids) for h in outcome.sequences] == [h for h, _ in hyps[:1]]
        else:
            assert tokens == hf_greedy(model, p, 12)


def test_long_prompts_are_prefilled_in_chunks_beside_running_requests():
    """While a long prompt is prefilled, chunk by chunk, the running requests keep getting tokens
    at every step, and the prefill tokens per forward stay under the cap."""
    model = tiny_llama(seed=7, max_pos=1024)
    adapter = ModelAdapter(model)
    ar = build("ar", {}, tiny_info())
    short = prompts(seed=3, count=2)
    long = (prompts(seed=4, count=1)[0] * 200)[: 3 * PREFILL_CHUNK + 17]
    batch = Batch(adapter, limits=BatchLimits(max_prefill_tokens=PREFILL_CHUNK))
    runners = [ar.start(p, StopRule(40, frozenset([-1]))) for p in short]
    for r in runners:
        batch.submit(r)
    batch.step()  # both short prompts prefilled (one chunk each... the cap still lets the first through)
    batch.step()
    late = ar.start(long, StopRule(5, frozenset([-1])))
    batch.submit(late)
    prefill_steps = 0
    while late.prefilling or not late.generated:
        report = batch.step()
        assert report.plan.prefill_tokens <= PREFILL_CHUNK
        assert 0 < report.forward_seconds <= report.seconds  # the rest of the step is host time
        prefill_steps += 1
        assert all(r.take() for r in runners if not r.done)  # the running requests moved on
    assert prefill_steps == 4  # 3 full chunks and the rest
    while not batch.idle:
        batch.step()
    assert late.generated == hf_greedy(model, long, 5, eos=-1)


def test_the_drafter_is_told_what_was_verified():
    """When the allocator verifies only part of a draft, the drafter learns which part."""
    seen = []

    class Scored(BaseDrafter):
        def begin(self, prompt, documents=()):
            class Session(BaseSession):
                def propose(self, context, max_nodes=256):
                    tree = TokenTree.from_sequences(context[-1], [[5, 6, 7, 8, 9, 10]])
                    return Draft.scored(tree, [1.0, 0.3, 0.05, 0.01, 0.01, 0.01, 0.01])

                def observe(self, verified):
                    seen.append((verified.tree.size, verified.proposed, verified.cut, verified.kept))

            return Session()

    adapter = ModelAdapter(tiny_llama(seed=2))
    steep = CostModel({1: 0.1, 2: 0.11, 3: 0.2, 8: 0.5})
    tokens, _ = drain(run_alone(adapter, Request(Scored(), [1, 2, 3], StopRule(6, frozenset([-1]))), steep))
    assert len(tokens) == 6
    assert all(proposed == 7 for _, proposed, _, _ in seen[:2])
    assert seen[0][:3] == (2, 7, True) and seen[0][3] == (0, 1)  # one draft node pays under this curve


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32), reason="oneDNN packing unavailable")
@pytest.mark.parametrize("make", [lambda: tiny_llama(seed=11), lambda: tiny_gemma3(seed=12, window=5)])
def test_a_request_logits_are_bit_identical_alone_or_batched(make):
    """On triedec's kernels, a request's logits do not depend on what else shares its forward:
    other requests' trees, their cache lengths, a prompt chunk, or its place in the row."""
    adapter = ModelAdapter(make(), "auto")
    gen = torch.Generator().manual_seed(0)

    def cache_of(length):
        c = adapter.new_cache(600)
        adapter.prefill(c, torch.randint(3, TINY_VOCAB, (length,), generator=gen))
        c.commit(range(length))
        return c

    def tree_item(c, tree):
        return ForwardItem(c, torch.tensor(tree.tokens), tree.positions(c.length)[0], tree.ancestry)

    mine = cache_of(37)
    tree = TokenTree.from_sequences(7, [[8, 9, 10], [8, 11], [12]])
    solo = adapter.forward_batch([tree_item(mine.clone(), tree)])[0]
    for others in ([5, 90], [200], [1, 2, 3, 300]):
        items = [tree_item(cache_of(n), TokenTree.from_sequences(4, [[5] * (n % 7)])) for n in others]
        chunk = torch.randint(3, TINY_VOCAB, (50,), generator=gen)
        items.append(ForwardItem(adapter.new_cache(60), chunk, torch.arange(50),
                                 torch.ones(50, 50, dtype=torch.bool).tril_()))
        for place in (0, len(items)):
            batch = [*items[:place], tree_item(mine.clone(), tree), *items[place:]]
            got = adapter.forward_batch(batch)[place]
            assert torch.equal(got, solo)
            for item in batch:
                item.cache.commit([])


def test_kv_memory_admits_what_fits_and_refuses_what_never_can():
    adapter = ModelAdapter(tiny_llama(seed=1))
    ar = build("ar", {}, tiny_info())
    rule = StopRule(20, frozenset([-1]))
    per_request = ar.start([1, 2, 3], rule).kv_tokens * adapter.kv_bytes_per_token
    batch = Batch(adapter, limits=BatchLimits(max_kv_bytes=2 * per_request))
    runs = [ar.start([1, 2, 3], rule) for _ in range(3)]
    for r in runs:
        batch.submit(r)
    batch.step()
    assert len(batch.running) == 2 and len(batch.waiting) == 1
    while not batch.idle:
        batch.step()
    assert all(r.done for r in runs)
    with pytest.raises(TriedecError, match="KV cache"):
        batch.submit(ar.start(list(range(3, 40)), StopRule(400, frozenset([-1]))))


def test_runs_are_known_by_request_id():
    """A batch knows each run by its request id: ids it makes are distinct, a given id is kept, an
    id in use or an empty one is refused before the run is queued, a step reports the ids that
    finished (and they leave :attr:`Batch.runs`), cancelling by id ends that run alone, and an id
    no longer in the batch cancels nothing."""
    adapter = ModelAdapter(tiny_llama(seed=1))
    ar = build("ar", {}, tiny_info())
    batch = Batch(adapter)
    short, long, doomed = (ar.start([1, 2, 3], StopRule(n, frozenset([-1]))) for n in (2, 6, 6))
    made = batch.submit(short)
    assert made.startswith("run-") and batch.runs == {made: short}
    assert batch.submit(long, request_id="chatcmpl-1") == "chatcmpl-1"
    for bad in ("chatcmpl-1", made, ""):
        with pytest.raises(TriedecError, match="request id"):
            batch.submit(doomed, request_id=bad)
    assert batch.submit(doomed) not in (made, "chatcmpl-1") and len(batch.runs) == 3
    finished: list[str] = []
    while made not in finished:
        finished += batch.step().finished
    assert finished == [made] and made not in batch.runs and short.done
    batch.cancel(made)  # gone already: nothing happens
    doomed_id = next(i for i, r in batch.runs.items() if r is doomed)
    batch.cancel(doomed_id)
    assert doomed.done and doomed.outcome.stats.stop_reason == "cancelled" and not long.done
    assert set(batch.runs) == {"chatcmpl-1"} and batch.running == ["chatcmpl-1"]
    while not batch.idle:
        finished += batch.step().finished
    assert finished == [made, "chatcmpl-1"] and long.outcome.stats.new_tokens == 6


def test_a_group_at_its_running_cap_waits_and_lets_the_others_go_first():
    """Admission is the batch's alone: a group (a server tenant) past ``group_running`` waits while
    later runs of other groups join; its runs join as its own finish, and each run's tokens are
    what it gives alone."""
    adapter = ModelAdapter(tiny_llama(seed=1))
    ar = build("ar", {}, tiny_info())
    rule = StopRule(6, frozenset([-1]))
    batch = Batch(adapter, limits=BatchLimits(max_running=3), group_running=1)
    runs = {name: ar.start([1, 2, i + 3], rule) for i, name in enumerate(["a1", "a2", "b1", "a3", "c1"])}
    for name, run in runs.items():
        assert batch.submit(run, group=name[0], request_id=name) == name
    tokens: dict[str, list[int]] = {name: [] for name in runs}

    def step() -> None:
        batch.step()
        for name, run in runs.items():
            tokens[name] += run.take()

    step()
    assert batch.running == ["a1", "b1", "c1"] and batch.runs["b1"] is runs["b1"]
    assert list(batch.waiting) == ["a2", "a3"]
    assert (batch.running_in("a"), batch.running_in("b"), batch.running_in("z")) == (1, 1, 0)
    batch.cancel("a2")  # a waiting run leaves at once; the group's next one is next in line
    assert runs["a2"].done and list(batch.waiting) == ["a3"] and "a2" not in batch.runs
    most = 0
    while not batch.idle:
        step()
        most = max(most, batch.running_in("a"))
    assert most == 1 and runs["a3"].done
    for i, name in enumerate(runs):
        if name != "a2":
            alone = [t for chunk in run_alone(adapter, ar.start([1, 2, i + 3], rule)) for t in chunk]
            assert tokens[name] == alone and len(alone) == 6, name
    with pytest.raises(TriedecError, match="group_running"):
        Batch(adapter, group_running=0)


def test_a_batch_that_learns_its_cost_corrects_the_surface_and_keeps_every_token():
    """``learn_cost``: a surface 1000x too slow is corrected by the forwards observed (clamped at
    :attr:`ObservedCost.LOW`), the step's host time is measured, tree sizes follow, and every
    request's tokens stay ``ar``'s; a new surface starts a new correction."""
    from triedec.core.costmodel import ObservedCost

    adapter = ModelAdapter(tiny_llama(seed=3))
    info = tiny_info()
    slow = CostModel({1: 10.0, 16: 11.0, 81: 20.0}, batch_seconds={4: {4: 10.5, 64: 20.0}})
    rule = StopRule(16, frozenset([-1]))
    batch = Batch(adapter, slow, learn_cost=True)
    assert batch.sizing_cost is not slow and batch.host_seconds == 0.0
    ar = build("ar", {}, info)
    truths = [alone(adapter, ar, p, rule)[0] for p in prompts(seed=21, count=4)]
    runs = [build("pld", {}, info).start(p, rule) for p in prompts(seed=21, count=4)]
    outs, _ = together(adapter, runs, batch=batch)
    assert [t for t, _ in outs] == truths
    observed = batch.sizing_cost
    assert isinstance(observed, ObservedCost) and observed.observations() >= 8  # a forward per step
    assert observed.ratio(4) == ObservedCost.LOW  # tiny forwards take milliseconds, not seconds
    assert batch.host_seconds > 0.0
    batch.cost = CostModel({1: 0.01})  # a new calibration: a new correction over it
    assert batch.sizing_cost.observations() == 0 and batch.host_seconds == 0.0
    assert Batch(adapter, slow).sizing_cost is slow  # without learn_cost: the calibrated surface as is


class Chain(BaseDrafter):
    """Proposes the same 4-node chain every step, its nodes unlikely; counts its full proposals
    and its root-only ones (a gated step)."""

    def __init__(self) -> None:
        self.full = self.rooted = 0

    def begin(self, prompt, documents=()):
        spy = self

        class Session(BaseSession):
            def propose(self, context, max_nodes=256):
                if max_nodes <= 1:
                    spy.rooted += 1
                    return Draft.root_only(context[-1])
                spy.full += 1
                return Draft.scored(TokenTree.from_sequences(context[-1], [[3, 4, 5, 6]]), [1.0, 0.3, 0.1, 0.05, 0.02])

        return Session()


def test_a_gated_batch_stops_asking_for_drafts_that_never_pay_and_keeps_every_token():
    """``gate_drafts``: under a surface where no draft node pays, a request stops drafting after two
    steps whose proposal got no node verified, and probes again after pauses that double; drafts
    that are always accepted never pause. Tokens are ``ar``'s either way (whether verified drafts
    that are never accepted pause depends on timing: their host time against the batch's pace)."""
    adapter = ModelAdapter(tiny_llama(seed=3))
    steep = CostModel({1: 0.01, 16: 1.0})  # every extra token costs more than it can yield
    rule = StopRule(40, frozenset([-1]))
    ar = build("ar", {}, tiny_info())
    batch_prompts = prompts(seed=22, count=3)
    truths = [alone(adapter, ar, p, rule)[0] for p in batch_prompts]
    for cost, gate in ((steep, False), (steep, True), (None, True)):
        chain = Chain()
        runs = [Request(chain, p, rule) for p in batch_prompts]
        outs, _ = together(adapter, runs, batch=Batch(adapter, cost, gate_drafts=gate))
        assert [t for t, _ in outs] == truths
        steps = sum(run.outcome.stats.steps for run in runs)
        skipped = sum(run.outcome.stats.skipped_drafts for run in runs)
        assert chain.full + chain.rooted == steps and skipped == chain.rooted
        if cost is steep and gate:
            assert chain.full <= 3 * 8 and skipped >= steps - 3 * 8  # 2 misses, then probes after 1, 2, 4, ... steps
            assert sum(run.outcome.stats.verified_nodes for run in runs) == 0
        elif not gate:
            assert skipped == 0  # ungated: every step drafts
    runs = [Request(Oracle(t, len(p)), p, rule) for p, t in zip(batch_prompts, truths, strict=True)]
    gc.disable()  # a collection inside one request's first drafted step would weigh on its host time
    try:
        outs, _ = together(adapter, runs, batch=Batch(adapter, None, gate_drafts=True))
    finally:
        gc.enable()
    assert [t for t, _ in outs] == truths
    # accepted every step, so it pays at any pace; the gate weighs wall-clock times, so a scheduling
    # hiccup in a first drafted step may cost a few skipped steps (0 in 5 runs here, beside a CI run)
    assert sum(run.outcome.stats.skipped_drafts for run in runs) <= 3
    assert sum(run.outcome.stats.steps for run in runs) < sum(len(t) for t in truths) / 2
    info = tiny_info(cost=steep, profile=fake_profile(nodes=12))
    for name, options in MIXED:  # every drafter's session answers a gated step (propose(context, 1))
        runs = [build(name, options, info).start(p, rule) for p in batch_prompts]
        outs, _ = together(adapter, runs, batch=Batch(adapter, steep, gate_drafts=True))
        assert [t for t, _ in outs] == truths, name


def test_generate_batch_equals_generate_in_input_order(tiny_model_dir, capsys):
    lm = triedec.load(tiny_model_dir)
    texts = ["Hello there", "one two three one two three one", "Tell me a story about the sea", "def quicksort(arr):",
             "Hi", "Translate to French: good morning"]
    for method_name, options in (("pld", {"min_expected": 0.0}), ("lookahead", {}), ("ar", {})):
        solo = [lm.generate(t, method_name, max_new_tokens=20, **options) for t in texts]
        got = lm.generate_batch(texts, method_name, max_new_tokens=20, progress=False, max_running=3, **options)
        assert [r.token_ids for r in got] == [r.token_ids for r in solo]
        assert [r.text for r in got] == [r.text for r in solo]
    sampled = lm.generate_batch(texts[:3], "pld", max_new_tokens=12, temperature=0.8, seed=5, progress=False)
    assert [r.token_ids for r in sampled] == [lm.generate(t, "ar", max_new_tokens=12, temperature=0.8,
                                                          seed=5).token_ids for t in texts[:3]]
    lm.generate_batch(texts[:2], "ar", max_new_tokens=4)  # a progress bar by default
    assert "generate_batch" in capsys.readouterr().err
    with pytest.raises(TriedecError, match="empty"):
        lm.generate_batch(["fine", ""], "ar", progress=False)  # every prompt checked before anything runs
    with pytest.raises(TriedecError, match="list of prompts"):
        lm.generate_batch("one prompt", progress=False)


def test_generate_batch_on_the_default_model_equals_transformers(default_lm):
    """The default model: six chat requests (two with the ~120-token article) decoded together,
    with auto and with ar, equal stock transformers' greedy decoding."""
    from helpers import PROMPTS, hf_generate

    chats = [PROMPTS[i] for i in (0, 2, 6, 9, 12, 16)]
    truths = [hf_generate(default_lm, default_lm.encode(chat), 40) for chat in chats]
    for name in ("auto", "ar"):
        got = default_lm.generate_batch(chats, name, max_new_tokens=40, progress=False)
        assert [r.token_ids for r in got] == truths, name
        assert all(r.stats.stop_reason in ("eos", "length") for r in got)



def test_a_batch_that_measures_drafting_runs_plain_steps_where_drafting_does_not_pay_and_keeps_every_token():
    """``measure_drafting``: steps that draft and steps that do not are both measured at each load,
    in pairs (every other step runs plain while the level has too few pairs); where plain steps commit more
    per second, only one step in 16 drafts. A plain step asks every drafter for its root alone, and
    every request's tokens stay ``ar``'s."""
    from triedec.core.allocate import load_level

    adapter = ModelAdapter(tiny_llama(seed=3))
    rule = StopRule(40, frozenset([-1]))
    batch_prompts = prompts(seed=23, count=3)
    truths = [alone(adapter, build("ar", {}, tiny_info()), p, rule)[0] for p in batch_prompts]
    for trained in (False, True):
        batch = Batch(adapter, None, measure_drafting=True)
        assert batch.payoff is not None
        if trained:  # measured before: at this load, plain steps commit twice as much per second
            for _ in range(8):
                batch.payoff.observe(3, True, 2.0, 3)
                batch.payoff.observe(3, False, 1.0, 3)
        chain = Chain()
        runs = [Request(chain, p, rule) for p in batch_prompts]
        for r in runs:
            batch.submit(r)
        plans, tokens = [], [[] for _ in runs]
        while not batch.idle:
            plans.append(batch.step().plan)
            for out, r in zip(tokens, runs, strict=True):
                out += r.take()
        assert tokens == truths
        decoding = [p for p in plans if len(p.decoding) == 3 and not p.chunks]
        drafted = [p for p in decoding if p.drafting]
        assert all(p.draft_nodes == 0 for p in plans if not p.drafting)
        assert chain.full == sum(len(p.decoding) for p in plans if p.drafting)  # plain steps: the root alone
        if trained:
            assert len(drafted) <= len(decoding) // 16 + 1 and not batch.payoff.prefers_drafting(load_level(3))
        else:
            assert len(decoding) > len(drafted) and batch.payoff.report()[3]["pairs"] >= 1
    assert Batch(adapter, None).payoff is None


class Wrong(BaseDrafter):
    """Drafts a 4-token chain, sure of it, whose first token is never the model's next one."""

    def __init__(self, truth: list[int], prompt_len: int) -> None:
        self.truth, self.prompt_len = truth, prompt_len

    def begin(self, prompt, documents=()):
        spy = self

        class Session(BaseSession):
            def propose(self, context, max_nodes=256):
                if max_nodes <= 1:
                    return Draft.root_only(context[-1])
                done = len(context) - spy.prompt_len
                bad = (spy.truth[done] + 1) % TINY_VOCAB if done < len(spy.truth) else 3
                return Draft.scored(TokenTree.from_sequences(context[-1], [[bad, 4, 5, 6]]), [1.0, 0.9, 0.9, 0.9, 0.9])

        return Session()


def test_a_gate_charges_drafting_the_forward_time_its_verified_rows_add():
    """A gated request's drafting costs its host time plus what its verified draft rows added to
    the forward (the cost model's estimate): drafts the allocator verifies (their claimed chance
    pays for their rows) but the model never accepts stop being asked for after two steps, and the
    tokens stay ``ar``'s."""
    adapter = ModelAdapter(tiny_llama(seed=3))
    rule = StopRule(30, frozenset([-1]))
    prompt = prompts(seed=24, count=1)[0]
    truth = alone(adapter, build("ar", {}, tiny_info()), prompt, rule)[0]
    cost = CostModel({1: 0.010, 5: 0.012, 16: 0.05})  # 4 rows cost 2 ms: at a claimed 0.9 each they pay
    run = Request(Wrong(truth, len(prompt)), prompt, rule)
    batch = Batch(adapter, cost, gate_drafts=True)
    batch.submit(run)
    batch.step()  # the prompt
    batch.step()  # a drafted step: 4 rows verified, none accepted
    gate = run.gate
    assert gate is not None and gate.draft_seconds is not None
    assert gate.draft_seconds >= cost.seconds(5) - cost.seconds(1)  # the rows' 2 ms are charged
    tokens = list(run.take())
    while not run.done:
        batch.step()
        tokens += run.take()
    batch.close()
    assert tokens == truth
    assert run.outcome.stats.skipped_drafts >= run.outcome.stats.steps // 2  # paused, probing now and then
