"""The cost model (pure), the calibration file, and the measurements on a tiny model: what is
measured, when, that profiles are measured generically, and that a recycling tree size is kept
only if it really beats ``ar``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import fake_cost, monotone_rates

import triedec
from triedec.api import calibration
from triedec.api.calibration import Bench, Calibration, load_or_calibrate
from triedec.core import machine
from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError
from triedec.core.params import CALIBRATION_EFFORT_ENV, CALIBRATION_EFFORTS
from triedec.drafters import recycling
from triedec.drafters import registry as drafter_registry
from triedec.drafters.template import RecyclingProfile, best_nodes

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


def test_cost_surface_interpolates_requests_tokens_and_context():
    cost = CostModel({1: 0.1, 16: 0.2}, 256, {}, {2: {2: 0.12, 32: 0.3}, 8: {8: 0.2, 64: 0.6}}, 1e-5)
    assert cost.seconds(1) == 0.1 and cost.seconds(16) == 0.2  # one request: the curve
    assert cost.seconds(2, requests=2) == pytest.approx(0.12)
    assert cost.seconds(17, requests=2) == pytest.approx(0.21)  # halfway along the 2-request row
    # between 2 and 8 requests: linear in requests at the same token count
    assert cost.seconds(32, requests=5) == pytest.approx(0.3 + (0.2 + (0.6 - 0.2) * 24 / 56 - 0.3) * 3 / 6)
    assert cost.seconds(64, requests=16) >= cost.seconds(64, requests=8)  # beyond the last row: never cheaper
    assert cost.seconds(8, requests=8, context=8 * 256 + 1000) == pytest.approx(0.2 + 0.01)  # 1,000 more tokens
    assert cost.seconds(8, requests=8, context=0) >= 0.1  # a shorter context saves at most half
    with pytest.raises(TriedecError):
        cost.seconds(1, requests=0)
    with pytest.raises(TriedecError):
        CostModel({1: 0.1}, batch_seconds={1: {1: 0.1}})  # the 1-request curve is forward_seconds
    with pytest.raises(TriedecError):
        CostModel({1: 0.1}, context_seconds=-1.0)
    again = CostModel.from_dict(json.loads(json.dumps(cost.as_dict())))
    assert again == cost and again.seconds(17, requests=3) == cost.seconds(17, requests=3)


# ---- the calibration file ------------------------------------------------------------------------


def test_calibration_json_round_trip_and_validation():
    profile = RecyclingProfile(tuple(monotone_rates()), 12, {"predicted_nodes": 12})
    cal = Calibration("m", "cpu-2threads-float32", "torch.float32", fake_cost(), {"recycling": profile},
                      {"seconds_taken": 1.0})
    again = Calibration.from_json(cal.to_json())
    assert again == cal and dict(again.profiles) == {"recycling": profile}
    cost_only = dataclasses.replace(cal, profiles={})
    assert dict(Calibration.from_json(cost_only.to_json()).profiles) == {}
    for text in ("{}", "not json", json.dumps({"format": "triedec-calibration-2"})):
        with pytest.raises(TriedecError):
            Calibration.from_json(text)


# ---- measuring, on a tiny model ------------------------------------------------------------------


class QuietWatch:
    """A :class:`machine.CpuWatch` that finds the machine quiet."""

    others_share = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def tiny_lm(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model on a cache of its own, measured as on a quiet machine: these tests check what
    is measured when, and a fake measurement that takes no time would be marked busy whenever other
    processes run (the busy tests below put their own watch in; the CpuWatch tests read the real one)."""
    monkeypatch.setattr(calibration, "CpuWatch", QuietWatch)
    return triedec.load(tiny_model_dir, cache_dir=tmp_path)


REAL_COST_MODEL = calibration.measure_cost_model


def small_cost_model(lm, repeats=1, progress=None):
    return REAL_COST_MODEL(lm, sizes=(1, 2, 9), batch=((2, (1, 2)),), context_tokens=16,
                                          long_context=40, repeats=1)


def test_only_what_a_method_needs_is_measured_and_it_is_cached(tiny_lm, monkeypatch):
    measured = []
    monkeypatch.setattr(calibration, "measure_cost_model",
                        lambda lm, repeats, progress: measured.append("cost") or small_cost_model(lm))
    spec = drafter_registry._REGISTRY["recycling"]

    def profile(bench):
        measured.append("recycling")
        return recycling.measure_profile(Bench(bench.lm, bench.info.cost, 2, 4))

    monkeypatch.setitem(drafter_registry._REGISTRY, "recycling",
                        dataclasses.replace(spec, profile=dataclasses.replace(spec.profile, measure=profile)))
    tiny_lm.generate("hi", "ar", max_new_tokens=2)
    tiny_lm.generate("hi", "ngram-trie", max_new_tokens=2, sized=False)
    tiny_lm.generate("hi", "recycling", max_new_tokens=2, nodes=80)
    assert measured == []  # none of these needs a measurement
    tiny_lm.generate("hi", "pld", max_new_tokens=2)  # min_expected from the cost curve
    assert measured == ["cost"]
    tiny_lm.generate("hi", "recycling", max_new_tokens=2)  # the profile is added to the same file
    assert measured == ["cost", "recycling"]
    files = list((tiny_lm.cache_dir / "calibration").glob("*.json"))
    assert len(files) == 1 and "recycling" in Calibration.from_json(files[0].read_text()).profiles
    again = triedec.load(tiny_lm.model.name_or_path, cache_dir=tiny_lm.cache_dir)
    again.generate("hi", "recycling", max_new_tokens=2)
    assert measured == ["cost", "recycling"]  # read from the cache, not measured again


def test_a_stale_calibration_file_is_measured_again(tiny_lm, monkeypatch):
    path = calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": "triedec-calibration-1", "forward_seconds": {"1": 0.1}}))
    monkeypatch.setattr(calibration, "measure_cost_model", lambda lm, repeats, progress: fake_cost())
    cal = load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"cost"}))
    assert cal.cost == fake_cost() and Calibration.from_json(path.read_text()).cost == fake_cost()
    with pytest.raises(TriedecError, match="nothing to calibrate"):
        load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"warp"}))


def test_a_long_device_key_gets_a_file_name_the_file_system_takes(tiny_lm, monkeypatch):
    """A long CPU name with the kernels and the layer mix passed 255 bytes (a Xeon's, with the
    lock's suffix): the name is cut and ends in a digest of the whole key, so two keys that differ
    only past the cut get files of their own, and the calibration is written, locked and read."""
    long_key = "cpu-" + "Intel-R--Xeon-R--Processor-" * 10 + "{}"
    monkeypatch.setattr(calibration, "device_key", lambda adapter: long_key.format("a"))
    path = calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter)
    assert len(path.stem) == calibration.CALIBRATION_NAME_LIMIT and len(path.with_suffix(".lock").name) < 255
    assert path.name.startswith(f"{tiny_lm.adapter.model_id}-cpu-Intel")
    monkeypatch.setattr(calibration, "measure_cost_model", lambda lm, repeats, progress: fake_cost())
    assert load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"cost"})).cost == fake_cost()
    assert Calibration.from_json(path.read_text()).cost == fake_cost()
    monkeypatch.setattr(calibration, "device_key", lambda adapter: long_key.format("b"))
    other = calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter)
    assert other != path and len(other.stem) == len(path.stem)
    monkeypatch.setattr(calibration, "device_key", lambda adapter: "cpu-short")
    assert calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter).name == \
        f"{tiny_lm.adapter.model_id}-cpu-short.json"


class FakeWatch:
    """A :class:`machine.CpuWatch` that reports a given share."""

    share = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.others_share = FakeWatch.share


def test_a_calibration_measured_on_a_busy_machine_is_marked_and_measured_again(tiny_lm, monkeypatch):
    measured = []
    monkeypatch.setattr(calibration, "measure_cost_model",
                        lambda lm, repeats, progress: measured.append("cost") or fake_cost())
    monkeypatch.setattr(calibration, "CpuWatch", FakeWatch)
    path = calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter)
    FakeWatch.share = 0.6
    busy = load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"cost"}))
    assert busy.busy and busy.details["others_cpu_share"] == 0.6 and measured == ["cost"]
    assert Calibration.from_json(path.read_text()).busy  # used for now, but the file says so
    FakeWatch.share = 0.05
    quiet = load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"cost"}))
    assert not quiet.busy and measured == ["cost", "cost"]  # measured again on the next load
    load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"cost"}))
    assert measured == ["cost", "cost"]  # a quiet one is kept
    FakeWatch.share = None  # counters unreadable (not Linux): nothing to say, nothing marked
    assert not dataclasses.replace(quiet, details={"others_cpu_share": None}).busy


def test_a_quick_calibration_records_its_effort_and_is_measured_in_full_when_asked(tiny_lm, monkeypatch):
    repeats_used, sized = [], []
    monkeypatch.setattr(calibration, "measure_cost_model",
                        lambda lm, repeats, progress: repeats_used.append(repeats) or fake_cost())
    spec = drafter_registry._REGISTRY["recycling"]

    def profile(bench):
        sized.append((bench.prompt_count, bench.max_new_tokens))
        return RecyclingProfile(tuple(monotone_rates()), 0, {})

    monkeypatch.setitem(drafter_registry._REGISTRY, "recycling",
                        dataclasses.replace(spec, profile=dataclasses.replace(spec.profile, measure=profile)))
    quick, full = CALIBRATION_EFFORTS["quick"], CALIBRATION_EFFORTS["full"]
    needs = frozenset({"cost", "recycling"})
    monkeypatch.setenv(CALIBRATION_EFFORT_ENV, "quick")
    cal = load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs)
    assert cal.effort == "quick" and repeats_used == [quick.repeats]
    assert sized == [(quick.prompts, quick.max_new_tokens)]
    assert load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs).effort == "quick" and len(repeats_used) == 1
    monkeypatch.delenv(CALIBRATION_EFFORT_ENV)  # full by default: the quick file is not good enough
    cal = load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs)
    assert cal.effort == "full" and repeats_used == [quick.repeats, full.repeats]
    assert sized[-1] == (full.prompts, full.max_new_tokens)
    path = calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter)
    assert Calibration.from_json(path.read_text()).effort == "full"
    # a full one serves a quick request; hand-sized parts make a custom one, kept for either
    assert load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs, effort="quick").effort == "full"
    assert len(repeats_used) == 2
    custom = load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs, force=True, effort="quick", repeats=3)
    assert custom.effort == "custom" and repeats_used[-1] == 3 and sized[-1] == (quick.prompts, quick.max_new_tokens)
    assert load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs).effort == "custom" and len(repeats_used) == 3
    hand_sized = Calibration.from_json(path.read_text())
    calibration._write(path, dataclasses.replace(hand_sized, profiles={}))
    assert load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs, effort="full").effort == "custom"  # its cost model
    # a cost model measured in full with a profile added quickly is a quick calibration
    load_or_calibrate(tiny_lm, tiny_lm.cache_dir, frozenset({"cost"}), force=True, effort="full")
    assert Calibration.from_json(path.read_text()).effort == "full"
    dropped = Calibration.from_json(path.read_text())
    calibration._write(path, dataclasses.replace(dropped, profiles={}))
    assert load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs, effort="quick").effort == "quick"
    monkeypatch.setenv(CALIBRATION_EFFORT_ENV, "thorough")
    with pytest.raises(TriedecError, match=CALIBRATION_EFFORT_ENV):
        load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs)
    with pytest.raises(TriedecError, match="effort must be one of"):
        load_or_calibrate(tiny_lm, tiny_lm.cache_dir, needs, effort="slow")


def test_processes_sharing_a_cache_directory_measure_a_calibration_once(tiny_model_dir, tmp_path):
    """Two processes load the same model on the same cache directory at once: one measures (under
    the lock beside the file), the other waits and reads what it wrote."""
    script = textwrap.dedent(f"""
        import json, sys, time
        import triedec
        from triedec.api import calibration
        from helpers import fake_cost
        measured = []
        def slow(lm, repeats, progress):
            measured.append(1)
            time.sleep(2.0)  # long enough that the other process arrives while this one measures
            return fake_cost()
        calibration.measure_cost_model = slow

        class Quiet:  # the sleep leaves the CPU to others: not a busy measurement
            others_share = 0.0
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                pass
        calibration.CpuWatch = Quiet
        lm = triedec.load({str(tiny_model_dir)!r}, cache_dir={str(tmp_path)!r})
        print(sys.argv[1], sys.stdin.readline().strip(), flush=True)  # both loaded: go together
        cal = lm.calibration()
        print(json.dumps({{"measured": len(measured), "cost": cal.cost.as_dict()}}), flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for i in range(2)]
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["measured"] for r in results) == [0, 1]
    assert results[0]["cost"] == results[1]["cost"] == fake_cost().as_dict()
    (lock,) = (tmp_path / "calibration").glob("*.lock")
    assert lock.stat().st_mode & 0o077 == 0  # readable only by its owner


def test_a_measurement_stops_within_one_forward_when_asked(tiny_lm):
    asked = []

    def stop() -> bool:
        asked.append(True)
        return len(asked) >= 3

    with pytest.raises(calibration.Interrupted, match="after 3 of"):
        calibration.measure_cost_model(tiny_lm, sizes=(1, 2), batch=((2, (1,)),), context_tokens=16,
                                       long_context=32, repeats=1, should_stop=stop)
    assert len(asked) == 3


def _fake_measure(lm, repeats, progress=None, should_stop=None):
    return fake_cost()


def test_a_busy_calibration_is_measured_again_in_process_with_its_profiles_kept(tiny_lm, monkeypatch):
    monkeypatch.setattr(calibration, "CpuWatch", FakeWatch)
    monkeypatch.setattr(calibration, "measure_cost_model", _fake_measure)
    path = calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter)
    assert tiny_lm.remeasure_if_busy() is False  # nothing loaded yet: nothing to do
    FakeWatch.share = 0.6
    busy = tiny_lm.calibration()
    profiles = {"recycling": RecyclingProfile(tuple(monotone_rates()), 8)}
    tiny_lm.calibrator._calibration = busy = dataclasses.replace(busy, profiles=profiles)
    assert busy.busy
    FakeWatch.share = 0.7  # still busy: measured, used, still marked
    assert tiny_lm.remeasure_if_busy() is False and tiny_lm.loaded_calibration().busy
    FakeWatch.share = 0.05
    assert tiny_lm.remeasure_if_busy() is True
    quiet = tiny_lm.loaded_calibration()
    assert not quiet.busy and quiet.profiles == profiles and quiet.details["remeasured"] == "while idle"
    assert Calibration.from_json(path.read_text()) == quiet  # written over the cached file
    assert tiny_lm.remeasure_if_busy() is True  # a quiet one is left alone


def test_an_idle_server_measures_a_busy_calibration_again_and_stops_for_work(tiny_lm, monkeypatch):
    import threading
    import time

    from triedec.engine.batch import BatchLimits
    from triedec.server.scheduler import Scheduler

    monkeypatch.setattr(calibration, "CpuWatch", FakeWatch)
    monkeypatch.setattr(calibration, "measure_cost_model", _fake_measure)
    FakeWatch.share = 0.6
    assert tiny_lm.calibration().busy
    measuring = threading.Event()

    def until_work_arrives(lm, repeats, progress=None, should_stop=None):
        measuring.set()
        while not should_stop():
            time.sleep(0.005)
        raise calibration.Interrupted("work arrived")

    monkeypatch.setattr(calibration, "measure_cost_model", until_work_arrives)
    scheduler = Scheduler(tiny_lm, BatchLimits(), 4, remeasure_after=0.1)
    try:
        scheduler.call(lambda: None).result(timeout=30)  # starts the loop
        assert measuring.wait(30)  # idle 0.1 s with a busy calibration: measuring again
        assert scheduler.call(lambda: 42).result(timeout=30) == 42  # the call stopped it and ran
        assert tiny_lm.loaded_calibration().busy  # nothing half-measured was kept
        FakeWatch.share = 0.05
        monkeypatch.setattr(calibration, "measure_cost_model", _fake_measure)
        scheduler.call(lambda: None).result(timeout=30)  # ends a measurement begun in between
        deadline = time.monotonic() + 30
        while tiny_lm.loaded_calibration().busy and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not tiny_lm.loaded_calibration().busy
    finally:
        scheduler.close()
    with pytest.raises(TriedecError, match="remeasure_after"):
        Scheduler(tiny_lm, BatchLimits(), 4, remeasure_after=0)


@pytest.mark.parametrize(("cores", "threads", "others", "share"), [
    (2, 2, 0.5, 0.25),   # a 2-core machine: the others' share of it
    (2, 2, 2.0, 1.0),
    (64, 2, 62.0, 0.0),  # 62 busy cores elsewhere on a 64-core host take nothing from 2 threads
    (64, 2, 63.0, 0.5),
    (4, 8, 1.0, 0.25),   # more threads than cores: the whole machine
])
def test_the_cpu_watch_counts_only_the_time_others_take_from_this_processes_cores(monkeypatch, cores, threads,
                                                                                    others, share):
    """One second of wall time: ``cores`` CPU-seconds in all, this process used none of them."""
    counters = iter([(0.0, 0.0, 0.0), (others, float(cores), 0.0)])
    monkeypatch.setattr(machine, "_cpu_counters", lambda: next(counters))
    monkeypatch.setattr(machine.os, "cpu_count", lambda: cores)
    with machine.CpuWatch(threads) as watch:
        pass
    assert watch.others_share == pytest.approx(share)


def test_the_cpu_watch_counts_other_processes_and_not_this_one():
    """Spinning processes beside this one make a watch busy; this process's own spinning is
    counted in its own CPU time."""
    import subprocess
    import sys
    import time

    if machine._cpu_counters() is None:
        pytest.skip("no /proc/stat here")
    import os

    cores = os.cpu_count() or 1  # measured as if this process needed every core: half of them spin
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((cores + 1) // 2)]
    try:
        time.sleep(0.3)
        with machine.CpuWatch(cores) as watch:
            time.sleep(1.0)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert watch.others_share is not None and watch.others_share > calibration.BUSY_SHARE
    # this process's own work is counted as its own (and CpuWatch subtracts it: the arithmetic is
    # the test above); checked on the counters, which other tests running beside this one (the
    # suite's other worker) cannot move
    start, cpu = machine._cpu_counters(), time.process_time()
    while time.process_time() - cpu < 0.5:
        pass
    stop = machine._cpu_counters()
    busy, _, ours = (b - a for a, b in zip(start, stop, strict=True))
    assert ours >= 0.45 and busy >= ours - 0.05, (busy, ours)


def test_the_cost_model_is_measured_per_tree_size_and_request_count(tiny_lm):
    ticks = []
    cost = calibration.measure_cost_model(tiny_lm, sizes=(1, 2, 17), batch=((2, (1, 4)), (3, (2,))),
                                          context_tokens=32, long_context=100, repeats=2,
                                          progress=lambda done, total: ticks.append((done, total)))
    assert ticks == [(i, 3 * 7) for i in range(1, 22)]  # (repeats + warm-up) x (6 points + long)
    assert set(cost.forward_seconds) == {1, 2, 17} and all(s > 0 for s in cost.forward_seconds.values())
    assert {b: set(row) for b, row in cost.batch_seconds.items()} == {2: {2, 8}, 3: {6}}
    assert cost.context_tokens == 32 and cost.details["repeats"] == 2 and cost.context_seconds >= 0
    with pytest.raises(TriedecError, match="cost sizes"):
        calibration.measure_cost_model(tiny_lm, sizes=(0,), batch=(), repeats=1)


CURVE = CostModel({1: 0.1, 2: 0.1, 4: 0.1, 9: 0.12, 81: 0.5})


class FakeBench:
    """A calibration bench whose prompts are never decoded (the measurements are replaced)."""

    def __init__(self, cost):
        self.info = triedec.ModelInfo(48, torch.device("cpu"), "m", cost)
        self.prompt_count, self.max_new_tokens = 3, 8

    def prompts(self, count):
        return [[1, 2, 3]] * count


@pytest.mark.parametrize(("speedup", "kept"), [(1.2, True), (1.02, False), (0.8, False)])
def test_the_predicted_size_is_kept_only_if_it_really_beats_ar(monkeypatch, speedup, kept):
    """The prediction (cost curve x node rates) is checked end to end; below the margin, 0 nodes."""
    monkeypatch.setattr(recycling, "measure_rates", lambda bench, prompts, n: tuple(monotone_rates()))
    checked = []

    def end_to_end(bench, prompts, profile, n):
        checked.append(profile.nodes)
        return {"speedup": speedup}

    monkeypatch.setattr(recycling, "measure_end_to_end", end_to_end)
    profile = recycling.measure_profile(FakeBench(CURVE))
    predicted = best_nodes(monotone_rates(), CURVE)
    assert predicted > 0 and checked == [predicted]
    assert profile.details["predicted_nodes"] == predicted
    assert profile.nodes == (predicted if kept else 0)
    with pytest.raises(TriedecError, match="margin"):
        recycling.measure_profile(FakeBench(CURVE), margin=1.5)


def test_the_end_to_end_check_runs_for_real(monkeypatch, tiny_lm):
    """Whatever the device measures, a predicted size above 0 goes through the real end-to-end
    check (ar against recycling on real prompts); the rates are forced so that the prediction is
    above 0 on any machine."""
    monkeypatch.setattr(recycling, "measure_rates", lambda bench, prompts, n: tuple(monotone_rates()))
    profile = recycling.measure_profile(Bench(tiny_lm, CURVE, 3, 8))
    check = profile.details["end_to_end"]
    assert profile.details["predicted_nodes"] == best_nodes(monotone_rates(), CURVE) > 0
    assert 0 < check["tokens"] <= 2 * 8
    assert check["ar_seconds"] > 0 and check["recycling_seconds"] > 0
    assert check["speedup"] == pytest.approx(check["ar_seconds"] / check["recycling_seconds"], rel=0.05)
    assert profile.nodes in (0, profile.details["predicted_nodes"])


def test_a_cached_cost_model_that_no_longer_fits_the_machine_is_measured_again_at_startup(tiny_lm, monkeypatch):
    """``Calibrator.check_cost`` (a server's startup) times a few forwards against the cached cost
    model: one 3x too steep (as one measured while something else ran) is measured again, written
    over the cached file and used, with its profiles kept; one that fits is left alone. The
    decision (:func:`calibration.stale`) takes any ratio beyond the tolerance either way."""
    assert calibration.stale({"1x1": 1.0, "1x8": 1.0 / 1.5}) and calibration.stale({"4x4": 1.4})
    assert not calibration.stale({"1x1": 0.8, "1x8": 1.25, "4x4": 1.0})
    assert tiny_lm.calibrator.check_cost() == {}  # nothing loaded: nothing to check
    fits = tiny_lm.calibration()
    path = calibration.calibration_path(tiny_lm.cache_dir, tiny_lm.adapter)
    now = calibration.measure_cost_model(tiny_lm, sizes=(1, 8), batch=((4, (1,)),), repeats=3)
    steep = CostModel({1: now.seconds(1), 8: 3 * now.seconds(8)}, now.context_tokens,
                      batch_seconds={4: {4: 3 * now.seconds(4, 4)}})
    profiles = {"recycling": RecyclingProfile(tuple(monotone_rates()), 8)}
    tiny_lm.calibrator._calibration = stale = dataclasses.replace(fits, cost=steep, profiles=profiles)
    ratios = tiny_lm.calibrator.check_cost()
    assert set(ratios) == {"1x1", "1x8", "4x4"} and calibration.stale(ratios)
    fresh = tiny_lm.loaded_calibration()
    assert fresh is not stale and fresh.cost != steep and fresh.profiles == profiles
    assert fresh.details["remeasured"].startswith("stale at startup")
    assert Calibration.from_json(path.read_text()) == fresh
    measured: list[int] = []
    monkeypatch.setattr(calibration, "remeasure_cost", lambda *a, **k: measured.append(1))
    monkeypatch.setattr(calibration, "spot_check", lambda lm, cost: {"1x1": 1.02, "1x8": 0.97, "4x4": 1.05})
    assert not calibration.stale(tiny_lm.calibrator.check_cost()) and not measured  # it fits: left alone
    assert tiny_lm.loaded_calibration() is fresh
