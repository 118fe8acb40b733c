"""``triedec serve``: an OpenAI-compatible HTTP server over one loaded :class:`~triedec.api.lm.LM`.

A thin shell (FastAPI + uvicorn + prometheus_client) over the public API:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's request and response shapes,
  ``stream: true`` as server-sent events in OpenAI's chunk format; triedec's own choices
  (``method``, ``method_options``, ``top_k``, ``min_p``, ``repetition_penalty``) come in the extra
  body, and every response carries triedec's stats in the ``triedec`` extension field.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format: requests, tokens,
  speed, queue depth, and per step the requests and tokens each forward carried, the budget used,
  draft nodes verified, time queued).

**Batching.** Each request is one engine run (:meth:`LM.start`: its own KV cache, drafting session,
stop and acceptance rules). One scheduler thread (:mod:`triedec.server.scheduler`) owns the
engine's step loop: every step, one forward carries every running request's draft tree, sized
together under one verify budget (:mod:`triedec.core.allocate`), plus chunks of newly arrived prompts;
beam searches run beside it, in loops of their own. At most ``max_running`` requests run at once
(and ``max_kv_bytes`` of KV), ``max_queue`` more wait; past that a request gets 503. A request whose
client disconnects leaves the batch at the next step boundary (its session ends, its KV is freed).
Shared learned state (recycling's matrix, agreement rates, auto's store) is updated under the
drafters' own locks, and state files are written from snapshots when the batch goes idle, every
``persist_every`` finished requests and at shutdown. On SIGTERM uvicorn stops accepting, lets
in-flight requests finish for ``drain_seconds``, and the scheduler then cancels whatever is left
and writes the learned state.

**Security** (docs/serving.md: Security). With API keys (:mod:`~triedec.server.auth`) every request but
``/health`` carries ``Authorization: Bearer KEY`` (401 otherwise) and belongs to the key's tenant.
Learned state is kept per tenant, shared, or not at all (:mod:`~triedec.server.tenancy`); the
``triedec`` stats' ``tokens_from_store`` say how many accepted tokens auto's store drafted. Per tenant,
running and queued requests are capped (429 with ``Retry-After``); each request's time may be
capped (``max_request_seconds``), ``max_tokens`` is capped server-wide, a body must arrive within
``body_seconds`` and a client must take its response within ``send_seconds``. Clients cannot name
learned-state files. No request can raise memory or time past a stated bound: every option that
sizes memory or work has a maximum, built methods (option sets) live in an LRU bounded per tenant
and overall in count and learned-state bytes (``ServerConfig.decoders``), beam search reserves the
KV its trie can grow to, a request's time limit holds within one step, and the whole calibration is
loaded or measured before the server serves (nothing is measured on a request's path).

**Scaling out** (docs/scaling-out.md). With ``redis_url``, a thread of its own
(:mod:`~triedec.server.sharing`) exchanges what the drafters learned with every other process
naming the same Redis, per tenant (or per model under ``shared``), never on a request's path.
:mod:`triedec.ray.app` runs this app as Ray Serve replicas behind a gateway that uses the same
front door (:func:`~triedec.server.transport.front_door`).

Modules: :mod:`~triedec.server.app` (the routes, :class:`ServerConfig`, :func:`serve`),
:mod:`~triedec.server.auth`, :mod:`~triedec.server.tenancy`, :mod:`~triedec.server.sharing`,
:mod:`~triedec.server.scheduler`,
:mod:`~triedec.server.schemas` (request and response shapes), :mod:`~triedec.server.metrics`
(Prometheus).

**Errors** are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``) with a 4xx
status (``param`` naming the field as the client sent it): malformed JSON, wrong types, unknown
fields inside ``messages`` or ``stream_options`` (an unknown top-level field is ignored, as vLLM
does, and named in the ``X-Triedec-Warning`` header), unknown methods or options, bad numbers, an
empty prompt, a prompt + ``max_tokens`` beyond the context, unsupported OpenAI fields (named as
such), a request whose KV could never fit under ``max_kv_bytes``, a body over ``max_body_bytes``
(413), a missing or wrong API key or a key in the query string (401), two ``Authorization``
headers (400), text that is not valid Unicode (400), an option past its maximum (400), a body too
slow (408), a request with no token within
``max_request_seconds`` (408), an unknown model (404), a tenant over its share (429), a full queue
(503). A learned-state file the operator set up badly is a 500 with a generic message (the path and
the reason go to the server's log).
"""

from triedec.core.errors import require_extra

require_extra("server", "triedec.server")  # a clear error, not a ModuleNotFoundError from deep inside

from typing import TYPE_CHECKING, Any

_EXPORTS = {"create_app": "app", "serve": "app", "ApiKeys": "auth", "ServerConfig": "config", "Tenancy": "config",
            "TenantLimits": "config", "Job": "jobs", "QueueFull": "scheduler", "Scheduler": "scheduler",
            "TenantBusy": "scheduler"}
"""Each name this package exports -> its module: imported on first use (PEP 562), so that reading
the server's configuration (``triedec.server.config``: ``triedec serve --help``) does not import
the app, torch and the model code."""

__all__ = ["ApiKeys", "Job", "QueueFull", "Scheduler", "ServerConfig", "Tenancy", "TenantBusy", "TenantLimits",
           "TextStream", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    import importlib

    if name == "TextStream":
        from triedec.api.text import TextStream

        return TextStream
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from triedec.api.text import TextStream
    from triedec.server.app import create_app, serve
    from triedec.server.auth import ApiKeys
    from triedec.server.config import ServerConfig, Tenancy, TenantLimits
    from triedec.server.jobs import Job
    from triedec.server.scheduler import QueueFull, Scheduler, TenantBusy
