"""Router metrics on their own registry (the names are a contract: the README's Metrics section, the dashboards).

Per-worker gauges are read from the registry at scrape time, so a removed worker's
series disappear with it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cluster.api.buckets import REQUEST_LATENCY_BUCKETS as E2E_BUCKETS  # the worker's (vLLM's) edges
from cluster.api.buckets import TTFT_BUCKETS
from cluster.kv.events import TIER_NAMES
from cluster.router.breaker import CLOSED
from cluster.router.registry import STATE_NAMES, Registry

# outcome label values of orchard_router_requests_total (one count per attempt on a worker)
SUCCESS = "success"  # the stream finished on this worker
FAILED = "failed"  # the worker failed; the request was placed again or resumed elsewhere
ERROR = "error"  # an error went back to the client (bad request, or out of attempts)
CANCELLED = "cancelled"  # the client went away
NO_WORKER = "no_worker"  # nothing to place it on (worker label "none")
# why a request was placed by the approximate map (orchard_router_tokenize_fallbacks_total)
TOKENIZE_FALLBACKS = ("timeout", "no_tokenizer", "no_renderer", "busy", "error")
TOKENIZE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class _WorkerGauges:
    def __init__(self, registry: Registry):
        self.registry = registry

    def collect(self):
        workers = self.registry.snapshot()
        states = GaugeMetricFamily("orchard_router_workers", "Workers known to the router, by state", labels=["state"])
        for state, name in STATE_NAMES.items():
            states.add_metric([name], sum(1 for w in workers if w.state == state))
        yield states
        inflight = GaugeMetricFamily(
            "orchard_router_inflight_requests", "Requests the router has open on each worker", labels=["worker"]
        )
        for w in workers:
            inflight.add_metric([w.worker_id], w.inflight)
        yield inflight
        circuit = GaugeMetricFamily(
            "orchard_router_circuit_open", "1 while a worker's circuit breaker is open or half-open (after "
            "consecutive failures: no requests but one probe)", labels=["worker"],
        )
        for w in workers:
            circuit.add_metric([w.worker_id], float(w.breaker.state != CLOSED))
        yield circuit


class _KvMapMetrics:
    """The KV map's (router/kv_map.py) counts, read at scrape time."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def collect(self):
        kv = self.registry.kv_map
        applied = CounterMetricFamily("orchard_router_kv_events_applied_total",
                                      "KV events from each worker applied to the router's prefix map",
                                      labels=["worker"])
        for worker, n in list(kv.events_applied.items()):
            applied.add_metric([worker], n)
        yield applied
        resyncs = CounterMetricFamily("orchard_router_kv_resyncs_total",
                                      "Snapshots of a worker's KV blocks the router took instead of its events: "
                                      "reason=gap (an event missing), epoch (the worker restarted), no_state "
                                      "(the router knew nothing of it), invalid (a batch refused: malformed or over "
                                      "the limits)", labels=["reason"])
        for reason, n in list(kv.resyncs.items()):
            resyncs.add_metric([reason], n)
        yield resyncs
        blocks = GaugeMetricFamily("orchard_router_kv_map_blocks",
                                   "KV blocks the router's prefix map holds for each worker, by tier",
                                   labels=["worker", "tier"])
        for worker in kv.workers():
            for tier, n in kv.blocks(worker).items():
                blocks.add_metric([worker, TIER_NAMES[tier]], n)
        yield blocks


class RouterMetrics:
    def __init__(self, registry: Registry):
        self.prometheus = CollectorRegistry()
        r = self.prometheus
        self.requests = Counter(
            "orchard_router_requests_total", "Attempts on workers, by outcome", ["worker", "outcome"], registry=r
        )
        self.ttft = Histogram(
            "orchard_router_time_to_first_token_seconds", "Time to first token seen by the router's clients",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "orchard_router_e2e_request_latency_seconds", "Request latency seen by the router's clients",
            buckets=E2E_BUCKETS, registry=r,
        )
        self.poison = Counter(
            "orchard_router_poison_requests_total",
            "Requests failed to their client after failing with INTERNAL on two workers (not tried again)", registry=r,
        )
        self.deadline_exceeded = Counter(
            "orchard_router_deadline_exceeded_total",
            "Requests whose client's deadline passed before they finished (waiting for a worker or on one)",
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "orchard_router_retry_budget_exhausted_total",
            "Requests failed fast instead of retried: the router's retry budget was spent", registry=r,
        )
        self.retries = Counter(
            "orchard_router_retries_total",
            "Requests placed again after a worker failed: kind=retry before the first token, kind=resume mid-stream",
            ["kind"], registry=r,
        )
        for kind in ("retry", "resume"):
            self.retries.labels(kind=kind)
        # placement by KV cache (router/prompt_blocks.py, policy.py's kv_aware)
        self.tokenize_seconds = Histogram(
            "orchard_router_tokenize_seconds",
            "Time a request waited for its prompt's KV block hashes before placement (at most "
            "--router-tokenize-timeout)", buckets=TOKENIZE_BUCKETS, registry=r,
        )
        self.tokenize_fallbacks = Counter(
            "orchard_router_tokenize_fallbacks_total",
            "Requests placed by the approximate prefix map instead of their KV block hashes, by why",
            ["reason"], registry=r,
        )
        for reason in TOKENIZE_FALLBACKS:
            self.tokenize_fallbacks.labels(reason=reason)
        self.predicted_cached_tokens = Counter(
            "orchard_router_predicted_cached_tokens_total",
            "Prompt tokens the KV-aware policy expected the chosen worker to hold, by tier (requests it placed "
            "by their block hashes)", ["tier"], registry=r,
        )
        for tier in ("memory", "disk"):
            self.predicted_cached_tokens.labels(tier=tier)
        self.actual_cached_tokens = Counter(
            "orchard_router_actual_cached_tokens_total",
            "Prompt tokens the workers served from their KV caches (usage.cached_tokens) for the requests placed "
            "by their block hashes", registry=r,
        )
        r.register(_WorkerGauges(registry))
        r.register(_KvMapMetrics(registry))
