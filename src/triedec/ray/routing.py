"""Which engine replica a request goes to on Ray Serve (:mod:`triedec.ray.app`): its affinity key
(:func:`affinity_key`: tenant, user, or the conversation's start), the replica that key hashes to
(:func:`rendezvous`), and :class:`AffinityRouter`, Ray Serve's request router over the pure
ranking :func:`choose` (the key's replica unless it leads the least loaded one by the slack, then
power-of-two choices). See docs/scaling-out.md."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.request_router import RequestRouter


def affinity_key(body: bytes, tenant: str | None, learning: str) -> str:
    """What keeps a request on one replica: its tenant (under ``tenant`` learning, where its
    learned state is its own), else the body's ``user``, else a digest of the conversation's start
    (chat: the messages up to the first user message, of which the first 256 characters;
    completions: the prompt's first 256 characters), which every later turn repeats, and so do
    the questions that follow one passage: what the replica's prefix trie and drafting state
    reuse. ``""`` (no affinity) for a body that is not a JSON object."""
    if learning == "tenant" and tenant:
        return "tenant:" + tenant
    try:
        request = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(request, dict):
        return ""
    user = request.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    messages = request.get("messages")
    if isinstance(messages, list):
        start = []
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                start.append({**message, "content": content[:256] if isinstance(content, str) else content})
                break
            start.append(message)
        seed = json.dumps(start, sort_keys=True, default=str)
    else:
        prompt = request.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and prompt else prompt
        seed = json.dumps(prompt, default=str)[:256]
    return "conversation:" + hashlib.sha256(seed.encode()).hexdigest()[:32]


def rendezvous(key: str, replicas: Sequence[str]) -> str:
    """The replica ``key`` belongs to (highest random weight: every key keeps its replica while it
    lives; a replica's leaving moves only its own keys, evenly)."""
    if not replicas:
        raise ValueError("no replica to choose from")
    return max(replicas, key=lambda r: hashlib.sha256(f"{key}\0{r}".encode()).digest())


class AffinityRouter(RequestRouter):
    """Ray Serve's request router for the engine replicas: affinity by rendezvous hashing, then
    power-of-two choices (:func:`choose`). Each request is routed to its own choice (no FIFO mixin:
    a replica found for one request is never handed to another's)."""

    def initialize_state(self, slack: int = 16, **kwargs: Any) -> None:
        self.slack = slack

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        if not candidate_replicas:
            return []
        key = (pending_request.kwargs.get("affinity") or "") if pending_request is not None else ""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        load = {i: self.replica_queue_len_cache.get(r.replica_id) for i, r in by_id.items()}
        return [[by_id[i] for i in rank] for rank in choose(key, load, self.slack)]


def choose(key: str, load: Mapping[str, int | None], slack: int, rng: random.Random | None = None) -> list[list[str]]:
    """The router's ranking, as a pure function of the candidates' ongoing requests (``load``;
    None = not known yet, counted as 0): the key's replica first, unless it leads the least loaded
    one by ``slack`` or more; then two random replicas (power of two: Ray takes the less loaded
    one that has room). No key: the two random replicas only."""
    rng = rng or random.Random()
    ids = sorted(load)
    known = {i: load[i] or 0 for i in ids}
    others = rng.sample(ids, min(2, len(ids)))
    if not key:
        return [others]
    home = rendezvous(key, ids)
    if known[home] - min(known.values()) >= slack:
        return [others]
    rest = [i for i in others if i != home]
    return [[home], rest] if rest else [[home]]
