"""The playground: a page at ``GET /`` that chats through the server's own API and colours each
token by where it came from.

The page is ``index.html`` and the files of :data:`FILES` in ``triedec/server/page/`` (no build step, no CDN, works
offline). It talks to ``/v1/chat/completions`` like any client, streaming, with ``"trace": true``
so that each chunk carries its step's record (:mod:`triedec.core.trace`), and to ``GET
/triedec/info`` for the methods and their options. The page and its files need no key; with keys
configured, every API call does: the page asks for one and keeps it in ``sessionStorage`` only,
sending it as ``Authorization: Bearer`` (never in a URL).

Safe by construction: every file is served with a strict Content-Security-Policy
(:data:`CSP`: scripts and styles from this origin only, no inline script, no inline style
attribute, no framing, no forms posting elsewhere), and the page inserts model and user text as
text nodes, never as HTML. See ``docs/playground.md``.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from triedec.core.trace import MODEL
from triedec.drafters.base import SOURCES, UNNAMED
from triedec.engine.methods import methods
from triedec.server.schemas import error

FILES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8",
         "icon.svg": "image/svg+xml"}
"""The page's files, served under ``/playground/`` (nothing else is)."""

PAGE_PATHS = frozenset({"/", *(f"/playground/{name}" for name in FILES)})
"""Paths anyone may read, keys or not: the page and its files (they hold no data)."""

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
"""The Content-Security-Policy of the page and its files."""

HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}

ORIGINS = {MODEL: "chosen by the model's own forward (nothing drafted it, or no draft matched)",
           **SOURCES, UNNAMED: "a draft from a plug-in drafter that names no source"}
"""Every origin a token can report, with what it means (the page's legend)."""


def _read(name: str) -> bytes:
    return resources.files("triedec.server").joinpath("page", name).read_bytes()


def info(model_name: str, default_method: str, default_options: dict[str, Any], max_tokens_limit: int,
         default_max_tokens: int, exactness: str) -> dict[str, Any]:
    """What ``GET /triedec/info`` answers: the model, the defaults, every method with its options
    (as ``triedec methods`` lists them) and every origin with its meaning."""
    return {"model": model_name, "method": default_method, "method_options": default_options,
            "max_tokens_limit": max_tokens_limit, "default_max_tokens": default_max_tokens,
            "exactness": exactness, "origins": ORIGINS,
            "methods": [{"name": name, "description": m.description, "equals": m.equals,
                         "options": m.spec.describe()} for name, m in methods().items()]}


def add_routes(app: FastAPI, keys: bool, about: dict[str, Any]) -> None:
    """``GET /`` (the page; ``keys``: whether it must ask for an API key before any call),
    ``GET /playground/{file}`` and ``GET /triedec/info`` (``about``)."""
    html = _read("index.html").replace(b'content="KEYS"', b'content="required"' if keys else b'content="none"')
    files = {name: _read(name) for name in FILES}  # read once: the package's files do not change

    @app.head("/", include_in_schema=False)  # probes that use HEAD get 200 too (uvicorn sends no body)
    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return Response(html, media_type="text/html; charset=utf-8", headers=HEADERS)

    @app.get("/playground/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in FILES:
            return error(404, f"no playground file {name!r}", "not_found_error")
        return Response(files[name], media_type=FILES[name], headers=HEADERS)

    @app.get("/triedec/info")
    async def triedec_info() -> dict[str, Any]:
        return about
