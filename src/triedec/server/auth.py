"""API keys: who may use the server, and which tenant each request belongs to.

Keys come from ``--api-key KEY`` (repeatable), ``--api-keys-file FILE`` (one key per line,
optionally followed by a space and a tenant name: ``key-abc alice``; blank lines and ``#`` comments
are skipped) or, when neither is given, the ``TRIEDEC_API_KEY`` environment variable (read by the
CLI, never by the library). A key without a name is a tenant of its own, named ``key-`` + the
first 12 hex digits of its SHA-256 (never the key itself).

With keys configured, every request except ``GET /health``, the playground's page and files
(:data:`~triedec.server.playground.PAGE_PATHS`) and ``/metrics`` with ``public_metrics`` must carry
``Authorization: Bearer KEY``, as OpenAI's API, vLLM and llama.cpp's server ask; a missing or wrong
key gets 401 in OpenAI's error shape before the body is read. The presented key is hashed and
compared with every configured key's hash in constant time (:func:`hmac.compare_digest`, no early
exit), so the time to answer says nothing about how much of a key was right. Keys are never logged
or echoed: a key sent in the URL's query string instead (``?api_key=...``) gets 401 on every path,
the open ones included, and ``triedec serve``'s access log masks every query string value
(:class:`MaskQueryStrings`). ``/metrics`` (server-wide counters) is the operator's: with a
``metrics_key`` only that key reads it (a tenant's key gets 401); without one, any configured key
does (and anyone with ``public_metrics``). Two
``Authorization`` headers get 400 (a proxy that checks the first and a server that uses the last
would disagree)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

from triedec.core.errors import TriedecError
from triedec.server.playground import PAGE_PATHS
from triedec.server.schemas import error

OPEN_PATHS = frozenset({"/health", *PAGE_PATHS})
"""paths anyone may read, keys or not: the health probe, and the playground's page and files (no
data: every API call the page makes carries a key)"""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def anonymous_tenant(key: str) -> str:
    """The tenant name of a key listed without one: derived from its hash, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _valid_token(what: str, value: str) -> None:
    if not value or any(c.isspace() for c in value) or not value.isprintable() or not value.isascii():
        raise TriedecError(f"{what} must be non-empty printable ASCII without spaces")


@dataclass(frozen=True)
class ApiKeys:
    """The configured keys, each with its tenant (``tenants``: key -> tenant name), and whether
    ``/metrics`` stays public. Validated on construction; at least one key."""

    tenants: Mapping[str, str]
    public_metrics: bool = False
    metrics_key: str | None = field(default=None, repr=False)
    """the operator's key for ``/metrics``: with it, no tenant's key reads the server-wide counters"""
    _digests: tuple[tuple[bytes, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tenants:
            raise TriedecError("no API key given")
        for key, tenant in self.tenants.items():
            _valid_token("an API key", key)
            _valid_token("a tenant name", tenant)
        if self.metrics_key is not None:
            _valid_token("the metrics key", self.metrics_key)
            if self.metrics_key in self.tenants:
                raise TriedecError("the metrics key must not also be a tenant's API key")
        object.__setattr__(self, "_digests", tuple((_digest(k), t) for k, t in self.tenants.items()))

    def __repr__(self) -> str:  # never show the keys
        return f"ApiKeys({len(self.tenants)} keys, {len(set(self.tenants.values()))} tenants)"

    @classmethod
    def load(cls, keys: Sequence[str] = (), file: str | os.PathLike[str] | None = None,
             public_metrics: bool = False, metrics_key: str | None = None) -> ApiKeys | None:
        """The keys given directly (each its own tenant) and in ``file`` (module doc); None when
        there are none (a ``metrics_key`` alone is refused: it guards nothing without keys). A key
        listed twice with different tenants is refused."""
        tenants: dict[str, str] = {}

        def add(key: str, tenant: str, where: str) -> None:
            if tenants.get(key, tenant) != tenant:
                raise TriedecError(f"{where}: a key is listed twice, for two tenants")
            tenants[key] = tenant

        for key in keys:  # validated with the rest on construction
            add(key, anonymous_tenant(key), "--api-key")
        if file is not None:
            try:
                text = Path(file).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise TriedecError(f"cannot read the API keys file {file}: {exc}") from exc
            for number, line in enumerate(text.splitlines(), 1):
                words = line.split("#", 1)[0].split()
                if not words:
                    continue
                if len(words) > 2:
                    raise TriedecError(f"{file} line {number}: expected 'KEY' or 'KEY TENANT'")
                _valid_token(f"{file} line {number}: the key", words[0])
                add(words[0], words[1] if len(words) == 2 else anonymous_tenant(words[0]), f"{file} line {number}")
            if not tenants:
                raise TriedecError(f"the API keys file {file} lists no key")
        if not tenants and metrics_key is not None:
            raise TriedecError("a metrics key needs API keys: without keys every path is open")
        return cls(tenants, public_metrics, metrics_key) if tenants else None

    def tenant(self, authorization: bytes | str | None) -> str | None:
        """The tenant of the key in an ``Authorization: Bearer KEY`` header value; None when it is
        missing, malformed or wrong. Every configured key is compared, in constant time each."""
        if isinstance(authorization, bytes):
            try:
                authorization = authorization.decode("ascii")
            except UnicodeDecodeError:
                return None
        if not authorization:
            return None
        scheme, _, presented = authorization.strip().partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            return None
        digest, found = _digest(presented), None
        for known, tenant in self._digests:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def is_operator(self, authorization: bytes | str | None) -> bool:
        """Whether the header carries the metrics key (compared in constant time)."""
        if self.metrics_key is None:
            return False
        if isinstance(authorization, bytes):
            authorization = authorization.decode("ascii", "replace")
        scheme, _, presented = (authorization or "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(presented.strip()),
                                                                  _digest(self.metrics_key))

    def is_open(self, path: str) -> bool:
        return path in OPEN_PATHS or (self.public_metrics and path == "/metrics")


KEY_PARAMETERS = frozenset({"api_key", "api-key", "apikey", "key", "access_token", "token", "auth", "authorization",
                            "bearer"})
"""query parameter names that clients use to pass keys in URLs: refused (401) with keys configured"""


def _key_in_query(query: bytes) -> bool:
    names = (part.split(b"=", 1)[0] for part in query.split(b"&"))
    return any(unquote_to_bytes(n).decode("latin-1").strip().lower() in KEY_PARAMETERS for n in names if n)


def mask_query(target: str) -> str:
    """A request target with its query string's values masked (``/v1/models?api_key=<masked>``): what
    the access log shows, so a key a client put in a URL is never written to a log."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    masked = "&".join(part.split("=", 1)[0] + ("=<masked>" if "=" in part else "") for part in query.split("&"))
    return f"{path}?{masked}"


class MaskQueryStrings(logging.Filter):
    """A filter for uvicorn's access logger (``uvicorn.access``): every query string value masked
    (:func:`mask_query`). ``triedec serve`` installs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], mask_query(args[2]), *args[3:])
        return True


class RequireKey:
    """ASGI middleware: with ``keys``, a request to any path but the open ones gets 401 unless it
    carries a configured key; the key's tenant goes into the request's state (``tenant``) for the
    routes. Without keys, every request passes with no tenant."""

    def __init__(self, app: Any, keys: ApiKeys | None) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        keys = self.keys
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [value for name, value in scope.get("headers") or [] if name.lower() == b"authorization"]
        if len(headers) > 1:  # a proxy that checks the first and a server that uses the last would disagree
            await error(400, "more than one Authorization header; send exactly one", param="Authorization")(
                scope, receive, send)
            return
        if keys is None:
            await self.app(scope, receive, send)
            return
        if _key_in_query(scope.get("query_string") or b""):  # on every path, the open ones too
            await error(401, "API keys are not accepted in the URL (URLs end up in logs and histories): send it as "
                             "'Authorization: Bearer KEY', and treat a key sent in a URL as exposed",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        path = scope.get("path", "")
        if keys.is_open(path):
            await self.app(scope, receive, send)
            return
        header = headers[0] if headers else None
        if path == "/metrics" and keys.metrics_key is not None:  # the operator's only
            if keys.is_operator(header):
                await self.app(scope, receive, send)
            else:
                await error(401, "/metrics needs this server's metrics key", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        tenant = keys.tenant(header)
        if tenant is None:
            message = ("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'." if header is None else
                       "Incorrect API key provided.")
            await error(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

