"""`orchard node serve`: the node agent, one per Mac.

It registers with each router (`Fleet.RegisterNode`, the join token; mutual TLS where
configured) and reports every heartbeat: its memory budget (`--memory-budget`, at most what
the machine can give: on a Mac Metal's recommended working set, on Linux the memory
available when it starts), what it has set aside for its workers, the free disk, the models
under `--models-dir` (`facts.scan`) and its workers. It serves the `Node` service, whose
every call must carry the join token as `authorization: Bearer TOKEN`:

- `StartWorker(spec)`: the model must be under `--models-dir` by name (NOT_FOUND naming it
  and the directory), its reservation must fit the budget and `--max-loaded` must allow it
  (RESOURCE_EXHAUSTED with the numbers); then it runs `python -m cluster worker serve` with
  the worker id, served model name, routers, address, context, KV pool and group flags the
  spec gives (the worker registers with the routers itself), its output in a log under
  `--state-dir`. A worker that exits is started again after a backoff, unless its exit says
  the failure is permanent (78, `cluster/exit_codes.py`): then it stays exited, the last
  line of its log its reason (`supervise.restart_delay`, the rule every launcher follows).
- `StopWorker`: drains it (`WorkerAdmin.Drain`; its requests in flight finish, up to the
  drain timeout), then SIGTERM, then SIGKILL after `--stop-grace`. A group member stops
  the same way; the controller stops a group by stopping each member.
- `FetchModel(source, peers, protect)`: brings a model's files here (one fetch per source;
  a second caller follows the first): here already, or copied from the first peer that
  gives them (`transfer.py`: --copy-streams files at once within --copy-bandwidth, resumed
  from partial files, sha256-checked), else pulled from the hub for an `hf:` source
  (`hub.py`). Fetched hub models live in --hub-cache, in huggingface_hub's layout; room is
  made under --disk-budget by deleting the least recently used of them that no worker here
  runs and `protect` does not name (`disk.py`; RESOURCE_EXHAUSTED with the numbers when it
  cannot). The report lists fetches under way, totals per kind, and the budget.
- `ListModelFiles` / `ReadModelFile`: a model's files for a peer's copy, by relative path
  only; `DescribeModel`: a model's facts from its files here, or from the hub's metadata.

When the agent stops, it stops its workers. Each worker's process id is kept in a file
under `--state-dir` while it runs, so that an agent started after a crash of the last one
(launchd starts it again) first stops the workers that one left running; on Linux a worker
also gets SIGTERM when its agent dies. No MLX here (the agent asks a short-lived Python for
Metal's working set, `platform.metal_working_set`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hmac
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cluster import platform
from cluster.api.serving import Endpoints
from cluster.config import human_bytes as human
from cluster.exit_codes import EXIT_PERMANENT, EXIT_TRANSIENT, Backoff, describe
from cluster.fleet import FleetError, disk, hub, transfer
from cluster.fleet.catalog import check_engine_args
from cluster.fleet.node_config import NodeConfig
from cluster.net import CHANNEL_OPTIONS, check_addresses, free_ports, parse_address
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.security import channel
from cluster.supervise import restart_delay
from cluster.worker.registration import Registration

log = logging.getLogger(__name__)

STARTING, LOADING, RUNNING, STOPPING, EXITED = "starting", "loading", "running", "stopping", "exited"
ALL_INTERFACES = ("0.0.0.0", "::", "")
OLLAMA_PREFIX = "ollama:"
PORT_HOLD_S = 120.0  # a reserved port is not handed out again for this long
MAX_PORTS = 64  # per ReservePorts call
POLL_S = 0.5  # a loading worker's readiness, a draining worker's requests
MODELS_REFRESH_S = 2.0  # the models on disk are looked at again this often
LOG_TAIL_BYTES = 8192  # read of a worker's log for its last line
# A node id another agent reports under is refused for good after this long: well past the
# silence that makes a router count a node unhealthy (3 beats of 1 s by default).
DUPLICATE_WAIT_S = 60.0
FROM_HUB, FROM_PEER, FROM_DISK = "hub", "peer", "disk"  # where a fetch's files came from
FETCH_PROGRESS_S = 0.25  # a FetchModel stream's progress messages at most this often
LIST_TIMEOUT_S = 300.0  # a peer's ListModelFiles (it may hash files it has not hashed before)


# -- a worker's command line -----------------------------------------------------------------
def find_model(models_dir: Path, source: str, hub_cache: Path | None = None) -> str:
    """What `--model` a worker of catalog source `source` gets on this node: a directory
    (with config.json) or a .gguf file named `source` under `models_dir`, the snapshot an
    `hf:ORG/REPO[@REV]` source names in `hub_cache` (no network; a group's rank may hold only
    its layers' files of it), or an `ollama:NAME:TAG` reference as it is (the worker imports
    it from Ollama's store)."""
    from cluster.fleet import facts

    if source.startswith(OLLAMA_PREFIX):
        return source
    if hub.is_hub_source(source):
        parsed = hub.parse_source(source)
        snapshot = disk.snapshot_dir(hub_cache, parsed.repo, parsed.revision) if hub_cache is not None else None
        if snapshot is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"model {source!r} is not on this node: the hub cache "
                                                        f"{hub_cache} has no snapshot of it (fetch it first)")
        return str(snapshot)
    if not source or source.startswith(".") or "/" in source or "\\" in source:
        raise FleetError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"source {source!r} must be a model's name under --models-dir (a directory or a .gguf "
                         "file), not a path")
    for name in facts.model_names(source):
        if facts.is_model(models_dir / name):
            return str(models_dir / name)
    raise FleetError(grpc.StatusCode.NOT_FOUND,
                     f"model {source!r} is not on this node: {models_dir} has no directory {source} with a "
                     f"config.json nor a file {facts.model_names(source)[-1]}")


def worker_argv(spec: pb.WorkerSpec, model: str, routers: str, host: str, advertise_host: str,
                port: int) -> list[str]:
    """`python -m cluster worker serve ...` for `spec` (secrets go in the environment)."""
    argv = [sys.executable, "-m", "cluster", "worker", "serve", "--model", model, "--worker-id", spec.worker_id,
            "--served-model-name", spec.model, "--router", routers, "--grpc", f"{host}:{port}",
            "--advertise", f"{advertise_host}:{port}", "--metrics", f"{host}:0"]
    if spec.context:
        argv += ["--max-model-len", str(spec.context)]
    if spec.kv_cache_bytes:
        argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
    if spec.num_kv_blocks:
        argv += ["--num-kv-blocks", str(spec.num_kv_blocks)]
    if spec.max_num_seqs:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.group_size > 1:
        argv += ["--group-size", str(spec.group_size), "--group-rank", str(spec.group_rank),
                 "--group-hosts", ",".join(spec.group_hosts)]
        if spec.group_port:
            argv += ["--group-port", str(spec.group_port)]
        if spec.group_shares:
            argv += ["--group-shares", spec.group_shares]
        if spec.memory_budget_bytes:
            argv += ["--memory-budget", str(spec.memory_budget_bytes)]
    return argv + list(spec.engine_args)


def last_line(path: Path) -> str:
    """The last non-empty line of a log: where a process that stops for good says why."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


# Linux: the child asks for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG) first
# thing after exec, not in a preexec_fn (unsafe in a process with threads); a parent that
# died before that is seen by its pid.
_DIE_WITH_PARENT = ("import ctypes, os, runpy, signal, sys\n"
                    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
                    "if os.getppid() != int(os.environ.pop('ORCHARD_PARENT_PID')):\n"
                    "    sys.exit(128 + signal.SIGTERM)\n"
                    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n")


def die_with_parent(argv: list[str], env: dict[str, str]) -> list[str]:
    """`python -m MODULE ARGS` as a command that gets SIGTERM when this process dies,
    however it dies (Linux; elsewhere `argv` as it is). Its command line still reads
    `MODULE ARGS` (`stop_leftovers` looks for it); sets ORCHARD_PARENT_PID in `env`."""
    if not sys.platform.startswith("linux") or argv[1:2] != ["-m"]:
        return argv
    env["ORCHARD_PARENT_PID"] = str(os.getpid())
    return [argv[0], "-c", _DIE_WITH_PARENT, *argv[2:]]


# -- the workers -----------------------------------------------------------------------------
@dataclass(eq=False)
class ManagedProcess:
    """A worker (or group member) this agent runs, started again while it fails transiently."""

    spec: pb.WorkerSpec
    argv: list[str]
    log_path: Path
    pid_path: Path
    address: str  # its gRPC address, for the drain (empty: a group member, which serves none)
    backoff: Backoff = field(default_factory=Backoff)
    state: str = STARTING
    proc: asyncio.subprocess.Process | None = None
    exit_code: int = 0
    reason: str = ""
    stopping: bool = False
    task: asyncio.Task | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # ends a backoff's wait when it is stopped
    stop_task: asyncio.Task | None = None  # StopWorker's drain and stop, once
    restarts: int = 0  # times it exited and was started again

    @property
    def live(self) -> bool:
        return self.state != EXITED

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def info(self) -> pb.ManagedWorker:
        s = self.spec
        return pb.ManagedWorker(worker_id=s.worker_id, model=s.model, state=self.state,
                                reserved_bytes=s.reserved_bytes if self.live else 0, group_size=max(1, s.group_size),
                                group_rank=s.group_rank, exit_code=self.exit_code, reason=self.reason,
                                address=self.address, restarts=self.restarts)


def stop_leftovers(pids_dir: Path, grace: float) -> list[int]:
    """Stop the workers a previous agent left running (it crashed), by the process ids it
    kept (in WORKER_ID.pid); only processes that are still `cluster worker serve` with that
    --worker-id (a pid is reused). Returns those stopped."""
    stopped = []
    for pid_path in sorted(pids_dir.glob("*.pid")):
        try:
            pid = int(pid_path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = 0
        if pid > 0 and _is_worker(_command_of(pid), pid_path.stem):
            log.warning("stopping worker process %d that an earlier agent left running (%s)", pid, pid_path.stem)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and _command_of(pid):
                    time.sleep(0.1)
                if _command_of(pid):
                    os.kill(pid, signal.SIGKILL)
            stopped.append(pid)
        pid_path.unlink(missing_ok=True)
    return stopped


def _is_worker(command: str, worker_id: str) -> bool:
    """Whether a command line is the worker `worker_id`'s (not a process that took its pid)."""
    words = command.split()
    return "cluster worker serve" in command and any(
        a == "--worker-id" and b == worker_id for a, b in zip(words, words[1:]))


def _command_of(pid: int) -> str:
    """A running process's whole command line ('' when it is gone; -ww: never cut to a width);
    `ps` works on macOS and Linux."""
    try:
        out = subprocess.run(["ps", "-ww", "-o", "command=", "-p", str(pid)], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    command = out.stdout.strip()
    return "" if "<defunct>" in command else command


# -- registration with the routers -----------------------------------------------------------
class NodeRegistration(Registration):
    """The worker's registration loop, registering this node (`Fleet.RegisterNode`) and
    sending its `NodeReport` as its heartbeat. A node id another agent still reports under
    (ALREADY_EXISTS) is tried again for `DUPLICATE_WAIT_S`: an agent that restarted waits
    for its earlier self to fall silent; past that it is another Mac's, for good."""

    what = "node"
    duplicate_since: float | None = None  # when the router first said the id is held

    def stub(self, ch):
        return pb_grpc.FleetStub(ch)

    def refused_for_good(self, error: grpc.aio.AioRpcError) -> bool:
        if error.code() != grpc.StatusCode.ALREADY_EXISTS:
            return super().refused_for_good(error)
        now = time.monotonic()
        self.duplicate_since = self.duplicate_since or now
        if now - self.duplicate_since < DUPLICATE_WAIT_S:
            log.warning("router %s: %s (trying again)", self.router, error.details())
            return False
        return True

    async def join(self, stub, timeout: float) -> tuple[str, int]:
        reply = await stub.RegisterNode(pb.RegisterNodeRequest(join_token=self.join_token, report=self.load()),
                                        timeout=timeout)
        self.duplicate_since = None
        return reply.node_id, reply.heartbeat_interval_ms

    async def beat(self, stub, timeout: float) -> bool:
        reply = await stub.NodeHeartbeat(pb.NodeHeartbeatRequest(join_token=self.join_token, report=self.load()),
                                         timeout=timeout)
        return reply.known


# -- the agent -------------------------------------------------------------------------------
def machine_memory() -> tuple[str, int]:
    """(platform, bytes the machine can give models): on a Mac with Metal, Metal's
    recommended working set; elsewhere the memory available now."""
    working_set = platform.metal_working_set()
    if working_set:
        return "metal", min(working_set, platform.available_memory() or working_set)
    return "cpu", platform.available_memory()


class NodeAgent:
    """The agent's state and its operations (`NodeServicer` serves them over gRPC)."""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.models_dir = Path(config.models_dir).expanduser()
        self.hub_cache = (Path(config.hub_cache).expanduser() if config.hub_cache
                          else hub.default_hub_cache(self.models_dir))
        self.routers = [r.strip() for r in config.router.split(",") if r.strip()]
        self.host = parse_address(config.grpc_address)[0]
        self.advertise_host = config.advertise or (socket.getfqdn() if self.host in ALL_INTERFACES else self.host)
        self.node_id = config.node_id or self._default_node_id()
        # a folder per node: agents of several nodes on one machine (a local fleet) never
        # take each other's workers for leftovers
        self.state_dir = Path(config.state_dir).expanduser() / self.node_id
        self.instance_id = uuid.uuid4().hex
        self.platform, self.budget = "cpu", 0
        self.models: list[pb.DiskModel] = []
        self.workers: dict[str, ManagedProcess] = {}
        self.held_ports: dict[int, float] = {}  # port -> until when (monotonic)
        self.endpoints = Endpoints(default_host=self.host, health_services=("",), security=config.security)
        self.address = ""
        self.registrations: list[NodeRegistration] = []
        self.stopped = asyncio.Event()  # set when the agent should end (a signal, or every router refused it)
        self.denied = False
        self._tasks: list[asyncio.Task] = []
        self.fetches: dict[str, transfer.Fetch] = {}  # source -> the fetch under way
        self.transfer_totals = {kind: pb.TransferTotal(kind=kind) for kind in (FROM_HUB, FROM_PEER)}
        self.disk_used = 0  # the fetched models' bytes (the hub cache), at the last look
        self.bytes_served = 0  # model file bytes sent to peers
        self._room = asyncio.Lock()  # one fetch at a time makes room on disk
        self._bandwidth = transfer.TokenBucket(config.copy_bandwidth)  # --copy-bandwidth: all copies together
        self._deleting: set[str] = set()  # hub repositories being deleted to make room: no worker starts on one

    def _default_node_id(self) -> str:
        if self.config.security.mutual:
            from cluster.certs import common_name

            return common_name(self.config.security.tls_cert)
        return socket.gethostname()

    # -- start and stop ------------------------------------------------------------------------
    async def start(self) -> None:
        (self.state_dir / "workers").mkdir(parents=True, exist_ok=True)
        # before the memory is measured: what an earlier agent's workers hold is this one's to give
        await asyncio.to_thread(stop_leftovers, self.state_dir / "workers", self.config.stop_grace)
        self.platform, machine = machine_memory()
        budget = self.config.memory_budget
        self.budget = int(min(budget, machine) if budget and machine else budget or machine)
        if budget and machine and budget > machine:
            log.warning("--memory-budget %s is more than this machine can give models (%s): using %s",
                        human(budget), human(machine), human(machine))
        await self.refresh_models()
        port = self.endpoints.bind_grpc(self.config.grpc_address)
        self.address = f"{self.advertise_host}:{port}"
        await self.endpoints.start(lambda server: pb_grpc.add_NodeServicer_to_server(NodeServicer(self), server))
        for router in self.routers:
            registration = NodeRegistration(router, self.address, self.report, join_token=self.config.join_token,
                                            worker_id=self.node_id, interval=self.config.heartbeat_interval,
                                            security=self.config.security.client())
            registration.instance_id = self.instance_id
            self.registrations.append(registration)
        registering = [registration.start() for registration in self.registrations]
        self._tasks = [asyncio.create_task(self._refresh_models_loop()),
                       asyncio.create_task(self._watch_refusals(registering))]
        log.info("node %s (%s, budget %s, %d models in %s) serving Node on %s", self.node_id, self.platform,
                 human(self.budget), len(self.models), self.models_dir, self.address)

    async def stop(self) -> None:
        """Stop every worker (SIGTERM: each finishes its streams; SIGKILL after the grace),
        then the registrations and the gRPC server."""
        await asyncio.gather(*(self._end(w) for w in list(self.workers.values())))
        fetching = [f.task for f in self.fetches.values() if f.task is not None]
        for task in [*self._tasks, *fetching]:
            task.cancel()  # a copy resumes from its partial files when fetched again
        await asyncio.gather(*fetching, return_exceptions=True)
        for registration in self.registrations:
            await registration.stop()
        await self.endpoints.stop(grace=1.0)

    async def _watch_refusals(self, registering: list[asyncio.Task]) -> None:
        """Every router refused this node (a wrong join token): nothing to do here but say so.
        A registration's task ends only when its router refuses it."""
        await asyncio.gather(*registering, return_exceptions=True)
        if self.registrations and all(r.denied for r in self.registrations):
            self.denied = True
            self.stopped.set()

    # -- what it reports ---------------------------------------------------------------------
    async def refresh_models(self) -> None:
        self.models, self.disk_used = await asyncio.to_thread(self._scan)

    def _scan(self) -> tuple[list[pb.DiskModel], int]:
        """The models under --models-dir, then the fetched ones (the hub cache's snapshots,
        each with how long ago a worker last started on it), and the bytes these take."""
        from cluster.fleet import facts

        models = facts.scan(self.models_dir, self.platform)
        repos = {r.repo: r for r in disk.cached_repos(self.hub_cache)}
        if repos:
            now = time.time()
            for m in hub.scan(self.hub_cache, self.platform):
                m.fetched = True
                repo = repos.get(hub.parse_source(m.name).repo)
                if repo is not None:
                    m.last_used_seconds_ago = disk.seconds_since_used(repo, now)
                models.append(m)
        return models, sum(r.bytes for r in repos.values())

    async def _refresh_models_loop(self) -> None:
        while True:
            await asyncio.sleep(MODELS_REFRESH_S)
            try:
                await self.refresh_models()
            except Exception:  # noqa: BLE001  (a bug in a scan must not end the agent's reports)
                log.exception("could not look at the models in %s", self.models_dir)

    @property
    def reserved(self) -> int:
        return sum(w.spec.reserved_bytes for w in self.workers.values() if w.live)

    def report(self) -> pb.NodeReport:
        try:
            disk_free = shutil.disk_usage(self.models_dir).free
        except OSError:
            disk_free = 0
        return pb.NodeReport(
            node_id=self.node_id, address=self.address, advertise_host=self.advertise_host,
            memory_budget_bytes=self.budget, memory_reserved_bytes=self.reserved,
            memory_available_bytes=platform.available_memory(), disk_free_bytes=disk_free, models=self.models,
            workers=[w.info() for w in self.workers.values()], platform=self.platform,
            max_loaded=self.config.max_loaded, instance_id=self.instance_id,
            transfers=[f.transfer() for f in self.fetches.values() if f.origin],
            transfer_totals=self.transfer_totals.values(), disk_budget_bytes=self.config.disk_budget or 0,
            disk_used_bytes=self.disk_used)

    def _report_now(self) -> None:
        for registration in self.registrations:
            registration.report_now()

    # -- ports -------------------------------------------------------------------------------
    def reserve_ports(self, count: int) -> list[int]:
        if not 1 <= count <= MAX_PORTS:
            raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"count must be in [1, {MAX_PORTS}], not {count}")
        now = time.monotonic()
        self.held_ports = {p: until for p, until in self.held_ports.items() if until > now}
        host = "0.0.0.0" if self.host in ALL_INTERFACES else self.host
        for _ in range(20):  # the OS may hand out a port held here: ask again
            ports = free_ports(count, host)
            if not set(ports) & set(self.held_ports):
                break
        for p in ports:
            self.held_ports[p] = now + PORT_HOLD_S
        return ports

    # -- workers -----------------------------------------------------------------------------
    def _check_room(self, spec: pb.WorkerSpec) -> None:
        free = self.budget - self.reserved
        if spec.reserved_bytes > free:
            raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"worker {spec.worker_id} of {spec.model} needs {human(spec.reserved_bytes)}, node "
                             f"{self.node_id} has {human(max(0, free))} of {human(self.budget)} free")
        loaded = {w.spec.model for w in self.workers.values() if w.live}
        if self.config.max_loaded and spec.model not in loaded and len(loaded) >= self.config.max_loaded:
            raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"node {self.node_id} runs {len(loaded)} models ({', '.join(sorted(loaded))}), its "
                             f"--max-loaded {self.config.max_loaded}: cannot start {spec.model}")

    def _check_snapshot(self, spec: pb.WorkerSpec) -> None:
        """A hub model's snapshot is whole for a single worker (a rank's fetch leaves only its
        layers' shards) and not being deleted to make room."""
        if hub.parse_source(spec.source).repo in self._deleting:
            raise FleetError(grpc.StatusCode.UNAVAILABLE, f"model {spec.source} is being deleted from node "
                                                          f"{self.node_id}'s disk to make room for a fetch")
        if spec.group_size <= 1 and (lacking := hub.missing(spec.source, self.hub_cache)):
            raise FleetError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model {spec.source} on node {self.node_id} lacks {', '.join(lacking[:3])}"
                             f"{' ...' if len(lacking) > 3 else ''}: fetch it whole first")

    async def start_worker(self, spec: pb.WorkerSpec) -> pb.ManagedWorker:
        for name in ("worker_id", "model", "source"):
            if not getattr(spec, name):
                raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"spec.{name} is required")
        if "/" in spec.worker_id or spec.worker_id.startswith("."):
            raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"spec.worker_id {spec.worker_id!r} may not hold '/'")
        known = self.workers.get(spec.worker_id)
        if known is not None and known.live:
            raise FleetError(grpc.StatusCode.ALREADY_EXISTS, f"worker {spec.worker_id} already runs on node "
                                                             f"{self.node_id} ({known.state})")
        if spec.group_size > 1 and (spec.group_rank >= spec.group_size or len(spec.group_hosts) != spec.group_size):
            raise FleetError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"a group member needs group_rank < group_size ({spec.group_rank} of {spec.group_size}) "
                             f"and one group_hosts address per rank ({len(spec.group_hosts)} given)")
        # the entry's flags were checked when it was added; a caller with the join token is
        # not the catalog: flags appended last would override the fleet's (keys, addresses, paths)
        check_engine_args(list(spec.engine_args))
        model = find_model(self.models_dir, spec.source, self.hub_cache)
        if hub.is_hub_source(spec.source):
            self._check_snapshot(spec)
        self._check_room(spec)
        if hub.is_hub_source(spec.source):
            disk.touch(Path(model))  # the disk budget deletes the least recently used first
        port = spec.port or self.reserve_ports(1)[0]
        member = spec.group_size > 1 and spec.group_rank > 0
        w = ManagedProcess(
            spec, worker_argv(spec, model, ",".join(self.routers), self.host, self.advertise_host, port),
            self.state_dir / f"{spec.worker_id}.log", self.state_dir / "workers" / f"{spec.worker_id}.pid",
            address="" if member else f"{'127.0.0.1' if self.host in ALL_INTERFACES else self.host}:{port}")
        self.workers[spec.worker_id] = w
        w.task = asyncio.create_task(self._supervise(w), name=f"orchard-node-{spec.worker_id}")
        log.info("starting worker %s of %s (%s, reserved %s): %s", spec.worker_id, spec.model, model,
                 human(spec.reserved_bytes), w.log_path)
        self._report_now()
        return w.info()

    def _environment(self) -> dict[str, str]:
        """The worker's secrets, from the agent's settings: never on its command line."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", ORCHARD_JOIN_TOKEN=self.config.join_token)
        sec = self.config.security
        if sec.admin_key:
            env["ORCHARD_ADMIN_KEY"] = sec.admin_key
        keys = sec.keys().inference
        if keys:
            env["ORCHARD_API_KEY"] = ",".join(k.decode() for k in keys)
        return env

    def _security_flags(self) -> list[str]:
        sec = self.config.security
        return [flag for name in ("tls_cert", "tls_key", "tls_ca") if getattr(sec, name)
                for flag in (f"--{name.replace('_', '-')}", str(getattr(sec, name)))]

    async def _spawn(self, w: ManagedProcess) -> None:
        env = self._environment()
        argv = die_with_parent([*w.argv, *self._security_flags()], env)
        with open(w.log_path, "ab") as out:
            w.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        w.pid_path.write_text(f"{w.proc.pid}\n")
        w.state = RUNNING if not w.address else LOADING

    async def _supervise(self, w: ManagedProcess) -> None:
        """Run the worker; start it again after a backoff when it exits, unless it was
        stopped or its failure is permanent."""
        while not w.stopping:
            started = time.monotonic()
            try:
                await self._spawn(w)
            except OSError as e:
                w.state, w.exit_code, w.reason = EXITED, EXIT_PERMANENT, f"could not start: {e}"
                self._report_now()
                return
            if w.stopping:  # stopped while it was being started
                w.proc.send_signal(signal.SIGTERM)
            self._report_now()
            waiter = asyncio.create_task(w.proc.wait())
            if w.address:
                await self._follow_loading(w, waiter)
            code = await waiter
            w.pid_path.unlink(missing_ok=True)
            w.exit_code, w.reason = code, last_line(w.log_path)
            if w.stopping:
                break
            delay = restart_delay(code, time.monotonic() - started, w.backoff)
            if delay is None:
                log.error("worker %s exited (%s): not started again: %s", w.spec.worker_id, describe(code), w.reason)
                w.state = EXITED
                self._report_now()
                return
            log.warning("worker %s exited (%s): starting it again in %g s: %s", w.spec.worker_id, describe(code),
                        delay, w.reason)
            w.state = STARTING
            w.restarts += 1
            self._report_now()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(w.wake.wait(), delay)
        w.state = EXITED

    async def _follow_loading(self, w: ManagedProcess, exited: asyncio.Task) -> None:
        """`loading` until the worker answers GetLoad (its model loaded), then `running`."""
        async with channel(w.address, self.config.security.client(), options=CHANNEL_OPTIONS) as ch:
            admin = pb_grpc.WorkerAdminStub(ch)
            while not exited.done() and w.state == LOADING:
                try:
                    await admin.GetLoad(pb.GetLoadRequest(), timeout=POLL_S * 4)
                except grpc.aio.AioRpcError:
                    await asyncio.wait({exited}, timeout=POLL_S)
                    continue
                w.state = RUNNING
                self._report_now()

    async def stop_worker(self, worker_id: str, drain_timeout: float = 0.0) -> pb.ManagedWorker:
        """Drain, then stop. One stop per worker: a second call waits for the first (its drain
        is not cut short), and a caller that gives up does not cancel it."""
        w = self.workers.get(worker_id)
        if w is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"no worker {worker_id!r} on node {self.node_id}")
        if w.stop_task is None:
            w.stop_task = asyncio.create_task(self._stop(w, drain_timeout or self.config.drain_timeout))
        await asyncio.shield(w.stop_task)
        return w.info()

    async def _stop(self, w: ManagedProcess, drain_timeout: float) -> None:
        if w.live and not w.stopping:
            w.stopping, w.state = True, STOPPING
            self._report_now()
            await self._drain(w, drain_timeout)
        await self._end(w)
        if self.workers.get(w.spec.worker_id) is w:
            del self.workers[w.spec.worker_id]
        self._report_now()

    async def _drain(self, w: ManagedProcess, timeout: float) -> None:
        """Take no new requests; wait (at most `timeout`) for those it has to finish."""
        if not w.address or w.pid is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with channel(w.address, self.config.security.client(), options=CHANNEL_OPTIONS) as ch:
            admin = pb_grpc.WorkerAdminStub(ch)
            try:
                await admin.Drain(pb.DrainRequest(drain=True), timeout=max(1.0, min(10.0, timeout)))
                while loop.time() < deadline and w.pid is not None:
                    load = await admin.GetLoad(pb.GetLoadRequest(), timeout=max(1.0, min(10.0, timeout)))
                    if load.num_running + load.num_waiting == 0:
                        return
                    await asyncio.sleep(POLL_S)
                log.warning("worker %s still had requests after its %g s drain: stopping it", w.spec.worker_id,
                            timeout)
            except grpc.aio.AioRpcError as e:
                log.info("worker %s did not answer its drain (%s): stopping it", w.spec.worker_id, e.code().name)

    async def _end(self, w: ManagedProcess) -> None:
        """SIGTERM (the worker finishes its streams), SIGKILL after the grace; no restart."""
        w.stopping = True
        w.wake.set()
        proc = w.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.config.stop_grace)
            except asyncio.TimeoutError:
                log.warning("worker %s did not exit %g s after SIGTERM: killing it", w.spec.worker_id,
                            self.config.stop_grace)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if w.task is not None:
            await asyncio.gather(w.task, return_exceptions=True)
        w.pid_path.unlink(missing_ok=True)
        w.state = EXITED

    # -- fetching models, serving their files to peers ------------------------------------------
    def _source(self, source: str) -> str:
        """The source as fetches are keyed (an hf: source canonical); INVALID_ARGUMENT for
        what cannot be fetched."""
        if not source:
            raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, "source is required")
        if source.startswith(OLLAMA_PREFIX):
            raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"source {source!r} is in Ollama's store on each "
                                                               "Mac: it is not fetched or copied")
        if hub.is_hub_source(source):
            return hub.canonical(source)
        self.model_root(source)  # INVALID_ARGUMENT for a path
        return source

    def model_root(self, source: str, layers: tuple[int, int] | None = None) -> Path | None:
        """The model `source` names on this node (a directory, a .gguf file or a hub
        snapshot holding every file, or those of `layers`), or None."""
        if hub.is_hub_source(source):
            return hub.local_snapshot(source, self.hub_cache, layers)
        try:
            return Path(find_model(self.models_dir, source, self.hub_cache))
        except FleetError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def _not_deleting(self, source: str) -> None:
        """NOT_FOUND for a fetched model the disk budget is deleting: not one to serve a peer."""
        if hub.is_hub_source(source) and hub.parse_source(source).repo in self._deleting:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"model {source} is being deleted from node "
                                                        f"{self.node_id}'s disk to make room for a fetch")

    def _held(self, source: str, layers: tuple[int, int] | None = None) -> Path:
        self._not_deleting(source)
        root = self.model_root(self._source(source), layers)
        if root is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"model {source!r} is not on node {self.node_id}")
        return root

    async def list_model_files(self, request: pb.ListModelFilesRequest) -> pb.ModelFiles:
        root = self._held(request.source, _layers(request))
        files = await asyncio.to_thread(transfer.list_files, root, _layers(request))
        revision = root.name if hub.is_hub_source(request.source) else ""
        return pb.ModelFiles(source=request.source, revision=revision, files=files)

    async def read_model_file(self, request: pb.ReadModelFileRequest):
        """The file's bytes from `request.offset`, in chunks; the path is checked before
        anything is looked up."""
        transfer.relative_path(request.path)
        self._not_deleting(request.source)
        path = transfer.model_file(Path(find_model(self.models_dir, self._source(request.source), self.hub_cache)),
                                   request.path)
        size = path.stat().st_size
        if request.offset > size:
            raise FleetError(grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} is past the end of "
                                                           f"{request.path} ({size} bytes)")
        async for chunk in transfer.read_chunks(path, request.offset):
            self.bytes_served += len(chunk)
            yield chunk

    async def describe_model(self, source: str) -> pb.DiskModel:
        """The model's facts: from its files where this node holds it, else (an hf: source)
        from the hub's metadata."""
        from cluster.fleet import facts

        source = self._source(source)
        root = self.model_root(source)
        if root is not None:
            out = await asyncio.to_thread(facts.disk_model, root, self.platform)
            if hub.is_hub_source(source):
                out.name, out.fetched = source, True
            return out
        if not hub.is_hub_source(source):
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"model {source!r} is not on node {self.node_id}")
        return await asyncio.to_thread(hub.describe, source, self.hub_cache, self.platform)

    async def fetch(self, request: pb.FetchModelRequest):
        """FetchModel: follow the fetch of the source, starting it unless one is under way
        (one of other layers, another rank's, is waited for first)."""
        source = self._source(request.source)
        while (job := self.fetches.get(source)) is not None and not job.serves(_layers(request)):
            await job.ended()  # another rank's files: fetch the rest once it is done
        if job is None:
            job = self.fetches[source] = transfer.Fetch(source, layers=_layers(request))
            job.task = asyncio.create_task(self._run_fetch(job, request), name=f"orchard-fetch-{source}")
        async for message in job.follow(FETCH_PROGRESS_S):
            yield message

    async def _run_fetch(self, job: transfer.Fetch, request: pb.FetchModelRequest) -> None:
        try:
            result = await self._fetch(job, request)
            await self.refresh_models()  # the next report lists it
            job.end(result)
        except FleetError as e:
            job.end(error=e)
        except asyncio.CancelledError:
            job.end(error=FleetError(grpc.StatusCode.UNAVAILABLE, f"node {self.node_id} is stopping"))
            raise
        except Exception as e:  # noqa: BLE001  (a bug must reach the caller, not end the agent)
            log.exception("fetch of %s failed", job.source)
            job.end(error=FleetError(grpc.StatusCode.INTERNAL, f"fetch of {job.source} failed: {e}"))
        finally:
            if self.fetches.get(job.source) is job:
                del self.fetches[job.source]
            self._report_now()

    async def _fetch(self, job: transfer.Fetch, request: pb.FetchModelRequest) -> pb.FetchProgress:
        """Here already; else from each peer in turn; else from the hub (hf: sources)."""
        source = job.source
        root = self.model_root(source, _layers(request))
        if root is not None:
            return pb.FetchProgress(**{"from": FROM_DISK}, done=True, path=str(root))
        failures = []
        for peer in request.peers:
            if peer.node_id == self.node_id or not peer.address:
                continue
            try:
                return await self._copy(job, peer, request)
            except (FleetError, grpc.aio.AioRpcError) as e:
                code, why = (e.code, e.message) if isinstance(e, FleetError) else (e.code(), e.details())
                if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION) and \
                        isinstance(e, FleetError):
                    raise  # no room here, or a file in the way: another peer would not help
                self.transfer_totals[FROM_PEER].failures += 1
                log.warning("copy of %s from %s failed (%s: %s)", source, peer.node_id, code.name, why)
                failures.append(f"{peer.node_id}: {code.name}: {why}")
        tried = f": {'; '.join(failures)}" if failures else ""
        if hub.is_hub_source(source):
            try:
                return await self._pull(job, request)
            except FleetError as e:
                raise FleetError(e.code, f"{e.message} (after no peer could copy it{tried})" if failures
                                 else e.message) from None
        raise FleetError(grpc.StatusCode.NOT_FOUND, f"model {source!r} is not on node {self.node_id} and no peer "
                                                    f"could copy it{tried or ' (none named)'}")

    def _keep(self, source: str, protect) -> set[str]:
        """The hub repositories the disk budget must not delete: protected, run by a worker
        here, or being fetched."""
        sources = {source, *protect, *self.fetches, *(w.spec.source for w in self.workers.values() if w.live)}
        return {hub.parse_source(s).repo for s in sources if hub.is_hub_source(s)}

    async def _make_room(self, job: transfer.Fetch, origin: str, total: int, need: int, protect,
                         fetched: bool) -> list[str]:
        """Delete the least recently used fetched models not kept until `need` more bytes fit,
        with what the other fetches under way have still to write (the budget counts only for
        `fetched` models), then begin `job` (`total` bytes from `origin`); the names of those
        deleted. One at a time: each sees the deletions and the fetches begun before it."""
        async with self._room:
            repos = await asyncio.to_thread(disk.cached_repos, self.hub_cache)
            try:
                free = shutil.disk_usage(self.hub_cache if self.hub_cache.is_dir() else self.models_dir).free
            except OSError:
                free = 0
            pending = _still_to_write([f for f in self.fetches.values() if f is not job], repos)
            budget = (self.config.disk_budget or 0) if fetched else 0
            doomed = disk.evictions(repos, need + pending, budget, free, self._keep(job.source, protect),
                                    f"{job.source} on node {self.node_id}")
            if fetched and hub.is_hub_source(job.source):
                job.repo = hub.parse_source(job.source).repo
                job.disk_bytes_when_done = next((r.bytes for r in repos if r.repo == job.repo), 0) + need
            self._deleting.update(repo.repo for repo in doomed)
            try:
                for repo in doomed:
                    log.info("deleting fetched model %s (%s, last used %.0f s ago) to make room for %s", repo.repo,
                             human(repo.bytes), disk.seconds_since_used(repo), job.source)
                    await asyncio.to_thread(disk.delete, repo)
            finally:
                self._deleting.difference_update(repo.repo for repo in doomed)
            job.begin(origin, total)
        if doomed:
            await self.refresh_models()
        return [f"{hub.PREFIX}{repo.repo}" for repo in doomed]

    def _peer_security(self):
        return dataclasses.replace(self.config.security.client(), api_key=self.config.join_token)

    async def _copy(self, job: transfer.Fetch, peer: pb.NodePeer, request: pb.FetchModelRequest) -> pb.FetchProgress:
        source = job.source
        started = time.monotonic()
        # Only a hub snapshot may hold a rank's files alone (hub.local_snapshot checks each
        # file); a plain directory holding part of a model would look whole to the scan.
        layers = request if hub.is_hub_source(source) else pb.FetchModelRequest()
        async with channel(peer.address, self._peer_security(), options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.NodeStub(ch)
            listing = await stub.ListModelFiles(pb.ListModelFilesRequest(
                source=source, first_layer=layers.first_layer, last_layer=layers.last_layer), timeout=LIST_TIMEOUT_S)
            dest = self._destination(source, listing)
            files = list(listing.files)
            total = sum(f.size for f in files)
            need = total - await asyncio.to_thread(dest.present_bytes, files)
            deleted = await self._make_room(job, peer.node_id, total, need, request.protect,
                                            isinstance(dest, transfer.HubDestination))
            self._report_now()
            copy = transfer.Copy(stub, source, files, dest, self.config.copy_streams, self._bandwidth, job.add)
            try:
                path = await copy.run()
            except OSError as e:  # this node's disk, not the peer: another peer would not help
                raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED if e.errno == errno.ENOSPC
                                 else grpc.StatusCode.FAILED_PRECONDITION,
                                 f"node {self.node_id} cannot write {source}: {e}") from None
            finally:
                self.transfer_totals[FROM_PEER].bytes += copy.received
        if hub.is_hub_source(source) and (lacking := await asyncio.to_thread(
                hub.missing, source, self.hub_cache, _layers(request))):
            raise FleetError(grpc.StatusCode.DATA_LOSS, f"the peer's files of {source} are not the whole model: "
                                                        f"it lacks {', '.join(lacking[:3])}")
        totals = self.transfer_totals[FROM_PEER]
        totals.fetches += 1
        totals.seconds += time.monotonic() - started
        log.info("copied %s from %s (%s) in %.1f s", source, peer.node_id, human(total), time.monotonic() - started)
        return pb.FetchProgress(**{"from": peer.node_id}, bytes_done=total, bytes_total=total, done=True,
                                path=str(path), deleted=deleted)

    def _destination(self, source: str, listing: pb.ModelFiles) -> transfer.Destination:
        """Where the peer's files of `source` go here; DATA_LOSS for a listing that cannot
        be the model's."""
        from cluster.fleet import facts

        if not listing.files:
            raise FleetError(grpc.StatusCode.DATA_LOSS, f"the peer lists no files of {source}")
        for f in listing.files:
            transfer.relative_path(f.path)
        if hub.is_hub_source(source):
            parsed = hub.parse_source(source)
            return transfer.HubDestination(self.hub_cache, parsed.repo, parsed.revision, listing.revision)
        names = facts.model_names(source)
        single = len(listing.files) == 1 and listing.files[0].path.endswith(".gguf")
        name = listing.files[0].path if single else source
        if name not in names:
            raise FleetError(grpc.StatusCode.DATA_LOSS, f"the peer's {source} is {name!r}, not one of {names}")
        final = self.models_dir / name
        if final.exists() or final.is_symlink():  # not the model (that would have been found): not ours to replace
            raise FleetError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{final} is on node {self.node_id} but is not the model {source}: move it away to "
                             "copy the model there")
        return transfer.PlainDestination(self.models_dir, name, single)

    async def _pull(self, job: transfer.Fetch, request: pb.FetchModelRequest) -> pb.FetchProgress:
        """From the hub (huggingface_hub: resumable, checked against the hub's hashes)."""
        source = job.source
        started = time.monotonic()
        try:
            need = await asyncio.to_thread(hub.pull_bytes, source, self.hub_cache, _layers(request))
        except FleetError:
            need = 0  # the pull says what is wrong
        deleted = await self._make_room(job, FROM_HUB, need, need, request.protect, fetched=True)
        self._report_now()
        loop = asyncio.get_running_loop()
        totals = self.transfer_totals[FROM_HUB]
        stopping = threading.Event()

        def report(done: int, total: int) -> None:  # on the pull's threads, as bytes arrive
            if stopping.is_set():
                raise FleetError(grpc.StatusCode.CANCELLED, f"the pull of {source} was stopped")
            loop.call_soon_threadsafe(job.set, done, total)

        pulling = asyncio.ensure_future(asyncio.to_thread(hub.pull, source, self.hub_cache, _layers(request), report))
        try:
            path = await asyncio.shield(pulling)
        except FleetError:
            totals.failures += 1
            raise
        except asyncio.CancelledError:  # a thread is not cancelled: it ends at its next bytes
            stopping.set()
            await asyncio.gather(pulling, return_exceptions=True)
            raise
        finally:
            await asyncio.sleep(0)  # the progress the pull posted last
            totals.bytes += job.bytes_done
        await asyncio.to_thread(disk.drop_partials, self.hub_cache, hub.parse_source(source).repo)
        totals.fetches += 1
        totals.seconds += time.monotonic() - started
        log.info("pulled %s from the hub in %.1f s", source, time.monotonic() - started)
        return pb.FetchProgress(**{"from": FROM_HUB}, bytes_done=job.bytes_done, bytes_total=job.bytes_total,
                                done=True, path=str(path), deleted=deleted)


def _still_to_write(fetches: list[transfer.Fetch], repos: list[disk.CachedRepo]) -> int:
    """The bytes the fetches under way have yet to put on disk. A fetch into the hub cache
    will hold what it was given room for, less what the scan `repos` already finds there (a
    chunk written and not yet counted is neither missed nor counted twice); any other, its
    bytes not yet received."""
    on_disk = {r.repo: r.bytes for r in repos}
    return sum(max(0, f.disk_bytes_when_done - on_disk.get(f.repo, 0)) if f.repo
               else max(0, f.bytes_total - f.bytes_done) for f in fetches)


def _layers(request) -> tuple[int, int] | None:
    """A pipeline rank's layers (`first_layer`..`last_layer`); None: every file."""
    return (request.first_layer, request.last_layer) if request.first_layer or request.last_layer else None


class NodeServicer(pb_grpc.NodeServicer):
    """The `Node` service: every call carries the join token as its bearer key."""

    def __init__(self, agent: NodeAgent):
        self.agent = agent

    async def _authorize(self, context) -> None:
        expected = self.agent.config.join_token
        if not expected:
            return
        scheme, _, token = (dict(context.invocation_metadata() or ()).get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "wrong join token: send the fleet's as 'authorization: Bearer TOKEN'")

    async def ReservePorts(self, request, context):
        await self._authorize(context)
        try:
            return pb.ReservePortsResponse(ports=self.agent.reserve_ports(request.count))
        except FleetError as e:
            await context.abort(e.code, e.message)

    async def StartWorker(self, request, context):
        await self._authorize(context)
        try:
            return await self.agent.start_worker(request.spec)
        except FleetError as e:
            await context.abort(e.code, e.message)

    async def StopWorker(self, request, context):
        await self._authorize(context)
        try:
            return await self.agent.stop_worker(request.worker_id, request.drain_timeout_seconds)
        except FleetError as e:
            await context.abort(e.code, e.message)

    async def GetNodeReport(self, request, context):
        await self._authorize(context)
        return self.agent.report()

    async def FetchModel(self, request, context):
        await self._authorize(context)
        try:
            async for progress in self.agent.fetch(request):
                yield progress
        except FleetError as e:
            await context.abort(e.code, e.message)

    async def DescribeModel(self, request, context):
        await self._authorize(context)
        try:
            return await self.agent.describe_model(request.source)
        except FleetError as e:
            await context.abort(e.code, e.message)

    async def ListModelFiles(self, request, context):
        await self._authorize(context)
        try:
            return await self.agent.list_model_files(request)
        except FleetError as e:
            await context.abort(e.code, e.message)

    async def ReadModelFile(self, request, context):
        await self._authorize(context)
        try:
            async for data in self.agent.read_model_file(request):
                yield pb.FileChunk(data=data)
        except FleetError as e:
            await context.abort(e.code, e.message)


# -- the command -----------------------------------------------------------------------------
async def serve(config: NodeConfig) -> int:
    agent = NodeAgent(config)
    try:
        await agent.start()
    except BaseException:
        await agent.stop()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, agent.stopped.set)
    print(f"orchard node: {agent.node_id} on {agent.address}, budget {human(agent.budget)}, "
          f"{len(agent.models)} models in {agent.models_dir}", flush=True)
    await agent.stopped.wait()
    log.info("node agent stopping: stopping its %d workers", len(agent.workers))
    await agent.stop()
    if agent.denied:
        refusal = agent.registrations[0].refusal
        if refusal is not None and refusal.code() == grpc.StatusCode.ALREADY_EXISTS:
            why = f"every router refused node {agent.node_id}: {refusal.details()}"
        else:
            why = "every router refused this node (wrong join token? set ORCHARD_JOIN_TOKEN)"
        print(f"orchard node serve: {why} ({describe(EXIT_PERMANENT)})", file=sys.stderr)
        return EXIT_PERMANENT
    return 0


def run(config: NodeConfig) -> int:
    """Entry point of `orchard node serve`: a setting that is wrong is permanent (78), an
    address in use transient (75), as for a worker (`cluster/exit_codes.py`)."""
    try:
        config.validate()
        check_addresses(config.grpc_address, *config.router.split(","))
    except ValueError as e:
        print(f"orchard node serve: {e}", file=sys.stderr)
        return EXIT_PERMANENT
    try:
        return asyncio.run(serve(config))
    except OSError as e:
        print(f"orchard node serve: {e} ({describe(EXIT_TRANSIENT)})", file=sys.stderr)
        return EXIT_TRANSIENT
