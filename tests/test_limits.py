"""One client cannot exhaust or stall the server (docs/serving.md: Security, "Caps"): every option that
sizes memory or work has a maximum (400 past it), built methods live in an LRU bounded in count
and learned-state bytes per tenant and overall, beam search reserves the KV it really allocates
and yields the engine every step (its prompt in chunks), a request's time limit holds within one
step, calibration is done before serving, extreme sampling values never give garbage, operator
faults are 500s without paths, and the front door's smaller findings of the red-team (query-string
keys, duplicate Authorization headers, lone surrogates, HEAD /health, slash redirects, state files
in directories others may write). Real uvicorn servers on loopback, driven by httpx and the
``openai`` client."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import TINY_VOCAB, drain

import triedec
from triedec.api.decoders import BuiltMethods, DecoderLimits
from triedec.bench.load import serving
from triedec.core.errors import StateFileError, TriedecError
from triedec.core.sampling import Sampling, process
from triedec.drafters.state import check_location
from triedec.engine.batch import StopRule, run_alone
from triedec.engine.beam import kv_slots
from triedec.engine.methods import method as find_method
from triedec.engine.methods import methods
from triedec.server import ApiKeys, ServerConfig, create_app
from triedec.server.auth import mask_query
from triedec.server.tenancy import tenant_file

MODEL = "tiny"
KEYS = {"key-alice-0123456789": "alice", "key-bob-0123456789": "bob"}
ALICE_KEY, BOB_KEY = KEYS
ALICE, BOB = f"Bearer {ALICE_KEY}", f"Bearer {BOB_KEY}"
QUESTION = [{"role": "user", "content": "Tell me a story about the sea and the ships."}]


def _config(**kw) -> ServerConfig:
    return ServerConfig(**{"model_name": MODEL, "method": "ar", "default_max_tokens": 16, **kw})


def _chat(url: str, auth: str | None = None, **body) -> httpx.Response:
    payload = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120,
                      headers={"Authorization": auth} if auth else {})


def _rss() -> int:
    """This process's resident memory, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


# ---- option maxima ---------------------------------------------------------------------------------

def test_every_option_that_sizes_memory_or_work_has_a_maximum():
    """The options that size a drafter's memory (k, store_capacity) or a step's work (tree sizes,
    n-gram orders, beams) declare a maximum, and a value past it is refused by name."""
    must = {"auto": {"max_nodes", "depth", "n", "store_capacity", "k"}, "recycling": {"k", "seed_prefill"},
            "ngram-trie": {"n", "num_draft"}, "pld": {"max_ngram", "num_tokens", "num_matches"},
            "lookahead": {"window", "ngram", "guesses", "budget", "depth"}, "beam": {"num_beams", "gc_every"}}
    for name, options in must.items():
        spec = find_method(name).spec
        assert options <= set(spec.maxima()), (name, spec.maxima())
        for option in options:
            limit = spec.maxima()[option]
            refused = f"{option} may be at most {limit}"
            if name == "lookahead":  # its whole tree's bound may speak first
                refused += "|nodes per step"
            with pytest.raises(TriedecError, match=refused):
                spec.make_options({option: limit + 1})
    # bounds that are not a single option's: lookahead's whole tree, recycling's template
    with pytest.raises(TriedecError, match="nodes per step"):
        find_method("lookahead").make_options({"window": 64, "ngram": 32})
    with pytest.raises(TriedecError, match="nodes must be an integer in"):
        find_method("recycling").make_options({"nodes": 81})
    assert all(isinstance(v, int) for m in methods().values() for v in m.spec.maxima().values())


def test_a_request_past_an_option_maximum_gets_400_naming_it(lm):
    with serving(create_app(lm, _config())) as url:
        for method, options, option in [("auto", {"k": 1003}, "k"), ("recycling", {"k": 1003}, "k"),
                                        ("beam", {"num_beams": 1000}, "num_beams"),
                                        ("auto", {"store_capacity": 10**9}, "store_capacity"),
                                        ("ngram-trie", {"num_draft": 100_000}, "num_draft")]:
            got = _chat(url, method=method, method_options=options)
            assert got.status_code == 400, got.text
            assert f"{option} may be at most" in got.json()["error"]["message"]
        assert _chat(url, method="beam", method_options={"num_beams": 64}).status_code == 200


# ---- built methods: an LRU bounded per scope and overall ------------------------------------------

def test_built_methods_are_an_lru_bounded_in_count_and_bytes_per_scope_and_overall():
    cache = BuiltMethods(DecoderLimits(per_scope=2, total=3, scope_bytes=100, total_bytes=150))
    cache.put(("a", "m", 1), "a1", 10)
    cache.put(("a", "m", 2), "a2", 10)
    assert cache.get(("a", "m", 1)) == "a1"  # now the most recent of scope a
    cache.put(("a", "m", 3), "a3", 10)  # scope a over its count: a2, the least recent, goes
    assert set(cache) == {("a", "m", 1), ("a", "m", 3)}
    cache.put(("b", "m", 1), "b1", 10)
    cache.put(("c", "m", 1), "c1", 10)  # four in all, over the total: a1 goes
    assert set(cache) == {("a", "m", 3), ("b", "m", 1), ("c", "m", 1)}
    cache.put(("b", "m", 2), "b2", 95)  # scope b over its bytes (105 > 100): b1 goes
    assert ("b", "m", 1) not in cache and ("b", "m", 2) in cache
    assert cache.learned_bytes <= 150 and len(cache) <= 3
    cache.put(("d", "m", 1), "d1", 60)  # total bytes over 150: the least recent go until it fits
    assert cache.learned_bytes <= 150 and ("d", "m", 1) in cache
    with pytest.raises(TriedecError, match="more than the 0 MiB this process keeps per scope"):
        cache.put(("e", "m", 1), "e1", 101)  # alone over a cap: refused, nothing dropped for it
    assert ("d", "m", 1) in cache
    assert cache.forget("d") == 1 and ("d", "m", 1) not in cache


def test_threads_asking_for_the_same_method_at_once_build_it_once():
    cache, built, gate = BuiltMethods(), [], threading.Barrier(8)

    class Built:
        def max_learned_bytes(self) -> int:
            return 1

    def build() -> Built:
        built.append(None)
        time.sleep(0.05)  # a slow build: the other threads arrive while it runs
        return Built()

    def ask() -> Built:
        gate.wait()
        return cache.get_or_build(("a", "m", 1), build)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: ask(), range(8)))
    assert len(built) == 1 and all(g is got[0] for g in got)


def test_the_lm_keeps_built_methods_within_its_limits(lm):
    fresh = lm.fresh()
    fresh.limit_decoders(DecoderLimits(per_scope=2, total=3))
    for k in (1, 2, 3):
        fresh.decoder("recycling", scope="t", nodes=80, k=k)
    assert [key[2].k for key in fresh.methods] == [2, 3]
    for scope in ("u", "v"):
        fresh.decoder("recycling", scope=scope, nodes=80, k=1)
    assert len(fresh.methods) == 3
    # a method whose bound alone is over a byte cap: refused with the cap named
    fresh.limit_decoders(DecoderLimits(scope_bytes=1 << 20))
    bound = fresh.decoder("auto", scope="w", store_capacity=1000).max_learned_bytes()
    assert 0 < bound <= 1 << 20
    with pytest.raises(TriedecError, match=r"may hold .* MiB of learned state, more than the 1 MiB"):
        fresh.decoder("auto", scope="w", store_capacity=1_000_000)


def test_a_dropped_method_and_its_requests_are_freed_at_once_without_the_cycle_collector(lm):
    """The LRU's memory bound holds only if a dropped method's learned state (auto's 24 MiB matrix
    on the default model) is freed the moment the last reference goes: no method, drafter or
    finished request may sit in a reference cycle waiting for ``gc``. With the collector off, every
    method built, used and forgotten is gone, and nothing it made is left as cyclic garbage."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        for name in methods():
            options = {"num_beams": 2} if name == "beam" else {}
            decoder = lm.decoder(name, scope=("drop", name), **options)
            held = [weakref.ref(decoder)]
            if getattr(decoder, "drafter", None) is not None:
                held.append(weakref.ref(decoder.drafter))
            lm.generate("the sea and the ships and the sea", name, max_new_tokens=6, **options)  # default scope
            run = lm.start(triedec.GenerationRequest([5, 6, 7, 5, 6], name, options, 6), scope=("drop", name))
            held.append(weakref.ref(run))
            drain(lm.stream(triedec.GenerationRequest([5, 6, 7, 5, 6], name, options, 6)))
            del decoder, run
            assert lm.forget(("drop", name)) == 1
            assert [ref() for ref in held] == [None] * len(held), f"{name}: kept alive after it was dropped"
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        assert gc.garbage == [], f"reference cycles left: {sorted({type(o).__name__ for o in gc.garbage})}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_twenty_option_sets_from_one_key_keep_memory_bounded(default_lm):
    """The red-team's first finding: each new option set built a method kept for good (auto with
    k=1003 and up: 385 MB each). With the maxima and the LRU, 20 distinct option sets from one
    key all succeed (or get a 4xx naming a cap), and RSS stays under 4 methods' worth plus slack."""
    lm = default_lm.fresh()
    per = 4
    config = ServerConfig(model_name="m", method="ar", api_keys=ApiKeys(KEYS), learning="tenant",
                          decoders=DecoderLimits(per_scope=per))
    matrix = lm.adapter.vocab_size * 64 * 8  # auto's recycling matrix at the largest k
    with serving(create_app(lm, config)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=ALICE_KEY, max_retries=0, timeout=120)
        ask = {"model": "m", "messages": QUESTION, "max_tokens": 2}
        client.chat.completions.create(**ask, extra_body={"method": "auto", "method_options": {"k": 64, "depth": 1}})
        before = _rss()
        for depth in range(2, 22):
            out = client.chat.completions.create(**ask, extra_body={"method": "auto",
                                                                     "method_options": {"k": 64, "depth": depth}})
            assert out.choices[0].message.content is not None
        grown = _rss() - before
        with pytest.raises(openai.BadRequestError, match="k may be at most 64"):
            client.chat.completions.create(**ask, extra_body={"method": "auto", "method_options": {"k": 1003}})
        assert sum(1 for key in lm.methods if key[0] == ("tenant", "alice")) == per
    # without the bound, 20 methods would hold 20 matrices (500 MB); the LRU keeps `per` of them
    assert grown < (per + 2) * matrix, f"RSS grew by {grown / 2**20:.0f} MiB"


# ---- beam search: a bounded step, the KV it really uses, and the time limit ---------------------

def test_beam_search_never_allocates_more_kv_than_it_reserves(lm):
    """The trie's buffers start small and double, but never past what admission reserves
    (prompt + b x max_new_tokens), even when max_new_tokens is short and b large (the red-team's
    beam with a 4-token limit reserved far less than it allocated)."""
    adapter = lm.adapter
    made = []
    original = adapter.new_cache

    def record(capacity):
        cache = original(capacity)
        made.append(cache)
        return cache

    adapter.new_cache = record
    try:
        for beams, new in [(64, 2), (64, 4), (16, 40), (3, 60)]:
            decoder = lm.decoder("beam", num_beams=beams, gc_every=0 if new == 40 else 5)
            prompt = list(range(5, 25))
            run = decoder.start(prompt, StopRule(max_new_tokens=new))
            assert run.kv_tokens == kv_slots(len(prompt), beams, new)
            made.clear()
            drain(run_alone(adapter, run))
            peak = max(cache.capacity for cache in made)
            assert peak <= run.kv_tokens, (beams, new, peak, run.kv_tokens)
    finally:
        adapter.new_cache = original


def _step_a_solo_run(lm, run) -> tuple[list[int], list[int]]:
    """Drive ``run`` (a SoloRun) step by step as the engine does; returns the tokens each forward
    carried and how many forwards each step ran."""
    sizes, per_step = [], []
    original = lm.adapter.forward_batch

    def spy(items):
        sizes.append(sum(item.size for item in items))
        return original(items)

    lm.adapter.forward_batch = spy
    try:
        run.start(lm.adapter)
        while not run.done:
            before = len(sizes)
            run.advance()
            per_step.append(len(sizes) - before)
    finally:
        lm.adapter.forward_batch = original
    return sizes, per_step


def test_beam_prefills_a_long_prompt_one_chunk_per_step(lm):
    """Beam search yields the engine between prompt chunks, as a request's prefill does, so a long
    prompt never holds the engine thread for its whole prefill."""
    prompt = [int(t) for t in torch.randint(3, TINY_VOCAB, (300,), generator=torch.Generator().manual_seed(0))]
    run = lm.decoder("beam", num_beams=2).start(prompt, StopRule(max_new_tokens=3))
    sizes, per_step = _step_a_solo_run(lm, run)
    assert sizes[:3] == [128, 128, 44]  # three chunks at fixed offsets, one per step
    assert per_step[:3] == [1, 1, 1]


def test_beam_search_does_one_forward_per_engine_step(lm):
    """A beam search yields after every forward, even when no token became certain: one engine
    step is one beam step. (It used to yield only when the beams' common prefix grew, so a wide
    search could run hundreds of forwards, a minute and more, inside one engine step.)"""
    prompt = [5, 9, 17, 33, 2, 8]
    for beams in (4, 64):
        decoder = lm.decoder("beam", num_beams=beams, early_stopping="never")
        run = decoder.start(prompt, StopRule(max_new_tokens=40))
        sizes, per_step = _step_a_solo_run(lm, run)
        assert max(per_step) == 1 and sum(per_step) == len(sizes), (beams, per_step)
        assert run.outcome.stats.steps == len(sizes) - 1  # every forward after the prefill is a beam step


def test_a_beam_at_its_maximum_leaves_others_served_and_ends_within_a_step_of_its_limit(default_lm):
    """The red-team's second finding: num_beams=1000 held the engine for a minute. Past the
    maximum: 400. At it, beside another tenant's 4-token requests: those finish within a few steps,
    and the time limit ends the beam request within one step of it."""
    limit = 4.0
    config = ServerConfig(model_name="m", method="ar", api_keys=ApiKeys(KEYS), learning="tenant",
                          max_request_seconds=limit)
    with serving(create_app(default_lm, config)) as url:
        ask = {"model": "m", "messages": QUESTION}
        over = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": ALICE}, timeout=60,
                          json={**ask, "max_tokens": 4, "method": "beam", "method_options": {"num_beams": 65}})
        assert over.status_code == 400 and "num_beams may be at most 64" in over.text
        # one step of a 64-beam search here, and one short request alone: the units of the bounds
        alone = time.perf_counter()
        got = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": BOB}, timeout=60,
                         json={**ask, "max_tokens": 4})
        assert got.status_code == 200
        short = time.perf_counter() - alone
        beam: dict = {}

        def run_beam() -> None:
            started = time.perf_counter()
            r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": ALICE}, timeout=120,
                           json={**ask, "max_tokens": 400, "method": "beam", "method_options": {"num_beams": 64}})
            beam.update(status=r.status_code, body=r.json(), seconds=time.perf_counter() - started)

        thread = threading.Thread(target=run_beam)
        thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the beam search is past its prefill, stepping
        step = None
        times = []
        for _ in range(3):
            started = time.perf_counter()
            got = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": BOB}, timeout=60,
                             json={**ask, "max_tokens": 4})
            assert got.status_code == 200
            times.append(time.perf_counter() - started)
        thread.join(60)
        # its time is up: it ends with the tokens already certain, or 408 when none is (64 beams
        # rarely agree on a first token within seconds)
        if beam["status"] == 200:
            assert beam["body"]["triedec"]["stop_reason"] == "time_limit"
            assert beam["body"]["choices"][0]["finish_reason"] == "length"
        else:
            assert beam["status"] == 408 and beam["body"]["error"]["code"] == "timeout", beam
        # one engine step with a 64-beam search in it (~0.3 s here): a beam step, never a whole search
        stats = default_lm.generate(QUESTION, "beam", num_beams=64, max_new_tokens=6).stats
        step = stats.seconds / stats.steps
        assert stats.steps >= 4 and step < 1.5, stats
        # each 4-token request: its own ~6 steps, each beside one beam step, at most
        assert max(times) < short + 8 * step + 1.0, (times, short, step)
        # the beam request ends within one step (plus the HTTP round trip) of its limit
        assert beam["seconds"] < limit + step + 1.0, (beam["seconds"], step)


# ---- nothing slow on a request's path ------------------------------------------------------------------

def test_a_first_recycling_request_on_a_fresh_cache_does_not_stall_a_running_request(tiny_model_dir, tmp_path,
                                                                                     caplog):
    """The red-team's third finding: the first recycling request measured its profile (a minute or
    two on the default model) on the engine thread, stalling everyone. Now the server measures every
    profile before it serves, logged with its time, and a running request's tokens keep coming."""
    caplog.set_level(logging.INFO, logger="triedec")
    lm = triedec.load(tiny_model_dir, cache_dir=tmp_path / "cache")  # nothing calibrated yet
    assert lm.loaded_calibration() is None
    app = create_app(lm, _config(max_tokens_limit=2000))
    assert "recycling" in lm.loaded_calibration().profiles
    assert re.search(r"calibration ready in \d+\.\d s", caplog.text)
    with serving(app) as url:
        gaps, last, sent = [], None, False
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300,
                                "stream": True, "stop": []}) as r:
            other = None
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if len(gaps) == 20 and not sent:
                    sent = True
                    other = threading.Thread(target=lambda: _chat(url, method="recycling", max_tokens=8))
                    other.start()
            other.join(60)
    assert sent and len(gaps) > 40
    typical = sorted(gaps)[len(gaps) // 2]
    assert max(gaps) < max(20 * typical, 0.5), (max(gaps), typical)  # no measurement ran in between


# ---- sampling extremes -------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-300])
def test_a_temperature_so_small_that_logits_overflow_is_greedy(lm, temperature):
    """The red-team's fourth finding: T = 1e-38 and below returned garbage ('ectableectable...')."""
    prompt = "Once upon a time"
    greedy = lm.generate(prompt, "ar", max_new_tokens=12).token_ids
    for method in ("ar", "pld", "auto"):
        got = lm.generate(prompt, method, max_new_tokens=12, temperature=temperature, seed=3)
        assert got.token_ids == greedy, (method, temperature)
    row = torch.tensor([1.0, 30.0, -5.0, 30.0, 2.0])
    processed = process(row, torch.tensor([], dtype=torch.long), Sampling(temperature=temperature, seed=0))
    assert torch.equal(processed, torch.tensor([-torch.inf, 0.0, -torch.inf, -torch.inf, -torch.inf]))


def test_other_sampling_extremes_are_greedy_or_refused(lm):
    prompt = "Once upon a time"
    greedy = lm.generate(prompt, "ar", max_new_tokens=12).token_ids
    for extreme in ({"top_p": 1e-300}, {"min_p": 0.9999999}, {"min_p": 1.0}, {"top_k": 1}):
        for method in ("ar", "auto"):
            got = lm.generate(prompt, method, max_new_tokens=12, temperature=1.0, seed=5, **extreme)
            assert got.token_ids == greedy, (method, extreme)
    for penalty in (1e-300, 1e300, 1e-7, 1e7):
        with pytest.raises(TriedecError, match="repetition_penalty must lie in"):
            lm.generate(prompt, "ar", max_new_tokens=4, temperature=0.7, seed=1, repetition_penalty=penalty)
    for penalty in (1e-6, 1e6):  # the ends of the range: finite logits, same tokens from every method
        runs = [lm.generate(prompt, m, max_new_tokens=12, temperature=0.7, seed=2, repetition_penalty=penalty)
                for m in ("ar", "auto")]
        assert runs[0].token_ids == runs[1].token_ids
    with serving(create_app(lm, _config())) as url:
        got = _chat(url, temperature=0.7, repetition_penalty=1e-300)
        assert got.status_code == 400 and "repetition_penalty must lie in" in got.text


# ---- operator faults: 5xx without paths ------------------------------------------------------------------

def test_an_unsafe_tenant_state_file_is_a_500_without_its_path_and_others_are_served(lm, tmp_path, caplog):
    """The red-team's fifth finding: a tenant's state file put there by the operator with mode 660
    got that tenant a 400 holding the server's absolute path. It is the operator's fault: 500 with a
    generic message, the path in the server's log only; other tenants are served."""
    caplog.set_level(logging.INFO)
    store = tmp_path / "state" / "store.safetensors"
    config = _config(api_keys=ApiKeys(KEYS), learning="tenant", method="auto",
                     method_options={"store": str(store), "sized": False})
    with serving(create_app(lm.fresh(), config)) as url:
        alices = Path(tenant_file(str(store), "alice"))
        alices.parent.mkdir(parents=True, exist_ok=True)
        alices.write_bytes(b"anything")
        os.chmod(alices, 0o660)
        got = _chat(url, ALICE)
        assert got.status_code == 500, got.text
        assert got.json()["error"]["type"] == "server_error"
        assert str(tmp_path) not in got.text and "/" not in got.json()["error"]["message"]
        assert str(alices) in caplog.text  # the operator learns where
        assert _chat(url, BOB).status_code == 200


def test_state_files_in_directories_others_may_write_are_refused_at_startup(lm, tmp_path):
    """The red-team's ninth finding: --auto-store inside a 0777 directory started without a word."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    for learning in ("shared", "tenant"):
        config = _config(learning=learning, method="auto", method_options={"store": str(shared / "s.safetensors")})
        with pytest.raises(StateFileError, match="may be written by other users"):
            create_app(lm.fresh(), config)
    # a sticky world-writable directory (as /tmp): a private directory made inside it is fine,
    # a file directly in it is not (others could create its name first)
    os.chmod(shared, 0o1777)
    check_location(shared / "mine" / "s.safetensors")
    with pytest.raises(StateFileError, match="may be written by other users"):
        check_location(shared / "s.safetensors")
    # a tenants' directory someone else made writable: refused at startup too
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    store = private / "s.safetensors"
    Path(tenant_file(str(store), "x")).parent.mkdir(mode=0o700)
    os.chmod(Path(tenant_file(str(store), "x")).parent, 0o777)
    with pytest.raises(StateFileError, match="may be written by other users"):
        create_app(lm.fresh(), _config(learning="tenant", method="auto", method_options={"store": str(store)}))
    create_app(lm.fresh(), _config(learning="shared", method="auto", method_options={"store": str(store)}))


# ---- the front door ----------------------------------------------------------------------------------

def test_duplicate_authorization_headers_get_400(lm):
    with serving(create_app(lm, _config(api_keys=ApiKeys(KEYS)))) as url:
        for pair in ([ALICE, BOB], ["Bearer wrong", ALICE], [ALICE, ALICE]):
            got = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                             headers=[("Authorization", pair[0]), ("Authorization", pair[1])],
                             json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
            assert got.status_code == 400, got.text
            assert "more than one Authorization header" in got.json()["error"]["message"]
        assert _chat(url, ALICE).status_code == 200


def test_a_lone_surrogate_gets_a_400_that_says_so(lm):
    """The red-team's seventh finding: '\\ud800' got the tokenizer's internal message."""
    with serving(create_app(lm, _config())) as url:
        bodies = [b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
                  b'{"model": "tiny", "prompt": "x\\udfffy", "max_tokens": 2}',
                  b'{"model": "tiny", "prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}']
        for body, path in zip(bodies, ["chat/completions", "completions", "completions"], strict=True):
            got = httpx.post(f"{url}/v1/{path}", content=body, headers={"Content-Type": "application/json"})
            assert got.status_code == 400, got.text
            assert "not valid Unicode" in got.json()["error"]["message"]
            assert "TextEncodeInput" not in got.text


def test_head_health_is_200_and_no_redirect_echoes_the_host(lm):
    with serving(create_app(lm, _config(api_keys=ApiKeys(KEYS)))) as url:
        assert httpx.head(f"{url}/health").status_code == 200
        got = httpx.post(f"{url}/v1/chat/completions/", headers={"Authorization": ALICE, "Host": "evil.example"},
                         json={"model": MODEL, "messages": QUESTION, "max_tokens": 2}, follow_redirects=False)
        assert got.status_code == 404 and "location" not in got.headers
        assert "evil.example" not in got.text


def test_query_masking():
    assert mask_query("/v1/models?api_key=sk-123&x=1") == "/v1/models?api_key=<masked>&x=<masked>"
    assert mask_query("/health") == "/health"
    assert mask_query("/a?flag") == "/a?flag"


def test_a_key_in_the_query_string_is_refused_and_never_logged(tiny_model_dir, tmp_path):
    """The red-team's sixth finding: ?api_key=<the real key> got 401, but the whole key landed in
    uvicorn's access log. A real `triedec serve` process: 401, and its log shows the key masked."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "TRIEDEC_API_KEY": ALICE_KEY}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "triedec.cli.main", "serve", "--model", str(tiny_model_dir),
                                 "--method", "ar", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=tempfile.gettempdir())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for query in (f"api_key={ALICE_KEY}", f"key={ALICE_KEY}", f"access_token={ALICE_KEY}"):
            got = httpx.get(f"{base}/v1/models?{query}", headers={"Authorization": ALICE})
            assert got.status_code == 401, got.text
            assert "not accepted in the URL" in got.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": ALICE}).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    text = log.read_text()
    assert "GET /v1/models?api_key=<masked> HTTP/1.1" in text and " 401" in text
    assert ALICE_KEY not in text
    assert re.search(r"calibration ready in \d+\.\d s", text)  # measured or loaded before serving, and said


def test_operator_fault_errors_are_state_file_errors_and_still_triedec_errors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_text("x")
    os.chmod(bad, 0o666)
    from triedec.drafters.state import load_state

    with pytest.raises(StateFileError) as found:
        load_state(bad, "output store", "store", "f")
    assert isinstance(found.value, TriedecError)


def test_maxima_show_in_the_cli_listing(capsys):
    from triedec.cli.main import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "--beam-num-beams, --num-beams  (default 4, at most 64)" in out
    assert "--auto-k  (default 8, at most 64)" in out


def test_server_flags_build_the_decoder_limits():
    from triedec.cli.flags import build_parser
    from triedec.cli.serve_config import server_config

    args = build_parser().parse_args(["serve", "--max-methods-per-tenant", "3", "--max-methods", "9",
                                      "--max-learned-mib-per-tenant", "10", "--max-learned-mib", "0"])
    config = server_config(args, {})
    assert config.decoders == DecoderLimits(3, 9, 10 << 20, None)
    defaults = server_config(build_parser().parse_args(["serve"]), {}).decoders
    assert defaults == DecoderLimits()


def test_served_model_name_is_an_alias_of_model_name():
    from triedec.cli.flags import build_parser
    from triedec.cli.serve_config import server_config

    for flag in ("--served-model-name", "--model-name"):
        args = build_parser().parse_args(["serve", flag, "my-model"])
        assert server_config(args, {}).model_name == "my-model"
