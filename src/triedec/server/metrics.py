"""The server's Prometheus metrics, in a registry of its own (no globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from triedec.core.allocate import DraftPayoff, load_level
from triedec.core.prefixtrie import PrefixStats
from triedec.engine.batch import StepReport
from triedec.engine.outcome import Outcome

_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """Requests, tokens and speed per method; queue depth; and what every engine step carried:
    requests and tokens per forward, the share of the per-forward token budget used, draft nodes
    verified, and time spent queued before a request joined the batch."""

    def __init__(self, depth: Callable[[], tuple[int, int]], max_tokens_per_forward: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.max_tokens = max_tokens_per_forward
        self.requests = Counter("triedec_requests", "HTTP generation requests by endpoint, method and status",
                                ["endpoint", "method", "status"], registry=r)
        self.tokens = Counter("triedec_generated_tokens", "tokens generated", ["method"], registry=r)
        self.tokens_per_s = Histogram("triedec_request_tokens_per_second", "tokens/s of each finished request",
                                      ["method"], buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
                                      registry=r)
        self.accepted = Histogram("triedec_request_mean_accepted", "tokens per decoding step of each finished "
                                  "request (MAT)", ["method"], buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8), registry=r)
        self.latency = Histogram("triedec_request_seconds", "wall time of each finished request", ["method"],
                                 registry=r)
        self.queued = Histogram("triedec_request_queued_seconds", "time each finished request waited before it "
                                "joined the batch", ["method"], registry=r)
        self.batch = Histogram("triedec_batch_requests", "requests carried by each forward (prompt chunks included)",
                               buckets=_SIZES, registry=r)
        self.forward_tokens = Histogram("triedec_forward_tokens", "tokens carried by each forward", buckets=_SIZES,
                                        registry=r)
        self.budget = Histogram("triedec_forward_budget_used", "tokens of each forward over the per-forward "
                                "budget (max_tokens_per_forward)", buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0),
                                registry=r)
        self.draft_nodes = Histogram("triedec_forward_draft_nodes", "draft nodes verified by each forward, all "
                                     "requests together", buckets=(0, *_SIZES), registry=r)
        self.steps = Counter("triedec_steps", "engine steps (forwards)", registry=r)
        self.plain_steps = Counter("triedec_plain_steps", "engine steps whose requests were not asked to draft "
                                   "(drafting did not measurably pay at that load, or an exploration step)",
                                   registry=r)
        self.speedup = Gauge("triedec_drafting_speedup", "committed tokens per second of steps that draft over "
                             "steps that do not, at each load level (decoding requests: 1-4, then 4-7, 8-15, ...)",
                             ["load"], registry=r)
        self.drafting = Gauge("triedec_drafting", "1 where steps draft at this load level, 0 where they run plain "
                              "(but for one step in 16 that explores)", ["load"], registry=r)
        queue = Gauge("triedec_queue_depth", "requests running or waiting", ["state"], registry=r)
        queue.labels("running").set_function(lambda: depth()[0])
        queue.labels("waiting").set_function(lambda: depth()[1])

    def step(self, carried: StepReport, payoff: DraftPayoff | None = None) -> None:
        """One engine step (called on the scheduler thread); ``payoff``: the batch's measure of what
        drafting buys, read at the step's load level."""
        plan = carried.plan
        if not plan.requests:
            return
        self.steps.inc()
        if not plan.drafting:
            self.plain_steps.inc()
        if payoff is not None and plan.decoding:
            level = load_level(len(plan.decoding))
            speedup = payoff.speedup(level)
            if speedup is not None:
                self.speedup.labels(str(level)).set(speedup)
            self.drafting.labels(str(level)).set(float(payoff.prefers_drafting(level)))
        self.batch.observe(plan.requests)
        self.forward_tokens.observe(plan.tokens)
        self.budget.observe(plan.tokens / self.max_tokens)
        self.draft_nodes.observe(plan.draft_nodes)

    def finished(self, endpoint: str, method: str, outcome: Outcome, request: bool = True) -> None:
        """A finished run: its tokens and timings; ``request``: also count its request (a request's
        other choices do not)."""
        s = outcome.stats
        if request:
            self.requests.labels(endpoint, method, "200").inc()
        self.tokens.labels(method).inc(s.new_tokens)
        self.tokens_per_s.labels(method).observe(s.tokens_per_s)
        self.latency.labels(method).observe(s.seconds)
        self.queued.labels(method).observe(s.queued_seconds)
        if s.mean_accepted:
            self.accepted.labels(method).observe(s.mean_accepted)

    def prefix(self, stats: Callable[[], PrefixStats]) -> None:
        """Also export the prefix trie's counts (:mod:`triedec.core.prefixtrie`), read at each scrape."""
        self.registry.register(_PrefixCollector(stats))

    def sharing(self, status: Callable[[], dict[str, Any]]) -> None:
        """Also export the learned-state exchange's ``status()`` (:mod:`triedec.server.sharing`)."""
        self.registry.register(_SharingCollector(status))


class _PrefixCollector:
    """The prefix trie's counts, read from its ``stats`` at each scrape."""

    def __init__(self, stats: Callable[[], PrefixStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield CounterMetricFamily("triedec_prefix_cache_lookups", "requests looked up in the prefix trie",
                                  value=s.lookups)
        yield CounterMetricFamily("triedec_prefix_cache_hits", "lookups that found a cached prefix", value=s.hits)
        yield CounterMetricFamily("triedec_prefix_cache_cached_tokens", "prompt tokens whose KV came from the "
                                  "prefix trie instead of a prefill", value=s.cached_tokens)
        yield CounterMetricFamily("triedec_prefix_cache_evictions", "nodes dropped from the prefix trie for room",
                                  value=s.evictions)
        yield GaugeMetricFamily("triedec_prefix_cache_bytes", "bytes of KV the prefix trie holds", value=s.bytes)
        yield GaugeMetricFamily("triedec_prefix_cache_tokens", "tokens whose KV the prefix trie holds", value=s.tokens)
        yield GaugeMetricFamily("triedec_prefix_cache_capacity_bytes", "the most bytes the prefix trie may hold",
                                value=s.capacity_bytes)


class _SharingCollector:
    """The exchange's link and counts, read from its ``status()`` at each scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        found = self.status()
        yield GaugeMetricFamily("triedec_sharing_redis_up", "whether the last exchange with Redis succeeded",
                                value=float(found["redis"] == "up"))
        yield GaugeMetricFamily("triedec_sharing_pending", "learned-state entries waiting to be published",
                                value=found["pending"])
        entries = CounterMetricFamily("triedec_sharing_entries", "learned-state entries by what happened to them",
                                      labels=["event"])
        for event in ("published", "absorbed", "dropped", "malformed"):
            entries.add_metric([event], found[event])
        yield entries
        yield CounterMetricFamily("triedec_sharing_outputs_absorbed",
                                  "other processes' finished outputs merged into a store here", value=found["outputs"])
