"""What the server's routes do with a generation request: validate it into an engine run (on a
worker thread; the method is built on the engine thread), submit it to the scheduler, and answer
in OpenAI's shapes, one response or server-sent events, with triedec's stats (see
:mod:`triedec.server`)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from triedec.api.generation import GenerationRequest
from triedec.api.lm import LM
from triedec.api.prompts import PromptTooLong
from triedec.api.text import TextStream, TokenOffsets
from triedec.api.tools import CallStream, ToolFormat, tool_format
from triedec.core.errors import StateFileError, TriedecError
from triedec.core.grammar import FORCED
from triedec.core.logprobs import Logprobs, TokenLogprob
from triedec.core.prefixtrie import PrefixTrie
from triedec.core.sampling import MAX_SEED, SAMPLING_FIELDS, Sampling
from triedec.core.trace import StepTrace
from triedec.drafters.base import FROM_STORE
from triedec.engine.batch import StepReport
from triedec.engine.methods import method as find_method
from triedec.engine.methods import methods
from triedec.engine.outcome import Outcome
from triedec.engine.request import Request as EngineRequest
from triedec.engine.runs import Run
from triedec.server.config import ServerConfig
from triedec.server.jobs import Job
from triedec.server.metrics import Metrics
from triedec.server.scheduler import QueueFull, Scheduler, TenantBusy
from triedec.server.schemas import (
    CHAT_SHAPE,
    COMPLETION_SHAPE,
    MAX_CHOICES,
    MAX_HYPOTHESES,
    MAX_LOGPROB_ENTRIES,
    ChatRequest,
    FieldError,
    Generation,
    Shape,
    error,
    vllm_prompt_logprobs,
)
from triedec.server.sharing import Sharing
from triedec.server.tenancy import ANONYMOUS, Scopes

log = logging.getLogger("triedec.server")


@dataclass
class _Prepared:
    """One run of a request (a choice, or a ``best_of`` candidate) and how to answer with it."""

    run: Run
    method: str
    options: dict[str, Any]
    """the options a client may see (state-file paths left out)"""
    prompt: tuple[int, ...]
    """its prompt's token ids"""
    index: int
    """which of the request's prompts it answers (completions take a list)"""
    stops: tuple[str, ...]
    trace: bool = False
    """the client asked for each step's record (``trace``)"""
    logprobs: int | None = None
    """the alternatives per token the client sees with each token's logprob (None: no logprobs)"""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs``: the alternatives per prompt token shown in its shape"""
    echo: bool = False
    """the response starts with the prompt (completions' ``echo``; with logprobs, its entries)"""
    score_only: bool = False
    """``echo`` with ``max_tokens`` 0: the prompt is scored, and the one token the engine
    generates (from the prefill's last row, no extra forward) is not returned"""
    limit: int = 0
    """the most tokens it may generate"""
    tools: ToolFormat | None = None
    """how the model writes calls, when the request lets it call tools (its reply is read back as
    text or calls)"""
    calls_required: bool = False
    """its reply must be calls (``tool_choice`` ``required`` or a named function)"""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def scores_prompt(self) -> bool:
        """the run scores its prompt (its first ``len(prompt) - 1`` logprobs are the prompt's)"""
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)


class Service:
    """What the routes do: validate a request into an engine run, submit it to the scheduler, and
    answer in OpenAI's shapes (one response, or server-sent events)."""

    def __init__(self, lm: LM, config: ServerConfig) -> None:
        self.lm, self.config = lm, config
        self.known = set(methods())
        self._tool_format: ToolFormat | str | None = None
        self.metrics: Metrics | None = None
        capacity = config.prefix_capacity()
        self.scheduler = Scheduler(lm, config.limits, config.max_queue, on_step=self._on_step,
                                   tenants=config.tenant_limits(), remeasure_after=config.remeasure_after or None,
                                   stall_seconds=config.stall_seconds,
                                   prefix=PrefixTrie(capacity) if capacity else None)
        self.prefix = self.scheduler.batch.prefix
        """the KV kept across requests (None: off, or the kernels are not bit-exact here)"""
        self.scopes = Scopes(config.tenancy(), lm.forget)
        self.metrics = Metrics(lambda: self.scheduler.depth, config.limits.max_tokens_per_forward)
        if self.prefix is not None:
            self.metrics.prefix(lambda: self.prefix.stats)  # type: ignore[union-attr]
        sharing = config.sharing()
        self.sharing = None if sharing is None else Sharing(lm, self.scheduler, sharing)
        if self.sharing is not None:
            self.metrics.sharing(self.sharing.status)

    def _on_step(self, carried: StepReport) -> None:
        if self.metrics is not None:
            self.metrics.step(carried, self.scheduler.batch.payoff)

    def method_of(self, req: Generation) -> tuple[str, dict[str, Any]]:
        """The request's method and options; refuses unsupported fields, unknown models and
        state-file options (files are the operator's to name, never a client's)."""
        config = self.config
        unsupported = req.unsupported()
        if unsupported:
            raise TriedecError(f"unsupported field(s): {', '.join(unsupported)} (triedec takes OpenAI's tools and "
                               "tool_choice, not the deprecated functions and function_call; it has no suffix)")
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

    def runs(self, req: Generation, prompts: int, method: str) -> tuple[int, int]:
        """``(n, runs per prompt)``, checked: the choices per prompt and the runs that make them
        (``best_of`` candidates; one for beam search, whose n best hypotheses are the choices),
        at most :data:`MAX_CHOICES` runs in all."""
        n, k = req.choices(), req.candidates()
        if find_method(method).spec.own_loop:
            if k > n:
                raise FieldError("best_of", "best_of is not supported with beam search (n returns its n best "
                                            "hypotheses)")
            if n > 1 and req.stream:
                raise FieldError("n", "n > 1 with beam search does not stream (the n best hypotheses are known "
                                      "only at the end)")
            k = 1
        if prompts * k > MAX_CHOICES:
            raise FieldError("prompt" if prompts > 1 else "n", f"{prompts} prompt(s) x {k} run(s) each exceed this "
                                                               f"server's cap of {MAX_CHOICES} runs per request")
        return n, k

    def prepare(self, req: Generation, prompts: Sequence[Any], chat: bool, method: str, options: dict[str, Any],
                scope: Hashable, runs: tuple[int, int], cache_scope: Hashable = None) -> list[_Prepared]:
        """Validate everything and make the request's runs, for each prompt one per choice (or
        per ``best_of`` candidate; ``runs``: :meth:`runs`'s ``(n, runs per prompt)``; in a worker
        thread; the method is already built, on the engine thread). Sampled, a prompt's choice i
        is seeded ``seed + i`` (a seed drawn once when the request has none); greedy, a prompt's
        choices are equal."""
        lm, config = self.lm, self.config
        given = {field: getattr(req, field) for field in SAMPLING_FIELDS if getattr(req, field) is not None}
        sampling = Sampling(**given)
        n, k = runs
        shown = req.asked_logprobs(chat)
        prompt_k = req.asked_prompt_logprobs()
        echo = bool(getattr(req, "echo", False))
        top = None if shown is None else shown.top
        scores_prompt = prompt_k is not None or (echo and shown is not None)
        logprobs = None
        if shown is not None or scores_prompt or k > n:  # best_of candidates are ranked by their logprobs
            logprobs = Logprobs(0 if top is None else top, req.logprobs_mode_asked(), prompt=scores_prompt,
                                prompt_top=max(top if echo and top is not None else 0, prompt_k or 0),
                                prompt_ranks=prompt_k is not None)
        seeds = [sampling.seed] * k
        if k > 1 and not sampling.greedy:
            base = secrets.randbits(63) if sampling.seed is None else sampling.seed
            seeds = [(base + i) % MAX_SEED for i in range(k)]
        asked = req.grammar()
        tools = req.asked_tools() if isinstance(req, ChatRequest) else None
        fmt, shown_tools = None, None
        if tools is not None:
            shown_tools = tools.as_template() if tools.calls else None
            if tools.calls:
                fmt = self.tool_format()
                content = None
                if asked is not None:  # the reply's content when it calls nothing: response_format's JSON only
                    if asked[0] != "response_format":
                        raise FieldError(asked[0], f"{asked[0]} with tools the model may call is not supported; "
                                                   "send response_format, tool_choice none, or no tools")
                    content = asked[1]
                    try:
                        lm.grammars.check(content)
                    except TriedecError as exc:
                        raise FieldError(asked[0], str(exc)) from None
                if req.stream and req.trace:
                    raise FieldError("trace", "a streamed trace with tools the model may call is not supported")
                try:
                    asked = ("tools", fmt.grammar(tools, content))
                except TriedecError as exc:  # the functions' schemas, together, past the grammar's size bound
                    raise FieldError("tools", str(exc)) from None
        grammar = None if asked is None else asked[1]
        if asked is not None:
            try:
                lm.grammars.check(grammar)  # compiled once (cached): an error names the field
            except TriedecError as exc:
                raise FieldError(asked[0], str(exc)) from None
        out = []
        most = None if lm.max_context is None else lm.max_context - 1  # room for a token to generate
        total_entries = 0
        for index, prompt in enumerate(prompts):
            try:
                ids = lm.encode(prompt, chat=chat, split_special=not config.special_tokens_in_text, tools=shown_tools,
                                most=most)
            except PromptTooLong as exc:  # found in bounded pieces: a long text is never tokenized whole
                raise FieldError("messages" if chat else "prompt",
                                 f"{exc}: it cannot fit the model's context of {lm.max_context} tokens with a token "
                                 "to generate") from None
            limit, score_only = self.limit(req, ids)
            if sampling.min_tokens > limit and not score_only:
                raise FieldError("min_tokens", f"min_tokens ({sampling.min_tokens}) exceeds the tokens this request "
                                               f"may generate ({limit})")
            entries = n * ((len(ids) - 1) * (1 + logprobs.prompt_alternatives) if scores_prompt and logprobs else 0)
            entries += n * (limit * (1 + top) if top is not None else 0)
            total_entries += entries
            if total_entries > MAX_LOGPROB_ENTRIES:
                field = "prompt_logprobs" if prompt_k is not None else "echo" if echo and scores_prompt else "logprobs"
                raise FieldError(field, f"the logprobs asked for come to {total_entries} entries (tokens x (1 + "
                                        f"alternatives), every choice and prompt), past this server's cap of "
                                        f"{MAX_LOGPROB_ENTRIES} (~{MAX_LOGPROB_ENTRIES * 100 // 10**6} MB of JSON)")
            for seed in seeds:
                request = GenerationRequest(ids, method, options, limit, req.stop, tuple(req.stop_token_ids or ()),
                                            sampling=dataclasses.replace(sampling, seed=seed), logprobs=logprobs,
                                            ignore_eos=req.ignore_eos, grammar=grammar)
                run = lm.start(request, scope=scope)
                if isinstance(run, EngineRequest):
                    run.cache_scope = cache_scope
                if req.trace:
                    run.record_steps()
                out.append(_Prepared(run, method, shown_options(method, options), tuple(ids), index, request.stop,
                                     req.trace, top, prompt_k, echo, score_only, limit, fmt,
                                     fmt is not None and tools is not None and tools.choice != "auto"))
        return out

    def tool_format(self) -> ToolFormat:
        """How the served model writes tool calls (its chat template's format; found once), or a
        :class:`FieldError` saying why it cannot be given tools."""
        if self._tool_format is None:
            try:
                self._tool_format = tool_format(self.lm.tokenizer)
            except TriedecError as exc:
                self._tool_format = str(exc)
        if isinstance(self._tool_format, str):
            raise FieldError("tools", self._tool_format)
        return self._tool_format

    def limit(self, req: Generation, ids: Sequence[int]) -> tuple[int, bool]:
        """The tokens to generate after the prompt ``ids`` (``max_tokens``, or as many as fit
        the context up to the server's default), checked, and whether the request only scores the
        prompt (``echo`` with ``max_tokens`` 0: one token is generated, from the prefill's last
        row, and not returned)."""
        lm, config = self.lm, self.config
        limit = getattr(req, "max_completion_tokens", None)
        name = "max_tokens" if limit is None else "max_completion_tokens"  # errors name the field the client sent
        limit = req.max_tokens if limit is None else limit
        score_only = bool(getattr(req, "echo", False)) and limit == 0 and not isinstance(limit, bool)
        if score_only:
            limit = 1  # the first token comes from the prefill's last row: it costs no forward
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
        return limit, score_only

    def check_size(self, req: Generation, prompt: Any, chat: bool) -> None:
        """Refuse a prompt surely too long for the context from its size alone, before anything is
        tokenized (:meth:`~triedec.api.prompts.Prompts.at_least_tokens`): such a refusal costs
        microseconds whatever the prompt's size, and allocates nothing that grows with it."""
        context = self.lm.max_context
        if context is None:
            return
        least = self.lm.prompts.at_least_tokens(prompt)
        if least + 1 > context:
            raise FieldError("messages" if chat else "prompt",
                             f"the prompt is at least {least} tokens long: it cannot fit the model's context of "
                             f"{context} tokens with a token to generate")
        limit = getattr(req, "max_completion_tokens", None)
        name = "max_tokens" if limit is None else "max_completion_tokens"  # as prepare() names it
        limit = req.max_tokens if limit is None else limit
        if isinstance(limit, int) and not isinstance(limit, bool) and least + limit > context:
            raise FieldError(name, f"the prompt (at least {least} tokens) + {name} ({limit}) exceed the model's "
                                   f"context of {context} tokens")

    def precheck(self, path: str, body: bytes) -> JSONResponse | None:
        """A generation request's body, looked at before FastAPI parses and validates it: a prompt
        surely too long for the context gets its 400 here, at the cost of one JSON parse (a 1 MiB
        refusal is then a few milliseconds of CPU). Anything else, malformed bodies included, goes
        on to the app, which answers it as usual."""
        chat = path == CHAT_SHAPE.path
        if not chat and path != COMPLETION_SHAPE.path:
            return None
        try:
            found = json.loads(body)
        except ValueError:
            return None
        if not isinstance(found, dict):
            return None
        prompt = found.get("messages") if chat else found.get("prompt")
        if chat and isinstance(prompt, list):
            prompts = [[m for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str)]]
        elif isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt  # several text prompts
        else:
            return None
        limits = {k: found.get(k) for k in ("max_tokens", *(("max_completion_tokens",) if chat else ()))}
        try:
            for each in prompts:
                self.check_size(_Limits(**limits), each or "", chat)
        except FieldError as exc:
            return error(400, str(exc), param=exc.param)
        return None

    def tenant(self, request: Request, req: Generation) -> str:
        """Whose request this is: the API key's tenant, else the ``user`` field, else anonymous."""
        return getattr(request.state, "tenant", None) or (f"user:{req.user}" if req.user else ANONYMOUS)

    @staticmethod
    def group(request: Request) -> str:
        """Whose share of the running slots a request counts in: the API key's tenant, else the
        client's address (``user`` is the client's to choose, so it cannot stand for a share)."""
        tenant = getattr(request.state, "tenant", None)
        if tenant:
            return tenant
        return f"peer:{request.client.host if request.client else ''}"

    async def start(self, request: Request, req: Generation, shape: Shape
                    ) -> tuple[list[Job], list[_Prepared]] | JSONResponse:
        """Validate the request and submit its jobs, one per run (a prompt's choices, or its
        ``best_of`` candidates); the answer to a request refused on the way."""
        assert self.metrics is not None
        label = req.method or self.config.method
        label = label if label in self.known else "unknown"  # bounded label values, whatever clients send
        scope: Hashable = None
        entered = False
        try:
            self.scheduler.check_room()  # 503 before any per-request work
            prompts = req.prompts()
            for prompt in prompts:
                self.check_size(req, prompt, shape.chat)  # 400 before anything is tokenized
            method, options = self.method_of(req)
            n, k = self.runs(req, len(prompts), method)
            if find_method(method).spec.own_loop:  # beam search: its n best hypotheses, its beams counted
                if n > 1:
                    options = self.beam_choices(method, options, n)
                self.check_hypotheses(method, options, len(prompts))
            tenant = self.tenant(request, req)
            self.scheduler.check_tenant(tenant, len(prompts) * k)  # 429 now, before any wait for the engine thread
            scope, options = self.scopes.enter(tenant, method, options)
            entered = True
            if not self.lm.is_built(method, scope=scope, **options):
                # built on the engine thread (torch ops; see the scheduler); nothing is measured on a request's path:
                # create_app loaded the whole calibration
                await asyncio.wrap_future(self.scheduler.call(lambda: self.lm.decoder(method, scope=scope, **options)))
            # the prefix trie's scope: the key's tenant with keys (one scope without), and the client's salt
            cache_scope = (tenant if self.config.api_keys is not None else None, req.cache_salt)
            prepared = await run_in_threadpool(self.prepare, req, prompts, shape.chat, method, options, scope,
                                               (n, k), cache_scope)
            seconds = self.config.max_request_seconds
            deadline = None if seconds is None else time.perf_counter() + seconds
            rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
            ended = _Countdown(len(prepared), functools.partial(self.scopes.leave, scope))  # the last leaves
            jobs = [Job(p.run, asyncio.get_running_loop(), tenant, deadline, on_end=ended,
                        request_id=rid if i == 0 else f"{rid}-{i}", group=self.group(request))
                    for i, p in enumerate(prepared)]
            submitted = 0
            try:
                for job in jobs:
                    self.scheduler.submit(job)  # from here on the job leaves its scope when it ends
                    submitted += 1
            except Exception:
                if submitted:  # the submitted choices end (cancelled) and the countdown leaves the scope
                    entered = False
                    for job in jobs[:submitted]:
                        job.cancel()
                    for _ in jobs[submitted:]:
                        ended()
                raise
            return jobs, prepared
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

    @staticmethod
    def check_hypotheses(method: str, options: dict[str, Any], prompts: int) -> None:
        """Refuse beam search over more than :data:`MAX_HYPOTHESES` hypotheses in all (prompts x
        ``num_beams``): each is a row of every step's forward."""
        beams = find_method(method).make_options(options).num_beams
        if prompts * beams > MAX_HYPOTHESES:
            raise FieldError("method_options" if prompts == 1 else "prompt",
                             f"{prompts} prompt(s) x num_beams {beams} = {prompts * beams} beam hypotheses exceed this "
                             f"server's cap of {MAX_HYPOTHESES} per request")

    @staticmethod
    def beam_choices(method: str, options: dict[str, Any], n: int) -> dict[str, Any]:
        """Beam search's options returning its ``n`` best hypotheses (``num_return_sequences``),
        checked against ``num_beams``."""
        asked = options.get("num_return_sequences")
        if asked is not None and asked != n:
            raise FieldError("n", f"n ({n}) and method_options.num_return_sequences ({asked}) disagree")
        beams = find_method(method).make_options(options).num_beams
        if n > beams:
            raise FieldError("n", f"n ({n}) cannot exceed num_beams ({beams}): beam search returns at most its beams")
        return {**options, "num_return_sequences": n}

    def extension(self, prepared: _Prepared, outcome: Outcome) -> dict[str, Any]:
        s = outcome.stats
        ext = {"method": prepared.method, "options": prepared.options,
               "tokens_per_step": s.mean_accepted, "tokens_per_s": s.tokens_per_s,
               "steps": s.steps, "computed_tokens": s.computed_tokens, "seconds": s.seconds,
               "queued_seconds": s.queued_seconds, "seed": s.seed, "stop_reason": s.stop_reason,
               "tokens_from_store": int(s.drafter.get(FROM_STORE, 0)), "learning": self.scopes.tenancy.learning,
               "exactness": s.exactness, "runner": s.runner, "prompt_tokens": s.prompt_tokens,
               "cached_tokens": s.cached_tokens}
        if s.error:  # it ended alone on an error of its own after some output (stop_reason "error")
            ext["error"] = s.error
        if s.grammar_seconds is not None:  # what the grammar cost and gave
            ext["grammar_seconds"] = s.grammar_seconds
            ext["forced_tokens"] = s.accepted_by_origin.get(FORCED, 0)
        if prepared.trace:  # the per-step stats the page checks its own counts against
            ext["accepted_by_origin"] = dict(s.accepted_by_origin)
            ext["accepted_per_step"] = list(s.accepted_per_step)
            ext["new_tokens"] = s.new_tokens
        return ext

    @staticmethod
    def usage(finished: Iterable[tuple[_Prepared, int]]) -> dict[str, int]:
        """A request's usage from its finished runs, each with the tokens it generated: every
        prompt counted once, every generated token counted (discarded ``best_of`` candidates'
        too; a prompt scoring's one token is not)."""
        prompts: dict[int, int] = {}
        cached: dict[int, int] = {}
        generated = 0
        for prepared, tokens in finished:
            prompts[prepared.index] = prepared.prompt_tokens
            if prepared.run.done:
                cached[prepared.index] = max(cached.get(prepared.index, 0), prepared.run.outcome.stats.cached_tokens)
            generated += 0 if prepared.score_only else tokens
        prompt_tokens = sum(prompts.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def failure(self, kind: str, value: Any, prepared: _Prepared, shape: Shape) -> JSONResponse:
        """The answer to a request that ended without output (``kind``: its final event)."""
        assert self.metrics is not None
        if kind == "timeout":
            status, answer = 408, error(408, f"the request produced no token within {self.config.max_request_seconds}"
                                             " s (this server's max_request_seconds)", code="timeout")
        elif kind == "cancelled":
            status, answer = 503, error(503, "the request was cancelled: the server is shutting down",
                                        "server_overloaded")
        elif isinstance(value, TriedecError):  # the request's own (its grammar admits no continuation, ...)
            status, answer = 400, error(400, f"generation failed: {value}", code="generation_failed")
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

    async def complete(self, request: Request, jobs: Sequence[Job], prepared: Sequence[_Prepared], shape: Shape,
                       n: int, make: Any) -> JSONResponse:
        """One response with every choice: for each prompt in order, its ``n`` choices (of
        ``best_of`` candidates the n with the highest sum of logprobs, best first; beam search's n
        best hypotheses), or the first failure among them. Usage counts each prompt once and every
        token generated, discarded candidates' too."""
        answers = await asyncio.gather(*(self.collect(request, job, p, shape, i == 0)
                                         for i, (job, p) in enumerate(zip(jobs, prepared, strict=True))))
        by_prompt: dict[int, list[_Choice]] = {}
        for p, answer in zip(prepared, answers, strict=True):
            if isinstance(answer, JSONResponse):
                return answer
            by_prompt.setdefault(p.index, []).extend(answer)
        chosen: list[_Choice] = []
        for index in sorted(by_prompt):
            candidates = by_prompt[index]
            if len(candidates) > n:  # best_of: the n most likely (a stable sort: ties keep their order)
                candidates = sorted(candidates, key=lambda c: -c.score)[:n]
            chosen += candidates
        use = self.usage((p, sum(c.tokens for c in answer)) for p, answer in zip(prepared, answers, strict=True))
        ext = dict(chosen[0].ext)
        if len(chosen) > 1:
            ext["choices"] = [c.ext for c in chosen]
        return JSONResponse(make(chosen, use, ext))

    def prompt_parts(self, prepared: _Prepared, entries: Sequence[TokenLogprob], shape: Shape
                     ) -> tuple[str, dict[str, Any] | None, list[Any] | None, TokenOffsets]:
        """What a choice shows of its prompt: the echoed text (or ``""``), the echoed prompt's
        logprobs in the endpoint's shape (its first token has none), vLLM's ``prompt_logprobs``,
        and the text offsets counted on from the prompt (``entries``: the prompt's scores)."""
        tokenizer, prompt = self.lm.tokenizer, list(prepared.prompt)
        offsets = TokenOffsets(tokenizer)
        text, shown, scored = "", None, None
        if prepared.echo:
            text = tokenizer.decode(prompt, skip_special_tokens=True)
            where = offsets.add(prompt)
            if prepared.logprobs is not None:
                shown = shape.logprobs([e.cut(prepared.logprobs) for e in entries], tokenizer, where, prompt[0])
        if prepared.prompt_logprobs is not None:
            scored = vllm_prompt_logprobs(entries, tokenizer, prepared.prompt_logprobs)
        return text, shown, scored, offsets

    async def collect(self, request: Request, job: Job, prepared: _Prepared, shape: Shape,
                      first: bool = True) -> list[_Choice] | JSONResponse:
        """One run's events to its choice (beam search's n best hypotheses: n choices): text,
        finish reason, tokens, extension and logprobs, or the answer to its failure (``first``:
        the request's first run, which counts the request)."""
        assert self.metrics is not None
        tokenizer = self.lm.tokenizer
        text = TextStream(tokenizer, prepared.stops)
        steps: list[dict[str, Any]] = []
        logprobs: list[TokenLogprob] = []
        while True:
            event = await self.next_event(request, job)
            if event is None:
                return error(499, "client disconnected")
            kind, value = event
            if kind == "tokens":
                logprobs += job.logprobs
                if prepared.trace:
                    steps += _traced(text, value, job.steps)
                else:
                    text.tokens += value  # the text is decoded once, at the end
            elif kind == "done":
                break
            else:
                return self.failure(kind, value, prepared, shape)
        outcome: Outcome = value
        self.metrics.finished(shape.endpoint, prepared.method, outcome, request=first)
        ext = self.extension(prepared, outcome)
        if prepared.trace:
            ext["trace"] = steps
        cut = prepared.prompt_tokens - 1 if prepared.scores_prompt else 0
        echoed, shown_prompt, scored, offsets = self.prompt_parts(prepared, logprobs[:cut], shape)
        body, reason, tokens = text.text, self.finish_reason(outcome), len(text.tokens)
        if prepared.score_only:
            body, reason, text.tokens, tokens = "", "length", [], 0
        own = logprobs[cut:][: len(text.tokens)]
        shown = None
        if prepared.logprobs is not None:
            shown = shape.logprobs(own, tokenizer, offsets.add(text.tokens))
            if shown_prompt is not None:
                shown = shape.joined(shown_prompt, shown)
        score = sum(e.logprob for e in own)
        calls: list[dict[str, Any]] | None = None
        if prepared.tools is not None:  # the reply, read back as text or calls
            stream = CallStream(prepared.tools, prepared.calls_required)
            stream.add(body)
            stream.finish()
            if stream.calls:
                calls = [c.as_openai() for c in stream.calls]
                reason = "tool_calls" if reason != "length" else reason
        content: str | None = echoed + body
        if prepared.tools is not None and stream.kind == "calls" and not calls:  # cut inside its first call
            content = None
        choices = [_Choice(content, reason, tokens, ext, shown, scored, score, calls)]
        for hypothesis in outcome.sequences[1:]:  # beam search's other hypotheses, best first
            ids = list(hypothesis.token_ids)
            done = "stop" if len(ids) < prepared.limit else "length"
            choices.append(_Choice(echoed + self.lm.decode_result(ids, prepared.stops), done, len(ids), ext, None,
                                   scored, hypothesis.score))
        return choices

    async def stream_choice(self, job: Job, prepared: _Prepared, shape: Shape, chunk: Any, index: int,
                            first: tuple[str, Any], ended: dict[int, tuple[_Prepared, int, dict[str, Any]]]
                            ) -> AsyncIterator[dict[str, Any]]:
        """One choice's chunks (``index``: its place in the response), from its first event on:
        the role chunk, the echoed prompt (with its logprobs, and vLLM's ``prompt_logprobs``),
        then its text as it comes (each token's logprobs in the chunk it arrived in; with
        ``trace``, one chunk per step), then its finish. Sets ``ended[index]`` to ``(prepared,
        tokens generated, extension)`` when it finishes; a failure raises :class:`_StreamFailed`."""
        assert self.metrics is not None
        tokenizer = self.lm.tokenizer
        text = TextStream(tokenizer, prepared.stops)
        yield chunk(None, None, index, first=True)
        kind, value = first  # "tokens" or "done": the prompt's part leads the first event's
        entries = job.logprobs if kind == "tokens" else []
        cut = prepared.prompt_tokens - 1 if prepared.scores_prompt else 0
        scores, entries = entries[:cut], entries[cut:]
        echoed, shown, scored, offsets = self.prompt_parts(prepared, scores, shape)
        if prepared.echo or scored is not None:
            yield chunk(echoed, None, index, logprobs=shown, prompt_logprobs=scored)
        calls = None if prepared.tools is None else CallStream(prepared.tools, prepared.calls_required)

        def split(delta: str, last: bool = False) -> tuple[str, list[dict[str, Any]] | None]:
            """``delta`` as the text to show and the calls it completed (a reply read back as text or
            calls when the request has tools)."""
            if calls is None:
                return delta, None
            given = len(calls.calls)
            shown_text, found = calls.finish() if last else calls.add(delta)
            return shown_text, [c.as_openai(index=given + i) for i, c in enumerate(found)] or None

        while True:
            if kind == "tokens" and prepared.score_only:
                pass  # the one token a prompt scoring generates is not returned
            elif kind == "tokens" and prepared.trace:  # one chunk per step, its text cut by token
                for step in _traced(text, value, job.steps):
                    shown = None
                    if prepared.logprobs is not None:
                        count = len(step["tokens"])
                        mine, entries = entries[:count], entries[count:]
                        shown = shape.logprobs(mine, tokenizer, offsets.add(step["tokens"]))
                    yield chunk("".join(step["text"]), None, index, ext={"trace": [step]}, logprobs=shown)
            elif kind == "tokens" and prepared.logprobs is not None:  # each token's logprobs in its chunk
                shown = shape.logprobs(entries, tokenizer, offsets.add(value))
                delta, found = split(text.add(value))
                yield chunk(delta, None, index, logprobs=shown)
                if found:
                    yield chunk(None, None, index, tool_calls=found)
            elif kind == "tokens":
                delta, found = split(text.add(value))
                if delta:
                    yield chunk(delta, None, index)
                if found:
                    yield chunk(None, None, index, tool_calls=found)
            elif kind == "done":
                self.metrics.finished(shape.endpoint, prepared.method, value, request=index == 0)
                tail, found = split(text.finish())
                if calls is not None:  # what the reply held back: text, or the call a cut reply was writing
                    more, cut = split("", last=True)
                    tail += more
                    found = [*(found or []), *(cut or [])] or None
                if tail and not prepared.score_only:
                    yield chunk(tail, None, index)
                if found:
                    yield chunk(None, None, index, tool_calls=found)
                ext = self.extension(prepared, value)
                ended[index] = (prepared, value.stats.new_tokens, ext)
                reason = "length" if prepared.score_only else self.finish_reason(value)
                if calls is not None and calls.calls and reason != "length":
                    reason = "tool_calls"
                yield chunk(None, reason, index, ext=ext)
                return
            else:
                raise _StreamFailed("cancelled: the server is shutting down" if kind == "cancelled"
                                    else "generation failed")
            kind, value = await job.next()
            entries = job.logprobs if kind == "tokens" else []

    async def stream(self, jobs: Sequence[Job], prepared: Sequence[_Prepared], shape: Shape, chunk: Any,
                     include_usage: bool, firsts: Sequence[tuple[str, Any]]) -> AsyncIterator[str]:
        """Every choice's chunks as server-sent events, as they come (each names its choice's
        ``index``), then the usage if asked, then ``[DONE]``; a failure ends the stream with an
        error event. The jobs are cancelled however the stream ends."""
        ended: dict[int, tuple[_Prepared, int, dict[str, Any]]] = {}
        try:
            parts = [self.stream_choice(job, p, shape, chunk, i, first, ended)
                     for i, (job, p, first) in enumerate(zip(jobs, prepared, firsts, strict=True))]
            async for payload in _merged(parts):
                yield _sse(payload)
            if include_usage:  # every choice has ended: the usage, with choice 0's extension
                usage = self.usage((p, tokens) for p, tokens, _ in ended.values())
                yield _sse(chunk(None, None, 0, usage=usage, ext=ended[0][2]))
            yield "data: [DONE]\n\n"
        except _StreamFailed as exc:
            yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
        finally:
            for job in jobs:
                job.cancel()  # the client went away (or the stream ended): free the requests at once

    async def respond(self, request: Request, req: Generation, shape: Shape) -> Any:
        """Start the request, then answer in ``shape``: a stream of chunks or one response. A
        stream starts with every run's first event, so a request that never produced a token
        still gets a status of its own (408, 503)."""
        started = await self.start(request, req, shape)
        if isinstance(started, JSONResponse):
            return started
        jobs, runs = started
        rid = jobs[0].id
        model = self.config.model_name

        def envelope(kind: str) -> dict[str, Any]:
            return {"id": rid, "object": kind, "created": int(time.time()), "model": model}

        streaming = False
        try:
            if req.stream:
                firsts = []
                for job, prepared in zip(jobs, runs, strict=True):
                    event = await self.next_event(request, job)
                    if event is None:
                        return error(499, "client disconnected")
                    if event[0] not in ("tokens", "done"):
                        return self.failure(*event, prepared, shape)
                    firsts.append(event)

                def chunk(delta: str | None, reason: str | None, index: int, first: bool = False,
                          usage: dict[str, int] | None = None, ext: dict[str, Any] | None = None,
                          logprobs: dict[str, Any] | None = None, prompt_logprobs: list[Any] | None = None,
                          tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
                    out = envelope(shape.chunk_object)
                    if usage is not None:
                        out["choices"], out["usage"] = [], usage
                    else:
                        out["choices"] = [shape.choice(delta, reason, streaming=True, first=first, logprobs=logprobs,
                                                       index=index, prompt_logprobs=prompt_logprobs,
                                                       tool_calls=tool_calls)]
                        if shape.chat and prompt_logprobs is not None:
                            out["prompt_logprobs"] = prompt_logprobs
                    if ext is not None:
                        out["triedec"] = ext
                    return out

                include = bool(req.stream_options and req.stream_options.include_usage)
                streaming = True  # the response cancels the jobs however it ends
                return _JobStream(jobs, self.stream(jobs, runs, shape, chunk, include, firsts),
                                  media_type="text/event-stream")

            def make(answers: Sequence[_Choice], use: dict[str, int], ext: dict[str, Any]) -> dict[str, Any]:
                out = {**envelope(shape.object),
                       "choices": [shape.choice(a.text, a.reason, streaming=False, logprobs=a.logprobs, index=i,
                                                prompt_logprobs=a.prompt_logprobs, tool_calls=a.tool_calls)
                                   for i, a in enumerate(answers)],
                       "usage": use, "triedec": ext}
                if shape.chat and answers[0].prompt_logprobs is not None:
                    out["prompt_logprobs"] = answers[0].prompt_logprobs
                return out

            return await self.complete(request, jobs, runs, shape, req.choices(), make)
        finally:
            if not streaming:
                for each in jobs:
                    each.cancel()  # a no-op once the run is done


@dataclass(frozen=True)
class _Choice:
    """One finished choice, ready for the response."""

    text: str | None
    """its text (None: a chat reply that is calls, cut before any completed)"""
    reason: str
    tokens: int
    """tokens generated for it (what usage counts)"""
    ext: dict[str, Any]
    logprobs: dict[str, Any] | None
    prompt_logprobs: list[Any] | None = None
    score: float = 0.0
    """what ranks ``best_of`` candidates: the sum of its tokens' logprobs (a hypothesis's score)"""
    tool_calls: list[dict[str, Any]] | None = None
    """the calls the reply made (OpenAI's ``tool_calls``), when it made any"""


class _StreamFailed(Exception):
    """A streamed choice ended without its output (its message goes in the stream's error event)."""


class _Countdown:
    """Calls ``then`` on its ``count``-th call (a request's scope is left when its last choice
    ends); called on the event loop only."""

    def __init__(self, count: int, then: Any) -> None:
        self.left, self.then = count, then

    def __call__(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.then()


async def _merged(parts: Sequence[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as each comes (one task per iterator, a small queue:
    a client that reads slowly holds the producers back, and their jobs keep their own bounded
    pending tokens). An iterator's exception ends the whole, after the items before it."""
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=16)

    async def pump(part: AsyncIterator[Any]) -> None:
        try:
            async for item in part:
                await queue.put(("item", item))
            await queue.put(("end", None))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put(("error", exc))

    tasks = [asyncio.create_task(pump(part)) for part in parts]
    try:
        left = len(tasks)
        while left:
            kind, item = await queue.get()
            if kind == "item":
                yield item
            elif kind == "end":
                left -= 1
            else:
                raise item
    finally:
        for task in tasks:
            task.cancel()


class _JobStream(StreamingResponse):
    """A stream of jobs' events that cancels the jobs however the response ends: finished, the
    client gone, or the transport's send timeout (a client that stopped reading), where the
    events' generator is left unclosed until it is collected."""

    def __init__(self, jobs: Sequence[Job], content: AsyncIterator[str], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.jobs = jobs

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel()


def shown_options(method: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as a client may see them: learned-state file paths (the operator's) left out."""
    files = set(find_method(method).spec.state_files(options))
    return {k: v for k, v in options.items() if k not in files}


@dataclass(frozen=True)
class _Limits:
    """A body's token limits as :meth:`Service.check_size` reads them from a request."""

    max_tokens: Any = None
    max_completion_tokens: Any = None


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
