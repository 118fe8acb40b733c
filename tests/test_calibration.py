"""The cost model (pure), the calibration file, and the measurements on a tiny model: what is
measured, when, and that a recycling tree size is kept only if it really beats ``ar``."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import fake_cost, monotone_rates

import triedec
from triedec import calibration
from triedec.calibration import Calibration, load_or_calibrate
from triedec.costmodel import CostModel, best_count
from triedec.drafters.recycling import RecyclingProfile, best_nodes
from triedec.errors import TriedecError

# ---- the cost model ------------------------------------------------------------------------------


def test_cost_model_interpolates_a_non_decreasing_envelope():
    cost = CostModel({1: 0.1, 2: 0.2, 4: 0.15, 8: 0.4})
    assert cost.seconds(1) == 0.1 and cost.seconds(2) == 0.2
    assert cost.seconds(3) == pytest.approx(0.2)  # 4 measured cheaper than 2: the envelope holds 0.2
    assert cost.seconds(6) == pytest.approx(0.3)
    assert cost.seconds(10) == pytest.approx(0.5)  # extrapolated from the last two sizes
    assert cost.ratio(8) == pytest.approx(4.0) and cost.break_even(8) == pytest.approx(3.0)
    assert CostModel({1: 0.1}).seconds(50) == 0.1
    with pytest.raises(TriedecError):
        cost.seconds(0)


@pytest.mark.parametrize("bad", [{}, {0: 0.1}, {1: -1.0}, {1: float("nan")}, {1: float("inf")}, {"x": 1}])
def test_cost_model_refuses_bad_curves(bad):
    with pytest.raises(TriedecError):
        CostModel(bad)


def test_cost_model_round_trips_through_a_dict():
    cost = CostModel({1: 0.1, 17: 0.2}, 256, {"repeats": 3})
    assert CostModel.from_dict(json.loads(json.dumps(cost.as_dict()))) == cost
    with pytest.raises(TriedecError):
        CostModel.from_dict({"nope": 1})


def test_best_count_keeps_nodes_while_they_pay():
    cost = CostModel({1: 0.1, 2: 0.2, 3: 0.21, 4: 0.4})
    assert best_count([0.9, 0.9, 0.9], cost) == 2  # 2.8 tokens in 0.21 s beats 1.9 in 0.2 and 1 in 0.1
    assert best_count([0.5, 0.1, 0.1], cost) == 0  # 1.5 tokens in 0.2 s is slower than a plain step
    assert best_count([0.5, 0.1, 0.0], None) == 2  # a flat curve: every node with a chance
    assert best_count([], cost) == 0


# ---- the calibration file ------------------------------------------------------------------------


def test_calibration_json_round_trip_and_validation():
    profile = RecyclingProfile(tuple(monotone_rates()), 12, {"predicted_nodes": 12})
    cal = Calibration("m", "cpu-2threads-float32", "torch.float32", fake_cost(), profile, {"seconds_taken": 1.0})
    again = Calibration.from_json(cal.to_json())
    assert again == cal and again.profiles() == {"recycling": profile}
    cost_only = dataclasses.replace(cal, recycling=None)
    assert Calibration.from_json(cost_only.to_json()).profiles() == {}
    for text in ("{}", "not json", json.dumps({"format": "triedec-calibration-1"})):
        with pytest.raises(TriedecError):
            Calibration.from_json(text)


# ---- measuring, on a tiny model ------------------------------------------------------------------


@pytest.fixture
def tiny_lm(tiny_model_dir, tmp_path):
    return triedec.load(tiny_model_dir, cache_dir=tmp_path)


def test_only_what_a_method_needs_is_measured_and_it_is_cached(tiny_lm, monkeypatch):
    measured = []
    real_cost, real_profile = calibration.measure_cost_model, calibration.measure_recycling_profile
    monkeypatch.setattr(calibration, "measure_cost_model",
                        lambda lm, repeats: measured.append("cost") or real_cost(lm, sizes=(1, 2, 9), repeats=1))
    monkeypatch.setattr(calibration, "measure_recycling_profile",
                        lambda lm, cost, prompts, n: measured.append("recycling") or real_profile(lm, cost, 2, 4))
    tiny_lm.generate("hi", "ar", max_new_tokens=2)
    tiny_lm.generate("hi", "ngram-trie", max_new_tokens=2, sized=False)
    tiny_lm.generate("hi", "recycling", max_new_tokens=2, nodes=80)
    assert measured == []  # none of these needs a measurement
    tiny_lm.generate("hi", "pld", max_new_tokens=2)  # min_expected from the cost curve
    assert measured == ["cost"]
    tiny_lm.generate("hi", "recycling", max_new_tokens=2)  # the profile is added to the same file
    assert measured == ["cost", "recycling"]
    files = list((tiny_lm.cache_dir / "calibration").glob("*.json"))
    assert len(files) == 1 and Calibration.from_json(files[0].read_text()).recycling is not None
    again = triedec.load(tiny_lm.model.name_or_path, cache_dir=tiny_lm.cache_dir)
    again.generate("hi", "recycling", max_new_tokens=2)
    assert measured == ["cost", "recycling"]  # read from the cache, not measured again


def test_a_stale_calibration_file_is_measured_again(tiny_lm, monkeypatch):
    path = calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": "triedec-calibration-1", "forward_seconds": {"1": 0.1}}))
    monkeypatch.setattr(calibration, "measure_cost_model", lambda lm, repeats: fake_cost())
    cal = load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"cost"}))
    assert cal.cost == fake_cost() and Calibration.from_json(path.read_text()).cost == fake_cost()
    with pytest.raises(TriedecError, match="nothing to calibrate"):
        load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"warp"}))


def test_the_cost_curve_is_measured_per_tree_size(tiny_lm):
    cost = calibration.measure_cost_model(tiny_lm, sizes=(1, 2, 17), context_tokens=32, repeats=2)
    assert set(cost.forward_seconds) == {1, 2, 17} and all(s > 0 for s in cost.forward_seconds.values())
    assert cost.context_tokens == 32 and cost.details["repeats"] == 2
    with pytest.raises(TriedecError, match="cost sizes"):
        calibration.measure_cost_model(tiny_lm, sizes=(0,), repeats=1)


CURVE = CostModel({1: 0.1, 2: 0.1, 4: 0.1, 9: 0.12, 81: 0.5})


@pytest.mark.parametrize(("speedup", "kept"), [(1.2, True), (1.02, False), (0.8, False)])
def test_the_predicted_size_is_kept_only_if_it_really_beats_ar(monkeypatch, speedup, kept):
    """The prediction (cost curve x node rates) is checked end to end; below the margin, 0 nodes."""
    monkeypatch.setattr(calibration, "calibration_prompts", lambda n: ["a"] * n)
    monkeypatch.setattr(calibration, "measure_recycling_rates", lambda lm, texts, n: tuple(monotone_rates()))
    checked = []

    def end_to_end(lm, texts, cost, profile, n):
        checked.append(profile.nodes)
        return {"speedup": speedup}

    monkeypatch.setattr(calibration, "measure_end_to_end", end_to_end)
    profile = calibration.measure_recycling_profile(None, CURVE, prompts=3, max_new_tokens=8)
    predicted = best_nodes(monotone_rates(), CURVE)
    assert predicted > 0 and checked == [predicted]
    assert profile.details["predicted_nodes"] == predicted
    assert profile.nodes == (predicted if kept else 0)
    with pytest.raises(TriedecError, match="margin"):
        calibration.measure_recycling_profile(None, CURVE, margin=1.5)


def test_the_end_to_end_check_runs_for_real(monkeypatch, tiny_lm):
    """Whatever the device measures, a predicted size above 0 goes through the real end-to-end
    check (ar against recycling on real prompts); the rates are forced so that the prediction is
    above 0 on any machine."""
    monkeypatch.setattr(calibration, "measure_recycling_rates", lambda lm, texts, n: tuple(monotone_rates()))
    profile = calibration.measure_recycling_profile(tiny_lm, CURVE, prompts=3, max_new_tokens=8)
    check = profile.details["end_to_end"]
    assert profile.details["predicted_nodes"] == best_nodes(monotone_rates(), CURVE) > 0
    assert 0 < check["tokens"] <= 2 * 8
    assert check["ar_seconds"] > 0 and check["recycling_seconds"] > 0
    assert check["speedup"] == pytest.approx(check["ar_seconds"] / check["recycling_seconds"], rel=0.05)
    assert profile.nodes in (0, profile.details["predicted_nodes"])
