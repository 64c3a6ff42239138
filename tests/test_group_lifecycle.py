"""A worker group's start and stop: no wait at start-up is without a deadline (a member
that dies mid-start ends rank 0's start in seconds, and a restarted member can join a
group that is forming), and a stop is orderly from whichever rank is told to stop (a
member asks rank 0 to drain and stop the group; `orchard up` stops rank 0 first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.up import free_ports
from cluster.worker.group import wire
from cluster.worker.group.channel import Leader, Member
from strike import greedy_streams
from test_group import _admitting, _wait_for

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token"
READY = "ORCHARD_WORKER_READY "


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", PYTHONUNBUFFERED="1",
                ORCHARD_JOIN_TOKEN=TOKEN, **extra)


# -- the side channel while the group starts ---------------------------------------------------------

def test_a_member_gone_while_rank_0_admits_can_join_again():
    """Rank 1 joins, dies (its connection closes) and is started again while rank 0 still
    waits for rank 2: the new rank 1 is admitted (it was refused as "already joined" until
    its join deadline, and the group never formed)."""
    lost = []
    leader = Leader(("127.0.0.1", 0), 3, TOKEN, 30.0, on_lost=lost.append)
    admitted = _admitting(leader)
    first = Member(leader.address, 1, 3, TOKEN, 30.0, on_lost=lost.append)
    again = Member(leader.address, 1, 3, TOKEN, 30.0, on_lost=lost.append)
    other = Member(leader.address, 2, 3, TOKEN, 30.0, on_lost=lost.append)
    try:
        first.join(time.monotonic() + 30)
        assert _wait_for(lambda: 1 in leader.members)
        first.close()  # rank 1 dies
        assert _wait_for(lambda: 1 not in leader.members), "rank 0 kept the dead member"
        again.join(time.monotonic() + 20)
        other.join(time.monotonic() + 30)
        assert admitted.wait(30) and set(leader.members) == {1, 2}
        assert leader.members[1].sock is not None and not leader.lost
    finally:
        leader.close()
        for m in (first, again, other):
            m.close()
    assert lost == []


def test_a_member_that_dies_while_the_group_starts_is_noticed_at_once():
    """Between admission and the members' LOADED (rank 0 loading its part), a member's
    closed connection loses the group at once, and `gather` says so rather than wait for
    its deadline; a member whose rank 0 goes away while it starts notices as soon."""
    lost = []
    leader = Leader(("127.0.0.1", 0), 2, TOKEN, 30.0, on_lost=lost.append)
    admitted = _admitting(leader)
    member = Member(leader.address, 1, 2, TOKEN, 30.0, on_lost=lambda reason: None)
    member.join(time.monotonic() + 30)
    assert admitted.wait(30)
    member.close()
    assert _wait_for(lambda: lost, 10), "rank 0 did not notice its member gone while starting"
    assert "rank 1" in lost[0]
    with pytest.raises(ConnectionError, match="lost"):
        leader.gather(wire.LOADED, time.monotonic() + 600)

    member_lost = []
    leader = Leader(("127.0.0.1", 0), 2, TOKEN, 30.0, on_lost=lost.append)
    admitted = _admitting(leader)
    member = Member(leader.address, 1, 2, TOKEN, 30.0, on_lost=member_lost.append)
    member.join(time.monotonic() + 30)
    member.listen()
    assert admitted.wait(30)
    leader.close(shutdown=False)  # rank 0 gone before it sent ASSIGN
    try:
        assert _wait_for(lambda: member_lost, 10), "the member did not notice rank 0 gone while starting"
        with pytest.raises(ConnectionError):
            member.receive(wire.ASSIGN, time.monotonic() + 600)
    finally:
        member.close()


# -- MLX's ring init: bounded although it holds the GIL ---------------------------------------------

RING_INIT = """
import logging, sys, time
from cluster import platform
platform.preload_blas()
logging.basicConfig(level=logging.INFO)
from cluster.worker.group.config import Topology
from cluster.worker.group.leader import init_ring
from cluster.worker.group.deadline import exit_after
with exit_after(0.5, 75, "nothing"):
    pass
time.sleep(1.5)  # the timer was cancelled: still here
print("cancelled", flush=True)
ports = [int(p) for p in sys.argv[1:]]
init_ring(Topology(0, tuple(("127.0.0.1", p) for p in ports), ("127.0.0.1", 1)), "ring", within=3)
print("formed", flush=True)
"""


def test_rings_init_waiting_for_a_neighbour_that_never_comes_ends_the_process_75():
    """Rank 0 of a ring whose rank 1 never connects: MLX waits in accept() holding the GIL
    (no Python thread runs, the start's watchdog included, so the group's start waited for
    ever); `within` ends the process with 75 all the same. A bound that was not reached
    leaves the process running."""
    proc = subprocess.run([sys.executable, "-c", RING_INIT, *map(str, free_ports(2))], capture_output=True,
                          text=True, env=_env(), timeout=120)
    assert proc.stdout.split() == ["cancelled"] and proc.returncode == 75, proc.stderr[-2000:]
    assert "forming MLX's ring group as rank 0" in proc.stderr


FAKE_MEMBER = """
import os, signal, sys, time
from cluster import platform
platform.preload_blas()
from cluster.worker.group import wire
from cluster.worker.group.channel import Member
from cluster.worker.group.memory import join_info
port, ring = int(sys.argv[1]), sys.argv[2]
m = Member(("127.0.0.1", port), 1, 2, os.environ["ORCHARD_JOIN_TOKEN"], 30.0,
           info={"host": "fake", "pid": os.getpid(), "ring": ring, **join_info(None, None)})
m.join(time.monotonic() + 120)
kind = None
while kind != wire.RING:  # after ASSIGN; pings answered meanwhile
    kind, payload = wire.read_message(m.sock)
    if kind == wire.PING:
        m.send(wire.PONG, payload)
print("RING", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # killed before its ring connect
"""


def _rank(model: Path, rank: int, hosts: str, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(model),
                             "--group-size", "2", "--group-rank", str(rank), "--group-hosts", hosts, "--group-port",
                             str(port), "--grpc", "127.0.0.1:0", "--metrics", "off", *extra],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())


def _ready(proc: subprocess.Popen, seconds: float = 300) -> list[str]:
    """Rank 0's output up to its ready line (its group formed and serves)."""
    lines: list[str] = []
    done = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(READY):
                done.set()
                return
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    done.wait(seconds)
    assert lines and lines[-1].startswith(READY), "rank 0 never served:\n" + "".join(lines[-40:])
    return lines


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_a_member_killed_after_ring_ends_rank_0_in_seconds_and_the_group_forms_when_it_is_back(tiny_model_dir):
    """The start-up hang: a member killed after RING, before its ring connect. Rank 0 sat
    in MLX's ring init (accept(), holding the GIL) until the start's watchdog, the join
    timeout plus a minute; now it exits 75 once the ring's deadline (--group-timeout,
    default 20 s) passes. Started again (as a launcher does), with the member back, the
    group forms."""
    *ring, port = free_ports(3)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ring)
    rank0 = _rank(tiny_model_dir, 0, hosts, port, "--group-join-timeout", "600")
    fake = subprocess.Popen([sys.executable, "-c", FAKE_MEMBER, str(port), hosts.split(",")[1]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        out, _ = fake.communicate(timeout=300)
        assert "RING" in out and fake.returncode == -signal.SIGKILL, out[-2000:]
        try:
            code = rank0.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("rank 0 still waits for the killed member's ring connect") from None
        log = rank0.stdout.read()
        assert code == 75, log[-3000:]
        assert "forming MLX's ring group as rank 0" in log
    finally:
        _stop(rank0, fake)

    rank0 = _rank(tiny_model_dir, 0, hosts, port)
    member = _rank(tiny_model_dir, 1, hosts, port)
    try:
        _ready(rank0)
        rank0.send_signal(signal.SIGTERM)  # rank 0's own orderly stop: its members exit 0 on its SHUTDOWN
        assert rank0.wait(timeout=120) == 0 and member.wait(timeout=120) == 0
    finally:
        _stop(rank0, member)


def test_a_member_of_another_model_stops_both_ranks_for_good_before_the_ring(tiny_model_dir, tmp_path):
    """A member whose model is not rank 0's: refused as it joins, before any rank waits in
    MLX's ring init, and both ranks exit 78. The member found out on ASSIGN, with rank 0
    already in the ring's accept() for it: rank 0 then waited there (exit 75 at the ring's
    deadline, to be started again for ever)."""
    from cluster.modelgen import create_model

    other = create_model(tmp_path / "other", "qwen3", "tiny", seed=0, layers=3)
    *ring, port = free_ports(3)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ring)
    rank0 = _rank(tiny_model_dir, 0, hosts, port)
    member = _rank(other, 1, hosts, port)
    try:
        codes = [p.wait(timeout=120) for p in (rank0, member)]
        log = rank0.stdout.read()
        assert codes == [78, 78], log[-3000:] + member.stdout.read()[-2000:]
        assert "rank 1 (" in log and "serves another model" in log and "forming MLX's ring" not in log
    finally:
        _stop(rank0, member)


# -- an orderly stop from a member ------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_to_a_member_stops_the_whole_group_in_order(tiny_model_dir):
    """SIGTERM to a serving member (launchd booting its Mac out): it asks rank 0 (STOP),
    rank 0 drains as on its own SIGTERM and sends SHUTDOWN, and every rank exits 0. The
    member used to die at once (no handler), and rank 0 lost its group (75)."""
    *ring, port = free_ports(3)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ring)
    rank0 = _rank(tiny_model_dir, 0, hosts, port)
    member = _rank(tiny_model_dir, 1, hosts, port)
    try:
        _ready(rank0)
        member.send_signal(signal.SIGTERM)
        assert member.wait(timeout=120) == 0, member.stdout.read()[-3000:]
        assert rank0.wait(timeout=120) == 0
        log = rank0.stdout.read()
        assert "rank 1 asked the group to stop" in log and "worker group lost" not in log, log[-3000:]
    finally:
        _stop(rank0, member)


def test_a_member_told_to_stop_before_its_group_serves_exits_0_at_once(tiny_model_dir):
    """Nothing to drain before the group serves (here: no rank 0 to join yet): the member
    ends at once with 0, rather than being killed by the signal."""
    *ring, port = free_ports(3)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ring)
    member = _rank(tiny_model_dir, 1, hosts, port, "--group-join-timeout", "600")
    try:
        lines = []
        for line in member.stdout:
            lines.append(line)
            if "not joined yet" in line:
                break
        assert lines and "not joined yet" in lines[-1], "".join(lines)
        member.send_signal(signal.SIGTERM)
        assert member.wait(timeout=60) == 0, member.stdout.read()[-2000:]
    finally:
        _stop(member)


# -- `orchard up`'s stop order ----------------------------------------------------------------------

class _Proc:
    """A child that runs until signalled; `events` records (what, name) in order."""

    def __init__(self, name: str, events: list):
        self.name, self.events, self.returncode, self.pid = name, events, None, 0

    def poll(self):
        return self.returncode

    def send_signal(self, sig) -> None:
        self.events.append(("signal", self.name))
        self.returncode = 0

    def kill(self) -> None:
        self.returncode = -signal.SIGKILL

    def wait(self, timeout=None):
        self.events.append(("ended", self.name))
        return self.returncode


def test_orchard_up_stops_a_groups_rank_0_before_its_members(tmp_path):
    """Rank 0 drains with its members running the drain's steps, then stops them: `up`
    signals the members only once rank 0 has ended (it signalled all ranks at once, and
    the members died under rank 0's drain), and the router last."""
    from cluster.up import Child, LocalCluster

    events: list = []
    cluster = LocalCluster("model", workers=1, group_size=2, log_dir=tmp_path, worker_port_base=0,
                           worker_metrics_port_base=0)
    cluster._spawn = lambda name, args, cpus=None, env=None: Child(name, _Proc(name, events), tmp_path / name)
    cluster.start_router()
    cluster.start_worker(0)
    cluster.stop(grace=1)
    assert events.index(("ended", "worker-0")) < events.index(("signal", "worker-0-rank-1")), events
    assert events[-2:] == [("signal", "router"), ("ended", "router")], events


@pytest.mark.slow
def test_sigterm_to_a_member_mid_stream_loses_no_stream_and_every_rank_exits_0(tmp_path):
    """A group that is its model's only worker, behind the router: SIGTERM to its member
    mid-stream. Rank 0 drains (the streams that finish within its grace do; the router
    holds the rest and resumes them once `orchard up` has started the group again), every
    stream is the run without the fault's, and both ranks of the stopped group exit 0."""
    from cluster.modelgen import create_model
    from cluster.up import LocalCluster, free_port

    model = create_model(tmp_path / "m", "qwen3", "tiny", seed=1, layers=4)
    texts = [f"stream {i}: " + " ".join(["orchard", "pear", "apple"][(i + j) % 3] for j in range(i + 3))
             for i in range(8)]
    max_tokens = 160
    cluster = LocalCluster(model, workers=1, group_size=2, grpc_address=f"127.0.0.1:{free_port()}",
                           http_address=None, metrics_address=None, worker_port_base=0, worker_metrics_port_base=0,
                           log_dir=tmp_path / "logs")
    with cluster:
        baseline = greedy_streams(cluster.router_address, texts, max_tokens)
        assert all(len(t) == max_tokens for t in baseline)
        old = cluster.group_processes(0)
        fired = threading.Event()

        def stop_member(n: int) -> None:
            if n >= len(texts) * max_tokens // 4 and not fired.is_set():
                fired.set()
                old[1].proc.send_signal(signal.SIGTERM)

        done = threading.Event()

        def supervise() -> None:  # what `orchard up` does every half second
            while not done.is_set():
                cluster.supervise()
                time.sleep(0.5)

        watcher = threading.Thread(target=supervise, daemon=True)
        watcher.start()
        try:
            got = greedy_streams(cluster.router_address, texts, max_tokens, on_progress=stop_member)
        finally:
            done.set()
            watcher.join(30)
        assert fired.is_set()
        assert got == baseline, "streams changed by the member's SIGTERM"
        assert [c.proc.wait(timeout=120) for c in old] == [0, 0], "\n".join(c.tail(30) for c in old)
        assert "rank 1 asked the group to stop" in old[0].log_path.read_text()
