"""The FastAPI app over one loaded :class:`~triedec.lm.LM` (see :mod:`triedec.server`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from triedec.engine import BatchLimits, Run
from triedec.errors import TriedecError, positive_int
from triedec.lm import LM
from triedec.methods import methods
from triedec.request import Outcome
from triedec.server.metrics import Metrics
from triedec.server.scheduler import Job, QueueFull, Scheduler
from triedec.server.schemas import (
    CHAT_SHAPE,
    COMPLETION_SHAPE,
    ChatRequest,
    CompletionRequest,
    Generation,
    Shape,
    error,
)
from triedec.text import TextStream

log = logging.getLogger("triedec.server")


@dataclass(frozen=True)
class ServerConfig:
    """What the server runs: the default ``method`` and its ``method_options`` (a request may name
    others), the model id clients use (``model_name``), and its limits."""

    method: str = "auto"
    method_options: Mapping[str, object] = field(default_factory=dict)
    model_name: str = "triedec"
    max_running: int = 16
    """requests decoded together (one forward per step for all of them)"""
    max_queue: int = 64
    """requests waiting to run; one more gets 503"""
    max_tokens_per_forward: int = 512
    """tokens one forward carries at most (prompt chunks and optional draft nodes stop there)"""
    max_prefill_tokens: int = 256
    """prompt tokens per forward, in whole 128-token chunks, beside the running requests' steps"""
    max_kv_bytes: int | None = 4 << 30
    """KV memory the running requests may reserve (a request that cannot fit waits; one that could
    never fit gets 400); None = no cap"""
    persist_every: int = 16
    """finished requests between two writes of learned-state files (also written when idle and at
    shutdown)"""
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    """max_tokens when a request gives none (cut to what the context leaves)"""
    drain_seconds: float = 30.0
    """on SIGTERM: how long in-flight requests may finish before they are cancelled"""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "default_max_tokens"):
            positive_int(name, getattr(self, name))
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise TriedecError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not self.model_name:
            raise TriedecError("model_name must not be empty")
        if not 0 <= self.drain_seconds < float("inf"):
            raise TriedecError(f"drain_seconds must be a finite number >= 0, got {self.drain_seconds!r}")
        self.limits()  # validates the engine's limits

    def limits(self) -> BatchLimits:
        return BatchLimits(self.max_running, self.max_tokens_per_forward, self.max_prefill_tokens, self.max_kv_bytes,
                           self.persist_every)


@dataclass
class _Prepared:
    run: Run
    method: str
    options: dict[str, Any]
    prompt_tokens: int
    stops: tuple[str, ...]


class _Service:
    """What the routes do: validate a request into an engine run, submit it to the scheduler, and
    answer in OpenAI's shapes (one response, or server-sent events)."""

    def __init__(self, lm: LM, config: ServerConfig) -> None:
        self.lm, self.config = lm, config
        self.known = set(methods())
        self.metrics: Metrics | None = None
        self.scheduler = Scheduler(lm, config.limits(), config.max_queue, on_step=self._on_step)
        self.metrics = Metrics(lambda: self.scheduler.depth, config.max_tokens_per_forward)

    def _on_step(self, carried: dict[str, float]) -> None:
        if self.metrics is not None:
            self.metrics.step(carried)

    def method_of(self, req: Generation) -> tuple[str, dict[str, Any]]:
        """The request's method and options; refuses unsupported fields and unknown models."""
        config = self.config
        unsupported = req.unsupported()
        if unsupported:
            raise TriedecError(f"unsupported field(s): {', '.join(unsupported)} (triedec returns one choice, "
                               "without logprobs, tools or penalties other than repetition_penalty)")
        if req.model is not None and req.model != config.model_name:
            raise LookupError(f"model {req.model!r} not found; this server serves {config.model_name!r}")
        options = dict(config.method_options) if req.method is None else {}
        options.update(req.method_options or {})
        return req.method or config.method, options

    def prepare(self, req: Generation, prompt: Any, chat: bool) -> _Prepared:
        """Validate everything and make the request's run (in a worker thread; the method is
        already built, on the engine thread)."""
        lm, config = self.lm, self.config
        method, options = self.method_of(req)
        ids = lm.encode(prompt, chat=chat)
        limit = getattr(req, "max_completion_tokens", None)
        limit = req.max_tokens if limit is None else limit
        if limit is None:
            room = (lm.max_context - len(ids)) if lm.max_context else config.default_max_tokens
            limit = max(1, min(config.default_max_tokens, room))
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        sampling = {"temperature": req.temperature if req.temperature is not None else 0.0,
                    "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": req.top_k or 0,
                    "min_p": req.min_p or 0.0,
                    "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    "seed": req.seed}
        run = lm.start(ids, method, max_new_tokens=limit, stop=list(stops) or None, **sampling, **options)
        return _Prepared(run, method, options, len(ids), stops)

    async def start(self, req: Generation, prompt: Any, shape: Shape) -> tuple[Job, _Prepared] | JSONResponse:
        assert self.metrics is not None
        label = req.method or self.config.method
        label = label if label in self.known else "unknown"  # bounded label values, whatever clients send
        try:
            method, options = self.method_of(req)
            # built on the engine thread: building may measure the device (torch ops; see the scheduler)
            await asyncio.wrap_future(self.scheduler.call(lambda: self.lm.decoder(method, **options)))
            prepared = await run_in_threadpool(self.prepare, req, prompt, shape.chat)
            job = Job(prepared.run, asyncio.get_running_loop())
            self.scheduler.submit(job)
        except (TriedecError, TypeError, ValueError) as exc:  # bad input, named by the library
            self.metrics.requests.labels(shape.endpoint, label, "400").inc()
            return error(400, str(exc))
        except LookupError as exc:
            self.metrics.requests.labels(shape.endpoint, label, "404").inc()
            return error(404, str(exc), "not_found_error", "model")
        except QueueFull as exc:
            self.metrics.requests.labels(shape.endpoint, label, "503").inc()
            return error(503, str(exc), "server_overloaded")
        return job, prepared

    @staticmethod
    def extension(prepared: _Prepared, outcome: Outcome) -> dict[str, Any]:
        s = outcome.stats
        return {"method": prepared.method, "options": prepared.options,
                "tokens_per_step": getattr(s, "mean_accepted", None), "tokens_per_s": s.tokens_per_s,
                "steps": s.steps, "computed_tokens": s.computed_tokens, "seconds": s.seconds,
                "queued_seconds": s.queued_seconds, "seed": getattr(s, "seed", None), "stop_reason": s.stop_reason}

    @staticmethod
    def usage(prepared: _Prepared, outcome: Outcome) -> dict[str, int]:
        n = outcome.stats.new_tokens
        return {"prompt_tokens": prepared.prompt_tokens, "completion_tokens": n,
                "total_tokens": prepared.prompt_tokens + n}

    async def complete(self, request: Request, job: Job, prepared: _Prepared, shape: Shape, make: Any) -> JSONResponse:
        assert self.metrics is not None
        text = TextStream(self.lm.tokenizer, prepared.stops)
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return error(499, "client disconnected")
                    continue
                if kind == "tokens":
                    text.tokens += value  # the text is decoded once, at the end
                elif kind == "done":
                    self.metrics.finished(shape.endpoint, prepared.method, value)
                    reason = "length" if value.stats.stop_reason == "length" else "stop"
                    return JSONResponse(make(text.text, reason, self.usage(prepared, value),
                                             self.extension(prepared, value)))
                elif kind == "cancelled":
                    return error(503, "the request was cancelled: the server is shutting down", "server_overloaded")
                else:
                    self.metrics.requests.labels(shape.endpoint, prepared.method, "500").inc()
                    return error(500, f"generation failed: {type(value).__name__}", "server_error")
        finally:
            job.cancel()  # a no-op once the run is done

    async def stream(self, job: Job, prepared: _Prepared, shape: Shape, chunk: Any,
                     include_usage: bool) -> AsyncIterator[str]:
        assert self.metrics is not None
        text = TextStream(self.lm.tokenizer, prepared.stops)
        try:
            yield _sse(chunk(None, None, first=True))
            while True:
                kind, value = await job.events.get()
                if kind == "tokens":
                    delta = text.add(value)
                    if delta:
                        yield _sse(chunk(delta, None))
                elif kind == "done":
                    self.metrics.finished(shape.endpoint, prepared.method, value)
                    tail = text.finish()
                    if tail:
                        yield _sse(chunk(tail, None))
                    reason = "length" if value.stats.stop_reason == "length" else "stop"
                    ext = self.extension(prepared, value)
                    yield _sse(chunk(None, reason, ext=ext))
                    if include_usage:
                        yield _sse(chunk(None, None, usage=self.usage(prepared, value), ext=ext))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    message = "cancelled: the server is shutting down" if kind == "cancelled" else "generation failed"
                    yield _sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
                    return
        finally:
            job.cancel()  # the client went away (or the stream ended): free the request at once

    async def respond(self, request: Request, req: Generation, prompt: Any, shape: Shape) -> Any:
        """Start the request, then answer in ``shape``: a stream of chunks or one response."""
        started = await self.start(req, prompt, shape)
        if isinstance(started, JSONResponse):
            return started
        job, prepared = started
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        model = self.config.model_name

        def envelope(kind: str) -> dict[str, Any]:
            return {"id": rid, "object": kind, "created": int(time.time()), "model": model}

        if req.stream:
            def chunk(delta: str | None, reason: str | None, first: bool = False,
                      usage: dict[str, int] | None = None, ext: dict[str, Any] | None = None) -> dict[str, Any]:
                out = envelope(shape.chunk_object)
                if usage is not None:
                    out["choices"], out["usage"] = [], usage
                else:
                    out["choices"] = [shape.choice(delta, reason, streaming=True, first=first)]
                if ext is not None:
                    out["triedec"] = ext
                return out

            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.stream(job, prepared, shape, chunk, include), media_type="text/event-stream")

        def make(text: str, reason: str, use: dict[str, int], ext: dict[str, Any]) -> dict[str, Any]:
            return {**envelope(shape.object), "choices": [shape.choice(text, reason, streaming=False)],
                    "usage": use, "triedec": ext}

        return await self.complete(request, job, prepared, shape, make)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _errors(app: FastAPI) -> None:
    """Every error as OpenAI's JSON shape with a 4xx (a 500 only for a bug)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                return error(400, "the body is not valid JSON")
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        return error(400, "; ".join(problems) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                     "invalid_request_error")

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error(500, f"internal error: {type(exc).__name__}", "server_error")


def create_app(lm: LM, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``lm``. Its scheduler thread starts with the first request; the
    lifespan's shutdown cancels what is left and writes the learned state."""
    config = config or ServerConfig()
    lm.decoder(config.method, **config.method_options)  # validate (and build) the default method now
    service = _Service(lm, config)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(service.scheduler.close)

    app = FastAPI(title="triedec", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible endpoints over triedec's lossless speculative decoding")
    app.state.scheduler, app.state.config, app.state.lm = service.scheduler, config, lm
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    _errors(app)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, req: ChatRequest) -> Any:
        if not req.messages:
            return error(400, "messages must not be empty", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return await service.respond(request, req, messages, CHAT_SHAPE)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request, req: CompletionRequest) -> Any:
        if not req.prompt:
            return error(400, "prompt must not be empty", param="prompt")
        return await service.respond(request, req, req.prompt, COMPLETION_SHAPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created,
                                            "owned_by": "triedec"}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = service.scheduler.depth
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        assert service.metrics is not None
        return PlainTextResponse(generate_latest(service.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app


class _BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before the app reads it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = error(413, f"the request body exceeds {self.limit} bytes")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_large(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await too_large(scope, receive, send)
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def serve(lm: LM, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server until SIGINT/SIGTERM: the engine's loop on this (the main) thread, where the
    model was loaded (see :mod:`triedec.server.scheduler` on why), uvicorn on a thread of its own.
    On the first signal uvicorn stops accepting and lets in-flight requests finish for
    ``config.drain_seconds``; the scheduler then cancels the rest and writes the learned state. A
    second signal exits at once."""
    import signal
    import threading

    import uvicorn

    app = create_app(lm, config)
    scheduler: Scheduler = app.state.scheduler
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=int(config.drain_seconds)))
    scheduler.claim()
    http = threading.Thread(target=server.run, name="triedec-http")

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
