"""`orchard up`: one command brings up a router and workers; SIGINT stops them all."""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.up import free_port


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _until_up(lines: queue.Queue, timeout: float) -> str:
    """What `orchard up` printed until it said it is up (within `timeout` seconds)."""
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        assert line is not None, "orchard up exited early:\n" + "".join(out)
        out.append(line)
        if "Ctrl-C stops them all" in line:
            return "".join(out)
    raise TimeoutError("orchard up did not come up:\n" + "".join(out))


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def test_up_starts_serves_and_stops(tmp_path, tiny_model_dir):
    model = tiny_model_dir
    grpc_addr, http_addr, metrics_addr = (f"127.0.0.1:{free_port()}" for _ in range(3))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "up", "--model", str(model), "--workers", "2", "--grpc", grpc_addr,
         "--http", http_addr, "--metrics", metrics_addr, "--worker-port-base", "0", "--worker-metrics-port-base", "0",
         "--log-dir", str(tmp_path / "logs"), "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = _lines(proc)
    try:
        text = _until_up(lines, 150)
        assert grpc_addr in text and f"http://{http_addr}/v1" in text and f"http://{metrics_addr}/metrics" in text
        workers = re.findall(r"worker-\d+\s+gRPC (\S+)", text)
        assert len(workers) == 2

        with grpc.insecure_channel(grpc_addr) as ch:
            listed = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
            assert sorted(w.state for w in listed) == [pb.WORKER_STATE_HEALTHY] * 2
            req = pb.GenerateRequest(text="hi",
                                     sampling=pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            chunks = list(pb_grpc.GenerationStub(ch).Generate(req, timeout=30))
            assert sum(len(c.token_ids) for c in chunks) == 3

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        for address in [grpc_addr, http_addr, metrics_addr, *workers]:
            assert not _listening(address), f"{address} still open after orchard up stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_up_with_no_model_serves_a_real_model_that_knows_the_capital_of_france(tmp_path, smollm2_gguf):
    """The first five minutes: `orchard up` with no --model (as `scripts/up` runs it) serves
    SmolLM2-135M-Instruct (the fixture fetched it once into the cache `orchard up` reads),
    and the README's first request, through the router's OpenAI HTTP, answers Paris."""
    grpc_addr, http_addr, metrics_addr = (f"127.0.0.1:{free_port()}" for _ in range(3))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "up", "--workers", "1", "--grpc", grpc_addr, "--http", http_addr,
         "--metrics", metrics_addr, "--worker-port-base", "0", "--worker-metrics-port-base", "0",
         "--log-dir", str(tmp_path / "logs"), "--timeout", "240"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        text = _until_up(_lines(proc), 300)
        assert "no --model: serving smollm2-135m-instruct" in text
        assert "serving SmolLM2-135M-Instruct.Q4_1" in text
        body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "temperature": 0, "max_tokens": 32}).encode()
        request = urllib.request.Request(f"http://{http_addr}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.load(r)["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_secure_keys_never_read_as_flags(tmp_path):
    """`orchard up --secure` writes its keys mode 0600 and spelled so that none can start
    with "-" (a bare token_urlsafe can, and `--api-key -abc` is then a missing argument)."""
    from cluster.up import Secrets

    for i in range(20):
        s = Secrets.create(tmp_path / str(i), routers=1, workers=0)
        assert s.api_key.startswith("orchard-api-") and s.admin_key.startswith("orchard-admin-")
        assert (tmp_path / str(i) / "api-key").stat().st_mode & 0o777 == 0o600
    assert len({Secrets.create(tmp_path / str(i), 1, 0).api_key for i in range(20)}) == 20  # kept, and distinct


def _processes_with(text: str) -> list[int]:
    """PIDs whose command line contains `text` (Linux /proc)."""
    import os
    from pathlib import Path

    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the group's processes in /proc")
def test_up_runs_a_worker_group_and_starts_it_again_when_it_loses_a_process(tmp_path):
    """`orchard up --group-size 2`: one worker made of 2 processes over MLX's ring on
    loopback; the router lists it as one row with its members; kill -9 of the member makes
    `up` start the whole group again; Ctrl-C leaves no process of it."""
    import os

    from cluster.modelgen import create_model

    model = create_model(tmp_path / "m", "qwen3", "tiny", seed=1, layers=4)
    grpc_addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "up", "--model", str(model), "--workers", "1", "--group-size", "2",
         "--grpc", grpc_addr, "--http", "off", "--metrics", "off", "--worker-port-base", "0",
         "--worker-metrics-port-base", "0", "--log-dir", str(tmp_path / "logs"), "--timeout", "180"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _lines(proc)
    out = []

    def read_until(marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            assert line is not None, "orchard up exited early:\n" + "".join(out)
            out.append(line)
            if marker in line:
                return
        raise TimeoutError(f"no {marker!r} from orchard up:\n" + "".join(out))

    try:
        read_until("Ctrl-C stops them all", 240)
        assert "each a group of 2 (pipeline parallel)" in "".join(out)
        listed = subprocess.run([sys.executable, "-m", "cluster.cli", "router", "workers", "--router", grpc_addr],
                                capture_output=True, text=True, timeout=60).stdout
        assert "worker-0" in listed and "group of 2, pipeline parallel" in listed and "rank 1" in listed
        with grpc.insecure_channel(grpc_addr) as ch:
            req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=4, temperature=0,
                                                                           ignore_eos=True))
            assert sum(len(c.token_ids) for c in pb_grpc.GenerationStub(ch).Generate(req, timeout=60)) == 4
        member = [p for p in _processes_with("--group-rank 1") if str(model) in " ".join(
            open(f"/proc/{p}/cmdline").read().split("\0"))]
        assert len(member) == 1
        os.kill(member[0], signal.SIGKILL)
        read_until("worker-0 started again", 120)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            with grpc.insecure_channel(grpc_addr) as ch:
                listed = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
            if [w.state for w in listed] == [pb.WORKER_STATE_HEALTHY] and listed[0].load.HasField("group"):
                new = [p for p in _processes_with("--group-rank 1") if p != member[0]]
                if new:
                    break
            time.sleep(1)
        else:
            raise TimeoutError("the group did not come back:\n" + "".join(out))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        time.sleep(1)
        assert not [p for p in _processes_with(str(model)) if p != proc.pid], "a process of the group is left"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- supervision: what `orchard up` does when a worker's process ends -----------------------------

class _FakeProc:
    """A child process that has ended with `code`, or runs until killed (code None)."""

    def __init__(self, code: int | None):
        self.returncode = code
        self.pid = 0

    def poll(self):
        return self.returncode

    def kill(self):
        if self.returncode is None:
            self.returncode = -signal.SIGKILL

    def wait(self, timeout=None):
        return self.returncode

    send_signal = lambda self, sig: self.kill()  # noqa: E731


def _fake_cluster(tmp_path, codes: dict[str, list], **kwargs):
    """A LocalCluster whose children are `_FakeProc`s: child NAME's k-th start ends with
    `codes[NAME][k]` (None: runs); a clock the test moves."""
    from cluster.up import Child, LocalCluster

    now = [0.0]
    cluster = LocalCluster("model", log_dir=tmp_path, worker_port_base=0, worker_metrics_port_base=0,
                           clock=lambda: now[0], **kwargs)
    spawned: list[tuple[str, list[str], float]] = []

    def spawn(name, args, cpus=None, env=None):
        n = sum(1 for s in spawned if s[0] == name)
        spawned.append((name, args, now[0]))
        script = codes.get(name, [None])
        log_path = tmp_path / f"{name}.log"
        code = script[min(n, len(script) - 1)]
        if code == 78:
            log_path.write_text("starting\norchard worker serve: cannot load the model at m: no weights "
                                "(exit 78: permanent)\n")
        return Child(name, _FakeProc(code), log_path)

    cluster._spawn = spawn
    return cluster, now, spawned


def test_up_without_secure_presents_the_keys_its_processes_inherit(tmp_path, monkeypatch):
    """A user with $ORCHARD_ADMIN_KEY exported starts a router that demands it (it reads the
    environment): the readiness check must present it, or `orchard up` waits out its timeout."""
    from cluster.up import LocalCluster

    monkeypatch.setenv("ORCHARD_ADMIN_KEY", "the-admin-key")
    monkeypatch.setenv("ORCHARD_API_KEY", "key-1,key-2")
    cluster = LocalCluster("model", log_dir=tmp_path, worker_port_base=0, worker_metrics_port_base=0)
    assert cluster.client_security(admin=True).api_key == "the-admin-key"
    assert cluster.client_security().api_key == "key-1"
    assert cluster.client_security().channel_credentials() is None  # no TLS without --secure


def test_up_restarts_a_transient_failure_with_growing_delays(tmp_path):
    """A worker that keeps exiting 75 is started again after 1, 2, 4 ... s, capped at 60 s;
    the other worker keeps running; a run past the reset time starts the count over."""
    from cluster.exit_codes import Backoff

    cluster, now, spawned = _fake_cluster(tmp_path, {"worker-0": [75]}, workers=2,
                                          backoff=Backoff(first=1, cap=60, reset_after=300))
    for i in range(2):
        cluster.start_worker(i)
    starts, lines = [], []
    while len(starts) < 9 and now[0] < 1000:  # the fake clock moves 0.5 s a look, as `orchard up` does
        now[0] += 0.5
        lines += cluster.supervise()
        starts = [t for name, _, t in spawned if name == "worker-0"]
    delays = [float(line.rsplit(" ", 2)[1]) for line in lines if "starting it again in" in line]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60], lines
    # each start comes its delay after the look that found the last run ended (the one after its start)
    assert [b - a for a, b in zip(starts, starts[1:])] == [d + 0.5 for d in delays]
    assert "worker-0 exited (exit 75: transient): starting it again in 4 s" in lines
    assert cluster.restarts == 8 and cluster.workers[1].proc.poll() is None, "worker-1 is left running"
    assert [name for name, _, _ in spawned].count("worker-1") == 1

    # a run longer than the reset time was healthy: the next failure waits 1 s again
    cluster.workers[0].proc.returncode = None
    now[0] += 301
    cluster.workers[0].proc.returncode = 75
    assert cluster.supervise() == ["worker-0 exited (exit 75: transient): starting it again in 1 s"]


def test_up_does_not_restart_a_permanent_failure_and_says_why(tmp_path):
    """A member that exits 78 (here: its model does not load) stops its group for good:
    one line naming the process and the reason, no restart however long `up` watches, and
    the other worker keeps running."""
    cluster, now, spawned = _fake_cluster(tmp_path, {"worker-0-rank-1": [78], "worker-0": [None]}, workers=2,
                                          group_size=[2, 1])
    for i in range(2):
        cluster.start_worker(i)
    lines = []
    for _ in range(400):
        lines += cluster.supervise()
        now[0] += 0.5
    assert len(lines) == 1, lines
    assert lines[0].startswith("worker-0's group (worker-0-rank-1) exited (exit 78: permanent): orchard worker serve: "
                               "cannot load the model at m: no weights"), lines[0]
    assert "not started again" in lines[0] and "worker-0-rank-1.log" in lines[0]
    assert cluster.workers[0].proc.returncode == -signal.SIGKILL, "rank 0 of the failed group is stopped"
    assert [name for name, _, _ in spawned] == ["worker-0-rank-1", "worker-0", "worker-1"], "nothing restarted"
    assert cluster.workers[1].proc.poll() is None and cluster.restarts == 0
    assert 0 in cluster.given_up and "no weights" in cluster.given_up[0]


def test_up_passes_every_group_flag_to_every_rank(tmp_path):
    """`orchard up --group-timeout/--group-shares/--group-inflight` reach rank 0 and the
    members, as flags `orchard worker serve` reads into its group options."""
    from cluster.cli import build_parser
    from cluster.config import from_args
    from cluster.up import UpConfig, local_cluster
    from cluster.worker.config import WorkerOptions

    config = from_args(UpConfig, build_parser().parse_args(
        ["up", "--workers", "1", "--group-size", "3", "--group-timeout", "7.5", "--group-shares", "1,2,3",
         "--group-inflight", "2", "--log-dir", str(tmp_path)]))
    from cluster.up import Child

    cluster = local_cluster(config, "model")
    spawned = []
    cluster._spawn = lambda name, args, cpus=None, env=None: spawned.append((name, args)) or Child(
        name, _FakeProc(None), tmp_path / f"{name}.log")
    cluster.start_worker(0)
    assert sorted(name for name, _ in spawned) == ["worker-0", "worker-0-rank-1", "worker-0-rank-2"]
    for name, args in spawned:
        group = from_args(WorkerOptions, build_parser().parse_args(args)).group
        assert (group.timeout, group.shares, group.inflight, group.size) == (7.5, "1,2,3", 2, 3), name
