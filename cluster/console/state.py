"""What the console shows, as one JSON-ready dict built from what a server already holds.

`RouterState` reads the router's registry (workers, their load reports, groups and ranks,
start failures), its recent-requests ring, and, with a fleet, the node agents' reports
and the catalog. `WorkerState` is a worker's view of itself. Neither asks anything of a
worker: a snapshot costs a walk over in-memory records (and the catalog's reads, with a
fleet).

A snapshot holds no ages that move by themselves (a node's "seconds since its report",
a model's idle seconds become "idle since" times): two snapshots of an idle cluster are
equal, so a push goes out only when something changed.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.registry import STATE_NAMES

if TYPE_CHECKING:
    from cluster.fleet.controller import FleetController
    from cluster.fleet.nodes import NodeRegistry
    from cluster.router.recent import RecentRequests
    from cluster.router.registry import Registry

RATE_WINDOW_SECONDS = 5.0  # tokens/s "now": over this window
TTFT_WINDOW_SECONDS = 60.0  # TTFT "now": the median of the requests begun in this window
REQUESTS_SHOWN = 100


class TokenRates:
    """Tokens/s per key over the last RATE_WINDOW_SECONDS, from ever-growing counts sampled
    at most once a second (whoever asks, however often)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._samples: deque[tuple[float, dict[str, int]]] = deque()

    def rates(self, counts: dict[str, int]) -> dict[str, float]:
        now = self.clock()
        if not self._samples or now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, dict(counts)))
            while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_SECONDS:
                self._samples.popleft()
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return {k: 0.0 for k in counts}
        return {k: round(max(0, last.get(k, 0) - first.get(k, 0)) / (t1 - t0), 1) for k in counts}


def load_fields(report: pb.LoadReport) -> dict:
    """A load report's fields the console shows (one worker, or a group's rank 0 for all)."""
    out = {"model": report.model, "running": report.num_running, "waiting": report.num_waiting,
           "max_num_seqs": report.max_num_seqs, "kv_used": report.kv_blocks_used,
           "kv_total": report.kv_blocks_total, "max_model_len": report.max_model_len,
           "resident_bytes": report.resident_bytes, "tasks": list(report.tasks),
           "reason": report.unhealthy_reason, "stalled": report.stalled, "lagging": report.lagging,
           "group": None}
    if report.HasField("group"):
        g = report.group
        out["group"] = {"size": g.size, "parallel": g.parallel, "ranks": [
            {"rank": m.rank, "host": m.host, "first_layer": m.first_layer, "last_layer": m.last_layer,
             "weight_bytes": m.weight_bytes, "memory_bytes": m.memory_bytes,
             "step_ms": round(m.step_seconds * 1000, 1)} for m in g.members]}
    return out


def node_fields(info: pb.NodeInfo) -> dict:
    r = info.report
    return {"id": r.node_id, "address": r.address, "platform": r.platform, "state": info.state,
            "memory_budget": r.memory_budget_bytes, "memory_reserved": r.memory_reserved_bytes,
            "memory_available": r.memory_available_bytes, "disk_free": r.disk_free_bytes,
            "disk_used": r.disk_used_bytes, "disk_budget": r.disk_budget_bytes,
            "models": [{"name": d.name, "weight_bytes": d.weight_bytes, "error": d.error} for d in r.models],
            "workers": [{"id": w.worker_id, "model": w.model, "state": w.state, "reserved_bytes": w.reserved_bytes,
                         "rank": w.group_rank, "size": w.group_size or 1, "progress": round(w.progress, 2),
                         "reason": w.reason} for w in r.workers],
            "transfers": [{"source": t.source, "from": getattr(t, "from"), "done": t.bytes_done,
                           "total": t.bytes_total} for t in r.transfers]}


def catalog_fields(entry: pb.CatalogModel, now: float) -> dict:
    return {"name": entry.name, "source": entry.source, "pin": entry.pin, "state": entry.state,
            "status": entry.status, "footprint_bytes": entry.footprint_bytes,
            "measured_bytes": entry.measured_bytes,
            "idle_since": round(now - entry.idle_seconds) if entry.idle_seconds else None,
            "placements": [{"node": p.node_id, "worker": p.worker_id, "state": p.state, "rank": p.group_rank,
                            "size": p.group_size or 1, "reserved_bytes": p.reserved_bytes}
                           for p in entry.placements]}


@dataclass
class RouterState:
    """The router's console state (`snapshot()`): see the module docstring. `about` is the
    router's own line (its addresses and policy)."""

    registry: Registry
    recent: RecentRequests
    about: Callable[[], dict]
    nodes: NodeRegistry | None = None
    controller: FleetController | None = None

    def __post_init__(self):
        self.rates = TokenRates()

    def snapshot(self) -> dict:
        now = time.time()
        workers = self.registry.snapshot()
        rates = self.rates.rates({w.worker_id: w.tokens_relayed for w in workers})
        where = {}
        if self.controller is not None:
            rows = [pb.WorkerInfo(worker_id=w.worker_id) for w in workers]
            self.controller.annotate(rows)
            where = {r.worker_id: (r.node_id, r.catalog_model) for r in rows if r.node_id}
        ttfts_of = self.recent.ttfts(now - TTFT_WINDOW_SECONDS)
        shown = []
        for w in sorted(workers, key=lambda w: w.worker_id):
            ttfts = ttfts_of.get(w.worker_id)
            node, catalog_model = where.get(w.worker_id, ("", ""))
            shown.append({"id": w.worker_id, "address": w.address, "state": STATE_NAMES[w.state],
                          "static": w.static, "circuit": w.breaker.state, "inflight": w.inflight,
                          "tokens_per_s": rates.get(w.worker_id, 0.0),
                          "ttft": round(statistics.median(ttfts), 4) if ttfts else None,
                          "node": node, "catalog_model": catalog_model, **load_fields(w.report)})
        failures = [{"id": f.worker_id, "model": f.model, "reason": f.reason, "exit_code": f.exit_code,
                     "permanent": f.permanent} for f in list(self.registry.failures.values())]
        state = {"role": "router", "router": self.about(), "workers": shown, "failures": failures,
                 "nodes": [], "catalog": None, "requests": self.recent.rows(REQUESTS_SHOWN)}
        if self.nodes is not None:
            state["nodes"] = [node_fields(n) for n in self.nodes.nodes()]
        if self.controller is not None:
            state["catalog"] = [catalog_fields(e, now) for e in self.controller.catalog_models()]
        return state


@dataclass
class WorkerState:
    """A worker's console state: itself alone (`report()`: its load report now)."""

    report: Callable[[], pb.LoadReport]
    about: Callable[[], dict]

    def snapshot(self) -> dict:
        report = self.report()
        state = "unhealthy" if report.stalled or report.unhealthy_reason else (
            "draining" if report.draining else "healthy")
        me = {"id": report.worker_id, "address": self.about().get("grpc", ""), "state": state, "static": True,
              "circuit": "closed", "inflight": report.num_running + report.num_waiting, "tokens_per_s": None,
              "ttft": None, "node": "", "catalog_model": "", **load_fields(report)}
        return {"role": "worker", "router": self.about(), "workers": [me], "failures": [], "nodes": [],
                "catalog": None, "requests": []}
