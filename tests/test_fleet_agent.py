"""`orchard node serve` (cluster/fleet/agent.py) against a real router, as processes on
127.0.0.1: the agent joins and reports its budget and models (ListNodes, `orchard nodes
list`); the Node service refuses a wrong join token, a model not on disk, a reservation over
budget; a silent agent turns unhealthy; a worker it starts registers with the router and
serves what a statically started worker does; StopWorker drains it (a request in flight
finishes) before it stops it; a stopped or killed agent leaves no worker running."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from cluster.fleet.agent import stop_leftovers
from cluster.net import CHANNEL_OPTIONS
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.security import ClientSecurity, channel
from cluster.up import LocalCluster, free_port
from tests.conftest import wait_for
from conftest import run

HEARTBEAT = 0.2
BUDGET = 1 << 30
SERVED = "tiny-chat"  # the catalog name the worker serves its model under


class AgentProcess:
    """`orchard node serve` on a free port."""

    def __init__(self, router: str, models_dir: Path, state_dir: Path, token: str, node_id: str = "node-a",
                 budget: int = BUDGET, extra: tuple[str, ...] = (), env: dict | None = None):
        self.address = f"127.0.0.1:{free_port()}"
        self.state_dir = state_dir / node_id  # where the agent keeps its workers' logs and pids
        self.log_path = state_dir / "agent.log"
        state_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "cluster", "node", "serve", "--router", router, "--grpc", self.address,
                "--node-id", node_id, "--memory-budget", str(budget), "--models-dir", str(models_dir),
                "--state-dir", str(state_dir), "--heartbeat-interval", str(HEARTBEAT), "--stop-grace", "20", *extra]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, ORCHARD_JOIN_TOKEN=token, PYTHONUNBUFFERED="1",
                                                  **(env or {})))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def worker_pids(self) -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in (self.state_dir / "workers").glob("*.pid")}

    def stop(self) -> None:
        """SIGTERM (it stops its workers), SIGKILL if it hangs; then any worker it left, by PID."""
        pids = self.worker_pids() if (self.state_dir / "workers").is_dir() else {}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet-router")
    cluster = LocalCluster("", workers=0, grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
                           metrics_address=None, log_dir=d, routers=2,  # a fleet may run two: an agent joins each
                           # quick beats, and room for a loaded machine's late ones (a worker draining under a
                           # full test run missed three in a row, 0.6 s)
                           router_args=["--heartbeat-interval", str(HEARTBEAT), "--missed-heartbeats", "10"])
    cluster.start_router(0)
    cluster.start_router(1)
    try:
        yield cluster
    finally:
        cluster.stop(grace=5)


@pytest.fixture(scope="module")
def models_dir(tiny_model_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("node-models")
    (d / "tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    return d


@pytest.fixture(scope="module")
def agent(router, models_dir, tmp_path_factory):
    a = AgentProcess(",".join(router.router_addresses), models_dir, tmp_path_factory.mktemp("node-a"),
                     router.join_token)
    try:
        yield a
    finally:
        a.stop()


def list_nodes(router: LocalCluster, address: str | None = None) -> dict[str, pb.NodeInfo]:
    try:
        with channel(address or router.router_address, aio=False) as ch:
            return {n.report.node_id: n for n in
                    pb_grpc.FleetStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5).nodes}
    except grpc.RpcError:
        return {}


def node_state(router: LocalCluster, node_id: str = "node-a") -> str:
    node = list_nodes(router).get(node_id)
    return node.state if node is not None else ""


def healthy(router: LocalCluster, agent: AgentProcess, node_id: str = "node-a") -> pb.NodeInfo:
    def check():
        assert agent.proc.poll() is None, f"the agent exited with {agent.proc.returncode}:\n{agent.log()}"
        node = list_nodes(router).get(node_id)
        return node if node is not None and node.state == "healthy" and node.report.address == agent.address else None

    return wait_for(check, 120, f"{node_id} healthy on the router")


def node_stub(ch) -> pb_grpc.NodeStub:
    return pb_grpc.NodeStub(ch)


def spec(worker_id: str = "w-1", source: str = "tiny", reserved: int = 256 << 20, **kw) -> pb.WorkerSpec:
    return pb.WorkerSpec(worker_id=worker_id, model=SERVED, source=source, context=512, kv_cache_bytes=32 << 20,
                         reserved_bytes=reserved, **kw)


def test_an_agent_joins_reports_and_refuses_what_it_cannot_do(router, agent, models_dir):
    node = healthy(router, agent)
    r = node.report
    assert (r.address, r.advertise_host, r.platform) == (agent.address, "127.0.0.1", "cpu")
    assert r.memory_budget_bytes == BUDGET and r.memory_reserved_bytes == 0 and r.disk_free_bytes > 0
    assert [m.name for m in r.models] == ["tiny"] and not r.workers
    assert r.models[0].weight_bytes > 0 and r.models[0].num_layers > 0 and not r.models[0].error  # facts.scan's
    wait_for(lambda: list_nodes(router, router.router_addresses[1]).get("node-a", pb.NodeInfo()).state == "healthy",
             60, "node-a healthy on the second router")

    table = subprocess.run([sys.executable, "-m", "cluster", "nodes", "list", "--router", router.router_address],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "NODE" in table.stdout and "node-a" in table.stdout and "healthy" in table.stdout
    assert "1.0 GiB" in table.stdout and "on disk: tiny" in table.stdout

    async def refusals():
        async with channel(agent.address, ClientSecurity(api_key="wrong"), options=CHANNEL_OPTIONS) as bad, \
                channel(agent.address, ClientSecurity(api_key=router.join_token), options=CHANNEL_OPTIONS) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await node_stub(bad).StartWorker(pb.StartWorkerRequest(spec=spec()))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "join token" in e.value.details()
            stub = node_stub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.StartWorker(pb.StartWorkerRequest(spec=spec(source="nope")))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert "'nope'" in e.value.details() and str(models_dir) in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.StartWorker(pb.StartWorkerRequest(spec=spec(source="../tiny")))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a path" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.StartWorker(pb.StartWorkerRequest(spec=spec(reserved=2 << 30)))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "needs 2.0 GiB, node node-a has 1.0 GiB of 1.0 GiB free" in e.value.details()
            # a caller with the join token is not the catalog: the agent checks the flags itself
            for engine_args, flag in ((["--api-key", "sk-x"], "'--api-key'"),
                                      (["--metrics=0.0.0.0:9100"], "'--metrics'"),
                                      (["--speculative-config", '{"model": "/etc"}'], "--speculative-config")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.StartWorker(pb.StartWorkerRequest(spec=spec(engine_args=engine_args)))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and flag in e.value.details()
            report = await stub.GetNodeReport(pb.GetNodeReportRequest())
            assert not report.workers and report.memory_reserved_bytes == 0  # nothing started
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.StopWorker(pb.StopWorkerRequest(worker_id="w-9"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "w-9" in e.value.details()
            ports = (await stub.ReservePorts(pb.ReservePortsRequest(count=3))).ports
            assert len(set(ports)) == 3 and all(p > 0 for p in ports)

    run(refusals())
    assert not agent.worker_pids()

    os.kill(agent.proc.pid, signal.SIGSTOP)  # its heartbeats stop
    try:
        wait_for(lambda: node_state(router) == "unhealthy", 60, "the silent node unhealthy")
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    healthy(router, agent)


def test_an_agent_copies_a_model_from_another_under_its_copy_flags(router, agent, tiny_model_dir, tmp_path):
    """`orchard node serve --hub-cache --disk-budget --copy-bandwidth --copy-streams`: node-b
    copies node-a's model (FetchModel), and the router sees it there with the copy's totals."""
    healthy(router, agent)
    (tmp_path / "models-b").mkdir()
    b = AgentProcess(router.router_address, tmp_path / "models-b", tmp_path / "node-b", router.join_token,
                     node_id="node-b", extra=("--hub-cache", str(tmp_path / "hub-b"), "--disk-budget", "1GiB",
                                              "--copy-bandwidth", "64MiB", "--copy-streams", "2"))
    try:
        healthy(router, b, "node-b")

        async def copy():
            async with channel(b.address, ClientSecurity(api_key=router.join_token), options=CHANNEL_OPTIONS) as ch:
                request = pb.FetchModelRequest(source="tiny", peers=[pb.NodePeer(node_id="node-a",
                                                                                  address=agent.address)])
                return [m async for m in node_stub(ch).FetchModel(request, timeout=120)]

        messages = run(copy())
        assert messages[-1].done and getattr(messages[-1], "from") == "node-a"
        copied = tmp_path / "models-b" / "tiny"
        assert messages[-1].path == str(copied)
        for f in tiny_model_dir.iterdir():
            assert (copied / f.name).read_bytes() == f.read_bytes(), f.name

        def reported() -> pb.NodeReport | None:
            report = list_nodes(router).get("node-b", pb.NodeInfo()).report
            return report if [m.name for m in report.models] == ["tiny"] else None

        report = wait_for(reported, 60, "node-b reporting the copy")
        assert report.disk_budget_bytes == 1 << 30
        peer = next(t for t in report.transfer_totals if t.kind == "peer")
        assert (peer.fetches, peer.failures) == (1, 0) and peer.bytes == sum(
            f.stat().st_size for f in tiny_model_dir.iterdir())
    finally:
        b.stop()


def test_an_agent_with_a_wrong_join_token_is_refused_for_good(router, models_dir, tmp_path):
    bad = AgentProcess(router.router_address, models_dir, tmp_path / "node-bad", "not-the-token", node_id="node-bad")
    try:
        assert bad.proc.wait(120) == 78, bad.log()
        assert "refused" in bad.log()
        assert "node-bad" not in list_nodes(router)
    finally:
        bad.stop()


def test_a_second_agent_under_a_node_id_in_use_exits_78_naming_node_id(router, agent, models_dir, tmp_path,
                                                                        monkeypatch, capsys):
    from cluster.fleet import agent as agent_module
    from cluster.fleet.node_config import NodeConfig

    healthy(router, agent)
    monkeypatch.setattr(agent_module, "DUPLICATE_WAIT_S", 2.0)  # past a restart's wait: another Mac's id
    twin = NodeConfig(router=",".join(router.router_addresses), grpc_address="127.0.0.1:0", node_id="node-a",
                      join_token=router.join_token, models_dir=str(models_dir), state_dir=str(tmp_path),
                      heartbeat_interval=HEARTBEAT)
    assert run(asyncio.wait_for(agent_module.serve(twin), 120)) == 78
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("orchard node serve: every router refused node node-a: node id 'node-a' is held by "
                          f"another agent that still reports (at {agent.address}") and "--node-id" in err, err
    assert err.endswith("(exit 78: permanent)"), err
    assert healthy(router, agent).report.address == agent.address  # the first kept its id


def test_stop_leftovers_ends_only_workers_an_earlier_agent_left(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    worker = subprocess.Popen([*sleeper, "cluster worker serve", "--worker-id", "w-1"])
    other = subprocess.Popen(sleeper)
    another_worker = subprocess.Popen([*sleeper, "cluster worker serve", "--worker-id", "w-30"])
    try:
        (tmp_path / "w-1.pid").write_text(f"{worker.pid}\n")
        (tmp_path / "w-2.pid").write_text(f"{other.pid}\n")  # its PID now some other program's
        (tmp_path / "w-3.pid").write_text(f"{another_worker.pid}\n")  # ... another worker's (another agent's)
        assert stop_leftovers(tmp_path, grace=10) == [worker.pid]
        assert worker.wait(10) == -signal.SIGTERM and other.poll() is None and another_worker.poll() is None
        assert not list(tmp_path.glob("*.pid"))
    finally:
        for p in (worker, other, another_worker):
            p.kill()
            p.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_started_through_die_with_parent_ends_when_its_parent_is_killed(tmp_path):
    parent_code = ("import os, subprocess, sys, time\n"
                   "from cluster.fleet.agent import die_with_parent\n"
                   "env = dict(os.environ)\n"
                   "argv = die_with_parent([sys.executable, '-m', 'http.server', '0', '--bind', '127.0.0.1'], env)\n"
                   "assert argv[1] == '-c' and argv[3:] == ['http.server', '0', '--bind', '127.0.0.1'], argv\n"
                   "child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                   "print(child.pid, flush=True)\n"
                   "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        wait_for(lambda: "http.server" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"),
                 60, "the child running its module")
        parent.kill()
        parent.wait(10)
        wait_for(lambda: not alive(child), 60, "the child ended with its parent")
    finally:
        parent.kill()
        parent.wait()
        if alive(child):
            os.kill(child, signal.SIGKILL)


async def _generate(target: str, model: str, max_tokens: int, on_chunk=None) -> tuple[list[int], str]:
    request = pb.GenerateRequest(text="The fleet serves many models", model=model,
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    tokens, text = [], ""
    async with channel(target, options=CHANNEL_OPTIONS) as ch:
        async for chunk in pb_grpc.GenerationStub(ch).Generate(request, timeout=300):
            tokens += chunk.token_ids
            text += chunk.text
            if on_chunk is not None:
                on_chunk()
    return tokens, text


def _registered(router: LocalCluster, worker_id: str) -> pb.WorkerInfo | None:
    with channel(router.router_address, aio=False) as ch:
        workers = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
    return next((w for w in workers if w.worker_id == worker_id and w.state == pb.WORKER_STATE_HEALTHY), None)


@pytest.mark.slow
def test_a_started_worker_serves_like_a_static_one_and_drains_before_it_stops(router, agent, tiny_model_dir,
                                                                           worker_process):
    healthy(router, agent)
    static = worker_process(tiny_model_dir, "--max-model-len", "512", http=False)

    async def go():
        async with channel(agent.address, ClientSecurity(api_key=router.join_token), options=CHANNEL_OPTIONS) as ch:
            stub = node_stub(ch)
            started = await stub.StartWorker(pb.StartWorkerRequest(spec=spec()))
            assert started.worker_id == "w-1" and started.model == SERVED and started.reserved_bytes == 256 << 20
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.StartWorker(pb.StartWorkerRequest(spec=spec()))
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
            worker = await asyncio.to_thread(wait_for, lambda: _registered(router, "w-1"), 180,
                                             "the agent's worker registered with the router")
            pid = agent.worker_pids()["w-1"]
            assert worker.model == SERVED
            deadline = asyncio.get_running_loop().time() + 60
            while (report := await stub.GetNodeReport(pb.GetNodeReportRequest())).workers[0].state != "running":
                assert report.workers[0].state == "loading"
                assert asyncio.get_running_loop().time() < deadline, "the agent did not see its worker loaded"
                await asyncio.sleep(0.1)
            assert report.memory_reserved_bytes == 256 << 20 and report.workers[0].address

            expected = await _generate(static.grpc, "", 24)
            assert await _generate(router.router_address, SERVED, 24) == expected

            first = asyncio.Event()
            long_stream = asyncio.create_task(_generate(router.router_address, SERVED, 200, first.set))
            await asyncio.wait_for(first.wait(), 120)
            stop = pb.StopWorkerRequest(worker_id="w-1", drain_timeout_seconds=120)
            stopped, again = await asyncio.gather(stub.StopWorker(stop), stub.StopWorker(stop))  # one stop
            tokens, _ = await long_stream
            assert len(tokens) == 200  # finished where it ran, not cut by the stop
            assert stopped.state == again.state == "exited" and not alive(pid)
            report = await stub.GetNodeReport(pb.GetNodeReportRequest())
            assert not report.workers and report.memory_reserved_bytes == 0

    run(go(), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_an_agent_that_ends_leaves_no_worker_running(router, models_dir, tmp_path, how):
    if how == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("a killed agent's workers end with it on Linux; elsewhere its next start stops them")
    a = AgentProcess(router.router_address, models_dir, tmp_path / "node-k", router.join_token, node_id="node-k")
    pid = None
    try:
        healthy(router, a, "node-k")

        async def start():
            async with channel(a.address, ClientSecurity(api_key=router.join_token)) as ch:
                await node_stub(ch).StartWorker(pb.StartWorkerRequest(spec=spec(worker_id="k-1")))

        run(start())
        pid = wait_for(lambda: a.worker_pids().get("k-1"), 60, "the worker's pid file")
        assert alive(pid)
        a.proc.send_signal(how)
        a.proc.wait(120)
        wait_for(lambda: not alive(pid), 60, "the worker ended with its agent")
    finally:
        a.stop()
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_command_line_is_one_orchard_worker_serve_takes(tmp_path):
    """The flags the agent gives a group member parse as the worker's own options say."""
    from cluster.cli import build_parser
    from cluster.config import from_args
    from cluster.fleet.agent import worker_argv
    from cluster.worker.config import WorkerOptions

    member = spec(group_size=2, group_rank=1, group_hosts=["10.0.0.1:7000", "10.0.0.2:7001"], group_port=7100,
                  group_shares="2,1", memory_budget_bytes=3 << 30, engine_args=["--max-num-seqs", "8"])
    argv = worker_argv(member, str(tmp_path), "r1:50051,r2:50051", "0.0.0.0", "mac-2.local", 50123)
    assert argv[:5] == [sys.executable, "-m", "cluster", "worker", "serve"]
    options = from_args(WorkerOptions, build_parser(argv[3:]).parse_args(argv[3:]))
    assert (options.model_path, options.worker_id, options.served_model_name) == (str(tmp_path), "w-1", SERVED)
    assert (options.router, options.grpc_address, options.advertise_address) == (
        "r1:50051,r2:50051", "0.0.0.0:50123", "mac-2.local:50123")
    e, g = options.engine_config, options.group
    assert (e.max_model_len, e.kv_cache_memory_bytes, e.max_num_seqs) == (512, 32 << 20, 8)
    assert (g.size, g.rank, g.hosts, g.port, g.shares, g.memory_budget) == (
        2, 1, "10.0.0.1:7000,10.0.0.2:7001", 7100, "2,1", 3 << 30)
    # the pool's blocks and the requests at once the footprint counted (a hybrid's state slots)
    leader = spec(group_size=2, group_rank=0, group_hosts=["10.0.0.1:7000", "10.0.0.2:7001"], num_kv_blocks=96,
                  max_num_seqs=12)
    leader.kv_cache_bytes = 0
    argv = worker_argv(leader, str(tmp_path), "r1:50051", "0.0.0.0", "mac-1.local", 50124)
    e = from_args(WorkerOptions, build_parser(argv[3:]).parse_args(argv[3:])).engine_config
    assert (e.num_kv_blocks, e.kv_cache_memory_bytes, e.max_num_seqs) == (96, None, 12)


def test_a_source_names_a_directory_or_a_gguf_file_alike_on_the_node_and_in_the_controller(tmp_path):
    from cluster.fleet.agent import find_model
    from cluster.fleet.controller import _disk_model

    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text("{}")
    (tmp_path / "small.gguf").write_bytes(b"GGUF")
    report = pb.NodeReport(models=[pb.DiskModel(name="dense"), pb.DiskModel(name="small.gguf")])
    for source, name in (("dense", "dense"), ("small", "small.gguf"), ("small.gguf", "small.gguf")):
        assert find_model(tmp_path, source) == str(tmp_path / name)
        assert _disk_model(report, source).name == name, source  # the controller sees it on disk too
    assert _disk_model(report, "nope") is None


def test_the_agent_and_the_routers_node_side_import_no_mlx():
    code = ("import sys\nsys.modules['mlx'] = None  # any import of MLX fails\n"
            "import cluster.fleet.agent, cluster.fleet.nodes, cluster.fleet.service, cluster.router.server\n"
            "print('mlx' in sys.modules and sys.modules['mlx'] is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr


def _report(agent: AgentProcess, token: str) -> pb.NodeReport:
    with channel(agent.address, ClientSecurity(api_key=token), aio=False) as ch:
        return pb_grpc.NodeStub(ch).GetNodeReport(pb.GetNodeReportRequest(), timeout=10)


@pytest.mark.slow
def test_a_failed_worker_is_started_again_unless_it_failed_for_good(router, agent):
    """Exit 78 (a flag the worker refuses) leaves it exited with its log's last line as the
    reason and its memory given back; exit 75 (its port taken) starts it again."""
    healthy(router, agent)
    token = router.join_token
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with channel(agent.address, ClientSecurity(api_key=token), aio=False) as ch:
            stub = pb_grpc.NodeStub(ch)
            stub.StartWorker(pb.StartWorkerRequest(spec=spec("bad-flag", engine_args=["--max-num-seqs", "0"])),
                             timeout=30)
            stub.StartWorker(pb.StartWorkerRequest(spec=spec("busy-port", port=taken.getsockname()[1])), timeout=30)
            try:
                def worker(worker_id: str) -> pb.ManagedWorker:
                    return next(w for w in _report(agent, token).workers if w.worker_id == worker_id)

                wait_for(lambda: worker("bad-flag").state == "exited", 120, "the permanent failure exited")
                bad = worker("bad-flag")
                assert bad.exit_code == 78 and "max_num_seqs must be >= 1" in bad.reason and bad.reserved_bytes == 0
                wait_for(lambda: worker("busy-port").exit_code == 75, 120, "the transient failure seen")
                wait_for(lambda: worker("busy-port").restarts >= 1, 120, "the restart counted")
                assert bad.restarts == 0
                assert worker("busy-port").state != "exited"  # started again after its backoff
                assert _report(agent, token).memory_reserved_bytes == 256 << 20  # only busy-port's
                table = subprocess.run([sys.executable, "-m", "cluster", "nodes", "list", "--router",
                                        router.router_address], capture_output=True, text=True, timeout=60).stdout
                assert "worker bad-flag: tiny-chat exited" in table and "exit 78" in table
            finally:
                for worker_id in ("bad-flag", "busy-port"):
                    stub.StopWorker(pb.StopWorkerRequest(worker_id=worker_id, drain_timeout_seconds=1), timeout=60)
    assert not _report(agent, token).workers and not agent.worker_pids()


@pytest.mark.slow
def test_a_secured_fleet_places_through_mutual_tls(models_dir, tmp_path):
    """`orchard up --secure`'s set-up (keys, TLS, mutual TLS): the agent registers with its
    certificate, the router reaches its Node service with its own, and the worker it starts
    gets the agent's certificate and keys, registers and serves over TLS."""
    router = LocalCluster("", workers=0, grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
                          metrics_address=None, log_dir=tmp_path / "router", secure=True,
                          router_args=["--heartbeat-interval", str(HEARTBEAT)])
    router.start_router(0)
    s = router.secrets
    a = AgentProcess(router.router_address, models_dir, tmp_path / "node-s", router.join_token, node_id="node-s",
                     extra=tuple(s.server_flags("node-s")),
                     env={"ORCHARD_ADMIN_KEY": s.admin_key, "ORCHARD_API_KEY": s.api_key})
    admin = s.client(admin=True)
    node_security = ClientSecurity(api_key=router.join_token, tls_ca=admin.tls_ca, tls_cert=admin.tls_cert,
                                   tls_key=admin.tls_key)

    def nodes() -> dict[str, pb.NodeInfo]:
        try:
            with channel(router.router_address, admin, aio=False) as ch:
                return {n.report.node_id: n for n in pb_grpc.FleetStub(ch).ListNodes(pb.ListNodesRequest(),
                                                                                     timeout=5).nodes}
        except grpc.RpcError:
            return {}

    def registered() -> bool:
        with channel(router.router_address, admin, aio=False) as ch:
            workers = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
        return any(w.worker_id == "s-1" and w.state == pb.WORKER_STATE_HEALTHY for w in workers)

    try:
        wait_for(lambda: a.proc.poll() is None and nodes().get("node-s", pb.NodeInfo()).state == "healthy", 120,
                 "the secured node healthy")
        with channel(a.address, ClientSecurity(api_key=router.join_token), aio=False) as plain:
            with pytest.raises(grpc.RpcError):  # no TLS, no certificate: no Node service
                pb_grpc.NodeStub(plain).GetNodeReport(pb.GetNodeReportRequest(), timeout=5)
        with channel(a.address, node_security, aio=False) as ch:
            pb_grpc.NodeStub(ch).StartWorker(pb.StartWorkerRequest(spec=spec("s-1")), timeout=30)
        wait_for(registered, 180, "the secured worker registered")
        request = pb.GenerateRequest(text="hello", model=SERVED,
                                     sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        with channel(router.router_address, s.client(), aio=False) as ch:
            tokens = [t for c in pb_grpc.GenerationStub(ch).Generate(request, timeout=120) for t in c.token_ids]
        assert len(tokens) == 4
    finally:
        a.stop()
        router.stop(grace=5)


@pytest.mark.slow
def test_a_group_the_agent_starts_member_by_member_serves_and_stops_whole(router, agent, tiny_model_dir,
                                                                        worker_process):
    """Rank 0 and rank 1 of a pipeline group, each a StartWorker with the group's ring
    addresses and side-channel port, serve as one worker; stopping each member stops it."""
    healthy(router, agent)
    static = worker_process(tiny_model_dir, "--max-model-len", "512", http=False)

    async def go():
        async with channel(agent.address, ClientSecurity(api_key=router.join_token), options=CHANNEL_OPTIONS) as ch:
            stub = node_stub(ch)
            ring0, ring1, side, port = (await stub.ReservePorts(pb.ReservePortsRequest(count=4))).ports
            group = dict(group_size=2, group_hosts=[f"127.0.0.1:{ring0}", f"127.0.0.1:{ring1}"], group_port=side,
                         memory_budget_bytes=512 << 20)
            await stub.StartWorker(pb.StartWorkerRequest(spec=spec("g-1", group_rank=1, **group)))
            rank0 = await stub.StartWorker(pb.StartWorkerRequest(spec=spec("g-0", group_rank=0, port=port, **group)))
            assert rank0.address == f"127.0.0.1:{port}" and rank0.group_size == 2
            worker = await asyncio.to_thread(wait_for, lambda: _registered(router, "g-0"), 300,
                                             "the group registered with the router")
            pids = agent.worker_pids()
            assert worker.load.group.size == 2
            assert await _generate(router.router_address, SERVED, 16) == await _generate(static.grpc, "", 16)
            report = await stub.GetNodeReport(pb.GetNodeReportRequest())
            assert report.memory_reserved_bytes == 2 * (256 << 20)
            for worker_id in ("g-0", "g-1"):
                stopped = await stub.StopWorker(pb.StopWorkerRequest(worker_id=worker_id, drain_timeout_seconds=30))
                assert stopped.state == "exited"
            assert not any(alive(pids[w]) for w in ("g-0", "g-1"))

    run(go(), timeout=600)


def test_the_budget_is_at_most_what_the_machine_can_give(monkeypatch, tmp_path):
    from cluster.fleet import agent as agent_module
    from cluster.fleet.agent import NodeAgent
    from cluster.fleet.node_config import NodeConfig

    monkeypatch.setattr(agent_module, "machine_memory", lambda: ("metal", 3 << 30))

    async def budget(asked: int | None) -> int:
        node = NodeAgent(NodeConfig(router=f"127.0.0.1:{free_port()}", grpc_address="127.0.0.1:0",
                                    memory_budget=asked, models_dir=str(tmp_path), state_dir=str(tmp_path / "s")))
        await node.start()
        try:
            report = node.report()
            assert report.platform == "metal" and report.address == node.address
            return report.memory_budget_bytes
        finally:
            await node.stop()

    assert run(budget(8 << 30)) == 3 << 30  # capped by the machine
    assert run(budget(1 << 30)) == 1 << 30
    assert run(budget(None)) == 3 << 30


@pytest.mark.parametrize("flags, message", [
    (["--memory-budget", "0"], "--memory-budget must be a positive size, not 0"),
    (["--max-loaded", "-1"], "--max-loaded must be >= 0, not -1"),
    (["--node-id", "../x"], "--node-id must be 1 to 128 characters, no '/', not starting with '.': '../x'"),
    (["--router", ","], "--router names no router"),
    (["--heartbeat-interval", "0"], "--heartbeat-interval must be in [0.05, 60] seconds, not 0.0"),
    (["--disk-budget", "0"], "--disk-budget must be a positive size, not 0"),
    (["--copy-streams", "0"], "--copy-streams must be in [1, 64], not 0"),
])
def test_a_bad_setting_is_one_line_and_permanent(flags, message, tmp_path, capsys):
    from cluster.cli import main

    assert main(["node", "serve", "--state-dir", str(tmp_path), *flags]) == 78
    assert capsys.readouterr().err.strip() == f"orchard node serve: {message}"
    assert not list(tmp_path.iterdir())  # refused before anything was done


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", "mac-1.local:0"])
def test_a_node_reachable_from_other_machines_needs_a_join_token(address, tmp_path, capsys, monkeypatch):
    from cluster.cli import main
    from cluster.fleet.node_config import NodeConfig

    monkeypatch.delenv("ORCHARD_JOIN_TOKEN", raising=False)
    with pytest.raises(ValueError):  # (before `main`, which would serve)
        NodeConfig(grpc_address=address).validate()
    assert main(["node", "serve", "--grpc", address, "--state-dir", str(tmp_path)]) == 78
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"orchard node serve: --grpc {address} is reachable from other machines") and \
        "$ORCHARD_JOIN_TOKEN or --join-token" in err and "\n" not in err, err
    assert not list(tmp_path.iterdir())  # refused before anything was done


def test_a_loopback_node_or_one_with_a_token_is_not_refused(monkeypatch):
    from cluster.fleet.node_config import NodeConfig

    monkeypatch.delenv("ORCHARD_JOIN_TOKEN", raising=False)
    for address in ("127.0.0.1:0", "[::1]:0", "localhost:0"):
        NodeConfig(grpc_address=address).validate()
    NodeConfig(grpc_address="0.0.0.0:0", join_token="s3cret").validate()


def test_a_busy_port_is_one_line_and_transient(tmp_path, capsys):
    from cluster.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["node", "serve", "--grpc", f"127.0.0.1:{port}", "--router", f"127.0.0.1:{free_port()}",
                     "--state-dir", str(tmp_path), "--models-dir", str(tmp_path)]) == 75
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"orchard node serve: cannot listen on 127.0.0.1:{port} for gRPC (in use?) (exit 75: transient)"
