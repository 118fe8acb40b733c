"""What ``triedec serve`` runs with: :class:`ServerConfig`, each setting declared once, and the
values it builds for the parts it configures (:class:`Tenancy`, :class:`TenantLimits`,
:class:`SharingConfig`). Declarations only: nothing here imports torch, FastAPI or the model, so
``triedec serve --help`` is generated from these fields in well under a second.

Plain settings are fields declared with :func:`~triedec.core.settings.setting`: ``triedec serve``'s
flags are generated from them (:func:`triedec.cli.flags.build_parser`), the Ray app reads its
``key=value`` pairs into the same fields, and nothing copies them by hand. The engine's limits are
one :class:`~triedec.core.limits.BatchLimits` and the bounds on built methods one
:class:`~triedec.api.decoders.DecoderLimits`, held as they are. The settings that are built from
several flags or the environment (the method and its options, the API keys, the Redis URL, the
model's name) are plain fields whose flags ``triedec.cli.flags`` writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from triedec.api.decoders import DecoderLimits
from triedec.core.errors import TriedecError, positive_int
from triedec.core.limits import BatchLimits
from triedec.core.params import DEFAULT_METHOD, MAX_NEW_TOKENS
from triedec.core.settings import MIB, setting

if TYPE_CHECKING:
    from triedec.server.auth import ApiKeys

Learning = Literal["shared", "tenant", "off"]
LEARNING: tuple[Learning, ...] = ("shared", "tenant", "off")
"""Whose learned state a request drafts from (:mod:`triedec.server.tenancy`)."""


@dataclass(frozen=True)
class Tenancy:
    """The learning mode (:mod:`triedec.server.tenancy`) and how many tenants' state is kept in memory."""

    learning: Learning = "shared"
    max_tenants: int = 64

    def __post_init__(self) -> None:
        if self.learning not in LEARNING:
            raise TriedecError(f"learning must be one of {', '.join(LEARNING)}, got {self.learning!r}")
        positive_int("max_tenants", self.max_tenants)


@dataclass(frozen=True)
class TenantLimits:
    """Per tenant: requests decoded at once (``max_running``; more wait for one of theirs to end,
    whatever room the batch has) and requests waiting beyond those (``max_queued``; one more gets
    :class:`TenantBusy`). ``max_request_seconds``: a request's whole time (queue included); past
    it a request that has emitted tokens ends with stop reason ``time_limit``, one that has not
    ends with a ``("timeout", None)`` event. None = no limit."""

    max_running: int | None = None
    max_queued: int | None = None
    max_request_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_running", "max_queued"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0
                                      or (name == "max_running" and value == 0)):
                raise TriedecError(f"{name} must be a positive integer (max_queued: >= 0) or None, got {value!r}")
        seconds = self.max_request_seconds
        if seconds is not None and not 0 < seconds < float("inf"):
            raise TriedecError(f"max_request_seconds must be a positive number or None, got {seconds!r}")


@dataclass(frozen=True)
class SharingConfig:
    """Where and how often learned state is exchanged with other replicas (:mod:`triedec.server.sharing`)."""

    redis_url: str
    interval: float = 0.5
    """seconds between two exports; also the longest a read blocks"""
    max_entries: int = 1_000
    """entries each stream keeps, about (Redis trims the oldest); an entry is one method's export
    of one interval: a few KB to a few tens of KB for a busy tenant"""
    max_pending: int = 1_000
    """entries waiting to be published while Redis does not answer, at most"""
    namespace: str = "triedec"
    """prefix of the stream names"""

    def __post_init__(self) -> None:
        if not isinstance(self.redis_url, str) or not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise TriedecError("the Redis URL must look like redis://HOST:PORT/DB (or rediss://, unix://)")
        if not 0.01 <= self.interval <= 60:
            raise TriedecError(f"the sharing interval must lie in [0.01, 60] seconds, got {self.interval!r}")
        positive_int("max_entries", self.max_entries)
        positive_int("max_pending", self.max_pending)
        if not self.namespace or any(c.isspace() or c == ":" for c in self.namespace):
            raise TriedecError("the stream namespace must be non-empty, without spaces or ':'")

    def __repr__(self) -> str:  # the URL may carry a password
        return f"SharingConfig(interval={self.interval}, max_entries={self.max_entries})"


DEFAULT_HOST = "127.0.0.1"
KEEP_ALIVE_SECONDS = 10
"""How long an idle kept-alive connection stays open. Longer than the client pools' own idle
expiry (httpx's, under the ``openai`` client: 5 s), so a pooled connection is dropped by its
client before the server closes it: with equal times a request sent at the moment the server
closes the connection fails with "Server disconnected" (seen in the suite at 5 s)."""
"""the address a server listens on unless told otherwise: loopback only"""
DEFAULT_PORT = 8000

SERVER_LIMITS = BatchLimits(max_kv_bytes=4 << 30)
"""The engine's limits a server starts with: the library's, with the KV the running requests may
reserve capped at 4 GiB."""


@dataclass(frozen=True)
class ServerConfig:
    """What the server runs: the default ``method`` and its ``method_options`` (a request may name
    others), the model id clients use (``model_name``), and its limits. Validated on
    construction."""

    method: str = DEFAULT_METHOD
    method_options: Mapping[str, object] = field(default_factory=dict)
    model_name: str = "triedec"
    limits: BatchLimits = SERVER_LIMITS
    """what the engine's batch may hold and one forward may carry"""
    max_queue: int = setting(64, help="requests that may wait; one more gets 503")
    max_body_bytes: int = setting(1 << 20, unit="bytes", help="request body limit")
    default_max_tokens: int = setting(MAX_NEW_TOKENS, flag="--max-tokens", help="max_tokens when a request gives none "
                                                                                 "(cut to what the context leaves)")
    drain_seconds: float = setting(30.0, unit="s", help="on SIGTERM, how long in-flight requests may finish before "
                                                        "they are cancelled")
    api_keys: ApiKeys | None = None
    """keys every request but ``/health`` must carry (:mod:`triedec.server.auth`); None = open"""
    learning: Learning | None = setting(None, group="security", choices=LEARNING,
                                        none="tenant with keys, shared without",
                                        help="whose learned state (auto's store, the recycling matrix, acceptance "
                                             "rates) a request drafts from: shared (everyone's), tenant (its own "
                                             "tenant's), off (nothing learned is kept)")
    max_tenants: int = setting(64, group="security",
                               help="tenants whose learned state is kept in memory (tenant learning)")
    tenant_max_running: int | None = setting(None, group="security", kind=int, none="up to --max-running",
                                             help="requests of one tenant decoded at once")
    tenant_max_queued: int | None = setting(None, group="security", kind=int, none="up to --max-queue",
                                            help="requests of one tenant waiting beyond those; one more gets 429")
    max_request_seconds: float | None = setting(600.0, group="security", kind=float, unit="s",
                                                help="a request's whole time, queue included: past it, it ends with "
                                                     "what it has (finish_reason length, stop_reason time_limit), or "
                                                     "gets 408 before its first token")
    stall_seconds: float = setting(2.0, group="security", unit="s",
                                   help="a request whose client has not taken its tokens for this long (a stream "
                                        "nobody reads) is paused, its batch slot free for others, until the client "
                                        "reads again; send-seconds later the server ends it")
    remeasure_after: float = setting(10.0, unit="s",
                                     help="seconds with no request after which a calibration measured while the "
                                          "machine was busy is measured again, stopped the moment a request arrives "
                                          "(0: never)")
    max_tokens_limit: int = setting(4096, group="security",
                                    help="the most max_tokens a request may ask for (more gets 400)")
    body_seconds: float = setting(30.0, group="security", unit="s",
                                  help="a request body must arrive within this time, else 408")
    send_seconds: float = setting(60.0, group="security", unit="s",
                                  help="a client that takes no response data for this long is disconnected (a client "
                                       "that never reads holds nothing for long)")
    send_buffer_bytes: int = setting(256 << 10, group="security", unit="bytes",
                                     help="the kernel's send buffer of each connection (SO_SNDBUF): what a client "
                                          "that stopped reading can leave unsent before the server notices")
    allowed_hosts: str = setting("", group="security",
                                 help="Host header values a server without API keys answers besides loopback ones "
                                      "(localhost, 127.0.0.0/8, [::1]), comma-separated; '*' answers any (a web page "
                                      "could then reach this server by DNS rebinding)")
    prefix_cache_bytes: int = setting(1 << 30, flag="--prefix-cache-mib", scale=MIB, unit="MiB",
                                      help="KV of earlier requests kept for later ones that start with the same "
                                           "tokens (the prefix trie: a conversation's next turn, a document's next "
                                           "question prefill only their new tokens), least recently used dropped "
                                           "first; 0: none")
    prefix_cache: bool = setting(True, help="keep KV across requests in the prefix trie (--no-prefix-cache: "
                                            "none, as --prefix-cache-mib 0)")
    special_tokens_in_text: bool = setting(False, group="security",
                                           help="tokenize special tokens' text inside messages and text prompts as "
                                                "the control tokens themselves (off: as plain text, so only the "
                                                "chat template makes control tokens; token-id prompts are as sent)")
    redis_url: str | None = field(default=None, repr=False)
    """share learned state with the other replicas that name the same Redis
    (:mod:`triedec.server.sharing`); None = this process's own only"""
    share_interval: float = setting(0.5, group="scaling", unit="s",
                                    help="seconds between two exchanges of learned state through Redis")
    share_max_entries: int = setting(1_000, group="scaling", help="entries each Redis stream of learned state keeps, "
                                                                  "about")
    decoders: DecoderLimits = field(default_factory=DecoderLimits)
    """the methods (option sets) kept built, per tenant and overall, in count and learned-state
    bytes (:mod:`triedec.api.decoders`); past them the least recently used are dropped"""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "default_max_tokens", "max_tokens_limit", "send_buffer_bytes"):
            positive_int(name, getattr(self, name))
        if isinstance(self.prefix_cache_bytes, bool) or not isinstance(self.prefix_cache_bytes, int) \
                or self.prefix_cache_bytes < 0:
            raise TriedecError(f"prefix_cache_bytes must be an integer >= 0, got {self.prefix_cache_bytes!r}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise TriedecError(f"the default max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit "
                               f"({self.max_tokens_limit})")
        if not 0 <= self.remeasure_after < float("inf"):
            raise TriedecError(f"remeasure_after must be a number of seconds >= 0, got {self.remeasure_after!r}")
        for name in ("body_seconds", "send_seconds", "stall_seconds"):
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
        if not isinstance(self.limits, BatchLimits):
            raise TriedecError(f"limits must be a BatchLimits, got {self.limits!r}")
        self.sharing()  # validates the Redis URL and the exchange's settings
        if not isinstance(self.allowed_hosts, str) or any(c.isspace() or c in "/@?#" for c in
                                                           self.allowed_hosts.replace(", ", ",")):
            raise TriedecError(f"allowed_hosts must be host names separated by commas, got {self.allowed_hosts!r}")
        if not isinstance(self.decoders, DecoderLimits):
            raise TriedecError(f"decoders must be a DecoderLimits, got {self.decoders!r}")

    def hosts(self) -> frozenset[str] | None:
        """The Host names (lower case, without port) a request must name besides loopback ones;
        None: any (the server has API keys, or ``allowed_hosts`` is ``*``)."""
        names = [h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()]
        if self.api_keys is not None or "*" in names:
            return None
        return frozenset(names)

    def sharing(self) -> SharingConfig | None:
        if self.redis_url is None:
            return None
        return SharingConfig(self.redis_url, self.share_interval, self.share_max_entries)

    def tenancy(self) -> Tenancy:
        learning = self.learning or ("tenant" if self.api_keys is not None else "shared")
        return Tenancy(learning, self.max_tenants)

    def prefix_capacity(self) -> int:
        """The bytes of KV the prefix trie may hold (0: no trie)."""
        return self.prefix_cache_bytes if self.prefix_cache else 0

    def tenant_limits(self) -> TenantLimits:
        return TenantLimits(self.tenant_max_running, self.tenant_max_queued, self.max_request_seconds)
