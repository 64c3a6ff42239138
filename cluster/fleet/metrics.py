"""The fleet's metrics, on the router's Prometheus registry (the names are a contract: the
README's Metrics section, the dashboards).

Counters and histograms count as loads, unloads and waits happen; the gauges (models
loaded and memory per node, the footprint estimate's error per model) are read from the
controller at scrape time, so a node or model gone takes its series with it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

# A load reads a model's weights from disk and starts a process: seconds to many minutes.
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)

# outcome label values of orchard_fleet_loads_total
LOADED = "loaded"  # this router placed and started it
FOUND = "found"  # it was placed already (a restart, another router's load)


class _FleetGauges:
    def __init__(self, controller):
        self.controller = controller

    def collect(self):
        nodes = self.controller.nodes.nodes()
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
        self._gauges = None

    def watch(self, controller) -> None:
        """Read the per-node and per-model gauges from `controller` at each scrape."""
        if self._gauges is None:
            self._gauges = _FleetGauges(controller)
            self.prometheus.register(self._gauges)
