"""triedec on Ray Serve (:mod:`triedec.ray.app`): the router's choice and the affinity key as pure
functions, the application's arguments, and a local Ray cluster with two engine replicas of the
default model driven by the ``openai`` client: answers equal ``LM.generate``'s, a conversation's
turns stay on one replica, and a replica killed mid-run fails only its own requests and is
restarted."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
import torch
from helpers import RedisServer, absorbed_after, free_port, quiet

pytest.importorskip("ray.serve", reason="the ray extra is not installed")

import openai
import ray
from ray import serve

from triedec.api.spec import ModelSpec
from triedec.core.errors import TriedecError
from triedec.drafters.registry import NEEDS_COST, profile_specs
from triedec.ray.app import APP_NAME, REPLICA_HEADER, Engine, RaySettings, app, build, engine_options, parse_pairs, run
from triedec.ray.routing import affinity_key, choose, rendezvous

# -- the pure parts ----------------------------------------------------------------------------------


def test_rendezvous_keeps_a_key_on_its_replica_and_moves_only_the_leavers_keys():
    replicas = [f"r{i}" for i in range(5)]
    keys = [f"conversation-{i}" for i in range(2000)]
    home = {k: rendezvous(k, replicas) for k in keys}
    assert all(rendezvous(k, list(reversed(replicas))) == home[k] for k in keys)  # order does not matter
    spread = Counter(home.values())
    assert set(spread) == set(replicas) and min(spread.values()) > 2000 / 5 * 0.8  # about even
    after = {k: rendezvous(k, [r for r in replicas if r != "r2"]) for k in keys}
    moved = {k for k in keys if after[k] != home[k]}
    assert moved == {k for k in keys if home[k] == "r2"}  # only r2's keys moved
    assert Counter(after[k] for k in moved).keys() == {"r0", "r1", "r3", "r4"}  # and they spread out


def test_choose_sends_a_key_home_unless_home_leads_the_least_loaded_by_the_slack():
    rng = random.Random(0)
    load = {"a": 0, "b": 0, "c": 0}
    home = rendezvous("k", list(load))
    ranks = choose("k", load, slack=4, rng=rng)
    assert ranks[0] == [home] and home not in ranks[1] and len(ranks[1]) >= 1
    assert choose("k", {**load, home: 3}, slack=4, rng=rng)[0] == [home]  # a lead under the slack
    fallback = choose("k", {**load, home: 4}, slack=4, rng=rng)  # a lead of the slack: power of two
    assert len(fallback) == 1 and len(fallback[0]) == 2
    assert choose("k", {**load, home: None}, slack=4, rng=rng)[0] == [home]  # unknown load counts as 0
    assert choose("k", {home: 50}, slack=4, rng=rng) == [[home]]  # alone: still home
    no_key = choose("", load, slack=4, rng=rng)
    assert len(no_key) == 1 and len(set(no_key[0])) == 2 and set(no_key[0]) <= set(load)


def test_the_affinity_key_is_the_tenant_then_user_then_the_conversations_start():
    turn1 = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "Hello!"},
                          {"role": "user", "content": "How are you?"}]}
    other = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bye"}]}
    key = affinity_key(json.dumps(turn1).encode(), None, "shared")
    assert key.startswith("conversation:")
    assert affinity_key(json.dumps(turn2).encode(), None, "shared") == key  # a later turn: the same key
    assert affinity_key(json.dumps(other).encode(), None, "shared") != key
    passage = "A long passage that questions are asked about. " * 12
    questions = [{"messages": [{"role": "user", "content": f"{passage}\n\nQuestion: {q}"}]} for q in ("Who?", "Why?")]
    keys = {affinity_key(json.dumps(q).encode(), None, "shared") for q in questions}
    assert len(keys) == 1  # one passage's questions: one replica, whose prefix trie holds the passage
    with_user = json.dumps({**turn1, "user": "u7"}).encode()
    assert affinity_key(with_user, None, "shared") == "user:u7"
    assert affinity_key(with_user, "acme", "tenant") == "tenant:acme"  # the tenant's state is its own
    assert affinity_key(with_user, "acme", "shared") == "user:u7"
    prompt = {"prompt": "Once upon a time"}
    longer = {"prompt": "Once upon a time, there was a fox. " * 20}
    assert affinity_key(json.dumps(prompt).encode(), None, "off").startswith("conversation:")
    assert affinity_key(b"{not json", None, "shared") == "" and affinity_key(b"[1]", None, "shared") == ""
    assert affinity_key(json.dumps(longer).encode(), None, "off") != affinity_key(json.dumps(prompt).encode(), None,
                                                                                  "off")


def test_application_arguments_are_the_serve_flags():
    settings, model, config = parse_pairs({"replicas": "2", "max_replicas": "4", "threads": "1", "method": "pld",
                                           "max_running": "8", "learning": "off", "public_metrics": "false",
                                           "pld_max_ngram": "3"})
    assert settings == RaySettings(replicas=2, max_replicas=4, affinity_slack=None, gateways=1)
    assert parse_pairs({"gateways": "3", "affinity_slack": "2"})[0] == RaySettings(1, None, 2, 3)
    assert model.threads == 1 and model.source.model is None
    assert config.method == "pld" and config.limits.max_running == 8 and config.tenancy().learning == "off"
    assert config.method_options == {"max_ngram": 3}
    for bad, needle in [({"port": "80"}, "Ray Serve owns"), ({"replicas": "0"}, "replicas"),
                        ({"replicas": "3", "max_replicas": "2"}, "below"),
                        ({"max_running": "x"}, "max_running= must be an int"),
                        ({"no_such_flag": "1"}, "unknown application argument no_such_flag"),
                        ({"public_metrics": "maybe"}, "true or false"), ({"learning": "all"}, "must be one of"),
                        ({"max_kv_mib": "-1"}, "--max-kv-mib must be >= 0"), ({"api_key": "sk-secret"}, None),
                        ({"method": "nope"}, "nope"), ({"gateways": "0"}, "gateways")]:
        if needle is None:  # a valid pair, whose value is a secret: read, never echoed
            assert parse_pairs(bad)[2].api_keys is not None
            continue
        with pytest.raises(TriedecError, match=needle):
            parse_pairs(bad)


def test_a_model_that_cannot_load_is_refused_before_any_replica_starts(tmp_path):
    """A replica that cannot load its model would make Ray retry it until it gives up: ``app``
    (``serve run``) and ``run`` (``triedec serve --ray``) check the model first, without Ray."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    for model, needle in [(tmp_path / "missing.gguf", "GGUF file not found"),
                          (tmp_path / "missing", "not a model directory"),
                          (tmp_path / "empty", "cannot read a model config"),
                          (tmp_path / "bert", "not a causal LM")]:
        with pytest.raises(TriedecError, match=needle):
            app({"model": str(model), "threads": "1"})
        settings, spec, config = parse_pairs({"model": str(model), "threads": "1"})
        with pytest.raises(TriedecError, match=needle):
            run(settings, spec, config)
    with pytest.raises(TriedecError, match="not supported"):
        app({"attn": "flash_attention_2"})
    ModelSpec().check()  # the embedded default passes


def test_engine_options_autoscale_on_ongoing_requests_only_with_room_to_grow():
    _, model, config = parse_pairs({"threads": "1", "max_running": "8", "max_queue": "4"})
    fixed = engine_options(RaySettings(replicas=2), model, config)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1}
    assert fixed["max_ongoing_requests"] == 12 and fixed["max_queued_requests"] == 4
    assert fixed["request_router_config"].request_router_kwargs == {"slack": 8}
    scaled = engine_options(RaySettings(replicas=1, max_replicas=3, affinity_slack=2), model, config)
    auto = scaled["autoscaling_config"]
    assert "num_replicas" not in scaled and (auto.min_replicas, auto.max_replicas) == (1, 3)
    assert auto.target_ongoing_requests == 8
    assert scaled["request_router_config"].request_router_kwargs == {"slack": 2}


class _Offline(Engine):
    """An engine replica without Ray or a model (nothing to shut down: Ray awaits the real
    ``__del__``, the garbage collector would not)."""

    def __del__(self) -> None:
        pass


def _engine(app) -> Engine:
    """An engine replica's request path around ``app``."""
    engine = object.__new__(_Offline)
    engine.app, engine.replica = app, "r1"
    return engine


HTTP_SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def test_the_engine_relays_every_message_of_an_app_that_ends_at_once_and_tags_the_replica():
    async def instant(scope, receive, send):
        assert (await receive())["body"] == b"{}"
        await send({"type": "http.response.start", "status": 418, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"tea", "more_body": True})
        await send({"type": "http.response.body", "body": b"pot", "more_body": False})

    async def collect() -> list[dict]:
        return [m async for m in _engine(instant).handle(HTTP_SCOPE, b"{}")]

    got = asyncio.run(collect())
    assert [m.get("body") for m in got] == [None, b"tea", b"pot"]
    assert (REPLICA_HEADER.encode(), b"r1") in got[0]["headers"] and got[0]["status"] == 418


def test_the_engine_raises_the_apps_error_and_a_closed_call_cancels_the_apps_task():
    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    async def drain(engine: Engine) -> list[dict]:
        return [m async for m in engine.handle(HTTP_SCOPE, b"")]

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(drain(_engine(broken)))

    seen: list[str] = []

    async def slow(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            seen.append((await receive())["type"])  # waits: the body was all
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def leave() -> None:
        stream = _engine(slow).handle(HTTP_SCOPE, b"")
        assert (await anext(stream))["type"] == "http.response.start"
        await stream.aclose()  # what Ray does when the client leaves
        await asyncio.sleep(0.01)

    asyncio.run(leave())
    assert seen == ["cancelled"]


# -- a local Ray cluster ---------------------------------------------------------------------------------

CHATS = [[{"role": "user", "content": q}] for q in
         ("Name three colors.", "What is 2 + 2?", "Write a haiku about rain.", "Say hello in French.")]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Two engine replicas (one thread each) of the default model, in its default mode (int4-a8 on
    a CPU with the vector kernels, else float32), behind the gateway, sharing learned state through
    a real Redis; yields the client and the same model loaded here, which the answers are compared
    with. The model is loaded here first, so that its converted copy is cached before the replicas
    load it, and its one-thread calibration is measured here once (on a new machine the two
    replicas would each measure it at startup, side by side, each slowed by the other)."""
    threads = torch.get_num_threads()
    try:  # ModelSpec.load sets torch's threads to its own
        reference = ModelSpec(threads=1).load()
        reference.calibration(frozenset({NEEDS_COST, *profile_specs()}))
    finally:
        torch.set_num_threads(threads)
    store = RedisServer(tmp_path_factory.mktemp("redis"))
    store.start()
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(*parse_pairs({"replicas": "2", "threads": "1", "method": "auto", "redis_url": store.url,
                                      "share_interval": "0.2"})), name=APP_NAME, route_prefix="/")
        yield (openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=180),
               reference)
    finally:
        serve.shutdown()
        ray.shutdown()
        store.stop()


def _ask(client: openai.OpenAI, messages: list[dict], max_tokens: int, **extra: object) -> tuple[str, str]:
    return _asked(client, messages, max_tokens, **extra)[:2]


def _asked(client: openai.OpenAI, messages: list[dict], max_tokens: int, **extra: object) -> tuple[str, str, dict]:
    """The answer's text, the replica that gave it and the triedec stats."""
    raw = client.chat.completions.with_raw_response.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                            max_tokens=max_tokens, **extra)
    out = raw.parse()
    return out.choices[0].message.content, raw.headers[REPLICA_HEADER], out.model_extra["triedec"]


def _sharing(client: openai.OpenAI, user: str, replica: str) -> Callable[[], dict]:
    """``replica``'s sharing status (``GET /health``), asked where ``user``'s requests go (the
    gateway routes on the body's ``user`` whatever the method; an answer from another replica is
    asked again)."""
    def status() -> dict:
        deadline = time.monotonic() + 30
        while True:
            health = httpx.request("GET", f"{client.base_url}".removesuffix("v1/") + "health",
                                   content=json.dumps({"user": user}), timeout=30)
            health.raise_for_status()
            if health.headers[REPLICA_HEADER] == replica:
                return health.json()["sharing"]
            assert time.monotonic() < deadline, f"GET /health never reached replica {replica}"
            time.sleep(0.1)
    return status


@pytest.mark.default_model  # the cluster serves the default model
def test_an_answer_from_one_replica_drafts_on_the_other_through_redis(ray_cluster):
    client, lm = ray_cluster
    question = [{"role": "user", "content": "List the planets of the solar system in order, with one fact each."}]
    first = _ask(client, [{"role": "user", "content": "Hi"}], 1, user="reader-0")[1]
    other, second = next((f"reader-{i}", home) for i in range(1, 64)
                         if (home := _ask(client, [{"role": "user", "content": "Hi"}], 1, user=f"reader-{i}")[1])
                         != first)
    status = _sharing(client, other, second)
    before = quiet(status, 1.0, "outputs")  # what the other replica merged so far: nothing is under way
    text, where, _ = _asked(client, question, 64, user="reader-0")
    assert where == first
    absorbed_after(status, before, 60.0, "outputs")  # the only answer given since: the question's
    again, where, stats = _asked(client, question, 64, user=other)
    assert where == second and again == text == lm.generate(question, "ar", max_new_tokens=64).text
    assert stats["tokens_from_store"] > 0  # drafted from the first replica's answer, merged from Redis


@pytest.mark.default_model  # the cluster serves the default model
def test_ray_answers_equal_lm_generate_and_turns_stay_on_their_replica(ray_cluster):
    client, lm = ray_cluster
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # together: they run batched on two replicas
        first = list(pool.map(lambda m: _ask(client, m, 24), CHATS))
    for messages, (text, _) in zip(CHATS, first, strict=True):
        assert text == lm.generate(messages, "ar", max_new_tokens=24).text
    seconds = [[*m, {"role": "assistant", "content": text}, {"role": "user", "content": "Say more."}]
               for m, (text, _) in zip(CHATS, first, strict=True)]
    for messages, (_, replica) in zip(seconds, first, strict=True):
        text, again = _ask(client, messages, 8)
        assert again == replica  # the second turn found the first's replica
        assert text == lm.generate(messages, "ar", max_new_tokens=8).text
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHATS[0], max_tokens=24,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == first[0][0]
    # conversations spread over both replicas (12 keys on one replica by chance: p = 2 ** -11)
    homes = {_ask(client, [{"role": "user", "content": f"Reply with the number {i}."}], 1)[1] for i in range(12)}
    assert len(homes) == 2
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the server's own errors, unchanged
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHATS[0], max_tokens=10**6)


def _replicas() -> tuple[str, int]:
    engine = serve.status().applications[APP_NAME].deployments["Engine"]
    return engine.status, engine.replica_states.get("RUNNING", 0)


@pytest.mark.default_model  # the cluster serves the default model
def test_a_killed_replica_fails_only_its_requests_and_ray_restarts_it(ray_cluster):
    client, lm = ray_cluster
    conversations = [[{"role": "user", "content": f"Tell me a long story about the number {i}."}] for i in range(12)]
    homes = {i: _ask(client, m, 1)[1] for i, m in enumerate(conversations)}
    victim = homes[0]
    doomed = [conversations[i] for i, r in homes.items() if r == victim][:2]
    spared = [conversations[i] for i, r in homes.items() if r != victim][:2]
    assert doomed and spared

    started = concurrent.futures.ThreadPoolExecutor(len(doomed) + len(spared))
    first_token = [False] * len(doomed)

    def doomed_stream(k: int) -> str:
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=doomed[k], max_tokens=1000,
                                                stream=True)
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first_token[k] = True
        except openai.APIError as exc:
            return f"failed: {exc}"
        return "completed"

    victims = [started.submit(doomed_stream, k) for k in range(len(doomed))]
    survivors = [started.submit(_ask, client, m, 32) for m in spared]
    deadline = time.time() + 120
    while not all(first_token):
        assert time.time() < deadline, "the doomed streams never started"
        time.sleep(0.05)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Engine#{victim}", namespace="serve"), no_restart=True)

    for future in victims:  # each fails cleanly (an error event ends its stream), none hangs
        assert future.result(timeout=60).startswith("failed")
    for messages, future in zip(spared, survivors, strict=True):
        text, replica = future.result(timeout=180)
        assert replica != victim and text == lm.generate(messages, "ar", max_new_tokens=32).text
    started.shutdown()

    deadline = time.time() + 240  # Ray replaces the replica
    while _replicas() != ("HEALTHY", 2):
        assert time.time() < deadline, f"the replica was not restarted: {_replicas()}"
        time.sleep(1)
    text, replica = _ask(client, doomed[0], 8)
    assert replica != victim and text == lm.generate(doomed[0], "ar", max_new_tokens=8).text
