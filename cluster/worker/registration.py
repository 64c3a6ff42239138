"""Keeps a worker registered with a router: `RegisterWorker`, then a `Heartbeat` with the
load report every interval.

- The router answers a registration with its heartbeat interval; the worker beats at the
  shorter of that and its own, so the router never counts a beat as missed.
- A heartbeat answered `known=false` (the router restarted or removed the worker) is
  followed by a new registration right away.
- `report_now()` sends the next heartbeat at once (the worker's health changed: a
  stalled engine must not wait for the interval to be known).
- Each registration names this start of the worker (`instance_id`): a worker restarted
  under the same id is a new process to the router, not one whose failures it remembers.
- An unreachable router is retried every interval, for ever: workers may start first.
- A wrong join token (PERMISSION_DENIED) stops the loop with an error logged; `denied`
  says so (`refusal` the router's answer). The worker keeps serving direct clients.
- With a `KvJournal` (`kv`), each report carries the KV events this router has not
  acked yet (`LoadReport.kv`, `cluster/kv/events.py`); the heartbeat's reply acks them. A
  registration starts over from a snapshot (the router may know nothing of this worker).

A node agent registers itself and sends its node report the same way: its subclass
(`fleet/agent.py`) replaces `stub`, `join` and `beat`.

Usage from the worker's event loop:
    reg = Registration(router, advertise_address, load_report_fn, join_token=token)
    reg.start()  ...  await reg.stop()
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import grpc

from cluster.kv.events import KvJournal, implied_ack
from cluster.net import CHANNEL_OPTIONS
from cluster.security import NO_SECURITY, ClientSecurity, channel
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Registration:
    def __init__(
        self,
        router: str,
        address: str,
        load: Callable[[], pb.LoadReport],
        join_token: str = "",
        worker_id: str = "",
        interval: float = 1.0,
        security: ClientSecurity = NO_SECURITY,
        kv: KvJournal | None = None,
    ):
        self.security = security  # TLS (with this worker's certificate for mutual TLS) and a key
        self.router = router
        self.address = address  # where the router reaches this worker's gRPC server
        self.load = load
        self.join_token = join_token
        self.worker_id = worker_id
        self.interval = interval
        self.registered = False
        self.denied = False
        self.refusal: grpc.aio.AioRpcError | None = None  # the router's answer when `denied`
        self.registrations = 0  # how many times it (re-)registered
        # this start of the process: the router gives a new one a fresh circuit breaker
        self.instance_id = uuid.uuid4().hex
        self.kv = kv
        self.kv_ack: pb.KvAck | None = None  # this router's answer to the KV events sent (None: send a snapshot)
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def report_now(self) -> None:
        """Send the load report now, not at the next interval."""
        self._wake.set()

    def start(self) -> asyncio.Task:
        self._task = asyncio.create_task(self.run(), name="orchard-registration")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.interval
        async with channel(self.router, self.security, options=CHANNEL_OPTIONS) as ch:
            stub = self.stub(ch)
            next_at = loop.time()
            while True:
                try:
                    if not self.registered:
                        period = await self._register(stub)
                    elif not await self.beat(stub, timeout=max(period, 1.0)):
                        log.info("router %s does not know %s %s: registering again", self.router, self.what,
                                 self.worker_id)
                        self.registered = False
                        continue
                except grpc.aio.AioRpcError as e:
                    if self.refused_for_good(e):
                        self.denied, self.refusal = True, e
                        log.error("router %s refused %s %s: %s", self.router, self.what, self.address, e.details())
                        return
                    if self.registered:
                        log.warning("heartbeat to router %s failed: %s", self.router, e.code().name)
                    else:
                        log.debug("cannot register with router %s yet: %s", self.router, e.code().name)
                except Exception:  # a bug in load(): keep beating
                    log.exception("heartbeat failed")
                next_at = max(next_at + period, loop.time())
                try:
                    await asyncio.wait_for(self._wake.wait(), next_at - loop.time())
                    next_at = loop.time()
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()

    # -- what a subclass registering something else (a node agent) replaces --------------------
    what = "worker"

    def stub(self, ch):
        return pb_grpc.RouterStub(ch)

    def refused_for_good(self, error: grpc.aio.AioRpcError) -> bool:
        """Whether the router's answer ends the registration (else it is tried again)."""
        return error.code() == grpc.StatusCode.PERMISSION_DENIED

    async def join(self, stub, timeout: float) -> tuple[str, int]:
        """Register: (the id the router gave, its heartbeat interval in ms)."""
        self.kv_ack = None
        load = self._load()
        reply = await stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                worker_id=self.worker_id, address=self.address, join_token=self.join_token, load=load,
                instance_id=self.instance_id,
            ),
            timeout=timeout,
        )
        self._kv_answered(load, None)
        return reply.worker_id, reply.heartbeat_interval_ms

    async def beat(self, stub, timeout: float) -> bool:
        """One heartbeat; False: the router does not know this process (register again)."""
        load = self._load()
        reply = await stub.Heartbeat(
            pb.HeartbeatRequest(worker_id=self.worker_id, join_token=self.join_token, load=load),
            timeout=timeout,
        )
        if reply.known:
            self._kv_answered(load, reply.kv_ack if reply.HasField("kv_ack") else None)
        return reply.known

    def _load(self) -> pb.LoadReport:
        """The load report, with the KV events this router needs next."""
        load = self.load()
        if self.kv is not None:
            load.kv.CopyFrom(self.kv.batch(self.kv_ack))
        return load

    def _kv_answered(self, load: pb.LoadReport, ack: pb.KvAck | None) -> None:
        """The router took `load`; `ack`: its answer to the KV events in it (None: no answer
        came with the reply, as to a registration's: taken as applied; a router that did
        not apply them asks for a resync at the next beat)."""
        if load.HasField("kv"):
            self.kv_ack = ack if ack is not None else implied_ack(load.kv, self.kv_ack)

    async def _register(self, stub) -> float:
        self.worker_id, interval_ms = await self.join(stub, timeout=max(2 * self.interval, 2.0))
        self.registered = True
        self.registrations += 1
        log.info("registered with router %s as %s (at %s)", self.router, self.worker_id, self.address)
        router_interval = interval_ms / 1000.0
        return min(self.interval, router_interval) if router_interval > 0 else self.interval
