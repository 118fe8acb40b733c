"""The FastAPI app over one loaded :class:`~triedec.lm.LM` (see :mod:`triedec.server`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from triedec.decoders import DecoderLimits
from triedec.drafters.base import FROM_STORE
from triedec.drafters.registry import NEEDS_COST, profile_specs
from triedec.drafters.state import check_location
from triedec.engine import BatchLimits, Run
from triedec.errors import StateFileError, TriedecError, positive_int
from triedec.generation import GenerationRequest
from triedec.lm import LM
from triedec.methods import method as find_method
from triedec.methods import methods
from triedec.request import Outcome
from triedec.sampling import SAMPLING_FIELDS, Sampling
from triedec.server.auth import ApiKeys, MaskQueryStrings, RequireKey
from triedec.server.metrics import Metrics
from triedec.server.playground import add_routes as add_playground
from triedec.server.playground import info as playground_info
from triedec.server.scheduler import Job, QueueFull, Scheduler, TenantBusy, TenantLimits
from triedec.server.schemas import (
    CHAT_SHAPE,
    COMPLETION_SHAPE,
    IGNORED_HEADER,
    ChatRequest,
    CompletionRequest,
    Generation,
    Shape,
    error,
)
from triedec.server.sharing import Sharing, SharingConfig
from triedec.server.tenancy import ANONYMOUS, Learning, Scopes, Tenancy, tenant_file
from triedec.text import TextStream
from triedec.trace import StepTrace

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
    api_keys: ApiKeys | None = None
    """keys every request but ``/health`` must carry (:mod:`triedec.server.auth`); None = open"""
    learning: Learning | None = None
    """whose learned state a request drafts from (:mod:`triedec.server.tenancy`); None = ``tenant``
    when keys are configured, ``shared`` otherwise"""
    max_tenants: int = 64
    """tenants whose learned state is kept in memory (``tenant`` learning)"""
    tenant_max_running: int | None = None
    """requests of one tenant decoded at once (None: up to ``max_running``)"""
    tenant_max_queued: int | None = None
    """requests of one tenant waiting beyond those; one more gets 429 (None: up to ``max_queue``)"""
    max_request_seconds: float | None = None
    """a request's whole time, queue included: past it, it ends with what it has (finish_reason
    ``length``, stop_reason ``time_limit``), or gets 408 if it has no token yet; None = no limit"""
    max_tokens_limit: int = 4096
    """the most ``max_tokens`` a request may ask for (more gets 400)"""
    body_seconds: float = 30.0
    """a request body must arrive within this time (else 408)"""
    send_seconds: float = 60.0
    """a response chunk must be taken by the client within this time (else the connection is
    closed: a client that never reads its stream holds nothing for long)"""
    redis_url: str | None = field(default=None, repr=False)
    """share learned state with the other replicas that name the same Redis
    (:mod:`triedec.server.sharing`); None = this process's own only"""
    share_interval: float = 0.5
    """seconds between two exchanges of learned state through Redis"""
    share_max_entries: int = 1_000
    """entries each Redis stream of learned state keeps, about"""
    decoders: DecoderLimits = field(default_factory=DecoderLimits)
    """the methods (option sets) kept built, per tenant and overall, in count and learned-state
    bytes (:mod:`triedec.decoders`); past them the least recently used are dropped"""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "default_max_tokens", "max_tokens_limit"):
            positive_int(name, getattr(self, name))
        if self.default_max_tokens > self.max_tokens_limit:
            raise TriedecError(f"the default max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit "
                               f"({self.max_tokens_limit})")
        for name in ("body_seconds", "send_seconds"):
            if not 0 < getattr(self, name) < float("inf"):
                raise TriedecError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        self.tenancy()  # validates the learning mode and max_tenants
        self.tenant_limits()  # validates the per-tenant limits
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise TriedecError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not self.model_name:
            raise TriedecError("model_name must not be empty")
        if not 0 <= self.drain_seconds < float("inf"):
            raise TriedecError(f"drain_seconds must be a finite number >= 0, got {self.drain_seconds!r}")
        self.limits()  # validates the engine's limits
        self.sharing()  # validates the Redis URL and the exchange's settings
        if not isinstance(self.decoders, DecoderLimits):
            raise TriedecError(f"decoders must be a DecoderLimits, got {self.decoders!r}")

    def sharing(self) -> SharingConfig | None:
        if self.redis_url is None:
            return None
        return SharingConfig(self.redis_url, self.share_interval, self.share_max_entries)

    def limits(self) -> BatchLimits:
        return BatchLimits(self.max_running, self.max_tokens_per_forward, self.max_prefill_tokens, self.max_kv_bytes,
                           self.persist_every)

    def tenancy(self) -> Tenancy:
        learning = self.learning or ("tenant" if self.api_keys is not None else "shared")
        return Tenancy(learning, self.max_tenants)

    def tenant_limits(self) -> TenantLimits:
        return TenantLimits(self.tenant_max_running, self.tenant_max_queued, self.max_request_seconds)


@dataclass
class _Prepared:
    run: Run
    method: str
    options: dict[str, Any]
    """the options a client may see (state-file paths left out)"""
    prompt_tokens: int
    stops: tuple[str, ...]
    trace: bool = False
    """the client asked for each step's record (``trace``)"""


class _Service:
    """What the routes do: validate a request into an engine run, submit it to the scheduler, and
    answer in OpenAI's shapes (one response, or server-sent events)."""

    def __init__(self, lm: LM, config: ServerConfig) -> None:
        self.lm, self.config = lm, config
        self.known = set(methods())
        self.metrics: Metrics | None = None
        self.scheduler = Scheduler(lm, config.limits(), config.max_queue, on_step=self._on_step,
                                   tenants=config.tenant_limits())
        self.scopes = Scopes(config.tenancy(), lm.forget)
        self.metrics = Metrics(lambda: self.scheduler.depth, config.max_tokens_per_forward)
        sharing = config.sharing()
        self.sharing = None if sharing is None else Sharing(lm, self.scheduler, sharing)
        if self.sharing is not None:
            self.metrics.sharing(self.sharing.status)

    def _on_step(self, carried: dict[str, float]) -> None:
        if self.metrics is not None:
            self.metrics.step(carried)

    def method_of(self, req: Generation) -> tuple[str, dict[str, Any]]:
        """The request's method and options; refuses unsupported fields, unknown models and
        state-file options (files are the operator's to name, never a client's)."""
        config = self.config
        unsupported = req.unsupported()
        if unsupported:
            raise TriedecError(f"unsupported field(s): {', '.join(unsupported)} (triedec returns one choice, "
                               "without logprobs, tools or penalties other than repetition_penalty)")
        if req.model is not None and req.model != config.model_name:
            raise LookupError(f"model {req.model!r} not found; this server serves {config.model_name!r}")
        method = req.method or config.method
        files = find_method(method).spec.state_files(req.method_options or {})  # an unknown name: 400
        if files:
            raise TriedecError(f"method_options may not name learned-state files ({', '.join(files)}): "
                               "the server's operator sets them")
        options = dict(config.method_options) if req.method is None else {}
        options.update(req.method_options or {})
        return method, options

    def prepare(self, req: Generation, prompt: Any, chat: bool, method: str, options: dict[str, Any],
                scope: Hashable) -> _Prepared:
        """Validate everything and make the request's run (in a worker thread; the method is
        already built, on the engine thread)."""
        lm, config = self.lm, self.config
        ids = lm.encode(prompt, chat=chat)
        limit = getattr(req, "max_completion_tokens", None)
        name = "max_tokens" if limit is None else "max_completion_tokens"  # errors name the field the client sent
        limit = req.max_tokens if limit is None else limit
        if limit is None:
            room = (lm.max_context - len(ids)) if lm.max_context else config.default_max_tokens
            limit = max(1, min(config.default_max_tokens, room))
        elif isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise FieldError(name, f"{name} must be a positive integer, got {limit!r}")
        elif limit > config.max_tokens_limit:
            raise FieldError(name, f"{name} {limit} exceeds this server's limit of {config.max_tokens_limit}")
        if lm.max_context is not None and len(ids) + limit > lm.max_context:
            raise FieldError(name, f"the prompt ({len(ids)} tokens) + {name} ({limit}) exceed the model's context of "
                                   f"{lm.max_context} tokens")
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        given = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
        request = GenerationRequest(ids, method, options, limit, stops, sampling=Sampling(**given))
        run = lm.start(request, scope=scope)
        if req.trace:
            run.record_steps()
        return _Prepared(run, method, _shown(method, options), len(ids), stops, req.trace)

    def tenant(self, request: Request, req: Generation) -> str:
        """Whose request this is: the API key's tenant, else the ``user`` field, else anonymous."""
        return getattr(request.state, "tenant", None) or (f"user:{req.user}" if req.user else ANONYMOUS)

    async def start(self, request: Request, req: Generation, prompt: Any, shape: Shape
                    ) -> tuple[Job, _Prepared] | JSONResponse:
        assert self.metrics is not None
        label = req.method or self.config.method
        label = label if label in self.known else "unknown"  # bounded label values, whatever clients send
        scope: Hashable = None
        entered = False
        try:
            method, options = self.method_of(req)
            tenant = self.tenant(request, req)
            self.scheduler.check_tenant(tenant)  # 429 now, before any wait for the engine thread
            scope, options = self.scopes.enter(tenant, method, options)
            entered = True
            if not self.lm.is_built(method, scope=scope, **options):
                # built on the engine thread (torch ops; see the scheduler); nothing is measured on a request's path:
                # create_app loaded the whole calibration
                await asyncio.wrap_future(self.scheduler.call(lambda: self.lm.decoder(method, scope=scope, **options)))
            prepared = await run_in_threadpool(self.prepare, req, prompt, shape.chat, method, options, scope)
            seconds = self.config.max_request_seconds
            job = Job(prepared.run, asyncio.get_running_loop(), tenant,
                      None if seconds is None else time.perf_counter() + seconds,
                      on_end=functools.partial(self.scopes.leave, scope))
            self.scheduler.submit(job)  # from here on the job leaves its scope when it ends
            return job, prepared
        except StateFileError:  # the operator's fault, not the client's: the detail (a path) goes to the log only
            log.exception("a learned-state file could not be used (for tenant %r)", self.tenant(request, req))
            status, answer = 500, error(500, "the server's learned state for this request could not be loaded; its "
                                             "operator has the details in the server log", "server_error")
        except (TriedecError, TypeError, ValueError) as exc:  # bad input, named by the library
            status, answer = 400, error(400, str(exc), param=_param_of(exc, req))
        except LookupError as exc:
            status, answer = 404, error(404, str(exc), "not_found_error", "model")
        except TenantBusy as exc:
            status, answer = 429, error(429, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                                        headers={"Retry-After": str(exc.retry_after)})
        except QueueFull as exc:
            status, answer = 503, error(503, str(exc), "server_overloaded",
                                        headers={"Retry-After": str(self.scheduler.retry_after())})
        except Exception:  # a bug: answered 500 by the app's handler; the scope is left first
            if entered:
                self.scopes.leave(scope)
            raise
        if entered:
            self.scopes.leave(scope)
        self.metrics.requests.labels(shape.endpoint, label, str(status)).inc()
        return answer

    def extension(self, prepared: _Prepared, outcome: Outcome) -> dict[str, Any]:
        s = outcome.stats
        drafter = getattr(s, "drafter", None) or {}
        ext = {"method": prepared.method, "options": prepared.options,
               "tokens_per_step": getattr(s, "mean_accepted", None), "tokens_per_s": s.tokens_per_s,
               "steps": s.steps, "computed_tokens": s.computed_tokens, "seconds": s.seconds,
               "queued_seconds": s.queued_seconds, "seed": getattr(s, "seed", None), "stop_reason": s.stop_reason,
               "tokens_from_store": int(drafter.get(FROM_STORE, 0)), "learning": self.scopes.tenancy.learning,
               "exactness": s.exactness}
        if prepared.trace:  # the per-step stats the page checks its own counts against
            ext["accepted_by_origin"] = dict(getattr(s, "accepted_by_origin", {}) or {})
            ext["accepted_per_step"] = list(getattr(s, "accepted_per_step", []) or [])
            ext["new_tokens"] = s.new_tokens
        return ext

    @staticmethod
    def usage(prepared: _Prepared, outcome: Outcome) -> dict[str, int]:
        n = outcome.stats.new_tokens
        return {"prompt_tokens": prepared.prompt_tokens, "completion_tokens": n,
                "total_tokens": prepared.prompt_tokens + n}

    def failure(self, kind: str, value: Any, prepared: _Prepared, shape: Shape) -> JSONResponse:
        """The answer to a request that ended without output (``kind``: its final event)."""
        assert self.metrics is not None
        if kind == "timeout":
            status, answer = 408, error(408, f"the request produced no token within {self.config.max_request_seconds}"
                                             " s (this server's max_request_seconds)", code="timeout")
        elif kind == "cancelled":
            status, answer = 503, error(503, "the request was cancelled: the server is shutting down",
                                        "server_overloaded")
        else:
            status, answer = 500, error(500, f"generation failed: {type(value).__name__}", "server_error")
        self.metrics.requests.labels(shape.endpoint, prepared.method, str(status)).inc()
        return answer

    @staticmethod
    def finish_reason(outcome: Outcome) -> str:
        return "length" if outcome.stats.stop_reason in ("length", "time_limit") else "stop"

    async def next_event(self, request: Request, job: Job) -> tuple[str, Any] | None:
        """The job's next event, or None if the client left before it (the job is cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(job.next(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None

    async def complete(self, request: Request, job: Job, prepared: _Prepared, shape: Shape, make: Any) -> JSONResponse:
        assert self.metrics is not None
        text = TextStream(self.lm.tokenizer, prepared.stops)
        steps: list[dict[str, Any]] = []
        while True:
            event = await self.next_event(request, job)
            if event is None:
                return error(499, "client disconnected")
            kind, value = event
            if kind == "tokens":
                if prepared.trace:
                    steps += _traced(text, value, job.steps)
                else:
                    text.tokens += value  # the text is decoded once, at the end
            elif kind == "done":
                self.metrics.finished(shape.endpoint, prepared.method, value)
                ext = self.extension(prepared, value)
                if prepared.trace:
                    ext["trace"] = steps
                return JSONResponse(make(text.text, self.finish_reason(value), self.usage(prepared, value), ext))
            else:
                return self.failure(kind, value, prepared, shape)

    async def stream(self, job: Job, prepared: _Prepared, shape: Shape, chunk: Any, include_usage: bool,
                     first: tuple[str, Any]) -> AsyncIterator[str]:
        assert self.metrics is not None
        text = TextStream(self.lm.tokenizer, prepared.stops)
        try:
            yield _sse(chunk(None, None, first=True))
            kind, value = first
            while True:
                if kind == "tokens" and prepared.trace:  # one chunk per step, its text cut by token
                    for step in _traced(text, value, job.steps):
                        yield _sse(chunk("".join(step["text"]), None, ext={"trace": [step]}))
                elif kind == "tokens":
                    delta = text.add(value)
                    if delta:
                        yield _sse(chunk(delta, None))
                elif kind == "done":
                    self.metrics.finished(shape.endpoint, prepared.method, value)
                    tail = text.finish()
                    if tail:
                        yield _sse(chunk(tail, None))
                    ext = self.extension(prepared, value)
                    yield _sse(chunk(None, self.finish_reason(value), ext=ext))
                    if include_usage:
                        yield _sse(chunk(None, None, usage=self.usage(prepared, value), ext=ext))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    message = "cancelled: the server is shutting down" if kind == "cancelled" else "generation failed"
                    yield _sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
                    return
                kind, value = await job.next()
        finally:
            job.cancel()  # the client went away (or the stream ended): free the request at once

    async def respond(self, request: Request, req: Generation, prompt: Any, shape: Shape) -> Any:
        """Start the request, then answer in ``shape``: a stream of chunks or one response. A
        stream starts with the request's first event, so a request that never produced a token
        still gets a status of its own (408, 503)."""
        started = await self.start(request, req, prompt, shape)
        if isinstance(started, JSONResponse):
            return started
        job, prepared = started
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        model = self.config.model_name

        def envelope(kind: str) -> dict[str, Any]:
            return {"id": rid, "object": kind, "created": int(time.time()), "model": model}

        streaming = False
        try:
            if req.stream:
                event = await self.next_event(request, job)
                if event is None:
                    return error(499, "client disconnected")
                if event[0] not in ("tokens", "done"):
                    return self.failure(*event, prepared, shape)

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
                streaming = True  # the stream's own finally cancels the job
                return StreamingResponse(self.stream(job, prepared, shape, chunk, include, event),
                                         media_type="text/event-stream")

            def make(text: str, reason: str, use: dict[str, int], ext: dict[str, Any]) -> dict[str, Any]:
                return {**envelope(shape.object), "choices": [shape.choice(text, reason, streaming=False)],
                        "usage": use, "triedec": ext}

            return await self.complete(request, job, prepared, shape, make)
        finally:
            if not streaming:
                job.cancel()  # a no-op once the run is done


def _shown(method: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as a client may see them: learned-state file paths (the operator's) left out."""
    files = set(find_method(method).spec.state_files(options))
    return {k: v for k, v in options.items() if k not in files}


class FieldError(TriedecError):
    """Bad input in one request field, named as the client sent it (``param`` of the 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _param_of(exc: Exception, req: Generation) -> str | None:
    """The request field an error is about: a :class:`FieldError`'s, else the field the library's
    message starts with when the client sent it (``temperature must be >= 0 ...``), else None."""
    if isinstance(exc, FieldError):
        return exc.param
    first = str(exc).split(" ", 1)[0]
    return first if first in type(req).model_fields or first == "method_options" else None


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _traced(text: TextStream, tokens: list[int], steps: Sequence[StepTrace]) -> list[dict[str, Any]]:
    """``tokens`` added to ``text`` one at a time, as their steps' JSON records, each with
    ``text``: the text each token added (``""`` while a character or a possible stop string is
    incomplete; the final chunk carries what was held back). Steps that do not account for
    exactly ``tokens`` (never expected) are replaced by one record of unknown origin."""
    if [t for s in steps for t in s.tokens] != list(tokens):
        steps = [StepTrace(-1, tuple(tokens), ("unknown",) * len(tokens))]
    out = []
    for step in steps:
        record = step.as_json()
        record["text"] = [text.add([t]) for t in step.tokens]
        if "tree" in record:  # each node's own text, for pictures of the tree
            record["tree"]["texts"] = [text.tokenizer.decode([t]) for t in record["tree"]["tokens"]]
        out.append(record)
    return out


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
    Scopes(config.tenancy(), lm.forget).check(config.method, config.method_options)
    lm.limit_decoders(config.decoders)
    _check_state_locations(config)
    _calibrate_everything(lm)
    lm.decoder(config.method, **config.method_options)  # validate (and build) the default method now
    service = _Service(lm, config)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if service.sharing is not None:
            service.sharing.start()
        yield
        if service.sharing is not None:  # a last exchange while the engine still runs
            await run_in_threadpool(service.sharing.close)
        await run_in_threadpool(service.scheduler.close)

    # redirect_slashes off: a redirect would echo the client's Host header back as a URL to follow
    app = FastAPI(title="triedec", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible endpoints over triedec's lossless speculative decoding")
    app.state.scheduler, app.state.config, app.state.lm = service.scheduler, config, lm
    app.state.sharing = service.sharing
    for layer, options in _front_door_layers(config):  # each added one is outermost
        app.add_middleware(layer, **options)
    _errors(app)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, req: ChatRequest) -> Any:
        if not req.messages:
            return _warn_ignored(req, error(400, "messages must not be empty", param="messages"))
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return _warn_ignored(req, await service.respond(request, req, messages, CHAT_SHAPE))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request, req: CompletionRequest) -> Any:
        if not req.prompt:
            return _warn_ignored(req, error(400, "prompt must not be empty", param="prompt"))
        return _warn_ignored(req, await service.respond(request, req, req.prompt, COMPLETION_SHAPE))

    add_playground(app, config.api_keys is not None,
                   playground_info(config.model_name, config.method, _shown(config.method, config.method_options),
                                   config.max_tokens_limit, config.default_max_tokens, lm.adapter.exactness))

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
        return found

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        assert service.metrics is not None
        return PlainTextResponse(generate_latest(service.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app


def _calibrate_everything(lm: LM) -> None:
    """Load, or measure now, every part of the calibration that a method a request may name could
    need (the cost model and every registered profile: recycling's takes a minute or two on a new
    machine), so that no request ever waits on a measurement and the engine thread never stalls on
    one. Logged with its time."""
    needs = frozenset({NEEDS_COST, *profile_specs()})
    log.info("loading the calibration every method needs (%s); measured once per machine and model, then cached",
             ", ".join(sorted(needs)))
    started = time.perf_counter()
    lm.calibration(needs)
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


def _front_door_layers(config: ServerConfig) -> list[tuple[type, dict[str, Any]]]:
    """The server's front door as ASGI middleware classes with their options, innermost first:
    the body's size and time limits (413, 408) and the send timeout, then, outermost, the API key
    (401, before any body is read)."""
    return [(_Transport, {"limit": config.max_body_bytes, "body_seconds": config.body_seconds,
                          "send_seconds": config.send_seconds}),
            (RequireKey, {"keys": config.api_keys})]


def front_door(inner: Any, config: ServerConfig) -> Any:
    """The ASGI app ``inner`` behind the server's own front door, as :func:`create_app` puts its
    routes (:func:`_front_door_layers`). A gateway in front of replicas (:mod:`triedec.ray_app`)
    uses it."""
    for layer, options in _front_door_layers(config):
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
    # an idle kept-alive connection is closed after 5 s; a request head is bounded to 16 KiB (h11,
    # chosen explicitly); uvicorn has no timeout for a head that never ends (docs/serving.md: Security)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", http="h11",
                                           timeout_keep_alive=5, h11_max_incomplete_event_size=16 << 10,
                                           timeout_graceful_shutdown=int(config.drain_seconds)))
    access = logging.getLogger("uvicorn.access")  # configured by uvicorn.Config just above
    if not any(isinstance(f, MaskQueryStrings) for f in access.filters):
        access.addFilter(MaskQueryStrings())  # a key a client put in a URL never reaches the log
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
