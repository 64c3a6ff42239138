"""The target's side of a run, from its Prometheus `/metrics`.

Counters are scraped before and after the run and subtracted; gauges (KV usage, running,
waiting) are sampled every `interval` seconds during the run for the plots and the peaks
of running and waiting. The KV-usage peak comes from every step instead: a worker counts
each step's usage into a histogram (`orchard_step_kv_cache_usage_ratio`), and the peak is
the upper edge of the highest bucket the run's steps reached, whenever a scrape happened
to look (samples only where a worker exports no such histogram). Give
the metrics endpoints of the workers (KV, preemptions, prefix cache) and of the router
(request outcomes, retries): a router's own `/metrics` has no KV numbers.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)

STEP_KV_HISTOGRAM = "orchard_step_kv_cache_usage_ratio"


def metrics_url(address: str) -> str:
    """HOST:PORT or a URL -> the URL of its /metrics."""
    url = address if "://" in address else f"http://{address}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def parse(text: str) -> dict[Key, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(values: dict[Key, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lv), v in values.items() if n == name and want <= set(lv))


@dataclass
class ServerSample:
    t: float  # seconds since the sampler started
    url: str
    values: dict[Key, float]


@dataclass
class ServerSummary:
    kv_usage_peak: float | None = None  # max over workers (0..1): see the module's docstring
    kv_usage_peak_by_worker: dict[str, float] = field(default_factory=dict)
    running_peak: int | None = None  # the cluster's total at its highest sample
    waiting_peak: int | None = None
    preemptions: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    prefix_cache_hit_rate: float | None = None
    prompt_tokens: int | None = None
    generation_tokens: int | None = None
    # speculative decoding (workers with --speculative-config): draft tokens scored and accepted
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    spec_acceptance_rate: float | None = None  # accepted / draft tokens
    spec_acceptance_by_position: list[float] = field(default_factory=list)  # accepted at j / verify rounds
    router_requests_by_outcome: dict[str, int] = field(default_factory=dict)
    router_retries_by_kind: dict[str, int] = field(default_factory=dict)
    # KV events (cluster/kv/events.py): published by the workers; snapshots sent instead; the router's resyncs
    kv_events: int | None = None
    kv_event_snapshots: int | None = None
    router_kv_resyncs_by_reason: dict[str, int] = field(default_factory=dict)
    # the prefix cache's tiers: prompt tokens found per tier; with a disk tier (--kv-disk-dir)
    # its bytes written and read, its reads (count, seconds) and what it held at the end
    kv_hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    kv_disk_bytes_written: int | None = None
    kv_disk_bytes_read: int | None = None
    kv_disk_reads: int | None = None
    kv_disk_read_seconds: float | None = None
    kv_disk_usage_bytes: int | None = None
    kv_series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # worker -> [(t, usage)]
    errors: list[str] = field(default_factory=list)


class ServerMetricsSampler:
    """`await before()`, `start()` (samples in the background), `await after()` -> summary."""

    def __init__(self, addresses: list[str], interval: float = 0.5, timeout: float = 5.0):
        self.urls = [metrics_url(a) for a in addresses]
        self.interval = interval
        self.timeout = timeout
        self.samples: list[ServerSample] = []
        self.errors: list[str] = []
        self._before: dict[str, dict[Key, float]] = {}
        self._task: asyncio.Task | None = None
        self._session = None
        self._t0 = time.perf_counter()

    async def _scrape(self, url: str) -> dict[Key, float] | None:
        import aiohttp

        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
                return parse(await r.text())
        except Exception as e:  # noqa: BLE001  (a missed scrape is reported, not fatal)
            if len(self.errors) < 20:
                self.errors.append(f"{url}: {type(e).__name__}: {e}")
            return None

    async def _scrape_all(self) -> dict[str, dict[Key, float] | None]:
        results = await asyncio.gather(*(self._scrape(u) for u in self.urls))
        return dict(zip(self.urls, results, strict=True))

    async def before(self) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        self._t0 = time.perf_counter()
        for url, values in (await self._scrape_all()).items():
            if values is not None:
                self._before[url] = values
                self.samples.append(ServerSample(0.0, url, values))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            now = time.perf_counter() - self._t0
            for url, values in (await self._scrape_all()).items():
                if values is not None:
                    self.samples.append(ServerSample(now, url, values))

    async def after(self) -> ServerSummary:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        now = time.perf_counter() - self._t0
        after = {}
        for url, values in (await self._scrape_all()).items():
            if values is not None:
                after[url] = values
                self.samples.append(ServerSample(now, url, values))
        if self._session is not None:
            await self._session.close()
            self._session = None
        return self.summarize(after)

    def _step_peaks(self, after: dict[str, dict[Key, float]]) -> dict[str, float]:
        """Per worker, the upper edge of the highest per-step KV-usage bucket that the run's
        steps reached (from the histogram's bucket counts after - before)."""
        name = STEP_KV_HISTOGRAM + "_bucket"
        grown: dict[str, dict[float, float]] = defaultdict(dict)  # worker -> le -> steps in the run
        for url, values in after.items():
            before = self._before.get(url)
            if before is None:
                continue
            for (n, labels), v in values.items():
                lv = dict(labels)
                if n == name and lv.get("le") != "+Inf":
                    grown[lv.get("worker", url)][float(lv["le"])] = v - before.get((n, labels), 0.0)
        peaks = {}
        for worker, by_edge in grown.items():
            steps = max(by_edge.values(), default=0.0)  # cumulative: the last edge holds every step
            if steps > 0:
                peaks[worker] = min(edge for edge, n in by_edge.items() if n == steps)
        return peaks

    def summarize(self, after: dict[str, dict[Key, float]]) -> ServerSummary:
        s = ServerSummary(errors=list(self.errors))
        # gauges: peaks over the samples, per worker label
        kv: dict[str, list[tuple[float, float]]] = defaultdict(list)
        by_time: dict[float, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        seen_worker_gauges = False
        for sample in self.samples:
            for (name, labels), v in sample.values.items():
                lv = dict(labels)
                worker = lv.get("worker", sample.url)
                if name == "orchard_kv_cache_usage_ratio":
                    kv[worker].append((sample.t, v))
                elif name in ("orchard_num_requests_running", "orchard_num_requests_waiting"):
                    seen_worker_gauges = True
                    by_time[round(sample.t, 1)][name] += v
        if kv:
            s.kv_series = dict(kv)
            s.kv_usage_peak_by_worker = {w: max(v for _, v in pts) for w, pts in kv.items()}
        s.kv_usage_peak_by_worker.update(self._step_peaks(after))
        if s.kv_usage_peak_by_worker:
            s.kv_usage_peak = max(s.kv_usage_peak_by_worker.values())
        if seen_worker_gauges:
            s.running_peak = int(max(d["orchard_num_requests_running"] for d in by_time.values()))
            s.waiting_peak = int(max(d["orchard_num_requests_waiting"] for d in by_time.values()))

        # counters: after - before, over the endpoints scraped both times
        def delta(name: str, **labels: str) -> float | None:
            urls = [u for u in after if u in self._before]
            have = [u for u in urls if any(n == name for n, _ in after[u])]
            if not have:
                return None
            return sum(total(after[u], name, **labels) - total(self._before[u], name, **labels) for u in have)

        def as_int(x: float | None) -> int | None:
            return None if x is None else int(round(x))

        s.preemptions = as_int(delta("orchard_num_preemptions_total"))
        s.prefix_cache_queries = as_int(delta("orchard_prefix_cache_queries_total"))
        s.prefix_cache_hits = as_int(delta("orchard_prefix_cache_hits_total"))
        if s.prefix_cache_queries:
            s.prefix_cache_hit_rate = (s.prefix_cache_hits or 0) / s.prefix_cache_queries
        s.prompt_tokens = as_int(delta("orchard_prompt_tokens_total"))
        s.generation_tokens = as_int(delta("orchard_generation_tokens_total"))
        s.spec_draft_tokens = as_int(delta("orchard_spec_decode_num_draft_tokens_total"))
        s.spec_accepted_tokens = as_int(delta("orchard_spec_decode_num_accepted_tokens_total"))
        if s.spec_draft_tokens:
            s.spec_acceptance_rate = (s.spec_accepted_tokens or 0) / s.spec_draft_tokens
            rounds = delta("orchard_spec_decode_num_drafts_total") or 0
            positions = sorted({int(dict(lv)["position"]) for u in after for n, lv in after[u]
                                if n == "orchard_spec_decode_num_accepted_tokens_per_pos_total"})
            for j in positions:
                d = delta("orchard_spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) or 0
                s.spec_acceptance_by_position.append(d / rounds if rounds else 0.0)
        s.kv_disk_bytes_written = as_int(delta("orchard_kv_disk_bytes_written_total"))
        s.kv_disk_bytes_read = as_int(delta("orchard_kv_disk_bytes_read_total"))
        s.kv_disk_reads = as_int(delta("orchard_kv_disk_read_seconds_count"))
        s.kv_disk_read_seconds = delta("orchard_kv_disk_read_seconds_sum")
        if any(n == "orchard_kv_disk_usage_bytes" for u in after for n, _ in after[u]):
            s.kv_disk_usage_bytes = as_int(sum(total(after[u], "orchard_kv_disk_usage_bytes") for u in after))
        s.kv_events = as_int(delta("orchard_kv_events_total"))
        s.kv_event_snapshots = as_int(delta("orchard_kv_event_snapshots_total"))
        for label, name, target in (("outcome", "orchard_router_requests_total", s.router_requests_by_outcome),
                                    ("kind", "orchard_router_retries_total", s.router_retries_by_kind),
                                    ("reason", "orchard_router_kv_resyncs_total", s.router_kv_resyncs_by_reason),
                                    ("tier", "orchard_kv_cache_hit_tokens_total", s.kv_hit_tokens_by_tier)):
            values = set()
            for u in after:
                values |= {dict(lv).get(label) for n, lv in after[u] if n == name}
            for value in sorted(v for v in values if v):
                d = delta(name, **{label: value})
                if d is not None:
                    target[value] = as_int(d)
        return s
