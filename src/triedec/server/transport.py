"""The server's front door as ASGI layers, outermost first: the transport (a body over its size
limit gets 413 before the app reads it, a body slower than ``body_seconds`` 408, a response the
client does not take within ``send_seconds`` is ended), then the API-key check. The Ray gateway
wraps its relay in the same layers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from triedec.server.auth import RequireKey
from triedec.server.config import ServerConfig
from triedec.server.schemas import (
    error,
)

log = logging.getLogger("triedec.server")


def front_door_layers(config: ServerConfig) -> list[tuple[type, dict[str, Any]]]:
    """The server's front door as ASGI middleware classes with their options, innermost first:
    the body's size and time limits (413, 408) and the send timeout, then, outermost, the API key
    (401, before any body is read)."""
    return [(_Transport, {"limit": config.max_body_bytes, "body_seconds": config.body_seconds,
                          "send_seconds": config.send_seconds}),
            (RequireKey, {"keys": config.api_keys})]


def front_door(inner: Any, config: ServerConfig) -> Any:
    """The ASGI app ``inner`` behind the server's own front door, as :func:`create_app` puts its
    routes (:func:`front_door_layers`). A gateway in front of replicas (:mod:`triedec.ray.app`)
    uses it."""
    for layer, options in front_door_layers(config):
        inner = layer(inner, **options)
    return inner


class _ClientTooSlow(Exception):
    """A response message was not taken by the client in time."""


class _Transport:
    """ASGI middleware bounding what one client can hold: a request body over ``limit`` bytes gets
    413 and one that has not arrived within ``body_seconds`` gets 408, both before the app sees
    it; a response message the client has not taken within ``send_seconds`` (a client that stopped
    reading its stream) ends the response, and the server closes the connection."""

    def __init__(self, app: Any, limit: int, body_seconds: float, send_seconds: float) -> None:
        self.app, self.limit = app, limit
        self.body_seconds, self.send_seconds = body_seconds, send_seconds

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
        body, more = b"", True
        deadline = asyncio.get_running_loop().time() + self.body_seconds
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                await error(408, f"the request body did not arrive within {self.body_seconds:g} s",
                            code="timeout")(scope, receive, send)
                return
            if message["type"] != "http.request":
                return  # the client left
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await error(413, f"the request body exceeds {self.limit} bytes")(scope, receive, send)
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._run(scope, replay, timed_send)

    async def _run(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except _ClientTooSlow:  # the client did not take a response message in time
            log.info("a client stopped reading its response for %g s: closing the connection", self.send_seconds)
