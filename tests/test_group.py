"""Worker groups (cluster/worker/group/): N local processes over MLX's ring on loopback
serve one model; every request's tokens and logprobs must be the single-process engine's,
bit for bit, and greedy tokens mlx-lm's. Plus the pieces alone: the plan's wire format and
mirrored tables, the layer split, the side channel's authentication and fault detection.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.worker.group import wire
from cluster.worker.group.channel import Leader, Member
from cluster.worker.group.config import GroupOptions, read_hostfile, topology
from cluster.up import free_ports
from cluster.worker.group.stage import split_layers
from strike import greedy_streams

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token"


# -- the plan on the wire ------------------------------------------------------------------------

class _Seq:
    def __init__(self, table, tokens, slot=-1, status="running"):
        self.block_table = table
        self.token_ids = tokens
        self.state_slot = slot
        self.status = SimpleNamespace(value=status)


def _entry(seq, start, n):
    return SimpleNamespace(seq=seq, start=start, num_new_tokens=n)


def _prepare_like(entries, bs):
    """What ModelRunner.prepare builds from the same entries (positions, slots, tables)."""
    positions, slots, tables = [], [], []
    for e in entries:
        bt = e.seq.block_table
        positions += range(e.start, e.start + e.num_new_tokens)
        slots += [bt[p // bs] * bs + p % bs for p in range(e.start, e.start + e.num_new_tokens)]
        tables.append(bt[: -(-(e.start + e.num_new_tokens) // bs)])
    width = max(len(t) for t in tables)
    return positions, slots, [t + [0] * (width - len(t)) for t in tables]


def test_plan_round_trip_mirrors_tables_through_growth_preemption_and_drops():
    bs = 4
    writer, reader = wire.PlanWriter(), wire.PlanReader(bs, 100)
    a, b = _Seq([1, 2, 3], list(range(10, 30)), slot=3), _Seq([7], list(range(50, 60)))
    steps = [
        [_entry(a, 0, 6), _entry(b, 0, 3)],  # prefill chunks
        [_entry(a, 6, 2), _entry(b, 3, 1)],  # b crosses into... its second block is allocated below
    ]
    b.block_table = [7, 9]
    for i, entries in enumerate(steps):
        payload = writer.encode(i + 1, entries, bs, check=1234)
        plan = reader.decode(payload)
        positions, slots, tables = _prepare_like(entries, bs)
        assert plan.positions.tolist() == positions
        assert plan.slot_mapping.tolist() == slots
        assert plan.block_tables.tolist() == tables
        assert plan.input_ids.tolist() == [t for e in entries
                                           for t in e.seq.token_ids[e.start:e.start + e.num_new_tokens]]
        assert plan.check == 1234 and plan.state_slots.tolist() == [e.seq.state_slot for e in entries]
    # a preempted sequence loses its blocks; readmitted it gets others: the members follow
    b.status.value = "waiting"
    b.block_table = []
    plan = reader.decode(writer.encode(3, [_entry(a, 8, 1)], bs))
    assert set(reader.tables) == set(writer.tables) and len(reader.tables) == 1, "b's table was dropped"
    b.status.value, b.block_table = "running", [11, 12]
    entries = [_entry(a, 9, 1), _entry(b, 0, 6)]
    plan = reader.decode(writer.encode(4, entries, bs))
    assert plan.block_tables.tolist() == _prepare_like(entries, bs)[2]
    # a table rewritten in the middle (not only grown) is sent from the first change
    a.block_table = [1, 5, 6]
    entries = [_entry(a, 10, 1)]
    plan = reader.decode(writer.encode(5, entries, bs))
    assert plan.slot_mapping.tolist() == _prepare_like(entries, bs)[1]
    assert reader.tables == writer.tables


def test_plan_decoding_refuses_malformed_messages():
    reader = wire.PlanReader(16, 8)
    with pytest.raises(wire.ProtocolError):
        reader.decode(b"short")
    head = wire.STEP_HEAD.pack(1, 0, 2, 1, 0, 0, 0)
    with pytest.raises(wire.ProtocolError):  # sizes that do not add up
        reader.decode(head + b"\0" * 4)
    # a block id outside the pool
    import numpy as np

    body = np.array([5, 6, 0, 0, 2, -1, 0, 0, 1, 99], np.int32)
    with pytest.raises(wire.ProtocolError, match="outside the pool"):
        reader.decode(wire.STEP_HEAD.pack(1, 0, 2, 1, 4, 0, 0) + body.tobytes())


# -- the split and the topology --------------------------------------------------------------------

def test_split_follows_shares_and_keeps_every_stage_a_layer():
    assert split_layers([10] * 8, [1, 1]) == [range(4), range(4, 8)]
    assert split_layers([10] * 8, [1, 3]) == [range(2), range(2, 8)]
    assert split_layers([10] * 3, [1, 1, 1]) == [range(1), range(1, 2), range(2, 3)]
    assert split_layers([10] * 3, [100, 1, 1]) == [range(1), range(1, 2), range(2, 3)]
    # the embedding on the first stage and the head on the last count against their shares
    assert split_layers([10] * 8, [1, 1], embed_bytes=40) == [range(2), range(2, 8)]
    with pytest.raises(ValueError):
        split_layers([10] * 2, [1, 1, 1])


def test_topology_from_flags_hostfiles_and_mlx_launch(tmp_path):
    opts = GroupOptions(size=2, hosts="10.0.0.1:5000,10.0.0.2:5001")
    t = topology(opts, environ={"MLX_RANK": "1"})
    assert t.rank == 1 and t.control == ("10.0.0.1", 6000) and t.ring[1] == ("10.0.0.2", 5001)
    launch = tmp_path / "hosts.json"
    launch.write_text(json.dumps([{"ssh": "m1", "ips": ["10.0.0.1"]}, {"ssh": "m2", "ips": ["10.0.0.2"]}]))
    assert read_hostfile(str(launch)) == [("10.0.0.1", 32323), ("10.0.0.2", 32324)]
    ring = tmp_path / "ring.json"
    ring.write_text(json.dumps([["127.0.0.1:7000"], ["127.0.0.1:7001"]]))
    t = topology(GroupOptions(size=2, port=9999), environ={"MLX_RANK": "0", "MLX_HOSTFILE": str(ring)})
    assert t.rank == 0 and t.ring == (("127.0.0.1", 7000), ("127.0.0.1", 7001)) and t.control == ("127.0.0.1", 9999)
    with pytest.raises(ValueError, match="--group-size 3"):
        topology(GroupOptions(size=3, hosts="a:1,b:2"))
    with pytest.raises(ValueError, match="addresses"):
        topology(GroupOptions(size=2), environ={})


# -- the side channel ------------------------------------------------------------------------------

def _leader(size=2, timeout=5.0):
    lost = []
    leader = Leader(("127.0.0.1", 0), size, TOKEN, timeout, on_lost=lost.append)
    return leader, lost


def _joined(timeout: float):
    """A leader serving one member (rank 1) that has joined; the member reads nothing (no
    serve()). Returns (leader, what the leader lost, member)."""
    leader, lost = _leader(timeout=timeout)
    member = Member(leader.address, 1, 2, TOKEN, 30.0, on_lost=lambda r: None)
    t = threading.Thread(target=leader.admit, args=(time.monotonic() + 30,), daemon=True)
    t.start()
    member.join(time.monotonic() + 30)
    t.join(30)
    leader.serve()
    return leader, lost, member


def test_side_channel_admits_only_members_with_the_token():
    leader, _ = _leader()
    addr = leader.address
    errors = []

    def join(token, rank):
        m = Member(addr, rank, 2, token, 5.0, on_lost=errors.append)
        try:
            m.join(time.monotonic() + 10)
            return m
        except (wire.ProtocolError, OSError) as e:
            errors.append(str(e))

    done = threading.Event()
    t = threading.Thread(target=lambda: (leader.admit(time.monotonic() + 20), done.set()), daemon=True)
    t.start()
    assert join("wrong", 1) is None  # refused; the leader keeps waiting
    assert join(TOKEN, 5) is None  # not a rank of this group
    good = join(TOKEN, 1)
    assert done.wait(10) and good is not None
    assert set(leader.members) == {1}
    assert any("join token" in e for e in errors) and any("group of" in e or "ranks" in e for e in errors)
    leader.close()
    good.close()


def test_a_stranger_that_stalls_its_handshake_delays_no_member():
    """A peer that connects first and sends a byte now and then (never a whole HELLO) holds
    no one up: the member that comes after it joins at once, and the stranger is dropped
    when its handshake's time is up (for the whole exchange, not for each byte)."""
    lost = []
    leader = Leader(("127.0.0.1", 0), 2, TOKEN, 30.0, on_lost=lost.append, handshake_timeout=2.0)
    admitted = threading.Event()
    threading.Thread(target=lambda: (leader.admit(time.monotonic() + 60), admitted.set()), daemon=True).start()
    stranger = socket.create_connection(leader.address, timeout=5)
    dropped = threading.Event()

    def trickle() -> None:
        try:
            for b in wire.frame(wire.HELLO, b"{" + b" " * 1000):
                stranger.sendall(bytes([b]))
                time.sleep(0.5)
        except OSError:
            pass
        dropped.set()

    threading.Thread(target=trickle, daemon=True).start()
    time.sleep(0.5)  # the stranger's handshake is under way
    member = Member(leader.address, 1, 2, TOKEN, 30.0, on_lost=lost.append)
    t0 = time.monotonic()
    member.join(time.monotonic() + 30)
    assert admitted.wait(30) and time.monotonic() - t0 < 15, "the member waited on the stranger"
    assert set(leader.members) == {1}
    assert dropped.wait(30), "the stranger was never dropped"
    stranger.close()
    leader.close()  # before the member: a member that leaves a formed group loses it
    member.close()
    assert lost == []


def _admitting(leader: Leader, seconds: float = 60) -> threading.Event:
    """The leader admitting its members on a thread; set once they all joined."""
    admitted = threading.Event()
    threading.Thread(target=lambda: (leader.admit(time.monotonic() + seconds), admitted.set()), daemon=True).start()
    return admitted


def _wait_for(predicate, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_strangers_that_stall_keep_no_member_out():
    """32 connections from the member's own address that send 2 bytes and stall (more than
    all the handshake slots) do not keep the member holding the token out: it joins within
    its deadline, long before the strangers' handshakes time out (one address holds at most
    a few slots, and a new connection takes the oldest one's)."""
    from cluster.worker.group.channel import MAX_PENDING_PER_ADDRESS

    lost = []
    leader = Leader(("127.0.0.1", 0), 2, TOKEN, 30.0, on_lost=lost.append, handshake_timeout=120.0)
    admitted = _admitting(leader, 120)
    strangers = []
    try:
        for _ in range(32):
            s = socket.create_connection(leader.address, timeout=10)
            s.sendall(wire.FRAME.pack(wire.MAGIC, wire.VERSION, wire.HELLO, 0, 100)[:2])
            strangers.append(s)
        # every stranger taken in (each past the address's slots took an older one's) before the member comes
        assert _wait_for(lambda: leader.handshakes.dropped >= 32 - MAX_PENDING_PER_ADDRESS)
        assert len(leader.handshakes) == MAX_PENDING_PER_ADDRESS
        member = Member(leader.address, 1, 2, TOKEN, 30.0, on_lost=lost.append)
        member.join(time.monotonic() + 30)
        assert admitted.wait(30) and set(leader.members) == {1}
    finally:
        for s in strangers:
            s.close()
        leader.close()
    member.close()
    assert lost == []


def test_handshake_slots_are_bounded_per_address_and_in_total():
    from cluster.worker.group.channel import HandshakeSlots

    slots = HandshakeSlots(per_address=2, total=5)
    assert slots.add("a1", "A") == [] and slots.add("a2", "A") == []
    assert slots.add("a3", "A") == ["a1"]  # the address's oldest gives way; the others keep theirs
    for c in ("b1", "b2", "c1"):
        assert slots.add(c, c[0].upper()) == []
    assert len(slots) == 5
    assert slots.add("d1", "D") == ["a2"]  # all full: the busiest address's oldest gives way
    assert slots.add("e1", "E") == ["b1"]
    assert len(slots) == 5 and slots.dropped == 3
    assert slots.release("a1") is True and slots.release("c1") is False and slots.release("c1") is False
    assert len(slots) == 4


def test_a_member_tries_again_when_rank_0_resets_its_connection():
    """The first connection is reset (rank 0 restarting, or dropping it while busy), then
    nothing listens for a moment: the member tries again until its deadline and joins."""
    import struct

    port = free_ports(1)[0]
    fake = socket.create_server(("127.0.0.1", port))
    lost = []
    member = Member(("127.0.0.1", port), 1, 2, TOKEN, 30.0, on_lost=lost.append)
    joined, failed = threading.Event(), []

    def join() -> None:
        try:
            member.join(time.monotonic() + 60)
            joined.set()
        except Exception as e:  # noqa: BLE001  (the assertion below reports it)
            failed.append(repr(e))

    threading.Thread(target=join, daemon=True).start()
    fake.settimeout(30)
    sock, _ = fake.accept()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset
    fake.close()
    time.sleep(0.5)  # refused meanwhile (nothing listens); the member's next tries find rank 0
    leader = Leader(("127.0.0.1", port), 2, TOKEN, 30.0, on_lost=lost.append)
    admitted = _admitting(leader)
    try:
        assert joined.wait(60), f"the member did not try again: {failed}"
        assert admitted.wait(30) and set(leader.members) == {1}
    finally:
        member.close()
        leader.close()


@pytest.mark.parametrize("payload, says", [
    (b"not json", "not JSON"),
    (b'{"rank": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested"),
    (b'{"rank": "1", "size": 2, "nonce": "' + b"n" * 32 + b'"}', "rank"),
    (b'{"rank": 1, "size": 2, "nonce": 12345678901234567890}', "nonce"),
    (b'{"rank": true, "size": 2, "nonce": "' + b"n" * 32 + b'"}', "rank"),
    (b'{"rank": 1, "size": 2, "nonce": "' + b"n" * 32 + b'", "memory": "lots"}', "memory"),
    (b'{"rank": 1, "size": 2, "nonce": "' + b"n" * 32 + b'", "ring": "nowhere"}', "ring address"),
    (b'{"rank": 1, "size": 2, "nonce": "' + b"n" * 32 + b'", "ring": "h:99999"}', "ring address"),
    (b"[1, 2]", "object"),
    (None, "bytes"),  # a HELLO longer than a handshake may be
])
def test_a_malformed_hello_closes_its_connection_and_the_join_goes_on(payload, says, caplog, monkeypatch):
    """A stranger's HELLO that is not JSON, nested 5,000 deep, of the wrong types or too
    long: its connection is closed with one log line (no traceback, no thread lost), and
    the member that comes next joins."""
    import logging

    crashed = []
    monkeypatch.setattr(threading, "excepthook", crashed.append)
    lost = []
    leader = Leader(("127.0.0.1", 0), 2, TOKEN, 30.0, on_lost=lost.append)
    admitted = _admitting(leader)
    caplog.set_level(logging.INFO, logger="cluster.worker.group.channel")
    try:
        with socket.create_connection(leader.address, timeout=30) as s:
            if payload is None:
                s.sendall(wire.FRAME.pack(wire.MAGIC, wire.VERSION, wire.HELLO, 0, wire.MAX_HANDSHAKE + 1))
            else:
                s.sendall(wire.frame(wire.HELLO, payload))
            assert s.recv(1) == b"", "the connection was left open"
        assert _wait_for(lambda: any("refused" in r.getMessage() for r in caplog.records))
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1 and says in refusals[0].getMessage(), refusals[0].getMessage()
        assert all(r.exc_info is None for r in caplog.records)
        member = Member(leader.address, 1, 2, TOKEN, 30.0, on_lost=lost.append)
        member.join(time.monotonic() + 30)
        assert admitted.wait(30) and set(leader.members) == {1}
    finally:
        leader.close()
    member.close()
    assert crashed == [] and lost == []


def test_a_group_never_starts_without_a_join_token(tmp_path):
    """Rank 0 and a member started with no join token (even on loopback, where an empty
    token used to be taken: any local process could then prove it) refuse to start: one
    line naming the setting, exit 78 (permanent: no launcher starts them again as they are)."""
    *ring, port = free_ports(3)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ring)
    env = {k: v for k, v in _env().items() if k != "ORCHARD_JOIN_TOKEN"}
    procs = [subprocess.Popen([sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(tmp_path),
                               "--group-size", "2", "--group-rank", str(r), "--group-hosts", hosts, "--group-port",
                               str(port), "--group-join-timeout", "5", "--grpc", "127.0.0.1:0", "--metrics", "off"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
             for r in (0, 1)]
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 78, err[-2000:]
            assert len(err.strip().splitlines()) == 1 and "$ORCHARD_JOIN_TOKEN" in err, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_group_ranks_refuse_an_empty_join_token_in_process():
    """The same refusal where a group starts without the CLI (Ray's actors, tests)."""
    from cluster.worker.group.member import run_member

    opts = GroupOptions(size=2, hosts="127.0.0.1:7000,127.0.0.1:7001", rank=1, join_timeout=1)
    assert run_member("unused", opts, "") == 78
    with pytest.raises(ValueError, match=r"\$ORCHARD_JOIN_TOKEN"):
        Leader(("127.0.0.1", 0), 2, "", 30.0)
    with pytest.raises(ValueError, match=r"\$ORCHARD_JOIN_TOKEN"):
        Member(("127.0.0.1", 1), 1, 2, "", 30.0)


def test_orchard_up_gives_each_group_one_random_join_token(tmp_path, monkeypatch):
    """`orchard up` makes a join token and hands it to every rank of its groups in their
    environment (never on a command line), the same for all ranks of a group."""
    import cluster.up as up

    spawned = []

    class FakePopen:
        def __init__(self, args, env=None, **kw):
            spawned.append((args, env))
            self.pid = 1

        def poll(self):
            return None

    monkeypatch.setattr(up.subprocess, "Popen", FakePopen)
    tokens = set()
    for _ in range(2):
        spawned.clear()
        cluster = up.LocalCluster(tmp_path, workers=1, group_size=3, worker_port_base=0, worker_metrics_port_base=0,
                                  log_dir=tmp_path / "logs")
        cluster.start_worker(0)
        ranks = [(args, env) for args, env in spawned if "--group-rank" in args]
        assert sorted(args[args.index("--group-rank") + 1] for args, _ in ranks) == ["0", "1", "2"]
        got = {env.get("ORCHARD_JOIN_TOKEN") for _, env in ranks}
        assert len(got) == 1 and len(next(iter(got))) >= 16
        token = next(iter(got))
        assert not any(token in " ".join(args) for args, _ in spawned)
        tokens.add(token)
    assert len(tokens) == 2, "a fresh token each run"


def test_rank_0_closes_even_when_a_member_connection_is_stuck():
    """Rank 0's orderly end tells each member to stop; a connection another sender is stuck
    on (a member that reads nothing: its buffers full) must not keep rank 0 from ending."""
    leader, lost, m = _joined(timeout=30.0)
    leader.members[1].lock.acquire()  # a send to rank 1 that never returns
    closed = threading.Event()
    threading.Thread(target=lambda: (leader.close(), closed.set()), daemon=True).start()
    assert closed.wait(30), "rank 0's close waited for ever on a stuck member connection"
    assert lost == []
    m.close()


def test_side_channel_notices_a_silent_or_closed_member():
    leader, lost, m = _joined(timeout=2.0)
    # the member never reads (no serve()): it answers no ping, and is lost by the timeout
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lost and "silent" in lost[0]
    m.close()

    leader, lost, m = _joined(timeout=30.0)
    m.close()  # a member that dies: its connection closes
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "rank 1" in lost[0]


# -- whole groups against the single process -----------------------------------------------------------

def _env():
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", PYTHONUNBUFFERED="1",
                ORCHARD_JOIN_TOKEN=TOKEN, PYTHONFAULTHANDLER="1")


def start_members(model: Path, size: int, hosts: str, port: int, parallel: str = "pipeline", extra=()):
    return [subprocess.Popen([sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(model),
                              "--group-size", str(size), "--group-rank", str(r), "--group-hosts", hosts,
                              "--group-port", str(port), "--parallel", parallel, "--group-timeout", "60", *extra],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=_env())
            for r in range(1, size)]


def run_group(model: Path, size: int, parallel: str = "pipeline", timeout: float = 600, stale_ring: bool = False,
              members_extra=(), **driver) -> dict:
    """Rank 0 (tests/group_driver.py) and size - 1 members as processes; rank 0's result.
    `stale_ring`: rank 0's flags have the members' ring addresses where they are not.
    `members_extra`: more flags for the members."""
    *ring, port = free_ports(size + 1)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ring)
    members = start_members(model, size, hosts, port, parallel, members_extra)
    rank0_hosts = ",".join([f"127.0.0.1:{ring[0]}"] + [f"127.0.0.1:{p}" for p in free_ports(size - 1)]) \
        if stale_ring else hosts
    args = [sys.executable, str(ROOT / "tests" / "group_driver.py"), "--model", str(model), "--hosts", rank0_hosts,
            "--port", str(port), "--parallel", parallel]
    for k, v in driver.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_env())
        logs = [m.communicate(timeout=60)[0] for m in members]
    finally:
        for m in members:
            if m.poll() is None:
                m.kill()
                m.wait()
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"rank 0 failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n" + "\n".join(
        x[-2000:] for x in logs)
    assert [m.returncode for m in members] == [0] * (size - 1), "members exit 0 when rank 0 stops:\n" + "\n".join(
        x[-2000:] for x in logs)
    return json.loads(line[len("RESULT "):])


_single: dict = {}


def single_run(model: Path, seed: int = 0, speculative: bool = False) -> dict:
    """The same workload on the single-process engine (the reference)."""
    key = (str(model), seed, speculative)
    if key not in _single:
        from group_driver import config, every_draft, run_workload

        from cluster.worker.config import EngineConfig
        from cluster.worker.engine import Engine
        from cluster.worker.spec_decode.policy import SpecPolicy

        limits = SpecPolicy.limits
        if speculative:
            every_draft()  # as rank 0 does
        try:
            engine = Engine.from_pretrained(model, EngineConfig(**config(speculative)))
            engine.warm_up()
            _single[key] = run_workload(engine, seed)
        finally:
            SpecPolicy.limits = limits
    return _single[key]


def assert_same(group: dict, single: dict, prefix_caching: bool = True) -> None:
    assert group["results"].keys() == single["results"].keys()
    for rid, want in single["results"].items():
        got = group["results"][rid]
        assert got["tokens"] == want["tokens"], rid
        assert got["logprobs"] == want["logprobs"], f"{rid}: logprobs differ (bit for bit)"
        assert got["top"] == want["top"], rid
        assert got["finish"] == want["finish"], rid
    # the workload did exercise what it is for
    assert single["preemptions"] > 0 and (single["prefix_hits"] > 0) == prefix_caching
    assert group["preemptions"] == single["preemptions"] and group["prefix_hits"] == single["prefix_hits"]
    assert single["results"]["aborted/0"]["finish"] == "abort"
    assert {f"n3/{i}" for i in range(3)} <= single["results"].keys()


def assert_greedy_matches_mlx_lm(model: Path, single: dict, seed: int = 0) -> None:
    import mlx.core as mx
    from group_driver import requests
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    m, _ = load(str(model))
    for rid, prompt, params, _, abort_at in requests(seed, 500):
        if params.temperature != 0 or abort_at is not None or params.n > 1:
            continue
        want = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), m, max_tokens=params.max_tokens),
                                           range(params.max_tokens))]
        assert single["results"][f"{rid}/0"]["tokens"] == want, rid


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from cluster.modelgen import create_model

    root = tmp_path_factory.mktemp("group-models")
    made = {}

    def get(arch: str, layers: int = 4, files: int = 1) -> Path:
        key = (arch, layers, files)
        if key not in made:
            made[key] = create_model(root / f"{arch}-{layers}-{files}", arch, "tiny", seed=3, layers=layers,
                                     files=files)
        return made[key]

    return get


def test_two_rank_pipeline_is_the_single_process_bit_for_bit(models):
    """qwen3 over 2 processes, weights in 2 files (each rank reads its own), with the
    mirrored-state check on: tokens, logprobs and top logprobs equal the single process's."""
    model = models("qwen3", layers=4, files=2)
    group = run_group(model, 2, check=True)
    single = single_run(model)
    assert_same(group, single)
    assert group["group"]["mismatches"] == 0 and group["group"]["checked_steps"] == group["group"]["steps"]
    layers = sorted(tuple(m["layers"]) for m in group["group"]["members"])
    assert layers == [(0, 2), (2, 4)]
    assert_greedy_matches_mlx_lm(model, single)


def test_rank_0_takes_each_members_ring_address_from_the_member(models):
    """Rank 0's flags have rank 1 where it is not (a Ray bundle that moved since they were
    written): the member says where it listens as it joins, rank 0 hands that ring to every
    rank, and the group forms and is exact. (The mirrored-state check runs as by default.)"""
    model = models("qwen3", layers=4, files=2)
    group = run_group(model, 2, stale_ring=True, timeout=300)
    assert_same(group, single_run(model))
    # the mirrored-state check as it runs by default: sampled, the first step included
    g, every = group["group"], GroupOptions.check_every
    assert every > 1 and g["mismatches"] == 0 and g["checked_steps"] == -(-g["steps"] // every)


@pytest.mark.slow
def test_two_batches_in_flight_give_the_single_process_tokens(models):
    """A 2-stage pipeline with 2 batches in flight (two virtual engines, each half the pool)
    batches requests differently from the single process, so logits may move in the last
    bits (a row's products are summed by how many rows share the step); every token is the
    same and every logprob within 1e-4."""
    model = models("llama", layers=4)
    group = run_group(model, 2, inflight=2, check=True)
    single = single_run(model)
    assert group["results"].keys() == single["results"].keys()
    for rid, want in single["results"].items():
        got = group["results"][rid]
        if rid == "aborted/0":  # aborted after a number of steps, and a step now finishes half the requests
            n = min(len(got["tokens"]), len(want["tokens"]))  # (or, after an arrival, more: pipelined.py)
            assert got["tokens"][:n] == want["tokens"][:n] and got["finish"] == "abort"
            continue
        assert got["tokens"] == want["tokens"], rid
        assert got["finish"] == want["finish"], rid
        assert max((abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])), default=0) < 1e-4, rid
    assert group["group"]["mismatches"] == 0 and group["group"]["checked_steps"] == group["group"]["steps"]


@pytest.mark.slow
def test_pipeline_with_speculative_decoding_is_the_single_process_bit_for_bit(models):
    """n-gram drafts ride in the plan as input tokens; rejected ones roll the block
    tables back (their blocks are freed): the members follow."""
    model = models("llama", layers=4)
    group = run_group(model, 2, speculative=True, check=True)
    single = single_run(model, speculative=True)
    assert_same(group, single)
    assert group["group"]["mismatches"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "gemma3_text", "deepseek_v3", "qwen3_5"])
@pytest.mark.parametrize("size", [2, 3])
def test_pipeline_families_are_the_single_process_bit_for_bit(models, arch, size):
    model = models(arch, layers=4, files=2 if size == 2 else 1)
    group = run_group(model, size, **({"shares": "1,2,1"} if size == 3 else {}))
    single = single_run(model)
    assert_same(group, single, prefix_caching=arch != "qwen3_5")  # a hybrid's prefix is recomputed
    assert_greedy_matches_mlx_lm(model, single)
    spans = sorted(tuple(m["layers"]) for m in group["group"]["members"])
    assert spans[0][0] == 0 and spans[-1][1] == 4 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "phi3", "olmo2", "qwen2_moe", "mixtral"])
def test_more_pipeline_families_are_the_single_process_bit_for_bit(models, arch):
    """The rest of stage.PIPELINE_FAMILIES, at 2 ranks."""
    model = models(arch, layers=4)
    group = run_group(model, 2)
    single = single_run(model)
    assert_same(group, single)
    assert_greedy_matches_mlx_lm(model, single)



# -- rank 0's steps in flight ---------------------------------------------------------------------

class _NoMembers:
    """A side channel's leader with no member to send to: records what would lose the group."""

    def __init__(self):
        from cluster.worker.group.progress import StepProgress

        self.members: dict = {}
        self.lost: list[str] = []
        self.on_lost = self.lose
        self.progress = StepProgress(1)

    def lose(self, reason: str) -> None:
        self.lost.append(reason)

    def broadcast(self, kind: int, payload: bytes = b"") -> None:
        pass

    def close(self) -> None:
        pass


def test_rank_0_finishes_only_the_oldest_step_in_flight(models):
    """The members run the steps in the order they were sent, and their hidden states come
    back in that order. A batch finished out of that order (a step that was sent and then
    never finished here: an error between the two) would be computed from another step's
    hidden state, silently: the group is lost instead. In order, nothing is lost."""
    from cluster.worker.group.config import Topology
    from cluster.worker.group.leader import GroupRunner, GroupState, GroupStats
    from cluster.worker.group.stage import Assignment
    from cluster.worker.model_runner import load_model, text_args
    from cluster.worker.sampling_params import SamplingParams
    from cluster.worker.scheduler import ScheduledSeq, SchedulerOutput
    from cluster.worker.sequence import Sequence

    model, _ = load_model(models("llama", layers=2))
    assignment = Assignment("tensor", 2, (), 2)
    topo = Topology(0, (("127.0.0.1", 1), ("127.0.0.1", 2)), ("127.0.0.1", 1001))
    leader = _NoMembers()
    group = GroupState(leader, None, topo, assignment, GroupOptions(size=2), int(text_args(model).hidden_size),
                       GroupStats(), max_in_flight=2)
    runner = GroupRunner(model, 8, 16, None, stage=assignment.stage(0), group=group)

    def batch(blocks: list[int]):
        seq = Sequence(f"s{blocks[0]}", [5, 6, 7], SamplingParams(max_tokens=1), num_prompt_tokens=3)
        seq.block_table = blocks
        return runner.prepare(SchedulerOutput([ScheduledSeq(seq, 0, 3)]))

    try:
        first, second = batch([0]), batch([1])
        assert runner.forward(first).shape[0] == 1 and runner.forward(second).shape[0] == 1
        assert leader.lost == [] and not group.in_flight
        first, second = batch([2]), batch([3])
        with pytest.raises(ConnectionError):
            runner.forward(second)  # step 4 before step 3
        assert len(leader.lost) == 1 and "not the oldest step in flight" in leader.lost[0]
    finally:
        group.close()


def test_pipelined_engine_generates_as_the_engine_does(models):
    """The pipelined engine's generate is the engine's (it had a copy of its own without
    the n > 1 refusal, and summed every sample's tokens into one list)."""
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.group.pipelined import PipelinedEngine
    from cluster.worker.model_runner import load_model
    from cluster.worker.sampling_params import SamplingParams

    model, tokenizer = load_model(models("llama", layers=2))
    engines = [Engine(model, tokenizer, EngineConfig(num_kv_blocks=16, max_num_seqs=4)) for _ in range(2)]
    pipelined = PipelinedEngine(engines, group=None)
    with pytest.raises(ValueError, match="n=1"):
        pipelined.generate([[5, 6, 7]], SamplingParams(max_tokens=2, n=2, seed=1))


# -- faults, with real processes through the router ------------------------------------------------

@pytest.mark.slow
def test_a_group_that_loses_a_member_is_resumed_elsewhere_and_started_again(models, tmp_path):
    """16 greedy streams through the router on a 2-rank group beside a single worker: kill -9
    of the group's member mid-stream, then SIGSTOP of it. Each time every stream completes
    with the tokens of the run without a fault (the router resumes the group's streams on
    the single worker), no process of the lost group is left after 60 s, and the launcher
    starts the whole group again."""
    import signal

    from cluster.up import LocalCluster, free_port

    model = models("qwen3", layers=4)
    texts = [f"stream {i}: " + " ".join(["orchard", "pear", "apple", "branch"][(i + j) % 4] for j in range(i + 3))
             for i in range(16)]
    max_tokens = 160
    cluster = LocalCluster(model, workers=2, group_size=[2, 1], grpc_address=f"127.0.0.1:{free_port()}",
                           http_address=None, metrics_address=None, worker_port_base=0, worker_metrics_port_base=0,
                           log_dir=tmp_path / "logs", worker_args=["--group-timeout", "10"])
    with cluster:
        baseline = greedy_streams(cluster.router_address, texts, max_tokens)
        assert all(len(t) == max_tokens for t in baseline)
        workers = {w.worker_id: w for w in cluster.healthy_workers()}
        group = workers["worker-0"].load.group
        assert group.size == 2 and group.parallel == "pipeline" and [m.rank for m in group.members] == [0, 1]
        assert not workers["worker-1"].load.HasField("group")
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            old = cluster.group_processes(0)
            member = old[1].proc.pid
            fired = threading.Event()

            def fault(n: int, fired=fired, member=member, sig=sig) -> None:
                if n >= len(texts) * max_tokens // 4 and not fired.is_set():
                    fired.set()
                    os.kill(member, sig)

            got = greedy_streams(cluster.router_address, texts, max_tokens, on_progress=fault)
            assert fired.is_set()
            assert got == baseline, f"streams changed by {signal.Signals(sig).name} of the group's member"
            deadline = time.monotonic() + 60
            while any(c.proc.poll() is None for c in old) and time.monotonic() < deadline:
                cluster.supervise()  # what `orchard up` does every half second
                time.sleep(0.5)
            assert all(c.proc.poll() is not None for c in old), "a process of the lost group is still there"
            assert old[0].proc.returncode == 75, "rank 0 exits 75 when its group is lost"
            restarted = cluster.group_restarts + 1
            deadline = time.monotonic() + 120  # after its backoff (a second or two)
            while cluster.group_restarts < restarted and time.monotonic() < deadline:
                cluster.supervise()
                time.sleep(0.5)
            cluster.wait_ready(timeout=300)  # the group was started again and registered
        assert cluster.group_restarts == 2


def test_a_ray_member_that_cannot_join_ends_its_process():
    """A Ray member actor runs the member on a thread. When the member ends (here: rank 0
    is not there by its join deadline) the actor's process must end with the member's
    exit code, as `orchard worker serve` does, so that Ray starts it again: an actor left
    alive with its member gone would keep its group from ever forming again."""
    port = free_ports(1)[0]
    code = ("import time; from cluster.ray_launcher import GroupMemberActor, RaySpec; "
            "from cluster.worker.group.config import GroupOptions; "
            f"GroupMemberActor(RaySpec(model='unused', join_token='{TOKEN}'), "
            f"GroupOptions(size=2, rank=1, port={port}, join_timeout=1, "
            f"hosts='127.0.0.1:{port + 1},127.0.0.1:{port + 2}')); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
    try:
        assert proc.wait(timeout=90) == 75, proc.communicate()[0][-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- what operators see ------------------------------------------------------------------------------

def test_a_group_is_one_row_with_its_members_and_its_metrics():
    from cluster.proto.orchard.v1 import orchard_pb2 as pb
    from cluster.router.admin import format_workers
    from cluster.worker.group.leader import GroupStats
    from cluster.worker.group.progress import StepProgress
    from cluster.worker.metrics import WorkerMetrics

    group = pb.GroupInfo(size=2, parallel="pipeline", members=[
        pb.GroupMember(rank=0, host="studio-1", memory_bytes=96 << 30, weight_bytes=40 << 30, first_layer=30,
                       last_layer=61),
        pb.GroupMember(rank=1, host="studio-2", memory_bytes=64 << 30, weight_bytes=38 << 30, first_layer=0,
                       last_layer=30, step_seconds=0.042)])
    rows = format_workers([
        pb.WorkerInfo(worker_id="g", address="a:1", model="m", state=pb.WORKER_STATE_HEALTHY,
                      load=pb.LoadReport(kv_blocks_total=10, group=group)),
        pb.WorkerInfo(worker_id="w", address="b:1", model="m", state=pb.WORKER_STATE_HEALTHY,
                      load=pb.LoadReport(kv_blocks_total=10))]).splitlines()
    assert rows[1].startswith("g ") and rows[3].startswith("w ") and len(rows) == 4
    assert "group of 2, pipeline parallel" in rows[2]
    assert "rank 0 studio-1 layers 30-60, weights 40.0 GiB, memory 96.0 GiB" in rows[2]
    assert "rank 1 studio-2 layers 0-29, weights 38.0 GiB, memory 64.0 GiB, 42 ms a step" in rows[2]

    stats = GroupStats(size=2, members=[{"rank": 0, "host": "h", "memory": 5, "weights": 7, "layers": [2, 4]},
                                        {"rank": 1, "host": "h", "memory": 6, "weights": 8, "layers": [0, 2]}],
                       steps=10, plan_bytes=1000, hidden_bytes=4096, collective_seconds=0.5, progress=StepProgress(2))
    stats.progress.sent(1, at=0.0)
    stats.progress.finished(1, 1, at=0.03)
    text = WorkerMetrics("m", "w", lambda: None, group=lambda: stats).render().decode()
    assert 'orchard_group_steps_total{model="m",worker="w"} 10.0' in text
    assert 'orchard_group_bytes_total{channel="hidden",model="m",worker="w"} 4096.0' in text
    assert 'orchard_group_collective_seconds_total{model="m",worker="w"} 0.5' in text
    assert 'orchard_group_member_weight_bytes{model="m",rank="1",worker="w"} 8.0' in text
    assert 'orchard_group_rank_step_seconds_bucket{le="0.05",model="m",rank="1",worker="w"} 1.0' in text
    assert 'orchard_group_rank_step_seconds_count{model="m",rank="1",worker="w"} 1.0' in text
    assert "orchard_group" not in WorkerMetrics("m", "w", lambda: None).render().decode()


@pytest.mark.slow
def test_mirrored_state_check_over_500_random_steps(models):
    """Every step rank 1 checksums its block tables and slot mapping (rebuilt from the
    plan's changes) against rank 0's: 0 mismatches over 500 steps of prefill only, decode
    only, mixed, idle, aborts and preemptions, and no hang."""
    model = models("qwen3", layers=4)
    out = run_group(model, 2, check=True, random_steps=500, seed=5)
    g = out["group"]
    assert out["steps"] >= 500 and g["steps"] >= 400
    assert g["mismatches"] == 0 and g["checked_steps"] == g["steps"]
    assert out["preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert all(v > 0 for v in out["phases"].values())


# -- tensor parallel ---------------------------------------------------------------------------------

def assert_close_where_decided(group: dict, single: dict) -> dict:
    """Tensor parallel sums in another order: each greedy token equals the single
    process's wherever that one's top-2 logprob margin exceeds 1e-3 (a closer call may go
    either way, and the streams part there); logprobs within 1e-4. Returns the largest
    logprob difference and how many tokens were compared."""
    worst, compared = 0.0, 0
    for rid, want in single["results"].items():
        if not rid.startswith(("r", "prefix")):  # the greedy requests (sampled ones may part at any draw)
            continue
        got = group["results"][rid]
        for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"])):
            top = want["top"][i]
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
            if margin > 1e-3:
                assert a == b, f"{rid}: token {i} differs where the margin is {margin:.4f}"
            if a != b:
                break
            worst = max(worst, abs(got["logprobs"][i] - want["logprobs"][i]))
            compared += 1
    assert worst < 1e-4, f"logprobs differ by {worst:.2e}"
    return {"worst": worst, "compared": compared}


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("deepseek_v3", marks=pytest.mark.slow),
                                  pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                  pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_tensor_parallel_matches_the_single_process_where_decided(models, arch):
    model = models(arch, layers=2)
    group = run_group(model, 2, parallel="tensor")
    single = single_run(model)
    stats = assert_close_where_decided(group, single)
    assert stats["compared"] > 50
    assert all(m["layers"] == [0, 2] for m in group["group"]["members"])  # every rank holds every layer ...
    weights = [m["weights"] for m in group["group"]["members"]]
    assert min(weights) > 0


def test_tensor_parallel_refuses_a_family_without_shard(models):
    model = models("gemma3_text", layers=2)
    *ring, port = free_ports(3)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ring)
    members = start_members(model, 2, hosts, port, "tensor")
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "group_driver.py"), "--model", str(model),
                               "--hosts", hosts, "--port", str(port), "--parallel", "tensor"],
                              capture_output=True, text=True, timeout=300, env=_env())
    finally:
        for m in members:
            try:
                m.wait(60)
            except subprocess.TimeoutExpired:
                m.kill()
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "'gemma3_text' cannot be served tensor parallel: its mlx-lm class has no shard()" in proc.stderr


def test_jaccl_needs_what_mlx_launch_sets(monkeypatch):
    from cluster.worker.group.config import Topology
    from cluster.worker.group.leader import init_ring

    monkeypatch.delenv("MLX_IBV_DEVICES", raising=False)
    monkeypatch.delenv("MLX_JACCL_COORDINATOR", raising=False)
    topo = Topology(0, (("10.0.0.1", 1), ("10.0.0.2", 1)), ("10.0.0.1", 1001))
    with pytest.raises(ValueError, match="MLX_IBV_DEVICES and MLX_JACCL_COORDINATOR"):
        init_ring(topo, "jaccl")


def test_a_step_that_does_not_finish_by_its_deadline_loses_the_group():
    """A wedged member still answers heartbeats; its step never finishes: the watchdog's
    deadline is what ends it (a blocked collective cannot be cancelled)."""
    from cluster.worker.group.channel import Watchdog

    lost = []
    dog = Watchdog(on_lost=lost.append)
    dog.arm(0.5, "group step 7")
    dog.disarm()
    time.sleep(1.0)
    assert lost == [], "a step that finished in time is not a loss"
    dog.arm(0.5, "group step 8")
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == ["group step 8 did not finish in time"]


def test_a_group_refuses_a_model_that_serves_embeddings_or_scores(embedding_model_dir, reranker_model_dir, tmp_path):
    """A group's steps serve generation only: an embedding model or a reranker (by its
    directory, or --task / --embeddings) is refused before the group starts, not served
    as a generation model (an embedding model would have answered chats)."""
    from cluster.worker.config import EngineConfig
    from cluster.worker.group.config import GroupOptions
    from cluster.worker.group.leader import load_group_engine

    opts = GroupOptions(size=2, hosts="127.0.0.1:7000,127.0.0.1:7001", rank=0)
    for path, config, says in ((embedding_model_dir, EngineConfig(), "serves embed"),
                               (reranker_model_dir, EngineConfig(), "serves score"),
                               (tmp_path, EngineConfig(embeddings=True), "serves generate, embed")):
        with pytest.raises(ValueError, match=f"{says}: a worker group serves generation only"):
            load_group_engine(str(path), config, opts, "token")
