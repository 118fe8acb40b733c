"""The methods an :class:`~triedec.api.lm.LM` keeps built: a least-recently-used cache bounded in count
and in learned-state bytes, per scope and overall.

An LM builds each method once per (scope, method, options) and keeps it, so that learned state
(the recycling matrix, auto's store, acceptance rates) stays warm across requests. Kept without a
bound, every new option set a client names would add a decoder for good: auto with ``k=1003``
holds a 385 MB matrix on a 49k-token vocabulary. :class:`BuiltMethods` bounds that:

* **count**: at most ``per_scope`` built methods per scope (a server's tenant) and ``total``
  overall;
* **bytes**: each built method declares the most learned state it can ever hold
  (:meth:`~triedec.engine.methods.Decoder.max_learned_bytes`, from its options' bounds: a recycling
  matrix is ``vocab x k`` ids, auto's store at most ``store_capacity`` tokens), and the sum is kept
  under ``scope_bytes`` per scope and ``total_bytes`` overall.

Past a bound, the least recently used other methods are dropped (their learned state with them;
state files were written by the engine as requests finished, and a dropped method is built again,
from its file, when it is next used). A single method whose bound alone exceeds a cap is refused
with a :class:`~triedec.core.errors.TriedecError` naming the cap. A request that is running keeps its
method alive until it ends, whatever the cache drops. Thread-safe: one lock guards the cache,
and a method is built under it, so two threads asking for the same one build it once.

It is also where an LM's **learned-state exchange** lives (:meth:`BuiltMethods.export_learned`,
:meth:`BuiltMethods.absorb_learned`): what each built method learned, named by scope, method and
:func:`options_id`, so that replicas can trade it (:mod:`triedec.server.sharing`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triedec.core.errors import TriedecError, positive_int
from triedec.core.settings import MIB, setting

if TYPE_CHECKING:  # the CLI reads DecoderLimits for its flags without importing torch
    from triedec.drafters.learned import Learned

log = logging.getLogger("triedec")

Key = tuple[Hashable, str, Any]
"""(scope, method name, options value)"""


@dataclass(frozen=True)
class DecoderLimits:
    """Bounds on the methods an LM keeps built (module doc). None for a byte cap: no cap."""

    per_scope: int = setting(8, flag="--max-methods-per-tenant",
                             help="option sets (built methods, each with its learned state) kept per tenant; past it "
                                  "the least recently used is dropped")
    """built methods (option sets) kept per scope: a server's tenant"""
    total: int = setting(64, flag="--max-methods", help="option sets kept in all")
    """built methods kept overall"""
    scope_bytes: int | None = setting(1 << 30, flag="--max-learned-mib-per-tenant", scale=MIB, unit="MiB",
                                      none="no cap",
                                      help="learned state one tenant's methods may hold, MiB, by each method's bound "
                                           "(recycling matrix: vocab x k ids; auto's store: store_capacity); past it "
                                           "the least recently used is dropped, and one method over it alone gets 400")
    """the most learned state (by its declared bound) the methods of one scope may hold"""
    total_bytes: int | None = setting(4 << 30, flag="--max-learned-mib", scale=MIB, unit="MiB", none="no cap",
                                      help="learned state all methods may hold, MiB")
    """the most learned state (by its declared bound) all built methods together may hold"""

    def __post_init__(self) -> None:
        positive_int("per_scope", self.per_scope)
        positive_int("total", self.total)
        for name in ("scope_bytes", "total_bytes"):
            value = getattr(self, name)
            if value is not None:
                positive_int(name, value)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def options_id(options: Any) -> str:
    """A method's options as a short stable id, equal across processes for equal values; options
    that name a learned-state file are left out (each replica has its own files)."""
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
              if not f.metadata.get("state_file")}
    text = json.dumps(values, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class BuiltMethods:
    """Built decoders by :data:`Key`, least recently used first, within :class:`DecoderLimits`
    (module doc)."""

    def __init__(self, limits: DecoderLimits | None = None) -> None:
        self.limits = limits or DecoderLimits()
        self._items: OrderedDict[Key, tuple[Any, int]] = OrderedDict()  # key -> (decoder, its byte bound)
        self._lock = threading.RLock()

    def get_or_build(self, key: Key, build: Callable[[], Any]) -> Any:
        """The decoder kept for ``key`` (now the most recently used), else ``build()``'s, kept
        within the bounds (a method over a byte cap alone raises)."""
        with self._lock:
            found = self.get(key)
            if found is None:
                found = build()
                self.put(key, found, found.max_learned_bytes())
            return found

    def set_limits(self, limits: DecoderLimits) -> None:
        """Bound the methods built from now on by ``limits`` (applied at the next build)."""
        with self._lock:
            self.limits = limits

    def get(self, key: Key) -> Any | None:
        """The decoder built for ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._items.get(key)
            if found is None:
                return None
            self._items.move_to_end(key)
            return found[0]

    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self._items
    def check(self, key: Key, nbytes: int) -> None:
        """Refuse a method whose learned-state bound alone exceeds a byte cap."""
        limits = self.limits
        for cap, where in ((limits.scope_bytes, "per scope (tenant)"), (limits.total_bytes, "in all")):
            if cap is not None and nbytes > cap:
                raise TriedecError(f"method {key[1]!r} with these options may hold {_mib(nbytes)} of learned state, "
                                   f"more than the {_mib(cap)} this process keeps {where}; use smaller options "
                                   "(k, store_capacity)")

    def put(self, key: Key, decoder: Any, nbytes: int) -> None:
        """Keep ``decoder`` for ``key`` (its learned state bounded by ``nbytes``), then drop the
        least recently used others until every bound holds."""
        self.check(key, nbytes)
        with self._lock:
            self._items[key] = (decoder, nbytes)
            self._items.move_to_end(key)
            limits = self.limits
            scope = key[0]
            self._evict(lambda k: k[0] == scope, limits.per_scope, limits.scope_bytes, key)
            self._evict(lambda k: True, limits.total, limits.total_bytes, key)

    def _evict(self, within: Any, count: int, nbytes: int | None, keep: Key) -> None:
        chosen = [k for k in self._items if within(k)]
        kept, used = len(chosen), sum(self._items[k][1] for k in chosen)
        for victim in chosen:  # least recently used first
            if kept <= count and (nbytes is None or used <= nbytes):
                return
            if victim == keep:
                continue
            used -= self._items.pop(victim)[1]
            kept -= 1
            log.info("dropped the built method %r of an idle option set (least recently used; the LM keeps %d per "
                     "scope, %d in all, within its learned-state caps)", victim[1], self.limits.per_scope,
                     self.limits.total)

    def forget(self, scope: Hashable) -> int:
        """Drop every method of ``scope``; returns how many."""
        with self._lock:
            dropped = [k for k in self._items if k[0] == scope]
            for k in dropped:
                del self._items[k]
            return len(dropped)

    def items(self) -> Iterator[tuple[Key, Any]]:
        """(key, decoder), least recently used first (a snapshot)."""
        with self._lock:
            return iter([(k, v[0]) for k, v in self._items.items()])

    def __iter__(self) -> Iterator[Key]:
        """The keys, least recently used first (a snapshot)."""
        with self._lock:
            return iter(list(self._items))

    def export_learned(self) -> list[tuple[Hashable, str, str, Learned]]:
        """What every built method learned since the last call, as (scope, method name,
        :func:`options_id`, learned), empty values included. Call it on the thread that runs the
        engine (it may run torch ops)."""
        return [(scope, name, options_id(opts), decoder.export_learned())
                for (scope, name, opts), decoder in self.items()]

    def absorb_learned(self, scope: Hashable, method_name: str, options: str, learned: Learned) -> int:
        """Merge ``learned`` into the methods built for ``scope`` named ``method_name`` whose
        :func:`options_id` is ``options``; returns how many took it."""
        matching = [decoder for (sc, name, opts), decoder in self.items()
                    if sc == scope and name == method_name and options_id(opts) == options]
        for decoder in matching:
            decoder.absorb_learned(learned)
        return len(matching)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def learned_bytes(self) -> int:
        """The sum of the kept methods' learned-state bounds."""
        with self._lock:
            return sum(v[1] for v in self._items.values())
