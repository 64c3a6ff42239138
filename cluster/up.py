"""`orchard up`: a router and N local workers as subprocesses, one command.

The workers register with the router (a fresh join token per run, passed to the children
in their environment, never on a command line). With `--secure`, `up` also makes a fleet
CA, a certificate per process, an API key and an admin key (files under the log
directory's `secrets/`, mode 0600): mutual TLS on gRPC, TLS + keys on HTTP. `up` waits until all
of them are healthy, prints the endpoints, then watches: a worker (or a group) with a
process gone is started again after a backoff, unless the process failed for good (exit
78: `cluster/exit_codes.py`), which is logged and left stopped. Ctrl-C (or SIGTERM) stops the
workers (a group's rank 0, which stops its members, before them), then the router: SIGTERM
by PID, SIGKILL after a grace period. Each child runs in its own session, so the terminal's
Ctrl-C reaches only `up`, which stops them in order. Children's logs go to files under
--log-dir.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.config import ByteSize, default_of, port_of, setting
from cluster.net import free_ports
from cluster.exit_codes import Backoff, describe, is_permanent
from cluster.router.config import RouterConfig, policy_names
from cluster.worker.config import GGUF_FILE_HELP, MODEL_HELP, EngineConfig, WorkerOptions
from cluster.worker.group.config import GroupOptions


@dataclass(frozen=True)
class UpConfig:
    """`orchard up`. The router's and the workers' own settings are their defaults (the
    children are started with only the flags below), so nothing here restates them."""

    model: str | None = setting(None, MODEL_HELP)
    gguf_file: str | None = setting(None, GGUF_FILE_HELP, metavar="NAME")
    workers: int = setting(2, "local worker processes")
    grpc_address: str = setting(RouterConfig.grpc_address, "the router's gRPC address", flag="--grpc")
    http_address: str | None = setting(RouterConfig.http_address, "the router's OpenAI HTTP address, or off",
                                       flag="--http", off="off")
    metrics_address: str | None = setting(RouterConfig.metrics_address, "the router's /metrics address, or off",
                                          flag="--metrics", off="off")
    policy: str = setting(RouterConfig.policy, "the router's placement policy", choices=policy_names)
    worker_port_base: int = setting(port_of(WorkerOptions.grpc_address),
                                    "worker i: gRPC port base+i (0: free ports)")
    worker_metrics_port_base: int = setting(port_of(WorkerOptions.metrics_address),
                                            "worker i: metrics port base+i (0: free)")
    log_dir: str | None = setting(None, "where the processes log (default: a temporary directory)")
    timeout: float = setting(300.0, "seconds to wait for the workers")
    secure: bool = setting(False, "API keys, an admin key, TLS and mutual TLS: a CA and keys made for this run "
                                  "(under LOG_DIR/secrets)")
    group_size: int = setting(1, "processes per worker: each worker is a group of N over MLX's ring on loopback "
                                 "(one model split across them)")
    parallel: str = setting("pipeline", "how a group splits the model", choices=("pipeline", "tensor"))
    group_timeout: float = setting(GroupOptions.timeout, "a group's member silent or step unfinished this long "
                                                         "loses the group", metavar="SECONDS")
    group_shares: str | None = setting(None, "pipeline: each rank's relative share of the layers, e.g. 1,2",
                                       metavar="W,W...")
    group_inflight: int = setting(GroupOptions.inflight, "pipeline: batches in flight at once (0: one per stage)",
                                  metavar="N")
    kv_disk_dir: str | None = setting(None, "a disk KV tier for each worker, worker i's in DIR/worker-i (a "
                                            "group's rank r: DIR/worker-i-rank-r; see orchard worker serve "
                                            "--kv-disk-dir)",
                                      metavar="DIR")
    kv_disk_size: ByteSize = setting(default_of(EngineConfig, "kv_disk_size"), "each worker's disk tier at most",
                                     metavar="SIZE")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def stop_children(children: list["Child"], grace: float) -> None:
    """SIGTERM to each that runs, then SIGKILL to those still running after `grace`."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def last_line(self) -> str:
        """Its log's last line: where a process that stops for good says why."""
        lines = self.tail(1).splitlines()
        return lines[-1].strip() if lines else ""


class LocalCluster:
    """Start, wait for and stop a router and its workers (also used by tests and benchmarks)."""

    def __init__(
        self,
        model: str | os.PathLike,
        workers: int = UpConfig.workers,
        grpc_address: str = UpConfig.grpc_address,
        http_address: str | None = UpConfig.http_address,
        metrics_address: str | None = UpConfig.metrics_address,
        worker_port_base: int = UpConfig.worker_port_base,  # 0: free ports
        worker_metrics_port_base: int = UpConfig.worker_metrics_port_base,
        policy: str = UpConfig.policy,
        log_dir: str | os.PathLike | None = None,
        worker_args: list[str] | None = None,
        router_args: list[str] | None = None,
        cpus: list[list[int]] | None = None,  # per worker: the CPUs it may run on
        worker_env: dict[str, str] | None = None,  # extra environment of the workers
        routers: int = 1,  # more than one: the others on free ports, no HTTP; every worker registers with all
        secure: bool = False,  # keys, TLS and mutual TLS (`Secrets`)
        group_size: int | list[int] = 1,  # processes per worker (a list: per worker); > 1: a worker group
        parallel: str = "pipeline",
        group_args: list[str] | None = None,  # more group flags, given to every rank (--group-timeout ...)
        kv_disk: tuple[str, int] | None = None,  # (DIR, bytes): worker i's disk KV tier in DIR/worker-i
        backoff: Backoff | None = None,  # the restarts' delays: a copy per worker
        clock=time.monotonic,
    ):
        self.model = str(model)
        self.num_workers = workers
        self.grpc_address = grpc_address
        self.http_address = http_address
        self.metrics_address = metrics_address
        self.worker_port_base = worker_port_base
        self.worker_metrics_port_base = worker_metrics_port_base
        self.policy = policy
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="orchard-up-"))
        self.worker_args = worker_args or []
        self.router_args = router_args or []
        self.cpus = cpus
        self.worker_env = worker_env or {}
        self.join_token = secrets.token_hex(16)
        self.secrets = Secrets.create(self.log_dir / "secrets", routers, workers) if secure else None
        self.router: Child | None = None  # the first router
        self.extra_routers: list[Child | None] = [None] * (routers - 1)
        self.extra_router_addresses: list[str] = []
        self.extra_router_metrics: list[str] = []  # router i > 0's metrics address
        self.workers: list[Child] = []  # worker i (rank 0 of a group)
        self.worker_addresses: list[str] = []
        self.worker_metrics: list[str] = []
        self.group_sizes = group_size if isinstance(group_size, list) else [group_size] * workers
        self.parallel = parallel
        self.members: dict[int, list[Child]] = {}  # worker i's other ranks, when it is a group
        self.group_hosts: dict[int, tuple[str, int]] = {}  # worker i's ring addresses and side-channel port
        self.group_args = group_args or []
        self.kv_disk = kv_disk
        self.group_restarts = 0  # restarts of worker groups (`restarts` counts every worker's)
        self.restarts = 0
        self.clock = clock
        self._backoff = backoff or Backoff()
        self.backoffs: dict[int, Backoff] = {}
        self.started_at: dict[int, float] = {}  # worker i's last start (clock)
        self.restart_at: dict[int, float] = {}  # worker i, ended: when it is started again
        self.given_up: dict[int, str] = {}  # worker i, ended for good (a permanent failure): why

    # -- processes ----------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], cpus: list[int] | None = None, env: dict | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        # secrets go in the environment: a command line is visible to every user (ps)
        env = dict(os.environ, PYTHONUNBUFFERED="1", ORCHARD_JOIN_TOKEN=self.join_token, **(env or {}))
        if self.secrets is not None:
            env.update(ORCHARD_API_KEY=self.secrets.api_key, ORCHARD_ADMIN_KEY=self.secrets.admin_key)
            args = [*args, *self.secrets.server_flags(name)]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cluster", *args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        return Child(name, proc, log_path)

    def start_router(self, i: int = 0) -> Child:
        """Router 0 on the configured addresses; router i > 0 on free ports, without HTTP."""
        if i == 0:
            grpc, http, metrics = self.grpc_address, self.http_address or "off", self.metrics_address or "off"
        else:
            while len(self.extra_router_addresses) < i:
                self.extra_router_addresses.append(f"127.0.0.1:{free_port()}")
                self.extra_router_metrics.append(f"127.0.0.1:{free_port()}")
            grpc, http, metrics = self.extra_router_addresses[i - 1], "off", self.extra_router_metrics[i - 1]
        args = ["router", "serve", "--grpc", grpc, "--policy", self.policy,
                "--http", http, "--metrics", metrics, *self.router_args]
        child = self._spawn("router" if i == 0 else f"router-{i}", args)
        if i == 0:
            self.router = child
        else:
            self.extra_routers[i - 1] = child
        return child

    @property
    def router_addresses(self) -> list[str]:
        """Every router's gRPC address (what an SDK client given them all fails over across)."""
        return [self.router_address, *self.extra_router_addresses]

    def start_worker(self, i: int) -> Child:
        host = self.grpc_address.rpartition(":")[0] or "127.0.0.1"
        host = "127.0.0.1" if host in ("0.0.0.0", "[::]", "") else host
        if i >= len(self.worker_addresses):
            port = self.worker_port_base + i if self.worker_port_base else free_port(host)
            mport = self.worker_metrics_port_base + i if self.worker_metrics_port_base else free_port(host)
            self.worker_addresses.append(f"{host}:{port}")
            self.worker_metrics.append(f"{host}:{mport}")
        args = ["worker", "serve", "--model", self.model, "--grpc", self.worker_addresses[i],
                "--metrics", self.worker_metrics[i], "--router", ",".join(self.router_addresses),
                "--worker-id", f"worker-{i}", *self.worker_args]
        def disk(name: str) -> list[str]:  # each process its own disk tier (a group's rank: its own layers)
            if self.kv_disk is None:
                return []
            disk_dir, size = self.kv_disk
            return ["--kv-disk-dir", str(Path(disk_dir) / name), "--kv-disk-size", str(size)]

        args += disk(f"worker-{i}")
        size = self.group_sizes[i % len(self.group_sizes)]
        members = []
        if size > 1:  # a worker group: rank 0 here, ranks 1.. beside it, over MLX's ring on loopback
            if i not in self.group_hosts:
                *ring, port = free_ports(size + 1, host)
                self.group_hosts[i] = (",".join(f"{host}:{p}" for p in ring), port)
            hosts, port = self.group_hosts[i]
            group = ["--group-size", str(size), "--group-hosts", hosts, "--group-port", str(port),
                     "--parallel", self.parallel, *self.group_args]
            args += [*group, "--group-rank", "0"]
            for r in range(1, size):
                members.append(self._spawn(
                    f"worker-{i}-rank-{r}", ["worker", "serve", "--model", self.model, *group, "--group-rank", str(r),
                                             *self.worker_args, *disk(f"worker-{i}-rank-{r}")],
                    self.cpus[(i + r) % len(self.cpus)] if self.cpus else None, self.worker_env))
        child = self._spawn(f"worker-{i}", args, self.cpus[i % len(self.cpus)] if self.cpus else None, self.worker_env)
        if members:
            self.members[i] = members
        if i < len(self.workers):
            self.workers[i] = child
        else:
            self.workers.append(child)
        self.started_at[i] = self.clock()
        return child

    def group_processes(self, i: int) -> list[Child]:
        """Worker i's processes: rank 0 and, for a group, the other ranks."""
        return [self.workers[i], *self.members.get(i, [])]

    def supervise(self, restart: bool = True) -> list[str]:
        """One look at the workers (what `orchard up` does every half second). A worker with
        a process gone is stopped whole (a group's member left stopped or wedged is killed:
        the group cannot go on without it). A permanent failure (exit 78, `exit_codes.py`)
        is not started again; anything else is, with `restart`, after its backoff. The
        other workers keep running. Returns what was done, a line each."""
        done = []
        for i in range(len(self.workers)):
            if i in self.restart_at or i in self.given_up:
                continue
            procs = self.group_processes(i)
            if not any(c.proc.poll() is not None for c in procs):
                continue
            ended = [c for c in procs if c.proc.poll() is not None]
            for c in procs:
                if c.proc.poll() is None:
                    c.proc.kill()
            for c in procs:
                c.proc.wait()
            cause = next((c for c in ended if is_permanent(c.proc.returncode)), ended[0])
            what = f"worker-{i}" + (f"'s group ({cause.name})" if i in self.members else "")
            if is_permanent(cause.proc.returncode):
                why = cause.last_line() or "see its log"
                self.given_up[i] = f"{cause.name}: {why}"
                done.append(f"{what} exited ({describe(cause.proc.returncode)}): {why}; not started again "
                            f"(its log: {cause.log_path}); the other workers keep running")
                continue
            backoff = self.backoffs.setdefault(i, replace(self._backoff, failures=0))
            delay = backoff.next_delay(self.clock() - self.started_at.get(i, self.clock()))
            self.restart_at[i] = self.clock() + delay
            done.append(f"{what} exited ({describe(cause.proc.returncode)}): "
                        + (f"starting it again in {delay:g} s" if restart else "stopped"))
        for i, when in sorted(self.restart_at.items()):
            if restart and self.clock() >= when:
                del self.restart_at[i]
                self.restarts += 1
                self.group_restarts += i in self.members
                self.start_worker(i)
                done.append(f"worker-{i} started again")
        return done

    @property
    def router_address(self) -> str:
        host, _, port = self.grpc_address.rpartition(":")
        return f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '') else host}:{port}"

    def start(self, timeout: float = UpConfig.timeout) -> None:
        """Start everything and wait until every worker is registered and healthy."""
        for r in range(1 + len(self.extra_routers)):
            self.start_router(r)
        for i in range(self.num_workers):
            self.start_worker(i)
        self.wait_ready(timeout)

    def client_security(self, admin: bool = False):
        """What a client of this cluster presents (the admin key with `admin`): without
        --secure, the keys in this environment, which the processes it starts inherit."""
        from cluster.security import ClientSecurity

        return ClientSecurity.from_env(admin=admin) if self.secrets is None else self.secrets.client(admin)

    def healthy_workers(self, router: str | None = None) -> list:  # of pb.WorkerInfo
        import grpc

        from cluster.proto.orchard.v1 import orchard_pb2 as pb
        from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
        from cluster.security import channel

        try:
            with channel(router or self.router_address, self.client_security(admin=True), aio=False) as ch:
                resp = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=2)
        except grpc.RpcError:
            return []
        return [w for w in resp.workers if w.state == pb.WORKER_STATE_HEALTHY]

    def wait_ready(self, timeout: float = UpConfig.timeout, n: int | None = None) -> None:
        n = self.num_workers if n is None else n
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = self.dead_children()
            if dead:
                c = dead[0]
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}; "
                                   f"its log ({c.log_path}):\n{c.tail()}")
            if all(len(self.healthy_workers(r)) >= n for r in self.router_addresses):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{n} healthy workers not registered within {timeout:g} s (logs in {self.log_dir})")

    def dead_children(self) -> list[Child]:
        return [c for c in self.children() if c.proc.poll() is not None]

    def children(self) -> list[Child]:
        members = [c for group in self.members.values() for c in group]
        return [c for c in [*self.workers, *members, self.router, *self.extra_routers] if c is not None]

    def stop(self, grace: float = 10.0) -> None:
        """Workers first (they finish nothing new), then the routers: SIGTERM, then SIGKILL
        after `grace`. A group's rank 0 before its members: it drains, its members running
        the drain's steps, then tells them to stop (they exit 0); any still running after
        that are stopped next."""
        members = [c for group in self.members.values() for c in group]
        for group in (self.workers, members, [c for c in (self.router, *self.extra_routers) if c is not None]):
            stop_children(group, grace)

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop(grace=2)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class Secrets:
    """A local cluster's credentials: a CA, a certificate per process (named after it)
    and one for its clients, an API key and an admin key; files mode 0600 in `dir`."""

    dir: Path
    api_key: str
    admin_key: str

    @classmethod
    def create(cls, directory: Path, routers: int, workers: int) -> "Secrets":
        from cluster.certs import CA_CERT, init_ca, issue

        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not (directory / CA_CERT).exists():
            init_ca(directory, "Orchard local cluster CA")
        for name in ["router", *(f"router-{i}" for i in range(1, routers)), *(f"worker-{i}" for i in range(workers)),
                     "client"]:
            issue(directory, name)
        keys = {}
        for name in ("api-key", "admin-key"):
            path = directory / name
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
                with os.fdopen(fd, "w") as f:
                    # a prefix, so a key never starts with "-" and reads as a flag after --api-key
                    f.write(f"orchard-{name.split('-')[0]}-{secrets.token_urlsafe(24)}\n")
            keys[name] = path.read_text().strip()
        return cls(directory, keys["api-key"], keys["admin-key"])

    def server_flags(self, name: str) -> list[str]:
        """A process's TLS flags (its certificate, issued now if it is a new name)."""
        from cluster.certs import issue

        d = self.dir
        if not (d / f"{name}.pem").exists():
            issue(d, name)
        return ["--tls-cert", str(d / f"{name}.pem"), "--tls-key", str(d / f"{name}-key.pem"),
                "--tls-ca", str(d / "ca.pem")]

    def client(self, admin: bool = False):
        from cluster.security import ClientSecurity

        d = self.dir
        return ClientSecurity(api_key=self.admin_key if admin else self.api_key, tls_ca=str(d / "ca.pem"),
                              tls_cert=str(d / "client.pem"), tls_key=str(d / "client-key.pem"))


def local_cluster(config: UpConfig, model: str | os.PathLike) -> LocalCluster:
    """The cluster `orchard up` runs for `config` (every group flag given to every rank)."""
    group_args = ["--group-timeout", f"{config.group_timeout:g}", "--group-inflight", str(config.group_inflight)]
    if config.group_shares:
        group_args += ["--group-shares", config.group_shares]
    return LocalCluster(
        model, workers=config.workers, grpc_address=config.grpc_address, http_address=config.http_address,
        metrics_address=config.metrics_address, worker_port_base=config.worker_port_base,
        worker_metrics_port_base=config.worker_metrics_port_base, policy=config.policy, log_dir=config.log_dir,
        secure=config.secure, group_size=config.group_size, parallel=config.parallel, group_args=group_args,
        kv_disk=(config.kv_disk_dir, config.kv_disk_size) if config.kv_disk_dir else None,
    )


def run_up(config: UpConfig) -> int:
    from cluster.models_cache import resolve_model

    model = resolve_model(config.model, config.gguf_file)
    cluster = local_cluster(config, model)
    stop = {"now": False}

    def on_term(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    print(f"starting a router and {config.workers} worker(s) on {model} (logs in {cluster.log_dir}) ...", flush=True)
    try:
        cluster.start_router()
        for i in range(config.workers):
            cluster.start_worker(i)
        cluster.wait_ready(config.timeout)
        scheme = "https" if config.secure else "http"
        http = f"{scheme}://{cluster.http_address}/v1" if cluster.http_address else "off"
        metrics = f"{scheme}://{cluster.metrics_address}/metrics" if cluster.metrics_address else "off"
        print(
            f"\nOrchard is up: {config.workers} worker(s) serving {Path(model).name}"
            + (f", each a group of {config.group_size} ({config.parallel} parallel)" if config.group_size > 1 else "")
            + "\n"
            f"  gRPC     {cluster.router_address}          (orchard router workers --router {cluster.router_address})\n"
            f"  HTTP     {http}    (OpenAI-compatible)\n"
            f"  metrics  {metrics}\n"
            + "".join(f"  worker-{i}  gRPC {a}  metrics {scheme}://{m}/metrics\n"
                      for i, (a, m) in enumerate(zip(cluster.worker_addresses, cluster.worker_metrics)))
            + (_secure_notes(cluster.secrets.dir) if cluster.secrets else "")
            + "Ctrl-C stops them all.",
            flush=True,
        )
        while not stop["now"]:
            for line in cluster.supervise():
                print(f"orchard up: {line}", file=sys.stderr, flush=True)
            if cluster.router is not None and cluster.router.proc.poll() is not None:
                c = cluster.router
                print(f"orchard up: the router exited ({describe(c.proc.returncode)}); its log ({c.log_path}):\n"
                      f"{c.tail()}", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as e:
        print(f"orchard up: {e}", file=sys.stderr)
        cluster.stop(grace=2)
        return 1
    finally:
        print("stopping ...", flush=True)
        cluster.stop()
        print("stopped.", flush=True)
    return 0


def _secure_notes(d: Path) -> str:
    return (f"  secured: keys and certificates in {d} (mode 0600). Clients:\n"
            f"    export ORCHARD_API_KEY=$(cat {d}/api-key) ORCHARD_TLS_CA={d}/ca.pem \\\n"
            f"           ORCHARD_TLS_CERT={d}/client.pem ORCHARD_TLS_KEY={d}/client-key.pem\n"
            f"    (admin commands: ORCHARD_ADMIN_KEY=$(cat {d}/admin-key); "
            f"HTTP: Authorization: Bearer $ORCHARD_API_KEY, --cacert {d}/ca.pem)\n")
