"""Learned state shared by the replicas of one model through Redis (``--redis-url``).

Each replica keeps its own drafters (auto's store of earlier outputs, the recycling matrix, the
acceptance and agreement rates) and drafts only from them: Redis is never on a request's path.
Beside the engine, a thread of its own (:class:`Sharing`) exchanges what the drafters learned,
every ``interval`` seconds:

1. **export**: it asks the engine thread (:meth:`Scheduler.call`, at a step boundary) for what every
   built method learned *here* since the last export (:meth:`LM.export_learned`: outputs finished
   here, matrix rows written here, rates updated here; :mod:`triedec.drafters.learned`);
2. **publish**: each non-empty value goes onto its scope's Redis stream (``XADD``, trimmed to about
   ``max_entries`` entries): one stream per tenant under ``--learning tenant``
   (``triedec:<model>:tenant-<hash of the tenant>``), one per model under ``shared``
   (``triedec:<model>:shared``); ``off`` shares nothing;
3. **follow**: it reads the streams of the scopes this replica holds from where it last read
   (``XREAD``, blocking at most until the next export), and a scope new here (its first request
   built it) from the stream's start: what other replicas learned before, as far as the stream
   keeps it; a method built anew in a scope followed already reads its own entries of the
   stream's past (``XRANGE``). A replica skips the entries it published while following the
   stream (its drafters hold them), not those of an earlier process or from before the tenant's
   state was dropped here;
4. **absorb**: what it read is handed to the engine thread, which merges it into the matching
   drafters (same scope, method and options) at the next step boundary
   (:meth:`LM.absorb_learned`; the merge rule of each part is in :mod:`triedec.drafters.learned`).

**Delay.** An output that finishes on replica A drafts on replica B once A has exported it (within
one interval), B has read it (at once: B blocks on the stream) and B's engine reaches a step
boundary: at most about ``interval`` + one decoding step, for a scope B holds already. The
matrix rows and rates travel the same way, so each replica's view of them is at most about one
interval stale.

**Faults.** Redis down or unreachable: the replica keeps serving from its local state; what it
learned waits in a bounded backlog (``max_pending`` entries; the oldest are dropped and counted);
the thread retries every interval (doubling up to 5 s) and, once Redis answers, publishes the
backlog and resumes reading where it stopped. A Redis that lost its data (restarted without
persistence) starts new streams, which are followed from their start. A malformed entry is
skipped and counted. No request waits on Redis or fails because of it. ``status()`` (and the
server's ``/health``) reports the link, counts and the last error's kind.

Redis must be private to the deployment: its streams hold tenants' outputs (as token ids).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Hashable
from concurrent.futures import CancelledError
from typing import Any

from triedec.api.lm import LM
from triedec.core.errors import TriedecError
from triedec.drafters.learned import Learned
from triedec.server.config import SharingConfig
from triedec.server.scheduler import QueueFull, Scheduler
from triedec.server.tenancy import scope_name

log = logging.getLogger("triedec.server.sharing")

READ_COUNT = 256
"""stream entries read per call at most"""
MERGE_CHUNK = 32
"""entries merged at one step boundary at most"""
MAX_BACKOFF = 5.0
"""seconds between two tries while Redis does not answer, at most"""


class Sharing:
    """The exchange thread of one replica (module doc): :meth:`start`, :meth:`close`,
    :meth:`status`. The engine's objects are touched on the engine thread only
    (:meth:`Scheduler.call`); this thread does the Redis I/O and the JSON."""

    def __init__(self, lm: LM, scheduler: Scheduler, config: SharingConfig) -> None:
        try:
            import redis
        except ImportError as exc:
            raise TriedecError("sharing learned state needs the Redis client: pip install 'triedec[redis]'") from exc
        self.lm, self.scheduler, self.config = lm, scheduler, config
        self.replica = uuid.uuid4().hex
        self._errors = (redis.RedisError, OSError)
        block = config.interval + 5.0
        self._redis = redis.Redis.from_url(config.redis_url, socket_timeout=block, socket_connect_timeout=2.0,
                                           health_check_interval=0)
        self._prefix = f"{config.namespace}:{lm.model_info().model_id or 'model'}:"
        self._scopes: dict[str, Hashable] = {}  # stream -> the local scope it feeds
        self._read: dict[str, str] = {}  # stream -> id of the last entry read ("0": from the start)
        self._mine: dict[str, set[str]] = {}  # stream -> ids published here since following it, not read back yet
        self._methods: dict[str, set[tuple[str, str]]] = {}  # stream -> (method, options id) built here
        self._catch_up: list[tuple[str, frozenset[tuple[str, str]], str]] = []  # (stream, new methods, up to id)
        self._backlog: collections.deque[tuple[str, dict[str, str]]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the counters read by status()
        self._counts = collections.Counter[str]()
        self._up: bool | None = None
        self._last_error: str | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="triedec-sharing", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after one last export and publish (bounded by ``timeout``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self._redis.close()

    def status(self) -> dict[str, Any]:
        """The link (``up``, ``down`` or ``connecting``), entries published, absorbed, pending and
        dropped, malformed entries skipped, other processes' finished outputs merged into a store
        here (``outputs``), and the last error's kind."""
        with self._lock:
            link = "connecting" if self._up is None else "up" if self._up else "down"
            return {"redis": link, "published": self._counts["published"], "absorbed": self._counts["absorbed"],
                    "outputs": self._counts["outputs"],
                    "pending": len(self._backlog), "dropped": self._counts["dropped"],
                    "malformed": self._counts["malformed"], "last_error": self._last_error}

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        retry = self.config.interval
        next_export = 0.0
        while True:
            stopping = self._stop.is_set()
            if stopping or time.monotonic() >= next_export:
                if not self._export():
                    stopping = True
                next_export = time.monotonic() + self.config.interval
            try:
                self._publish()
                if stopping:
                    return
                found = self._follow(max(0.01, next_export - time.monotonic()))
                self._link(True, None)
                retry = self.config.interval
            except self._errors as exc:
                self._link(False, type(exc).__name__)
                if stopping or self._stop.wait(retry):
                    return
                retry = min(2 * retry, MAX_BACKOFF)
                continue
            if found:
                self._absorb(found)

    def _link(self, up: bool, error: str | None) -> None:
        with self._lock:
            if up != self._up:
                log.warning("Redis link %s%s", "up" if up else "down", f" ({error})" if error else "")
            self._up = up
            if error:
                self._last_error = error

    def _export(self) -> bool:
        """Queue what the drafters learned since the last export, and note the scopes and methods
        held here (a method new in a scope already followed catches up on its stream's past);
        False once the engine stopped."""
        try:
            exported = self.scheduler.call(self.lm.export_learned).result(timeout=60)
        except (QueueFull, CancelledError, TimeoutError):
            return False
        held: dict[str, set[tuple[str, str]]] = {}
        for scope, method, options, learned in exported:
            name = scope_name(scope)
            if name is None:
                continue
            stream = self._prefix + name
            held.setdefault(stream, set()).add((method, options))
            self._scopes[stream] = scope
            if learned:
                if len(self._backlog) >= self.config.max_pending:
                    self._backlog.popleft()
                    self._count("dropped")
                self._backlog.append((stream, {"replica": self.replica, "method": method, "options": options,
                                               "learned": learned.to_json()}))
        for stream, methods in held.items():
            if stream not in self._read:  # a scope new here: follow its stream from the start
                self._read[stream], self._mine[stream] = "0", set()
            elif self._read[stream] != "0" and methods - self._methods[stream]:
                self._catch_up.append((stream, frozenset(methods - self._methods[stream]), self._read[stream]))
        for stream in set(self._read) - set(held):  # dropped here: a later build catches up from the start
            del self._read[stream], self._scopes[stream], self._mine[stream]
        self._catch_up = [c for c in self._catch_up if c[0] in held]
        self._methods = held
        return True

    def _publish(self) -> None:
        while self._backlog:
            stream, fields = self._backlog[0]
            entry_id = self._redis.xadd(stream, fields, maxlen=self.config.max_entries, approximate=True)
            mine = self._mine.get(stream)
            if mine is not None and len(mine) < self.config.max_entries:  # skipped when read back
                mine.add(_text(entry_id))
            self._backlog.popleft()
            self._count("published")

    def _follow(self, block: float) -> list[tuple[Hashable, str, str, Learned]]:
        """The past entries of methods new in a followed scope, then the new entries of the
        streams followed (blocking up to ``block`` seconds)."""
        found: list[tuple[Hashable, str, str, Learned]] = []
        while self._catch_up:
            stream, methods, upto = self._catch_up[0]
            start = "-"
            while True:
                entries = self._redis.xrange(stream, min=start, max=upto, count=READ_COUNT)
                for _, fields in entries:
                    self._take(stream, fields, found, methods)
                if len(entries) < READ_COUNT:
                    break
                start = "(" + _text(entries[-1][0])
            self._catch_up.pop(0)
        if not self._read:  # nothing held here yet: check the link, then wait for the next export
            self._redis.ping()
            self._stop.wait(block)
            return found
        answer = self._redis.xread(dict(self._read), count=READ_COUNT, block=max(1, int(block * 1000)))
        for stream, entries in answer or ():
            stream = _text(stream)
            if stream not in self._read:
                continue
            for entry_id, fields in entries:
                entry_id = _text(entry_id)
                self._read[stream] = entry_id
                if entry_id in self._mine[stream]:
                    self._mine[stream].discard(entry_id)
                    continue  # learned here (the drafters hold it)
                self._take(stream, fields, found)
        return found

    def _take(self, stream: str, fields: dict[Any, Any], found: list[tuple[Hashable, str, str, Learned]],
              methods: frozenset[tuple[str, str]] | None = None) -> None:
        """Parse one entry into ``found`` (only for ``methods``, if given); count a malformed one."""
        got = {_text(k): _text(v) for k, v in fields.items()}
        try:
            method, options = got["method"], got["options"]
            if methods is None or (method, options) in methods:
                found.append((self._scopes[stream], method, options, Learned.from_json(got["learned"])))
        except (TriedecError, KeyError):
            self._count("malformed")

    def _absorb(self, found: list[tuple[Hashable, str, str, Learned]]) -> None:
        """Merge ``found`` on the engine thread, :data:`MERGE_CHUNK` entries per step boundary (a
        long catch-up never holds the engine for long)."""
        for start in range(0, len(found), MERGE_CHUNK):
            if not self._merge(found[start : start + MERGE_CHUNK]):
                return

    def _merge(self, found: list[tuple[Hashable, str, str, Learned]]) -> bool:
        def merge() -> tuple[int, int, int]:
            absorbed = malformed = outputs = 0
            for scope, method, options, learned in found:
                try:
                    took = bool(self.lm.absorb_learned(scope, method, options, learned))
                    absorbed += took
                    outputs += len(learned.outputs) if took else 0
                except TriedecError:  # another model's tokens, another matrix width
                    malformed += 1
                except Exception:  # a bug: this entry is lost, serving goes on
                    log.exception("merging shared learned state failed")
                    malformed += 1
            return absorbed, malformed, outputs

        try:
            absorbed, malformed, outputs = self.scheduler.call(merge).result(timeout=60)
        except (QueueFull, CancelledError, TimeoutError):
            return False
        self._count("absorbed", absorbed)
        self._count("malformed", malformed)
        self._count("outputs", outputs)
        return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
