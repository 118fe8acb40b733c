"""Learned state shared by replicas (docs/scaling-out.md): the exchanged value and its merge rules
(:mod:`triedec.drafters.learned`), every drafter's export and absorb, an answer learned on one
model drafting on another, and two real ``triedec serve`` processes sharing one real Redis
(Debian's redis-server, started here on a loopback port): delay, tenant isolation, Redis stopped
and restarted mid-run, malformed entries."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import (
    RedisServer,
    absorbed_after,
    cache_with_built_kernels,
    free_port,
    hf_greedy,
    quiet,
    run,
    tiny_info,
    tiny_llama,
)
from helpers import random_prompts as prompts

import triedec
from triedec.core.errors import TriedecError
from triedec.drafters import method_spec
from triedec.drafters.base import FROM_STORE
from triedec.drafters.learned import Learned
from triedec.drafters.matrix import AdjacencyMatrix
from triedec.drafters.rates import MovingRatio, RateTable
from triedec.drafters.store import LEAD, OutputStore
from triedec.server import ServerConfig
from triedec.server.sharing import SharingConfig

pytestmark = pytest.mark.slow  # end to end: in make test, not in make test-fast

VOCAB = 48


def build(name: str, options: dict | None = None, info=None):
    spec = method_spec(name)
    return spec.factory(spec.make_options(options or {}), info or tiny_info())


# ---- the exchanged value --------------------------------------------------------------------------


def test_learned_round_trips_through_json_and_refuses_malformed_values():
    learned = Learned(outputs=(((1, 2), (3, 4, 5)),), rows=((7, (1, 2)),),
                      rates=(((("store", 2), 1, True), 0.5, 0.9, 3), (4, 0.1, 1.0, 1)))
    assert Learned.from_json(learned.to_json()) == learned
    assert not Learned() and learned
    for bad in ["not json", "{}", json.dumps({"outputs": [[[1], [-1]]], "rows": [], "rates": []}),
                json.dumps({"outputs": [[[1], [True]]], "rows": [], "rates": []}),
                json.dumps({"outputs": [], "rows": [[1, [2.5]]], "rates": []}),
                json.dumps({"outputs": [], "rows": [], "rates": [[1, 0.5, 0.0, 1]]}),
                json.dumps({"outputs": [], "rows": [], "rates": [[1, 0.5, 1.0, -1]]}),
                json.dumps({"outputs": [], "rows": [], "rates": [[{"a": 1}, 0.5, 1.0, 1]]}),
                '{"outputs": [], "rows": [], "rates": [[1, NaN, 1.0, 1]]}']:
        with pytest.raises(TriedecError, match="malformed learned state"):
            Learned.from_json(bad)
    with pytest.raises(TriedecError, match="vocabulary"):
        Learned(outputs=(((1,), (VOCAB,)),)).check_tokens(VOCAB)
    Learned(outputs=(((1,), (VOCAB - 1,)),)).check_tokens(VOCAB)


def test_rates_blend_as_weighted_averages_by_updates_since_the_last_export():
    """A hand computation: this side made 1 update since its export (weight 1), the other 3."""
    rate = MovingRatio(0.8)
    rate.update(1.0, 1.0, 0.5)  # numerator 0.8 + 0.5 * 0.2 = 0.9, denominator 1
    assert rate.updates == 1
    rate.blend(0.2, 2.0, 3)
    assert math.isclose(rate.numerator, (0.9 + 3 * 0.2) / 4) and math.isclose(rate.denominator, (1 + 3 * 2.0) / 4)
    table = RateTable(lambda key: 0.8, 0.5, 0.5, lambda key: isinstance(key, int))
    table.learn(5, 1.0, 1.0)
    table.relax(6)  # relaxing is not an update: not exported
    found = table.export()
    assert [key for key, *_ in found] == [5] and found[0][3] == 1
    assert table.export() == ()
    other = RateTable(lambda key: 0.8, 0.5, 0.5, lambda key: isinstance(key, int))
    other.absorb([*found, ("x", 0.1, 1.0, 5), (9, 0.1, 1.0, 0)])
    assert [key for key, _ in other.items()] == [5]  # an invalid key and a rate without updates change nothing
    assert math.isclose(other.value(5), ((0.8 + found[0][1]) / 2) / ((1 + found[0][2]) / 2))
    assert other.value(7) == 0.8  # a key never updated reads its prior


def test_matrix_rows_last_writer_wins_except_rows_written_here_since_the_export():
    a, b = AdjacencyMatrix(VOCAB, 2, torch.device("cpu")), AdjacencyMatrix(VOCAB, 2, torch.device("cpu"))
    logits = torch.zeros(3, VOCAB)
    logits[0, 10], logits[0, 11], logits[1, 12], logits[1, 13], logits[2, 14], logits[2, 15] = 9, 8, 9, 8, 9, 8
    a.update([1, 2, 3], logits)
    rows = a.take_written()
    assert rows == ((1, (10, 11)), (2, (12, 13)), (3, (14, 15))) and a.take_written() == ()
    b.update([2], logits[2:])  # b wrote row 2 itself after its last export: it keeps it
    b.put_rows(rows)
    assert b.table[1].tolist() == [10, 11] and b.table[3].tolist() == [14, 15] and b.table[2].tolist() == [14, 15]
    assert bool(b.filled[1]) and not bool(b.filled[4])
    assert [t for t, _ in b.take_written()] == [2]  # taken rows are not sent on again
    with pytest.raises(TriedecError, match="width"):
        b.put_rows([(1, (1, 2, 3))])
    with pytest.raises(TriedecError, match="vocabulary"):
        b.put_rows([(1, (1, VOCAB))])


def test_the_store_keeps_an_output_it_holds_already_once():
    store = OutputStore(1000)
    output = list(range(10, 30))
    store.add(output, [1, 2, 3])
    tokens = store.tokens
    store.add(list(range(40, 50)), [1])
    assert store.add(output, [1, 2, 3]) is not None
    assert store.tokens == tokens + 11 and len(store.docs) == 2
    assert list(store.docs.values())[-1][0][3:] == tuple(output)  # the repeat is the newest now
    assert store.continuations([1, 2, 3, 10, 11, 12], depth=3) == [((13, 14, 15), 6)]


# ---- every drafter ------------------------------------------------------------------------------


def test_an_answer_learned_by_one_auto_drafter_drafts_on_another_and_stays_exact():
    """Replica A answers a prompt; B absorbs A's export and answers the same prompt from its store
    (accepted store tokens), with exactly transformers' greedy tokens; what B absorbed is not
    exported again, and B's own answers are."""
    model = tiny_llama()
    a, b = build("auto", {"sized": False}), build("auto", {"sized": False})
    prompt = prompts(seed=3, count=1)[0]
    reference = hf_greedy(model, prompt, 40)
    tokens, _ = run(model, a, prompt, 40)
    assert tokens == reference
    learned = a.export_learned()
    assert [out for _, out in learned.outputs] == [tuple(reference)]
    assert learned.outputs[0][0] == tuple(prompt[-LEAD:])
    assert learned.rows and learned.rates and not a.export_learned()
    b.absorb_learned(Learned.from_json(learned.to_json()))
    assert b.store.tokens == a.store.tokens and b.matrix.filled.any()
    assert not b.export_learned().outputs
    tokens, stats = run(model, b, prompt, 40)
    assert tokens == reference and stats.drafter[FROM_STORE] > 0
    assert [out for _, out in b.export_learned().outputs] == [tuple(reference)]
    with pytest.raises(TriedecError, match="vocabulary"):
        b.absorb_learned(Learned(outputs=(((1,), (VOCAB + 5, 1, 2, 3, 4)),)))


@pytest.mark.parametrize("name,options", [("pld", {}), ("ngram-trie", {}), ("recycling", {"nodes": 80})])
def test_every_drafter_with_learned_state_exports_it_and_absorbs_anothers(name, options):
    model = tiny_llama()
    a, b = build(name, options), build(name, options)
    for prompt in prompts(seed=11, count=4):
        run(model, a, prompt, 24)
    learned = a.export_learned()
    assert learned, f"{name} learned nothing to share"
    assert not a.export_learned()  # only what is new since the last export
    before = b.stats()
    b.absorb_learned(Learned.from_json(learned.to_json()))
    assert b.stats() != before
    for prompt in prompts(seed=12, count=2):  # still exact after absorbing
        assert run(model, b, prompt, 24)[0] == hf_greedy(model, prompt, 24)


def test_methods_that_learn_nothing_across_requests_export_nothing():
    for name, options in [("ar", {}), ("lookahead", {})]:
        drafter = build(name, options)
        run(tiny_llama(), drafter, prompts(seed=1, count=1)[0], 16)
        assert not drafter.export_learned()
        drafter.absorb_learned(Learned(rates=((1, 0.5, 1.0, 2),)))  # nothing to merge into, no error


def test_lm_exchanges_learned_state_per_scope_and_method(tiny_model_dir):
    """Two loaded copies of one model: what the first learned reaches only the same scope, method
    and options of the second, and the second's answer is the first's, drafted from its store."""
    lm1, lm2 = triedec.load(tiny_model_dir), triedec.load(tiny_model_dir)
    prompt = "Tell me a story about the sea and the ships."
    first = lm1.generate(prompt, method="auto", max_new_tokens=40, sized=False)
    mine = lm2.decoder("auto", sized=False)
    others = [lm2.decoder("auto", scope=("tenant", "b"), sized=False), lm2.decoder("auto")]  # other scope, options
    exported = [e for e in lm1.export_learned() if e[3]]
    assert [(scope, name) for scope, name, _, _ in exported] == [(None, "auto")]
    scope, name, options_id, learned = exported[0]
    assert lm2.absorb_learned(scope, name, options_id, learned) == 1
    assert lm2.absorb_learned(("tenant", "c"), name, options_id, learned) == 0
    assert mine.drafter.store.tokens > 0 and all(o.drafter.store.tokens == 0 for o in others)
    again = lm2.generate(prompt, method="auto", max_new_tokens=40, sized=False)
    assert again.token_ids == first.token_ids == lm2.generate(prompt, method="ar", max_new_tokens=40).token_ids
    assert again.stats.drafter[FROM_STORE] > 0 and first.stats.drafter.get(FROM_STORE, 0) == 0


def test_sharing_settings_are_validated_and_the_url_is_never_shown():
    with pytest.raises(TriedecError, match="redis://"):
        ServerConfig(redis_url="http://localhost:6379")
    with pytest.raises(TriedecError, match="interval"):
        ServerConfig(redis_url="redis://localhost:6379/0", share_interval=0)
    config = ServerConfig(redis_url="redis://:secret-password@localhost:6379/0")
    assert "secret-password" not in repr(config) and "secret-password" not in repr(config.sharing())
    assert isinstance(config.sharing(), SharingConfig) and ServerConfig().sharing() is None


# ---- two processes, one Redis -------------------------------------------------------------------

KEYS_FILE = "key-alice-0123456789 alice\nkey-bob-0123456789 bob\nkey-carol-0123456789 carol\n"
ALICE, BOB, CAROL = (f"Bearer key-{name}-0123456789" for name in ("alice", "bob", "carol"))
INTERVAL = 0.2
STATED_DELAY = INTERVAL + 2.0
"""docs/scaling-out.md's bound (one interval plus a decoding step), with room for this loaded 2-core machine"""
AUTO = {"method": "auto", "method_options": {"sized": False}}


class Replica:
    """One ``triedec serve`` process of the tiny model, sharing learned state through ``redis_url``."""

    def __init__(self, model_dir: Path, redis_url: str, keys_file: Path, cache: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cache = cache_with_built_kernels(cache)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "triedec.cli.main", "serve", "--model", str(model_dir), "--port", str(self.port),
             "--model-name", "tiny", "--method", "ar", "--api-keys-file", str(keys_file), "--learning", "tenant",
             "--redis-url", redis_url, "--share-interval", str(INTERVAL), "--drain-seconds", "5"],
            # a cache of its own, and the suite's thread count and quick calibration (tests/conftest.py)
            env={**{k: v for k, v in os.environ.items() if not k.startswith("TRIEDEC_")}, "TRIEDEC_CACHE": str(cache),
                 **{k: os.environ[k] for k in ("TRIEDEC_THREADS", "TRIEDEC_CALIBRATION") if k in os.environ}},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.time() + 180
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return
            assert time.time() < deadline, "the replica did not start"
            time.sleep(0.2)

    def ask(self, key: str, question: str, max_tokens: int = 48) -> tuple[str, dict]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                **AUTO}
        got = httpx.post(f"{self.url}/v1/chat/completions", json=body, headers={"Authorization": key}, timeout=120)
        assert got.status_code == 200, got.text
        return got.json()["choices"][0]["message"]["content"], got.json()["triedec"]

    def hold(self, key: str) -> None:
        """Build the tenant's auto here with a one-token completion (nothing a chat could draft from)."""
        body = {"model": "tiny", "prompt": "Say hello.", "max_tokens": 1, **AUTO}
        got = httpx.post(f"{self.url}/v1/completions", json=body, headers={"Authorization": key}, timeout=120)
        assert got.status_code == 200, got.text

    def sharing(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()["sharing"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    """A real Redis and two replicas; both hold alice's, bob's and carol's scopes."""
    base = tmp_path_factory.mktemp("cluster")
    keys = base / "keys"
    keys.write_text(KEYS_FILE)
    keys.chmod(0o600)
    redis_server = RedisServer(base)
    redis_server.start()
    replicas = [Replica(tiny_model_dir, redis_server.url, keys, base / f"cache{i}") for i in (1, 2)]
    try:
        for replica in replicas:
            replica.wait_ready()
            for key in (ALICE, BOB, CAROL):
                replica.hold(key)
        yield redis_server, replicas
    finally:
        for replica in replicas:
            replica.stop()
        redis_server.stop()


def test_an_answer_on_one_process_drafts_on_the_other_for_its_tenant_only(cluster):
    _, (one, two) = cluster
    question = "Tell me a story about the sea and the ships."
    before = quiet(two.sharing, 3 * INTERVAL + 0.5, "outputs")
    text, stats = one.ask(ALICE, question)
    assert stats["tokens_from_store"] == 0
    delay = absorbed_after(two.sharing, before, STATED_DELAY, "outputs")
    print(f"process 2 absorbed process 1's answer {delay:.2f} s after it was returned")
    again, again_stats = two.ask(ALICE, question)
    assert again == text and again_stats["tokens_from_store"] > 0 and again_stats["learning"] == "tenant"
    other, other_stats = two.ask(BOB, question)  # bob's scope on process 2 learned nothing of alice's
    assert other == text and other_stats["tokens_from_store"] == 0
    assert one.sharing()["redis"] == two.sharing()["redis"] == "up"
    metrics = httpx.get(f"{one.url}/metrics", headers={"Authorization": ALICE}, timeout=10).text
    assert "triedec_sharing_redis_up 1.0" in metrics
    mark = 'triedec_sharing_entries_total{event="published"}'
    published = [line for line in metrics.splitlines() if line.startswith(mark)]
    assert published and float(published[0].split()[-1]) >= 1


def test_redis_stopped_and_restarted_mid_run_fails_no_request_and_the_streams_catch_up(cluster):
    redis_server, (one, two) = cluster
    question = "Write a poem about the mountains and the rivers."  # carol's first question anywhere
    redis_server.stop()
    deadline = time.monotonic() + 30
    while one.sharing()["redis"] != "down":
        assert time.monotonic() < deadline, one.sharing()
        time.sleep(0.1)
    text, _ = one.ask(CAROL, question)  # served while Redis is down
    answers = [two.ask(BOB, f"Question number {i}?", max_tokens=12)[0] for i in range(3)]
    assert all(isinstance(a, str) for a in answers)
    deadline = time.monotonic() + 10
    while one.sharing()["pending"] == 0:  # what carol's answer taught waits in the backlog
        assert time.monotonic() < deadline, one.sharing()
        time.sleep(0.1)
    before = two.sharing()["outputs"]
    redis_server.start()  # an empty Redis: the streams start again
    absorbed_after(two.sharing, before, 15.0, "outputs")
    assert one.sharing()["redis"] == "up" and one.sharing()["pending"] == 0
    again, again_stats = two.ask(CAROL, question)
    assert again == text and again_stats["tokens_from_store"] > 0


def test_a_method_built_later_in_a_followed_scope_catches_up_on_the_streams_past(cluster):
    """Process 2 holds carol's scope through auto; recycling for carol is built there only after
    process 1 published recycling's matrix rows: it reads them from the stream's past."""
    _, (one, two) = cluster
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count from one to ten."}],
            "max_tokens": 24, "method": "recycling", "method_options": {"nodes": 80}}
    got = httpx.post(f"{one.url}/v1/chat/completions", json=body, headers={"Authorization": CAROL}, timeout=120)
    assert got.status_code == 200, got.text
    time.sleep(4 * INTERVAL)  # published; process 2 follows carol's stream but has no recycling to merge into
    before = two.sharing()["absorbed"]
    body["max_tokens"] = 1
    got = httpx.post(f"{two.url}/v1/chat/completions", json=body, headers={"Authorization": CAROL}, timeout=120)
    assert got.status_code == 200, got.text
    absorbed_after(two.sharing, before, STATED_DELAY + 2)


def test_a_malformed_entry_is_skipped_and_counted(cluster):
    import redis

    redis_server, (_, two) = cluster
    client = redis.Redis(port=redis_server.port)
    streams = [k.decode() for k in client.keys("triedec:*:tenant-*")]
    assert streams, "no tenant stream"
    before = two.sharing()["malformed"]
    for stream in streams:
        client.xadd(stream, {"replica": "x", "method": "auto", "options": "y", "learned": "{not json"})
        client.xadd(stream, {"replica": "x"})
    deadline = time.monotonic() + 10
    while two.sharing()["malformed"] < before + 2:
        assert time.monotonic() < deadline, two.sharing()
        time.sleep(0.1)
    text, _ = two.ask(ALICE, "Say hello.", max_tokens=8)  # still serving
    assert isinstance(text, str)
