"""``triedec serve`` on the real stack: a uvicorn server on a free loopback port, driven by the
``openai`` client and httpx: shapes, streaming, the extra body, equality with ``LM.generate``,
bad input (always a JSON 4xx), a full queue (503), a bounded load test with a client that leaves
mid-stream, a schemathesis run, and SIGTERM on a real ``triedec serve`` process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from helpers import cache_with_built_kernels
from hypothesis import HealthCheck, given, settings

from triedec.bench.load import LoadRequest, run_load, serving, summarize_load
from triedec.engine.batch import BatchLimits
from triedec.server import ServerConfig, TextStream, create_app

MODEL = "tiny"
SERVER_METHOD = "pld"  # the default method of the module's server (conftest's ``base``)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHAT = [{"role": "user", "content": "Tell me a story about the sea."}]


def test_chat_completion_equals_lm_generate(client, lm):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20)
    want = lm.generate(CHAT, "pld", max_new_tokens=20)
    assert out.choices[0].message.content == want.text
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == ("length" if want.stats.stop_reason == "length" else "stop")
    assert out.usage.completion_tokens == want.stats.new_tokens
    assert out.usage.prompt_tokens == len(lm.encode(CHAT))
    ext = out.model_extra["triedec"]
    assert ext["method"] == "pld" and ext["tokens_per_step"] >= 1 and ext["tokens_per_s"] > 0
    assert ext["exactness"] == lm.adapter.exactness and ext["runner"] == lm.adapter.runner
    assert out.object == "chat.completion" and out.model == MODEL


@pytest.mark.parametrize("method,options", [("ar", {}), ("lookahead", {}), ("ngram-trie", {"sized": False}),
                                            ("pld", {"num_tokens": 4, "min_expected": 0.0}),
                                            ("recycling", {"nodes": 80})])
def test_method_in_the_extra_body_streaming_and_not(client, lm, method, options):
    want = lm.generate(CHAT, method, max_new_tokens=24, **options).text
    body = {"method": method, "method_options": options}
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, extra_body=body)
    assert out.choices[0].message.content == want
    assert out.model_extra["triedec"]["method"] == method
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=body))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1 and reasons[0] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    solo = lm.generate(CHAT, method, max_new_tokens=24, **options)
    assert chunks[-1].usage.completion_tokens == solo.stats.new_tokens


def test_completions_streaming_and_not(client, lm):
    prompt = "one two three one two three one"
    want = lm.generate(prompt, "pld", max_new_tokens=16)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    assert out.choices[0].text == want.text and out.object == "text_completion"
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    assert sum(1 for c in streamed if c.choices and c.choices[0].finish_reason) == 1
    ids = lm.encode(prompt)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=16).choices[0].text == want.text


def test_sampling_and_stop_pass_through(client, lm):
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    want = lm.generate(CHAT, "pld", max_new_tokens=20, **params).text
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, **params)
    assert out.choices[0].message.content == want
    assert out.model_extra["triedec"]["seed"] == 11
    extra = {"method": "ar", "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2}
    want = lm.generate(CHAT, "ar", max_new_tokens=20, temperature=0.7, seed=2, top_k=5, min_p=0.05,
                       repetition_penalty=1.2).text
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0.7, seed=2,
                                         extra_body=extra)
    assert out.choices[0].message.content == want
    full = lm.generate(CHAT, "pld", max_new_tokens=30).text
    start = next(i for i in range(len(full) // 3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]  # two characters well inside the answer; OpenAI returns the text before it
    expected = lm.generate(CHAT, "pld", max_new_tokens=30, stop=stop).text
    assert expected.endswith(stop)
    for stream in (False, True):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, stop=[stop], stream=stream)
        text = out.choices[0].message.content if not stream else "".join(
            c.choices[0].delta.content or "" for c in out if c.choices)
        assert text == expected[: -len(stop)]


def test_text_stream_holds_back_partial_stops_and_characters(lm):
    tok = lm.tokenizer
    ids = tok("hello world, hello sea", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, ["o s"])
    text = "".join(stream.add([t]) for t in ids) + stream.finish()
    assert text == "hello world, hell"
    plain = TextStream(tok, [])
    assert "".join(plain.add([t]) for t in ids) + plain.finish() == tok.decode(ids)


def test_models_health_and_metrics(base, client, lm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == lm.max_context > 0
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok"
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in ("triedec_requests_total", "triedec_generated_tokens_total", "triedec_request_tokens_per_second",
                 "triedec_request_mean_accepted", "triedec_queue_depth", "triedec_batch_requests_bucket",
                 "triedec_forward_tokens_bucket", "triedec_forward_budget_used_bucket",
                 "triedec_forward_draft_nodes_bucket", "triedec_request_queued_seconds_bucket", "triedec_steps_total"):
        assert name in text, name
    assert 'triedec_requests_total{endpoint="chat",method="pld",status="200"}' in text
    # what drafting buys at each load, measured: one decoding step in 4 runs plain until both arms are measured
    client.completions.create(model=MODEL, prompt="a b c a b c a b", max_tokens=24, extra_body={"ignore_eos": True})
    text = httpx.get(f"{base}/metrics").text
    plain = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("triedec_plain_steps_total"))
    assert plain >= 2 and 'triedec_drafting{load="1"}' in text


BAD = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": 3, "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages must not be empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "bogus": 1}]}, 400,
     "bogus"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "method": "warp"}, 400, "unknown method"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "method_options": {"bogus": 1}}, 400,
     "unknown option"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "method_options": {"num_tokens": "x"}}, 400,
     "num_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 0}, 400, "max_tokens must be"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": -3}, 400, "max_tokens must be"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens must be"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4000}, 400, "context"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "context"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 17}, 400, "n must lie in [1, 16]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "response_format": {"type": "json"}}, 400,
     "response_format must be"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 99}, 400,
     "top_logprobs must lie in [0, 20]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, 400,
     'tools[0] must be {"type": "function"'),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "functions": [{"name": "f"}]}, 400,
     "unsupported field(s): functions"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "seed": -1, "temperature": 0.5}, 400, "seed"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "not found"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "method": "beam", "temperature": 0.5}, 400,
     "beam search does not sample"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "unsupported field(s): suffix"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,message", BAD)
def test_bad_input_gets_a_json_4xx(base, path, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{base}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"]


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_tokens": 4000}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"seed": -1, "temperature": 0.5}, "seed"), ({"method": "warp"}, None),
])
def test_errors_name_the_field_the_client_sent(base, body, param):
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert "max_new_tokens" not in error["message"]  # the library's name never leaks to an HTTP client


def test_unknown_top_level_fields_are_ignored_with_a_warning_header(base, client):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "bogus": 1, "x\r\nSet-Cookie: a=b": 2}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-triedec-warning"] == "unknown fields ignored: bogus, xSet-Cookieab"
    assert "set-cookie" not in r.headers
    plain = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4},
                       timeout=60)
    assert "x-triedec-warning" not in plain.headers
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    with httpx.stream("POST", f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                               "stream": True, "vllm_only": True}, timeout=60) as s:
        assert s.status_code == 200 and s.headers["x-triedec-warning"] == "unknown fields ignored: vllm_only"


def test_oversized_body_gets_413(base):
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}).encode()
    r = httpx.post(f"{base}/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]

    def chunks():  # no content-length: chunked transfer, counted as it arrives
        yield big[: len(big) // 2]
        yield big[len(big) // 2 :]

    r = httpx.post(f"{base}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_a_full_queue_answers_503(lm):
    """One running, none waiting: of eight simultaneous requests some run, the rest get 503 at once."""
    app = create_app(lm, ServerConfig(model_name=MODEL, method="ar", limits=BatchLimits(max_running=1), max_queue=0))
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400}
    with serving(app) as url:
        barrier = threading.Barrier(8)
        codes: list[tuple[int, dict]] = []

        def send():
            barrier.wait()
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            codes.append((r.status_code, r.json()))

        threads = [threading.Thread(target=send) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    statuses = sorted(c for c, _ in codes)
    assert len(statuses) == 8 and 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}
    assert all("queue is full" in body["error"]["message"] for c, body in codes if c == 503)


def _solo(lm, req: LoadRequest) -> str:
    extra = dict(req.extra)
    method = extra.pop("method", "pld")
    options = extra.pop("method_options", {})
    prompt = list(req.messages) if req.messages is not None else req.prompt
    text = lm.generate(prompt, method, max_new_tokens=req.max_tokens, **extra, **options).text
    return text


def test_load_48_requests_12_at_a_time_with_a_client_leaving_mid_stream(base, lm):
    """Mixed methods, chat and completions, streaming and not: every response complete and equal to
    its solo output (none lost or crossed), while one client disconnects mid-stream."""
    topics = ["the sea", "a city", "the sky", "a robot", "music", "a garden"]
    methods = [{}, {"method": "ar"}, {"method": "lookahead"},
               {"method": "ngram-trie", "method_options": {"sized": False}},
               {"method": "recycling", "method_options": {"nodes": 80}},
               {"method": "pld", "temperature": 0.8, "seed": 5}]
    requests = []
    for i in range(48):
        extra = dict(methods[i % len(methods)])
        if i % 3 == 0:
            req = LoadRequest(max_tokens=12 + i % 9, prompt=f"Story {i} about {topics[i % 6]}:", stream=i % 2 == 0,
                              extra=extra)
        else:
            req = LoadRequest(max_tokens=12 + i % 9, messages=[{"role": "user", "content": f"Tell me about "
                                                                f"{topics[i % 6]} ({i})."}], stream=i % 2 == 0,
                              extra=extra)
        requests.append(req)
    solo = [_solo(lm, r) for r in requests]
    leaver_done = threading.Event()

    def leave_mid_stream():
        with httpx.stream("POST", f"{base}/v1/completions", json={"model": MODEL, "prompt": "A very long story:",
                                                                   "max_tokens": 400, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines), next(lines)  # read a little, then hang up
        leaver_done.set()

    leaver = threading.Thread(target=leave_mid_stream)
    leaver.start()
    responses, seconds = run_load(f"{base}/v1", MODEL, requests, concurrency=12, timeout=300)
    leaver.join(60)
    assert leaver_done.is_set()
    assert [r.text for r in responses] == solo
    assert all(r.finish_reason in ("stop", "length") for r in responses)
    summary = summarize_load(responses, seconds)
    assert summary["requests"] == 48 and summary["p95_latency_s"] >= summary["p50_latency_s"] > 0
    deadline = time.time() + 10  # the leaver's request was freed, nothing is left running
    while httpx.get(f"{base}/health").json()["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{base}/health").json().items() >= {"status": "ok", "running": 0, "waiting": 0}.items()


OPERATIONS = [("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"),
              ("/health", "GET"), ("/metrics", "GET")]


@pytest.mark.parametrize("path,method", OPERATIONS)
def test_schemathesis_finds_no_server_error(lm, path, method):
    """Requests schemathesis generates from the OpenAPI schema (valid and invalid), in process:
    never a 5xx. Bounded: 25 examples per operation, max_tokens cut to 16."""
    # the in-process client addresses the app as "testserver", which a keyless server must be told to answer
    app = create_app(lm, ServerConfig(model_name=MODEL, method="ar", default_max_tokens=8, allowed_hosts="testserver"))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    assert {(p, m) for p, m in OPERATIONS} <= {(op.path, op.method.upper()) for op in
                                               (r.ok() for r in schema.get_all_operations())}

    @given(case=schema[path][method].as_strategy())
    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
              database=None)
    def check(case):
        if isinstance(case.body, dict):
            for key in ("max_tokens", "max_completion_tokens"):  # bound the work, not the checks
                if isinstance(case.body.get(key), int):
                    case.body[key] = min(case.body[key], 16)
        response = case.call()
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

    check()


@pytest.mark.parametrize("method,flags", [("recycling", ["--recycling-nodes", "80", "--recycling-state"]),
                                          ("auto", ["--auto-sized", "false", "--auto-store"])])
def test_sigterm_finishes_in_flight_requests_and_saves_the_learned_state(tmp_path, tiny_model_dir, method, flags):
    """A real ``triedec serve`` process (the engine on its main thread): SIGTERM while a streamed
    request runs; the stream still ends with [DONE], the process exits 0, and the learned-state
    file (recycling's matrix, auto's store) is written at shutdown."""
    port = free_port()
    state = tmp_path / f"{method}.safetensors"
    env = {**os.environ, "TRIEDEC_CACHE": str(cache_with_built_kernels(tmp_path / "cache"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "triedec.cli.main", "serve", "--model", str(tiny_model_dir), "--port", str(port),
         "--method", method, *flags, str(state), "--drain-seconds", "20", "--model-name", MODEL],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            assert time.time() < deadline
            time.sleep(0.2)
        lines = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True}) as r:
            for line in r.iter_lines():
                if line and not lines:
                    proc.send_signal(signal.SIGTERM)
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        assert proc.wait(60) == 0
        assert state.exists() and state.stat().st_size > 0 and state.stat().st_mode & 0o777 == 0o600
        assert not Path(f"{state}.tmp").exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_run_that_fails_as_it_starts_fails_alone(lm):
    """A run that raises as it starts ends alone: it gets an error event (never a hang), the run
    that steps beside it finishes, and the run waiting behind its tenant's cap runs next."""
    import asyncio
    import threading

    from triedec.engine.batch import BatchLimits
    from triedec.engine.outcome import Outcome, Stats
    from triedec.engine.runs import SoloRun
    from triedec.server import Job, Scheduler, TenantLimits

    all_submitted = threading.Event()  # the first run keeps stepping until every job is in

    def finite(steps_left: int) -> SoloRun:
        def loop(adapter, steps):
            while not all_submitted.is_set():
                yield [1]
            for _ in range(steps_left):
                yield [1]
            return Outcome(Stats(new_tokens=steps_left))

        return SoloRun(loop, kv_tokens=1)

    class Broken(SoloRun):
        def start(self, adapter):
            raise RuntimeError("a bug while starting")

    async def scenario():
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(lm, BatchLimits(max_running=4), max_queue=4, tenants=TenantLimits(max_running=1))
        first, behind = Job(finite(50), loop, tenant="t"), Job(finite(2), loop, tenant="t")
        broken = Job(Broken(lambda adapter, steps: iter(()), kv_tokens=1), loop, tenant="u")
        for job in (first, behind, broken):
            scheduler.submit(job)
        all_submitted.set()
        events = {}
        for name, job in (("first", first), ("broken", broken), ("behind", behind)):
            while (event := await asyncio.wait_for(job.next(), 60))[0] == "tokens":  # never a hang
                pass
            events[name] = event
        await asyncio.to_thread(scheduler.close)
        return events

    events = asyncio.run(scenario())
    assert events["broken"][0] == "error" and "a bug while starting" in str(events["broken"][1])
    assert events["first"][0] == "done" and events["first"][1].stats.new_tokens == 50
    assert events["behind"][0] == "done" and events["behind"][1].stats.new_tokens == 2


def test_a_failed_forward_fails_the_requests_it_carried_and_keeps_the_ones_waiting(lm, monkeypatch):
    """A failure outside any one run's part of a step (the forward itself: a bug) fails the runs
    that stepped, each with an error event (never a hang), and the server goes on: the run waiting
    behind its tenant's cap is untouched and runs next."""
    import asyncio

    from triedec.api.generation import GenerationRequest
    from triedec.engine.batch import BatchLimits
    from triedec.server import Job, Scheduler, TenantLimits

    forward, calls = lm.adapter.forward_batch, [0]

    def broken_once(items):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("a bug in the forward")
        return forward(items)

    monkeypatch.setattr(lm.adapter, "forward_batch", broken_once)

    async def scenario():
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(lm, BatchLimits(max_running=4), max_queue=4, tenants=TenantLimits(max_running=1))
        runs = [lm.start(GenerationRequest.of("Tell me a story", "ar", max_new_tokens=6)) for _ in range(2)]
        first, behind = Job(runs[0], loop, tenant="t"), Job(runs[1], loop, tenant="t")
        for job in (first, behind):
            scheduler.submit(job)
        events = {}
        for name, job in (("first", first), ("behind", behind)):
            while (event := await asyncio.wait_for(job.next(), 60))[0] == "tokens":  # never a hang
                pass
            events[name] = event
        await asyncio.to_thread(scheduler.close)
        return events

    events = asyncio.run(scenario())
    assert events["first"][0] == "error" and "a bug in the forward" in str(events["first"][1])
    assert events["behind"][0] == "done" and events["behind"][1].stats.new_tokens == 6


def test_scheduler_frees_a_cancelled_request_at_once_and_cancels_the_rest_on_close(lm):
    """A request whose client left is closed at the scheduler's next step boundary (its loop's
    finally runs: the drafting session ends); close() cancels whatever still runs."""
    import asyncio

    from triedec.engine.batch import BatchLimits
    from triedec.engine.runs import SoloRun
    from triedec.server import Job, Scheduler

    ended = {"a": threading.Event(), "b": threading.Event()}

    def endless(name):
        def loop(adapter, steps):
            try:
                while True:
                    yield [1]
            finally:
                ended[name].set()

        return SoloRun(loop, kv_tokens=1)

    async def scenario():
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(lm, BatchLimits(max_running=4), max_queue=0)
        a, b = Job(endless("a"), loop), Job(endless("b"), loop)
        scheduler.submit(a)
        scheduler.submit(b)
        assert (await a.next())[0] == "tokens" and (await b.next())[0] == "tokens"
        a.cancel()
        await asyncio.to_thread(ended["a"].wait, 5)
        assert ended["a"].is_set() and not ended["b"].is_set()
        await asyncio.to_thread(scheduler.close)
        assert ended["b"].is_set() and scheduler.depth == (0, 0)
        while (event := await b.next())[0] == "tokens":
            pass
        assert event == ("cancelled", None)

    asyncio.run(scenario())
