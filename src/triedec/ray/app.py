"""triedec on Ray Serve: engine replicas behind one OpenAI-compatible endpoint (``pip install
triedec[ray]``; docs/scaling-out.md).

    serve run triedec.ray.app:app replicas=2 threads=1 redis_url=redis://127.0.0.1:6379/0
    triedec serve --ray --replicas 2 --threads 1 --redis-url redis://127.0.0.1:6379/0

The application has two deployments:

* **Engine** replicas each run the batching server itself (:func:`triedec.server.create_app`: the
  same routes, errors, auth, limits and stats) in-process, its engine loop on a thread of its own
  that loaded the model (``--threads`` torch threads; Ray reserves as many CPUs). They autoscale on
  ongoing requests between ``--replicas`` and ``--max-replicas``.
* The **Gateway** (the HTTP ingress, no CPU reserved; ``--gateways`` replicas) checks the key and
  bounds the body exactly as the server's own front door does
  (:func:`~triedec.server.transport.front_door`), names the request's affinity
  (:func:`~triedec.ray.routing.affinity_key`) and relays the engine's ASGI messages, streaming, to the client.
  A replica that dies under a request ends it cleanly: 503 before its first byte, an error event in
  a stream already started.

:class:`~triedec.ray.routing.AffinityRouter` (a Ray Serve request router) sends a request to the
replica its affinity key hashes to (rendezvous hashing: a key moves only when its replica goes away), so that a
conversation's turns find their drafting state warm; when that replica leads the least loaded one
by ``affinity_slack`` requests or more, or is full, power-of-two choices takes over. Learned state
still reaches every replica through Redis (``--redis-url``, :mod:`triedec.server.sharing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request
from starlette.responses import Response

from triedec.api.spec import ModelSpec
from triedec.cli.serve_config import serve_values, server_config
from triedec.core.errors import TriedecError
from triedec.ray.routing import AffinityRouter, affinity_key
from triedec.server.app import create_app
from triedec.server.config import DEFAULT_HOST, DEFAULT_PORT, ServerConfig
from triedec.server.schemas import error
from triedec.server.transport import front_door

log = logging.getLogger("triedec.ray")

APP_NAME = "triedec"
REPLICA_HEADER = "triedec-replica"
"""the response header naming the engine replica that answered (Ray Serve's replica id)"""


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """How many engine replicas run and how requests are spread over them. ``replicas``: started
    with (and the autoscaling floor); ``max_replicas``: the autoscaling ceiling (None = fixed at
    ``replicas``); ``affinity_slack``: ongoing requests by which a key's replica may lead the least
    loaded one before power-of-two choices takes over (None = the server's ``max_running``)."""

    replicas: int = 1
    max_replicas: int | None = None
    affinity_slack: int | None = None
    gateways: int = 1
    """gateway replicas (each with its own router; rendezvous hashing makes their choices agree)"""

    def __post_init__(self) -> None:
        for name in ("replicas", "max_replicas", "affinity_slack", "gateways"):
            value = getattr(self, name)
            if value is None and name not in ("replicas", "gateways"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TriedecError(f"{name} must be a positive integer, got {value!r}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise TriedecError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})")

    @classmethod
    def from_args(cls, args: Any) -> RaySettings:
        return cls(args.replicas, args.max_replicas, args.affinity_slack, args.gateways)


def parse_pairs(pairs: Mapping[str, str]) -> tuple[RaySettings, ModelSpec, ServerConfig]:
    """``serve run triedec.ray.app:app key=value ...``: each key is a ``triedec serve`` flag
    (``max_running=8`` is ``--max-running``; ``public_metrics=true`` a switch), each value read by
    that flag's own declaration (:func:`triedec.cli.serve_config.serve_values`, no command line), and the
    settings built as ``triedec serve`` builds them, with the same environment
    (``TRIEDEC_API_KEY``, ``TRIEDEC_REDIS_URL``)."""
    for key in pairs:
        if key in ("host", "port", "ray"):
            raise TriedecError(f"{key}= does not apply under `serve run`: Ray Serve owns the HTTP address "
                               "(serve's http_options)")
    args = serve_values(pairs)
    return RaySettings.from_args(args), ModelSpec.from_args(args), server_config(args, os.environ)


# -- deployments ---------------------------------------------------------------------------------


class Engine:
    """An engine replica: the batching server's app, in-process, fed ASGI messages by the gateway.
    The model is loaded, and the engine loop runs, on one thread of its own (see
    :mod:`triedec.server.scheduler` on why torch work stays on one thread)."""

    async def __init__(self, model: ModelSpec, config: ServerConfig) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.app: Any = None
        self._engine = threading.Thread(target=self._main, args=(model, config), name="triedec-engine", daemon=True)
        self._engine.start()
        await asyncio.to_thread(self._ready.wait)
        if self._failure is not None:
            raise self._failure
        self._lifespan = _Lifespan(self.app)
        await self._lifespan.start()

    def _main(self, model: ModelSpec, config: ServerConfig) -> None:
        try:
            self.app = create_app(model.load(), config)
            self.app.state.scheduler.claim()
        except BaseException as exc:
            self._failure = exc
            return
        finally:
            self._ready.set()
        self.app.state.scheduler.run()

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine loop has stopped is replaced."""
        if not self._engine.is_alive():
            raise RuntimeError("the engine loop has stopped")

    async def handle(self, scope: dict[str, Any], body: bytes, affinity: str = "") -> AsyncIterator[dict[str, Any]]:
        """Run one HTTP request through the app: yields its ASGI response messages (the start
        carries :data:`REPLICA_HEADER`). ``affinity`` is read by the router only. Closed early (the
        client left: Ray cancels the call), it cancels the app's task, whose handler then cancels
        the request: it leaves the batch at the next step boundary."""
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()  # None: the app has ended
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if delivered:  # the body was all: nothing more comes until the task is cancelled
                await asyncio.Future()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        task = asyncio.create_task(self.app(dict(scope, state={}), receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))  # after every message it sent
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica.encode())]
                    message = {**message, "headers": headers}
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    return
            task.result()  # the app ended without a last message: raise its error
        finally:
            task.cancel()

    async def __del__(self) -> None:
        """Ray's graceful shutdown: the last exchange of learned state, then the scheduler cancels
        what is left and writes the learned state."""
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            await lifespan.stop()


class _Lifespan:
    """Runs an ASGI app's lifespan (startup, then shutdown) as the ASGI spec has servers do."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                  self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        answer = await self._outbox.get()
        if answer["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {answer.get('message', answer['type'])}")

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._outbox.get()
        await self._task


class _Asgi(Response):
    """A response that runs an ASGI app (Ray Serve sends a returned Response by calling it with the
    request's scope, receive and send)."""

    def __init__(self, app: Any) -> None:  # no body of its own
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path",
               "headers", "client", "server")


class Gateway:
    """The HTTP ingress: the server's front door (key, body limits), then the request's affinity,
    then the engine replica's response relayed message by message."""

    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.engine = engine.options(stream=True)
        self.learning = config.tenancy().learning
        self.front = front_door(self._relay, config)

    async def __call__(self, request: Request) -> Response:
        return _Asgi(self.front)

    async def _relay(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:  # the front door has read and bounded it already: this is its replay
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        tenant = (scope.get("state") or {}).get("tenant")
        plain = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
        plain["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
        response = self.engine.handle.remote(plain, body, affinity=affinity_key(body, tenant, self.learning))
        started: dict[str, Any] | None = None
        try:
            async for message in response:
                if message["type"] == "http.response.start":
                    started = message
                await send(message)
        except BackPressureError:
            await error(503, "every replica's queue is full; retry later", "server_overloaded",
                        headers={"Retry-After": "1"})(scope, receive, send)
        except asyncio.CancelledError:
            response.cancel()  # the client left: the engine replica drops the request
            raise
        except Exception as exc:  # the replica died or failed under the request
            log.warning("a request failed on its replica: %s", type(exc).__name__)
            if started is None:
                await error(503, "the replica serving this request failed; retry it", "server_overloaded",
                            headers={"Retry-After": "1"})(scope, receive, send)
            else:
                await send({"type": "http.response.body", "body": _broken(started), "more_body": False})


def _broken(start: dict[str, Any]) -> bytes:
    """The last bytes of a response whose replica failed after it started: an error event for a
    stream (what the server itself sends when generation fails mid-stream), nothing otherwise."""
    headers = {bytes(k).lower(): bytes(v) for k, v in start.get("headers", [])}
    if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
        event = {"error": {"message": "the replica serving this request failed", "type": "server_error",
                           "param": None, "code": None}}
        return f"data: {json.dumps(event)}\n\n".encode()
    return b""


def engine_options(settings: RaySettings, model: ModelSpec, config: ServerConfig) -> dict[str, Any]:
    """The engine deployment's Ray Serve options: CPUs (``model.threads``), how many requests a
    replica takes (the server's running and queue bounds; past them requests wait at the gateway,
    and past ``max_queue`` there too they get 503), the affinity router, and replicas fixed or
    autoscaled on ongoing requests (target: ``max_running`` per replica, a full batch)."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": model.threads},
        "max_ongoing_requests": config.limits.max_running + config.max_queue, "max_queued_requests": config.max_queue,
        "request_router_config": RequestRouterConfig(
            request_router_class=AffinityRouter,
            request_router_kwargs={"slack": settings.affinity_slack or config.limits.max_running}),
        "health_check_period_s": 5, "graceful_shutdown_timeout_s": config.drain_seconds + 10}
    if settings.max_replicas is not None and settings.max_replicas > settings.replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=settings.replicas, initial_replicas=settings.replicas, max_replicas=settings.max_replicas,
            target_ongoing_requests=config.limits.max_running)
    else:
        options["num_replicas"] = settings.replicas
    return options


def build(settings: RaySettings, model: ModelSpec, config: ServerConfig) -> Any:
    """The Ray Serve application (``serve.run(build(...))``): the gateway over the engine replicas."""
    engine = serve.deployment(Engine, name="Engine", **engine_options(settings, model, config))
    gateway = serve.deployment(Gateway, name="Gateway", num_replicas=settings.gateways,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return gateway.bind(engine.bind(model, config), config)


def app(args: dict[str, str]) -> Any:
    """``serve run triedec.ray.app:app key=value ...`` (see :func:`parse_pairs`); the model is
    checked here, before any replica tries to load it."""
    settings, model, config = parse_pairs(args)
    model.check()
    return build(settings, model, config)


def run(settings: RaySettings, model: ModelSpec, config: ServerConfig, host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT) -> None:
    """``triedec serve --ray``: join the Ray cluster at ``RAY_ADDRESS`` (else start one on this
    machine), serve on ``host:port`` until SIGINT/SIGTERM, then shut Serve down (each replica
    writes its learned state). The model is checked before Ray starts."""
    import ray

    model.check()
    ray.init(logging_level=logging.WARNING, include_dashboard=False)
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        needed = settings.replicas * model.threads
        if needed > cpus:
            raise TriedecError(f"{settings.replicas} replicas x {model.threads} threads need {needed} CPUs; the Ray "
                               f"cluster has {cpus:g} (lower --threads or --replicas)")
        serve.start(http_options={"host": host, "port": port})
        serve.run(build(settings, model, config), name=APP_NAME, route_prefix="/")
        log.info("serving on http://%s:%d with %d engine replica(s)", host, port, settings.replicas)
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop.wait(1.0):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        with contextlib.suppress(Exception):
            serve.shutdown()
    finally:
        ray.shutdown()
