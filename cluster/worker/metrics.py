"""The worker's Prometheus metrics (names are a contract: the README's Metrics section, the dashboards).

Histograms are observed on the asyncio side from the timestamps the engine thread puts
on its outputs. Gauges and counters are read from the engine's `EngineStats` (plain ints
the engine thread updates) when Prometheus scrapes, so they are exact and cost nothing
per step. Each server has its own registry, never prometheus_client's global one.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.api.buckets import ITL_BUCKETS, KV_USAGE_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from cluster.worker.group.progress import STEP_BUCKETS

FINISHED_REASONS = ("stop", "length", "abort")

LABELS = ("model", "worker")


class WorkerMetrics:
    def __init__(self, model: str, worker_id: str, stats: Callable[[], object],
                 group: Callable[[], object] | None = None):
        """`stats()` returns the engine's EngineStats (or None before the engine is up);
        `group()` a worker group's GroupStats (None: a single process)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = labels = (model, worker_id)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*labels)

        self.ttft = histogram(
            "orchard_time_to_first_token_seconds", "Time from arrival at the worker to the first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "orchard_inter_token_latency_seconds", "Time between consecutive tokens of one request.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "orchard_e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "orchard_request_queue_time_seconds", "Time from arrival to first being scheduled.", REQUEST_LATENCY_BUCKETS
        )
        self.stalls = Counter(
            "orchard_engine_stalls_total", "Times the engine made no progress for the stall timeout (wedged).",
            LABELS, registry=self.registry,
        ).labels(*labels)
        self.registry.register(_EngineStatsCollector(labels, stats))
        if group is not None:
            self.registry.register(_GroupStatsCollector(labels, group))

    def watch_kv_events(self, journal) -> None:
        """Count the KV events `journal` (cluster/kv/events.py's KvJournal) publishes."""
        self.registry.register(_KvEventsCollector(self.labels, journal))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST


class _EngineStatsCollector:
    """Gauges and counters straight from EngineStats at scrape time."""

    def __init__(self, labels: tuple[str, str], stats: Callable[[], object]):
        self.labels = list(labels)
        self.stats = stats

    def describe(self):
        return []  # registered before the engine exists: no early collect

    def collect(self):
        s = self.stats()
        if s is None:
            return
        lv = self.labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, value)
            return c

        total = s.num_blocks_total or 1
        yield gauge("orchard_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1).", s.num_blocks_used / total)
        yield gauge("orchard_kv_cache_blocks_total", "KV blocks in the pool.", s.num_blocks_total)
        h = HistogramMetricFamily("orchard_step_kv_cache_usage_ratio",
                                  "KV-cache usage (0..1) at each engine step, once the step is scheduled.",
                                  labels=LABELS)
        counts, cumulative, buckets = list(s.kv_usage_step_counts), 0, []
        for edge, n in zip(KV_USAGE_BUCKETS, counts):
            cumulative += n
            buckets.append((repr(edge) if edge != 1.0 else "1.0", cumulative))
        buckets.append(("+Inf", cumulative))
        h.add_metric(lv, buckets, s.kv_usage_step_sum)
        yield h
        if s.state_slots_total:  # a hybrid model: its recurrent layers' per-request state
            yield gauge("orchard_state_slots_used", "Recurrent-state slots held by running requests.",
                        s.state_slots_used)
            yield gauge("orchard_state_slots_total", "Recurrent-state slots (max_num_seqs).", s.state_slots_total)
        yield gauge("orchard_num_requests_running", "Requests being computed.", s.num_running)
        yield gauge("orchard_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield counter("orchard_prompt_tokens_total", "Prompt tokens received.", s.prompt_tokens)
        yield counter("orchard_generation_tokens_total", "Tokens generated.", s.generation_tokens)
        yield counter("orchard_num_preemptions_total", "Requests preempted (to be recomputed).", s.num_preemptions)
        yield counter("orchard_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_queries)
        yield counter("orchard_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", s.prefix_hits)
        spec = getattr(s, "spec_decode", None)
        if spec is not None:  # speculative decoding: vLLM's counters (acceptance rate = accepted / draft tokens)
            yield counter("orchard_spec_decode_num_drafts",
                          "Verify rounds: requests that scored draft tokens in a step.", spec.num_drafts)
            yield counter("orchard_spec_decode_num_draft_tokens", "Draft tokens scored.", spec.num_draft_tokens)
            yield counter("orchard_spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)
            c = CounterMetricFamily("orchard_spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each draft position (0: the first draft).",
                                    labels=(*LABELS, "position"))
            for j, n in enumerate(list(spec.accepted_per_pos)):
                c.add_metric([*lv, str(j)], n)
            yield c
        yield from _kv_tier_metrics(lv, s)
        finished = dict(s.finished)
        c = CounterMetricFamily("orchard_request_success_total", "Finished requests by reason.",
                                labels=(*LABELS, "finished_reason"))
        for reason in sorted(set(FINISHED_REASONS) | set(finished)):
            c.add_metric([*lv, str(reason)], finished.get(reason, 0))
        yield c


class _KvEventsCollector:
    """The KV events the worker published to its routers, read from its journal at scrape time."""

    def __init__(self, labels: tuple[str, str], journal):
        self.labels = list(labels)
        self.journal = journal

    def describe(self):
        return []

    def collect(self):
        lv, j = self.labels, self.journal
        c = CounterMetricFamily("orchard_kv_events_total", "KV events published: blocks stored in or removed "
                                "from a tier, or a tier cleared.", labels=(*LABELS, "tier", "kind"))
        for (tier, kind), n in sorted(dict(j.counts).items()):
            c.add_metric([*lv, tier, kind], n)
        yield c
        c = CounterMetricFamily("orchard_kv_event_snapshots_total",
                                "Snapshots of every KV block held sent to a router instead of events (a router "
                                "that restarted, fell behind or lost track).", labels=LABELS)
        c.add_metric(lv, j.snapshots_sent)
        yield c


DROP_REASONS = ("queue_full", "disk_full", "read_only", "error")
READ_ERROR_KINDS = ("truncated", "header", "identity", "tokens", "checksum", "io")


def _kv_tier_metrics(lv: list[str], s):
    """Prefix-cache hits by tier, and with a disk tier (--kv-disk-dir) its traffic, errors,
    size and reads (names: issue 42's design, section 6)."""
    from cluster.worker.kv_tier import READ_SECONDS_BUCKETS

    tier = getattr(s, "kv_tier", None)
    disk_hits = tier.stats.hit_tokens if tier is not None else 0
    hits = CounterMetricFamily("orchard_kv_cache_hit_tokens_total",
                               "Prompt tokens served from the prefix cache, by the tier they were found in.",
                               labels=(*LABELS, "tier"))
    hits.add_metric([*lv, "memory"], max(0, s.prefix_hits - disk_hits))
    hits.add_metric([*lv, "disk"], disk_hits)
    yield hits
    if tier is None:
        return
    c = tier.counters()

    def one(kind, name: str, doc: str, value: float):
        m = kind(name, doc, labels=LABELS)
        m.add_metric(lv, value)
        return m

    yield one(GaugeMetricFamily, "orchard_kv_disk_enabled", "Whether the disk KV tier serves (1) or is off (0).",
              1 if c["enabled"] else 0)
    yield one(GaugeMetricFamily, "orchard_kv_disk_usage_bytes", "Bytes the disk KV tier holds.", c["used_bytes"])
    yield one(GaugeMetricFamily, "orchard_kv_disk_budget_bytes", "The disk KV tier's size budget (--kv-disk-size).",
              c["budget_bytes"])
    yield one(GaugeMetricFamily, "orchard_kv_disk_write_queue_bytes", "Bytes of blocks waiting to be written.",
              c["queue_bytes"])
    yield one(GaugeMetricFamily, "orchard_num_requests_loading",
              "Requests waiting for their prefix to be read from the disk tier.", tier.stats.loading)
    yield one(CounterMetricFamily, "orchard_kv_disk_bytes_written_total", "Bytes written to the disk tier.",
              c["bytes_written"])
    yield one(CounterMetricFamily, "orchard_kv_disk_blocks_written_total", "Blocks written to the disk tier.",
              c["blocks_written"])
    yield one(CounterMetricFamily, "orchard_kv_disk_bytes_read_total", "Bytes read back from the disk tier.",
              c["bytes_read"])
    yield one(CounterMetricFamily, "orchard_kv_disk_evictions_total",
              "Blocks the disk tier deleted to stay within its budget.", c["evictions"])
    dropped = CounterMetricFamily("orchard_kv_disk_blocks_dropped_total",
                                  "Blocks not written to the disk tier, by reason.", labels=(*LABELS, "reason"))
    for reason in sorted(set(DROP_REASONS) | set(c["dropped"])):
        dropped.add_metric([*lv, reason], c["dropped"].get(reason, 0))
    yield dropped
    errors = CounterMetricFamily("orchard_kv_disk_errors_total",
                                 "Disk tier blocks refused at read (recomputed), by what was wrong.",
                                 labels=(*LABELS, "kind"))
    for kind in sorted(set(READ_ERROR_KINDS) | set(c["errors"])):
        errors.add_metric([*lv, kind], c["errors"].get(kind, 0))
    yield errors
    h = HistogramMetricFamily("orchard_kv_disk_read_seconds", "Time to read one request's blocks from the disk tier.",
                              labels=LABELS)
    counts, cumulative, buckets = list(tier.stats.read_seconds_counts), 0, []
    for edge, n in zip((*READ_SECONDS_BUCKETS, float("inf")), counts):
        cumulative += n
        buckets.append((repr(edge) if edge != float("inf") else "+Inf", cumulative))
    h.add_metric(lv, buckets, tier.stats.read_seconds_sum)
    yield h


class _GroupStatsCollector:
    """A worker group's costs (rank 0 reports them): its steps, the time rank 0 spends in
    MLX's collectives and waiting for the other stages, and the bytes it moves."""

    def __init__(self, labels: tuple[str, str], stats: Callable[[], object]):
        self.labels = list(labels)
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        g = self.stats()
        if g is None:
            return
        lv = self.labels
        size = GaugeMetricFamily("orchard_group_size", "Processes in this worker group.", labels=LABELS)
        size.add_metric(lv, g.size)
        yield size
        for name, doc, value in (
                ("orchard_group_steps_total", "Steps the group ran.", g.steps),
                ("orchard_group_collective_seconds_total",
                 "Time rank 0 spent inside MLX collectives (receiving the previous stage's hidden states).",
                 g.collective_seconds),
                ("orchard_group_wait_seconds_total", "Time rank 0 waited for the previous stage to finish a step.",
                 g.wait_seconds),
                ("orchard_group_plan_seconds_total", "Host time rank 0 spent encoding and sending step plans.",
                 g.plan_seconds)):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, value)
            yield c
        sent = CounterMetricFamily("orchard_group_bytes_total",
                                   "Bytes the group moved through rank 0: step plans sent on the side channel, "
                                   "hidden states received through MLX.", labels=(*LABELS, "channel"))
        sent.add_metric([*lv, "plan"], g.plan_bytes)
        sent.add_metric([*lv, "hidden"], g.hidden_bytes)
        yield sent
        weights = GaugeMetricFamily("orchard_group_member_weight_bytes", "Weights each rank holds.",
                                    labels=(*LABELS, "rank"))
        memory = GaugeMetricFamily("orchard_group_member_memory_bytes",
                                   "The memory each rank's machine can give a model.", labels=(*LABELS, "rank"))
        for m in g.members:
            weights.add_metric([*lv, str(m["rank"])], m["weights"])
            memory.add_metric([*lv, str(m["rank"])], m["memory"])
        yield weights
        yield memory
        if g.progress is not None:
            yield _rank_steps(lv, g.progress)


def _rank_steps(lv: list[str], progress) -> HistogramMetricFamily:
    """Each member's part of each pipeline step, as rank 0 sees it (`group/progress.py`):
    the slow Mac of a group is the rank with the longest parts."""
    h = HistogramMetricFamily("orchard_group_rank_step_seconds",
                              "Each member's part of each pipeline step: from when its input was there (or it "
                              "finished its previous step) to its notice that its output is on its way, as rank 0 "
                              "sees the notices.", labels=(*LABELS, "rank"))
    for rank in sorted(progress.buckets):
        counts, cumulative, buckets = list(progress.buckets[rank]), 0, []
        for edge, n in zip((*STEP_BUCKETS, float("inf")), counts):
            cumulative += n
            buckets.append((repr(edge) if edge != float("inf") else "+Inf", cumulative))
        h.add_metric([*lv, str(rank)], buckets, progress.seconds[rank])
    return h
