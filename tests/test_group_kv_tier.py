"""The disk KV tier in a worker group (cluster/worker/group/kv.py): a 2-rank pipeline group,
each rank with a directory of its own, restarted, serves a prompt's prefix from disk with
the tokens and logprobs of the single process serving it from memory, bit for bit; a
member missing or failing a block's file has the group recompute it, never serve it
wrong; pipelined virtual engines share one store a process; and the wire's KV messages."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_group import models, run_group  # noqa: F401  (models: the fixture)

from cluster.kv.hashing import block_hashes
from cluster.worker.group import wire


@pytest.fixture(scope="module")
def model(models):  # noqa: F811
    return models("qwen3", layers=4, files=2)


_single: dict = {}


def single(model: Path, phase: str) -> dict:
    """The single process on the same workload, the prefix from memory: `first` then
    `second` ("warm" then "again" on one engine), or `short` then `second` ("short")."""
    if phase not in _single:
        from group_driver import KV_CONFIG, run_kv

        from cluster.worker.config import EngineConfig
        from cluster.worker.engine import Engine

        engine = Engine.from_pretrained(model, EngineConfig(**KV_CONFIG))
        engine.warm_up()
        if phase == "again":
            run_kv(engine, "warm")
        _single[phase] = run_kv(engine, phase)
    return _single[phase]


def group(model: Path, dirs: list[Path], phase: str, inflight: int = 1) -> dict:
    return run_group(model, 2, kv_disk_dir=str(dirs[0]), kv_phase=phase, inflight=inflight, timeout=300,
                     members_extra=("--kv-disk-dir", str(dirs[1])))


@pytest.fixture(scope="module")
def warmed(model, tmp_path_factory):
    """Each rank's directory after a group served `first` (its blocks written through)."""
    root = tmp_path_factory.mktemp("group-kv-warm")
    dirs = [root / "rank0", root / "rank1"]
    group(model, dirs, "warm")
    return dirs


def copy(dirs: list[Path], to: Path) -> list[Path]:
    return [Path(shutil.copytree(d, to / d.name)) for d in dirs]


def block_file(disk_dir: Path, index: int) -> Path:
    """The file of `second`'s block `index` in a rank's store."""
    from group_driver import kv_prompts

    h = block_hashes(kv_prompts()["second"], 16)[index].hex()
    found = list(disk_dir.glob(f"*/blocks/*/{h}.kvb"))
    assert len(found) == 1, f"block {index}'s file in {disk_dir}: {found}"
    return found[0]


def same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == want["logprobs"], "logprobs differ (bit for bit)"
    assert got["top"] == want["top"]


def test_a_restarted_group_serves_the_prefix_from_disk_as_the_single_process_from_memory(model, warmed, tmp_path):
    dirs = copy(warmed, tmp_path)
    for d in dirs:  # each rank's own store: its layers' identity
        assert len(list(d.glob("*/blocks/*/*.kvb"))) >= 5
    assert {p.parent.name for p in dirs[0].glob("*/identity.json")} != {p.parent.name for p in
                                                                       dirs[1].glob("*/identity.json")}
    got, want = group(model, dirs, "again"), single(model, "again")
    assert want["second"]["cached"] == 80 and want["second"]["disk"] == 0  # the reference: from memory
    assert got["second"]["cached"] == 80 and got["second"]["disk"] == 80, "the prefix came from disk"
    same(got["second"], want["second"])
    same(got["seeded"], want["seeded"])
    assert got["hit_tokens"] == 80


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["missing", "corrupt"])
def test_a_member_missing_or_failing_a_block_has_the_group_recompute_it(model, warmed, tmp_path, fault):
    """The member's file of the prefix's last block is gone, or a payload byte flipped: the
    group installs the 4 blocks every rank read and computes the rest, as the single
    process does with a 64-token prefix in memory."""
    dirs = copy(warmed, tmp_path)
    path = block_file(dirs[1], 4)
    if fault == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    block_file(dirs[0], 4)  # rank 0 still holds it
    got, want = group(model, dirs, "again"), single(model, "short")
    assert want["second"]["cached"] == 64
    assert got["second"]["cached"] == 64 and got["second"]["disk"] == 64
    same(got["second"], want["second"])


@pytest.mark.slow
def test_pipelined_virtual_engines_share_one_store(model, tmp_path):
    """Two batches in flight (two virtual engines, the prompts in the second one's share of
    the pool): one store a rank, and the prefix from disk after a restart is exact."""
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    group(model, dirs, "warm", inflight=2)
    assert len(list(dirs[0].glob("*/identity.json"))) == 1
    got, want = group(model, dirs, "again", inflight=2), single(model, "again")
    assert got["second"]["disk"] == 80
    same(got["second"], want["second"])
    same(got["seeded"], want["seeded"])


# -- the wire ------------------------------------------------------------------------------------------

def test_kv_messages_round_trip_and_refuse_malformed_ones():
    h = [bytes([i]) * 15 + b"\0" for i in range(1, 4)]  # a trailing zero byte survives
    blocks = [(3, h[0], None), (7, h[1], h[0])]
    assert wire.read_kv_save(wire.kv_save(blocks), 8) == blocks
    assert wire.read_kv_read(wire.kv_read(9, [(h[0], None), (h[2], h[0])])) == (9, [(h[0], None), (h[2], h[0])])
    assert wire.read_kv_apply(wire.kv_apply(9, [(0, 5), (1, 2)]), 8) == (9, [(0, 5), (1, 2)])
    assert wire.read_kv_read_done(wire.KV_READ_DONE_MSG.pack(9, 2)) == (9, 2)
    with pytest.raises(wire.ProtocolError, match="outside the pool of 4 blocks"):
        wire.read_kv_save(wire.kv_save(blocks), 4)
    with pytest.raises(wire.ProtocolError, match="outside the pool"):
        wire.read_kv_apply(wire.kv_apply(9, [(0, 8)]), 8)
    with pytest.raises(wire.ProtocolError, match="negative index"):
        wire.read_kv_apply(wire.kv_apply(9, [(-1, 1)]), 8)
    with pytest.raises(wire.ProtocolError, match="bytes for 2 blocks"):
        wire.read_kv_read(wire.kv_read(9, [(h[0], None), (h[1], None)])[:-1])
    with pytest.raises(wire.ProtocolError, match="at most 65536"):
        wire.read_kv_read(wire.KV_TICKET.pack(1, wire.MAX_KV_BLOCKS + 1))
    with pytest.raises(wire.ProtocolError, match="shorter than its header"):
        wire.read_kv_save(b"\1", 8)
    with pytest.raises(wire.ProtocolError, match="KV_READ_DONE message of 3 bytes"):
        wire.read_kv_read_done(b"abc")


def test_orchard_up_gives_each_rank_of_a_group_its_own_disk_tier(monkeypatch, capsys):
    import argparse
    from dataclasses import replace

    from cluster.config import add_flags, from_args
    from cluster.up import LocalCluster, UpConfig, local_cluster, run_up

    parser = argparse.ArgumentParser()
    add_flags(parser, UpConfig)
    config = from_args(UpConfig, parser.parse_args(["--kv-disk-dir", "/kv", "--group-size", "2"]))
    spawned = {}
    monkeypatch.setattr(LocalCluster, "_spawn", lambda self, name, args, cpus, env: spawned.setdefault(name, args))
    local_cluster(replace(config, log_dir="/tmp/unused"), "/m").start_worker(0)
    dirs = {name: args[args.index("--kv-disk-dir") + 1] for name, args in spawned.items()}
    assert dirs == {"worker-0": "/kv/worker-0", "worker-0-rank-1": "/kv/worker-0-rank-1"}

    assert run_up(replace(config, parallel="tensor")) == 2  # refused before anything starts
    assert "does not run in tensor-parallel worker groups yet" in capsys.readouterr().err
