"""The allocator (pure): one verify budget per forward, shared by every running request's draft."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triedec.core.allocate import allocate
from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError

# 1 token costs 0.1 s, 16 cost 0.12 s, then linear: drafts are nearly free up to 16 tokens
FLAT16 = CostModel({1: 0.1, 16: 0.12, 64: 0.4}, batch_seconds={2: {2: 0.11, 32: 0.2}, 8: {8: 0.16, 64: 0.5},
                                                                16: {16: 0.25, 128: 1.0}})


def test_one_request_keeps_nodes_while_they_pay():
    cost = CostModel({1: 0.1, 2: 0.2, 3: 0.21, 4: 0.4})
    assert allocate([[1, 0.9, 0.9, 0.9]], [1], cost) == [3]  # 2.8 tokens in 0.21 s beats 1.9 in 0.2 and 1 in 0.1
    assert allocate([[1, 0.5, 0.1, 0.1]], [1], cost) == [1]  # 1.5 tokens in 0.2 s is slower than a plain step
    assert allocate([[1, 0.5, 0.1, 0.0]], [1], None) == [3]  # a flat curve: every node with a chance
    assert allocate([[1]], [1], cost) == [1]
    assert allocate([], [], cost) == []


def test_trees_shrink_smoothly_as_requests_pile_up():
    """The same draft, alone and beside more and more requests: the tree shrinks toward plain
    batched decoding, without a switch."""
    draft = [1.0, *(0.9 ** d for d in range(1, 40))]
    sizes = [sum(allocate([draft] * b, [1] * b, FLAT16)) / b for b in (1, 2, 8, 16)]
    assert sizes[0] > 10  # alone: a big tree pays
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]


def test_nodes_go_to_the_most_likely_drafts_first():
    good, poor = [1.0, 0.95, 0.9, 0.85, 0.8], [1.0, 0.2, 0.1, 0.05, 0.02]
    counts = allocate([poor, good], [1, 1], FLAT16, max_tokens=6)
    assert counts == [1, 5]  # four optional nodes fit: all go to the likely draft


def test_required_nodes_always_go_and_the_token_cap_binds_the_rest():
    fixed = [1.0, 0.0, 0.0, 0.0]  # a fixed tree (e.g. lookahead): required whole, no estimates
    assert allocate([fixed], [4], FLAT16) == [4]
    assert allocate([fixed, [1.0, 0.9, 0.9]], [4, 1], FLAT16, max_tokens=5) == [4, 1]
    assert allocate([[1.0, 0.9, 0.9]], [1], None, max_tokens=2) == [2]
    assert allocate([[1.0, 0.9]], [1], None, fixed_tokens=5, max_tokens=4) == [1]  # the roots always go


# compute-bound: every token costs 10 ms, whatever the forward carries
LINEAR = CostModel({1: 0.01, 2: 0.02, 512: 5.12}, batch_seconds={2: {2: 0.02, 512: 5.12}})


def test_a_prompt_chunk_beside_a_draft_does_not_make_its_nodes_pay():
    """The chunk's own time is spent whatever the cut: a node is weighed against a decoding step's
    rate at its marginal time, not against a step slowed by the prompt (where a 100-token chunk
    would make a 0.5-chance node look worth 10 ms)."""
    assert allocate([[1.0, 0.5]], [1], LINEAR) == [1]  # 1.5 tokens in 20 ms is slower than 1 in 10
    assert allocate([[1.0, 0.5]], [1], LINEAR, fixed_tokens=100, items=2, context=300, fixed_context=200) == [1]
    assert allocate([[1.0, 0.5, 0.5]], [1], LINEAR, fixed_tokens=100, items=2)[0] == 1
    assert allocate([[1.0, 0.9, 0.9]], [1], LINEAR) == [1]  # still slower than 1 token in 10 ms


def test_drafts_beside_a_chunk_go_where_the_curve_is_flat_at_the_chunk():
    """Where the forward with the chunk aboard is memory-bound (rows nearly free there), the
    nodes cost almost nothing and go, as they do alone on a flat curve."""
    flat = CostModel({1: 0.1, 16: 0.1, 64: 0.4}, batch_seconds={2: {2: 0.1, 160: 0.1, 320: 0.4}})
    draft = [1.0, *(0.5 ** d for d in range(1, 12))]
    assert allocate([draft], [1], flat, fixed_tokens=100, items=2) == [len(draft)]
    assert allocate([draft], [1], flat) == [len(draft)]


def test_host_time_is_charged_to_every_step_so_nodes_weigh_less_against_it():
    cost = CostModel({1: 0.1, 2: 0.2, 3: 0.21, 4: 0.4})
    draft = [1, 0.5, 0.1, 0.1]
    assert allocate([draft], [1], cost) == [1]  # 1.5 tokens in 0.2 s is slower than 1 in 0.1
    assert allocate([draft], [1], cost, host_seconds=0.5) == [3]  # 1.6 in 0.71 s beats 1 in 0.6
    sizes = [allocate([draft], [1], cost, host_seconds=h)[0] for h in (0.0, 0.01, 0.1, 0.5, 2.0)]
    assert sizes == sorted(sizes)  # more time outside the forward never takes fewer nodes
    with pytest.raises(TriedecError, match="host_seconds"):
        allocate([draft], [1], cost, host_seconds=-1.0)


def test_observed_forwards_correct_the_calibrated_surface_where_they_ran():
    from triedec.core.costmodel import ObservedCost

    base = CostModel({1: 0.1, 16: 0.2, 64: 0.4}, batch_seconds={4: {4: 0.15, 64: 0.5}})
    observed = ObservedCost(base, weight=0.5, min_observations=2)
    assert observed.seconds(16) == base.seconds(16) and observed.observations() == 0  # nothing seen: the base
    observed.observe(1, 1, None, 0.3)
    assert observed.seconds(1) == base.seconds(1)  # one observation is not enough
    observed.observe(1, 1, None, 0.3)
    assert observed.ratio(1, 1) == pytest.approx(3.0) and observed.seconds(1) == pytest.approx(0.3)
    assert observed.ratio(1, 16) == pytest.approx(3.0)  # an unseen shape: the request count's ratio
    assert observed.ratio(4, 8) == pytest.approx(3.0)  # an unseen request count: the overall ratio
    for _ in range(20):  # 16-token forwards run at the calibrated speed: that cell follows them alone
        observed.observe(16, 1, None, 0.2)
    assert observed.ratio(1, 16) == pytest.approx(1.0, abs=1e-3) and observed.ratio(1, 1) == pytest.approx(3.0)
    assert list(observed.seconds_many([1, 16], 1)) == pytest.approx([0.3, 0.2], abs=1e-3)
    observed.observe(1, 1, None, 1e6)  # a wild outlier moves a cell by at most the clamp
    assert observed.ratio(1, 1) <= ObservedCost.HIGH
    observed.observe(1, 1, None, float("nan"))  # and nonsense is ignored
    assert observed.observations() == 23
    with pytest.raises(TriedecError, match="weight"):
        ObservedCost(base, weight=0.0)


def test_bad_arguments_are_refused():
    with pytest.raises(TriedecError):
        allocate([[1.0, 0.5]], [], FLAT16)
    with pytest.raises(TriedecError):
        allocate([[1.0, 0.5]], [3], FLAT16)


@st.composite
def drafts(draw):
    out = []
    for _ in range(draw(st.integers(1, 6))):
        chances = [1.0, *draw(st.lists(st.floats(0, 1), max_size=12))]
        out.append((chances, draw(st.integers(1, len(chances)))))
    return out


@settings(max_examples=200, deadline=None)
@given(drafts(), st.one_of(st.none(), st.integers(1, 60)), st.integers(0, 200))
def test_every_request_gets_a_prefix_of_at_least_its_required_nodes(found, cap, prefill):
    chances, required = [c for c, _ in found], [r for _, r in found]
    for cost in (FLAT16, None):
        counts = allocate(chances, required, cost, fixed_tokens=prefill, max_tokens=cap)
        assert all(r <= n <= len(c) for n, r, c in zip(counts, required, chances, strict=True))
        optional = sum(counts) - sum(required)
        if cap is not None:
            assert optional <= max(0, cap - prefill - sum(required))
        for n, r, c in zip(counts, required, chances, strict=True):
            # an optional node with no chance never goes (its expected gain is 0)
            assert all(min(c[r : i + 1]) > 0 for i in range(r, n))


def test_a_gate_skips_drafting_after_misses_and_backs_off_until_a_node_is_verified():
    from triedec.core.allocate import DraftGate

    gate = DraftGate(patience=2, max_skip=4)
    pattern = []
    for _ in range(24):
        drafts = gate.proposes()
        pattern.append("d" if drafts else ".")
        if drafts:
            gate.verified(proposed=5, verified=0)  # a miss: nodes proposed, none verified
    # two misses, then pauses of 1, 2, 4, 4 steps between single probes that miss again
    assert "".join(pattern) == "dd.d..d....d....d....d.."
    assert gate.skipped == pattern.count(".")
    gate = DraftGate(patience=2)
    for _ in range(10):
        assert gate.proposes()
        gate.verified(proposed=0, verified=0)  # nothing drafted: cheap, never a miss
    gate.verified(5, 0)
    gate.verified(5, 1)  # a verified node resets the count of misses in a row
    gate.verified(5, 0)
    assert gate.proposes() and gate.skipped == 0
    with pytest.raises(TriedecError):
        DraftGate(patience=0)


def test_a_gate_with_a_pace_pauses_drafts_that_no_longer_pay_for_their_host_time():
    """Given the batch's pace, verified drafts that are rarely accepted stop paying once the
    accepted tokens' worth (a moving average, from a prior of 1) falls below the drafting's host
    time; alone (a token costs a whole forward) the same drafts keep going much longer, and an
    accepted probe reopens the gate."""
    from triedec.core.allocate import DraftGate, Pace

    def steps_until_paused(token_seconds: float) -> int:
        pace = Pace()
        pace.observe(token_seconds * 10, 10)
        assert pace.token_seconds == pytest.approx(token_seconds)
        gate = DraftGate(patience=2, pace=pace)
        for step in range(200):
            if not gate.proposes():
                return step
            gate.verified(proposed=4, verified=2, accepted=0, draft_seconds=0.0007)
        return 200

    crowded, alone = steps_until_paused(0.005), steps_until_paused(0.040)
    assert crowded == 10  # 0.8**9 * 5 ms < 0.7 ms at the 9th drafted step, then a second miss
    assert alone == 20  # 0.8**19 * 40 ms < 0.7 ms
    gate = DraftGate(patience=2, pace=Pace())
    for _ in range(30):  # no pace yet (no step seen): verified nodes keep it open, as without a pace
        assert gate.proposes()
        gate.verified(4, 2, 0, 0.0007)
    gate.pace.observe(0.005, 1)
    gate.verified(4, 2, 0, 0.0007)
    gate.verified(4, 2, 0, 0.0007)
    assert not gate.proposes()  # two misses at this pace: one step skipped
    assert gate.proposes()
    gate.verified(4, 4, 4, 0.0007)  # the probe accepted 4 tokens: it pays again
    assert gate.misses == 0 and gate.skip == 1 and gate.proposes()
    gate.verified(0, 0, 0, 0.0)  # nothing drafted: no evidence
    assert gate.accepted > 0.7
    with pytest.raises(TriedecError):
        Pace(weight=0)
    with pytest.raises(TriedecError):
        DraftGate(weight=1.5)
    pace = Pace()
    pace.observe(1.0, 0)  # a step that committed nothing teaches nothing
    assert pace.token_seconds == 0.0
    pace.observe(0.010, 2)
    pace.observe(0.020, 2)
    assert pace.token_seconds == pytest.approx(0.005 + 0.2 * 0.005)


@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=60))
@settings(max_examples=60, deadline=None)
def test_a_gate_never_pauses_longer_than_its_cap_and_a_verified_node_reopens_it(outcomes):
    from triedec.core.allocate import DraftGate

    gate = DraftGate(patience=2, max_skip=8)
    run = 0
    for proposed, verified in outcomes:
        if not gate.proposes():
            run += 1
            assert run <= 8
            continue
        run = 0
        verified = min(verified, proposed)
        gate.verified(proposed, verified)
        if verified:
            assert gate.proposes()  # the next step drafts


def test_a_payoff_drafts_only_where_drafting_measurably_pays_and_explores_the_other_arm():
    """The A/B controller over steps: drafting is the prior; both arms get measured in pairs (one
    step in ``warmup`` runs the plain arm until the level has ``min_pairs`` pairs), then the faster
    arm runs but for one step in ``explore``; load levels are kept apart, and a change in what pays
    is followed."""
    from triedec.core.allocate import DraftPayoff, load_level

    assert [load_level(b) for b in (0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 40)] == [1, 1, 2, 3, 4, 4, 4, 8, 8, 16, 32]
    payoff = DraftPayoff(explore=16, warmup=4, min_pairs=4)

    def run(requests: int, steps: int, draft_rate: float, plain_rate: float) -> str:
        arms = []
        for _ in range(steps):
            drafted = payoff.drafts(requests)
            arms.append("d" if drafted else ".")
            payoff.observe(requests, drafted, 1.0, int(draft_rate if drafted else plain_rate))
        return "".join(arms)

    first = run(16, 16, draft_rate=70, plain_rate=100)  # drafting is slower at 16 requests
    assert first == "ddd.ddd.ddd.ddd." and payoff.pairs(16) == 4 and payoff.speedup(16) == pytest.approx(0.7)
    later = run(16, 160, draft_rate=70, plain_rate=100)
    assert later.count("d") == 10 and not payoff.prefers_drafting(16)  # one step in 16 explores
    assert payoff.prefers_drafting(1) and payoff.speedup(1) is None  # another level: nothing known, the prior
    alone = run(1, 160, draft_rate=180, plain_rate=100)  # alone, drafting pays
    assert alone[:16] == "ddd.ddd.ddd.ddd." and alone[16:].count(".") == 9 and payoff.speedup(1) == pytest.approx(1.8)
    turned = run(16, 1200, draft_rate=130, plain_rate=100)  # the load's drafts got better: followed within a window
    assert turned.index("dd") < 16 * 32 and turned[-160:].count(".") == 10 and payoff.prefers_drafting(16)
    report = payoff.report()
    assert set(report) == {1, 16} and report[16]["drafting"] and report[1]["speedup"] == pytest.approx(1.8)
    # a step that is not measured (prompt chunks aboard) drafts only where pairs measured drafting to pay
    assert payoff.drafts(16, measured=False) and payoff.drafts(1, measured=False)
    assert not payoff.drafts(2, measured=False) and payoff.prefers_drafting(2)  # level 2: the prior only
    pairs = payoff.pairs(1)
    payoff.observe(1, False, 1.0, 1)
    payoff.observe(1, True, 0.0, 3)  # a step that took no time, or a bad count, teaches nothing and breaks a pair
    payoff.observe(1, True, float("nan"), 3)
    payoff.observe(1, True, 1.0, -1)
    assert payoff.pairs(1) == pairs and payoff.speedup(1) == pytest.approx(1.8)
    payoff.observe(1, True, 1.0, 3)
    payoff.observe(2, False, 1.0, 3)  # another number of requests: no pair
    payoff.observe(2, False, 1.0, 3)  # the same arm: no pair
    assert payoff.pairs(1) == pairs and payoff.pairs(2) == 0
    for bad in ({"explore": 1}, {"warmup": True}, {"min_pairs": 0}, {"window": 0.5}):
        with pytest.raises(TriedecError):
            DraftPayoff(**bad)


@given(st.integers(0, 2**31), st.integers(2, 12))
@settings(max_examples=40, deadline=None)
def test_a_payoff_does_not_mistake_the_load_inside_a_level_for_a_difference_between_identical_arms(seed, every):
    """Two identical arms (``ar``'s) at a load that falls from 15 requests to 8 as requests finish:
    a step's rate depends on how many requests it carries, and the rarely run arm runs at other
    loads than the other. Compared in pairs at the same load, the arms measure equal, whatever the
    machine's speed does meanwhile."""
    from triedec.core.allocate import DraftPayoff

    rng = random.Random(seed)
    payoff = DraftPayoff(explore=16, warmup=4, min_pairs=4)
    requests, machine = 15, 1.0
    for step in range(1, 600):
        if step % every == 0 and requests > 8:
            requests -= 1  # a request finished
        machine *= math.exp(rng.gauss(0, 0.02))  # the machine's speed drifts
        jitter = math.exp(rng.gauss(0, 0.01))
        drafted = payoff.drafts(requests)
        payoff.observe(requests, drafted, machine * jitter * (0.004 + 0.0011 * requests), requests)
    assert payoff.pairs(8) >= 4
    assert payoff.speedup(8) == pytest.approx(1.0, rel=0.03)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=300), st.floats(1.2, 5.0), st.booleans())
@settings(max_examples=60, deadline=None)
def test_a_payoff_runs_the_slower_arm_on_at_most_its_exploration_share_once_both_are_measured(loads, factor,
                                                                                              drafting_wins):
    """Whatever the sequence of loads, once a level's arms are measured and one arm is slower by a
    steady factor, the slower arm runs on at most one step in ``explore`` (plus one) at that level."""
    from triedec.core.allocate import DraftPayoff, load_level

    payoff = DraftPayoff(explore=8, warmup=2, min_pairs=2)
    slower: dict[int, int] = {}
    decided: dict[int, int] = {}
    for requests in loads:
        draft_seconds, plain_seconds = (1.0, factor) if drafting_wins else (factor, 1.0)
        level = load_level(requests)
        measured = payoff.speedup(level) is not None
        drafted = payoff.drafts(requests)
        if measured:
            decided[level] = decided.get(level, 0) + 1
            slower[level] = slower.get(level, 0) + int(drafted != drafting_wins)
        payoff.observe(requests, drafted, draft_seconds if drafted else plain_seconds, 4)
    for level, count in decided.items():
        assert slower[level] <= count // 8 + 1


def test_a_payoff_explores_less_once_a_levels_verdict_is_clear():
    """With ``settle``, a level with ``settle_pairs`` pairs whose slower arm is clearly slower
    explores it one step in ``explore x settle``; a close call keeps exploring one in ``explore``."""
    from triedec.core.allocate import DraftPayoff

    for factor, period in ((2.0, 64), (1.05, 16)):  # drafting 2x slower: settled; 5% slower: not
        payoff = DraftPayoff(explore=16, warmup=2, min_pairs=4, settle=4, settle_pairs=16)
        explored = []
        for step in range(2000):
            drafted = payoff.drafts(20)
            payoff.observe(20, drafted, factor if drafted else 1.0, 4)
            if step >= 400:
                explored.append(drafted)
        assert payoff.settled(16) is (factor > 1.5)
        assert abs(sum(explored) - len(explored) / period) <= 2, (factor, sum(explored))
    with pytest.raises(TriedecError):
        DraftPayoff(settle=0)
    with pytest.raises(TriedecError):
        DraftPayoff(settle_margin=1.5)
