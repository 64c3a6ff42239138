"""FleetController: the router's part of the fleet. It loads catalog models on the fleet's
nodes when requests name them, unloads them when their keep-alive runs out or another
model needs their room, and keeps the catalog's record of what runs where.

Loading a model (`ensure_loaded`, never blocking; `load`, awaited):
- **Single flight.** One load task per model in this router, and the catalog's claim
  (`Catalog.claim`, a row per model in the shared SQLite file) across routers: a router
  that cannot take the claim starts nothing and waits for the worker the other one starts
  (workers register with every router). A model already placed (a node reports a worker
  of it, or the catalog records one on a node not heard from yet) is never started again:
  its requests wait for that worker.
- **Placement** (`cluster.fleet.placement`, the one policy): a footprint per node from the
  node's facts of the model's files (`cluster.fleet.footprint`) with the entry's context
  and `--fleet-concurrency` requests of it in the KV pool. Evictions go first, each by
  draining (`NodeSide.stop` drains: a request in flight finishes); then one worker, or a
  pipeline group whose ring ports and side-channel port are reserved on its nodes before
  any rank starts. The load ends when the worker (a group's rank 0) registers healthy with
  this router, bounded by `--load-timeout`; its placement is recorded in the catalog.
- **Where the files are not.** Every healthy node is a candidate: one without the model's
  files is given the footprint of a same-platform node's files, or of what a node
  describes of an hf: source (`NodeSide.describe`: the hub's metadata), and the policy
  counts the fetch's time. Before a worker (a group's rank: its layers' files only) starts
  on such a node, the node fetches the files (`NodeSide.fetch`): copied from the healthy
  nodes that hold them, else pulled from the hub; the model is "copying" or "pulling"
  meanwhile, with its progress.
- **Failure** (no room: the message says what is needed and what each node has; a start
  refused; a worker that exited or never registered) is kept as `load_error(model)` for
  `LOAD_RETRY_AFTER` seconds: requests held for the model fail at once with it, and new
  ones too until a new load may be tried. Workers started for a failed load are stopped.

Keep-alive (Ollama's meaning): the entry's, or `--default-keep-alive`, or the latest
request's `keep_alive`, counted from when the model's last request finished; 0 unloads
after the request, negative never. A pinned model is never unloaded for its keep-alive nor
evicted, and no model is unloaded while this router has requests of it in flight or its
workers report any running (another router's). The proxy tells the controller of each
request (`request_started` / `request_finished`).

A lost Mac (`replace_lost`, every tick): a node silent for the router's --remove-after
takes its workers with it; each model that ran there is placed again on the nodes that
remain (a group's ranks left are stopped first: it is formed afresh, over the nodes left or
on one node if it now fits), while its requests wait in the router's hold. A node that
comes back is a candidate again with the files it holds; the workers it still runs of
models placed elsewhere since are stopped.

Replicas (`scale`, every tick; the rule is `cluster.fleet.scaling`'s): a loaded model has
between max(min_replicas, 1) and max_replicas replicas, each a worker or a group. The proxy
tells the controller each request's wait for its first token (`request_waited`). One more
is placed as a load is, under the model's claim, on a node that runs none of its replicas
(idle models evicted there if the placement rule allows); one fewer is the replica with
the fewest requests in flight, taken out of the router's pool and drained before it stops.
A model's first replica is its load; the others up to min_replicas follow at once.

After a router restart (`run`), the controller takes the nodes' reports as the truth: a
placement the catalog records whose worker no node reports is forgotten, a worker a node
runs for a catalog model is the model's (nothing is loaded twice), and one it runs for a
model no longer in the catalog is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import grpc

from cluster.fleet import FleetError, facts, footprint, hub, placement, scaling
from cluster.fleet.catalog import Placement, parse_duration, worker_flags
from cluster.fleet.config import FleetConfig
from cluster.fleet.metrics import FOUND, LOADED
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.registry import HEALTHY

if TYPE_CHECKING:
    from cluster.fleet.catalog import Catalog
    from cluster.fleet.metrics import FleetMetrics
    from cluster.fleet.nodes import NodeSide
    from cluster.router.registry import Registry

log = logging.getLogger(__name__)

# A failed load's error answers the model's requests this long before another load is
# tried: a burst of requests for a model that cannot fit gets one answer, not one load each.
LOAD_RETRY_AFTER = 5.0
# The run loop's period: keep-alive expiry and the reconcile with the nodes' reports.
TICK = 1.0
# A catalog claim's life unless its holder renews it, which it does every TICK while its load
# or unload runs: a router that dies mid-load blocks the model on the others this long at most.
CLAIM_TTL = 15.0
# A worker started again this often without serving is crash-looping: the load waiting for it fails.
MAX_LOAD_RESTARTS = 3
# How long an eviction or unload lets a worker's requests in flight finish before it stops.
DRAIN_TIMEOUT = 120.0
STOP_GRACE = 60.0  # ... and then to stop (SIGTERM, SIGKILL after a grace)
QUIET_DRAIN = 1.0  # the drain of a worker a failed load started: it has no requests
STOP_CLEANUP = 10.0  # how long the router's stop waits for its cancelled loads' cleanups
# A placement the catalog records on a node not heard from since this router started is
# waited for this long (the node's first report after a router restart) before it is forgotten.
NODE_GRACE = 10.0
MAX_SLUG_CHARS = 40  # of a model's name in its workers' ids (and so their file names)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
DISK_FULL_RETRY = 60.0  # a node whose disk budget refused a model's files is not fetched onto again this long
LIVE = ("starting", "loading", "running")  # ManagedWorker states of a worker that serves or will


def source_name(source: str) -> str:
    """The name a node holds a catalog source under (`DiskModel.name`): a hub source's
    canonical `hf:ORG/REPO@REV` (`@main` when it names no revision), else its name under
    `--models-dir`."""
    if hub.is_hub_source(source):
        return hub.canonical(source)
    if source.startswith("ollama:"):
        return source
    return PurePosixPath(source.rstrip("/")).name


class _CannotFetch(FleetError):
    """The node side fetches no files (UNIMPLEMENTED: Ray's nodes)."""


class _NodeLost(FleetError):
    """A worker a load started was lost with its node (`replace_lost`)."""


class _NoDiskRoom(FleetError):
    """A node's disk budget has no room for the model's files (RESOURCE_EXHAUSTED)."""

    def __init__(self, code: grpc.StatusCode, message: str, node_id: str):
        super().__init__(code, message)
        self.node_id = node_id


@dataclass
class _Fetch:
    """A model's files being fetched onto a node for a load (`FetchProgress` as it comes)."""

    origin: str  # "hub" or the peer node's id
    done: int = 0
    total: int = 0


@dataclass
class _Use:
    """This router's use of a loaded model."""

    active: int = 0  # requests in flight here
    idle_since: float = 0.0  # when the last one finished (or the model was found loaded)
    keep_alive: float | None = None  # the latest request's keep_alive, seconds (None: it gave none, the entry's)
    uses: float = 0.0  # its recent requests as of idle_since, decayed (`placement.used`)


@dataclass(frozen=True)
class _Sizing:
    """A catalog entry's workers' --max-num-seqs and --block-size, and the full contexts of
    their KV pool."""

    max_num_seqs: int
    block_size: int
    contexts: int


@dataclass(frozen=True)
class Member:
    """One worker of a placed model, as a node reports it."""

    node_id: str
    worker: pb.ManagedWorker

    @property
    def live(self) -> bool:
        return self.worker.state in LIVE


@dataclass
class _Placed:
    """What the controller knows of a model placed on the fleet (from the nodes' reports)."""

    members: list[Member] = field(default_factory=list)

    @property
    def node_ids(self) -> list[str]:
        return sorted({m.node_id for m in self.members})

    def replicas(self) -> dict[str, list[Member]]:
        """Its live replicas: rank 0's worker id -> the replica's members (a worker alone,
        or a group's ranks, rank 0 first)."""
        out: dict[str, list[Member]] = {}
        for m in sorted((m for m in self.members if m.live), key=lambda m: m.worker.group_rank):
            out.setdefault(_group_id(m.worker), []).append(m)
        return out


class FleetController:
    """The router's fleet (the module docstring says how it loads and unloads). It runs on
    the router's event loop: `ensure_loaded` and the request hooks never block; `load`,
    `unload` and `run` are awaited. Its writes to the catalog (claims, placements, a
    model's last use) run on threads: one may wait for another router's transaction."""

    def __init__(self, catalog: Catalog, nodes: NodeSide, registry: Registry, metrics: FleetMetrics | None,
                 config: FleetConfig, router_id: str, clock=time.monotonic):
        self.catalog = catalog
        self.nodes = nodes
        self.registry = registry
        self.metrics = metrics
        self.config = config
        self.router_id = router_id
        self.clock = clock
        self.default_keep_alive = parse_duration(config.default_keep_alive)
        self._loads: dict[str, asyncio.Task] = {}
        self._unloads: dict[str, asyncio.Task] = {}
        self._errors: dict[str, tuple[FleetError, float]] = {}
        self._use: dict[str, _Use] = {}
        self._estimates: dict[str, int] = {}  # worker id -> the footprint it was started with
        # model -> (node, bytes) its load set aside from its plan until its workers serve: two
        # loads planned at once must not both count on a room the nodes' reports show free
        self._pending: dict[str, list[tuple[str, int]]] = {}
        self._waiting_for_room: dict[str, str] = {}  # model -> why it does not fit yet (busy models hold the room)
        self._load_seconds: dict[str, float] = {}  # model -> its last load's time
        self._unload_starts: dict[str, int] = {}  # model -> unloads begun (a load waiting for its worker ends)
        # workers this router stopped that the nodes' last reports may still list (until their next one)
        self._stopped: set[str] = set()
        self._reported: set[str] = set()  # workers the nodes reported, not exited (`_unlist_ended`)
        self._writes: set[asyncio.Future] = set()  # catalog writes in flight off the loop (`_write_soon`)
        self._touches: dict[str, float] = {}  # model -> its last request's end, not written yet
        self._forgetting: set[str] = set()  # models whose placements `reconcile` is forgetting
        # (source name, platform) -> a DiskModel a node described for nodes of that platform
        # without the files (`_describe_missing`), and the latest failure to describe one
        self._described: dict[tuple[str, str], pb.DiskModel] = {}
        self._describe_failed: dict[str, tuple[FleetError, float]] = {}
        self._fetching: dict[str, dict[str, _Fetch]] = {}  # model -> node -> its fetch for a load
        self._fetch_cut: dict[str, str] = {}  # model -> its fetch in words, when its load's timeout cut it
        self._disk_full: dict[tuple[str, str], tuple[_NoDiskRoom, float]] = {}  # (source, node) -> refusal, when
        # workers on a node lost whose models were placed again (worker id -> node): no model's
        # any more; stopped if their node comes back still running them (`replace_lost`)
        self._abandoned: dict[str, str] = {}
        self._fetches = True  # whether the node side fetches files (Ray's does not: `_place_and_start`)
        self._replacing: dict[str, asyncio.Task] = {}  # model -> stopping a group's ranks left, then its load
        self.scale_policy = config.scale_policy
        self._traffic: dict[str, scaling.Traffic] = {}  # loaded model -> its traffic, as the replica rule sees it
        self._scaling: dict[str, asyncio.Task] = {}  # model -> its replica being added or removed
        self._avoid: dict[str, frozenset[str]] = {}  # model -> nodes a replica being added may not go to
        self._scale_failed: dict[str, str] = {}  # model -> why its last replica could not be added (logged once)
        self._started = clock()
        if metrics is not None:
            metrics.watch(self)

    # -- what the proxy asks ----------------------------------------------------------------------
    def knows(self, model: str) -> bool:
        """Whether `model` is a catalog entry."""
        return bool(model) and self.catalog.get(model) is not None

    def names(self) -> list[str]:
        return sorted(e.name for e in self.catalog.entries())

    def ensure_loaded(self, model: str) -> None:
        """Start loading `model` unless a load of it runs (here or, by the catalog's claim, on
        another router), its last load failed less than `LOAD_RETRY_AFTER` seconds ago, or it
        is being unloaded (the load then follows the unload). Never blocks."""
        task = self._loads.get(model)
        if task is not None and not task.done():
            return
        failed = self._errors.get(model)
        if failed is not None:
            if self.clock() - failed[1] < LOAD_RETRY_AFTER:
                return
            del self._errors[model]
        self._loads[model] = asyncio.create_task(self._load_task(model), name=f"fleet load {model}")

    def load_error(self, model: str) -> FleetError | None:
        """The failure of the model's last load, while it answers requests (`LOAD_RETRY_AFTER`)."""
        failed = self._errors.get(model)
        if failed is None or self.clock() - failed[1] >= LOAD_RETRY_AFTER:
            return None
        return failed[0]

    def loading(self, model: str) -> bool:
        task = self._loads.get(model)
        return task is not None and not task.done()

    def waited(self, seconds: float) -> None:
        """A request was held this long for its model to load."""
        if self.metrics is not None:
            self.metrics.load_wait_seconds.observe(seconds)

    def request_started(self, model: str, keep_alive: float | None = None) -> None:
        use = self._use.setdefault(model, _Use(idle_since=self.clock()))
        use.active += 1
        use.keep_alive = keep_alive  # Ollama's: each request's own; one without it, the model's
        self._count_in_flight(model, use.active)

    def request_waited(self, model: str, seconds: float) -> None:
        """A request's wait for its first token, from its arrival here (told at its first
        token, or at its end when it failed before one): what replicas follow."""
        traffic = self._traffic.get(model)
        if traffic is not None:
            traffic.waited(self.clock(), seconds)

    def _count_in_flight(self, model: str, count: int) -> None:
        traffic = self._traffic.get(model)
        if traffic is not None:
            traffic.in_flight(self.clock(), count)

    def request_finished(self, model: str) -> None:
        use = self._use.get(model)
        if use is None or use.active == 0:
            return
        use.active -= 1
        self._count_in_flight(model, use.active)
        now = self.clock()
        use.uses = placement.used(use.uses, use.idle_since, now)
        use.idle_since = now
        if use.active == 0:
            self._touch_soon(model)  # what another router on the catalog counts the model's idle time from
            if self._keep_alive(model) == 0 and self._idle_unpinned(model):  # Ollama's 0: unloaded after it
                self._start_unload(model, "keep_alive")

    def _idle_unpinned(self, model: str) -> bool:
        """Whether `model` runs, is not pinned and has no request in flight here nor reported
        by its workers (another router's). One that has is left to `expire` (its workers'
        next reports). Its load may not have ended yet: the request it served has."""
        return any(m.model == model and not m.pinned and m.in_flight == 0 for m in self._loaded())

    # -- the operator's ---------------------------------------------------------------------------
    async def load(self, model: str) -> pb.CatalogModel:
        """Load `model` now (a no-op when it serves): returns once it serves, or raises the
        load's FleetError."""
        self._entry(model)
        self._errors.pop(model, None)
        self.ensure_loaded(model)
        await asyncio.shield(self._loads[model])
        error = self.load_error(model)
        if error is not None:
            raise error
        return self.describe(model)

    async def unload(self, model: str, reason: str = "operator") -> pb.CatalogModel:
        """Unload `model` now: its workers drain (requests in flight finish), then stop."""
        self._entry(model)
        task = self._loads.get(model)
        if task is not None and not task.done():
            await asyncio.shield(task)
        scaling = self._scaling.get(model)
        if scaling is not None and not scaling.done():  # a replica being added would start after the unload
            scaling.cancel()
            await asyncio.gather(scaling, return_exceptions=True)
        self._start_unload(model, reason, asked=True)
        await asyncio.shield(self._unloads[model])
        return self.describe(model)

    def _entry(self, model: str) -> pb.CatalogModel:
        entry = self.catalog.get(model)
        if entry is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, self.unknown(model))
        return entry

    def unknown(self, model: str) -> str:
        """A NOT_FOUND message for a model neither served nor in the catalog."""
        names = self.names()
        served = sorted({w.model for w in self.registry.snapshot() if w.model and w.model not in names})
        return (f"model {model!r} is not in the fleet's catalog (catalog: {', '.join(names) or 'empty'}"
                + (f"; also served: {', '.join(served)}" if served else "") + ")")

    # -- placed models, from the nodes' reports ---------------------------------------------------
    def placed(self) -> dict[str, _Placed]:
        """Catalog model -> its workers the nodes report (exited ones included), but those
        this router stopped since (a node's report lists them until its next heartbeat)."""
        out: dict[str, _Placed] = {}
        reported = set()
        for info in self.nodes.nodes():
            for w in info.report.workers:
                reported.add(w.worker_id)
                if w.worker_id not in self._stopped and w.worker_id not in self._abandoned:
                    out.setdefault(w.model, _Placed()).members.append(Member(info.report.node_id, w))
        self._stopped &= reported
        return out

    def _live_members(self, model: str) -> list[Member]:
        return [m for m in self.placed().get(model, _Placed()).members if m.live]

    def _reachable_members(self, model: str) -> list[Member]:
        """The model's live workers but those on a node lost (`_lost_nodes`)."""
        lost = self._lost_nodes()
        return [m for m in self._live_members(model) if m.node_id not in lost]

    def _lost_nodes(self) -> set[str]:
        """The nodes gone: unhealthy and silent for the router's --remove-after (a Mac gone
        would hold its models' requests until --load-timeout: they are placed elsewhere
        instead, `replace_lost`). A node silent for a few heartbeats (a busy Mac) keeps its
        workers: nothing is loaded twice."""
        gone_after = self.registry.config.remove_after
        return {n.report.node_id for n in self.nodes.nodes() if n.state != "healthy" and n.age_seconds >= gone_after}

    def _awaited_nodes(self, model: str) -> list[str]:
        """Nodes the catalog records a placement of `model` on that have not reported since
        this router started (within `NODE_GRACE`): the model may be running there."""
        if self.clock() - self._started > NODE_GRACE:
            return []
        known = {info.report.node_id for info in self.nodes.nodes()}
        return sorted({p.node_id for p in self.catalog.placements(model) if p.node_id not in known})

    def serving(self, model: str) -> bool:
        """Some worker of `model` takes requests here (healthy, not draining)."""
        return any(w.state == HEALTHY for w in self.registry.serving(model))

    # -- loading ----------------------------------------------------------------------------------
    async def _load_task(self, model: str) -> None:
        t0 = self.clock()
        outcome = "error"
        self._fetch_cut.pop(model, None)
        try:
            unloading = self._unloads.get(model)
            if unloading is not None and not unloading.done():
                await asyncio.shield(unloading)
            outcome = await asyncio.wait_for(self._load(model), self.config.load_timeout)
        except asyncio.TimeoutError:
            fetching = self._fetch_cut.pop(model, "")
            self._fail(model, FleetError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"model {model!r} did not load within {self.config.load_timeout:g} s "
                                         "(the router's --load-timeout)" + (
                                             f" while {fetching}: a big model's files need a longer --load-timeout "
                                             "the first time" if fetching else "")))
            outcome = "timeout"
        except FleetError as e:
            self._fail(model, e)
            outcome = "no_room" if e.code is grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as e:  # a bug must not leave held requests waiting out the timeout
            log.exception("load of %s failed", model)
            self._fail(model, FleetError(grpc.StatusCode.INTERNAL, f"loading model {model!r} failed: {e}"))
        finally:
            if self.metrics is not None:
                self.metrics.loads.labels(model=model, outcome=outcome).inc()
                if outcome == LOADED:
                    self.metrics.load_seconds.observe(self.clock() - t0)

    def _fail(self, model: str, error: FleetError) -> None:
        log.warning("fleet: load of %s failed: %s", model, error.message)
        self._errors[model] = (error, self.clock())
        self.registry.notify()  # the requests held for it fail now

    async def _load(self, model: str) -> str:
        """One load: "loaded" (this router started it) or "found" (it was placed already, or
        another router loaded it: its worker registers here too)."""
        while True:
            if self.serving(model):
                return FOUND
            replacing = self._replacing.get(model)
            if replacing is not None and not replacing.done():  # its broken group's ranks stop first: their room
                await asyncio.shield(replacing)                 # is the new placement's
                continue
            scaling = self._scaling.get(model)
            if scaling is not None and not scaling.done():  # a replica being added is placed under this router's
                await asyncio.gather(asyncio.shield(scaling), return_exceptions=True)  # claim too: it may serve
                continue
            if not (self._reachable_members(model) or self._awaited_nodes(model)) \
                    and await self._write(self.catalog.claim, model, self.router_id, CLAIM_TTL):
                break
            await self._fail_crash_looping(model)
            await self._tick()  # its worker, placed already or by another router, registers here
        async with self._holding_claim(model):
            if self._reachable_members(model):  # the router that held the claim placed it meanwhile
                await self._wait_serving(model)
                return FOUND
            t0 = self.clock()
            await self._place_and_start(model)
            self._load_seconds[model] = self.clock() - t0
            self._use.setdefault(model, _Use()).idle_since = self.clock()
            return LOADED

    @contextlib.asynccontextmanager
    async def _holding_claim(self, model: str):
        """While the body runs, renew this router's claim on `model` (taken already) every
        `TICK`; then release it."""
        done = asyncio.Event()

        async def renew() -> None:
            while not done.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), TICK)
                if not done.is_set():
                    try:
                        await self._write(self.catalog.claim, model, self.router_id, CLAIM_TTL)
                    except Exception as e:  # the catalog busy for a moment: the next tick renews it
                        log.warning("fleet: renewing the claim on %s: %s", model, e)

        renewing = asyncio.create_task(renew(), name=f"fleet claim {model}")
        try:
            yield
        finally:
            done.set()
            await asyncio.gather(renewing, return_exceptions=True)  # its write done: not after the release
            await self._write(self.catalog.release, model, self.router_id)

    async def _tick(self) -> None:
        """Until the workers or the nodes change, at most `TICK` seconds."""
        await _either(self.registry.wait_changed(TICK), self.nodes.wait_changed(TICK))

    async def _wait_serving(self, model: str, worker_id: str | None = None) -> None:
        """Until a worker of `model` (`worker_id`, when given: raises when it exits or
        fails to start) registers healthy, or an unload of the model begins (only a request
        it served starts one during a load: keep_alive 0 may end it before this wakes)."""
        unloads = self._unload_starts.get(model, 0)
        while not any(w.state == HEALTHY and (worker_id is None or w.worker_id == worker_id)
                      for w in self.registry.serving(model)):
            if self._unload_starts.get(model, 0) != unloads:
                return
            if worker_id is not None:
                self._check_started(model, worker_id)
            else:
                await self._fail_crash_looping(model)
            await self._tick()

    def _check_started(self, model: str, worker_id: str) -> None:
        """FleetError when the worker started for `model` exited (or failed to start);
        `_NodeLost` when its node, or a node of its group's, was lost (`replace_lost`)."""
        lost = next((w for w in self._abandoned if w == worker_id or w.startswith(f"{worker_id}-rank-")), None)
        if lost is not None:
            raise _NodeLost(grpc.StatusCode.UNAVAILABLE, f"model {model!r}'s worker {lost} was lost with its node "
                                                         f"{self._abandoned[lost]} while loading")
        for m in self.placed().get(model, _Placed()).members:
            if m.worker.worker_id == worker_id and m.worker.state == "exited":
                raise FleetError(grpc.StatusCode.UNAVAILABLE,
                                 f"model {model!r}'s worker on {m.node_id} exited (code {m.worker.exit_code}) "
                                 f"while loading: {m.worker.reason or 'no reason given'}")
            if m.worker.worker_id == worker_id and m.worker.restarts >= MAX_LOAD_RESTARTS:
                raise self._crash_error(model, m)
        failure = self.registry.failures.get(worker_id)
        if failure is not None and failure.permanent:
            raise FleetError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model {model!r}'s worker could not start: {failure.reason}")

    async def _fail_crash_looping(self, model: str) -> None:
        """When no worker of `model` serves and one placed already (a group's rank) restarted
        `MAX_LOAD_RESTARTS` times: stop its workers (the next load may place it elsewhere)
        and raise the FleetError saying why."""
        if self.serving(model):
            return
        members = sorted(self._reachable_members(model), key=lambda m: m.worker.group_rank)
        healthy = {n.report.node_id for n in self.nodes.nodes() if n.state == "healthy"}
        if model in self._replacing or any(m.node_id not in healthy for m in self._live_members(model)):
            return  # a group's ranks start again until their member's node is back, or lost (`replace_lost`)
        looping = next((m for m in members if m.worker.restarts >= MAX_LOAD_RESTARTS), None)
        if looping is not None:
            await self._stop_quietly(model, [(m.node_id, m.worker.worker_id) for m in members])
            self._count_replacement(model, "crash")
            raise self._crash_error(model, looping)

    @staticmethod
    def _crash_error(model: str, m: Member) -> FleetError:
        return FleetError(grpc.StatusCode.UNAVAILABLE,
                          f"model {model!r}'s worker on {m.node_id} exited and was started again {m.worker.restarts} "
                          f"times without serving (last exit code {m.worker.exit_code}): "
                          f"{m.worker.reason or 'no reason given'}")

    async def _place_and_start(self, model: str) -> None:
        """Plan, evict, fetch, start. A node lost while its worker loads (`_NodeLost`), or
        whose disk budget has no room for the files (`_NoDiskRoom`), is planned over again
        without it; a node side that cannot fetch (Ray's: `_CannotFetch`) with the nodes
        that hold the files only."""
        entry = self._entry(model)
        while True:
            await self._describe_missing(entry)
            plan, footprints = await self._plan_when_room(model, entry)
            log.info("fleet: placing %s: %s", model, plan.why)
            self._pending[model] = ([(plan.node_id, plan.bytes)] if isinstance(plan, placement.Single)
                                    else [(rank.node_id, rank.bytes) for rank in plan.ranks])
            try:
                for victim in plan.evict:
                    log.info("fleet: evicting %s for %s", victim, model)
                    self._start_unload(victim, "evicted")
                    await asyncio.shield(self._unloads[victim])
                if isinstance(plan, placement.Single):
                    await self._start_single(entry, plan.node_id, footprints[plan.node_id])
                else:
                    await self._start_group(entry, plan, footprints)
                return
            except _NodeLost as e:
                log.warning("fleet: %s: placing it again", e.message)
            except _NoDiskRoom as e:
                log.warning("fleet: %s: placing it elsewhere", e.message)
                self._disk_full[source_name(entry.source), e.node_id] = (e, self.clock())
            except _CannotFetch as e:
                if not self._fetches:
                    raise
                log.warning("fleet: %s; placing on the nodes that hold the files only", e.message)
                self._fetches = False
            finally:
                del self._pending[model]

    async def _plan_when_room(self, model: str, entry: pb.CatalogModel
                              ) -> tuple[placement.Single | placement.Group, dict[str, footprint.Footprint]]:
        """The plan for `model`, once there is room. A fleet whose room is held by models
        busy now (requests in flight, loading or unloading) has room once they finish: the
        load waits for that (within --load-timeout), as a request waits for a free slot;
        only a model that would not fit with every unpinned model unloaded is refused at
        once, with what it needs and what each node has."""
        while True:
            plan, footprints, could_fit = self._plan(model, entry)
            if not isinstance(plan, placement.NoRoom):
                return plan, footprints
            if not could_fit:
                failed = self._describe_failed.get(source_name(entry.source))
                if not footprints and failed is not None:  # nobody holds it and the hub could not say
                    raise failed[0]
                full = [e.message for e in self._disks_full(entry)]
                raise plan.error() if not full else FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                               f"{plan.message}; " + "; ".join(full))
            self._waiting_for_room[model] = plan.message
            try:
                await self._tick()
            finally:
                self._waiting_for_room.pop(model, None)

    def _plan(self, model: str, entry: pb.CatalogModel) -> tuple[placement.Plan, dict, bool]:
        """(the plan now, the footprints per node, whether a NoRoom would be a plan once the
        busy models are idle)."""
        avoid = self._avoid.get(model, frozenset())  # an added replica's: the nodes that run one
        nodes = [n for n in self.nodes.nodes() if n.report.node_id not in avoid]
        name = source_name(entry.source)
        healthy = [n for n in nodes if n.state == "healthy"]
        footprints = self._footprints(entry, healthy)
        layers = max((d.num_layers for d, _ in self._disks(entry, healthy).values()), default=0)
        want = placement.ToPlace(model, name, footprints, num_layers=layers, max_nodes=entry.max_nodes)
        pending = self._pending_bytes()
        views = [placement.node_view(n, pending.get(n.report.node_id, 0)) for n in nodes]
        loaded = self._loaded()
        plan = placement.plan(want, views, [*loaded, *self._pending_loads()], self.clock())
        if not isinstance(plan, placement.NoRoom):
            return plan, footprints, True
        # once the busy models are idle and the other loads under way are done (then idle too)
        idle = [replace(m, in_flight=0, loading=False) for m in loaded]
        bare = [placement.node_view(n) for n in nodes]
        return plan, footprints, not isinstance(placement.plan(want, bare, idle, self.clock()), placement.NoRoom)

    def _pending_bytes(self) -> dict[str, int]:
        """Node -> bytes that loads in progress set aside there and its report does not show
        yet (their workers not started, or started since its last heartbeat), less those of
        workers stopped since its last heartbeat."""
        placed = self.placed()
        out: dict[str, int] = {}
        for info in self.nodes.nodes():
            for w in info.report.workers:
                if w.worker_id in self._stopped and w.state in (*LIVE, "stopping"):  # its stop returned: gone
                    out[info.report.node_id] = out.get(info.report.node_id, 0) - w.reserved_bytes
        for model, ranks in self._pending.items():
            reported = {m.node_id for m in placed.get(model, _Placed()).members if m.live}
            for node_id, size in ranks:
                if node_id not in reported:
                    out[node_id] = out.get(node_id, 0) + size
        return out

    def _pending_loads(self) -> list[placement.Loaded]:
        """The loads in progress on nodes whose reports do not list their workers yet, as
        models that hold a slot under the node's --max-loaded (never to be evicted): two
        loads planned at once must not both count on one free slot."""
        placed = self.placed()
        out = []
        for model, ranks in self._pending.items():
            reported = {m.node_id for m in placed.get(model, _Placed()).members if m.live}
            reserved = {node_id: size for node_id, size in ranks if node_id not in reported and size > 0}
            if reserved:
                out.append(placement.Loaded(model=model, reserved=reserved, pinned=True, loading=True))
        return out

    def _context(self, entry: pb.CatalogModel, disk: pb.DiskModel) -> int:
        """The context its workers get: the entry's, else the fleet's default, within the model's own."""
        context = entry.context or self.config.fleet_context
        return min(context, disk.max_context) if disk.max_context else context

    def _sizing(self, entry: pb.CatalogModel) -> _Sizing:
        """How the entry's workers are sized: the --max-num-seqs and --block-size its engine
        args give (else the worker's defaults), and the full contexts its KV pool holds."""
        flags = worker_flags(entry.engine_args)
        return _Sizing(flags.max_num_seqs, flags.block_size, min(self.config.fleet_concurrency, flags.max_num_seqs))

    def _footprints(self, entry: pb.CatalogModel, nodes: list[pb.NodeInfo]) -> dict[str, footprint.Footprint]:
        """Node id -> the model's footprint there, for the nodes that hold its files or can
        fetch them (`_disks`): a hybrid's state slot for each of its --max-num-seqs, and a
        KV pool of --fleet-concurrency full contexts (footprint.estimate's default caps it)."""
        out = {}
        sizing = self._sizing(entry)
        for node_id, (disk, platform) in self._disks(entry, nodes).items():
            context = self._context(entry, disk)
            out[node_id] = replace(footprint.estimate(disk, context, sizing.max_num_seqs, platform),
                                   kv=footprint.kv_pool_bytes(disk, context, sizing.contexts, sizing.block_size))
        return out

    def _disks(self, entry: pb.CatalogModel, nodes: list[pb.NodeInfo]) -> dict[str, tuple[pb.DiskModel, str]]:
        """Node id -> (the facts of the model's files as a worker there would load them, its
        platform), for the nodes of `nodes` that hold them or can fetch them (`_disk_for`)."""
        out = {}
        for info in nodes:
            disk = self._disk_for(entry, info.report)
            if disk is not None:
                out[info.report.node_id] = (disk, _platform(info.report))
        return out

    def _disk_for(self, entry: pb.CatalogModel, report: pb.NodeReport) -> pb.DiskModel | None:
        """The model's facts on the node of `report`: its own files'; else, where it can fetch
        them (`_fetchable`), a node's of the same platform that holds them, or what a node of
        that platform described (`_describe_missing`); None: it cannot run the model."""
        name = source_name(entry.source)
        held = _disk_model(report, name)
        if held is not None or not self._fetchable(entry) or report.node_id in {
                e.node_id for e in self._disks_full(entry)}:
            return held
        platform = _platform(report)
        same = (d for n in self.nodes.nodes() if _platform(n.report) == platform
                and (d := _disk_model(n.report, name)) is not None)
        return next(same, None) or self._described.get((name, platform))

    def _disks_full(self, entry: pb.CatalogModel) -> list[_NoDiskRoom]:
        """The nodes whose disk budget refused the model's files in the last `DISK_FULL_RETRY`
        seconds: not fetched onto again meanwhile (their fetched models may free room)."""
        name, now = source_name(entry.source), self.clock()
        return [e for (source, _), (e, when) in sorted(self._disk_full.items())
                if source == name and now - when < DISK_FULL_RETRY]

    def _fetchable(self, entry: pb.CatalogModel) -> bool:
        """Whether a node without the model's files can fetch them: from the hub (an hf:
        source), or copied from a healthy node that holds them (a --models-dir source)."""
        if not self._fetches:
            return False
        if hub.is_hub_source(entry.source):
            return True
        return not entry.source.startswith("ollama:") and bool(self._holders(entry))

    def _holders(self, entry: pb.CatalogModel) -> list[pb.NodeInfo]:
        """The healthy nodes that hold the model's files."""
        name = source_name(entry.source)
        return [n for n in self.nodes.nodes() if n.state == "healthy" and _disk_model(n.report, name) is not None]

    async def _describe_missing(self, entry: pb.CatalogModel) -> None:
        """For an hf: source, the facts of its files on each platform of the healthy nodes
        where no node holds them: asked of one node of that platform (`NodeSide.describe`:
        the hub's metadata, nothing downloaded), once per source and platform. A failure is
        kept `LOAD_RETRY_AFTER` seconds: the plan then has no such node, and a plan with no
        node at all fails with it (the hub unreachable, the repo unknown, ...)."""
        if not hub.is_hub_source(entry.source):
            return
        name = source_name(entry.source)
        failed = self._describe_failed.get(name)
        if failed is not None and self.clock() - failed[1] < LOAD_RETRY_AFTER:
            return
        asked = set()
        for info in self.nodes.nodes():
            platform = _platform(info.report)
            if info.state != "healthy" or platform in asked or self._disk_for(entry, info.report) is not None:
                continue
            asked.add(platform)
            try:
                self._described[name, platform] = await self.nodes.describe(info.report.node_id, entry.source)
            except FleetError as e:
                log.warning("fleet: %s could not describe %s: %s", info.report.node_id, entry.source, e.message)
                self._describe_failed[name] = (FleetError(e.code, f"model {entry.name!r}: no node holds "
                                                                  f"{entry.source}, and {e.message}"), self.clock())
                return
        self._describe_failed.pop(name, None)

    def _loaded(self) -> list[placement.Loaded]:
        """The models placed on the fleet, as the policy weighs them."""
        out = []
        for model, placed in self.placed().items():
            live = [m for m in placed.members if m.live]
            if not live:
                continue
            entry = self.catalog.get(model)
            use = self._use.get(model) or _Use(idle_since=self._started)
            reserved: dict[str, int] = {}
            for m in live:
                reserved[m.node_id] = reserved.get(m.node_id, 0) + m.worker.reserved_bytes
            # requests here, and those its workers report (another router's too)
            busy = use.active + sum(w.report.num_running + w.report.num_waiting for w in self.registry.serving(model))
            out.append(placement.Loaded(
                model=model, reserved=reserved,
                pinned=entry is None or entry.pin,  # a worker of no catalog entry is not the fleet's to move
                # loaded once it serves here: a node's report says so a poll and a heartbeat later
                in_flight=busy, loading=self._busy(model) or (any(m.worker.state != "running" for m in live)
                                                              and not self.serving(model)),
                idle_since=self._idle_since(model, use), keep_alive=self._keep_alive(model),
                load_seconds=self._load_seconds.get(model) or self._reload_seconds(entry, live), uses=use.uses))
        return out

    def _reload_seconds(self, entry: pb.CatalogModel | None, live: list[Member]) -> float:
        """A model's time to load again, not measured yet: its weights read from disk."""
        if entry is None:
            return 0.0
        name = source_name(entry.source)
        nodes = {n.report.node_id: n.report for n in self.nodes.nodes()}
        weights = sum(d.weight_bytes for m in live if m.node_id in nodes
                      and (d := _disk_model(nodes[m.node_id], name)) is not None and m.worker.group_rank == 0)
        return placement.Costs().load_seconds(weights)

    async def _start_single(self, entry: pb.CatalogModel, node_id: str, fp: footprint.Footprint) -> None:
        worker_id = _worker_id(entry.name, node_id)
        disk = self._disk_for(entry, self._report(node_id))
        await self._fetch_missing(entry, [(node_id, 0, 0)])
        spec = pb.WorkerSpec(worker_id=worker_id, model=entry.name, source=entry.source,
                             context=self._context(entry, disk), kv_cache_bytes=fp.kv, reserved_bytes=fp.total,
                             engine_args=entry.engine_args, max_num_seqs=self._sizing(entry).max_num_seqs)
        log.info("fleet: starting %s on %s as %s (%.2f GiB reserved)", entry.name, node_id, worker_id,
                 fp.total / 2**30)
        await self._start_all(entry.name, [(node_id, spec)])

    async def _start_group(self, entry: pb.CatalogModel, plan: placement.Group, footprints: dict) -> None:
        """A pipeline group over the plan's ranks: each rank's ring port (and rank 0's
        side-channel port) reserved on its node first, then every rank started.

        The group's pool has the same blocks on every rank, each block over that rank's
        layers: rank 0 is given the footprint's blocks (--num-kv-blocks) and every other
        rank a --kv-cache-memory-bytes of the whole model's pool. A rank's layers own at
        most the whole model's K/V, so that holds the blocks whichever layers the group
        gives it (the group splits by its layers' real sizes; layers own K/V unevenly:
        shared K/V, sliding windows, a hybrid's attention-only layers), and the group's
        check that a member holds rank 0's blocks always passes. A member allocates its
        blocks over its own layers, not that budget."""
        size = len(plan.ranks)
        reports = {n.report.node_id: n.report for n in self.nodes.nodes()}
        disks = {rank.node_id: self._disk_for(entry, reports[rank.node_id]) for rank in plan.ranks}
        # the group is told each rank's layers (`plan.shares`): a rank fetches their files only
        await self._fetch_missing(entry, [(rank.node_id, rank.first_layer, rank.last_layer) for rank in plan.ranks])
        ports = [await self.nodes.reserve_ports(rank.node_id, 2 if r == 0 else 1) for r, rank in enumerate(plan.ranks)]
        hosts = [f"{_host(reports[rank.node_id])}:{ports[r][0]}" for r, rank in enumerate(plan.ranks)]
        group_id = _worker_id(entry.name, "group")
        sizing = self._sizing(entry)
        specs = []
        for r, rank in enumerate(plan.ranks):
            fp = footprints[rank.node_id]
            context = self._context(entry, disks[rank.node_id])
            blocks = footprint.kv_pool_blocks(context, sizing.contexts, sizing.block_size) if fp.kv else 0
            specs.append((rank.node_id, pb.WorkerSpec(
                worker_id=group_id if r == 0 else f"{group_id}-rank-{r}", model=entry.name, source=entry.source,
                context=context, num_kv_blocks=blocks if r == 0 else 0, kv_cache_bytes=0 if r == 0 else fp.kv,
                max_num_seqs=sizing.max_num_seqs, reserved_bytes=rank.bytes, engine_args=entry.engine_args,
                group_size=size, group_rank=r, group_hosts=hosts, group_port=ports[0][1], group_shares=plan.shares,
                memory_budget_bytes=rank.bytes)))
        log.info("fleet: starting %s as a group of %d over %s", entry.name, size,
                 ", ".join(rank.node_id for rank in plan.ranks))
        await self._start_all(entry.name, specs)

    async def _fetch_missing(self, entry: pb.CatalogModel, ranks: list[tuple[str, int, int]]) -> None:
        """Fetch the model's files onto the nodes of `ranks` (node, first layer, last layer;
        0, 0: every file) whose reports do not list them, all at once: copied from the
        healthy nodes that hold them (`peers`, tried in order), else pulled from the hub.
        The disk budget of a node may delete other fetched models for room, never one pinned
        or loaded anywhere (`protect`). While it runs, the model's state is "copying" or
        "pulling" (`describe`). A failure raises the node's error: `_NoDiskRoom` when its
        disk budget has no room for them, `_CannotFetch` when the node side fetches nothing."""
        name = source_name(entry.source)
        reports = {n.report.node_id: n.report for n in self.nodes.nodes()}
        missing = [(node_id, first, last) for node_id, first, last in ranks
                   if _disk_model(reports[node_id], name) is None]
        if not missing:
            return
        holders = self._holders(entry)
        peers = [pb.NodePeer(node_id=n.report.node_id, address=n.report.address)
                 for n in sorted(holders, key=lambda n: (len(n.report.transfers), n.report.node_id))]
        request = pb.FetchModelRequest(source=entry.source, peers=peers, protect=self._protected(entry))
        fetches = self._fetching[entry.name] = {node_id: _Fetch(peers[0].node_id if peers else placement.HUB)
                                                for node_id, _, _ in missing}
        tasks = []
        for node_id, first, last in missing:
            one = pb.FetchModelRequest()
            one.CopyFrom(request)
            one.first_layer, one.last_layer = first, last
            tasks.append(asyncio.ensure_future(self._fetch_one(entry.name, node_id, one, fetches[node_id])))
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # --load-timeout: its error says how far the fetch got
            words = pb.CatalogModel()
            self._describe_fetch(words, fetches)
            self._fetch_cut[entry.name] = words.status
            raise
        finally:
            for task in tasks:  # one failed: the others are of no use
                task.cancel()
            self._fetching.pop(entry.name, None)

    async def _fetch_one(self, model: str, node_id: str, request: pb.FetchModelRequest, fetch: _Fetch) -> None:
        def progress(p: pb.FetchProgress) -> None:
            fetch.origin = getattr(p, "from") or fetch.origin
            fetch.done, fetch.total = p.bytes_done, p.bytes_total

        log.info("fleet: fetching %s onto %s (%s)", request.source, node_id,
                 f"from {_and([p.node_id for p in request.peers])}" if request.peers else "from the hub")
        try:
            done = await self.nodes.fetch(node_id, request, progress)
        except FleetError as e:
            message = f"model {model!r}: fetching {request.source} onto {node_id}: {e.message}"
            if e.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise _NoDiskRoom(e.code, message, node_id) from None
            raise (_CannotFetch if e.code is grpc.StatusCode.UNIMPLEMENTED else FleetError)(e.code, message) from None
        progress(done)
        if done.deleted:
            log.info("fleet: %s deleted %s for room on its disk", node_id, ", ".join(done.deleted))

    def _protected(self, entry: pb.CatalogModel) -> list[str]:
        """The sources a node's disk budget must not delete for a fetch: this model's, the
        pinned models' and those loaded anywhere (by the names nodes hold them under)."""
        entries = {e.name: e for e in self.catalog.entries()}
        loaded = {model for model, p in self.placed().items() if any(m.live for m in p.members)}
        return sorted({source_name(entry.source)} | {source_name(e.source) for e in entries.values()
                                                     if e.pin or e.name in loaded})

    async def _start_all(self, model: str, specs: list[tuple[str, pb.WorkerSpec]]) -> None:
        """Start the workers (a group's ranks, rank 0 first) and wait until the first one
        registers healthy; on any failure, stop those started."""
        started: list[tuple[str, str]] = []
        try:
            for node_id, spec in specs:
                await self.nodes.start(node_id, spec)
                started.append((node_id, spec.worker_id))
                if spec.group_rank == 0:
                    self._estimates[spec.worker_id] = spec.reserved_bytes
            await self._record(model, specs)
            await self._wait_serving(model, specs[0][1].worker_id)
        except BaseException:
            await self._stop_quietly(model, started)
            raise

    def _report(self, node_id: str) -> pb.NodeReport:
        return next(n.report for n in self.nodes.nodes() if n.report.node_id == node_id)

    async def _record(self, model: str, specs: list[tuple[str, pb.WorkerSpec]]) -> None:
        for node_id, s in specs:
            await self._write(self.catalog.record_placement, Placement(
                model, node_id, s.worker_id, rank=s.group_rank, size=s.group_size or 1,
                reserved_bytes=s.reserved_bytes, router_id=self.router_id))

    def _forget(self, model: str) -> Awaitable:
        """The catalog forgets where `model` was placed (its workers stopped, or never ran):
        the placements recorded now, by worker id (a later load's are its own)."""
        return self._write(self._forget_now, [p.worker_id for p in self.catalog.placements(model)])

    def _forget_now(self, worker_ids: list[str]) -> None:
        for worker_id in worker_ids:
            self.catalog.forget_placement(worker_id)

    # -- the catalog's writes, off the loop -------------------------------------------------------
    def _write(self, call, *args) -> Awaitable:
        """`call(*args)` on a thread: a write to the catalog (or a claim) waits for the other
        router's transaction, up to SQLite's busy timeout, and must not stall this loop's
        other requests meanwhile. (Reads stay on the loop: in WAL mode a reader never waits
        for a writer.)"""
        return asyncio.to_thread(call, *args)

    def _write_soon(self, call, *args) -> asyncio.Future:
        """`_write` that nothing waits for (its failure is logged)."""
        future = asyncio.ensure_future(self._write(call, *args))
        self._writes.add(future)
        future.add_done_callback(self._written)
        return future

    def _written(self, future: asyncio.Future) -> None:
        self._writes.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.warning("fleet: catalog write failed: %s", future.exception())

    def _touch_soon(self, model: str) -> None:
        """Record the model's use now in the catalog, off the loop; the ends of its requests
        while a write waits are one write."""
        waiting = model in self._touches
        self._touches[model] = self.catalog.clock()
        if not waiting:
            self._write_soon(self._touch_now, model)

    def _touch_now(self, model: str) -> None:
        self.catalog.touch(model, self._touches.pop(model))

    async def _stop_quietly(self, model: str, workers: list[tuple[str, str]]) -> None:
        """Stop the workers a failed load started (nothing of theirs is in flight: a short
        drain; 0 would be the agent's default, longer than the call's deadline). One whose
        stop failed is forgotten only when its node reports it exited or absent; else its
        node's reports keep saying where it runs."""
        for node_id, worker_id in workers:
            try:
                await self.nodes.stop(node_id, worker_id, QUIET_DRAIN)
            except Exception as e:
                log.warning("fleet: could not stop %s on %s: %s", worker_id, node_id, e)
                if not (isinstance(e, FleetError) and e.code is grpc.StatusCode.NOT_FOUND) \
                        and self._runs(node_id, worker_id):
                    continue
            self._gone(worker_id)
            await self._write(self.catalog.forget_placement, worker_id)

    def _runs(self, node_id: str, worker_id: str) -> bool:
        """Whether `node_id`'s last report lists `worker_id` as live."""
        return any(w.worker_id == worker_id and w.state in LIVE
                   for n in self.nodes.nodes() if n.report.node_id == node_id for w in n.report.workers)

    def _gone(self, worker_id: str) -> None:
        """A worker this router stopped is gone: the registry stops listing it now (its
        missed heartbeats would say so only seconds later, and a load meanwhile would find
        it "serving"), and the nodes' reports that still list it are not believed."""
        self._estimates.pop(worker_id, None)
        self._stopped.add(worker_id)
        self.registry.remove(worker_id)

    # -- unloading --------------------------------------------------------------------------------
    def _start_unload(self, model: str, reason: str, asked: bool = False) -> None:
        """Unload `model` in a task (`_unload`; `asked`: by an operator who awaits it)."""
        task = self._unloads.get(model)
        if task is None or task.done():
            use = self._use.get(model)
            if use is not None:  # a request's keep_alive was for the model as loaded now; a later one's is not
                use.keep_alive = None
            task = asyncio.create_task(self._unload(model, reason, asked), name=f"fleet unload {model}")
            task.add_done_callback(_log_failure)
            self._unloads[model] = task
            self._unload_starts[model] = self._unload_starts.get(model, 0) + 1

    async def _unload(self, model: str, reason: str, asked: bool = False) -> None:
        """Drain and stop the model's workers (a group's members with it), under the
        model's claim: two routers whose keep-alives run out together stop it once, and no
        router loads it while it stops. An unload an operator `asked` for that another router
        holds the claim for is refused (UNAVAILABLE); any other is left to that router."""
        members = self._live_members(model)
        if not members:
            return
        if not await self._write(self.catalog.claim, model, self.router_id, CLAIM_TTL):
            if asked:
                raise FleetError(grpc.StatusCode.UNAVAILABLE, f"another router is loading or unloading model "
                                                              f"{model!r} now: try again when it is done")
            return
        async with self._holding_claim(model):
            members = self._live_members(model)  # another router may have unloaded it while the claim was taken
            if not members:
                return
            log.info("fleet: unloading %s (%s) from %s", model, reason, _and(sorted({m.node_id for m in members})))
            await self._stop_members(members)
            await self._forget(model)
        if self.metrics is not None:
            self.metrics.unloads.labels(model=model, reason=reason).inc()

    async def _stop_members(self, members: list[Member]) -> list[str]:
        """Drain and stop these workers (whole replicas): the ids of those that stopped,
        gone from the registry now (the caller forgets their placements)."""
        # rank 0 first: it drains the group's requests and then stops its members (its STOP
        # message); a member has no address to drain, its stop would cut rank 0's streams
        members = sorted(members, key=lambda m: m.worker.group_rank != 0)
        firsts = [m for m in members if m.worker.group_rank == 0]
        results = await asyncio.gather(*(self.nodes.stop(m.node_id, m.worker.worker_id, DRAIN_TIMEOUT)
                                         for m in firsts), return_exceptions=True)
        results += await asyncio.gather(*(self.nodes.stop(m.node_id, m.worker.worker_id, DRAIN_TIMEOUT)
                                          for m in members[len(firsts):]), return_exceptions=True)
        stopped = []
        for m, result in zip(members, results):
            if isinstance(result, BaseException):
                log.warning("fleet: stopping %s on %s: %s", m.worker.worker_id, m.node_id, result)
                if not (isinstance(result, FleetError) and result.code is grpc.StatusCode.NOT_FOUND):
                    self._estimates.pop(m.worker.worker_id, None)
                    continue  # it may run still (its node unreachable): its heartbeats say
            self._gone(m.worker.worker_id)
            stopped.append(m.worker.worker_id)
        return stopped

    def _idle_since(self, model: str, use: _Use) -> float:
        """When `model`'s last request finished, on this router or (the catalog's record)
        another one, in `clock`'s time."""
        last_used = self.catalog.last_used(model)
        if last_used is None:
            return use.idle_since
        return max(use.idle_since, self.clock() - max(0.0, self.catalog.clock() - last_used))

    def _keep_alive(self, model: str) -> float:
        use = self._use.get(model)
        if use is not None and use.keep_alive is not None:
            return use.keep_alive
        entry = self.catalog.get(model)
        if entry is None or not entry.HasField("keep_alive_seconds"):
            return self.default_keep_alive
        return entry.keep_alive_seconds

    def expire(self) -> list[str]:
        """Unload the models idle past their keep-alive (never pinned, never busy): their names."""
        gone = placement.expired(self._loaded(), self.clock())
        for model in gone:
            self._start_unload(model, "keep_alive")
        return gone

    def _busy(self, model: str) -> bool:
        task = self._unloads.get(model)
        return (task is not None and not task.done()) or self.loading(model) or self.scaling(model)

    # -- replicas ---------------------------------------------------------------------------------
    def scaling(self, model: str) -> bool:
        """Whether a replica of `model` is being added or removed."""
        task = self._scaling.get(model)
        return task is not None and not task.done()

    def replica_counts(self) -> dict[str, int]:
        """Catalog model -> its live replicas (serving, or starting or loading)."""
        return {model: n for model, p in self.placed().items() if (n := len(p.replicas()))}

    def _bounds(self, entry: pb.CatalogModel) -> scaling.Bounds:
        return scaling.Bounds(entry.min_replicas, entry.max_replicas, self._sizing(entry).max_num_seqs)

    def scale(self) -> list[tuple[str, int]]:
        """One step of the replicas that follow traffic: each serving model's replicas
        counted and its requests in flight sampled, then the rule asked; the changes it
        calls for are begun (in tasks). Returns them: (model, +1 or -1)."""
        now = self.clock()
        placed = self.placed()
        begun = []
        for model in list(self._traffic):
            if model not in placed or not placed[model].replicas():
                del self._traffic[model]  # unloaded: a load starts its traffic afresh
        for entry in self.catalog.entries():
            model = entry.name
            replicas = placed.get(model, _Placed()).replicas()
            if not replicas or self._busy(model) or not self.serving(model):
                continue
            traffic = self._traffic.get(model)
            if traffic is None:  # loaded: its first window starts now
                traffic = self._traffic[model] = scaling.Traffic(self.scale_policy, since=now, replicas=len(replicas))
            traffic.seen(now, len(replicas))
            use = self._use.get(model) or _Use()
            reported = sum(w.report.num_running + w.report.num_waiting for w in self.registry.serving(model))
            traffic.in_flight(now, max(use.active, reported))  # another router's requests: its workers' reports
            decision = scaling.decide(traffic, self._bounds(entry), now)
            if decision.delta:
                task = asyncio.create_task(self._scale(model, decision, replicas), name=f"fleet scale {model}")
                task.add_done_callback(_log_failure)
                self._scaling[model] = task
                begun.append((model, decision.delta))
        return begun

    async def _scale(self, model: str, decision: scaling.Decision, replicas: dict[str, list[Member]]) -> None:
        """Add or remove one replica of `model` under its claim (no other router loads,
        unloads or scales it meanwhile); its traffic starts a new window once it is done,
        and after a start or stop that failed too (not tried again each tick)."""
        if decision.delta > 0:
            await self._describe_missing(self._entry(model))  # a node without its files is a candidate too
            if not self._replica_fits(model, decision.why, replicas):
                return  # the next steps ask again, without a write to the catalog each
        if not await self._write(self.catalog.claim, model, self.router_id, CLAIM_TTL):
            return  # another router is loading, unloading or scaling it: the next step sees what it did
        async with self._holding_claim(model):
            if decision.delta > 0:
                changed = await self._add_replica(model, decision.why, replicas)
            else:
                changed = await self._remove_replica(model, decision.why, replicas)
        if changed and self.metrics is not None:
            self.metrics.scale_events.labels(model=model, direction="up" if decision.delta > 0 else "down").inc()
        traffic = self._traffic.get(model)
        if traffic is not None:
            traffic.changed(self.clock(), len(replicas) + (decision.delta if changed else 0))

    def _replica_fits(self, model: str, why: str, replicas: dict[str, list[Member]]) -> bool:
        """Whether a node that runs none of `model`'s replicas has room for one now (idle
        models unloaded there if the rule allows): a replica is not worth waiting for room."""
        self._avoid[model] = frozenset(m.node_id for members in replicas.values() for m in members)
        try:
            plan = self._plan(model, self._entry(model))[0]
        finally:
            del self._avoid[model]
        if isinstance(plan, placement.NoRoom):
            self._scale_failure(model, why, f"no node without a replica of it has room: {plan.message}")
            return False
        return True

    def _scale_failure(self, model: str, why: str, message: str) -> None:
        """Why a replica could not be added, logged when it changes (the rule asks every tick)."""
        if self._scale_failed.get(model) != message:
            log.warning("fleet: another replica of %s (%s) could not be added: %s", model, why, message)
        self._scale_failed[model] = message

    async def _add_replica(self, model: str, why: str, replicas: dict[str, list[Member]]) -> bool:
        """One more replica, placed as a load is on a node that runs none of `model`'s
        (False: its start failed; the next steps try again)."""
        self._avoid[model] = frozenset(m.node_id for members in replicas.values() for m in members)
        try:
            log.info("fleet: adding a replica of %s (%s)", model, why)
            await asyncio.wait_for(self._place_and_start(model), self.config.load_timeout)
        except (FleetError, asyncio.TimeoutError) as e:
            self._scale_failure(model, why, e.message if isinstance(e, FleetError)
                                else "its worker did not serve within --load-timeout")
            return False
        finally:
            del self._avoid[model]
        self._scale_failed.pop(model, None)
        return True

    async def _remove_replica(self, model: str, why: str, replicas: dict[str, list[Member]]) -> bool:
        """One replica fewer: the one with the fewest requests in flight, out of this
        router's pool first, then drained (its requests in flight finish) and stopped."""
        records = {w.worker_id: w for w in self.registry.serving(model)}
        victim = min(replicas, key=lambda rid: (records[rid].load if rid in records else 0, rid))
        log.info("fleet: removing replica %s of %s (%s)", victim, model, why)
        record = records.get(victim)
        if record is not None:
            self.registry.set_drained(record, True)
        stopped = await self._stop_members(replicas[victim])
        await self._write(self._forget_now, stopped)
        if victim not in stopped and record is not None:
            self.registry.set_drained(record, False)  # it runs on (its node unreachable): it serves again
        return victim in stopped

    # -- after a restart, and every tick ----------------------------------------------------------
    def reconcile(self) -> None:
        """The nodes' reports are the truth: placements of workers no node runs are
        forgotten; a worker that ended leaves the registry; a worker of a model no longer in
        the catalog is stopped; a model found loaded starts its idle time now."""
        self._unlist_ended()
        placed = self.placed()
        names = set(self.names())
        reported = {info.report.node_id for info in self.nodes.nodes()}
        for model in names:
            live = [m for m in placed.get(model, _Placed()).members if m.live]
            if live:
                self._use.setdefault(model, _Use(idle_since=self.clock()))
                continue
            recorded = self.catalog.placements(model)
            waiting = self.clock() - self._started <= NODE_GRACE and any(p.node_id not in reported for p in recorded)
            if recorded and not waiting and not self.loading(model) and model not in self._forgetting:
                self._forgetting.add(model)
                forgetting = self._write_soon(self._forget_now, [p.worker_id for p in recorded])
                forgetting.add_done_callback(lambda _, model=model: self._forgetting.discard(model))
        for model, p in placed.items():
            if model not in names and any(m.live for m in p.members) and not self._busy(model):
                log.info("fleet: %s runs on %s but is no longer in the catalog: stopping it", model,
                         ", ".join(p.node_ids))
                self._start_unload(model, "operator")

    # -- a lost Mac ---------------------------------------------------------------------------------
    def replace_lost(self) -> list[str]:
        """Place again the catalog models with a worker or a group's rank on a node lost
        (`_lost_nodes`): its workers there are abandoned (no model's any more), a group's
        ranks on the nodes left are stopped (a group with a member gone cannot serve), and
        the model is loaded afresh on the nodes that remain, as any load is placed: a single
        worker elsewhere, a group over the nodes left, or one node if it now fits. Requests
        held for the model meanwhile wait for that load. A lost node that reports again is
        a node like any other, with the files it holds; the abandoned workers it still runs
        are stopped. Returns the models placed again."""
        self._stop_abandoned()
        lost = self._lost_nodes()
        if not lost:
            return []
        names = set(self.names())
        out = []
        for model, placed in sorted(self.placed().items()):
            live = [m for m in placed.members if m.live]
            if model not in names or not any(m.node_id in lost for m in live) or model in self._replacing:
                continue
            gone = [m for m in live if m.node_id in lost]
            broken = {_group_id(m.worker) for m in gone if m.worker.group_size > 1}
            # the ranks left of its groups that lost a member; never its other workers (another
            # replica, or those another router placed again already)
            left = [(m.node_id, m.worker.worker_id) for m in live
                    if m.node_id not in lost and m.worker.group_size > 1 and _group_id(m.worker) in broken]
            log.warning("fleet: %s lost with %s's node %s: placing it again", model,
                        ", ".join(m.worker.worker_id for m in gone), _and(sorted({m.node_id for m in gone})))
            for m in gone:
                self._abandoned[m.worker.worker_id] = m.node_id
                self._estimates.pop(m.worker.worker_id, None)
                self.registry.remove(m.worker.worker_id)
            self._count_replacement(model, "node_lost")
            task = asyncio.create_task(self._place_again(model, left, [m.worker.worker_id for m in gone]),
                                       name=f"fleet re-place {model}")
            task.add_done_callback(_log_failure)
            self._replacing[model] = task
            task.add_done_callback(lambda _, model=model: self._replacing.pop(model, None))
            out.append(model)
        return out

    async def _place_again(self, model: str, left: list[tuple[str, str]], abandoned: list[str]) -> None:
        """Stop a group's ranks `left` on the nodes that remain, forget the abandoned
        workers' placements, then load the model."""
        await self._stop_quietly(model, left)
        await self._write(self._forget_now, abandoned)
        self._errors.pop(model, None)  # a failure before the loss says nothing of the nodes left
        self.ensure_loaded(model)

    def _stop_abandoned(self) -> None:
        """An abandoned worker whose node reports again still running it is stopped; one its
        node no longer lists is forgotten."""
        running = {w.worker_id: info for info in self.nodes.nodes() for w in info.report.workers
                   if w.worker_id in self._abandoned and w.state in LIVE}
        for worker_id, node_id in list(self._abandoned.items()):
            info = running.get(worker_id)
            if info is None:
                del self._abandoned[worker_id]
            elif info.state == "healthy" and worker_id not in self._stopped:
                log.info("fleet: %s is back: stopping %s, placed elsewhere since", node_id, worker_id)
                self._stopped.add(worker_id)
                stopping = asyncio.create_task(self.nodes.stop(node_id, worker_id, QUIET_DRAIN),
                                               name=f"fleet stop {worker_id} (abandoned)")
                stopping.add_done_callback(_log_failure)

    def _count_replacement(self, model: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.replacements.labels(reason=reason).inc()

    def _unlist_ended(self) -> None:
        """A worker the nodes reported live and no longer do (another router stopped it, or
        it exited) leaves the registry now: its heartbeats stopped with it, and until it
        missed enough of them this router would send it requests and find its model loaded.
        One stopping is kept: its requests in flight finish."""
        live = {w.worker_id for info in self.nodes.nodes() for w in info.report.workers if w.state != "exited"}
        for worker_id in self._reported - live:
            self.registry.remove(worker_id)
            self._estimates.pop(worker_id, None)  # this router's, ended without it (another router stopped it)
        self._reported = live

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile with the nodes and expire keep-alives every `TICK` until `stop` is set."""
        while not stop.is_set():
            try:
                self.reconcile()
                self.replace_lost()
                self.expire()
                self.scale()
            except Exception:  # the catalog file unreadable for a moment: try again next tick
                log.exception("fleet: reconcile failed")
            try:
                await asyncio.wait_for(stop.wait(), TICK)
            except asyncio.TimeoutError:
                pass
        tasks = [t for t in (*self._loads.values(), *self._unloads.values(), *self._replacing.values(),
                             *self._scaling.values()) if not t.done()]
        for task in tasks:
            task.cancel()
        # their cleanups (workers a load started stopped, claims released) end before the
        # router closes its nodes, bounded: a node that does not answer is not waited for
        if tasks or self._writes:
            await asyncio.wait([*tasks, *self._writes], timeout=STOP_CLEANUP)

    # -- what the catalog shows -------------------------------------------------------------------
    def describe(self, model: str) -> pb.CatalogModel:
        """The catalog entry with its state, status in words, placements and footprint."""
        entry = pb.CatalogModel()
        entry.CopyFrom(self._entry(model))
        placed = self.placed().get(model, _Placed())
        live = sorted((m for m in placed.members if m.live), key=lambda m: (m.worker.group_rank, m.node_id))
        for m in live:
            entry.placements.add(node_id=m.node_id, worker_id=m.worker.worker_id, state=m.worker.state,
                                 group_rank=m.worker.group_rank, group_size=m.worker.group_size or 1,
                                 reserved_bytes=m.worker.reserved_bytes, progress=m.worker.progress)
        entry.footprint_bytes = sum(m.worker.reserved_bytes for m in live) or self._estimate(entry)
        entry.measured_bytes = sum(w.report.resident_bytes for w in self.registry.serving(model))
        entry.replicas = len(placed.replicas())
        use = self._use.get(model)
        if use is not None and use.active == 0 and live:
            entry.idle_seconds = self.clock() - use.idle_since
        nodes = [m.node_id for m in live]
        unloading = self._unloads.get(model)
        if unloading is not None and not unloading.done():
            entry.state, entry.status = "unloading", "unloading from " + _and(nodes)
        elif live and all(m.worker.state == "running" for m in live) and self.serving(model):
            entry.state, entry.status = "serving", "serving on " + _and(nodes)
        elif self.serving(model) and any(m.worker.state == "running" for m in live):
            # a replica being added, or a report a heartbeat behind the group that serves
            replicas = placed.replicas().values()
            whole = [r for r in replicas if all(m.worker.state == "running" for m in r)]
            loading = [r for r in replicas if r not in whole]
            entry.state = "serving"
            entry.status = "serving on " + _and(sorted({m.node_id for r in (whole or loading) for m in r}))
            if whole and loading:
                entry.status += "; a replica loading on " + _and(sorted({m.node_id for r in loading for m in r}))
        elif model in self._fetching:
            self._describe_fetch(entry, self._fetching[model])
        elif live or self.loading(model):
            entry.state = "loading"
            progress = [m for m in live if m.worker.progress]
            entry.status = ("loading on " + _and(nodes) if nodes else "loading") + (
                f" {100 * min(m.worker.progress for m in progress):.0f}%" if progress else "")
            if model in self._waiting_for_room:
                entry.status = "waiting for room (the models that hold it are busy): " + self._waiting_for_room[model]
        else:
            holders = [n.report.node_id for n in self.nodes.nodes()
                       if _disk_model(n.report, source_name(entry.source)) is not None]
            entry.state = "on disk" if holders else "not on disk"
            entry.status = ("on disk on " + _and(holders)) if holders else (
                "on no node yet: pulled from the hub when it loads" if hub.is_hub_source(entry.source)
                else "on no node's --models-dir")
            error = self.load_error(model)
            if error is not None:
                entry.status += f"; last load failed: {error.message}"
        if entry.state == "serving" and model in self._fetching:  # another replica's files on their way
            fetching = pb.CatalogModel()
            self._describe_fetch(fetching, self._fetching[model])
            entry.status += "; a replica " + fetching.status
            entry.fetch_progress = fetching.fetch_progress
        return entry

    @staticmethod
    def _describe_fetch(entry: pb.CatalogModel, fetches: dict[str, _Fetch]) -> None:
        """State "copying" (from a peer, onto any node) or "pulling" (from the hub only), the
        bytes fetched of all, and in words: "copying to mac-2 from mac-1 37%"."""
        hub = placement.HUB
        entry.state = "pulling" if all(f.origin == hub for f in fetches.values()) else "copying"
        total = sum(f.total for f in fetches.values())
        entry.fetch_progress = sum(f.done for f in fetches.values()) / total if total else 0.0
        by_origin: dict[str, list[str]] = {}
        for node_id, f in sorted(fetches.items()):
            by_origin.setdefault(f.origin, []).append(node_id)
        entry.status = "; ".join(f"{'pulling' if origin == hub else 'copying'} to {_and(nodes)} from "
                                 f"{'the hub' if origin == hub else origin}" for origin, nodes in by_origin.items())
        if total:
            entry.status += f" {100 * entry.fetch_progress:.0f}%"

    def _estimate(self, entry: pb.CatalogModel) -> int:
        """The footprint a worker of `entry` would have on the nodes that hold it (the least;
        0: none holds it, or its files cannot be served)."""
        try:
            return min((fp.total for fp in self._footprints(entry, self.nodes.nodes()).values()), default=0)
        except FleetError:
            return 0

    def catalog_models(self) -> list[pb.CatalogModel]:
        return [self.describe(e.name) for e in sorted(self.catalog.entries(), key=lambda e: e.name)]

    def model_infos(self) -> list[pb.ModelInfo]:
        """The catalog's entries as /v1/models lists them (beside the models served)."""
        out = []
        for entry in self.catalog_models():
            served = [w for w in self.registry.serving(entry.name) if w.healthy]
            info = pb.ModelInfo(id=entry.name, owned_by="orchard", state=entry.state, status=entry.status)
            info.max_model_len = max((w.report.max_model_len for w in served), default=0)
            name = source_name(entry.source)
            disk = next((d for n in self.nodes.nodes() if (d := _disk_model(n.report, name))), None) or next(
                (d for (source, _), d in self._described.items() if source == name), None)  # on no node yet
            if not info.max_model_len and disk is not None:
                info.max_model_len = self._context(entry, disk)
            info.tasks.extend(sorted({t for w in served for t in w.report.tasks}) or (list(disk.tasks) if disk else []))
            out.append(info)
        return out

    def rpcs(self) -> CatalogRPCs:
        """The catalog RPCs over this controller (the `Fleet` service hands them here)."""
        return CatalogRPCs(self)

    def annotate(self, workers: list[pb.WorkerInfo]) -> None:
        """Fill each fleet-placed worker's node_id and catalog_model (`orchard router workers`)."""
        where = {m.worker.worker_id: (m.node_id, model) for model, p in self.placed().items() for m in p.members}
        for w in workers:
            if w.worker_id in where:
                w.node_id, w.catalog_model = where[w.worker_id]

    def footprint_errors(self) -> dict[str, float]:
        """Model -> measured resident memory / the footprint estimate - 1, for loaded models
        whose worker reported its resident memory."""
        out = {}
        for w in self.registry.snapshot():
            estimate = self._estimates.get(w.worker_id)
            if estimate and w.report.resident_bytes:
                out[w.model] = w.report.resident_bytes / estimate - 1.0
        return out


def _disk_model(report: pb.NodeReport, name: str) -> pb.DiskModel | None:
    return next((m for n in facts.model_names(name) for m in report.models if m.name == n and not m.error), None)


def _group_id(worker: pb.ManagedWorker) -> str:
    """The id of a group member's group: its rank 0's worker id (`_start_group` names rank r
    `GROUP-rank-r`)."""
    suffix = f"-rank-{worker.group_rank}"
    return worker.worker_id.removesuffix(suffix) if worker.group_rank else worker.worker_id


def _worker_id(model: str, where: str) -> str:
    """A new worker id for `model`: a file-name-safe slug of the name (a catalog name may hold
    "/" and be long; agents name files under --state-dir by worker id) and a short hash of
    it that keeps two names of one slug apart. The name itself is the spec's `model`."""
    slug = _UNSAFE.sub("-", model)[:MAX_SLUG_CHARS].strip("-.") or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:6]
    return f"{slug}-{digest}@{where}-{uuid.uuid4().hex[:6]}"


def _platform(report: pb.NodeReport) -> str:
    return report.platform or "metal"


def _host(report: pb.NodeReport) -> str:
    return report.advertise_host or report.address.rpartition(":")[0] or "127.0.0.1"


def _and(names: list[str]) -> str:
    names = list(dict.fromkeys(names))
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1] if names else "no node"


def _log_failure(task: asyncio.Task) -> None:
    """A fleet task's failure, logged (nobody may await it: an unload the controller began)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("fleet: %s failed: %s", task.get_name(), error,
                    exc_info=None if isinstance(error, FleetError) else error)


async def _either(*waits) -> None:
    """Until the first of `waits` is done (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


class CatalogRPCs:
    """The `Fleet` service's catalog RPCs, which `FleetServicer` hands here: each takes
    `(request, context)` and aborts the call with a FleetError's code and message. The
    server's AuthInterceptor asks for the admin key first, as for the router's other
    admin RPCs."""

    def __init__(self, controller: FleetController):
        self.controller = controller

    async def _answer(self, context, work):
        try:
            return await work()
        except FleetError as e:
            await context.abort(e.code, e.message)

    async def AddModel(self, request: pb.CatalogModel, context) -> pb.CatalogModel:
        async def add():
            added = await self.controller._write(self.controller.catalog.add, request)
            log.info("fleet: catalog %s %s (source %s)", "changed" if request.replace else "added", added.name,
                     added.source)
            return self.controller.describe(added.name)
        return await self._answer(context, add)

    async def RemoveModel(self, request: pb.RemoveModelRequest, context) -> pb.RemoveModelResponse:
        async def remove():
            await self.controller.unload(request.name, "operator")
            await self.controller._write(self.controller.catalog.remove, request.name)
            log.info("fleet: catalog removed %s", request.name)
            return pb.RemoveModelResponse()
        return await self._answer(context, remove)

    async def ListCatalog(self, request: pb.ListCatalogRequest, context) -> pb.ListCatalogResponse:
        async def listed():
            return pb.ListCatalogResponse(models=self.controller.catalog_models())
        return await self._answer(context, listed)

    async def LoadModel(self, request: pb.LoadModelRequest, context) -> pb.CatalogModel:
        return await self._answer(context, lambda: self.controller.load(request.name))

    async def UnloadModel(self, request: pb.UnloadModelRequest, context) -> pb.CatalogModel:
        return await self._answer(context, lambda: self.controller.unload(request.name, "operator"))
