"""The benchmark's protocol: splits, warm-up prompts, shuffled method order, cold and warm state,
paired statistics, repetition metrics, what a results file records, and cross-machine refusal."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from triedec.api.calibration import calibration_prompts
from triedec.bench.compare import compare_results, read_results
from triedec.bench.datasets import (
    EXTRA_TUNING_POSITIONS,
    Question,
    load_questions,
    select,
    split,
    warmup_questions,
)
from triedec.bench.harness import BenchConfig, prompt_copy_share
from triedec.bench.stats import (
    MIN_UNITS,
    bootstrap_coverage,
    bootstrap_interval,
    compare,
    geometric_mean,
    paired_order,
    ratio_interval,
)
from triedec.bench.summary import leader, summarize
from triedec.cli.main import main
from triedec.core.errors import TriedecError
from triedec.engine.request import Request

pytestmark = pytest.mark.slow  # end to end: in make test, not in make test-fast

# ---- splits and warm-up ----------------------------------------------------------------------------


def test_split_is_fixed_disjoint_and_holds_every_prompt_tuned_on():
    everything = load_questions("spec-bench")
    tuning, evaluation = split(everything, "tuning"), split(everything, "evaluation")
    assert not {q.id for q in tuning} & {q.id for q in evaluation}
    assert len(tuning) + len(evaluation) == len(everything)
    positions = defaultdict(list)
    for q in everything:
        positions[q.category].append(q.id)
    tuned = {ids[p] for ids in positions.values() for p in (0, 16, 32, 48, 64, 40, 8, 24, 56, 72,
                                                             *EXTRA_TUNING_POSITIONS)}
    assert tuned <= {q.id for q in tuning}  # earlier published samples, tuning runs, calibration
    calibration = set(calibration_prompts())
    assert not calibration & {q.turns[0] for q in evaluation}
    assert split(everything, "all") == everything
    with pytest.raises(TriedecError, match="--split"):
        split(everything, "test")


def test_warmup_prompts_lie_outside_the_sample(tmp_path):
    sample = select(split(load_questions("spec-bench"), "evaluation"), per_category=5)
    warm = warmup_questions("spec-bench", sample, 6)
    assert len(warm) == 6 and len({q.category for q in warm}) == 6  # one per category first
    assert not {q.turns[0] for q in warm} & {t for q in sample for t in q.turns}
    tuning_sample = select(split(load_questions("spec-bench"), "tuning"), per_category=2)
    assert not {q.turns[0] for q in warmup_questions("spec-bench", tuning_sample, 20)} \
        & {t for q in tuning_sample for t in q.turns}
    # a user's file: calibration prompts, minus any the file itself holds
    mine = [Question("x", "c", (calibration_prompts()[0],))]
    assert calibration_prompts()[0] not in {q.turns[0] for q in warmup_questions("mine.jsonl", mine, 3)}
    with pytest.raises(TriedecError, match="warm-up prompts"):
        warmup_questions("mine.jsonl", mine, 1000)


# ---- order ---------------------------------------------------------------------------------------


def test_method_order_is_a_fresh_seeded_shuffle_per_prompt_and_repeat():
    labels = ["hf-greedy", "ar", "pld", "auto"]
    config = BenchConfig(order_seed=3)
    orders = [config.order(labels, p, r) for p in range(30) for r in range(3)]
    assert all(sorted(o) == sorted(labels) for o in orders)
    assert len({tuple(o) for o in orders}) > 10
    assert {o[0] for o in orders} == set(labels)  # every method sometimes runs first
    assert orders == [BenchConfig(order_seed=3).order(labels, p, r) for p in range(30) for r in range(3)]
    assert orders != [BenchConfig(order_seed=4).order(labels, p, r) for p in range(30) for r in range(3)]
    with pytest.raises(TriedecError, match="--state"):
        BenchConfig(state="lukewarm")


def test_serving_phases_run_every_system_back_to_back_per_cell_and_repeat():
    systems, cells, repeats = ["ar", "auto", "pld"], [1, 4, 16, 32], 5
    order = paired_order(systems, cells, repeats, seed=7)
    assert sorted(order) == sorted((s, c, r) for s in systems for c in cells for r in range(repeats))
    blocks = [order[k : k + len(systems)] for k in range(0, len(order), len(systems))]
    for block in blocks:  # one (cell, repeat) per block, every system once in it
        assert len({(c, r) for _, c, r in block}) == 1
        assert sorted(s for s, _, _ in block) == systems
    assert {block[0][0] for block in blocks} == set(systems)  # no system always runs first
    assert [(b[0][1], b[0][2]) for b in blocks] != [(c, r) for r in range(repeats) for c in cells]  # shuffled
    assert order == paired_order(systems, cells, repeats, seed=7)
    assert order != paired_order(systems, cells, repeats, seed=8)
    with pytest.raises(TriedecError, match="repeats"):
        paired_order(systems, cells, 0, seed=7)


# ---- statistics ----------------------------------------------------------------------------------


def test_bootstrap_interval_matches_a_hand_computation():
    # Two prompts with speedups 1 and 4: a resample of two prompts is (1,1), (1,4), (4,1) or
    # (4,4), with geometric means 1, 2, 2, 4 at odds 1/4, 1/2, 1/4; the 2.5% and 97.5%
    # quantiles of that distribution are 1 and 4.
    assert bootstrap_interval([1.0, 4.0]) == pytest.approx((1.0, 4.0))
    # Three prompts 1, 2, 4: all-ones has odds 1/27 (3.7% > 2.5%), so the low end is 1; all-fours
    # likewise gives the high end 4; the geometric mean is 2.
    assert bootstrap_interval([1.0, 2.0, 4.0]) == pytest.approx((1.0, 4.0))
    assert geometric_mean([1.0, 2.0, 4.0]) == pytest.approx(2.0)
    assert bootstrap_interval([2.0] * 5) == pytest.approx((2.0, 2.0))


def test_comparisons_pair_prompts():
    # Speeds that vary 100-fold between prompts but are exactly 2x per prompt: paired, the interval
    # is [2, 2]; any unpaired statistic would straddle 1.
    base = {f"p{i}": v for i, v in enumerate([1.0, 10.0, 100.0, 3.0, 0.5, 7.0, 2.0, 40.0, 0.2, 9.0])}
    fast = {k: 2 * v for k, v in base.items()}
    c = compare(fast, base)
    assert (c.geomean, c.median, c.low, c.high, c.prompts, c.units) == pytest.approx((2.0, 2.0, 2.0, 2.0, 10, 10))
    assert c.verdict == "faster" and compare(base, fast).verdict == "slower"
    ones = {k: 1.0 for k in base}
    mixed = compare(dict(zip(base, [1.2, 0.8, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.1, 0.9], strict=True)), ones)
    assert mixed.low < 1 < mixed.high and mixed.verdict == "no difference shown"
    few = compare({"x": 1.0, "only-here": 5.0}, {"x": 2.0})  # unpaired prompts are left out
    assert few.prompts == 1 and few.low is None and few.verdict == "too few prompts"
    assert compare({"x": 1.0}, {"y": 1.0}) is None
    # MIN_UNITS independent units, not prompts: 10 prompts that are 5 questions' two turns get none
    turns = {k: f"q{i // 2}" for i, k in enumerate(base)}
    paired = compare(fast, base, turns)
    assert (paired.prompts, paired.units, paired.low, paired.verdict) == (10, 5, None, "too few prompts")
    assert MIN_UNITS == 10


def test_a_question_s_turns_are_resampled_together():
    # Ten questions of two turns: turn 1 ratio 1, turn 2 ratio 4, so every question's mean log
    # ratio is log 2 and any resample of whole questions has geometric mean exactly 2; resampling
    # the 20 turns one by one mixes 1s and 4s and gives a wide interval.
    ratios = [1.0, 4.0] * 10
    questions = [str(i // 2) for i in range(20)]
    assert bootstrap_interval(ratios, units=questions) == pytest.approx((2.0, 2.0))
    low, high = bootstrap_interval(ratios)
    assert low < 1.8 and high > 2.2
    # a ratio of totals, by question: each question holds 1 + 3 tokens over 2 + 2 steps
    num, den = [1.0, 3.0] * 10, [2.0, 2.0] * 10
    assert ratio_interval(num, den, units=questions) == pytest.approx((1.0, 1.0))
    assert ratio_interval(num[:18], den[:18], units=questions[:18]) is None  # 9 questions
    with pytest.raises(TriedecError):
        bootstrap_interval(ratios, units=questions[:3])


def test_bootstrap_coverage_falls_short_on_few_units():
    # The reason for MIN_UNITS: over 5 units the nominal 95% interval holds the truth far less often
    few, many = bootstrap_coverage(5, trials=400, resamples=500), bootstrap_coverage(30, trials=400, resamples=500)
    assert few < 0.9 < many


def test_summary_pairs_per_prompt_and_reports_turns_and_the_low_repetition_slice():
    def r(method, id_, cat, tok_s, turn=1, turns=1, rep=0.0, copy=0.0):
        question = id_.split("-turn")[0]
        return {"id": id_, "question": question, "method": method, "category": cat, "turn": turn, "turns": turns,
                "new_tokens": 100, "seconds": 100 / tok_s, "steps": 50, "computed_tokens": 60,
                "identical_to_reference": True, "peak_mem_mb": 1.0, "kv_mb": 1.0, "repeated_4grams": rep,
                "prompt_copy_4grams": copy}

    samples = []
    for i, (base, rep) in enumerate([(10, 0.0), (20, 0.5), (40, 0.1)] * 3):
        samples += [r("hf-greedy", f"q{i}", "x", base, rep=rep), r("ar", f"q{i}", "x", 2 * base, rep=rep),
                    r("auto", f"q{i}", "x", 6 * base, rep=rep)]
    for t in (1, 2):
        samples += [r("hf-greedy", f"m-turn{t}", "mt", 10, t, 2), r("ar", f"m-turn{t}", "mt", 20, t, 2),
                    r("auto", f"m-turn{t}", "mt", 20 * t, t, 2, copy=0.9 if t == 2 else 0.0)]
    res = summarize(samples)["auto"]
    assert res["overall"]["vs_reference"]["prompts"] == 11 and res["overall"]["vs_reference"]["units"] == 10
    assert res["by_category"]["x"]["vs_ar"]["geomean"] == pytest.approx(3.0)
    assert res["by_category"]["x"]["vs_reference"]["ci95"] is None  # 9 questions: no interval
    assert res["overall"]["vs_ar"]["ci95"] is not None
    assert res["by_turn"]["mt turn 1"]["vs_reference"]["geomean"] == pytest.approx(2.0)
    assert res["by_turn"]["mt turn 2"]["vs_reference"]["geomean"] == pytest.approx(4.0)
    assert res["by_category"]["mt"]["vs_reference"]["geomean"] == pytest.approx(8 ** 0.5)  # both turns
    # the slice is judged on the reference's outputs (hf-greedy here): the q with rep 0.5 repeat too much
    assert res["slices"]["low_repetition"]["samples"] == 8
    assert "by_turn" not in summarize([s for s in samples if s["category"] == "x"])["auto"]
    lead = leader(samples, summarize(samples))
    assert lead["method"] == "auto"  # per-prompt ratios over ar: 3 (nine times), 1, 2
    assert lead["against"]["ar"]["geomean"] == pytest.approx((3 ** 9 * 2) ** (1 / 11))
    assert set(lead["against"]) == {"hf-greedy", "ar"}


def test_prompt_copy_share():
    assert prompt_copy_share([1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 8]) == pytest.approx(1 / 2)
    assert prompt_copy_share([1, 2, 3, 4], [5, 6, 7, 8]) == 0.0
    assert prompt_copy_share([1, 2], [1, 2]) == 0.0


# ---- runs on a tiny model ------------------------------------------------------------------------

STATEFUL = "ar,pld,recycling,ngram-trie,lookahead,auto:sized=false"
"""Every stateful method; auto sends every ranked node, so that what its store drafts does not
depend on a cost model measured beside other work (sized, a cost curve measured on a busy machine
could size the second copy's drafts away)."""


@pytest.fixture()
def same_question_twice(tmp_path):
    path = tmp_path / "twice.jsonl"
    text = "Repeat after me: alpha beta gamma delta alpha beta gamma delta."
    path.write_text("\n".join(json.dumps({"id": i, "category": "c", "prompt": text}) for i in ("a", "b")) + "\n")
    return path


def _drafts_per_method(monkeypatch):
    """Record every draft each request proposed, per drafter type, request by request."""
    logs: dict[str, list[list[tuple]]] = defaultdict(list)
    seen: dict[int, tuple[Request, list[tuple]]] = {}  # holds each request, so no id is reused
    original = Request.propose

    def propose(self, drafting=True):
        draft = original(self, drafting)
        if id(self) not in seen:
            seen[id(self)] = (self, [])
            logs[type(self.drafter).__name__].append(seen[id(self)][1])
        seen[id(self)][1].append((draft.tree.tokens, draft.tree.parents, draft.chances))
        return draft

    monkeypatch.setattr(Request, "propose", propose)
    return logs


def test_cold_resets_every_stateful_method_and_warm_carries(tmp_path, tiny_model_dir, same_question_twice,
                                                            monkeypatch):
    logs = _drafts_per_method(monkeypatch)
    args = ["bench", "--model", str(tiny_model_dir), "--dataset", str(same_question_twice), "--methods",
            STATEFUL, "--max-new-tokens", "16", "--no-progress", "--warmup", "1"]
    assert main([*args, "--repeats", "2", "--out", str(tmp_path / "cold")]) == 0
    assert len(logs) == 6
    for name, runs in logs.items():
        timed = runs[-4:]  # two prompts x two repeats (calibration and warm-up runs may come before)
        assert len(runs) >= 4, name
        assert all(run == timed[0] for run in timed), f"{name} drafted differently after a cold reset"
    cold = json.loads((tmp_path / "cold" / "results.json").read_text())
    assert cold["state"] == "cold"
    assert all(len(set(s["computed_all"])) == 1 for s in cold["samples"])

    logs.clear()
    assert main([*args, "--state", "warm", "--out", str(tmp_path / "warm")]) == 0
    first, second = logs["AutoDrafter"][-2:]
    assert first != second  # the store drafts the second copy from the first answer
    warm = json.loads((tmp_path / "warm" / "results.json").read_text())
    auto = {s["id"]: s for s in warm["samples"] if s["method"] == "auto:sized=false"}
    assert auto["b"]["steps"] < auto["a"]["steps"]


def test_cold_refuses_a_state_file_and_warm_repeats_start_fresh(tmp_path, tiny_model_dir, same_question_twice,
                                                                 capsys):
    store = tmp_path / "store.safetensors"
    argv = ["bench", "--model", str(tiny_model_dir), "--dataset", str(same_question_twice), "--methods",
            f"auto:store={store}", "--max-new-tokens", "8", "--no-progress", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "state file" in capsys.readouterr().err
    assert main([*argv, "--state", "warm", "--repeats", "2"]) == 0
    samples = json.loads((tmp_path / "o" / "results.json").read_text())["samples"]
    auto = [s for s in samples if s["method"].startswith("auto")]
    assert all(len(set(s["steps_all"])) == 1 for s in auto)  # each repeat replays the pass from reset state


def test_a_run_shuffles_orders_and_records_what_it_ran_on(tmp_path, tiny_model_dir, same_question_twice):
    out = tmp_path / "run"
    assert main(["bench", "--model", str(tiny_model_dir), "--dataset", str(same_question_twice), "--methods",
                 "hf-greedy,ar,pld,ngram-trie", "--max-new-tokens", "8", "--repeats", "3", "--no-progress",
                 "--order-seed", "5", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    for key in ("commit", "versions", "calibration", "dataset_sha256", "sample_sha256", "warmup_prompts",
                "order", "state", "split", "model_id"):
        assert key in results, key
    assert results["split"] == "all" and results["order_seed"] == 5
    assert results["versions"]["torch"] and results["calibration"]["cost"]
    assert len(results["sample_sha256"]) == 64
    by_prompt_repeat = defaultdict(dict)
    for s in results["samples"]:
        assert s["tokens"] and len(s["tokens"]) == s["new_tokens"] and s["repeats_identical"]
        assert len(s["order_positions"]) == 3
        for rep, pos in enumerate(s["order_positions"]):
            by_prompt_repeat[(s["id"], rep)][pos] = s["method"]
    orders = [tuple(v[i] for i in range(4)) for v in by_prompt_repeat.values()]
    assert all(len(set(o)) == 4 for o in orders) and len(set(orders)) > 1
    md = (out / "results.md").read_text()
    assert "fresh random order" in md and "state **cold**" in md and "95%" in md


def test_compare_refuses_results_from_another_machine(tmp_path, tiny_model_dir, same_question_twice, capsys):
    out = tmp_path / "a"
    assert main(["bench", "--model", str(tiny_model_dir), "--dataset", str(same_question_twice), "--methods",
                 "hf-greedy,ar", "--max-new-tokens", "6", "--no-progress", "--out", str(out)]) == 0
    a = read_results(out)
    other = {**a, "machine": {**a["machine"], "cpu": "Some Other CPU"}}
    (tmp_path / "b.json").write_text(json.dumps(other))
    assert main(["compare", str(out), str(tmp_path / "b.json")]) == 2
    assert "different machines" in capsys.readouterr().err
    assert main(["compare", str(out), str(tmp_path / "b.json"), "--cross-machine"]) == 0
    assert "Different machines" in capsys.readouterr().out
    same = compare_results(a, a)
    assert same["methods"]["ar"]["b_over_a"]["geomean"] == pytest.approx(1.0)
    assert not same["cross_machine"]
    (tmp_path / "junk.json").write_text("{}")
    assert main(["compare", str(out), str(tmp_path / "junk.json")]) == 2
    # `triedec report` summarizes the same samples again: same numbers, the rebuild recorded
    assert main(["report", str(out)]) == 0
    rebuilt = read_results(out)
    assert rebuilt["samples"] == a["samples"] and rebuilt["report_rebuilt"]
    speed = rebuilt["methods"]["ar"]["overall"]["tokens_per_s"]
    assert speed == pytest.approx(a["methods"]["ar"]["overall"]["tokens_per_s"])


def test_llamacpp_baseline_errors_are_clear(tmp_path, tiny_model_dir, same_question_twice, capsys, monkeypatch):
    import sys

    argv = ["bench", "--model", str(tiny_model_dir), "--dataset", str(same_question_twice), "--methods",
            "hf-greedy,llamacpp", "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path / "l")]
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the extra were not installed
    assert main(argv) == 2
    assert "pip install 'triedec[llamacpp]'" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "llama_cpp")
    pytest.importorskip("llama_cpp")
    assert main(argv) == 2  # a model directory has no GGUF for llama.cpp to run
    assert ".gguf" in capsys.readouterr().err


@pytest.mark.default_model
def test_llamacpp_baseline_runs_the_default_gguf(tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "l"
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "Name three colours."}) + "\n")
    assert main(["bench", "--dataset", str(path), "--methods", "hf-greedy,ar,llamacpp", "--max-new-tokens", "16",
                 "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    o = results["methods"]["llamacpp"]["overall"]
    assert o["compared"] == 0 and o["new_tokens"] > 0 and o["tokens_per_s"] > 0
    assert "llama.cpp" in (out / "results.md").read_text()


@pytest.mark.default_model
def test_llamacpp_lookup_runs_past_llama_cpp_pythons_batch_of_512(tmp_path):
    """With its prompt lookup, llama-cpp-python 0.3.x sized its score buffer to n_batch (512) rows
    and failed inside its own eval once a run passed ~500 tokens; the runner asks for a buffer of
    n_ctx rows. A 600-token prompt, then decoding past it, on the real library; the runner counts
    llama.cpp's forwards and the tokens they evaluate."""
    pytest.importorskip("llama_cpp")
    from triedec.bench.llamacpp import LlamaCppRunner
    from triedec.model.source import default_model_path

    runner = LlamaCppRunner(default_model_path(), "llamacpp:lookup=10", frozenset(), 700, lookup=10)
    prompt = ([504, 3459, 314, 260, 1345, 28, 30] * 90)[:600]  # repetitive, so lookup drafts every step
    record = runner.run(prompt, 40)
    assert len(record.tokens) > 1
    # its forwards are counted: each evaluates the last token and its drafts
    assert 1 <= record.steps <= len(record.tokens) - 1 and record.computed_tokens >= record.steps
    plain = LlamaCppRunner(default_model_path(), "llamacpp", frozenset(), 700).run(prompt, 40)
    assert plain.steps == plain.computed_tokens == len(plain.tokens) - 1  # one token a forward


def test_llamacpp_lookup_passes_llama_cpp_its_own_prompt_lookup(tmp_path, monkeypatch):
    """``llamacpp:lookup=N`` builds llama.cpp with ``LlamaPromptLookupDecoding(num_pred_tokens=N)``
    as its draft model, and a run stops at EOS and at the token cap as plain llama.cpp's does (a
    stand-in for llama-cpp-python: the wiring, not llama.cpp, is under test here)."""
    import sys
    import types

    from triedec.bench.llamacpp import LlamaCppRunner

    made: list[dict] = []

    class Lookup:
        def __init__(self, num_pred_tokens: int) -> None:
            self.num_pred_tokens = num_pred_tokens

    class Llama:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

        def token_eos(self) -> int:
            return 2

        def reset(self) -> None:
            pass

        def generate(self, prompt, **kwargs):
            yield from [5, 6, 7, 2, 9]

    module = types.ModuleType("llama_cpp")
    module.Llama = Llama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = Lookup
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    runner = LlamaCppRunner(gguf, "llamacpp:lookup=4", frozenset(), 64, lookup=4)
    assert isinstance(made[-1]["draft_model"], Lookup) and made[-1]["draft_model"].num_pred_tokens == 4
    assert made[-1]["n_ctx"] == 64 + 5  # room for the last token and its 4 drafts past the context
    assert made[-1]["logits_all"] is True  # llama-cpp-python's score buffer gets n_ctx rows, as its eval needs
    assert runner.run([1, 2], 16).tokens == [5, 6, 7, 2]  # the file's EOS ends it and counts, as triedec's does
    assert runner.run([1, 2], 2).tokens == [5, 6]
    LlamaCppRunner(gguf, "llamacpp", frozenset(), 64)
    assert "draft_model" not in made[-1] and "logits_all" not in made[-1] and made[-1]["n_ctx"] == 64
    # its score buffer is n_ctx x vocab floats: a lookup runner starts at 2048 positions, grows as runs need
    big = LlamaCppRunner(gguf, "llamacpp:lookup=4", frozenset(), 32768, lookup=4)
    assert made[-1]["n_ctx"] == 2048 + 5
    big.run([1] * 1000, 16)
    assert made[-1]["n_ctx"] == 2048 + 5 and len(made) == 3  # it fits: no new context
    big.run([1] * 3000, 16)
    assert made[-1]["n_ctx"] == 4096 + 5 and len(made) == 4
    big.run([1] * 31000, 2000)
    assert made[-1]["n_ctx"] == 32768 + 5  # never past the model's context
    with pytest.raises(TriedecError, match="lookup"):
        LlamaCppRunner(gguf, "llamacpp:lookup=-1", frozenset(), 64, lookup=-1)
