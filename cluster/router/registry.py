"""The router's view of its workers: registration, heartbeats, health, draining, load.

Two ways in. A worker registers itself (`RegisterWorker` with the join token) and sends a
heartbeat with its load report every `heartbeat_interval`; or an operator adds it
statically (`AddWorker`) and the router polls its `GetLoad` and gRPC health at the same
interval. Either way a worker not heard from for `missed_heartbeats` intervals is
unhealthy (no new requests) and its streams resume elsewhere; a self-registered one is
removed after `remove_after` seconds of silence (a static one stays, polled, until it is removed by hand). A failed
stream also marks its worker unhealthy at once; the next heartbeat or poll that succeeds
makes it healthy again. A worker that cannot start says why (`report_failure`): it is listed
as failed until it registers again, and a permanent failure of a model's only worker ends
the router's hold for that model (`failed_for_good`). `wait_changed` wakes whoever waits on a change of the workers
(one joins or is removed, or its state changes). How late the router's own event loop
runs (stalled on an overloaded machine) is not counted as the workers' silence: their
latest heartbeats may be waiting unread in its sockets. The KV events a report carries
(`LoadReport.kv`) are replayed into `kv_map` (router/kv_map.py) and dropped from the stored
report; the map's ack goes back in the heartbeat's reply, or in the next poll's request.

All of it runs on the router's event loop; `snapshot()` may be read from other threads.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api.limits import quoted
from cluster.api.pooling import GENERATE, refuse_task, tasks_of
from cluster.api.wire import refuse_features
from cluster.net import CHANNEL_OPTIONS
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.breaker import CLOSED, CircuitBreaker
from cluster.router.config import RouterConfig
from cluster.router.kv_map import KvMap
from cluster.security import NO_SECURITY, ClientSecurity, channel

log = logging.getLogger(__name__)

HEALTHY, UNHEALTHY, DRAINING = pb.WORKER_STATE_HEALTHY, pb.WORKER_STATE_UNHEALTHY, pb.WORKER_STATE_DRAINING
FAILED = pb.WORKER_STATE_FAILED
STATE_NAMES = {HEALTHY: "healthy", UNHEALTHY: "unhealthy", DRAINING: "draining", FAILED: "failed"}
MAX_FAILURES = 256  # start failures remembered (the oldest go first)
MAX_FAILURE_REASON = 2000  # characters of a failure's reason kept
# A worker's epochs, unique across workers: a new one each time it joins, comes back to
# health, takes requests again after a drain of its own (a Mac back from sleep) or
# re-registers as a new process (a request that failed on it may try it again).
_EPOCHS = itertools.count(1)


@dataclass(frozen=True)
class RegistryConfig:
    """The registry's part of `RouterConfig`: meanings and defaults are there."""

    join_token: str = RouterConfig.join_token  # empty: registration is open (a local cluster)
    heartbeat_interval: float = RouterConfig.heartbeat_interval
    missed_heartbeats: int = RouterConfig.missed_heartbeats
    remove_after: float = RouterConfig.remove_after
    circuit_threshold: int = RouterConfig.circuit_threshold
    circuit_cooldown: float = RouterConfig.circuit_cooldown
    # A worker silent this long (no heartbeat, no poll) has its streams resumed elsewhere,
    # those with no token yet included (a Mac asleep: its connections stay open and quiet).
    stream_idle_timeout: float = RouterConfig.stream_idle_timeout

    @property
    def unhealthy_after(self) -> float:
        return self.missed_heartbeats * self.heartbeat_interval


@dataclass(eq=False)
class WorkerRecord:
    worker_id: str
    address: str
    static: bool = False
    report: pb.LoadReport = field(default_factory=pb.LoadReport)
    inflight: int = 0  # requests this router has open on the worker now
    inflight_at_report: int = 0  # ... when the last report arrived
    tokens_relayed: int = 0  # to this router's clients, ever (the console's tokens/s)
    last_seen: float = field(default_factory=time.monotonic)
    healthy: bool = True
    drained: bool = False  # by an operator through the router
    channel: object = None
    generation: object = None  # GenerationStub
    admin: object = None  # WorkerAdminStub
    health: object = None  # HealthStub
    # The router's open streams there (proxy attempts with `abandon(reason)`): a worker
    # that reports itself stalled has them all resumed elsewhere at once.
    attempts: set = field(default_factory=set)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    identity: str | None = None  # the certificate name it registered with (mutual TLS)
    instance: str = ""  # the start of its process it registered from (empty: a static worker, or not said)
    epoch: int = field(default_factory=lambda: next(_EPOCHS))
    kv_ack: pb.KvAck | None = None  # the KV map's answer to its last report's events (None: none sent)

    @property
    def model(self) -> str:
        return self.report.model

    @property
    def state(self) -> int:
        if not self.healthy:
            return UNHEALTHY
        if self.drained or self.report.draining:
            return DRAINING
        return HEALTHY

    @property
    def load(self) -> float:
        """Requests on the worker: the report plus what this router placed since it, and
        never less than this router's own in-flight count (reports lag by up to a second)."""
        reported = self.report.num_running + self.report.num_waiting
        return max(reported + self.inflight - self.inflight_at_report, self.inflight)

    @property
    def kv_usage(self) -> float:
        total = self.report.kv_blocks_total
        return self.report.kv_blocks_used / total if total else 0.0

    def has(self, features: frozenset[str]) -> bool:
        """Whether the worker has each of these per-request features (as it last reported)."""
        return features <= set(self.report.features)

    def abandon_streams(self, reason: str) -> None:
        """Cancel the router's open streams on this worker; each resumes elsewhere."""
        for attempt in list(self.attempts):
            attempt.abandon(reason)

    def on_report(self, report: pb.LoadReport, now: float) -> None:
        undrained = self.report.draining and not report.draining
        self.report = report
        self.inflight_at_report = self.inflight
        self.last_seen = now
        healthy = not report.stalled and not report.unhealthy_reason
        if healthy and (not self.healthy or undrained):
            self.epoch = next(_EPOCHS)
        self.healthy = healthy

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            model=self.model,
            state=self.state,
            load=self.report,
            inflight=self.inflight,
            static=self.static,
            circuit=self.breaker.state,
        )


@dataclass(frozen=True)
class StartFailure:
    """A worker's report that it could not start (`cluster/exit_codes.py`'s code)."""

    worker_id: str
    model: str
    reason: str
    exit_code: int
    permanent: bool
    at: float = field(default_factory=time.monotonic)

    def info(self, now: float | None = None) -> pb.WorkerInfo:
        age = (time.monotonic() if now is None else now) - self.at
        return pb.WorkerInfo(worker_id=self.worker_id, model=self.model, state=FAILED,
                             failure=pb.WorkerFailure(reason=self.reason, exit_code=self.exit_code,
                                                      permanent=self.permanent, age_seconds=age))


def describe_failure(f: StartFailure) -> str:
    """A client's error for a model whose worker could not start."""
    then = ("it is not started again until that is fixed" if f.permanent
            else "it is being started again")
    return f"model {quoted(f.model)}'s worker {f.worker_id} could not start ({then}): {f.reason}"


class RegistryError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param  # the request field at fault, for an INVALID_ARGUMENT


class Registry:
    def __init__(self, config: RegistryConfig = RegistryConfig(), connect: bool = True, on_remove=None,
                 security: ClientSecurity = NO_SECURITY, bind_identities: bool = False):
        self.config = config
        self.security = security  # how the router dials its workers
        # mutual TLS: a worker id belongs to the certificate name that first registered it
        self.bind_identities = bind_identities
        self.workers: dict[str, WorkerRecord] = {}
        self._connect = connect  # False in unit tests: no channels
        self._on_remove = on_remove or (lambda worker_id: None)
        self._closing: set[asyncio.Task] = set()
        self._changed = asyncio.Event()  # set, and replaced, at each change (`wait_changed`)
        self._gone: dict[str, float] = {}  # model -> when its last worker was removed (`served_lately`)
        self.failures: dict[str, StartFailure] = {}  # worker id -> its last start's failure, until it registers
        self.kv_map = KvMap()  # the blocks each worker holds, per tier, from the KV events in its reports

    # -- lookups ------------------------------------------------------------------------------
    def find(self, key: str) -> WorkerRecord | None:
        """By id, or else by address."""
        if key in self.workers:
            return self.workers[key]
        return next((w for w in self.workers.values() if w.address == key), None)

    def snapshot(self) -> list[WorkerRecord]:
        return list(self.workers.values())

    def serving(self, model: str, task: str | None = None) -> list[WorkerRecord]:
        """Every worker serving `model` (any model when empty), whatever its state; with
        `task`, only those whose model serves it ("generate", "embed", "score")."""
        return [w for w in self.workers.values()
                if (not model or w.model == model) and (task is None or task in tasks_of(w.report.tasks))]

    def candidates(self, model: str, task: str = GENERATE, features: frozenset[str] = frozenset()
                   ) -> list[WorkerRecord]:
        """Healthy, not draining, serving `model` (any model when empty) for `task`, with
        every per-request feature in `features`. Raises NOT_FOUND when no worker serves the
        model, INVALID_ARGUMENT when its workers serve other tasks (an embedding model asked
        to generate) or none of them has a feature asked for (whatever their health: the
        same answer every time), UNAVAILABLE when none is healthy. Workers lagging (a step
        running well past its usual time) are left out while another can take requests."""
        serving = self.serving(model, task)
        others = self.serving(model) if not serving else []
        if others:
            raise RegistryError(grpc.StatusCode.INVALID_ARGUMENT, refuse_task(
                model or ", ".join(sorted({w.model for w in others})), task,
                sorted({t for w in others for t in tasks_of(w.report.tasks)})).message)
        if not serving:
            failure = self.failed(model) if model else None
            if failure is not None:  # a model of the fleet whose worker cannot start (now, or for good)
                raise RegistryError(grpc.StatusCode.UNAVAILABLE, describe_failure(failure))
            known = sorted({w.model for w in self.workers.values() if w.model})
            what = f"model {quoted(model)}" if model else "any model"
            raise RegistryError(
                grpc.StatusCode.NOT_FOUND if model else grpc.StatusCode.UNAVAILABLE,
                f"no worker serves {what}"
                + (f" (served: {', '.join(known)})" if known else " (no workers registered)"),
            )
        able = [w for w in serving if w.has(features)]
        if not able:
            missing = features - {f for w in serving for f in w.report.features} or features
            refusal = refuse_features(model or ", ".join(sorted({w.model for w in serving})), missing)
            raise RegistryError(grpc.StatusCode.INVALID_ARGUMENT, refusal.message, refusal.param)
        serving = able
        ready = [w for w in serving if w.state == HEALTHY and w.breaker.allows()]
        if not ready:
            states = ", ".join(f"{w.worker_id}: {STATE_NAMES[w.state]}"
                               + (f", circuit {w.breaker.state}" if w.breaker.state != CLOSED else "")
                               for w in serving)
            raise RegistryError(
                grpc.StatusCode.UNAVAILABLE,
                f"no healthy worker for {('model ' + repr(model)) if model else 'the request'} ({states})",
            )
        # a worker whose step runs long (lagging: a stall, perhaps) only when no other can take it
        return [w for w in ready if not w.report.lagging] or ready

    def served_lately(self, model: str, within: float) -> bool:
        """Whether a worker serves `model` (any model when empty), in any state, or did
        until less than `within` seconds ago, or failed to start and is being started
        again (reported less than `within` seconds ago): one may come back (a restart)."""
        now = time.monotonic()
        if self.serving(model) or any(not f.permanent and (not model or f.model == model) and now - f.at <= within
                                      for f in self.failures.values()):
            return True
        for gone, at in list(self._gone.items()):
            if now - at > within:
                del self._gone[gone]
        return any(not model or gone == model for gone in self._gone)

    @property
    def can_serve(self) -> bool:
        """Some worker can take a request now (healthy, not draining)."""
        return any(w.state == HEALTHY for w in self.workers.values())

    def models(self) -> list[pb.ModelInfo]:
        seen: dict[str, pb.ModelInfo] = {}
        for w in self.workers.values():
            if w.model and w.healthy:
                info = seen.setdefault(w.model, pb.ModelInfo(id=w.model, owned_by="orchard"))
                info.max_model_len = max(info.max_model_len, w.report.max_model_len)
                info.tasks.extend(t for t in tasks_of(w.report.tasks) if t not in info.tasks)
        return sorted(seen.values(), key=lambda m: m.id)

    # -- registration -----------------------------------------------------------------------------
    def check_token(self, token: str) -> None:
        expected = self.config.join_token
        if expected and not hmac.compare_digest(token.encode(), expected.encode()):
            raise RegistryError(grpc.StatusCode.PERMISSION_DENIED, "wrong join token")

    def check_identity(self, worker_id: str, identity: str | None) -> None:
        """Under mutual TLS a worker id belongs to the certificate that registered it first:
        another certificate cannot take it over (its address stays as it is)."""
        if not self.bind_identities:
            return
        if not identity:
            raise RegistryError(grpc.StatusCode.UNAUTHENTICATED,
                                "registration needs a client certificate of the fleet CA")
        w = self.workers.get(worker_id)
        if w is not None and w.identity is not None and w.identity != identity:
            log.warning("refused worker id %s from certificate %r: it belongs to %r", worker_id, identity, w.identity)
            raise RegistryError(grpc.StatusCode.PERMISSION_DENIED,
                                f"worker id {worker_id!r} belongs to another certificate than {identity!r}")

    def register(self, worker_id: str, address: str, token: str, report: pb.LoadReport,
                 identity: str | None = None, instance: str = "") -> WorkerRecord:
        """`instance`: the worker process's start; a known worker that registers with
        another one restarted: it starts clean (`_restarted`)."""
        self.check_token(token)
        if not address:
            raise RegistryError(grpc.StatusCode.INVALID_ARGUMENT, "a worker must register with its address")
        worker_id = worker_id or report.worker_id or address
        self.check_identity(worker_id, identity)
        other = next((w for w in self.workers.values() if w.address == address and w.worker_id != worker_id), None)
        if self.bind_identities and other is not None and other.identity not in (None, identity):
            raise RegistryError(grpc.StatusCode.PERMISSION_DENIED,
                                f"{address} is worker {other.worker_id!r}'s, registered by another certificate")
        known = self.workers.get(worker_id)
        if known is not None and known.address == address and instance and known.instance not in ("", instance):
            self._restarted(known)
        if self.failures.pop(worker_id, None) is not None:
            log.info("worker %s, failed before, started", worker_id)
        w = self._upsert(worker_id, address, report, static=False)
        w.identity = w.identity or identity
        w.instance = instance or w.instance
        return w

    def _restarted(self, w: WorkerRecord) -> None:
        """A new process under a known id: the old one's failures were its own (a closed
        breaker, no count; the half-open probe is for a worker that stayed up), its streams
        are gone, and a new connection reaches the new process at once."""
        log.info("worker %s registered as a new process: circuit closed (was %s), failures forgotten",
                 w.worker_id, w.breaker.state)
        w.abandon_streams(f"worker {w.worker_id} restarted")
        w.breaker = self._breaker()
        w.epoch = next(_EPOCHS)
        if w.channel is not None:
            self._close_channel(w)
            self._open(w)
        self._notify()

    def report_failure(self, worker_id: str, token: str, model: str, reason: str, exit_code: int, permanent: bool,
                       identity: str | None = None) -> StartFailure:
        """Worker `worker_id` could not start (its process ends): listed as failed until it
        registers again. A record of it left from an earlier start is removed (that process
        is gone), its streams resumed elsewhere or held."""
        self.check_token(token)
        if not worker_id:
            raise RegistryError(grpc.StatusCode.INVALID_ARGUMENT, "a failure report needs the worker's worker_id",
                                "worker_id")
        self.check_identity(worker_id, identity)
        if len(reason) > MAX_FAILURE_REASON:
            reason = reason[:MAX_FAILURE_REASON] + " ..."
        failure = StartFailure(worker_id, model, reason, exit_code, permanent)
        known = self.workers.get(worker_id)
        if known is not None:
            known.abandon_streams(f"worker {worker_id} failed to start again")
            self.remove(worker_id)
        self.failures.pop(worker_id, None)
        self.failures[worker_id] = failure
        while len(self.failures) > MAX_FAILURES:
            del self.failures[next(iter(self.failures))]
        log.warning("worker %s (model %s) could not start, %s: %s", worker_id, model or "?",
                    "for good: no launcher starts it again as it is" if permanent else "it will be started again",
                    reason)
        self._notify()
        return failure

    def forget_failure(self, worker_id: str) -> bool:
        """An operator's `remove` of a worker listed as failed."""
        if self.failures.pop(worker_id, None) is None:
            return False
        self._notify()
        return True

    def failed(self, model: str) -> StartFailure | None:
        """The latest start failure of a worker of `model`."""
        return next((f for f in reversed(self.failures.values()) if f.model == model), None)

    def failed_for_good(self, model: str) -> StartFailure | None:
        """The latest permanent start failure of a worker of `model`, when no worker of it
        is registered: nothing will come back for it until someone fixes that."""
        if not model or self.serving(model):
            return None
        return next((f for f in reversed(self.failures.values()) if f.model == model and f.permanent), None)

    def heartbeat(self, worker_id: str, token: str, report: pb.LoadReport, identity: str | None = None) -> bool:
        """False: the worker is unknown (the router restarted, or removed it) and must register."""
        self.check_token(token)
        self.check_identity(worker_id, identity)
        w = self.workers.get(worker_id)
        if w is None:
            return False
        self.record_report(w, report)
        return True

    def kv_ack(self, worker_id: str) -> pb.KvAck | None:
        """The answer to worker `worker_id`'s last KV events (its heartbeat's reply carries it)."""
        w = self.workers.get(worker_id)
        return None if w is None else w.kv_ack

    def record_report(self, w: WorkerRecord, report: pb.LoadReport) -> None:
        if report.HasField("kv"):  # applied here, then dropped: the stored report (ListWorkers) never carries it
            if self.workers.get(w.worker_id) is w:  # a report that came after its worker was removed: none kept
                w.kv_ack = self.kv_map.apply(w.worker_id, report.kv)
            report.ClearField("kv")
        state, healthy = w.state, w.healthy
        w.on_report(report, time.monotonic())
        if report.stalled:
            if healthy:
                log.warning("worker %s reports its engine stalled: unhealthy; resuming its %d streams elsewhere",
                            w.worker_id, len(w.attempts))
            w.abandon_streams(f"worker {w.worker_id}'s engine stalled")
        elif report.unhealthy_reason:  # it cannot take new requests; those it has run on
            if healthy:
                log.warning("worker %s reports itself unhealthy (%s): placing nothing there", w.worker_id,
                            report.unhealthy_reason)
        elif not healthy:
            log.info("worker %s is healthy again", w.worker_id)
        if report.lagging and not report.stalled:
            self._move_unstarted(w)
        if w.state != state:
            self._notify()

    def _move_unstarted(self, w: WorkerRecord) -> None:
        """A worker lagging (its step runs well past its usual time: a long step, or the
        start of a stall): its streams that have had no output yet go to another worker of
        its model that can take them and is not lagging (they would wait for that step;
        nothing of theirs has reached a client; the proxy bounds how often one moves)."""
        if not any(o is not w and o.state == HEALTHY and o.breaker.allows() and not o.report.lagging
                   for o in self.serving(w.model)):
            return
        moved = sum(attempt.move(f"worker {w.worker_id}'s step runs long: placed on another worker")
                    for attempt in list(w.attempts))
        if moved:
            log.info("worker %s is lagging: %d requests with no output yet placed on other workers", w.worker_id,
                     moved)

    def set_drained(self, w: WorkerRecord, drained: bool) -> None:
        """An operator's drain (or its undo) through the router."""
        if w.drained != drained:
            w.drained = drained
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """Wake whoever waits on a change (`wait_changed`) for a reason outside the registry:
        a fleet load failed, so the requests held for its model fail now."""
        self._notify()

    def may_come_back(self, model: str, excluded: set[str], task: str = GENERATE,
                      features: frozenset[str] = frozenset()) -> list[WorkerRecord]:
        """Workers for `model`, `task` and `features`, not in `excluded`, that are unhealthy
        but not draining: a heartbeat or poll may make them candidates again."""
        return [w for w in self.serving(model, task) if w.has(features)
                and w.worker_id not in excluded and not w.healthy and not (w.drained or w.report.draining)]

    async def wait_changed(self, timeout: float) -> bool:
        """Wait until a worker joins, is removed or changes state, at most `timeout` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def add_static(self, address: str, report: pb.LoadReport | None = None) -> WorkerRecord:
        """An operator's worker: polled by the router. Its id comes from its first report."""
        existing = self.find(address)
        if existing is not None and (report is None or existing.worker_id == (report.worker_id or address)):
            existing.static = True
            if report is not None:
                self.record_report(existing, report)
            return existing
        worker_id = (report.worker_id if report is not None else "") or address
        w = self._upsert(worker_id, address, report or pb.LoadReport(), static=True)
        if report is None:
            w.healthy = False  # not heard from yet
        return w

    def _upsert(self, worker_id: str, address: str, report: pb.LoadReport, static: bool) -> WorkerRecord:
        w = self.workers.get(worker_id)
        if w is not None and w.address != address:
            log.info("worker %s moved from %s to %s", worker_id, w.address, address)
            self.remove(worker_id)
            w = None
        # Another id at this address: the worker restarted under a new id.
        stale = self.find(address)
        if w is None and stale is not None and stale.worker_id != worker_id:
            self.remove(stale.worker_id)
        if w is None:
            w = WorkerRecord(worker_id=worker_id, address=address, static=static, breaker=self._breaker())
            self._open(w)
            self.workers[worker_id] = w
            log.info("worker %s at %s joined (model %s%s)", worker_id, address, report.model,
                     ", static" if static else "")
            self._notify()
        w.static = w.static or static
        self.record_report(w, report)
        return w

    def _breaker(self) -> CircuitBreaker:
        return CircuitBreaker(self.config.circuit_threshold, self.config.circuit_cooldown)

    def remove(self, key: str) -> WorkerRecord | None:
        w = self.find(key)
        if w is None:
            return None
        del self.workers[w.worker_id]
        if w.model:
            self._gone[w.model] = time.monotonic()
        self._on_remove(w.worker_id)
        self.kv_map.forget(w.worker_id)
        self._notify()
        if w.channel is not None:
            self._close_channel(w)
        log.info("worker %s at %s removed", w.worker_id, w.address)
        return w

    def _close_channel(self, w: WorkerRecord) -> None:
        task = asyncio.ensure_future(w.channel.close(grace=None))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _open(self, w: WorkerRecord) -> None:
        if not self._connect:
            return
        w.channel = channel(w.address, self.security, options=CHANNEL_OPTIONS)
        w.generation = pb_grpc.GenerationStub(w.channel)
        w.admin = pb_grpc.WorkerAdminStub(w.channel)
        w.health = health_pb2_grpc.HealthStub(w.channel)

    # -- health -----------------------------------------------------------------------------------
    def mark_failed(self, worker_id: str, why: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None and w.healthy:
            log.warning("worker %s marked unhealthy: %s", worker_id, why)
            w.healthy = False
            self._notify()

    def sweep(self, now: float | None = None, stalled: float = 0.0) -> None:
        """Mark silent workers unhealthy; remove self-registered ones silent too long.
        `stalled`: how late this process is running (its event loop's delay), so how much
        of the workers' latest beats may still wait unread: not counted as silence."""
        now = time.monotonic() if now is None else now
        for w in list(self.workers.values()):
            silent = now - w.last_seen - stalled
            if w.healthy and silent > self.config.unhealthy_after:
                log.warning("worker %s missed %d heartbeats: unhealthy", w.worker_id, self.config.missed_heartbeats)
                w.healthy = False
                self._notify()
            # A worker that misses its beats is stopped or asleep (they come from its event
            # loop, not its engine: a busy engine does not delay them): its streams resume now.
            if w.attempts and silent > min(self.config.unhealthy_after, self.config.stream_idle_timeout):
                log.warning("worker %s silent for %.0f s: resuming its %d streams elsewhere", w.worker_id, silent,
                            len(w.attempts))
                w.abandon_streams(f"worker {w.worker_id} silent for {silent:.0f} s")
            if not w.static and silent > self.config.remove_after:
                self.remove(w.worker_id)

    async def poll_static(self, timeout: float | None = None) -> None:
        """One round of GetLoad + health checks of the static workers."""
        statics = [w for w in self.workers.values() if w.static and w.admin is not None]
        if statics:
            await asyncio.gather(*(self.poll(w, timeout or self.config.heartbeat_interval) for w in statics))

    @staticmethod
    def load_request(w: WorkerRecord) -> pb.GetLoadRequest:
        """GetLoad's request: with the KV map's last ack, so the worker sends only the events after it."""
        return pb.GetLoadRequest(kv_ack=w.kv_ack)

    async def poll(self, w: WorkerRecord, timeout: float) -> None:
        """GetLoad + gRPC health of one worker; a report if both answer and it is SERVING."""
        try:
            report, health = await asyncio.gather(
                w.admin.GetLoad(self.load_request(w), timeout=timeout),
                w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout),
            )
        except grpc.aio.AioRpcError as e:
            log.debug("poll of %s failed: %s", w.address, e.code())
            return
        serving = health.status == health_pb2.HealthCheckResponse.SERVING
        if not serving and not report.stalled and not report.unhealthy_reason:
            return
        if w.worker_id in self.workers and self.workers[w.worker_id] is w:
            new_id = report.worker_id
            if new_id and new_id != w.worker_id and w.worker_id == w.address and new_id not in self.workers:
                # First report of a worker added before it was up: adopt its own id.
                del self.workers[w.worker_id]
                w.worker_id = new_id
                self.workers[w.worker_id] = w
            self.record_report(w, report)

    async def run(self, stop: asyncio.Event) -> None:
        """The health loop: sweep and poll every heartbeat interval until `stop` is set.
        How late each wake-up is measures the event loop's delay (a stall, a busy loop)."""
        interval = self.config.heartbeat_interval
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not stop.is_set():
            late = max(0.0, loop.time() - due)
            if late > interval:
                log.warning("router stalled for %.2f s: not counted as its workers' silence", late)
            self.sweep(stalled=late)
            await self.poll_static()
            due = loop.time() + interval
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        for w in self.workers.values():
            if w.channel is not None:
                await w.channel.close(grace=None)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
