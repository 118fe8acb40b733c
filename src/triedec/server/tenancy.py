"""Whose learned state a request drafts from and teaches: ``--learning shared|tenant|off``.

A method's learned state (auto's store of earlier outputs, the recycling matrix, the acceptance
rates) lives on its drafter, and the :class:`~triedec.api.lm.LM` builds one drafter per method,
options and *scope* (:meth:`~triedec.api.lm.LM.decoder`). This module picks the scope of a request:

* ``shared``: one scope for everyone (None): every request drafts from every earlier one;
* ``tenant``: one scope per tenant (the API key's tenant, else the request's ``user`` field, else
  the anonymous tenant): a request drafts only from its own tenant's earlier requests. State files
  are kept per tenant: an option naming ``/dir/store.safetensors`` becomes
  ``/dir/store.safetensors.tenants/<tenant hash>.safetensors`` (directory 0700, files 0600). At
  most ``max_tenants`` tenants are kept in memory: the least recently used idle one is dropped
  (its files were written by the engine; it is loaded again on its next request);
* ``off``: a scope per request, dropped when it ends: nothing learned crosses requests (as the
  benchmark's ``cold`` protocol); state files are refused.

The calibration (the device's cost curve and the methods' profiles) is a property of the device,
not of anyone's text, and is shared by every scope. Used from the event loop's thread only (not
thread-safe by itself).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path

from triedec.core.errors import TriedecError
from triedec.engine.methods import method as find_method
from triedec.server.config import Tenancy

ANONYMOUS = "anonymous"
"""the tenant of a request with neither an API key nor a ``user`` field"""


def tenant_file(path: str, tenant: str) -> str:
    """Where ``tenant``'s copy of the state file ``path`` lives: a file named by the tenant's
    hash (tenant names are client-chosen text, never a path) in a directory beside ``path``."""
    return str(Path(f"{path}.tenants") / f"{_digest(tenant)}{Path(path).suffix or '.safetensors'}")


def _digest(tenant: str) -> str:
    """A tenant's name as it appears outside the process (file and stream names)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:24]


def scope_name(scope: Hashable) -> str | None:
    """The name of a scope that outlives requests, as other replicas know it: ``shared`` (the one
    scope of ``shared`` learning) or ``tenant-<hash of the tenant>``; None for a request's own scope
    (``off``), which nothing outside it learns from."""
    if scope is None:
        return "shared"
    if isinstance(scope, tuple) and len(scope) == 2 and scope[0] == "tenant":
        return "tenant-" + _digest(str(scope[1]))
    return None


class Scopes:
    """Hands each request its scope and its options (state files rewritten per tenant), and
    forgets scopes: a request's own at its end (``off``), idle tenants past ``max_tenants``."""

    def __init__(self, tenancy: Tenancy, forget: Callable[[Hashable], object]) -> None:
        self.tenancy = tenancy
        self._forget = forget
        self._tenants: OrderedDict[str, int] = OrderedDict()  # tenant -> requests in flight, least recent first
        self._ids = itertools.count()

    def check(self, method: str, options: Mapping[str, object]) -> None:
        """Refuse state-file options under ``off`` (nothing learned is kept)."""
        if self.tenancy.learning == "off" and find_method(method).spec.state_files(options):
            raise TriedecError("--learning off keeps no learned state: drop the state-file options")

    def enter(self, tenant: str | None, method: str, options: Mapping[str, object]
              ) -> tuple[Hashable, dict[str, object]]:
        """The scope and options of a request of ``tenant`` (None: anonymous) that starts now."""
        learning = self.tenancy.learning
        options = dict(options)
        if learning == "shared":
            return None, options
        if learning == "off":
            return ("request", next(self._ids)), options
        tenant = tenant or ANONYMOUS
        self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
        self._tenants.move_to_end(tenant)
        for name in find_method(method).spec.state_files(options):
            options[name] = tenant_file(str(options[name]), tenant)
        self._evict()
        return ("tenant", tenant), options

    def leave(self, scope: Hashable) -> None:
        """The request of ``scope`` ended (or never started)."""
        if not isinstance(scope, tuple):
            return
        kind, name = scope
        if kind == "request":
            self._forget(scope)
        elif name in self._tenants:
            self._tenants[name] -= 1
            self._evict()

    def _evict(self) -> None:
        over = len(self._tenants) - self.tenancy.max_tenants
        for tenant in [t for t, flying in self._tenants.items() if not flying][:max(0, over)]:
            del self._tenants[tenant]
            self._forget(("tenant", tenant))

    @property
    def tenants(self) -> int:
        """Tenants whose learned state is held in memory."""
        return len(self._tenants)
