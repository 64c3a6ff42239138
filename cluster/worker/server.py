"""`orchard worker serve`: wiring of the worker process.

`WorkerService` (the asyncio side, which owns the engine thread) is the `Backend` that
the API layer serves: `cluster.api` starts gRPC (Generation, WorkerAdmin, health),
/metrics and, with `--http`, the OpenAI-compatible API over it; `Registration` reports
to a router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from dataclasses import replace

import grpc

from cluster.api.serving import Endpoints, MetricsEndpoint
from cluster.api.servicer import GenerationServicer
from cluster.exit_codes import EXIT_PERMANENT, describe, exit_code, is_permanent
from cluster.net import check_addresses, parse_address
from cluster.security import channel
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.worker.chat_render import check_renderer
from cluster.worker.config import WorkerOptions
from cluster.worker.engine_loop import EngineLoadError
from cluster.worker.power import PowerNotifier, StayAwake, system_power

log = logging.getLogger(__name__)

READY_PREFIX = "ORCHARD_WORKER_READY "  # + JSON of the bound addresses, printed on stdout
REPORT_FAILURE_TIMEOUT_S = 3.0  # a router's answer to "this worker could not start"

def routers(value: str | None) -> list[str]:
    """`--router A,B`: the routers a worker registers with (a fleet may run several)."""
    return [r.strip() for r in (value or "").split(",") if r.strip()]


def default_worker_id(options: WorkerOptions, port: int) -> str:
    """HOSTNAME-PORT; under mutual TLS, the certificate's name (the router binds the id to it)."""
    if options.security.mutual:
        from cluster.certs import common_name

        return common_name(options.security.tls_cert)
    return f"{socket.gethostname()}-{port}"


class WorkerAdminServicer(pb_grpc.WorkerAdminServicer):
    def __init__(self, server: "WorkerServer"):
        self.server = server

    async def GetLoad(self, request, context) -> pb.LoadReport:
        report = self.server.service.load_report()
        journal = self.server.kv_journal
        if journal is not None:  # a polled worker: the KV events after the router's ack
            report.kv.CopyFrom(journal.batch(request.kv_ack if request.HasField("kv_ack") else None))
        return report

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        return await self.server.set_draining(request.drain)

    async def GetTokenizer(self, request, context) -> pb.TokenizerFiles:
        files = self.server.service.tokenizer_files
        if files is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker's tokenizer cannot be sent (it "
                                "has no files, or they are over the size limit)")
        return files


# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms).
# The engine thread gives the GIL up at every MLX evaluation and C kernel call (a hundred
# times a step) and must win it back from the asyncio thread each time; at the default it waits
# behind the streaming side and a served step is slower than the engine's own
# (`load/bench_worker_vs_mlx.py --only orchard`; MEASUREMENTS.md).
GIL_SWITCH_INTERVAL_S = 0.0002


class WorkerServer:
    """Start with `await start()`, stop with `await stop()`; `addresses` has what was bound."""

    def __init__(self, options: WorkerOptions, power: PowerNotifier | None = None):
        self.options = options
        self.power = power  # the machine's power management (None: this machine's, `system_power()`)
        self.awake: StayAwake | None = None  # the Mac kept awake while the model is loaded (power.py)
        self._drained_for_sleep = False
        self.service = None
        self.endpoints = Endpoints(security=options.security)
        self._registrations: list = []
        self._watchdog: asyncio.Task | None = None
        self._switch_interval: float | None = None

    @property
    def addresses(self) -> dict[str, str]:
        return self.endpoints.addresses

    @property
    def engine_loop(self):
        return None if self.service is None else self.service.engine_loop

    @property
    def kv_journal(self):
        """The engine's KV events (cluster/kv/events.py), for the routers; None: it has none."""
        loop = self.engine_loop
        return None if loop is None or loop.engine is None else getattr(loop.engine, "kv_journal", None)

    async def start(self) -> "WorkerServer":
        """Load the engine and bind everything; on any failure, stop what already started
        (engine thread, gRPC server, HTTP sites) before raising."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        from cluster.worker.engine import Engine
        from cluster.worker.service import WorkerService

        opts = self.options
        self._switch_interval = sys.getswitchinterval()  # given back by stop()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        port = self.endpoints.bind_grpc(opts.grpc_address)
        worker_id = opts.worker_id or default_worker_id(opts, port)

        warmed: list[float] = []  # the warm-up's seconds: a full-budget prefill step and a decode step

        def load_engine() -> Engine:  # runs on the engine thread
            if opts.group.enabled:  # rank 0 of a worker group: the members join, then it serves for all
                from cluster.worker.group.leader import load_group_engine

                engine = load_group_engine(opts.model_path, opts.engine_config, opts.group, opts.join_token,
                                           model_name=opts.served_model_name)
            else:
                engine = Engine.from_pretrained(opts.model_path, opts.engine_config, opts.served_model_name)
            warmed.append(engine.warm_up())
            log.info("engine warmed up in %.2f s", warmed[-1])
            return engine

        self.service = service = WorkerService(worker_id, load_engine, stall_report=opts.stall_report,
                                               limits=opts.limits, templates=opts.chat_templates)
        try:
            await service.start()
        except EngineLoadError as e:  # the routers list why, before the process ends
            await self._report_failure(worker_id, e)
            raise
        service.engine_loop.full_step = warmed[-1] if warmed else 0.0

        def add_services(server) -> None:
            pb_grpc.add_GenerationServicer_to_server(GenerationServicer(service), server)
            pb_grpc.add_WorkerAdminServicer_to_server(WorkerAdminServicer(self), server)

        metrics = MetricsEndpoint(service.metrics.render, service.metrics.content_type,
                                  healthy=lambda: service.engine_loop.alive and self._healthy())
        await self.endpoints.start(add_services, backend=service, http_address=opts.http_address,
                                   metrics=metrics, metrics_address=opts.metrics_address,
                                   request_timeout=opts.request_timeout,
                                   http_extras=None if opts.console == "off" else self._console)
        self._watchdog = asyncio.create_task(self._watch_progress())
        journal = self.kv_journal
        if journal is not None:
            if service.metrics is not None:
                service.metrics.watch_kv_events(journal)
            loop = asyncio.get_running_loop()

            def report_soon() -> None:  # on the engine thread: many KV events wait for the routers
                if not loop.is_closed():
                    loop.call_soon_threadsafe(self._report_now)

            journal.on_backlog = report_soon
        if opts.router:
            from cluster.worker.registration import Registration

            advertise = opts.advertise_address or self.addresses["grpc"]
            if advertise.rpartition(":")[0] in ("0.0.0.0", "::", ""):  # bound to all: name this machine
                advertise = f"{socket.getfqdn()}:{parse_address(advertise)[1]}"
            for router in routers(opts.router):  # every router of the fleet places work here
                registration = Registration(router, advertise, service.load_report, join_token=opts.join_token,
                                            worker_id=worker_id, interval=opts.heartbeat_interval,
                                            security=opts.security.client(), kv=journal)
                registration.start()
                self._registrations.append(registration)
        self.awake = awake = self._stay_awake(f"orchard worker {worker_id} serves {service.model_name}").start()
        group = getattr(service.engine_loop.engine, "group", None)
        if group is not None:  # a member's Mac about to sleep drains the group as this one's would
            group.leader.on_sleep(lambda rank, sleeping: awake.drain(awake.drain_s) if sleeping else awake.undrain())
        log.info("worker %s serving %s (%s): %s", worker_id, service.model_name, opts.model_path,
                 ", ".join(f"{k} {v}" for k, v in self.addresses.items()))

    async def _report_failure(self, worker_id: str, error: EngineLoadError) -> None:
        """Tell each router this worker could not start, and why (best effort, bounded in
        time: the process ends next whatever they answer)."""
        from pathlib import Path

        opts = self.options
        code = exit_code(error.__cause__ or error)
        model = opts.served_model_name or Path(opts.model_path).name
        request = pb.ReportFailureRequest(worker_id=worker_id, join_token=opts.join_token, model=model,
                                          reason=failure_reason(error), exit_code=code, permanent=is_permanent(code))
        for router in routers(opts.router):
            try:
                async with channel(router, opts.security.client()) as ch:
                    await pb_grpc.RouterStub(ch).ReportFailure(request, timeout=REPORT_FAILURE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("could not tell router %s that this worker could not start: %s", router, e.details())

    def _stay_awake(self, reason: str) -> StayAwake:
        """The Mac kept awake while this worker holds its model; a sleep that comes anyway
        drained for first (the notifier's thread waits for the event loop to do it)."""
        loop = asyncio.get_running_loop()

        def drain(seconds: float) -> None:
            asyncio.run_coroutine_threadsafe(self.drain_for_sleep(seconds), loop).result(seconds + 5)

        def undrain() -> None:
            asyncio.run_coroutine_threadsafe(self.undrain_after_sleep(), loop).result(10)

        return StayAwake(self.power or system_power(), reason, drain, undrain)

    async def drain_for_sleep(self, seconds: float) -> None:
        """Before the machine sleeps: drain (the routers told at once), give the running
        streams up to `seconds` to finish, then end the rest, which the router resumes
        elsewhere or holds until this worker is back."""
        service = self.service
        self._drained_for_sleep = not service.draining  # an operator's drain outlasts the sleep
        await self.set_draining(True)
        self._report_now()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while service.num_streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        ended = service.end_streams()
        if ended:
            log.warning("worker %s: %d streams still running at sleep: ended, for the router to resume",
                        service.worker_id, ended)

    async def undrain_after_sleep(self) -> None:
        """Awake again: take requests, unless the worker was drained before the sleep."""
        if self._drained_for_sleep:
            self._drained_for_sleep = False
            await self.set_draining(False)
            self._report_now()

    def _report_now(self) -> None:
        for registration in self._registrations:
            registration.report_now()

    async def _watch_progress(self) -> None:
        """gRPC health follows the engine's progress and the chat-template renders:
        NOT_SERVING while the engine is stalled or the renders are stuck (the load report
        and /health say so too), SERVING again when both move (unless draining). Each
        change is reported to the routers at once, not at the next heartbeat, and so is a
        step that starts or stops lagging (the routers place new requests elsewhere)."""
        service, was_stalled, was_healthy, was_lagging = self.service, False, True, False
        period = min(0.25, self.options.stall_report / 4)
        while True:
            await asyncio.sleep(period)
            lagging = service.lagging
            if lagging != was_lagging:
                was_lagging = lagging
                self._report_now()
            stalled = service.stalled
            if stalled != was_stalled:
                if stalled:
                    log.error("worker %s: %s: reporting NOT_SERVING", service.worker_id, service.stall_reason)
                    if service.metrics is not None:
                        service.metrics.stalls.inc()
                else:
                    log.warning("worker %s: the engine is moving again", service.worker_id)
                was_stalled = stalled
            healthy = self._healthy()
            if healthy != was_healthy:
                await self.endpoints.set_serving(healthy and not service.draining)
                was_healthy = healthy
                self._report_now()

    def _console(self, app, keys) -> None:
        """The web console on the HTTP app (cluster/console): this worker's own state."""
        from cluster.console.routes import add_routes
        from cluster.console.state import WorkerState

        def about() -> dict:
            return {"id": self.service.worker_id, "grpc": self.addresses.get("grpc", ""),
                    "http": self.addresses.get("http", ""), "fleet": False}

        add_routes(app, WorkerState(self.service.load_report, about), keys)

    def _healthy(self) -> bool:
        return not self.service.stalled and not self.service.unhealthy_reason

    async def set_draining(self, draining: bool) -> pb.DrainResponse:
        """The one way in and out of draining: the service refuses new requests, gRPC
        health says NOT_SERVING (and SERVING again when undrained and healthy)."""
        response = self.service.set_draining(draining)
        await self.endpoints.set_serving(not draining and self._healthy())
        return response

    def ready_info(self) -> dict:
        """The bound addresses and what was loaded (for scripts that start workers)."""
        from cluster import platform

        engine = self.engine_loop.engine
        return {**self.addresses, "worker_id": self.service.worker_id, "model": engine.model_name,
                "dtypes": [str(engine.runner.dtype).removeprefix("mlx.core.")], "blas": platform.blas_path()}

    @property
    def group(self):
        """Rank 0's `GroupState` when this worker is a group's rank 0, else None."""
        return None if self.engine_loop is None else getattr(self.engine_loop.engine, "group", None)

    async def stop(self) -> None:
        """Stop taking requests, give running streams `grace_seconds`, stop the engine."""
        if self.service is not None:
            self.service.set_draining(True)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for registration in self._registrations:
            await registration.stop()
        self._registrations.clear()
        await self.endpoints.stop(self.options.grace_seconds)
        if self.service is not None:
            await self.service.stop()
            if self.group is not None:  # the members stop with rank 0
                self.group.close()
        if self.awake is not None:  # the model is gone: the Mac may sleep
            self.awake.stop()
            self.awake = None
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None


async def run_until_signalled(options: WorkerOptions, ready_line: bool = True) -> None:
    server = WorkerServer(options)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    def stop_soon(reason: str) -> None:  # from the side channel's reader thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: stopping already
            loop.call_soon_threadsafe(stop.set)

    if server.group is not None:  # a member told to stop asks for the group's stop: drained as on SIGTERM here
        server.group.leader.on_stop(stop_soon)
    if ready_line:  # once a SIGTERM drains: whoever waits for this line may stop the worker at once
        print(READY_PREFIX + json.dumps(server.ready_info()), flush=True)
    try:
        await stop.wait()
    finally:
        log.info("worker stopping")
        await server.stop()


def failure_reason(error: EngineLoadError) -> str:
    """Why the model did not load, on one line of at most 400 characters (mlx-lm lists
    missing weights over many lines)."""
    reason = " ".join(str(error).split())
    return reason if len(reason) <= 400 else reason[:400] + " ..."


def serve(options: WorkerOptions) -> int:
    """Entry point of `orchard worker serve` (no model path: models_cache.DEFAULT_MODEL)."""
    from cluster.models_cache import resolve_model

    try:
        check_addresses(options.grpc_address, options.metrics_address, options.http_address,
                        *routers(options.router), options.advertise_address)
        options.security.check()
        if options.group.enabled:
            from cluster.worker.group.config import require_join_token, topology

            options.group.validate()
            rank = topology(options.group).rank
            require_join_token(options.join_token)
        options.chat_templates.check()
        options.engine_config.validate()
        check_renderer()
    except ValueError as e:  # a setting: permanent, so that no launcher starts it again as it is
        print(f"orchard worker serve: {e}", file=sys.stderr)
        return EXIT_PERMANENT
    try:
        options = replace(options, model_path=str(resolve_model(options.model_path, options.gguf_file)))
    except SystemExit as e:  # no such model: one line, permanent
        print(f"orchard worker serve: {e}", file=sys.stderr)
        return EXIT_PERMANENT
    if options.group.enabled:
        if rank != 0:  # a member: no servers, it runs the steps rank 0 plans
            from cluster.worker.group.member import member_process

            member_process(options.model_path, options.group, options.join_token, options.engine_config)
    code = 0
    try:
        asyncio.run(run_until_signalled(options))
    except OSError as e:  # an address in use or not there yet: transient (cluster/exit_codes.py)
        code = exit_code(e)
        print(f"orchard worker serve: {e} ({describe(code)})", file=sys.stderr)
    except EngineLoadError as e:
        # One line that says what to fix, and an exit code that tells a launcher whether
        # starting again can help: a group whose member was late or lost (75), or a model
        # that does not load or that a member does not share (78).
        code = exit_code(e.__cause__ or e)
        print(f"orchard worker serve: cannot load the model at {options.model_path}: {failure_reason(e)} "
              f"({describe(code)})", file=sys.stderr)
    # Everything the worker started is stopped and joined. Skip interpreter teardown: MLX
    # keeps per-thread C++ state (compile caches) whose destructors take the GIL, and where
    # we cannot wait for the engine's OS thread to be gone (no /proc) they can race
    # Py_Finalize and abort an orderly shutdown.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
