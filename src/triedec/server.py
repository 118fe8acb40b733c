"""``triedec serve``: an OpenAI-compatible HTTP server over one loaded :class:`~triedec.lm.LM`.

A thin shell (FastAPI + uvicorn + prometheus_client) over the public API:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's request and response shapes,
  ``stream: true`` as server-sent events in OpenAI's chunk format; triedec's own choices
  (``method``, ``method_options``, ``top_k``, ``min_p``, ``repetition_penalty``) come in the extra
  body, and every response carries triedec's stats in the ``triedec`` extension field.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

**Concurrency.** Each request is one :meth:`LM.stream` generator (its own KV cache and drafting
session). One scheduler thread advances every running request by one decoding step in turn
(round-robin), so a long request never blocks the others; at most ``max_running`` run at once and
``max_queue`` more wait; past that a request gets 503. A request whose client disconnects is
closed at the scheduler's next turn (its session ends, which also saves recycling's state file
when one is configured). Shared learned state (recycling's matrix, agreement rates) is updated
under the drafters' own locks. On SIGTERM uvicorn stops accepting, lets in-flight requests finish
for ``drain_seconds``, and the scheduler then cancels whatever is left.

**Errors** are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``) with a 4xx
status: malformed JSON, wrong types, unknown fields, unknown methods or options, bad numbers, an
empty prompt, a prompt + ``max_tokens`` beyond the context, unsupported OpenAI fields (named as
such), a body over ``max_body_bytes`` (413), an unknown model (404), a full queue (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from triedec.errors import TriedecError, positive_int
from triedec.lm import LM
from triedec.methods import Outcome, methods

log = logging.getLogger("triedec.server")


@dataclass(frozen=True)
class ServerConfig:
    """What the server runs: the default ``method`` and its ``method_options`` (a request may name
    others), the model id clients use (``model_name``), and its limits."""

    method: str = "auto"
    method_options: Mapping[str, object] = field(default_factory=dict)
    model_name: str = "triedec"
    max_running: int = 8
    """requests advanced together, one step each in turn"""
    max_queue: int = 64
    """requests waiting to run; one more gets 503"""
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    """max_tokens when a request gives none (cut to what the context leaves)"""
    drain_seconds: float = 30.0
    """on SIGTERM: how long in-flight requests may finish before they are cancelled"""

    def __post_init__(self) -> None:
        for name in ("max_running", "max_body_bytes", "default_max_tokens"):
            positive_int(name, getattr(self, name))
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise TriedecError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not self.model_name:
            raise TriedecError("model_name must not be empty")
        if not 0 <= self.drain_seconds < float("inf"):
            raise TriedecError(f"drain_seconds must be a finite number >= 0, got {self.drain_seconds!r}")


class QueueFull(Exception):
    """The scheduler has ``max_running + max_queue`` requests already."""


# ---- the scheduler ------------------------------------------------------------------------------


class Job:
    """One request's generator and the channel its events travel on to the HTTP handler:
    ``("tokens", list[int])`` per step, then ``("done", Outcome)``, ``("error", exception)`` or
    ``("cancelled", None)``."""

    def __init__(self, steps: Generator[list[int], None, Outcome], loop: asyncio.AbstractEventLoop) -> None:
        self.steps = steps
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, kind: str, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is already closed: nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """Advances every running request one decoding step in turn, on one thread (started on first
    use). Per-request state lives in each job's generator; nothing here is shared between jobs."""

    def __init__(self, max_running: int, max_queue: int) -> None:
        self.max_running, self.max_queue = max_running, max_queue
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def depth(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cond:
            return len(self._running), len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._running) + len(self._waiting) >= self.max_running + self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_running} running, {self.max_queue} waiting)")
            self._waiting.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="triedec-scheduler", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Stop: cancel every job (each generator is closed, its session ended) and wait."""
        with self._cond:
            self._closed = True
            for job in [*self._running, *self._waiting]:
                job.cancel()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._running or self._waiting or self._closed):
                    self._cond.wait()
                if self._closed and not (self._running or self._waiting):
                    return
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                turn = list(self._running)
            for job in turn:
                if self._step(job):
                    with self._cond:
                        self._running.remove(job)

    @staticmethod
    def _step(job: Job) -> bool:
        """Advance ``job`` one step; True when it is over."""
        if job.cancelled.is_set():
            job.steps.close()
            job.emit("cancelled", None)
            return True
        try:
            new = next(job.steps)
        except StopIteration as done:
            job.emit("done", done.value)
            return True
        except Exception as exc:  # reported to the client as a 500 (never expected)
            log.exception("request failed")
            job.emit("error", exc)
            return True
        job.emit("tokens", new)
        return False


# ---- request and response shapes ----------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


UNSUPPORTED_NEUTRAL: dict[str, object] = {
    "n": 1, "logprobs": False, "top_logprobs": None, "tools": None, "tool_choice": None, "functions": None,
    "function_call": None, "response_format": None, "logit_bias": None, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "parallel_tool_calls": None, "echo": False, "best_of": None, "suffix": None,
}
"""OpenAI fields the server knows but does not support, with the value that asks for nothing."""


class _Generation(_Body):
    """Fields both endpoints share: OpenAI's, then triedec's extra-body ones."""

    model: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None
    # triedec's own (extra body)
    method: str | None = Field(default=None, description="triedec decoding method (default: the server's)")
    method_options: dict[str, Any] | None = Field(default=None, description="the method's options")
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # known, unsupported
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def unsupported(self) -> list[str]:
        given = self.model_dump(exclude_unset=True)
        return [k for k, neutral in UNSUPPORTED_NEUTRAL.items()
                if k in given and given[k] not in (None, neutral) and given[k] not in ({}, [])]


class ChatRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Generation):
    prompt: str | list[int]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


@dataclass(frozen=True)
class _Shape:
    """What one endpoint's responses look like: its metrics label, id prefix, object names, and
    whether a choice carries a chat message (a ``delta`` when streaming) or plain ``text``."""

    endpoint: str
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str | None, reason: str | None, streaming: bool, first: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"index": 0}
        if not self.chat:
            out["text"] = text or ""
        elif not streaming:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["delta"] = {"role": "assistant", "content": ""} if first else ({} if text is None else
                                                                              {"content": text})
        return {**out, "finish_reason": reason, "logprobs": None}


CHAT_SHAPE = _Shape("chat", "chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)
COMPLETION_SHAPE = _Shape("completions", "cmpl", "text_completion", "text_completion", chat=False)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


# ---- text: incremental, stop strings excluded ---------------------------------------------------


class TextStream:
    """Turns accepted tokens into text deltas. Incomplete UTF-8 characters and any tail that could
    still grow into a stop string are held back; the final text ends right before the first stop
    string (OpenAI's semantics: the stop sequence is not returned)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.tokens: list[int] = []
        self.sent = ""

    def _text(self) -> tuple[str, bool]:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stops if s in text]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def add(self, new: Sequence[int]) -> str:
        self.tokens += new
        text, stopped = self._text()
        if not stopped:
            text = text.rstrip("\ufffd")
            hold = max((k for s in self.stops for k in range(len(s), 0, -1) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        return self._delta(text)

    def finish(self) -> str:
        return self._delta(self._text()[0])

    @property
    def text(self) -> str:
        return self._text()[0]

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


# ---- the app --------------------------------------------------------------------------------------


class _Metrics:
    def __init__(self, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("triedec_requests", "HTTP generation requests by endpoint, method and status",
                                ["endpoint", "method", "status"], registry=r)
        self.tokens = Counter("triedec_generated_tokens", "tokens generated", ["method"], registry=r)
        self.tokens_per_s = Histogram("triedec_request_tokens_per_second", "tokens/s of each finished request",
                                      ["method"], buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
                                      registry=r)
        self.accepted = Histogram("triedec_request_mean_accepted", "tokens per decoding step of each finished "
                                  "request (MAT)", ["method"], buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8), registry=r)
        self.latency = Histogram("triedec_request_seconds", "wall time of each finished request", ["method"],
                                 registry=r)
        queue = Gauge("triedec_queue_depth", "requests running or waiting", ["state"], registry=r)
        queue.labels("running").set_function(lambda: scheduler.depth[0])
        queue.labels("waiting").set_function(lambda: scheduler.depth[1])


@dataclass
class _Prepared:
    steps: Generator[list[int], None, Outcome]
    method: str
    options: dict[str, Any]
    prompt_tokens: int
    stops: tuple[str, ...]


def create_app(lm: LM, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``lm``. Its scheduler thread starts with the first request; the
    lifespan's shutdown cancels what is left."""
    config = config or ServerConfig()
    lm.decoder(config.method, **config.method_options)  # validate (and build) the default method now
    scheduler = Scheduler(config.max_running, config.max_queue)
    metrics = _Metrics(scheduler)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(scheduler.close)

    app = FastAPI(title="triedec", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible endpoints over triedec's lossless speculative decoding")
    app.state.scheduler, app.state.config, app.state.lm = scheduler, config, lm
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                return _error(400, "the body is not valid JSON")
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        return _error(400, "; ".join(problems) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    def prepare(req: _Generation, prompt: Any, chat: bool) -> _Prepared:
        """Validate everything and build the request's generator (in a worker thread: building a
        method may measure the device)."""
        unsupported = req.unsupported()
        if unsupported:
            raise TriedecError(f"unsupported field(s): {', '.join(unsupported)} (triedec returns one choice, "
                               "without logprobs, tools or penalties other than repetition_penalty)")
        if req.model is not None and req.model != config.model_name:
            raise LookupError(f"model {req.model!r} not found; this server serves {config.model_name!r}")
        method = req.method or config.method
        options = dict(config.method_options) if req.method is None else {}
        options.update(req.method_options or {})
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
        steps = lm.stream(ids, method, max_new_tokens=limit, stop=list(stops) or None, **sampling, **options)
        return _Prepared(steps, method, options, len(ids), stops)

    known = set(methods())

    async def start(request: Request, req: _Generation, prompt: Any, chat: bool, endpoint: str
                    ) -> tuple[Job, _Prepared] | JSONResponse:
        label = req.method or config.method
        label = label if label in known else "unknown"  # bounded label values, whatever clients send
        try:
            prepared = await run_in_threadpool(prepare, req, prompt, chat)
        except (TriedecError, TypeError, ValueError) as exc:  # bad input, named by the library
            metrics.requests.labels(endpoint, label, "400").inc()
            return _error(400, str(exc))
        except LookupError as exc:
            metrics.requests.labels(endpoint, label, "404").inc()
            return _error(404, str(exc), "not_found_error", "model")
        job = Job(prepared.steps, asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFull as exc:
            prepared.steps.close()
            metrics.requests.labels(endpoint, prepared.method, "503").inc()
            return _error(503, str(exc), "server_overloaded")
        return job, prepared

    def extension(prepared: _Prepared, outcome: Outcome) -> dict[str, Any]:
        s = outcome.stats
        return {"method": prepared.method, "options": prepared.options,
                "tokens_per_step": getattr(s, "mean_accepted", None), "tokens_per_s": s.tokens_per_s,
                "steps": s.steps, "computed_tokens": s.computed_tokens, "seconds": s.seconds,
                "seed": getattr(s, "seed", None), "stop_reason": s.stop_reason}

    def finished(endpoint: str, prepared: _Prepared, outcome: Outcome) -> None:
        s = outcome.stats
        metrics.requests.labels(endpoint, prepared.method, "200").inc()
        metrics.tokens.labels(prepared.method).inc(s.new_tokens)
        metrics.tokens_per_s.labels(prepared.method).observe(s.tokens_per_s)
        metrics.latency.labels(prepared.method).observe(s.seconds)
        if getattr(s, "mean_accepted", 0):
            metrics.accepted.labels(prepared.method).observe(s.mean_accepted)

    def usage(prepared: _Prepared, outcome: Outcome) -> dict[str, int]:
        n = outcome.stats.new_tokens
        return {"prompt_tokens": prepared.prompt_tokens, "completion_tokens": n,
                "total_tokens": prepared.prompt_tokens + n}

    async def complete(request: Request, job: Job, prepared: _Prepared, endpoint: str,
                       make: Any) -> JSONResponse:
        text = TextStream(lm.tokenizer, prepared.stops)
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return _error(499, "client disconnected")
                    continue
                if kind == "tokens":
                    text.add(value)
                elif kind == "done":
                    finished(endpoint, prepared, value)
                    reason = "length" if value.stats.stop_reason == "length" else "stop"
                    return JSONResponse(make(text.text, reason, usage(prepared, value), extension(prepared, value)))
                elif kind == "cancelled":
                    return _error(503, "the request was cancelled: the server is shutting down", "server_overloaded")
                else:
                    metrics.requests.labels(endpoint, prepared.method, "500").inc()
                    return _error(500, f"generation failed: {type(value).__name__}", "server_error")
        finally:
            job.cancel()  # a no-op once the generator is done

    async def stream(job: Job, prepared: _Prepared, endpoint: str, chunk: Any, include_usage: bool
                     ) -> AsyncIterator[str]:
        text = TextStream(lm.tokenizer, prepared.stops)
        try:
            yield _sse(chunk(None, None, first=True))
            while True:
                kind, value = await job.events.get()
                if kind == "tokens":
                    delta = text.add(value)
                    if delta:
                        yield _sse(chunk(delta, None))
                elif kind == "done":
                    finished(endpoint, prepared, value)
                    tail = text.finish()
                    if tail:
                        yield _sse(chunk(tail, None))
                    reason = "length" if value.stats.stop_reason == "length" else "stop"
                    yield _sse(chunk(None, reason, ext=extension(prepared, value)))
                    if include_usage:
                        yield _sse(chunk(None, None, usage=usage(prepared, value), ext=extension(prepared, value)))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    message = "cancelled: the server is shutting down" if kind == "cancelled" else "generation failed"
                    yield _sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
                    return
        finally:
            job.cancel()  # the client went away (or the stream ended): free the request at once

    def _sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def respond(request: Request, req: _Generation, prompt: Any, shape: _Shape) -> Any:
        """Start the request, then answer in ``shape``: a stream of chunks or one response."""
        started = await start(request, req, prompt, shape.chat, shape.endpoint)
        if isinstance(started, JSONResponse):
            return started
        job, prepared = started
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"

        def envelope(kind: str) -> dict[str, Any]:
            return {"id": rid, "object": kind, "created": int(time.time()), "model": config.model_name}

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
            return StreamingResponse(stream(job, prepared, shape.endpoint, chunk, include),
                                     media_type="text/event-stream")

        def make(text: str, reason: str, use: dict[str, int], ext: dict[str, Any]) -> dict[str, Any]:
            return {**envelope(shape.object), "choices": [shape.choice(text, reason, streaming=False)],
                    "usage": use, "triedec": ext}

        return await complete(request, job, prepared, shape.endpoint, make)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, req: ChatRequest) -> Any:
        if not req.messages:
            return _error(400, "messages must not be empty", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return await respond(request, req, messages, CHAT_SHAPE)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request, req: CompletionRequest) -> Any:
        if not req.prompt:
            return _error(400, "prompt must not be empty", param="prompt")
        return await respond(request, req, req.prompt, COMPLETION_SHAPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created,
                                            "owned_by": "triedec"}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = scheduler.depth
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

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
        too_large = _error(413, f"the request body exceeds {self.limit} bytes")
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
    """Run the server until SIGINT/SIGTERM (uvicorn): stop accepting, let in-flight requests finish
    for ``config.drain_seconds``, cancel the rest (their sessions end, saving recycling's state)."""
    import uvicorn

    app = create_app(lm, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=int(config.drain_seconds)))
    server.run()
