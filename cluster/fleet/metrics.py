"""The fleet's metrics, on the router's Prometheus registry (the names are a contract: the
README's Metrics section, the dashboards).

Counters and histograms count as loads, unloads and waits happen; the gauges (models
loaded and memory per node, the footprint estimate's error per model) are read from the
controller at scrape time, so a node or model gone takes its series with it. The fetch
counters add up what the nodes' reports say they fetched (`TransferTotal`, per start of
each agent), so they count on across an agent's restart and a node's departure.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cluster.proto.orchard.v1 import orchard_pb2 as pb

# A load reads a model's weights from disk and starts a process: seconds to many minutes.
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)

# outcome label values of orchard_fleet_loads_total
LOADED = "loaded"  # this router placed and started it
FOUND = "found"  # it was placed already (a restart, another router's load)


class FetchTotals:
    """The fleet's fetches by kind ("hub", "peer"), from the nodes' `transfer_totals`: each
    agent's start (`instance_id`) counts from zero, so what a node reported is kept per
    start, and a start's last report stands once it is gone."""

    FIELDS = ("bytes", "seconds", "fetches", "failures")

    def __init__(self):
        self._ended: dict[str, list[float]] = {}  # kind -> totals of agent starts gone
        self._latest: dict[tuple[str, str], dict[str, list[float]]] = {}  # (node, instance) -> kind -> totals

    def update(self, reports: list[pb.NodeReport]) -> dict[str, list[float]]:
        """Take the nodes' latest reports; returns kind -> [bytes, seconds, fetches, failures]."""
        for r in reports:
            key = (r.node_id, r.instance_id)
            for old in [k for k in self._latest if k[0] == r.node_id and k != key]:  # that agent restarted
                for kind, totals in self._latest.pop(old).items():
                    self._add(self._ended, kind, totals)
            self._latest[key] = {t.kind: [float(getattr(t, f)) for f in self.FIELDS] for t in r.transfer_totals}
        out = {kind: list(totals) for kind, totals in self._ended.items()}
        for per_kind in self._latest.values():
            for kind, totals in per_kind.items():
                self._add(out, kind, totals)
        return out

    @staticmethod
    def _add(into: dict[str, list[float]], kind: str, totals: list[float]) -> None:
        into[kind] = [a + b for a, b in zip(into.get(kind, [0.0] * len(totals)), totals)]


class _FleetGauges:
    def __init__(self, controller):
        self.controller = controller
        self.fetches = FetchTotals()

    def collect(self):
        nodes = self.controller.nodes.nodes()
        yield from self._fetches(nodes)
        loaded = GaugeMetricFamily("orchard_fleet_models_loaded", "Catalog models with a worker on each node "
                                   "(starting, loading or running)", labels=["node"])
        memory = GaugeMetricFamily("orchard_fleet_node_memory_bytes", "Each node's memory for models: its budget, "
                                   "and what it has reserved for the workers it runs", labels=["node", "kind"])
        for info in nodes:
            r = info.report
            loaded.add_metric([r.node_id], len({w.model for w in r.workers if w.state in ("starting", "loading",
                                                                                           "running")}))
            memory.add_metric([r.node_id, "budget"], r.memory_budget_bytes)
            memory.add_metric([r.node_id, "reserved"], r.memory_reserved_bytes)
        yield loaded
        yield memory
        error = GaugeMetricFamily("orchard_fleet_footprint_error_ratio", "A loaded model's resident memory as its "
                                  "worker measured it, over the footprint estimate, minus 1", labels=["model"])
        for model, ratio in sorted(self.controller.footprint_errors().items()):
            error.add_metric([model], ratio)
        yield error
        replicas = GaugeMetricFamily("orchard_fleet_replicas", "A catalog model's replicas (each a worker or a group: "
                                     "starting, loading or running)", labels=["model"])
        for model, count in sorted(self.controller.replica_counts().items()):
            replicas.add_metric([model], count)
        yield replicas

    def _fetches(self, nodes: list[pb.NodeInfo]):
        totals = self.fetches.update([n.report for n in nodes])
        fetched = CounterMetricFamily("orchard_fleet_fetch_bytes", "Bytes of model files the nodes fetched, by "
                                      "kind (hub: pulled; peer: copied from another node)", labels=["kind"])
        seconds = CounterMetricFamily("orchard_fleet_fetch_seconds", "Time the nodes spent in finished fetches, "
                                      "by kind", labels=["kind"])
        fetches = CounterMetricFamily("orchard_fleet_fetches", "Fetches of model files the nodes finished, by kind "
                                      "and outcome (ok, failed)", labels=["kind", "outcome"])
        for kind, (size, spent, ok, failed) in sorted(totals.items()):
            fetched.add_metric([kind], size)
            seconds.add_metric([kind], spent)
            fetches.add_metric([kind, "ok"], ok)
            fetches.add_metric([kind, "failed"], failed)
        yield fetched
        yield seconds
        yield fetches


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.prometheus = registry
        self.loads = Counter("orchard_fleet_loads_total", "Loads of catalog models, by outcome (loaded, found: "
                             "placed already, no_room, timeout, error)", ["model", "outcome"], registry=registry)
        self.unloads = Counter("orchard_fleet_unloads_total", "Unloads of catalog models, by reason (keep_alive, "
                               "evicted, operator)", ["model", "reason"], registry=registry)
        self.load_seconds = Histogram("orchard_fleet_load_seconds", "Time from a load's start to its worker "
                                      "registered healthy", buckets=LOAD_BUCKETS, registry=registry)
        self.load_wait_seconds = Histogram("orchard_fleet_load_wait_seconds", "Time requests were held for their "
                                           "model to load", buckets=LOAD_BUCKETS, registry=registry)
        self.replacements = Counter("orchard_fleet_replacements_total", "Models placed again, by reason "
                                    "(node_lost: a node it ran on stopped reporting; crash: its workers kept "
                                    "exiting and were stopped)", ["reason"], registry=registry)
        self.scale_events = Counter("orchard_fleet_scale_events_total", "Replicas of catalog models added (up) "
                                    "or removed (down) as their traffic asked", ["model", "direction"],
                                    registry=registry)
        self._gauges = None

    def watch(self, controller) -> None:
        """Read the per-node and per-model gauges from `controller` at each scrape."""
        if self._gauges is None:
            self._gauges = _FleetGauges(controller)
            self.prometheus.register(self._gauges)
