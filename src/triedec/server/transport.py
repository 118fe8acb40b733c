"""The server's front door as ASGI layers, outermost first: the Host check (a server without API
keys answers only loopback names and ``allowed_hosts``: no DNS rebinding), the transport (a body over its size
limit gets 413 before the app reads it, a body slower than ``body_seconds`` 408, a response the
client does not take within ``send_seconds`` is ended), then the API-key check. The Ray gateway
wraps its relay in the same layers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from triedec.server.auth import RequireKey
from triedec.server.config import ServerConfig
from triedec.server.schemas import (
    error,
)

log = logging.getLogger("triedec.server")


BODIES_PER_PEER = 2
"""request bodies one peer (a client address) may have read and prechecked at once"""
BIG_BODY = 256 << 10
"""a body (its declared length) from this size up is read in turn with the other big ones"""
BIG_BODY_PAUSE = 2.0
"""a big body's turn lasts this many times its reading and precheck again: big bodies get at most a
third of the event loop's time"""

Precheck = Callable[[str, bytes], Any]
"""``(path, body) -> an ASGI response or None``: a look at a whole request body before the app
parses it, which may refuse it at once (the server's: a prompt surely too long for the context)."""


def front_door_layers(config: ServerConfig, precheck: Precheck | None = None) -> list[tuple[type, dict[str, Any]]]:
    """The server's front door as ASGI middleware classes with their options, innermost first:
    the body's size and time limits (413, 408), ``precheck`` on the whole body, and the send
    timeout, then the API key (401, before any body is read), then, outermost, the Host check (400,
    before anything else)."""
    return [(_Transport, {"limit": config.max_body_bytes, "body_seconds": config.body_seconds,
                          "send_seconds": config.send_seconds, "precheck": precheck}),
            (RequireKey, {"keys": config.api_keys}),
            (AllowedHosts, {"hosts": config.hosts()})]


def front_door(inner: Any, config: ServerConfig) -> Any:
    """The ASGI app ``inner`` behind the server's own front door, as :func:`create_app` puts its
    routes (:func:`front_door_layers`). A gateway in front of replicas (:mod:`triedec.ray.app`)
    uses it."""
    for layer, options in front_door_layers(config):
        inner = layer(inner, **options)
    return inner


def host_name(value: bytes | None) -> str | None:
    """A ``Host`` header's name, lower case, without its port (``[::1]:8000`` is ``::1``); None
    for a missing or malformed one."""
    if not value:
        return None
    try:
        text = value.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        name, sep, rest = text[1:].partition("]")
        return name if sep and (not rest or (rest.startswith(":") and rest[1:].isdigit())) else None
    name, _, port = text.partition(":")
    return name if name and (not port or port.isdigit()) else None


def is_loopback(name: str) -> bool:
    """``localhost``, an address in 127.0.0.0/8, or ``::1``."""
    if name in ("localhost", "localhost.", "::1"):
        return True
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "127" and all(p.isdigit() and int(p) < 256 for p in parts)


class AllowedHosts:
    """ASGI middleware: with ``hosts`` (a server without API keys), a request whose ``Host`` is not
    a loopback name nor one of ``hosts`` gets 400 before anything else runs: a web page a local
    user visits cannot rebind its own name to 127.0.0.1 and use the API, the page or ``/metrics``
    (Starlette's TrustedHostMiddleware does the same). None: every Host passes."""

    def __init__(self, app: Any, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.hosts is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope.get("headers") or [] if k.lower() == b"host"]
        name = host_name(values[0]) if len(values) == 1 else None
        if name is None or not (is_loopback(name) or name in self.hosts):
            await error(400, "this server answers only requests addressed to it by a loopback name (or a name its "
                             "operator allowed with --allowed-hosts)", param="Host")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _ClientTooSlow(Exception):
    """A response message was not taken by the client in time."""


class _Transport:
    """ASGI middleware bounding what one client can hold: a request body over ``limit`` bytes gets
    413 and one that has not arrived within ``body_seconds`` gets 408, both before the app sees
    it; a response message the client has not taken within ``send_seconds`` (a client that stopped
    reading its stream) ends the response, and the server closes the connection."""

    def __init__(self, app: Any, limit: int, body_seconds: float, send_seconds: float,
                 precheck: Precheck | None = None) -> None:
        self.app, self.limit, self.precheck = app, limit, precheck
        self.body_seconds, self.send_seconds = body_seconds, send_seconds
        self._gates: dict[str, list[Any]] = {}  # peer -> [its semaphore, requests holding or awaiting it]
        self._big_turn = asyncio.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def timed_send(message: dict[str, Any]) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_seconds)
            except TimeoutError as exc:
                raise _ClientTooSlow from exc

        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self._run(scope, receive, timed_send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error(413, f"the request body exceeds {self.limit} bytes")(scope, receive, send)
            return
        peer = (scope.get("client") or ("",))[0]
        big = declared is not None and declared.isdigit() and int(declared) > BIG_BODY
        async with self._gate(peer), self._big_bodies(big):
            answered = await self._read_body(scope, receive, send)
        if answered is None:
            return
        body, replayed = answered, False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._run(scope, replay, timed_send)

    @contextlib.asynccontextmanager
    async def _big_bodies(self, big: bool) -> AsyncIterator[None]:
        """Bodies over :data:`BIG_BODY` are read and prechecked one at a time, and each holds the
        turn :data:`BIG_BODY_PAUSE` times as long again as it took: reading and parsing a large
        body holds the GIL (``json.loads`` is one long C call), so a flood of them could otherwise
        keep the engine's thread waiting for the GIL dozens of times a step. This caps their share
        of the server's time at ``1 / (1 + BIG_BODY_PAUSE)``; large requests of a flood wait for
        their turn (and so send more slowly) instead of slowing everyone's decoding."""
        if not big:
            yield
            return
        async with self._big_turn:
            started = time.perf_counter()
            try:
                yield
            finally:
                await asyncio.sleep(BIG_BODY_PAUSE * (time.perf_counter() - started))

    @contextlib.asynccontextmanager
    async def _gate(self, peer: str) -> AsyncIterator[None]:
        """At most :data:`BODIES_PER_PEER` request bodies of one peer read and prechecked at once;
        the peer's others wait without being read (the server stops reading their sockets), so a
        flood of large bodies from one peer keeps the event loop's queue short for everyone else."""
        gate = self._gates.get(peer)
        if gate is None:
            gate = self._gates[peer] = [asyncio.Semaphore(BODIES_PER_PEER), 0]
        gate[1] += 1
        try:
            async with gate[0]:
                yield
        finally:
            gate[1] -= 1
            if not gate[1]:
                del self._gates[peer]

    async def _read_body(self, scope: dict[str, Any], receive: Any, send: Any) -> bytes | None:
        """The whole request body, or None once an answer was sent (408, 413, the client left, or
        the precheck refused it)."""
        parts: list[bytes] = []
        size, more = 0, True
        deadline = asyncio.get_running_loop().time() + self.body_seconds
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                await error(408, f"the request body did not arrive within {self.body_seconds:g} s",
                            code="timeout")(scope, receive, send)
                return None
            if message["type"] != "http.request":
                return None  # the client left
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                await error(413, f"the request body exceeds {self.limit} bytes")(scope, receive, send)
                return None
        body = b"".join(parts)
        refused = self.precheck(scope.get("path", ""), body) if self.precheck is not None else None
        if refused is not None:
            await refused(scope, receive, send)
            return None
        return body

    async def _run(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except _ClientTooSlow:  # the client did not take a response message in time
            log.info("a client stopped reading its response for %g s: closing the connection", self.send_seconds)
