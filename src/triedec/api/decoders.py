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
method alive until it ends, whatever the cache drops. Not thread-safe by itself: the LM locks
around it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from triedec.core.errors import TriedecError, positive_int
from triedec.core.settings import MIB, setting

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


class BuiltMethods:
    """Built decoders by :data:`Key`, least recently used first, within :class:`DecoderLimits`."""

    def __init__(self, limits: DecoderLimits | None = None) -> None:
        self.limits = limits or DecoderLimits()
        self._items: OrderedDict[Key, tuple[Any, int]] = OrderedDict()  # key -> (decoder, its byte bound)

    def get(self, key: Key) -> Any | None:
        """The decoder built for ``key`` (now the most recently used), or None."""
        found = self._items.get(key)
        if found is None:
            return None
        self._items.move_to_end(key)
        return found[0]

    def __contains__(self, key: Key) -> bool:
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
        dropped = [k for k in self._items if k[0] == scope]
        for k in dropped:
            del self._items[k]
        return len(dropped)

    def items(self) -> Iterator[tuple[Key, Any]]:
        """(key, decoder), least recently used first (a snapshot)."""
        return iter([(k, v[0]) for k, v in self._items.items()])

    def __iter__(self) -> Iterator[Key]:
        """The keys, least recently used first (a snapshot)."""
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    @property
    def learned_bytes(self) -> int:
        """The sum of the kept methods' learned-state bounds."""
        return sum(v[1] for v in self._items.values())
