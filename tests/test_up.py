"""`orchard up`: one command brings up a router and workers; SIGINT stops them all."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

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
    out = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            assert line is not None, "orchard up exited early:\n" + "".join(out)
            out.append(line)
            if "Ctrl-C stops them all" in line:
                break
        else:
            raise TimeoutError("orchard up did not come up:\n" + "".join(out))
        text = "".join(out)
        assert grpc_addr in text and f"http://{http_addr}/v1" in text and f"http://{metrics_addr}/metrics" in text
        workers = re.findall(r"worker-\d+\s+gRPC (\S+)", text)
        assert len(workers) == 2

        with grpc.insecure_channel(grpc_addr) as ch:
            listed = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
            assert sorted(w.state for w in listed) == [pb.WORKER_STATE_HEALTHY] * 2
            req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
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
        read_until("started the whole group again", 120)
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
