"""triedec bench: end to end on a tiny random model, metrics arithmetic, and bad input."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from triedec.bench.datasets import load_questions, select, split
from triedec.bench.runners import RunRecord, TriedecRunner
from triedec.bench.summary import summarize
from triedec.cli.main import main
from triedec.core.errors import TriedecError

pytestmark = pytest.mark.slow  # end to end: in make test, not in make test-fast

SCHEMA_KEYS = {"tokens_per_s", "speedup", "mean_accepted", "steps", "new_tokens", "computed_tokens",
               "mismatches", "peak_mem_mb"}


class CorruptingRunner:
    """Test-only method: triedec's pld, with one output token changed."""

    def __init__(self, lm, label):
        self.label = label
        self.inner = TriedecRunner(lm, label, "pld", {})

    comparable = True

    def reset(self):
        self.inner.reset()

    def run(self, prompt, max_new_tokens, seed=None):
        rec = self.inner.run(prompt, max_new_tokens, seed)
        tokens = list(rec.tokens)
        tokens[len(tokens) // 2] = (tokens[len(tokens) // 2] + 1) % 1000
        return RunRecord(tokens, rec.seconds, rec.steps, rec.computed_tokens, rec.kv_bytes)


class CrashingRunner(CorruptingRunner):
    """Test-only method: triedec's pld, raising on its third run (the warm-up is its first)."""

    runs = 0

    def run(self, prompt, max_new_tokens, seed=None):
        self.runs += 1
        if self.runs == 3:
            raise RuntimeError("out of memory, say")
        return self.inner.run(prompt, max_new_tokens, seed)


@pytest.fixture(scope="module")
def two_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "two.jsonl"
    rows = [{"id": "a", "category": "chat", "turns": ["Say hello.", "Now say it again, louder."]},
            {"id": "b", "category": "copy", "prompt": "Repeat: one two three one two three one two"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_bench_end_to_end(tmp_path, tiny_model_dir, two_prompts, capsys):
    out = tmp_path / "out"
    code = main(
        ["bench", "--model", str(tiny_model_dir), "--dataset", str(two_prompts), "--methods",
         "hf-greedy,hf-pld,ar,pld,pld:num_tokens=4,corrupt", "--max-new-tokens", "12", "--repeats", "2",
         "--out", str(out), "--no-progress"],
        extra_runners={"corrupt": CorruptingRunner},
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    for key in ("machine", "model", "dataset", "max_new_tokens", "repeats", "methods", "samples"):
        assert key in results
    assert results["max_new_tokens"] == 12 and results["repeats"] == 2
    assert set(results["machine"]) >= {"cpu", "torch_threads", "device", "torch", "transformers", "triedec"}
    assert list(results["methods"]) == ["hf-greedy", "hf-pld", "ar", "pld", "pld:num_tokens=4", "corrupt"]
    for res in results["methods"].values():
        assert set(res["overall"]) >= SCHEMA_KEYS
        assert set(res["by_category"]) == {"chat", "copy"}
        for cat in res["by_category"].values():
            assert set(cat) >= SCHEMA_KEYS
    assert len(results["samples"]) == 3 * 6  # 3 prompts (two turns + one) x 6 methods
    for s in results["samples"]:
        assert {"id", "category", "method", "new_tokens", "seconds", "steps", "identical_to_reference"} <= set(s)
        assert len(s["seconds_all"]) == 2
    ok = {n: r for n, r in results["methods"].items() if n != "corrupt"}
    assert all(r["overall"]["mismatches"] == 0 and r["overall"]["speedup"] is not None for r in ok.values())
    bad = results["methods"]["corrupt"]["overall"]
    assert bad["mismatches"] == 3 and bad["wrong"] is True and bad["speedup"] is None
    assert results["methods"]["hf-greedy"]["overall"]["speedup"] == pytest.approx(1.0)
    assert results["methods"]["ar"]["overall"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert bad["speedup_vs_ar"] is None
    assert all(0 <= smp["repeated_4grams"] <= 1 for smp in results["samples"])
    for name in ("results.md", "speedup_by_category.png", "mean_accepted.png", "tokens_per_s_vs_context.png"):
        assert (out / name).stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "**WRONG** (3 mismatches)" in md
    wrong = [smp for smp in results["samples"] if smp["method"] == "corrupt"]
    assert all(smp["first_mismatch"]["top2_gap"] >= 0 for smp in wrong)
    assert all(smp["first_mismatch"]["position"] == smp["new_tokens"] // 2 for smp in wrong)
    assert "top-2 gap" in md
    assert "WRONG" in capsys.readouterr().out


def test_a_method_that_raises_is_dropped_and_the_others_finish(tmp_path, tiny_model_dir, two_prompts, caplog):
    out = tmp_path / "crash"
    code = main(["bench", "--model", str(tiny_model_dir), "--dataset", str(two_prompts), "--methods",
                 "hf-greedy,ar,pld,crash", "--max-new-tokens", "8", "--out", str(out), "--no-progress"],
                extra_runners={"crash": CrashingRunner})
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["hf-greedy", "ar", "pld"]  # every method left, on every prompt
    assert len(results["samples"]) == 3 * 3 and {s["method"] for s in results["samples"]} == {"hf-greedy", "ar", "pld"}
    (failure,) = results["failed"]
    assert failure["method"] == "crash" and failure["prompt"] == "a-turn2"
    assert failure["error"] == "RuntimeError: out of memory, say"
    assert "**crash failed** on a-turn2" in (out / "results.md").read_text()
    assert "crash failed on a-turn2" in caplog.text


def test_a_reference_that_raises_ends_the_run(tiny_model_dir):
    import triedec
    from triedec.bench.datasets import Question
    from triedec.bench.harness import BenchConfig, run_benchmark

    tiny_lm = triedec.load(tiny_model_dir)
    crash = CrashingRunner(tiny_lm, "hf-greedy")
    questions = [Question("q", "chat", ("Hi.",)), Question("r", "chat", ("Bye.",))]
    with pytest.raises(RuntimeError, match="out of memory"):
        run_benchmark(tiny_lm, [crash, TriedecRunner(tiny_lm, "ar", "ar", {})], questions,
                      BenchConfig(max_new_tokens=4), warmup=[Question("w", "chat", ("Warm.",))])


def row(method, category, new_tokens, seconds, steps, identical=True, computed=None, id=None):
    return {"id": category if id is None else id, "method": method, "category": category, "new_tokens": new_tokens,
            "seconds": seconds, "steps": steps,
            "computed_tokens": steps if computed is None else computed, "identical_to_reference": identical,
            "peak_mem_mb": 1.0, "kv_mb": 0.5}


def test_sampled_bench_end_to_end(tmp_path, tiny_model_dir, two_prompts):
    """--temperature: hf-sample is the speed baseline, triedec's ar (added) the token reference;
    every triedec method equals ar at the same seed, transformers' runs are not compared; a wrong
    method is still caught."""
    out = tmp_path / "sampled"
    code = main(["bench", "--model", str(tiny_model_dir), "--dataset", str(two_prompts), "--methods",
                 "hf-pld,pld,ngram-trie,lookahead,corrupt", "--max-new-tokens", "12", "--temperature", "0.8",
                 "--top-p", "0.9", "--seed", "4", "--out", str(out), "--no-progress"],
                extra_runners={"corrupt": CorruptingRunner})
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["reference"] == "hf-sample" and results["token_reference"] == "ar"
    assert results["sampling"]["temperature"] == 0.8 and results["sampling"]["seed"] == 4
    assert list(results["methods"]) == ["hf-sample", "ar", "hf-pld", "pld", "ngram-trie", "lookahead", "corrupt"]
    assert sorted({s["seed"] for s in results["samples"]}) == [4, 5, 6]
    for name in ("ar", "pld", "ngram-trie", "lookahead"):
        o = results["methods"][name]["overall"]
        assert o["mismatches"] == 0 and o["compared"] == 3 and o["speedup"] is not None
    for name in ("hf-sample", "hf-pld"):
        o = results["methods"][name]["overall"]
        assert o["compared"] == 0 and o["mismatches"] == 0
    assert results["methods"]["hf-sample"]["overall"]["speedup"] == pytest.approx(1.0)
    assert results["methods"]["corrupt"]["overall"]["wrong"]
    wrong = [smp["first_mismatch"] for smp in results["samples"] if smp["method"] == "corrupt"]
    assert wrong and all(0 <= fm["cdf_margin"] <= 1 for fm in wrong if fm["reference_token"] is not None)
    md = (out / "results.md").read_text()
    assert "sampling (temperature 0.8, top_p 0.9" in md and "| — |" in md


def test_a_quantized_bench_judges_tokens_against_ar_and_records_the_mode(tmp_path, tiny_model_dir, two_prompts):
    """--weights int4: hf-greedy stays the speed baseline, triedec's ar (bit-exact in every mode)
    is the token reference, stock transformers' runs are not compared (bf16 near-ties), and a
    wrong method is still caught."""
    out = tmp_path / "int4"
    code = main(["bench", "--model", str(tiny_model_dir), "--dataset", str(two_prompts), "--methods",
                 "pld,ngram-trie,corrupt", "--max-new-tokens", "12", "--weights", "int4", "--out", str(out),
                 "--no-progress"], extra_runners={"corrupt": CorruptingRunner})
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["precision"] == "int4g32-bfloat16" and results["kernels"].startswith("int4-weights")
    assert results["reference"] == "hf-greedy" and results["token_reference"] == "ar"
    for name in ("ar", "pld", "ngram-trie"):
        o = results["methods"][name]["overall"]
        assert o["mismatches"] == 0 and o["compared"] == 3 and o["speedup"] is not None
    assert results["methods"]["hf-greedy"]["overall"]["compared"] == 0
    assert results["methods"]["corrupt"]["overall"]["wrong"]
    md = (out / "results.md").read_text()
    assert "precision int4g32-bfloat16" in md and "bit-exact reference in every mode" in md


def test_speedup_arithmetic_on_hand_made_timings():
    samples = [
        row("hf-greedy", "x", 100, 10.0, 99), row("hf-greedy", "y", 50, 2.0, 49),   # 10 and 25 tok/s
        row("fast", "x", 100, 5.0, 33, computed=330), row("fast", "y", 50, 1.0, 7),  # 20 and 50 tok/s
        row("bad", "x", 100, 1.0, 10), row("bad", "y", 50, 1.0, 10, identical=False),
    ]
    res = summarize(samples)
    ref = res["hf-greedy"]["overall"]
    assert ref["tokens_per_s"] == pytest.approx(17.5) and ref["speedup"] == pytest.approx(1.0)
    fast = res["fast"]
    assert fast["overall"]["tokens_per_s"] == pytest.approx(35.0)
    assert fast["overall"]["speedup"] == pytest.approx(2.0)  # ratio of mean tokens/s
    assert fast["by_category"]["x"]["speedup"] == pytest.approx(2.0)
    assert fast["by_category"]["y"]["speedup"] == pytest.approx(2.0)
    assert fast["overall"]["mean_accepted"] == pytest.approx((99 + 49) / 40)
    assert fast["overall"]["computed_tokens"] == 337
    assert fast["overall"]["computed_per_token"] == pytest.approx(337 / 150)
    assert res["bad"]["overall"]["speedup"] is None and res["bad"]["overall"]["wrong"]
    assert res["bad"]["by_category"]["x"]["speedup"] == pytest.approx(100 / 10)  # correct there
    assert res["bad"]["by_category"]["y"]["speedup"] is None


def test_by_pass_metrics_for_a_repeated_workload():
    samples = [
        row("hf-greedy", "1:x", 100, 10.0, 99), row("hf-greedy", "2:x", 100, 10.0, 99),  # 10 tok/s both
        row("auto", "1:x", 100, 5.0, 50), row("auto", "2:x", 100, 2.0, 20),              # 20 then 50
    ]
    res = summarize(samples)
    by_pass = res["auto"]["by_pass"]
    assert by_pass["1"]["speedup"] == pytest.approx(2.0) and by_pass["2"]["speedup"] == pytest.approx(5.0)
    assert set(res["auto"]["by_category"]) == {"1:x", "2:x"}
    assert "by_pass" not in summarize([row("hf-greedy", "x", 10, 1.0, 9)])["hf-greedy"]


def test_repeated_workload_asks_the_same_questions_twice():
    qs = select(load_questions("repeated"), per_category=2)
    first = [q for q in qs if q.category.startswith("1:")]
    second = [q for q in qs if q.category.startswith("2:")]
    assert len(first) == len(second) == 14
    for a, b in zip(first, second, strict=True):
        assert a.category[2:] == b.category[2:] and b.id.startswith(a.id)
        assert a.turns[0] in b.turns[0] or a.category == "1:humaneval"
    code = [q for q in second if q.category == "2:humaneval"]
    assert all("_v2(" in q.turns[0] for q in code)


def test_repeated_ngram_share():
    from triedec.bench.harness import repeated_ngram_share

    assert repeated_ngram_share([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngram_share([1, 2, 3, 4] * 3) == pytest.approx(5 / 9)  # 9 4-grams: 4 rotations, then repeats
    assert repeated_ngram_share([1, 2, 3]) == 0.0


def test_verification_branch_tokens_are_summed_over_runs():
    """``verify_per_token`` sums every run's ``verify_tokens`` (not the last run's), only for
    methods whose drafter reports it."""
    samples = [row("hf-greedy", "x", 100, 10.0, 99), row("hf-greedy", "y", 50, 2.0, 49),
               {**row("la", "x", 100, 5.0, 40, computed=400), "drafter": {"verify_tokens": 120.0}},
               {**row("la", "y", 50, 5.0, 20, computed=200), "drafter": {"verify_tokens": 30.0}}]
    res = summarize(samples)
    assert res["la"]["overall"]["verify_per_token"] == pytest.approx(150 / 150)
    assert res["la"]["by_category"]["x"]["verify_per_token"] == pytest.approx(1.2)
    assert "verify_per_token" not in res["hf-greedy"]["overall"]


def test_spec_bench_sample_is_fixed_and_covers_categories():
    qs = select(split(load_questions("spec-bench"), "evaluation"), per_category=5)
    cats = {}
    for q in qs:
        cats.setdefault(q.category, []).append(q.id)
    assert list(cats) == ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert all(len(v) == 5 for v in cats.values())
    # evaluation positions 0, 8, 16, 24, 32 are file positions 1, 17, 33, 49, 65 (ids start at 81)
    assert cats["mt_bench"] == ["82", "98", "114", "130", "146"]
    assert [len(q.turns) for q in qs if q.category == "mt_bench"] == [2] * 5
    assert qs == select(split(load_questions("spec-bench"), "evaluation"), per_category=5)
    assert len(select(load_questions("humaneval"), per_category=3)) == 3
    assert {q.category for q in select(load_questions("mbpp"), per_category=2)} == {"mbpp"}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dataset", "nope"], "unknown dataset"),
        (["--dataset", "missing.jsonl"], "not found"),
        (["--methods", "hf-greedy,warp"], "unknown method"),
        (["--methods", "pld:bogus=1"], "unknown option"),
        (["--methods", "pld:num_tokens=x"], "cannot read"),
        (["--methods", "hf-pld:num_tokens=0"], "num_tokens"),
        (["--categories", "poetry"], "unknown categories"),
        (["--per-category", "0"], "per-category"),
        (["--repeats", "0"], "repeats"),
        (["--max-new-tokens", "-1"], "max-new-tokens"),
        (["--temperature", "0.7", "--methods", "hf-greedy,pld"], "the baseline is hf-sample"),
        (["--methods", "hf-sample,pld"], "the baseline is hf-greedy"),
        (["--temperature", "-0.7"], "temperature"),
        (["--temperature", "0.7", "--methods", "hf-beam,beam"], "beam search does not sample"),
    ],
)
def test_bench_bad_input(tmp_path, tiny_model_dir, capsys, argv, message):
    code = main(["bench", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


def test_unreadable_and_malformed_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(TriedecError, match="cannot read"):
        load_questions(str(bad))
    empty_prompt = tmp_path / "e.jsonl"
    empty_prompt.write_text('{"prompt": ""}\n')
    with pytest.raises(TriedecError, match="prompt"):
        load_questions(str(empty_prompt))
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x00")
    with pytest.raises(TriedecError, match="cannot read"):
        load_questions(str(binary))


# ---- the beam-search benchmark -----------------------------------------------------------------


def test_beam_bench_end_to_end(tmp_path, tiny_model_dir, two_prompts, capsys):
    out = tmp_path / "beam"
    code = main(["bench", "--model", str(tiny_model_dir), "--dataset", str(two_prompts), "--methods", "hf-beam,beam",
                 "--beams", "2,3", "--max-new-tokens", "10", "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["num_beams"]): r for r in results["summary"]}
    assert set(rows) == {("hf-greedy", 1), ("hf-beam", 2), ("beam", 2), ("hf-beam", 3), ("beam", 3)}
    for b in (2, 3):
        mine = rows[("beam", b)]
        assert mine["mismatches"] == 0 and mine["speedup"] is not None
        assert 0 < mine["kv_ratio"] < 1  # the prompt is held once, not b times
        assert rows[("hf-beam", b)]["kv_tokens"] > mine["kv_tokens"]
    assert "| beam | 3 |" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--methods", "hf-beam,beam,pld"], "on their own"),
        (["--methods", "beam", "--beams", "1,8"], "widths >= 2"),
        (["--methods", "beam", "--beams", "x"], "comma-separated"),
    ],
)
def test_beam_bench_bad_input(tmp_path, tiny_model_dir, capsys, argv, message):
    code = main(["bench", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err


def test_humaneval_answers_run_in_a_sandbox_with_a_timeout():
    from triedec.bench.beam import extract_code, humaneval_tasks, passes

    tasks = humaneval_tasks()
    task = tasks["HumanEval/0"]
    solution = task["prompt"] + task["canonical_solution"]
    assert passes(task, f"Here it is:\n```python\n{solution}```\nDone.")
    assert passes(task, task["canonical_solution"])  # the body only
    assert not passes(task, "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```")
    assert not passes(task, "```python\ndef has_close_elements(numbers, threshold):\n    while True: pass\n```",
                      timeout=2)
    assert not passes(task, "```python\nimport os\nos.environ['X']\n```")  # empty environment: KeyError
    assert extract_code("a\n```py\nx = 1\n") == "x = 1\n"
    assert extract_code("no fences") == "no fences"


def test_serving_benchmark_end_to_end(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """``bench --serving`` on the tiny model: a real ``triedec serve`` process per phase, loaded by
    the openai client at two concurrencies; in-process solo runs; generate_batch against
    transformers' own; results, tables and the plot written, every greedy text equal to its solo
    text."""
    monkeypatch.setenv("TRIEDEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "category": "chat"}) for p in
                              ["Hello there", "Tell me a story", "one two three one two", "What is the sea?"]))
    out = tmp_path / "serving"
    code = main(["bench", "--serving", "--model", str(tiny_model_dir), "--dataset", str(data), "--methods",
                 "ngram-trie:sized=false", "--concurrency", "1,2", "--batch-sizes", "2", "--max-new-tokens", "6",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["requests"] == 4 and results["commit"] and results["machine"]["cpu"]
    assert results["methods"] == ["ngram-trie:sized=false"]  # not overwritten by the generate_batch sides
    assert sorted((r["method"], r["concurrency"]) for r in results["phases"]) == [
        ("ngram-trie:sized=false", 1), ("ngram-trie:sized=false", 2)]
    assert sorted(map(tuple, results["phase_order"])) == sorted((r["method"], r["concurrency"], r["repeat"])
                                                               for r in results["phases"])
    for r in results["phases"]:
        assert r["identical_texts"] == 4 and r["tokens_per_s"] > 0 and r["p95_latency_s"] >= r["p50_latency_s"] > 0
        assert len(r["completion_tokens_each"]) == 4 and sum(r["completion_tokens_each"]) == r["completion_tokens"]
    (batch,) = results["generate_batch"]
    assert batch["requests"] == 2 and batch["mismatches_vs_solo"] == [] and batch["transformers_tokens_per_s"] > 0
    assert (out / "serving.png").stat().st_size > 0
    assert "through the server, one at a time" in (out / "results.md").read_text()
    assert "serve under load" in capsys.readouterr().out


def test_serving_benchmark_repeats_sampled_phases_and_pairs_them(tmp_path, tiny_model_dir, monkeypatch):
    """Sampled and repeated: every phase twice, each on a fresh server, in one seeded order; request
    k seeded seed + k, so every served text equals its in-process solo text; the prompts' ids, the
    solo outputs and the sampling are recorded; the ratio to ar carries an interval over repeats."""
    monkeypatch.setenv("TRIEDEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "category": "chat", "id": f"q{i}"}) for i, p in
                              enumerate(["Hello there", "Tell me a story", "one two three one two"])))
    out = tmp_path / "serving"
    assert main(["bench", "--serving", "--model", str(tiny_model_dir), "--dataset", str(data), "--methods",
                 "ngram-trie:sized=false,ar", "--concurrency", "2", "--repeats", "2", "--temperature", "0.9",
                 "--seed", "5", "--max-new-tokens", "6", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["repeats"] == 2 and results["sampling"]["temperature"] == 0.9 and results["sampling"]["seed"] == 5
    assert len(results["prompt_ids"]) == 3 and results["generate_batch"] == []  # a greedy comparison: skipped
    assert sorted((r["method"], r["repeat"]) for r in results["phases"]) == [
        ("ar", 0), ("ar", 1), ("ngram-trie:sized=false", 0), ("ngram-trie:sized=false", 1)]
    assert len(results["phase_order"]) == 4
    firsts, seconds = results["phase_order"][0::2], results["phase_order"][1::2]  # blocks of two, back to back
    assert [p[1:] for p in firsts] == [p[1:] for p in seconds]
    assert all(a[0] != b[0] for a, b in zip(firsts, seconds, strict=True))
    for r in results["phases"]:
        assert r["identical_texts"] == 3 and r["differing_texts"] == []
    assert results["solo_outputs"]["ar"]["texts"] == results["solo_outputs"]["ngram-trie:sized=false"]["texts"]
    md = (out / "results.md").read_text()
    assert "sampled (temperature 0.9; request k seeded 5 + k)" in md and "2 repeat(s)" in md
    (row,) = [line for line in md.splitlines() if line.startswith("| 2 | ")]
    assert re.fullmatch(r"\| 2 \| \d+\.\d\dx \[\d+\.\d\d, \d+\.\d\d\] \|", row)


def test_repeat_intervals_pair_phases_by_repeat():
    from triedec.bench.serving_report import paired_ratio, phase_runs, serving_markdown
    from triedec.bench.stats import repeat_interval, t_quantile

    assert t_quantile(2) == 4.303 and abs(t_quantile(11) - 2.201) < 1e-3 and abs(t_quantile(60) - 2.000) < 1e-3
    assert repeat_interval([1.2]) is None
    low, high = repeat_interval([1.1, 1.2, 1.3])
    assert low < 1.1 and high > 1.3  # three repeats: t = 4.30, wider than their range
    assert repeat_interval([1.2, 1.2, 1.2]) == pytest.approx((1.2, 1.2))

    def phase(method, c, tps, repeat):
        return {"method": method, "concurrency": c, "tokens_per_s": tps, "p50_latency_s": 1.0 + repeat,
                "p95_latency_s": 2.0, "identical_texts": 4, "requests": 4, "repeat": repeat}

    phases = [phase("auto", 1, t, i) for i, t in enumerate((20.0, 24.0, 22.0))]
    phases += [phase("ar", 1, t, i) for i, t in enumerate((10.0, 20.0, 11.0))]
    runs = phase_runs({"phases": phases[::-1]})
    assert [r["repeat"] for r in runs["auto", 1]] == [0, 1, 2]
    point, ci, pairs = paired_ratio(runs, "auto", "ar", 1)
    assert pairs == 3 and point == pytest.approx((2.0 * 1.2 * 2.0) ** (1 / 3))  # paired by repeat, not sorted
    assert ci == repeat_interval([2.0, 1.2, 2.0])
    results = {"requests": 4, "max_tokens": 8, "kernels": "plain", "commit": "abc", "repeats": 3,
               "machine": {"cpu": "x", "torch_threads": 2, "torch": "2", "transformers": "5"},
               "phase_order": [[p["method"], 1, p["repeat"]] for p in phases], "methods": ["auto", "ar"],
               "phases": phases, "in_process_tokens_per_s": {"auto": 25.0, "ar": 11.0}, "generate_batch": []}
    md = serving_markdown(results)
    assert "| auto | 1 | 22.0 (20.0-24.0) | 1.00x | 2.00 | 2.00 | 12/12 |" in md
    assert f"| 1 | {point:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}] |" in md and "greedy" in md


def test_serving_tables_compare_each_method_with_ar():
    from triedec.bench.serving_report import serving_markdown

    def phase(method, c, tps):
        return {"method": method, "concurrency": c, "tokens_per_s": tps, "p50_latency_s": 1.0, "p95_latency_s": 2.0,
                "identical_texts": 4, "requests": 4}

    results = {"requests": 4, "max_tokens": 8, "kernels": "plain", "commit": "abc",
               "machine": {"cpu": "x", "torch_threads": 2, "torch": "2", "transformers": "5"},
               "phase_order": [["auto", 1], ["ar", 1], ["auto", 2], ["ar", 2]], "methods": ["auto", "ar"],
               "phases": [phase("auto", 1, 20.0), phase("auto", 2, 30.0), phase("ar", 1, 10.0), phase("ar", 2, 25.0)],
               "in_process_tokens_per_s": {"auto": 25.0, "ar": 11.0}, "generate_batch": [],
               "cost_surface": {"context_tokens": 256, "forward_ms": {"1": 50.0, "16": 100.0},
                                "batch_forward_ms": {"2": {"2": 55.0, "4": 60.0}}, "context_ms_per_1k_tokens": 6.0}}
    md = serving_markdown(results)
    assert "| auto | 2 | 30.0 | 1.50x |" in md and "| 2 | 1.20x |" in md and "| auto | 25.0 | 20.0 | 0.80x |" in md
    assert "1 request 50.0 ms (1 token), 100.0 ms (16); 2 requests 55.0 ms (2 tokens)" in md
    results["cost_surface"] = None
    assert "calibration" not in serving_markdown(results)


def test_bench_plots_carry_each_bar_interval_and_n_from_results_json():
    """The speedup and tokens-per-step bars of a published run: every error bar spans the 95%
    interval that results.json holds (or the bootstrap over its samples' prompts), every bar is
    labelled with its number of prompts, and the baseline is named."""
    import matplotlib

    matplotlib.use("Agg")
    from triedec.bench.report import accepted_figure, speedup_figure
    from triedec.bench.stats import ratio_interval

    results = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "spec-bench-greedy-cpu" /
                          "results.json").read_text())
    names = list(results["methods"])
    fig = speedup_figure(results)
    (ax,) = fig.axes
    categories = [*results["methods"][names[0]]["by_category"], "overall"]
    bars = [c for c in ax.containers if isinstance(c, matplotlib.container.BarContainer)]
    assert len(bars) == len(names)
    labels = [t.get_text() for t in ax.texts]
    for name, bar in zip(names, bars, strict=True):
        segments = bar.errorbar.lines[2][0].get_segments()
        for category, segment in zip(categories, segments, strict=True):
            part = results["methods"][name]["overall" if category == "overall" else "by_category"]
            cmp = (part if category == "overall" else part[category])["vs_reference"]
            assert segment[0][1] == pytest.approx(cmp["ci95"][0]) and segment[1][1] == pytest.approx(cmp["ci95"][1])
            assert f"n={cmp['prompts']}" in labels
    assert results["reference"] in ax.get_ylabel() and results["reference"] in ax.get_title()

    fig = accepted_figure(results, results["samples"])
    (ax,) = fig.axes
    (bar,) = [c for c in ax.containers if isinstance(c, matplotlib.container.BarContainer)]
    segments = bar.errorbar.lines[2][0].get_segments()
    for name, segment, text in zip(names, segments, ax.texts, strict=True):
        rows = {}
        for r in results["samples"]:
            if r["method"] == name:
                t, s = rows.get(r["id"], (0, 0))
                rows[r["id"]] = (t + max(r["new_tokens"] - 1, 0), s + r["steps"])
        question = {r["id"]: str(r.get("question", r["id"])) for r in results["samples"]}
        low, high = ratio_interval([t for t, _ in rows.values()], [s for _, s in rows.values()],
                                   units=[question[k] for k in rows])
        assert low <= results["methods"][name]["overall"]["mean_accepted"] <= high
        assert (segment[0][1], segment[1][1]) == pytest.approx((low, high))
        assert text.get_text() == f"n={len(rows)}"


def test_serving_plot_draws_each_point_with_its_interval():
    import matplotlib

    matplotlib.use("Agg")
    from triedec.bench.serving_report import serving_figure, throughput_interval

    rng = random.Random(0)
    phases = []
    for method in ("auto", "ar"):
        for c in (1, 4):
            tokens = [rng.randint(60, 128) for _ in range(12)]  # MIN_UNITS requests or more get an interval
            latencies = [t / rng.uniform(10, 30) * c for t in tokens]
            phases.append({"method": method, "concurrency": c, "tokens_per_s": sum(tokens) / sum(latencies) * c,
                           "p50_latency_s": 1.0, "p95_latency_s": 2.0, "latencies_s": latencies,
                           "completion_tokens_each": tokens})
    results = {"methods": ["auto", "ar"], "phases": phases, "requests": 12, "max_tokens": 128}
    left = serving_figure(results).axes[0]
    assert "95% bootstrap interval" in left.get_title()
    lines = [c for c in left.containers if isinstance(c, matplotlib.container.ErrorbarContainer)]
    assert len(lines) == 2
    for method, container in zip(("auto", "ar"), lines, strict=True):
        rows = [p for p in phases if p["method"] == method]
        for row, segment in zip(rows, container.lines[2][0].get_segments(), strict=True):
            low, high = throughput_interval(row)
            assert low < row["tokens_per_s"] < high
            assert (segment[0][1], segment[1][1]) == pytest.approx((low, high))
    del phases[0]["completion_tokens_each"]  # a run from before per-request tokens: no interval, said so
    assert throughput_interval(phases[0]) is None
    assert "intervals only where" in serving_figure(results).axes[0].get_title()
