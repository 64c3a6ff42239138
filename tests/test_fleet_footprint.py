"""cluster/fleet/footprint.py: the KV pool rule, a group's shares, bad input; and (slow) the
whole estimate against real workers' measured `LoadReport.resident_bytes`."""

from __future__ import annotations

import math
import time

import grpc
import pytest

from cluster.fleet import FleetError, footprint
from cluster.fleet.footprint import BLOCK_SIZE, Footprint, estimate, kv_pool_bytes, rank_shares
from cluster.proto.orchard.v1 import orchard_pb2 as pb

GiB = 1 << 30
DISK = pb.DiskModel(name="m", weight_bytes=8 * GiB, kv_bytes_per_token=128 << 10, num_layers=32,
                    max_context=32768, tasks=["generate"])


def test_the_kv_pool_is_whole_blocks_for_a_few_full_contexts():
    assert kv_pool_bytes(DISK, 4096, 1) == 4096 * DISK.kv_bytes_per_token
    assert kv_pool_bytes(DISK, 4097, 1) == (4096 + BLOCK_SIZE) * DISK.kv_bytes_per_token  # a block started is whole
    assert kv_pool_bytes(DISK, 100, 3) == 3 * 112 * DISK.kv_bytes_per_token
    # sized for CONCURRENT_CONTEXTS full contexts, never more than max_num_seqs of them
    assert estimate(DISK, 8192, 64, "metal").kv == kv_pool_bytes(DISK, 8192, footprint.CONCURRENT_CONTEXTS)
    assert estimate(DISK, 8192, 1, "metal").kv == kv_pool_bytes(DISK, 8192, 1)


def test_the_estimate_adds_weights_pool_and_the_platforms_overhead():
    for platform in ("cpu", "metal"):
        f = estimate(DISK, 2048, 2, platform)
        assert f == Footprint(DISK.weight_bytes, kv_pool_bytes(DISK, 2048, 2), footprint.OVERHEAD_BYTES[platform])
        assert f.total == f.weights + f.kv + f.overhead


def test_a_hybrid_holds_a_state_slot_for_each_request_it_runs():
    hybrid = pb.DiskModel(name="h", weight_bytes=GiB, kv_bytes_per_token=4096, state_bytes_per_seq=75 << 20,
                          num_layers=48)
    f = estimate(hybrid, 4096, 64, "metal")
    assert f.state == 64 * (75 << 20) and f.total == f.weights + f.kv + f.overhead + f.state
    assert sum(n - f.overhead for _, _, n in rank_shares(hybrid, [1, 1], f)) >= f.weights + f.kv + f.state


@pytest.mark.parametrize("args, code, words", [
    ((DISK, 0, 4, "cpu"), grpc.StatusCode.INVALID_ARGUMENT, "context must be at least 1 token, not 0"),
    ((DISK, 512, 0, "cpu"), grpc.StatusCode.INVALID_ARGUMENT, "max_num_seqs must be at least 1, not 0"),
    ((DISK, 512, 4, "cuda"), grpc.StatusCode.INVALID_ARGUMENT, "platform must be one of cpu, metal, not 'cuda'"),
    ((pb.DiskModel(name="x", error="no model_type"), 512, 4, "cpu"), grpc.StatusCode.FAILED_PRECONDITION,
     "model 'x' cannot be loaded: no model_type"),
])
def test_bad_input_is_refused_naming_it(args, code, words):
    with pytest.raises(FleetError) as e:
        estimate(*args)
    assert e.value.code == code and words in e.value.message


def test_a_groups_shares_follow_the_budgets_and_cover_every_layer_once():
    whole = estimate(DISK, 4096, 4, "metal")
    shares = rank_shares(DISK, [48 * GiB, 16 * GiB], whole)
    assert [(a, b) for a, b, _ in shares] == [(0, 23), (24, 31)]
    per_layer = (whole.weights + whole.kv) / 32
    assert [n for _, _, n in shares] == [math.ceil(per_layer * n) + whole.overhead for n in (24, 8)]
    assert [(a, b) for a, b, _ in rank_shares(DISK, [1, 1, 1])] == [(0, 10), (11, 20), (21, 31)]
    for bad in ([], [GiB] * 33, [GiB, 0]):
        with pytest.raises(FleetError) as e:
            rank_shares(DISK, bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "needs 1 to 32 nodes" in e.value.message


# -- measured ---------------------------------------------------------------------------------------

CONTEXT, MAX_NUM_SEQS = 1024, 2


@pytest.fixture(scope="module")
def sized_models(tmp_path_factory):
    """A dense, a MoE and a 4-bit model whose weights (held in float32 on a CPU) are a few
    hundred MB, so that they dominate the footprint as a real model's do."""
    from mlx_lm import convert

    from cluster.modelgen import create_model

    root = tmp_path_factory.mktemp("sized")
    dense = create_model(root / "dense", "llama", "small", layers=36)
    moe = create_model(root / "moe", "qwen3_moe", "small", layers=36)
    q4 = root / "q4"
    convert(str(create_model(root / "dense-src", "qwen3", "small", layers=36)), mlx_path=str(q4), quantize=True,
            q_bits=4, q_group_size=64)
    return {"dense": dense, "moe": moe, "4-bit": q4}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "moe", "4-bit"])
def test_the_estimate_is_within_10_percent_of_a_real_workers_resident_memory(sized_models, worker_process, name,
                                                                             capsys):
    from cluster import platform
    from cluster.fleet import facts
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
    from cluster.worker.engine_loop import IDLE_RELEASE_SECONDS
    from cluster.worker.service import RESIDENT_READ_SECONDS

    where = "metal" if platform.has_metal() else "cpu"
    disk = facts.disk_model(sized_models[name], where)
    want = estimate(disk, CONTEXT, MAX_NUM_SEQS, where)
    worker = worker_process(sized_models[name], "--max-model-len", str(CONTEXT), "--max-num-seqs", str(MAX_NUM_SEQS),
                            "--kv-cache-memory-bytes", str(want.kv), "--cpu-dequantize", "yes", http=False)
    try:
        with grpc.insecure_channel(worker.grpc) as channel:
            admin = pb_grpc.WorkerAdminStub(channel)
            report = admin.GetLoad(pb.GetLoadRequest(), timeout=30)
            # what loading freed was given back before the worker served (engine_loop): the
            # idle release (after IDLE_RELEASE_SECONDS) and a fresh read find no less
            time.sleep(IDLE_RELEASE_SECONDS + RESIDENT_READ_SECONDS + 0.5)
            later = admin.GetLoad(pb.GetLoadRequest(), timeout=30).resident_bytes
    finally:
        worker.stop()
    assert report.kv_blocks_total * BLOCK_SIZE * disk.kv_bytes_per_token == want.kv  # the pool it was given
    error = (want.total - report.resident_bytes) / report.resident_bytes
    with capsys.disabled():
        print(f"\n{name}: estimate {want.total / 2**20:.0f} MiB (weights {want.weights / 2**20:.0f}, KV "
              f"{want.kv / 2**20:.0f}, overhead {want.overhead / 2**20:.0f}), measured "
              f"{report.resident_bytes / 2**20:.0f} MiB: error {100 * error:+.1f}%")
    assert abs(error) <= 0.10
    assert abs(later - report.resident_bytes) < 0.02 * report.resident_bytes


def test_the_process_memory_a_worker_reports_is_its_rss():
    from cluster import platform

    rss = platform.resident_bytes()  # /proc/self/status's VmRSS
    if not rss:
        pytest.skip("no /proc here to compare with")
    assert abs(platform.process_memory() - rss) < 0.05 * rss

