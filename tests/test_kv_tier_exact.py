"""The disk KV tier in the engine (cluster/worker/kv_tier.py): a prefix served from disk
gives the tokens and logprobs of the same prefix served from memory, bit for bit, and the
tokens of computing it; on the host path and the MLX path, after a restart and after an
eviction; beside other requests, aborted while reading, refused for a hybrid model."""

from __future__ import annotations

import random
import threading
import time
import types

import pytest

from cluster.kv.hashing import block_hashes
from cluster.modelgen import create_model
from cluster.worker import kernels, kv_tier
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=1234, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-tier-models")
    # llama and qwen3 run on the host path (host_forward.FAMILIES); the others through MLX
    return {arch: create_model(root / arch, arch, "tiny", seed=5)
            for arch in ("llama", "qwen3", "olmo2", "gemma3_text", "deepseek_v3")}


def hold_reads(engine: Engine) -> threading.Event:
    """The engine's disk reads wait (on a thread of their own) until the returned event is set."""
    gate = threading.Event()
    reader = engine.kv_tier.reader
    submit = reader.submit

    def held(entries, out, done):
        threading.Thread(target=lambda: gate.wait(60) and submit(entries, out, done), daemon=True).start()

    reader.submit = held
    return gate


def engine_on(path, disk_dir, **overrides) -> Engine:
    cfg = EngineConfig(**{"num_kv_blocks": 64, "kv_disk_dir": str(disk_dir), **overrides})
    engine = Engine.from_pretrained(path, cfg)
    if engine.kv_tier is not None:
        assert engine.kv_tier.wait_ready(60), "the tier did not open"
    return engine


def settled(engine: Engine) -> Engine:
    """`engine` with its disk writes done (they are asynchronous): what a later request, or a
    later engine on the same directory, reads."""
    assert engine.kv_tier.flush(60), "the disk writes did not finish"
    return engine


def stopped(engine: Engine) -> None:
    """`engine`'s tier flushed and closed, as a worker stops (its store's lock given back)."""
    settled(engine).kv_tier.close()


def run(engine: Engine, prompt: list[int], params: SamplingParams, rid: str = "r") -> dict:
    """One request to its end (the engine stepped as a worker's loop steps it, waiting on the
    tier's reads when nothing else runs): its tokens, logprobs, top logprobs and usage."""
    engine.add_request(rid, prompt, params)
    out = {"tokens": [], "logprobs": [], "top": [], "cached": 0, "disk": 0}
    while engine.has_unfinished():
        if not engine.has_runnable():
            assert engine.kv_tier.wait(30), "a disk read did not finish"
        for o in engine.step():
            if o.request_id != rid:
                continue
            out["tokens"] += o.new_token_ids
            out["logprobs"] += o.logprobs or []
            out["top"] += o.top_logprobs or []
            out["cached"], out["disk"] = o.num_cached_tokens, o.num_cached_tokens_disk
        engine.check_integrity()
    return out


def run_on(engine: Engine, prompt: list[int]) -> Engine:
    run(engine, prompt, GREEDY, "earlier")
    return engine


def prompts(seed: int, prefix_len: int = 80, suffix_len: int = 21) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    return (prefix + [rng.randrange(3, 500) for _ in range(suffix_len)],
            prefix + [rng.randrange(3, 500) for _ in range(suffix_len)], prefix)


def same(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]  # bit for bit
    assert a["top"] == b["top"]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("arch,attention,kv_dtype", [
    ("llama", None, "auto"), ("qwen3", None, "auto"), ("qwen3", None, "float16"),  # the host path
    ("olmo2", None, "auto"), ("olmo2", None, "float16"),  # MLX's, the C kernels writing the pool
    ("olmo2", "reference", "auto"), ("olmo2", "reference", "bfloat16"),  # MLX's scatter writing it
    ("gemma3_text", None, "auto"),  # sliding-window layers (a 32-token window, the prefix longer)
    ("deepseek_v3", None, "auto"),  # multi-head latent attention: one pool for K and V
])
def test_a_prefix_from_disk_after_a_restart_equals_it_from_memory(model_dirs, tmp_path, monkeypatch, arch,
                                                                 attention, kv_dtype, params):
    if attention is not None:
        monkeypatch.setattr(kernels, "_forced", attention)  # MLX's scatter writes the pool, not the C kernels
    path = model_dirs[arch]
    first, second, prefix = prompts(11)
    warm = engine_on(path, tmp_path, kv_cache_dtype=kv_dtype)
    assert (warm.runner.host is not None) == (arch in ("llama", "qwen3")), "the path under test"
    run(warm, first, GREEDY, "first")
    assert run(warm, second, GREEDY, "second")["cached"] == 80  # the shared prefix, from memory
    from_memory = run(warm, second, params, "again")  # all its 6 full blocks, from memory
    assert from_memory["cached"] == 96 and from_memory["disk"] == 0

    stopped(warm)
    restarted = engine_on(path, tmp_path, kv_cache_dtype=kv_dtype)  # a new engine on the same directory
    from_disk = run(restarted, second, params)
    assert from_disk["cached"] == 96 and from_disk["disk"] == 96, "the prefix came from disk"
    same(from_disk, from_memory)
    assert restarted.kv_tier.stats.hit_tokens == 96

    computed = run(engine_on(path, tmp_path, enable_prefix_caching=False, kv_cache_dtype=kv_dtype), second, params)
    assert computed["tokens"] == from_disk["tokens"]
    assert computed["cached"] == 0


def test_a_prefix_evicted_from_memory_is_read_back(model_dirs, tmp_path):
    """A pool too small to keep the prefix: other prompts evict it, and it comes back from disk."""
    path = model_dirs["llama"]
    first, second, _ = prompts(12)
    engine = engine_on(path, tmp_path, num_kv_blocks=24)
    run(engine, first, GREEDY, "first")
    for i in range(3):  # 3 x 7 blocks through a 24-block pool: the prefix's blocks are reused
        run(engine, prompts(100 + i, prefix_len=96, suffix_len=10)[0], GREEDY, f"filler-{i}")
    settled(engine)
    in_memory = len(engine.block_manager.get_computed_blocks(engine.admission.sequence(
        "probe", second, GREEDY, (), None)))
    assert in_memory < 5, "the prefix was meant to be evicted (its last blocks first)"
    from_disk = run(engine, second, GREEDY, "second")
    assert from_disk["cached"] == 80 and from_disk["disk"] == 80 - 16 * in_memory
    reference = engine_on(path, tmp_path / "other", num_kv_blocks=64)
    run(reference, first, GREEDY, "first")
    same(from_disk, run(reference, second, GREEDY, "second"))


def test_reads_beside_decoding_requests_leave_theirs_unchanged(model_dirs, tmp_path):
    path = model_dirs["qwen3"]
    first, second, _ = prompts(13)
    others = [prompts(200 + i, prefix_len=30, suffix_len=7)[0] for i in range(3)]
    stopped(run_on(engine_on(path, tmp_path), first))  # the prefix on disk

    def alone(prompt):
        return run(engine_on(path, tmp_path / "alone", enable_prefix_caching=True), prompt, GREEDY)

    want = [alone(p)["tokens"] for p in others]
    engine = engine_on(path, tmp_path)
    gate = hold_reads(engine)  # the read waits until the others decode
    for i, p in enumerate(others):
        engine.add_request(f"o{i}", p, GREEDY)
    got = {f"o{i}": [] for i in range(3)}
    for o in engine.step():  # the others' prefill
        got[o.request_id] += o.new_token_ids
    engine.add_request("loaded", second, GREEDY)
    loaded = []
    for _ in range(3):
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert engine.seqs["loaded"].kv_loading, "the load is in flight while the others step"
    gate.set()
    while engine.has_unfinished():
        if not engine.has_runnable():
            engine.kv_tier.wait(30)
        for o in engine.step():
            (loaded if o.request_id == "loaded" else got[o.request_id]).extend(o.new_token_ids)
    assert [got[f"o{i}"] for i in range(3)] == want
    assert engine.seqs == {} and len(loaded) == 12
    assert engine.kv_tier.stats.hit_tokens == 80


def test_an_abort_while_reading_drops_the_read(model_dirs, tmp_path):
    path = model_dirs["llama"]
    first, second, _ = prompts(14)
    stopped(run_on(engine_on(path, tmp_path), first))
    engine = engine_on(path, tmp_path)
    gate = hold_reads(engine)
    engine.add_request("loaded", second, GREEDY)
    engine.step()
    assert engine.kv_tier.loads_in_flight == 1 and not engine.has_runnable()
    assert engine.abort("loaded")
    gate.set()
    assert engine.kv_tier.wait(30)
    engine.step()
    assert engine.kv_tier.loads_in_flight == 0 and not engine.has_unfinished()
    assert engine.kv_tier.stats.hit_tokens == 0 and not engine.block_manager.cached
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0


def test_a_corrupt_block_is_recomputed_and_the_output_is_right(model_dirs, tmp_path, caplog):
    path = model_dirs["qwen3"]
    first, second, _ = prompts(15)
    warm = engine_on(path, tmp_path)
    run(warm, first, GREEDY, "first")
    want = run(warm, second, GREEDY, "second")
    bad = warm.kv_tier.store.path(block_hashes(second, 16)[2])  # the prefix's third block
    stopped(warm)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x40  # a flipped bit in its payload
    bad.write_bytes(bytes(data))
    restarted = engine_on(path, tmp_path)
    got = run(restarted, second, GREEDY)
    assert got["disk"] == 32, "the two blocks before the bad one came from disk"
    assert got["tokens"] == want["tokens"]
    assert restarted.kv_tier.counters()["errors"]["checksum"] == 1
    assert any("checksum" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_a_hybrid_model_has_the_tier_off_and_says_why(tmp_path):
    path = create_model(tmp_path / "hybrid", "qwen3_next", "tiny", seed=2)
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, kv_disk_dir=str(tmp_path / "kv")))
    info = engine.kv_tier.info()
    assert not info.enabled and info.reason == kv_tier.RECURRENT_REASON
    assert engine.generate([[5, 6, 7] * 20], GREEDY)[0]  # it serves, without the tier


@pytest.mark.parametrize("flags,says", [
    (["--kv-disk-size", "1000"], "--kv-disk-size must be at least 1 MiB, not 1000"),
    (["--kv-disk-read-threads", "0"], "--kv-disk-read-threads must be in [1, 64], not 0"),
    (["--kv-disk-dir", "{tmp}/a-file"], "--kv-disk-dir must be a directory, but {tmp}/a-file is a file"),
    (["--kv-disk-dir", "{tmp}/a-file/kv"], "--kv-disk-dir must be a directory, but {tmp}/a-file is a file"),
])
def test_disk_flags_are_checked_before_the_model_loads(tmp_path, flags, says):
    import subprocess
    import sys

    (tmp_path / "a-file").write_text("")
    flags, says = [f.format(tmp=tmp_path) for f in flags], says.format(tmp=tmp_path)
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(tmp_path / "none"),
                           "--kv-disk-dir", str(tmp_path / "kv"), *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr  # permanent: a launcher does not start it again as it is
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_truncated_file_and_another_models_file_are_recomputed(model_dirs, tmp_path, caplog):
    """Files the store refuses at read (cut short; written for another model, moved into this
    one's directory): the request recomputes from there, its output right, a warning logged."""
    first, second, _ = prompts(16)
    reference = engine_on(model_dirs["llama"], tmp_path / "ref")
    run(reference, first, GREEDY, "first")
    want = run(reference, second, GREEDY, "second")

    warm = engine_on(model_dirs["llama"], tmp_path / "kv")
    run(warm, first, GREEDY, "first")
    hashes = block_hashes(second, 16)
    cut = warm.kv_tier.store.path(hashes[1])
    stopped(warm)
    other = engine_on(model_dirs["qwen3"], tmp_path / "kv")  # another model: its own store directory
    run(other, first, GREEDY, "first")
    foreign = other.kv_tier.store.path(hashes[3])
    stopped(other)
    theirs_in_ours = cut.parents[2] / foreign.relative_to(foreign.parents[2])
    theirs_in_ours.write_bytes(foreign.read_bytes())  # qwen3's block 3 where llama's was

    restarted = engine_on(model_dirs["llama"], tmp_path / "kv")
    cut.write_bytes(cut.read_bytes()[:-100])  # cut short under the running store
    got = run(restarted, second, GREEDY)
    assert got["disk"] == 16, "only the block before the cut one came from disk"
    assert got["tokens"] == want["tokens"]
    stopped(restarted)
    again = engine_on(model_dirs["llama"], tmp_path / "kv")  # the cut file was deleted and recomputed
    later = run(again, second + [7], GREEDY)
    assert later["disk"] == 48 and later["tokens"] != [], "blocks 0-2 from disk, the foreign block 3 refused"
    assert again.kv_tier.counters()["errors"]["identity"] == 1
    assert restarted.kv_tier.counters()["errors"]["truncated"] == 1
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "(truncated" in warned and "(identity" in warned


def test_a_full_disk_drops_blocks_and_serving_goes_on(model_dirs, tmp_path, monkeypatch, caplog):
    import errno
    import os

    def full(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    first, second, _ = prompts(17)
    engine = engine_on(model_dirs["qwen3"], tmp_path)
    monkeypatch.setattr(os, "writev", full)
    run(engine, first, GREEDY, "first")
    settled(engine)
    assert engine.kv_tier.counters()["dropped"]["disk_full"] >= 1
    assert engine.kv_tier.info().enabled
    got = run(engine, second, GREEDY, "second")  # from memory, as without a disk
    assert got["cached"] == 80 and got["disk"] == 0 and len(got["tokens"]) == 12
    assert any("No space" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_a_read_only_directory_serves_reads_and_writes_nothing(model_dirs, tmp_path, monkeypatch):
    from cluster.kv.disk_store import DiskStore

    first, second, _ = prompts(18)
    warm = engine_on(model_dirs["qwen3"], tmp_path)
    run(warm, first, GREEDY, "first")
    want = run(warm, second, GREEDY, "second")
    stopped(warm)
    monkeypatch.setattr(DiskStore, "_probe_writable", lambda self: (False, f"cannot write {self.dir}: Read-only "
                                                                          "file system"))
    engine = engine_on(model_dirs["qwen3"], tmp_path)
    info = engine.kv_tier.info()
    assert info.enabled and "Read-only" in info.reason
    got = run(engine, second, GREEDY)
    assert got["disk"] == 96 and got["tokens"] == want["tokens"]
    run(engine, prompts(19)[0], GREEDY, "new")
    assert engine.kv_tier.store.stats.blocks_written == 0


def test_orchard_up_gives_each_worker_its_own_disk_tier(monkeypatch):
    import argparse
    from dataclasses import replace

    from cluster.config import add_flags, from_args
    from cluster.up import LocalCluster, UpConfig, local_cluster

    parser = argparse.ArgumentParser()
    add_flags(parser, UpConfig)
    config = from_args(UpConfig, parser.parse_args(["--kv-disk-dir", "/kv", "--kv-disk-size", "8GiB"]))
    spawned = []
    monkeypatch.setattr(LocalCluster, "_spawn", lambda self, name, args, cpus, env: spawned.append(args))
    cluster = local_cluster(replace(config, log_dir="/tmp/unused"), "/m")
    cluster.start_worker(0)
    cluster.start_worker(1)
    for i, args in enumerate(spawned):
        assert args[args.index("--kv-disk-dir") + 1] == f"/kv/worker-{i}"
        assert args[args.index("--kv-disk-size") + 1] == str(8 << 30)


def test_the_engine_loop_waits_on_its_inbox_while_only_reads_are_in_flight(model_dirs, tmp_path):
    """Nothing runnable but a read: the loop does not spin (`has_work` is False), and the
    read's end wakes it with a message; the prefill and decode rates reach the load report."""
    import queue

    from cluster.worker.engine_loop import KvReadsDone, LoopState

    path = model_dirs["llama"]
    first, second, _ = prompts(20)
    earlier = run_on(engine_on(path, tmp_path), first)
    assert earlier.stats.prefill_tokens_per_second > 0
    stopped(earlier)
    engine = engine_on(path, tmp_path)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    engine.set_wake(lambda: inbox.put(KvReadsDone()))
    gate = hold_reads(engine)
    state = LoopState(engine)
    engine.add_request("loaded", second, GREEDY)
    state.step([])  # the read starts
    assert engine.kv_tier.loads_in_flight == 1 and not state.has_work()
    assert engine.stats.queued_prefill_tokens == len(second)
    gate.set()
    assert isinstance(inbox.get(timeout=30), KvReadsDone)
    assert not state.handle(KvReadsDone(), [])
    events: list = []
    state.work(events)  # installs the read, admits the request
    assert engine.seqs["loaded"].num_disk_tokens == 80 and state.has_work()
    assert engine.kv_tier.info().read_tokens_per_second > 0


def test_the_worker_exports_the_disk_tiers_metrics(model_dirs, tmp_path):
    from cluster.worker.metrics import WorkerMetrics

    first, second, _ = prompts(21)
    engine = settled(run_on(engine_on(model_dirs["qwen3"], tmp_path), first))
    stopped(engine)
    engine = engine_on(model_dirs["qwen3"], tmp_path)
    run(engine, second, GREEDY)
    text = WorkerMetrics("m", "w", lambda: engine.stats).render().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['orchard_kv_cache_hit_tokens_total{model="m",tier="disk",worker="w"}'] == 80
    assert values['orchard_kv_disk_enabled{model="m",worker="w"}'] == 1
    assert values['orchard_kv_disk_bytes_read_total{model="m",worker="w"}'] > 0
    assert values['orchard_kv_disk_read_seconds_count{model="m",worker="w"}'] == 1
    assert values['orchard_kv_disk_usage_bytes{model="m",worker="w"}'] > 0
    for name in ("orchard_kv_disk_blocks_dropped_total", "orchard_kv_disk_errors_total",
                 "orchard_kv_disk_write_queue_bytes", "orchard_num_requests_loading", "orchard_kv_disk_evictions_total",
                 "orchard_kv_disk_bytes_written_total", "orchard_kv_disk_blocks_written_total",
                 "orchard_kv_disk_budget_bytes"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name


def test_blocks_beyond_the_write_queue_wait_for_room_while_cached(model_dirs, tmp_path):
    """A write queue of two blocks: a prompt's blocks go to disk a few at a time, the others
    waiting (while they stay cached) rather than dropped; all of them land by the flush."""
    path = model_dirs["llama"]
    block_bytes = engine_on(path, tmp_path / "probe").kv_tier.block_bytes
    first, second, _ = prompts(22)
    engine = engine_on(path, tmp_path / "kv", kv_disk_queue_bytes=2 * block_bytes)
    run(engine, first, GREEDY, "first")
    stopped(engine)
    assert engine.kv_tier.counters()["blocks_written"] == 7  # (101 + 12 tokens) // 16
    assert engine.kv_tier.counters()["dropped"]["queue_full"] == 0
    restarted = engine_on(path, tmp_path / "kv")
    assert run(restarted, second, GREEDY)["disk"] == 80


def test_the_bench_reports_hits_by_tier_and_the_disk_traffic():
    from collections import defaultdict
    from dataclasses import asdict
    from types import SimpleNamespace

    from cluster.bench.serve import format_report
    from cluster.bench.server_metrics import ServerMetricsSampler, parse

    def exposition(memory: int, disk: int, written: int, read: int, reads: int, seconds: float) -> str:
        lv = 'model="m",worker="w0"'
        return (f'orchard_kv_cache_hit_tokens_total{{{lv},tier="memory"}} {memory}\n'
                f'orchard_kv_cache_hit_tokens_total{{{lv},tier="disk"}} {disk}\n'
                f'orchard_kv_disk_bytes_written_total{{{lv}}} {written}\n'
                f'orchard_kv_disk_bytes_read_total{{{lv}}} {read}\n'
                f'orchard_kv_disk_usage_bytes{{{lv}}} {written}\n'
                '# TYPE orchard_kv_disk_read_seconds histogram\n'
                f'orchard_kv_disk_read_seconds_bucket{{{lv},le="+Inf"}} {reads}\n'
                f'orchard_kv_disk_read_seconds_count{{{lv}}} {reads}\n'
                f'orchard_kv_disk_read_seconds_sum{{{lv}}} {seconds}\n')

    sampler = ServerMetricsSampler(["127.0.0.1:1"])
    url = sampler.urls[0]
    sampler._before[url] = parse(exposition(16, 0, 1 << 20, 0, 0, 0.0))
    summary = sampler.summarize({url: parse(exposition(48, 96, 3 << 20, 2 << 20, 2, 0.5))})
    assert summary.kv_hit_tokens_by_tier == {"memory": 32, "disk": 96}
    assert (summary.kv_disk_bytes_written, summary.kv_disk_bytes_read, summary.kv_disk_reads) == (2 << 20, 2 << 20, 2)
    assert summary.kv_disk_read_seconds == 0.5 and summary.kv_disk_usage_bytes == 3 << 20
    report = defaultdict(float, errors=[], server=asdict(summary))  # the client side's figures: zeros
    text = format_report(report, SimpleNamespace(max_concurrency=1, percentile_metrics=""))
    assert "Prefix-cache hit tokens, disk:" in text and "KV disk mean read (ms):" in text


def test_a_write_queue_smaller_than_a_block_writes_nothing_and_says_so(model_dirs, tmp_path, caplog):
    engine = engine_on(model_dirs["llama"], tmp_path, kv_disk_queue_bytes=1024)
    first, second, _ = prompts(23)
    run(engine, first, GREEDY, "first")
    assert engine.kv_tier.flush(5)  # nothing waits: it returns at once
    assert engine.kv_tier.counters()["blocks_written"] == 0
    assert run(engine, second, GREEDY)["cached"] == 80  # the memory cache serves as ever
    assert any("less than one KV block" in r.getMessage() for r in caplog.records)


class _InlineThread:
    """A thread whose target runs within `start()`: the tier's store opens before its
    constructor returns (the fastest a restart's open can be)."""

    def __init__(self, target, args=(), name=None, daemon=None):
        self.target, self.args = target, args

    def start(self):
        self.target(*self.args)


def test_the_journal_hears_the_disk_blocks_of_a_store_that_opens_at_once(model_dirs, tmp_path, monkeypatch):
    """A restarted worker's disk blocks go to the KV journal (the routers' map) however soon
    its store opens: the journal listens before the opening thread starts."""
    from cluster.kv.events import DISK

    path = model_dirs["llama"]
    first, _, _ = prompts(17)
    warm = run_on(engine_on(path, tmp_path), first)
    stopped(warm)
    on_disk = set(warm.kv_tier.store._index)
    assert on_disk
    monkeypatch.setattr(kv_tier, "threading", types.SimpleNamespace(
        Thread=_InlineThread, Lock=threading.Lock, Event=threading.Event))
    restarted = engine_on(path, tmp_path)
    assert restarted.kv_tier.store.mode == "ok"
    assert restarted.kv_journal.held(DISK) == on_disk


def test_a_failed_install_leaves_no_unwritten_block_cached_and_no_read_held(model_dirs, tmp_path):
    """A step that fails writing a read's rows into the pool: the blocks it had installed
    are taken out of the cache (their rows were never written: a later prompt recomputes
    them instead of taking them as hits), and the other reads done are installed later,
    not held for ever."""
    path = model_dirs["llama"]
    a, b = prompts(21)[0], prompts(22)[0]
    warm = engine_on(path, tmp_path)
    want = run(warm, a, GREEDY, "a")
    run(warm, b, GREEDY, "b")
    stopped(warm)
    engine = engine_on(path, tmp_path)
    tier = engine.kv_tier
    gate = hold_reads(engine)
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    engine.step()
    assert tier.loads_in_flight == 2 and not engine.has_runnable()
    gate.set()
    deadline = time.monotonic() + 60
    while len(tier._done) < 2 and time.monotonic() < deadline:
        tier.wait(1.0)
    assert len(tier._done) == 2, "the reads did not finish"
    write = engine.runner.write_blocks

    def fails(ids, arrays):
        raise RuntimeError("out of memory")

    engine.runner.write_blocks = fails
    with pytest.raises(RuntimeError):
        engine.step()
    engine.runner.write_blocks = write
    assert not engine.block_manager.cached, "blocks whose rows were never written are cached"
    engine.abort_all()  # as the engine loop does after a failed step
    engine.step()
    assert tier.loads_in_flight == 0 and tier._staged_blocks == 0
    engine.check_integrity()
    got = run(engine, a, GREEDY, "again")
    assert got["tokens"] == want["tokens"]
