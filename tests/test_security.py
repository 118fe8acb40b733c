"""The server as something you can expose (docs/serving.md: Security), on real uvicorn servers on loopback
driven by the ``openai`` client, httpx and raw sockets: the auth matrix on every endpoint, learned
state per tenant (``tokens_from_store`` in the stats), per-tenant caps (429 + Retry-After), the request
time limit (length / 408, KV freed), slow bodies and clients that never read, private state
files, and a schemathesis run with keys configured."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import os
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings

from triedec.bench.load import serving
from triedec.cli.serve_config import api_keys as _api_keys
from triedec.core.errors import TriedecError
from triedec.drafters import state as state_module
from triedec.drafters.state import load_state, save_state
from triedec.server import ApiKeys, ServerConfig, create_app
from triedec.server import auth as auth_module
from triedec.server.config import SERVER_LIMITS
from triedec.server.tenancy import tenant_file

MODEL = "tiny"
KEYS = {"key-alice-0123456789": "alice", "key-bob-0123456789": "bob"}
ALICE_KEY, BOB_KEY = KEYS
ALICE, BOB = f"Bearer {ALICE_KEY}", f"Bearer {BOB_KEY}"
QUESTION = [{"role": "user", "content": "Tell me a story about the sea and the ships."}]
AUTO = {"method": "auto", "method_options": {"sized": False}}


def _config(**kw) -> ServerConfig:
    return ServerConfig(**{"model_name": MODEL, "method": "ar", "default_max_tokens": 16, **kw})


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


# ---- keys -----------------------------------------------------------------------------------------

ENDPOINTS = [("POST", "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 4}),
             ("POST", "/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 4}),
             ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/health", None),
             ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/no-such-path", None)]


def _matrix(url: str, keys: ApiKeys | None) -> None:
    for method, path, body in ENDPOINTS:
        for auth in (None, "Bearer wrong-key", "Basic " + ALICE_KEY, ALICE):
            got = httpx.request(method, url + path, json=body, headers={"Authorization": auth} if auth else {},
                                timeout=60)
            if keys is None or auth == ALICE or keys.is_open(path):
                # FastAPI's generated /docs page is off (it loads a CDN's scripts): 404 like any unknown path
                assert got.status_code == (404 if path in ("/no-such-path", "/docs") else 200), (path, auth, got.text)
            else:
                assert got.status_code == 401, (path, auth)
                err = got.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert got.headers["www-authenticate"] == "Bearer"
                assert ALICE_KEY not in got.text


@pytest.mark.parametrize("keys", [ApiKeys(KEYS), ApiKeys(KEYS, public_metrics=True), None],
                         ids=["keys", "keys-public-metrics", "no-keys"])
def test_the_auth_matrix_on_every_endpoint(lm, keys):
    """No key, a wrong key, another scheme and a right key on every endpoint: 401 in OpenAI's
    shape unless the key is right or the path is open (/health; /metrics if public); without
    keys configured everything is open, whatever header comes."""
    with serving(create_app(lm, _config(api_keys=keys))) as url:
        _matrix(url, keys)
        if keys is not None:  # the openai client: a wrong key is an AuthenticationError, the right one works
            with pytest.raises(openai.AuthenticationError):
                _client(url, "wrong").chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
            assert _client(url, BOB_KEY).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)


def test_an_unauthenticated_body_is_never_read(lm):
    """401 comes before the body: a client without a key cannot even upload (no 413 either)."""
    with serving(create_app(lm, _config(api_keys=ApiKeys(KEYS), max_body_bytes=1000))) as url:
        got = httpx.post(f"{url}/v1/completions", content=b"x" * 5000, headers={"Content-Type": "application/json"})
        assert got.status_code == 401


def test_keys_are_compared_with_every_configured_key_in_constant_time(monkeypatch):
    keys = ApiKeys({**KEYS, "third-key-xyz": "carol"})
    calls = []
    original = hmac.compare_digest

    def compare(a, b):
        calls.append((len(a), len(b)))
        return original(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", compare)
    for header, want in [(ALICE, "alice"), ("Bearer nope", None), ("bearer  third-key-xyz ", "carol"), ("", None),
                         ("Bearer", None), (b"Bearer \xff", None), (None, None)]:
        calls.clear()
        assert keys.tenant(header) == want
        if want is not None or header in ("Bearer nope",):
            assert calls == [(32, 32)] * 3  # one digest comparison per key, whatever matched
    assert "key-alice" not in repr(keys) and "key-alice" not in str(keys)


def test_keys_from_flags_file_and_environment(tmp_path):
    file = tmp_path / "keys"
    file.write_text("# operators\nkey-one alice\n\nkey-two   # no tenant: its own\nkey-three alice\n")
    keys = ApiKeys.load(["flag-key"], file)
    assert keys.tenants["key-one"] == keys.tenants["key-three"] == "alice"
    assert keys.tenants["key-two"].startswith("key-") and "two" not in keys.tenants["key-two"]
    assert keys.tenants["flag-key"] != keys.tenants["key-two"]
    for text, message in [("a b c\n", "expected"), ("# only comments\n", "no key"), ("k alice\nk bob\n", "twice")]:
        file.write_text(text)
        with pytest.raises(TriedecError, match=message):
            ApiKeys.load([], file)
    with pytest.raises(TriedecError, match="cannot read"):
        ApiKeys.load([], tmp_path / "missing")
    assert ApiKeys.load([], None) is None

    args = argparse.Namespace(api_key=[], api_keys_file=None, public_metrics=False)
    assert _api_keys(args, {}) is None
    assert set(_api_keys(args, {"TRIEDEC_API_KEY": "env-key"}).tenants) == {"env-key"}
    args.api_key = ["flag"]
    assert set(_api_keys(args, {"TRIEDEC_API_KEY": "env-key"}).tenants) == {"flag"}  # a flag wins


def test_keys_are_never_logged(lm, caplog):
    caplog.set_level(logging.DEBUG)
    with serving(create_app(lm, _config(api_keys=ApiKeys(KEYS)))) as url:
        for auth in (ALICE, "Bearer wrong-secret-123"):
            httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 2},
                       headers={"Authorization": auth})
    for secret in (*KEYS, "wrong-secret-123"):
        assert secret not in caplog.text


# ---- learned state per tenant -----------------------------------------------------------------------

def _ask(url: str, key: str, user: str | None = None) -> tuple[str, dict]:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 48, **AUTO}
    if user:
        body["user"] = user
    got = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": key}, timeout=60)
    assert got.status_code == 200, got.text
    out = got.json()
    return out["choices"][0]["message"]["content"], out["triedec"]


@pytest.mark.parametrize("learning", ["tenant", "shared", "off"])
def test_tenant_b_drafts_nothing_from_tenant_a_unless_shared(lm, learning):
    config = _config(api_keys=ApiKeys(KEYS), learning=learning)
    with serving(create_app(lm.fresh(), config)) as url:
        text_a, stats_a = _ask(url, ALICE)
        text_b, stats_b = _ask(url, BOB)
        again_a, again_stats = _ask(url, ALICE)
    want = lm.generate(QUESTION, "auto", max_new_tokens=48, sized=False).text
    assert text_a == text_b == again_a == want  # exact whatever was learned
    assert stats_a["learning"] == stats_b["learning"] == learning
    assert stats_a["tokens_from_store"] == 0
    if learning == "shared":
        assert stats_b["tokens_from_store"] > 0
    else:
        assert stats_b["tokens_from_store"] == 0
    # a tenant drafts from its own earlier answer, unless nothing is learned
    assert (again_stats["tokens_from_store"] > 0) == (learning != "off")


def test_without_keys_tenant_learning_follows_the_user_field(lm):
    with serving(create_app(lm.fresh(), _config(learning="tenant"))) as url:
        _ask(url, "Bearer unused", user="ann")
        assert _ask(url, "Bearer unused", user="ben")[1]["tokens_from_store"] == 0
        assert _ask(url, "Bearer unused", user="ann")[1]["tokens_from_store"] > 0


def test_the_default_learning_is_tenant_with_keys_and_shared_without():
    assert ServerConfig(api_keys=ApiKeys(KEYS)).tenancy().learning == "tenant"
    assert ServerConfig().tenancy().learning == "shared"
    with pytest.raises(TriedecError, match="learning"):
        ServerConfig(learning="everyone")  # type: ignore[arg-type]


def test_state_files_are_kept_per_tenant_and_clients_cannot_name_one(lm, tmp_path):
    store = tmp_path / "state" / "store.safetensors"
    config = _config(api_keys=ApiKeys(KEYS), method="auto", method_options={"sized": False, "store": str(store)},
                     limits=dataclasses.replace(SERVER_LIMITS, persist_every=1))
    with serving(create_app(lm.fresh(), config)) as url:
        for key in (ALICE, BOB):
            got = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24},
                             headers={"Authorization": key}, timeout=60)
            assert got.status_code == 200 and "store" not in got.json()["triedec"]["options"]  # no server paths
        bad = httpx.post(f"{url}/v1/completions", headers={"Authorization": ALICE}, timeout=60,
                         json={"prompt": "Once", "max_tokens": 4, "method": "auto",
                               "method_options": {"store": str(tmp_path / "mine.safetensors")}})
        assert bad.status_code == 400 and "learned-state files" in bad.json()["error"]["message"]
        deadline = time.time() + 20
        while len(list(Path(f"{store}.tenants").glob("*.safetensors"))) < 2 and time.time() < deadline:
            time.sleep(0.1)
    files = sorted(Path(f"{store}.tenants").glob("*.safetensors"))
    assert {f.name for f in files} == {Path(tenant_file(str(store), t)).name for t in ("alice", "bob")}
    assert not store.exists() and not (tmp_path / "mine.safetensors").exists()
    assert stat.S_IMODE(Path(f"{store}.tenants").stat().st_mode) == 0o700
    assert stat.S_IMODE(store.parent.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    with pytest.raises(TriedecError, match="keeps no learned state"):
        create_app(lm.fresh(), _config(learning="off", method="auto", method_options={"store": str(store)}))


def test_idle_tenants_past_the_bound_are_dropped(lm):
    fresh = lm.fresh()
    with serving(create_app(fresh, _config(learning="tenant", max_tenants=2))) as url:
        for user in ("u1", "u2", "u3", "u1"):
            _ask(url, "Bearer unused", user=user)
        scopes = {key[0] for key in fresh.methods if key[0] is not None}
    assert scopes == {("tenant", "user:u3"), ("tenant", "user:u1")}


# ---- limits -----------------------------------------------------------------------------------------

def test_a_tenant_over_its_cap_gets_429_with_retry_after_while_another_is_served(lm):
    config = _config(api_keys=ApiKeys(KEYS), tenant_max_running=1, tenant_max_queued=0, max_tokens_limit=400)
    app = create_app(lm, config)
    pause = None
    with serving(app) as url, ThreadPoolExecutor(1) as pool:
        def once(key: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", headers={"Authorization": key}, timeout=60,
                              json={"prompt": "Once upon a time", "max_tokens": 8})

        once(ALICE)  # alice's method is built
        with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": ALICE}, timeout=60,
                          json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True}) as first:
            for line in first.iter_lines():
                if line.startswith("data: {") and pause is None:  # alice's request runs: hold the engine
                    pause = app.state.scheduler.call(lambda: time.sleep(2.0))
                    bob = pool.submit(once, BOB)
                    second = once(ALICE)
                    assert second.status_code == 429, second.text
                    assert second.json()["error"]["code"] == "rate_limit_exceeded"
                    assert int(second.headers["retry-after"]) >= 1
                    assert not bob.done()  # bob waits for the engine like everyone, not for alice
            assert bob.result().status_code == 200  # served while alice is at her cap
        pause.result()
        assert once(ALICE).status_code == 200  # the cap counts requests in flight only


def test_max_tokens_is_capped_server_wide(lm):
    with serving(create_app(lm, _config(max_tokens_limit=32))) as url:
        got = httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 33})
        assert got.status_code == 400 and "limit of 32" in got.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 32}).status_code == 200
    with pytest.raises(TriedecError, match="exceeds max_tokens_limit"):
        ServerConfig(default_max_tokens=64, max_tokens_limit=32)


def test_a_request_past_its_time_ends_with_length_or_408_and_its_kv_is_freed(lm):
    app = create_app(lm, _config(max_request_seconds=0.8, max_tokens_limit=400))
    scheduler = app.state.scheduler
    with serving(app) as url:
        # a streamed request: the engine pauses after its first tokens, past the deadline
        finish, stats, chunks = None, None, 0
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                chunks += 1
                if chunks == 2:
                    scheduler.call(lambda: time.sleep(1.0))
                for choice in event["choices"]:
                    finish = choice["finish_reason"] or finish
                if event.get("usage"):
                    stats, usage = event["triedec"], event["usage"]
        assert finish == "length" and stats["stop_reason"] == "time_limit"
        assert 0 < usage["completion_tokens"] < 400
        # a request with no token yet when its time is up: 408, for a stream too
        for stream in (False, True):
            scheduler.call(lambda: time.sleep(1.2))
            got = httpx.post(f"{url}/v1/completions", timeout=60,
                             json={"prompt": "Once upon a time", "max_tokens": 8, "stream": stream})
            assert got.status_code == 408, got.text
            assert got.json()["error"]["code"] == "timeout"
        assert httpx.get(f"{url}/health").json().items() >= {"status": "ok", "running": 0, "waiting": 0}.items()
        assert scheduler.batch.idle  # every expired request left the batch (its KV freed)


# ---- slow clients -----------------------------------------------------------------------------------

def _timed_request(url: str) -> float:
    started = time.perf_counter()
    got = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 16}, timeout=60)
    assert got.status_code == 200
    return time.perf_counter() - started


def test_a_slow_body_and_a_client_that_never_reads_do_not_hold_the_others(lm):
    bound = 3.0  # seconds: what a 16-token request may take here while both bad clients hang on
    with serving(create_app(lm, _config(body_seconds=1.5, send_seconds=2.0, max_tokens_limit=500))) as url:
        host, port = url.removeprefix("http://").split(":")
        baseline = _timed_request(url)
        slow = socket.create_connection((host, int(port)))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        mute = socket.socket()
        mute.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        mute.connect((host, int(port)))
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 500, "stream": True}).encode()
        mute.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        times = [_timed_request(url) for _ in range(4)]
        assert max(times) < bound + baseline, times
        slow.settimeout(10)
        answer = b""  # the slow body gets 408 once body_seconds passed (head and body may come apart)
        while not answer.endswith(b"}}") and (chunk := slow.recv(4096)):
            answer += chunk
        assert b" 408 " in answer.split(b"\r\n")[0] and b"timeout" in answer
        slow.close()
        mute.close()
        deadline = time.time() + 10  # the mute client's request ends (done, or given up after send_seconds)
        while httpx.get(f"{url}/health").json()["running"] and time.time() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}/health").json()["running"] == 0


def test_a_response_the_client_never_takes_is_given_up_after_send_seconds():
    """The transport middleware bounds every send: a client whose socket never drains (a send
    that never returns) ends the response after ``send_seconds``."""
    from triedec.server.transport import _Transport

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})

    async def stuck_send(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def scenario():
        started = time.perf_counter()
        await _Transport(app, 1000, body_seconds=1.0, send_seconds=0.3)(
            {"type": "http", "method": "GET", "headers": []}, receive, stuck_send)
        return time.perf_counter() - started

    assert asyncio.run(scenario()) < 2.0


def test_the_event_channel_is_bounded_and_never_blocks_the_scheduler():
    """Tokens emitted while nobody reads coalesce into one pending list and one wake-up."""
    from triedec.server.jobs import Job

    async def scenario():
        loop = asyncio.get_running_loop()
        scheduled = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            scheduled.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        job = Job(run=None, loop=loop)  # type: ignore[arg-type]
        emitter = threading.Thread(target=lambda: [job.emit("tokens", [i]) for i in range(1000)])
        emitter.start()
        emitter.join()
        assert len(scheduled) == 1
        assert await job.next() == ("tokens", list(range(1000)))
        job.emit("tokens", [7])
        job.emit("done", "outcome")
        assert await job.next() == ("tokens", [7])
        assert await job.next() == ("done", "outcome") == await job.next()

    asyncio.run(scenario())


# ---- data at rest -----------------------------------------------------------------------------------

def test_state_files_are_private_and_unsafe_ones_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "a" / "b" / "state.safetensors"
    save_state(path, {"x": torch.arange(3)}, {"format": "f"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
    meta, tensors = load_state(path, "test state", "state", "f")
    assert meta["format"] == "f" and tensors["x"].tolist() == [0, 1, 2]
    os.chmod(path, 0o666)
    with pytest.raises(TriedecError, match="may be written by other users"):
        load_state(path, "test state", "state", "f")
    os.chmod(path, 0o600)
    monkeypatch.setattr(state_module.os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(TriedecError, match="owned by another user"):
        load_state(path, "test state", "state", "f")
    monkeypatch.undo()
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(TriedecError, match="not a readable"):
        load_state(path, "test state", "state", "f")
    with pytest.raises(TriedecError, match="is not a regular file"):
        load_state(tmp_path, "test state", "state", "f")


def test_an_unsafe_store_is_refused_with_a_clear_error_when_the_server_starts(lm, tmp_path):
    store = tmp_path / "store.safetensors"
    drafter = lm.fresh().decoder("auto", store=str(store)).drafter
    drafter.remember(list(range(5, 40)), [3, 4])
    drafter.persist()
    assert stat.S_IMODE(store.stat().st_mode) == 0o600
    create_app(lm.fresh(), _config(method="auto", method_options={"store": str(store)}))  # loads
    os.chmod(store, 0o622)
    with pytest.raises(TriedecError, match="may be written by other users"):
        create_app(lm.fresh(), _config(method="auto", method_options={"store": str(store)}))


# ---- schemathesis -----------------------------------------------------------------------------------

OPERATIONS = [("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"),
              ("/health", "GET"), ("/metrics", "GET")]


@pytest.mark.parametrize("path,method", OPERATIONS)
def test_schemathesis_with_keys_finds_no_server_error(lm, path, method):
    """Generated requests (valid and invalid), with a right key, a wrong one or none: never a
    5xx. Bounded: 15 examples per operation, max_tokens cut to 8."""
    app = create_app(lm, _config(api_keys=ApiKeys(KEYS), tenant_max_running=2, max_request_seconds=30))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"Authorization": ALICE})

    @given(case=schema[path][method].as_strategy())
    @settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
              database=None)
    def check(case):
        if isinstance(case.body, dict):
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(key), int):
                    case.body[key] = min(case.body[key], 8)
        for auth in (ALICE, "Bearer wrong", None):
            response = case.call(headers={"Authorization": auth} if auth else {})
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

    check()


def test_scopes_rewrite_state_files_per_tenant_and_forget_what_they_must():
    from triedec.server.tenancy import Scopes, Tenancy

    forgotten = []
    shared = Scopes(Tenancy("shared"), forgotten.append)
    assert shared.enter("alice", "auto", {"store": "/s/store.safetensors"}) == (None, {"store": "/s/store.safetensors"})
    off = Scopes(Tenancy("off"), forgotten.append)
    first, _ = off.enter("alice", "auto", {})
    second, _ = off.enter("alice", "auto", {})
    assert first != second
    off.leave(first)
    assert forgotten == [first]
    with pytest.raises(TriedecError, match="keeps no learned state"):
        off.check("auto", {"store": "/s/store.safetensors"})
    forgotten.clear()
    tenants = Scopes(Tenancy("tenant", max_tenants=1), forgotten.append)
    scope, options = tenants.enter("../../etc/passwd", "auto", {"store": "/s/store.safetensors", "k": 4})
    assert scope == ("tenant", "../../etc/passwd") and options["k"] == 4
    assert Path(options["store"]).parent == Path("/s/store.safetensors.tenants") and ".." not in options["store"]
    busy, _ = tenants.enter("bob", "auto", {})
    assert forgotten == [] and tenants.tenants == 2  # alice's request is still in flight: nobody is dropped
    tenants.leave(scope)
    assert forgotten == [("tenant", "../../etc/passwd")] and tenants.tenants == 1
    tenants.leave(busy)
    assert tenants.tenants == 1  # bob stays: within the bound


def test_the_server_keeps_an_idle_connection_longer_than_client_pools_do():
    """A pooled connection must be dropped by its client before the server closes it: with equal
    idle times a request sent as the server closes the connection fails ("Server disconnected",
    seen in the suite when both were 5 s). httpx's pool (the ``openai`` client's) keeps one 5 s."""
    import httpx2

    from triedec.server.config import KEEP_ALIVE_SECONDS

    for limits in (httpx.Limits(), httpx2.Limits()):
        assert limits.keepalive_expiry is not None and limits.keepalive_expiry < KEEP_ALIVE_SECONDS
