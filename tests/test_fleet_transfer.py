"""Copying a model's files from one node agent to another (cluster/fleet/transfer.py, the
agent's FetchModel / ListModelFiles / ReadModelFile / DescribeModel) and the disk budget
(cluster/fleet/disk.py), with node agents in process over real gRPC on 127.0.0.1: a copy
gives the same files (sha256 checked) and, for a hub source, huggingface_hub's own cache
layout; an interrupted copy resumes from its partial file; a corrupted chunk is fetched
again; a peer that dies mid-copy gives way to the next; several files stream at once under
the bandwidth bound; ReadModelFile refuses paths out of the model and wrong tokens before
reading; the disk budget deletes the least recently used fetched model, never a protected
or plain one, and says the numbers when it cannot make room; the node's report shows a
copy while it runs and its totals after."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import grpc
import pytest

from cluster.fleet import FleetError, disk, transfer
from cluster.net import CHANNEL_OPTIONS
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.security import ClientSecurity, channel
from cluster.up import free_port
from tests.conftest import run
from tests.fake_hub import FakeHub

TOKEN = "join-secret"
MiB = 1 << 20
REPO = "acme/tiny"
SOURCE = f"hf:{REPO}@main"


# -- models on disk ---------------------------------------------------------------------------
def random_bytes(n: int, seed: int) -> bytes:
    out, block = bytearray(), hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


def plain_model(models_dir: Path, name: str, sizes: dict[str, int], seed: int = 0) -> Path:
    """A directory under --models-dir with a config.json and files of `sizes` bytes."""
    root = models_dir / name
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "made-up"}')
    for i, (path, size) in enumerate(sizes.items()):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(random_bytes(size, seed * 100 + i))
    return root


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_snapshot(cache: Path, repo: str, files: dict[str, bytes], commit: str = "a" * 40,
                 revision: str = "main") -> Path:
    """A snapshot in huggingface_hub's cache layout, as a pull writes it: weights (LFS)
    named by sha256, the rest by git blob sha1, `refs/REV` holding the commit."""
    root = cache / disk.repo_folder(repo)
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        lfs = path.endswith(".safetensors")
        blob = root / "blobs" / (hashlib.sha256(data).hexdigest() if lfs else git_sha1(data))
        blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return snapshot


def hub_files(seed: int = 0, weights: int = 3 * MiB) -> dict[str, bytes]:
    return {"config.json": b'{"model_type": "made-up"}', "tokenizer.json": random_bytes(3000, seed + 1),
            "model-00001-of-00002.safetensors": random_bytes(weights, seed + 2),
            "model-00002-of-00002.safetensors": random_bytes(weights // 2, seed + 3),
            "nested/extra.txt": random_bytes(100, seed + 4)}


def size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def tree(root: Path) -> dict[str, str]:
    """Each file's sha256 by its relative path (symlinks followed)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# -- agents in process ----------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def agents(tmp_path: Path, *names: str, **settings):
    """Node agents in this process serving Node on 127.0.0.1 (their router is nowhere: they
    keep trying to register, which these tests do not need)."""
    from cluster.fleet.agent import NodeAgent
    from cluster.fleet.node_config import NodeConfig

    router = f"127.0.0.1:{free_port()}"
    started = []
    try:
        for name in names:
            config = NodeConfig(router=router, grpc_address="127.0.0.1:0", node_id=name, memory_budget=1 << 30,
                                models_dir=str(tmp_path / name / "models"), state_dir=str(tmp_path / name / "state"),
                                join_token=TOKEN, heartbeat_interval=5.0, **settings.get(name, {}))
            (tmp_path / name / "models").mkdir(parents=True, exist_ok=True)
            agent = NodeAgent(config)
            await agent.start()
            started.append(agent)
        yield started
    finally:
        for agent in started:
            await agent.stop()


def stall_after(agent, limit: int) -> None:
    """The agent's ReadModelFile sends `limit` bytes in all, then nothing more (a peer that
    hangs, then dies when the test stops it): nothing past the cut is in flight."""
    serve = agent.read_model_file

    async def stalling(request):
        async for chunk in serve(request):
            room = limit - agent.bytes_served + len(chunk)
            if room <= 0:
                await asyncio.Event().wait()
            yield chunk[:room]
            if room < len(chunk):
                await asyncio.Event().wait()

    agent.read_model_file = stalling


def peer(agent) -> pb.NodePeer:
    return pb.NodePeer(node_id=agent.node_id, address=agent.address)


def stub_of(agent, token: str = TOKEN):
    ch = channel(agent.address, ClientSecurity(api_key=token), options=CHANNEL_OPTIONS)
    return ch, pb_grpc.NodeStub(ch)


async def fetch(agent, source: str, *peers, protect=(), on_progress=None) -> pb.FetchProgress:
    """FetchModel over gRPC; its last message."""
    ch, stub = stub_of(agent)
    async with ch:
        last = None
        async for message in stub.FetchModel(pb.FetchModelRequest(source=source, peers=[peer(p) for p in peers],
                                                                  protect=list(protect))):
            last = message
            if on_progress is not None:
                on_progress(message)
        return last


async def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.01)
    raise TimeoutError(f"{what} not within {timeout} s")


# -- copies -----------------------------------------------------------------------------------------
def test_a_plain_model_copied_from_a_peer_has_the_same_files(tmp_path):
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            src = plain_model(a.models_dir, "dense", {"model.safetensors": 2 * MiB + 5, "sub/x.bin": 10})
            (a.models_dir / "small.gguf").write_bytes(random_bytes(MiB + 3, 9))
            await a.refresh_models()
            last = await fetch(b, "dense", a)
            assert last.done and getattr(last, "from") == "mac-1" and last.path == str(b.models_dir / "dense")
            assert tree(b.models_dir / "dense") == tree(src)
            gguf = await fetch(b, "small", a)  # a source NAME held as NAME.gguf
            assert gguf.path == str(b.models_dir / "small.gguf")
            assert (b.models_dir / "small.gguf").read_bytes() == (a.models_dir / "small.gguf").read_bytes()
            assert not list(b.models_dir.glob(".*.part"))  # the partial names are gone
            again = await fetch(b, "dense", a)  # here now: nothing copied
            assert getattr(again, "from") == "disk" and again.done
            assert {m.name for m in b.report().models} >= {"dense", "small.gguf"}

    run(go())


def test_a_plain_model_is_copied_whole_even_for_a_pipeline_rank(tmp_path):
    """A plain directory holding one rank's shards would look whole to the node's scan (and
    a later whole worker would fail on the missing shards): only hub snapshots, checked file
    by file, are fetched in part."""
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            src = plain_model(a.models_dir, "sharded", {"model-00001-of-00002.safetensors": MiB,
                                                        "model-00002-of-00002.safetensors": MiB + 7})
            (src / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
            (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
                "model.layers.0.mlp.weight": "model-00001-of-00002.safetensors",
                "model.layers.1.mlp.weight": "model-00002-of-00002.safetensors"}}))
            await a.refresh_models()
            ch, stub = stub_of(b)
            async with ch:
                last = None
                async for last in stub.FetchModel(pb.FetchModelRequest(source="sharded", peers=[peer(a)],
                                                                       first_layer=1, last_layer=1)):
                    pass
            assert last.done and getattr(last, "from") == "mac-1"
            assert tree(b.models_dir / "sharded") == tree(src)

    run(go())


def test_a_copy_onto_a_directory_that_is_not_a_model_says_so_before_copying(tmp_path):
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            plain_model(a.models_dir, "dense", {"model.safetensors": MiB})
            (b.models_dir / "dense").mkdir()
            (b.models_dir / "dense" / "notes.txt").write_text("half of a model copied by hand")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetch(b, "dense", a)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert str(b.models_dir / "dense") in e.value.details() and "move it away" in e.value.details()
            assert a.bytes_served == 0

    run(go())


def test_a_full_disk_mid_copy_is_resource_exhausted_naming_the_node(tmp_path, monkeypatch):
    from cluster.fleet import transfer

    def full(out, digest, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            plain_model(a.models_dir, "dense", {"model.safetensors": MiB})
            monkeypatch.setattr(transfer, "_append", full)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetch(b, "dense", a)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "mac-2" in e.value.details() and "No space left" in e.value.details()

    run(go())


def test_a_hub_model_copied_from_a_peer_is_in_huggingface_hubs_layout(tmp_path, monkeypatch):
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            files = hub_files()
            src = hub_snapshot(a.hub_cache, REPO, files)
            last = await fetch(b, f"hf:{REPO}", a)  # `@main` when absent
            snapshot = b.hub_cache / disk.repo_folder(REPO) / "snapshots" / ("a" * 40)
            assert last.done and last.path == str(snapshot)
            assert tree(snapshot) == tree(src)
            root = b.hub_cache / disk.repo_folder(REPO)
            assert (root / "refs" / "main").read_text() == "a" * 40
            for path, data in files.items():  # blobs named as the hub's etags, linked from the snapshot
                link = snapshot / path
                etag = hashlib.sha256(data).hexdigest() if path.endswith(".safetensors") else git_sha1(data)
                assert link.is_symlink() and not os.path.isabs(os.readlink(link))
                assert link.resolve() == (root / "blobs" / etag).resolve()
            assert not list((root / "blobs").glob("*.incomplete"))
            return root, snapshot

    root, snapshot = run(go())
    # huggingface_hub reads the copy as if it had pulled it
    from huggingface_hub import scan_cache_dir, snapshot_download

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = scan_cache_dir(root.parent)
    assert [r.repo_id for r in info.repos] == [REPO] and not info.warnings
    assert {r.commit_hash for r in next(iter(info.repos)).revisions} == {"a" * 40}
    assert Path(snapshot_download(REPO, cache_dir=root.parent)) == snapshot


def test_files_of_one_blob_are_copied_once_and_whole(tmp_path):
    """Two files with the same bytes share a blob: one stream writes it, the other links it
    (two streams appending to one partial blob would leave it twice as long)."""
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            files = {**hub_files(), "copy-of-1.safetensors": hub_files()["model-00001-of-00002.safetensors"]}
            src = hub_snapshot(a.hub_cache, REPO, files)
            last = await fetch(b, SOURCE, a)
            assert last.done and tree(Path(last.path)) == tree(src)
            assert a.bytes_served == size(src) - len(files["copy-of-1.safetensors"])

    run(go())


@pytest.mark.parametrize("path", ["config.json", "model-00001-of-00002.safetensors"])
def test_a_blob_named_other_than_its_bytes_is_refused(tmp_path, monkeypatch, path):
    """A peer's listing names each blob; the receiver writes a blob only under its bytes' own
    hash (git sha1 or sha256), else a later snapshot sharing that name would read wrong bytes."""
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            hub_snapshot(a.hub_cache, REPO, hub_files())
            listed = a.list_model_files

            async def misnamed(request):
                listing = await listed(request)
                for f in listing.files:
                    if f.path == path:
                        f.blob = ("0" * len(f.blob))
                return listing

            a.list_model_files = misnamed
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub to fall back on
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetch(b, SOURCE, a)
            assert "not its" in e.value.details()
            blobs = (b.hub_cache / disk.repo_folder(REPO) / "blobs").glob("*")
            # (a file the other streams were copying when this one failed stays partial, to resume)
            for blob in (p for p in blobs if p.suffix != ".incomplete"):
                data = blob.read_bytes()
                assert blob.name in (hashlib.sha256(data).hexdigest(), git_sha1(data)), blob.name

    run(go())


def test_a_peer_listing_too_few_files_is_not_taken_for_the_model(tmp_path, monkeypatch):
    """A copy is done only when the snapshot holds the model (the index's shards too), not when
    every file the peer listed arrived."""
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            files = {**hub_files(), "model.safetensors.index.json": json.dumps({"weight_map": {
                "model.layers.0.mlp.weight": "model-00001-of-00002.safetensors",
                "model.layers.1.mlp.weight": "model-00002-of-00002.safetensors"}}).encode()}
            hub_snapshot(a.hub_cache, REPO, files)
            listed = a.list_model_files

            async def short(request):
                listing = await listed(request)
                del listing.files[[f.path for f in listing.files].index("model-00002-of-00002.safetensors")]
                return listing

            a.list_model_files = short
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub to fall back on
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetch(b, SOURCE, a)
            assert "model-00002-of-00002.safetensors" in e.value.details()

    run(go())


def test_a_hub_model_of_a_branch_with_a_slash_is_copied(tmp_path):
    from cluster.fleet import hub

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            hub_snapshot(a.hub_cache, REPO, hub_files(), revision="release/v1")
            last = await fetch(b, f"hf:{REPO}@release/v1", a)
            assert last.done and hub.local_snapshot(f"hf:{REPO}@release/v1", b.hub_cache) == Path(last.path)

    run(go())


def test_an_interrupted_copy_resumes_from_its_partial_files(tmp_path):
    """The peer stops mid-copy; the next fetch (the peer back on another port) resumes: the
    peer serves the model about once in all, not once and a half."""
    total = 8 * MiB

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"copy_bandwidth": 2 * MiB}}) as (a, b):
            plain_model(a.models_dir, "dense", {"model-1.safetensors": total // 2, "model-2.safetensors": total // 2})
            stall_after(a, total // 2)
            fetching = asyncio.create_task(fetch(b, "dense", a))
            await wait_until(lambda: b.fetches.get("dense") and b.fetches["dense"].bytes_done >= total // 2, 60,
                             "half copied")
            await a.endpoints.stop(grace=None)  # the peer goes away mid-file
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetching
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "mac-1" in e.value.details()
            partial = b.models_dir / ".dense.part"
            kept = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
            assert kept == total // 2
            served_before = a.bytes_served
            async with agents(tmp_path / "again", "mac-1") as (a2,):
                os.symlink(a.models_dir / "dense", a2.models_dir / "dense")
                last = await fetch(b, "dense", a2)
                assert last.done and tree(b.models_dir / "dense") == tree(a.models_dir / "dense")
                assert a2.bytes_served == size(a.models_dir / "dense") - kept  # only what was missing
                assert served_before + a2.bytes_served < 1.5 * total

    run(go())


def test_a_corrupted_chunk_is_detected_and_the_file_fetched_again(tmp_path):
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            src = plain_model(a.models_dir, "dense", {"model.safetensors": 3 * MiB, "small.json": 50})
            serve = a.read_model_file
            corrupted = []

            async def corrupt_once(request):
                async for chunk in serve(request):
                    if not corrupted and request.path == "model.safetensors":
                        corrupted.append(request.path)
                        chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                    yield chunk

            a.read_model_file = corrupt_once
            last = await fetch(b, "dense", a)
            assert corrupted and last.done and tree(b.models_dir / "dense") == tree(src)
            assert a.bytes_served >= 2 * 3 * MiB  # the bad file came twice

            # a partial file corrupted on the receiver's disk is found out the same way
            hub_snapshot(a.hub_cache, REPO, hub_files(seed=5))
            big = hub_files(seed=5)["model-00001-of-00002.safetensors"]
            blobs = b.hub_cache / disk.repo_folder(REPO) / "blobs"
            blobs.mkdir(parents=True)
            (blobs / (hashlib.sha256(big).hexdigest() + ".incomplete")).write_bytes(b"\0" * (len(big) // 2))
            last = await fetch(b, SOURCE, a)
            assert last.done and tree(Path(last.path)) == tree(a.hub_cache / disk.repo_folder(REPO) / "snapshots" /
                                                               ("a" * 40))

    run(go())


def test_a_peer_that_dies_mid_copy_gives_way_to_the_next(tmp_path):
    total = 6 * MiB

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", "mac-3", **{"mac-3": {"copy_bandwidth": 2 * MiB}}) as (a, b, c):
            for holder in (a, b):
                plain_model(holder.models_dir, "dense", {"model-1.safetensors": total // 2,
                                                         "model-2.safetensors": total // 2})
            stall_after(a, total // 3)
            fetching = asyncio.create_task(fetch(c, "dense", a, b))
            await wait_until(lambda: c.fetches.get("dense") and c.fetches["dense"].bytes_done >= total // 3, 60,
                             "a third copied")
            assert getattr(c.report().transfers[0], "from") == "mac-1"
            await a.endpoints.stop(grace=None)
            last = await fetching
            assert last.done and getattr(last, "from") == "mac-2"
            assert tree(c.models_dir / "dense") == tree(a.models_dir / "dense")
            assert b.bytes_served == size(a.models_dir / "dense") - total // 3  # only what mac-1 had not
            totals = {t.kind: t for t in c.report().transfer_totals}
            assert totals["peer"].failures == 1 and totals["peer"].fetches == 1

    run(go())


def test_a_peer_that_stalls_mid_copy_gives_way_to_the_next(tmp_path, monkeypatch):
    """A peer alive but sending nothing (its connection kept alive) is given up after
    STALL_S; else the fetch, which outlives its callers, would hold the source for good."""
    from cluster.fleet import transfer

    monkeypatch.setattr(transfer, "STALL_S", 1.0)
    total = 2 * MiB

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", "mac-3") as (a, b, c):
            for holder in (a, b):
                plain_model(holder.models_dir, "dense", {"model.safetensors": total})
            stall_after(a, total // 2)
            last = await asyncio.wait_for(fetch(c, "dense", a, b), 60)
            assert last.done and getattr(last, "from") == "mac-2"
            assert tree(c.models_dir / "dense") == tree(a.models_dir / "dense")

    run(go())


def test_several_files_stream_at_once_within_the_bandwidth_bound(tmp_path):
    rate, total = 2 * MiB, 6 * MiB

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2",
                          **{"mac-2": {"copy_bandwidth": rate, "copy_streams": 3}}) as (a, b):
            plain_model(a.models_dir, "dense", {f"model-{i}.safetensors": total // 4 for i in range(4)})
            serve, streams = a.read_model_file, {"now": 0, "most": 0}

            async def counted(request):
                streams["now"] += 1
                streams["most"] = max(streams["most"], streams["now"])
                try:
                    async for chunk in serve(request):
                        yield chunk
                finally:
                    streams["now"] -= 1

            a.read_model_file = counted
            seen: list[pb.Transfer] = []

            async def watch():
                while True:
                    seen.extend(b.report().transfers)
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            started = time.monotonic()
            progress: list[pb.FetchProgress] = []
            last = await fetch(b, "dense", a, on_progress=progress.append)
            took = time.monotonic() - started
            watcher.cancel()
            assert last.done and tree(b.models_dir / "dense") == tree(a.models_dir / "dense")
            assert streams["most"] >= 2  # several files at once
            assert took >= total / rate * 0.8, took  # the bound held (no upper limit: the machine may be slow)
            # the report listed the copy while it ran, and counts it after
            assert seen and all(t.source == "dense" and getattr(t, "from") == "mac-1" for t in seen)
            assert max(t.bytes_done for t in seen) > 0 and seen[-1].bytes_total == total + 25
            assert len(progress) >= 2 and progress[-1].done
            report = b.report()
            assert not report.transfers
            totals = {t.kind: t for t in report.transfer_totals}
            assert (totals["peer"].bytes, totals["peer"].fetches, totals["hub"].fetches) == (total + 25, 1, 0)

    run(go())


def test_the_bandwidth_bound_holds_for_the_node_not_each_fetch(tmp_path):
    """Two copies at once share --copy-bandwidth: the bound keeps serving from starving, which
    a bucket per fetch would not."""
    from cluster.fleet import transfer

    rate, each = 2 * MiB, 3 * MiB

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"copy_bandwidth": rate}}) as (a, b):
            for name in ("one", "two"):
                plain_model(a.models_dir, name, {"model.safetensors": each})
            started = time.monotonic()
            done = await asyncio.gather(fetch(b, "one", a), fetch(b, "two", a))
            took = time.monotonic() - started
            assert all(d.done for d in done)
            assert took >= (2 * each - rate * transfer.BURST_S) / rate * 0.9, took  # no upper limit: a slow machine

    run(go())


def test_one_fetch_per_source_a_second_caller_follows_the_first(tmp_path):
    total = 4 * MiB

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"copy_bandwidth": 4 * MiB}}) as (a, b):
            plain_model(a.models_dir, "dense", {"model.safetensors": total})
            first, second = await asyncio.gather(fetch(b, "dense", a), fetch(b, "dense", a))
            assert first.done and second.done and first.path == second.path
            assert a.bytes_served < 1.5 * total

    run(go())


def test_a_whole_fetch_does_not_follow_a_ranks_fetch_of_the_same_source(tmp_path):
    """A rank's fetch writes part of the snapshot; a fetch of the whole model asked meanwhile
    (its group re-formed as one worker here) waits for it and then fetches the rest, rather
    than taking its partial snapshot for the model."""
    from cluster.fleet import hub

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"copy_bandwidth": 4 * MiB}}) as (a, b):
            files = {**hub_files(), "config.json": b'{"model_type": "llama", "num_hidden_layers": 2}',
                     "model.safetensors.index.json": json.dumps({"weight_map": {
                         "model.layers.0.mlp.weight": "model-00001-of-00002.safetensors",
                         "model.layers.1.mlp.weight": "model-00002-of-00002.safetensors"}}).encode()}
            hub_snapshot(a.hub_cache, REPO, files)
            ch, stub = stub_of(b)
            async with ch:
                async def rank():
                    async for last in stub.FetchModel(pb.FetchModelRequest(source=SOURCE, peers=[peer(a)],
                                                                           first_layer=1, last_layer=1)):
                        pass
                    return last

                ranked = asyncio.create_task(rank())
                await wait_until(lambda: b.fetches.get(SOURCE), 60, "the rank's fetch under way")
                whole = await fetch(b, SOURCE, a)
                assert (await ranked).done
            assert whole.done and hub.local_snapshot(SOURCE, b.hub_cache) == Path(whole.path)

    run(go())


def test_an_agent_that_stops_mid_copy_ends_the_copy_and_tells_its_caller(tmp_path):
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"copy_bandwidth": 2 * MiB}}) as (a, b):
            plain_model(a.models_dir, "dense", {"model.safetensors": 8 * MiB})
            fetching = asyncio.create_task(fetch(b, "dense", a))
            job = await wait_until(lambda: b.fetches.get("dense") if b.fetches.get("dense") and
                                   b.fetches["dense"].bytes_done else None, 60, "a copy under way")
            await b.stop()
            assert job.task.done() and job.error is not None and job.error.code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError):
                await fetching

    run(go())


# -- with the hub ---------------------------------------------------------------------------------
@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """The fake hub holding REPO (a plain model's files; weights as LFS files); HF_* at it."""
    server = FakeHub()
    model = plain_model(tmp_path / "on-the-hub", "tiny", {"model-00001-of-00002.safetensors": 3 * MiB,
                                                          "model-00002-of-00002.safetensors": 2 * MiB,
                                                          "tokenizer.json": 5000})
    server.commit = server.add(REPO, model)
    server.model = model
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.close()


def test_pulled_once_from_the_hub_then_copied_from_the_node_that_has_it(tmp_path, fake_hub):
    """The copy reads as a pull: the receiver's own pull afterwards downloads nothing."""
    from cluster.fleet import hub

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            pulled = await fetch(a, SOURCE)  # no peer: the hub
            assert pulled.done and getattr(pulled, "from") == "hub" and Path(pulled.path).name == fake_hub.commit
            from_hub = sum(fake_hub.served.values())
            assert from_hub >= size(fake_hub.model)
            copied = await fetch(b, SOURCE, a)
            assert copied.done and getattr(copied, "from") == "mac-1"
            assert sum(fake_hub.served.values()) == from_hub  # no second hub download
            assert tree(Path(copied.path)) == tree(fake_hub.model)
            assert hub.local_snapshot(SOURCE, b.hub_cache) == Path(copied.path)
            assert f"hf:{REPO}@{fake_hub.commit}" in {m.name for m in b.report().models if m.fetched}
            totals = {t.kind: t for t in b.report().transfer_totals}
            assert totals["peer"].bytes == size(fake_hub.model) and totals["hub"].fetches == 0
            await asyncio.to_thread(hub.pull, SOURCE, b.hub_cache)  # blobs named as the hub's etags: all there
            assert sum(fake_hub.served.values()) == from_hub

    run(go())


def test_a_pull_from_the_hub_reads_each_file_once(tmp_path, fake_hub):
    """Making room for a pull needs only the sizes the hub lists: no config.json downloaded
    beside the pull's own, no range read of a shard's header."""
    async def go():
        async with agents(tmp_path, "mac-1") as (a,):
            pulled = await fetch(a, SOURCE)
            assert pulled.done and getattr(pulled, "from") == "hub"
            sizes = {p.name: p.stat().st_size for p in fake_hub.model.iterdir()}
            assert fake_hub.served == sizes and not fake_hub.range_starts

    run(go())


def test_a_peer_that_dies_mid_copy_of_a_hub_model_gives_way_to_the_hub(tmp_path, fake_hub):
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"copy_bandwidth": 4 * MiB}}) as (a, b):
            await fetch(a, SOURCE)
            stall_after(a, 2 * MiB)
            fetching = asyncio.create_task(fetch(b, SOURCE, a))
            await wait_until(lambda: b.fetches.get(SOURCE) and b.fetches[SOURCE].bytes_done >= 2 * MiB, 60,
                             "a copy under way")
            await a.endpoints.stop(grace=None)
            last = await fetching
            assert last.done and getattr(last, "from") == "hub"
            assert tree(Path(last.path)) == tree(fake_hub.model)
            # huggingface_hub downloads each file whole into a file of its own: the copy's
            # partial files are of no use to it, and are not left behind
            assert not list(b.hub_cache.rglob("*.incomplete"))
            totals = {t.kind: t for t in b.report().transfer_totals}
            assert (totals["peer"].failures, totals["hub"].fetches) == (1, 1)

    run(go())


def test_an_agent_that_stops_mid_pull_ends_the_pull(tmp_path, fake_hub):
    """The pull runs in a thread that cancelling its task does not stop: it ends at its next
    bytes (huggingface_hub reports every 10 MiB), before the agent's stop returns (else it
    downloads on past the agent)."""
    shard, big = "model.safetensors", 16 * MiB
    fake_hub.add("acme/big", plain_model(tmp_path / "on-the-hub", "big", {shard: big}))
    fake_hub.slow(shard, 4 * MiB)

    async def go():
        async with agents(tmp_path, "mac-1") as (a,):
            fetching = asyncio.create_task(fetch(a, "hf:acme/big"))
            await wait_until(lambda: fake_hub.served.get(shard), 60, "the pull under way")
            await a.stop()
            with pytest.raises(grpc.aio.AioRpcError):
                await fetching
        await wait_until(lambda: shard in fake_hub.abandoned, 30, "the hub's client gone")
        assert fake_hub.served[shard] < big

    run(go())


def test_describe_answers_from_the_hub_for_a_model_not_here(tmp_path, fake_hub):
    async def go():
        async with agents(tmp_path, "mac-1") as (a,):
            ch, stub = stub_of(a)
            async with ch:
                described = await stub.DescribeModel(pb.DescribeModelRequest(source=f"hf:{REPO}"))
                assert described.name == SOURCE and described.file_bytes == size(fake_hub.model)
                assert not list(a.hub_cache.rglob("*.safetensors"))  # nothing fetched to say so
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.DescribeModel(pb.DescribeModelRequest(source="hf:acme/nope"))
                assert e.value.code() == grpc.StatusCode.NOT_FOUND

    run(go())


# -- serving files: what a peer may ask -------------------------------------------------------------
@pytest.mark.parametrize("path", ["../models/dense/config.json", "/etc/passwd", "sub/../../x", "", "a\\..\\b"])
def test_read_model_file_refuses_a_path_out_of_the_model_before_reading(tmp_path, path):
    async def go():
        async with agents(tmp_path, "mac-1") as (a,):
            plain_model(a.models_dir, "dense", {"model.safetensors": 10})
            ch, stub = stub_of(a)
            async with ch:
                for source in ("dense", "no-such-model"):  # checked before the model is looked up
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in stub.ReadModelFile(pb.ReadModelFileRequest(source=source, path=path)):
                            pass
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "path" in e.value.details()
            assert a.bytes_served == 0

    run(go())


def test_the_file_rpcs_refuse_a_wrong_join_token(tmp_path):
    async def go():
        async with agents(tmp_path, "mac-1") as (a,):
            plain_model(a.models_dir, "dense", {"model.safetensors": 10})
            ch, stub = stub_of(a, token="wrong")
            async with ch:
                calls = [lambda: stub.ListModelFiles(pb.ListModelFilesRequest(source="dense")),
                         lambda: stub.DescribeModel(pb.DescribeModelRequest(source="dense"))]
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call()
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                for streamed in (stub.ReadModelFile(pb.ReadModelFileRequest(source="dense", path="model.safetensors")),
                                 stub.FetchModel(pb.FetchModelRequest(source="dense"))):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in streamed:
                            pass
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert a.bytes_served == 0

    run(go())


def test_list_and_describe_and_fetch_say_what_is_missing(tmp_path):
    async def go():
        async with agents(tmp_path, "mac-1", "mac-2") as (a, b):
            plain_model(a.models_dir, "dense", {"model.safetensors": 100})
            ch, stub = stub_of(a)
            async with ch:
                listing = await stub.ListModelFiles(pb.ListModelFilesRequest(source="dense"))
                assert sorted(f.path for f in listing.files) == ["config.json", "model.safetensors"]
                assert all(len(f.sha256) == 64 and not f.blob for f in listing.files)
                described = await stub.DescribeModel(pb.DescribeModelRequest(source="dense"))
                assert described.name == "dense" and described.file_bytes > 100
                for call, code in ((stub.ListModelFiles(pb.ListModelFilesRequest(source="nope")), "NOT_FOUND"),
                                   (stub.DescribeModel(pb.DescribeModelRequest(source="nope")), "NOT_FOUND"),
                                   (stub.ListModelFiles(pb.ListModelFilesRequest(source="../x")), "INVALID_ARGUMENT")):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call
                    assert e.value.code().name == code
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.ReadModelFile(pb.ReadModelFileRequest(source="dense", path="model.safetensors",
                                                                               offset=101)):
                        pass
                assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
            with pytest.raises(grpc.aio.AioRpcError) as e:  # no peer has it, and it is no hub source
                await fetch(b, "nope", a)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetch(b, "ollama:llama3:8b", a)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(go())


# -- the disk budget -------------------------------------------------------------------------------
def _age(cache: Path, repo: str, seconds_ago: float) -> None:
    for snapshot in (cache / disk.repo_folder(repo) / "snapshots").iterdir():
        t = time.time() - seconds_ago
        os.utime(snapshot, (t, t))


def test_the_disk_budget_deletes_the_least_recently_used_fetched_model_never_a_kept_or_plain_one(tmp_path):
    weights = 2 * MiB
    size = len(b"".join(hub_files(weights=weights).values()))

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2",
                          **{"mac-2": {"disk_budget": 3 * size + size // 2}}) as (a, b):
            hub_snapshot(a.hub_cache, REPO, hub_files(seed=1, weights=weights))
            for i, repo in enumerate(("acme/old", "acme/pinned", "acme/newer")):
                hub_snapshot(b.hub_cache, repo, hub_files(seed=10 + i, weights=weights))
            _age(b.hub_cache, "acme/pinned", 3000)  # the least recent, but protected
            _age(b.hub_cache, "acme/old", 2000)
            _age(b.hub_cache, "acme/newer", 1000)
            plain = plain_model(b.models_dir, "mine", {"model.safetensors": 4 * MiB})  # not the budget's
            await b.refresh_models()
            report = b.report()
            assert report.disk_budget_bytes == 3 * size + size // 2 and report.disk_used_bytes == 3 * size
            fetched = {m.name: m for m in report.models if m.fetched}
            assert set(fetched) == {f"hf:acme/{r}@{rev}" for r in ("old", "pinned", "newer")
                                    for rev in ("main", "a" * 40)}  # by ref and by commit
            assert 1500 < fetched["hf:acme/old@main"].last_used_seconds_ago < 2500
            assert not next(m for m in report.models if m.name == "mine").fetched

            last = await fetch(b, SOURCE, a, protect=["hf:acme/pinned"])
            assert list(last.deleted) == ["hf:acme/old"]
            assert not (b.hub_cache / disk.repo_folder("acme/old")).exists()
            assert (b.hub_cache / disk.repo_folder("acme/pinned")).exists() and plain.exists()
            assert b.report().disk_used_bytes == 3 * size

            # no room unless a protected model or one a worker here runs went: refused with the numbers
            from cluster.fleet.agent import RUNNING, ManagedProcess

            worker = ManagedProcess(pb.WorkerSpec(worker_id="w-1", model="newer", source="hf:acme/newer"), [],
                                    tmp_path / "w.log", tmp_path / "w.pid", "", state=RUNNING)
            b.workers[worker.spec.worker_id] = worker
            hub_snapshot(a.hub_cache, "acme/big", hub_files(seed=7, weights=weights))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetch(b, "hf:acme/big", a, protect=["hf:acme/pinned", SOURCE])
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--disk-budget" in e.value.details() and "acme/newer" in e.value.details()
            del b.workers[worker.spec.worker_id]
            assert all((b.hub_cache / disk.repo_folder(r)).exists() for r in ("acme/pinned", "acme/newer", REPO))

    run(go())


def test_a_worker_is_not_started_on_a_model_being_deleted_to_make_room(tmp_path, monkeypatch):
    weights = 2 * MiB
    size = len(b"".join(hub_files(weights=weights).values()))

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"disk_budget": size + size // 2}}) as (a, b):
            hub_snapshot(a.hub_cache, REPO, hub_files(seed=1, weights=weights))
            hub_snapshot(b.hub_cache, "acme/old", hub_files(seed=2, weights=weights))
            deleting, go_on = asyncio.Event(), threading.Event()
            loop, delete = asyncio.get_running_loop(), disk.delete

            def slow_delete(repo):
                loop.call_soon_threadsafe(deleting.set)
                go_on.wait(60)
                delete(repo)

            monkeypatch.setattr(disk, "delete", slow_delete)

            async def no_process(w):
                pass

            b._supervise = no_process
            fetching = asyncio.create_task(fetch(b, SOURCE, a))
            await asyncio.wait_for(deleting.wait(), 60)
            try:
                with pytest.raises(FleetError) as e:
                    await b.start_worker(pb.WorkerSpec(worker_id="w-1", model="old", source="hf:acme/old"))
                assert e.value.code == grpc.StatusCode.UNAVAILABLE and "hf:acme/old" in e.value.message
                assert "being deleted" in e.value.message and not b.workers
                for serve in (b.list_model_files(pb.ListModelFilesRequest(source="hf:acme/old")),
                              anext(b.read_model_file(pb.ReadModelFileRequest(source="hf:acme/old",
                                                                              path="config.json")))):
                    with pytest.raises(FleetError) as e:  # nor is it served to a peer
                        await serve
                    assert e.value.code == grpc.StatusCode.NOT_FOUND and "being deleted" in e.value.message
            finally:
                go_on.set()
            assert (await fetching).done

    run(go())


def test_a_single_worker_is_not_started_on_a_ranks_part_of_a_hub_model(tmp_path):
    """A pipeline rank's fetch leaves a snapshot of its layers' shards only: a worker of the
    whole model there would fail on the shards it lacks (or serve a part of the model)."""
    async def go():
        async with agents(tmp_path, "mac-1") as (a,):
            files = {**hub_files(), "model.safetensors.index.json": json.dumps({"weight_map": {
                "model.layers.0.mlp.weight": "model-00001-of-00002.safetensors",
                "model.layers.1.mlp.weight": "model-00002-of-00002.safetensors"}}).encode()}
            del files["model-00002-of-00002.safetensors"]
            hub_snapshot(a.hub_cache, REPO, files)

            async def no_process(w):
                pass

            a._supervise = no_process
            with pytest.raises(FleetError) as e:
                await a.start_worker(pb.WorkerSpec(worker_id="w-1", model="tiny", source=SOURCE))
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "model-00002-of-00002.safetensors" in e.value.message and not a.workers
            rank = pb.WorkerSpec(worker_id="w-2", model="tiny", source=SOURCE, group_size=2, group_rank=1,
                                 group_hosts=["h:1", "h:2"])
            assert (await a.start_worker(rank)).worker_id == "w-2"  # a rank holds its layers' files only

    run(go())


def test_two_fetches_at_once_make_room_for_each_other(tmp_path):
    weights = 2 * MiB
    size = len(b"".join(hub_files(weights=weights).values()))

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"disk_budget": 3 * size}}) as (a, b):
            for i, repo in enumerate(("acme/x", "acme/y")):
                hub_snapshot(a.hub_cache, repo, hub_files(seed=20 + i, weights=weights))
            for i, repo in enumerate(("acme/old", "acme/older")):
                hub_snapshot(b.hub_cache, repo, hub_files(seed=30 + i, weights=weights))
                _age(b.hub_cache, repo, 1000 * (i + 1))
            x, y = await asyncio.gather(fetch(b, "hf:acme/x", a), fetch(b, "hf:acme/y", a))
            assert sorted([*x.deleted, *y.deleted]) == ["hf:acme/older"]
            await b.refresh_models()
            assert b.report().disk_used_bytes <= 3 * size

    run(go())


def test_a_fetch_under_way_counts_once_whatever_it_has_written_and_told():
    """The disk budget's reckoning of another fetch under way: the bytes it will hold once
    done, less those on disk now, however many of them it has counted yet (a chunk written and
    not yet told was counted twice: one model too many deleted at the budget's edge)."""
    from cluster.fleet.agent import _still_to_write

    hub_fetch = transfer.Fetch("hf:acme/x")
    hub_fetch.begin("mac-1", 100)
    hub_fetch.repo, hub_fetch.disk_bytes_when_done = "acme/x", 130  # 30 were there before it began
    hub_fetch.add(20)  # told of 20, while 50 are written
    repos = [disk.CachedRepo("acme/x", Path("x"), 30 + 50, 1.0), disk.CachedRepo("acme/y", Path("y"), 500, 2.0)]
    assert _still_to_write([hub_fetch], repos) == 50
    assert _still_to_write([hub_fetch], []) == 130  # its folder not made yet
    plain = transfer.Fetch("dense")  # a plain copy: not in the hub cache's scan
    plain.begin("mac-1", 100)
    plain.add(40)
    assert _still_to_write([hub_fetch, plain], repos) == 50 + 60


def test_evictions_go_least_recently_used_first_and_only_as_far_as_needed():
    repos = [disk.CachedRepo(name, Path(name), 100, used) for name, used in
             (("a/in-use", 1.0), ("a/old", 2.0), ("a/mid", 3.0), ("a/new", 4.0))]
    keep = {"a/in-use"}
    assert disk.evictions(repos, 50, 440, 10**9, keep, "x") == [repos[1]]
    assert disk.evictions(repos, 150, 440, 10**9, keep, "x") == repos[1:3]
    assert disk.evictions(repos, 40, 440, 10**9, keep, "x") == []  # it fits
    assert disk.evictions(repos, 50, 0, 10**9, keep, "x") == []  # no budget: the disk's free space only
    assert disk.evictions(repos, 50, 0, 20, keep, "x") == [repos[1]]
    with pytest.raises(FleetError) as e:
        disk.evictions(repos, 350, 440, 10**9, keep, "hf:a/b on mac-2")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "hf:a/b on mac-2 needs" in e.value.message and "a/in-use" in e.value.message


def test_a_worker_of_a_hub_model_runs_its_snapshot_and_marks_it_used(tmp_path):
    from cluster.fleet.agent import find_model

    cache = tmp_path / "hub"
    snapshot = hub_snapshot(cache, REPO, hub_files(weights=10))
    _age(cache, REPO, 5000)
    assert find_model(tmp_path, f"hf:{REPO}", cache) == str(snapshot)
    assert find_model(tmp_path, f"hf:{REPO}@{'a' * 40}", cache) == str(snapshot)
    with pytest.raises(FleetError) as e:
        find_model(tmp_path, "hf:acme/other", cache)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "acme/other" in e.value.message
    disk.touch(snapshot)
    assert disk.seconds_since_used(disk.cached_repos(cache)[0]) < 60


# -- the router's node side ------------------------------------------------------------------------
def test_the_routers_node_side_fetches_and_describes_through_an_agent(tmp_path):
    from cluster.fleet.nodes import AgentNodes, NodeRegistry
    from cluster.router.registry import RegistryConfig

    async def go():
        async with agents(tmp_path, "mac-1", "mac-2", **{"mac-2": {"copy_bandwidth": 4 * MiB}}) as (a, b):
            plain_model(a.models_dir, "dense", {"model.safetensors": 3 * MiB})
            registry = NodeRegistry(RegistryConfig(join_token=TOKEN))
            registry.register(TOKEN, b.report())
            nodes = AgentNodes(registry, join_token=TOKEN)
            try:
                seen: list[pb.FetchProgress] = []
                last = await nodes.fetch("mac-2", pb.FetchModelRequest(source="dense", peers=[peer(a)]), seen.append)
                assert last.done and last.path == str(b.models_dir / "dense")
                assert seen and all(not m.done and getattr(m, "from") == "mac-1" for m in seen)
                assert [m.bytes_done for m in seen] == sorted(m.bytes_done for m in seen)
                assert (await nodes.describe("mac-2", "dense")).name == "dense"
                with pytest.raises(FleetError) as e:
                    await nodes.fetch("mac-2", pb.FetchModelRequest(source="nope", peers=[peer(a)]), seen.append)
                assert e.value.code == grpc.StatusCode.NOT_FOUND and "nope" in e.value.message
                with pytest.raises(FleetError) as e:
                    await nodes.describe("mac-2", "nope")
                assert e.value.code == grpc.StatusCode.NOT_FOUND
            finally:
                await nodes.close()

    run(go())


def test_orchard_nodes_list_shows_a_nodes_fetches_and_its_disk_budget():
    from cluster.fleet.nodes import format_nodes

    report = pb.NodeReport(node_id="mac-2", disk_budget_bytes=100 << 30, disk_used_bytes=40 << 30, transfers=[
        pb.Transfer(source="dense", **{"from": "mac-1"}, bytes_done=3 << 30, bytes_total=8 << 30, seconds=12),
        pb.Transfer(source=SOURCE, **{"from": "hub"}, bytes_done=MiB, seconds=1)])
    table = format_nodes([pb.NodeInfo(report=report, state="healthy")])
    assert "fetched models: 40.0 GiB of its --disk-budget 100.0 GiB" in table
    assert "copying dense from mac-1 37% (3.0 GiB in 12 s)" in table
    assert f"pulling {SOURCE} from hub (1 MiB in 1 s)" in table
