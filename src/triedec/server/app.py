"""The FastAPI app over one loaded :class:`~triedec.api.lm.LM` (see :mod:`triedec.server`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from triedec.api.lm import LM
from triedec.core.errors import TriedecError
from triedec.drafters.registry import NEEDS_COST, profile_specs
from triedec.drafters.state import check_location
from triedec.engine.methods import method as find_method
from triedec.model.memory import tune_allocator
from triedec.server.auth import MaskQueryStrings
from triedec.server.config import DEFAULT_HOST, DEFAULT_PORT, KEEP_ALIVE_SECONDS, ServerConfig
from triedec.server.playground import add_routes as add_playground
from triedec.server.playground import info as playground_info
from triedec.server.scheduler import Scheduler
from triedec.server.schemas import (
    CHAT_SHAPE,
    COMPLETION_SHAPE,
    IGNORED_HEADER,
    ChatRequest,
    CompletionRequest,
    Generation,
    error,
)
from triedec.server.service import Service, shown_options
from triedec.server.tenancy import ANONYMOUS, Scopes, tenant_file
from triedec.server.tokenizer import add_routes as add_tokenizer
from triedec.server.transport import front_door_layers

log = logging.getLogger("triedec.server")

SWITCH_INTERVAL = 0.0005
"""seconds a thread may hold the GIL while another waits for it, in a server's process (Python's
default is 0.005)"""


def _errors(app: FastAPI) -> None:
    """Every error as OpenAI's JSON shape with a 4xx (a 500 only for a bug)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                return error(400, "the body is not valid JSON")
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append((where, f"{where or 'body'}: {err.get('msg')}"))
        return error(400, "; ".join(p for _, p in problems) or "invalid request",
                     param=problems[0][0] or None if problems else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                     "invalid_request_error")

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error(500, f"internal error: {type(exc).__name__}", "server_error")


def _warn_ignored(req: Generation, response: Any) -> Any:
    """``response`` with the :data:`~triedec.server.schemas.IGNORED_HEADER` naming the request's
    ignored fields, if it had any."""
    ignored = req.ignored()
    if ignored:
        response.headers[IGNORED_HEADER] = f"unknown fields ignored: {', '.join(ignored)}"
    return response


def create_app(lm: LM, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``lm``. Its scheduler thread starts with the first request; the
    lifespan's shutdown cancels what is left and writes the learned state."""
    config = config or ServerConfig()
    tune_allocator()  # big buffers go back to the system when freed (model/memory.py)
    # The engine thread takes the GIL back after each torch op; while the event loop is busy (a flood of refusals)
    # each take waits up to the switch interval, 5 ms by default: dozens of waits a step. A short interval keeps
    # everyone else's requests at their speed under such a flood (tests/test_hostile.py).
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
    Scopes(config.tenancy(), lm.forget).check(config.method, config.method_options)
    lm.limit_decoders(config.decoders)
    _check_state_locations(config)
    _calibrate_everything(lm)
    lm.decoder(config.method, **config.method_options)  # validate (and build) the default method now
    service = Service(lm, config)
    lm.prompts.max_token_bytes  # noqa: B018  (measured now: a request's size check never waits on it)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if service.sharing is not None:
            service.sharing.start()
        service.scheduler.start()  # the engine's thread (unless the caller runs it) at the process's priority
        yield_to_engine()  # then this thread, and the worker threads it starts, below it
        yield
        if service.sharing is not None:  # a last exchange while the engine still runs
            await run_in_threadpool(service.sharing.close)
        await run_in_threadpool(service.scheduler.close)

    # redirect_slashes off: a redirect would echo the client's Host header back as a URL to follow. FastAPI's
    # generated pages (/docs, /redoc) are off: they load scripts from a CDN; the schema stays at /openapi.json
    app = FastAPI(title="triedec", version="0.1.0", lifespan=lifespan, redirect_slashes=False, docs_url=None,
                  redoc_url=None,
                  description="OpenAI-compatible endpoints over triedec's lossless speculative decoding")
    app.state.scheduler, app.state.config, app.state.lm = service.scheduler, config, lm
    app.state.sharing = service.sharing
    for layer, options in front_door_layers(config, service.precheck):  # each added one is outermost
        app.add_middleware(layer, **options)
    _errors(app)

    @app.post(CHAT_SHAPE.path, response_model=None)
    async def chat_completions(request: Request, req: ChatRequest) -> Any:
        if not req.messages:
            return _warn_ignored(req, error(400, "messages must not be empty", param="messages"))
        return _warn_ignored(req, await service.respond(request, req, CHAT_SHAPE))

    @app.post(COMPLETION_SHAPE.path, response_model=None)
    async def completions(request: Request, req: CompletionRequest) -> Any:
        if not req.prompt or any(not p for p in req.prompts()):
            return _warn_ignored(req, error(400, "prompt must not be empty", param="prompt"))
        return _warn_ignored(req, await service.respond(request, req, COMPLETION_SHAPE))

    shown = shown_options(config.method, config.method_options)
    add_playground(app, config.api_keys is not None,
                   playground_info(config.model_name, config.method, shown, config.max_tokens_limit,
                                   config.default_max_tokens, lm.adapter.exactness))

    add_tokenizer(app, lm, config.model_name, split_special=not config.special_tokens_in_text)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created,
                                            "owned_by": "triedec", "max_model_len": lm.max_context}]}

    @app.head("/health", include_in_schema=False)  # probes that use HEAD get 200 too (uvicorn sends no body)
    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = service.scheduler.depth
        found = {"status": "ok", "running": running, "waiting": waiting}
        if service.sharing is not None:
            found["sharing"] = service.sharing.status()
        if service.prefix is not None:
            found["prefix_cache"] = dataclasses.asdict(service.prefix.stats)
        return found

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        assert service.metrics is not None
        return PlainTextResponse(generate_latest(service.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app


HTTP_NICENESS = 5
"""how much lower than the engine's the priority of the HTTP side's threads is (Linux ``nice``):
parsing, validating and refusing requests is one client's work, a forward is everyone's"""


def yield_to_engine() -> None:
    """Lower the calling thread's CPU priority by :data:`HTTP_NICENESS` (threads it starts inherit
    it). On a machine whose cores a flood of requests keeps busy, the engine's threads (torch's
    among them, which wait on each other in every parallel op) then still get the CPU when they
    need it. A no-op where threads have no priority of their own (not Linux) or it cannot be set."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + HTTP_NICENESS))
    except OSError as exc:
        log.info("could not lower the HTTP threads' priority: %s", exc)


def _calibrate_everything(lm: LM) -> None:
    """Load, or measure now, every part of the calibration that a method a request may name could
    need (the cost model and every registered profile: recycling's takes a minute or two on a new
    machine), so that no request ever waits on a measurement and the engine thread never stalls on
    one; then check the cost model against a few forwards timed now, and measure it again if it no
    longer fits this machine (:meth:`~triedec.api.calibration.Calibrator.check_cost`). Logged with
    its time."""
    needs = frozenset({NEEDS_COST, *profile_specs()})
    log.info("loading the calibration every method needs (%s); measured once per machine and model, then cached",
             ", ".join(sorted(needs)))
    started = time.perf_counter()
    lm.calibration(needs)
    lm.calibrator.check_cost()  # a few forwards against the cached surface; measured again if stale
    log.info("calibration ready in %.1f s", time.perf_counter() - started)


def _check_state_locations(config: ServerConfig) -> None:
    """Refuse, at startup, learned-state files of the server's own options in a location others may
    write (:func:`~triedec.drafters.state.check_location`): the file itself, and under ``tenant``
    learning the directory of the per-tenant files beside it. A tenant's own file is checked when
    the tenant first needs it (a 500 for that tenant, logged)."""
    tenants = config.tenancy().learning == "tenant"
    for name in find_method(config.method).spec.state_files(config.method_options):
        path = str(config.method_options[name])
        check_location(path)
        if tenants:
            check_location(tenant_file(path, ANONYMOUS))


def listening_socket(host: str, port: int, send_buffer: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` whose connections inherit a send buffer of
    ``send_buffer`` bytes (the kernel doubles it), instead of one that grows to megabytes: a
    client that stopped reading fills it, and the server's send waits, within a bounded amount of
    data (then ``stall_seconds`` pause its request, and ``send_seconds`` end it)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise TriedecError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise TriedecError(f"the server could not listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


def serve(lm: LM, config: ServerConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Run the server until SIGINT/SIGTERM: the engine's loop on this (the main) thread, where the
    model was loaded (see :mod:`triedec.server.scheduler` on why), uvicorn on a thread of its own.
    On the first signal uvicorn stops accepting and lets in-flight requests finish for
    ``config.drain_seconds``; the scheduler then cancels the rest and writes the learned state. A
    second signal exits at once."""
    import signal

    import uvicorn

    app = create_app(lm, config)
    sock = listening_socket(host, port, config.send_buffer_bytes)
    scheduler: Scheduler = app.state.scheduler
    # an idle kept-alive connection is closed after KEEP_ALIVE_SECONDS; a request head is bounded to
    # 16 KiB (h11, chosen explicitly); uvicorn has no timeout for a head that never ends
    # (docs/serving.md: Security)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", http="h11",
                                           timeout_keep_alive=KEEP_ALIVE_SECONDS,
                                           h11_max_incomplete_event_size=16 << 10,
                                           timeout_graceful_shutdown=int(config.drain_seconds)))
    access = logging.getLogger("uvicorn.access")  # configured by uvicorn.Config just above
    if not any(isinstance(f, MaskQueryStrings) for f in access.filters):
        access.addFilter(MaskQueryStrings())  # a key a client put in a URL never reaches the log
    scheduler.claim()
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="triedec-http")

    def stop(signum: int, frame: Any) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    watcher = threading.Thread(target=lambda: (http.join(), scheduler.close()), name="triedec-http-watch", daemon=True)
    watcher.start()  # uvicorn ended (shut down, or failed to start): stop the engine too
    try:
        scheduler.run()
    finally:
        server.should_exit = True
        http.join(config.drain_seconds + 10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise TriedecError(f"the server could not start on {host}:{port} (see the log above)")
