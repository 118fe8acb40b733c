"""The prefix trie over HTTP (docs/serving.md: the prefix trie), on the tiny model: a repeated
prefix is served from the trie (``usage.prompt_tokens_details.cached_tokens``) with the same text
as without it; another tenant's prefix, or another ``cache_salt``, never hits; ``/health`` and
``/metrics`` count it; ``--no-prefix-cache`` keeps nothing."""

from __future__ import annotations

import json

import httpx
import pytest

from triedec.bench.load import serving
from triedec.server import ApiKeys, ServerConfig, create_app

MODEL = "tiny"
DOC = "Tell me a story about the sea and the ships and the city. " * 6
KEYS = {"key-alice-0123456789": "alice", "key-bob-0123456789": "bob"}


def _ask(c: httpx.Client, url: str, prompt: str, key: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = c.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8, **extra},
                    headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("method", ["ar", "auto"])
def test_a_repeated_prefix_is_served_from_the_trie_with_the_same_text(lm, method):
    with serving(create_app(lm, ServerConfig(model_name=MODEL, method=method))) as url, httpx.Client(timeout=60) as c:
        first = _ask(c, url, DOC + "First question?")
        again = _ask(c, url, DOC + "First question?")
        other = _ask(c, url, DOC + "Another question?")
        assert _cached(first) == 0
        assert 0 < _cached(again) < again["usage"]["prompt_tokens"]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert _cached(other) > 0 and again["triedec"]["cached_tokens"] == _cached(again)
        streamed = c.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": DOC + "First question?",
                                                          "max_tokens": 8, "stream": True,
                                                          "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert _cached(next(ch for ch in chunks if ch.get("usage"))) > 0
        health = c.get(f"{url}/health").json()["prefix_cache"]
        assert health["hits"] >= 3 and 0 < health["bytes"] <= health["capacity_bytes"]
        metrics = c.get(f"{url}/metrics").text
        assert "triedec_prefix_cache_hits_total" in metrics and "triedec_prefix_cache_bytes" in metrics
    with serving(create_app(lm, ServerConfig(model_name=MODEL, method=method, prefix_cache=False))) as url, \
            httpx.Client(timeout=60) as c:
        _ask(c, url, DOC + "First question?")
        kept = _ask(c, url, DOC + "First question?")
        assert _cached(kept) == 0 and kept["choices"][0]["text"] == first["choices"][0]["text"]
        assert "prefix_cache" not in c.get(f"{url}/health").json()


def test_another_tenants_prefix_or_another_salt_never_hits(lm):
    config = ServerConfig(model_name=MODEL, method="ar", api_keys=ApiKeys(KEYS))
    with serving(create_app(lm, config)) as url, httpx.Client(timeout=60) as c:
        alice = "key-alice-0123456789"
        bob = "key-bob-0123456789"
        _ask(c, url, DOC, alice)
        assert _cached(_ask(c, url, DOC, bob)) == 0
        assert _cached(_ask(c, url, DOC, alice)) > 0
        assert _cached(_ask(c, url, DOC, alice, cache_salt="s1")) == 0
        assert _cached(_ask(c, url, DOC, alice, cache_salt="s1")) > 0
        assert _cached(_ask(c, url, DOC, bob, cache_salt="s1")) == 0
