"""API keys: who may use the server, and which tenant each request belongs to.

Keys come from ``--api-key KEY`` (repeatable), ``--api-keys-file FILE`` (one key per line,
optionally followed by a space and a tenant name: ``key-abc alice``; blank lines and ``#`` comments
are skipped) or, when neither is given, the ``TRIEDEC_API_KEY`` environment variable (read by the
CLI, never by the library). A key without a name is a tenant of its own, named ``key-`` + the
first 12 hex digits of its SHA-256 (never the key itself).

With keys configured, every request except ``GET /health`` (and ``/metrics`` with
``public_metrics``) must carry ``Authorization: Bearer KEY``, as OpenAI's API, vLLM and llama.cpp's
server ask; a missing or wrong key gets 401 in OpenAI's error shape before the body is read. The
presented key is hashed and compared with every configured key's hash in constant time
(:func:`hmac.compare_digest`, no early exit), so the time to answer says nothing about how much of
a key was right. Keys are never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triedec.errors import TriedecError
from triedec.server.schemas import error

OPEN_PATHS = frozenset({"/health"})
"""paths anyone may read, keys or not"""


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
    _digests: tuple[tuple[bytes, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tenants:
            raise TriedecError("no API key given")
        for key, tenant in self.tenants.items():
            _valid_token("an API key", key)
            _valid_token("a tenant name", tenant)
        object.__setattr__(self, "_digests", tuple((_digest(k), t) for k, t in self.tenants.items()))

    def __repr__(self) -> str:  # never show the keys
        return f"ApiKeys({len(self.tenants)} keys, {len(set(self.tenants.values()))} tenants)"

    @classmethod
    def load(cls, keys: Sequence[str] = (), file: str | os.PathLike[str] | None = None,
             public_metrics: bool = False) -> ApiKeys | None:
        """The keys given directly (each its own tenant) and in ``file`` (module doc); None when
        there are none. A key listed twice with different tenants is refused."""
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
        return cls(tenants, public_metrics) if tenants else None

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

    def is_open(self, path: str) -> bool:
        return path in OPEN_PATHS or (self.public_metrics and path == "/metrics")


class RequireKey:
    """ASGI middleware: with ``keys``, a request to any path but the open ones gets 401 unless it
    carries a configured key; the key's tenant goes into the request's state (``tenant``) for the
    routes. Without keys, every request passes with no tenant."""

    def __init__(self, app: Any, keys: ApiKeys | None) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        keys = self.keys
        if keys is None or scope["type"] != "http" or keys.is_open(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
        tenant = keys.tenant(header)
        if tenant is None:
            message = ("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'." if header is None else
                       "Incorrect API key provided.")
            await error(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

