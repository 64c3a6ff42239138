"""Exit codes (cluster/exit_codes.py): 75 transient, 78 permanent, on a worker, a group's
rank 0 and its members alike; and the ring hostfiles a group's ranks write are removed."""

from __future__ import annotations

import errno
import glob
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from cluster.exit_codes import EXIT_PERMANENT, EXIT_TRANSIENT, Backoff, exit_code
from cluster.up import free_ports
from cluster.worker.group import wire
from cluster.worker.group.channel import Leader, Member
from cluster.worker.group.config import GroupOptions

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token"


def test_the_table():
    assert exit_code(ValueError("--group-size must be >= 1")) == EXIT_PERMANENT
    assert exit_code(FileNotFoundError("model.safetensors")) == EXIT_PERMANENT
    assert exit_code(wire.Refused("the join token does not match", permanent=True)) == EXIT_PERMANENT
    assert exit_code(wire.Refused("rank 1 has already joined")) == EXIT_TRANSIENT
    assert exit_code(wire.ProtocolError("the connection closed")) == EXIT_TRANSIENT
    assert exit_code(TimeoutError("group members [1] did not join in time")) == EXIT_TRANSIENT
    assert exit_code(OSError(errno.EADDRINUSE, "Address already in use")) == EXIT_TRANSIENT
    assert exit_code(RuntimeError("[load] cannot read weights")) == EXIT_PERMANENT  # a model that does not load
    assert exit_code(RuntimeError("?"), default=EXIT_TRANSIENT) == EXIT_TRANSIENT
    b = Backoff(first=1, cap=60, reset_after=300)
    assert [b.next_delay(0.1) for _ in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert b.next_delay(300) == 1


def _admitting(size=2):
    leader = Leader(("127.0.0.1", 0), size, TOKEN, 5.0, on_lost=lambda reason: None)
    t = threading.Thread(target=leader.admit, args=(time.monotonic() + 30,), daemon=True)
    t.start()
    return leader, t


def test_a_member_refused_for_a_wrong_join_token_exits_78():
    """A wrong join token is refused by rank 0, and starting the member again will not
    change that: 78, not 75 (it was 75: launchers retried it for ever)."""
    from cluster.worker.group.member import run_member

    leader, _ = _admitting()
    before = _group_threads()
    try:
        opts = GroupOptions(size=2, rank=1, port=leader.address[1], join_timeout=20,
                            hosts=f"127.0.0.1:{free_ports(1)[0]},127.0.0.1:{free_ports(1)[0]}")
        assert run_member("unused", opts, "not-the-token") == EXIT_PERMANENT
        # the start's watchdog is stopped with it: armed for the join, it would have ended this
        # process (pytest's, a Ray actor's) with exit 75 a minute later
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _group_threads() - before:
            time.sleep(0.05)
        assert not _group_threads() - before
    finally:
        leader.close()


def _group_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in ("orchard-group-watchdog", "orchard-group-watch",
                                                           "orchard-group-reader")}


def test_a_member_whose_model_is_not_rank_0s_exits_78_and_rank_0_learns_it_is_permanent(tmp_path):
    """A config digest mismatch: the member exits 78 and tells rank 0 so (the ERROR's
    PERMANENT flag), so rank 0 exits 78 too instead of being restarted to reload."""
    from cluster.worker.group.member import run_member

    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2}')
    leader, admitted = _admitting()
    code = []
    opts = GroupOptions(size=2, rank=1, port=leader.address[1], join_timeout=20,
                        hosts=f"127.0.0.1:{free_ports(1)[0]},127.0.0.1:{free_ports(1)[0]}")
    member = threading.Thread(target=lambda: code.append(run_member(str(tmp_path), opts, TOKEN)), daemon=True)
    member.start()
    try:
        admitted.join(30)
        assert set(leader.members) == {1}
        leader.broadcast(wire.ASSIGN, wire.dumps({"assignment": {}, "config": "0" * 64, "engine": {}}))
        with pytest.raises(wire.Refused, match="is not rank 0's") as refused:
            leader.gather(wire.LOADED, time.monotonic() + 30)
        assert refused.value.permanent and exit_code(refused.value) == EXIT_PERMANENT
        member.join(30)
        assert code == [EXIT_PERMANENT]
    finally:
        leader.close()


def test_a_member_that_fails_for_a_transient_reason_tells_rank_0_so():
    leader, admitted = _admitting()
    member = Member(leader.address, 1, 2, TOKEN, 5.0, on_lost=lambda reason: None)
    try:
        member.join(time.monotonic() + 30)
        admitted.join(30)
        member.send_error("rank 1: ConnectionError: MLX's ring group did not form")
        with pytest.raises(wire.Refused) as refused:
            leader.gather(wire.LOADED, time.monotonic() + 30)
        assert not refused.value.permanent and exit_code(refused.value) == EXIT_TRANSIENT
    finally:
        member.close()
        leader.close()


def _env():
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", PYTHONUNBUFFERED="1",
                ORCHARD_JOIN_TOKEN=TOKEN)


def test_rank_0_whose_members_are_late_exits_75(tiny_model_dir):
    """Members not there by the join deadline is transient (it was reported as 78, so a
    launcher honouring 78 would never have started the group again)."""
    *ring, port = free_ports(3)
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(tiny_model_dir), "--group-size", "2",
         "--group-rank", "0", "--group-hosts", ",".join(f"127.0.0.1:{p}" for p in ring), "--group-port", str(port),
         "--group-join-timeout", "2", "--grpc", "127.0.0.1:0", "--metrics", "off"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_env(), timeout=240)
    assert proc.returncode == EXIT_TRANSIENT, proc.stderr[-3000:]
    assert "did not join" in proc.stderr and "exit 75: transient" in proc.stderr


def test_bad_flags_of_a_supervised_command_exit_78(capsys):
    """A command line `orchard worker serve` cannot parse will not parse next time either."""
    from cluster.cli import main

    assert main(["worker", "serve", "--max-num-seqs", "many"]) == EXIT_PERMANENT
    assert "--max-num-seqs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a one-off command keeps argparse's usage error
        main(["generate"])
    assert e.value.code == 2


def _ring_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "orchard-ring-*.json")))


def test_ring_hostfiles_are_removed_once_mlx_has_read_them(monkeypatch):
    """Every rank wrote /tmp/orchard-ring-*.json and never removed it: they piled up with
    each group start. Now MLX reads it in init and it is gone when init returns or fails."""
    import mlx.core as mx

    from cluster.worker.group.config import Topology
    from cluster.worker.group.leader import init_ring

    topo = Topology(1, (("127.0.0.1", 1), ("127.0.0.1", 2)), ("127.0.0.1", 1001))
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    seen = []

    class Group:
        def size(self):
            return 2

        def rank(self):
            return 1

    def init(backend, strict):
        path = os.environ["MLX_HOSTFILE"]
        seen.append((path, Path(path).read_text()))
        return Group()

    before = _ring_files()
    monkeypatch.setattr(mx.distributed, "init", init)
    assert isinstance(init_ring(topo), Group)
    assert seen[0][1] == topo.ring_hostfile() and Path(seen[0][0]).name.startswith(f"orchard-ring-{os.getpid()}-")
    assert not Path(seen[0][0]).exists() and _ring_files() <= before and "MLX_HOSTFILE" not in os.environ

    def fail(backend, strict):  # a peer that is not there: transient, and nothing left behind
        seen.append((os.environ["MLX_HOSTFILE"], ""))
        raise RuntimeError("[ring] Couldn't connect (error: 111)")

    monkeypatch.setattr(mx.distributed, "init", fail)
    with pytest.raises(ConnectionError, match="did not form") as e:
        init_ring(topo)
    assert exit_code(e.value) == EXIT_TRANSIENT
    assert not Path(seen[1][0]).exists() and _ring_files() <= before


def test_a_ring_hostfile_left_by_a_killed_rank_is_removed_by_the_next_start(tmp_path):
    """A rank killed while MLX's init waits for its peers leaves its hostfile: the next
    rank to write one removes it (the writer's process id is in the name), and only that:
    not a live process's, not another user's, not a file of another name."""
    from cluster.worker.group.leader import RING_FILE_PREFIX, remove_stale_ring_files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f"{RING_FILE_PREFIX}{dead.pid}-abc123.json"
        kept = [tmp_path / f"{RING_FILE_PREFIX}{live.pid}-abc123.json", tmp_path / f"{RING_FILE_PREFIX}abc123.json",
                tmp_path / "other.json"]
        for path in [stale, *kept]:
            path.write_text("[]")
        assert remove_stale_ring_files(str(tmp_path)) == [stale]
        assert not stale.exists() and all(p.exists() for p in kept)
    finally:
        live.kill()
        live.wait()
