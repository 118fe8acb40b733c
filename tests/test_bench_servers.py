"""The side-by-side server benchmarks' arithmetic (triedec.bench.servers): per-request speeds,
per-prompt means over repeats, and ratios to a baseline with their intervals."""

from __future__ import annotations

import pytest

from triedec.bench.servers import per_prompt_speeds, ratio_cell, speeds, summarize


def record(prompt: str, system: str, tokens: int, first: float | None, last: float) -> dict:
    return {"prompt": prompt, "system": system, "tokens": tokens, "sent": 0.0, "first": first, "last": last}


def test_speeds_after_the_first_token_and_end_to_end() -> None:
    assert speeds(record("p", "s", 11, 1.0, 3.0)) == (5.0, 11 / 3.0)  # 10 tokens in 2 s after the first
    assert speeds(record("p", "s", 1, 1.0, 1.0)) == (None, 1.0)  # one token: no decode speed
    assert speeds(record("p", "s", 0, None, 0.0)) == (None, None)


def test_per_prompt_means_over_repeats_and_ratios_to_the_baseline() -> None:
    records = [record("a", "base", 11, 1.0, 3.0), record("a", "base", 11, 1.0, 2.0),  # decode 5 and 10
               record("a", "fast", 11, 1.0, 1.5),  # decode 20
               record("b", "base", 11, 0.5, 1.5), record("b", "fast", 11, 0.5, 1.0),  # 10 and 20
               record("c", "base", 1, 1.0, 1.0), record("c", "fast", 11, 1.0, 2.0)]  # c: base has no decode
    per = per_prompt_speeds(records, ["base", "fast"])
    assert per["a"]["base"][0] == pytest.approx(7.5) and per["c"]["base"][0] is None
    decode = summarize(per, ["base", "fast"], 0, "base")
    assert decode["fast"]["prompts"] == 2  # c left out for every system
    assert decode["base"]["geomean_ratio"] == pytest.approx(1.0)
    assert decode["fast"]["geomean_ratio"] == pytest.approx((20 / 7.5 * 2) ** 0.5)
    assert decode["fast"]["ratio_of_means"] == pytest.approx(40 / 17.5)
    low, high = decode["fast"]["geomean_interval"]
    assert low <= decode["fast"]["geomean_ratio"] <= high
    assert ratio_cell(decode["base"]).startswith("8.8 | 1.00x [1.00, 1.00] | 1.00x")


def test_llama_bench_line_names_the_build() -> None:
    from triedec.bench.servers import llama_bench_line

    bench = {"summary": {"tg128": {"tokens_per_s": 113.26, "stddev": 7.1}, "pp256": {"tokens_per_s": 304.1,
                                                                                      "stddev": 31.7}},
             "rows": [{"build_commit": "0c1e570", "cpu_info": "AMD EPYC"}]}
    assert llama_bench_line(bench) == ("llama-bench: tg128 113.3 ± 7.1 tok/s, pp256 304.1 ± 31.7 tok/s "
                                       "(build 0c1e570, AMD EPYC).")
