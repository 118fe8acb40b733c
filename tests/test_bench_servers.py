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


def test_percentiles_and_a_load_phase_summary() -> None:
    from triedec.bench.load import LoadResponse, summarize_load
    from triedec.bench.servers import latency_summary
    from triedec.bench.stats import percentile

    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    load = summarize_load([LoadResponse("", "stop", n, s, 1) for n, s in ((4, 1.0), (6, 3.0), (2, 2.0))], 4.0)
    assert load["p50_latency_s"] == 2.0 and load["p95_latency_s"] == pytest.approx(2.9)
    assert load["tokens_per_s"] == 3.0 and load["requests_per_s"] == 0.75
    records = [{"tokens": 5, "sent": 0.0, "first": 0.1, "last": 0.5, "chunk_times": [0.1, 0.2, 0.5]},
               {"tokens": 3, "sent": 0.0, "first": 0.3, "last": 0.5, "chunk_times": [0.3, 0.5]},
               {"tokens": 0, "sent": 0.0, "first": None, "last": None, "chunk_times": []}]
    out = latency_summary(records, 2.0)
    assert out["tokens"] == 8 and out["tokens_per_s"] == 4.0 and out["requests"] == 3
    assert out["ttft_p50_ms"] == pytest.approx(200.0)  # 100 and 300 ms; the empty answer has no first token
    assert out["tpot_p50_ms"] == pytest.approx(100.0)  # 400 ms over 4 tokens, 200 ms over 2
    assert out["itl_p99_ms"] == pytest.approx(100 + 0.99 * 200)  # gaps 100, 300 and 200 ms


def test_a_load_phase_keeps_its_concurrency_and_times_every_streamed_chunk() -> None:
    """run_phase against a small streaming server: never more than C requests in flight, every
    prompt's record with its chunks' times and the server's usage count, in prompt order."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from triedec.bench.servers import run_phase

    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for token in body["prompt"]:
                time.sleep(0.01)
                self.wfile.write(f"data: {json.dumps({'choices': [{'text': str(token)}]})}\n\n".encode())
                self.wfile.flush()
            usage = {"choices": [{"text": "", "finish_reason": "length"}],
                     "usage": {"completion_tokens": len(body["prompt"])}, "seed": body.get("seed")}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            with lock:
                state["now"] -= 1

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        prompts = {f"p{i}": list(range(1, 2 + i % 4)) for i in range(9)}
        records, seconds = run_phase(f"http://127.0.0.1:{httpd.server_address[1]}", prompts, 3, 16,
                                     lambda q: {"seed": int(q[1:])})
    finally:
        httpd.shutdown()
    assert [r["prompt"] for r in records] == list(prompts)
    assert 2 <= state["most"] <= 3  # the cap holds (and requests did overlap)
    for r in records:
        assert r["tokens"] == len(prompts[r["prompt"]]) == len(r["chunk_times"])
        assert r["text"] == "".join(map(str, prompts[r["prompt"]])) and r["finish_reason"] == "length"
        assert r["sent"] < r["first"] <= r["last"]
    assert 0 < seconds < 5


def test_the_llamacpp_scripts_share_their_options_and_refuse_missing_tools(tmp_path) -> None:
    import argparse

    from triedec.bench.servers import LLAMACPP_BIN, add_common_arguments, check_llamacpp
    from triedec.core.errors import TriedecError

    parser = argparse.ArgumentParser()
    add_common_arguments(parser, max_tokens=256, repeats=3)
    args = parser.parse_args(["--out", str(tmp_path)])
    assert (args.max_tokens, args.repeats, args.threads, args.llamacpp, args.model) == (256, 3, 2, LLAMACPP_BIN, None)
    (tmp_path / "llama-server").write_text("")
    check_llamacpp(tmp_path, ("llama-server",))
    with pytest.raises(TriedecError, match=r"llama-bench not found: build llama\.cpp"):
        check_llamacpp(tmp_path)
    with pytest.raises(TriedecError, match=r"llama-bench not found: .*, or pass --no-llama$"):
        check_llamacpp(tmp_path, otherwise="pass --no-llama")


def test_engine_metrics_reads_the_servers_own_exposition() -> None:
    """What a phase's engine did, read back from the text the server's metrics registry exports:
    its step counters, the draft nodes it verified and each load level's drafting decision."""
    from prometheus_client import generate_latest

    from triedec.bench.servers import engine_metrics
    from triedec.server.metrics import Metrics

    metrics = Metrics(lambda: (0, 0), 128)
    assert engine_metrics(generate_latest(metrics.registry).decode()) == {
        "steps": 0.0, "plain_steps": 0.0, "draft_nodes": 0.0, "drafting": {}, "speedup": {}}
    metrics.steps.inc(5)
    metrics.plain_steps.inc(2)
    for nodes in (3, 0, 9):
        metrics.draft_nodes.observe(nodes)
    metrics.drafting.labels("16").set(0.0)
    metrics.speedup.labels("16").set(0.92)
    metrics.drafting.labels("4").set(1.0)
    got = engine_metrics(generate_latest(metrics.registry).decode())
    assert got == {"steps": 5.0, "plain_steps": 2.0, "draft_nodes": 12.0, "drafting": {"16": 0.0, "4": 1.0},
                   "speedup": {"16": 0.92}}


@pytest.mark.parametrize("run", ["native-forward-vs-llamacpp-cpu", "native-forward-vs-llamacpp-gemma3-270m-cpu",
                                 "native-forward-vs-llamacpp-qwen2.5-coder-0.5b-cpu"])
def test_a_stored_llamacpp_runs_report_is_what_its_records_give(tmp_path, run) -> None:
    """scripts/vs_llamacpp.py --report-only rewrites a run's report from its records alone: the
    published results.md of each stored run is exactly what its results.json's records give."""
    import importlib.util
    import json
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("vs_llamacpp", root / "scripts" / "vs_llamacpp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shutil.copy(root / "benchmarks" / run / "results.json", tmp_path / "results.json")
    script.write_report(tmp_path, json.loads((tmp_path / "results.json").read_text()))
    assert (tmp_path / "results.md").read_text() == (root / "benchmarks" / run / "results.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["auto_equals_ar"] == 60


def test_the_startup_line_is_triedecs_runner_or_llama_cpps_system_info():
    from triedec.bench.servers import startup_line

    llama = ("system info: n_threads = 2, n_threads_batch = 2, total_threads = 2 | CPU : SSE3 = 1 | AVX = 1 | "
             "AVX2 = 1 | F16C = 1 | FMA = 1 | OPENMP = 1 | REPACK = 1 |")
    assert startup_line(llama) and startup_line("system_info: n_threads = 2 | AVX = 1 |")
    assert startup_line("triedec: model: precision int4g32a8-bfloat16; runner: triedec; kernels: ...")
    assert not startup_line("main: server is listening on http://127.0.0.1:8080")
