"""Poison requests in a worker group: a request that makes a pipeline rank's step raise
fails alone, with its cause, and the group serves the other streams on, exactly, without
being started again (a member says FAILED in place of READY over the side channel).
Under tensor parallelism a rank cannot be unblocked: that side is the router's
(test_router_poison.py).
"""

from __future__ import annotations

import threading
import time

import pytest

from cluster.worker.group import wire
from cluster.worker.group.channel import Leader, Member, StepFailed
from test_group import TOKEN, models, run_group  # noqa: F401  (models: the fixture)
from strike import greedy_streams


def _serving_group(size: int):
    """A leader serving `size - 1` joined members, each reading (serve()): (leader, what it
    lost, members by rank)."""
    lost: list[str] = []
    leader = Leader(("127.0.0.1", 0), size, TOKEN, 30.0, on_lost=lost.append)
    members = {r: Member(leader.address, r, size, TOKEN, 30.0, on_lost=lambda reason: None) for r in range(1, size)}
    admit = threading.Thread(target=leader.admit, args=(time.monotonic() + 30,), daemon=True)
    admit.start()
    for m in members.values():
        m.join(time.monotonic() + 30)
    admit.join(30)
    leader.serve()
    for m in members.values():
        m.serve()
    return leader, lost, members


def test_a_failed_step_is_passed_down_the_pipeline_and_the_group_goes_on():
    """Rank 2's step fails: rank 1, waiting for it, gets FAILED with the cause (through
    rank 0) and passes it on; rank 0's wait raises StepFailed with rank 2's cause, an
    ordinary step error: the group is not lost, and the next step's notices come as before.
    A notice out of order still loses the group."""
    leader, lost, members = _serving_group(3)
    try:
        cause = "rank 2: RuntimeError: poisoned"
        members[2].notify_failed(7, 1, cause)
        with pytest.raises(StepFailed) as passed:
            members[1].wait_ready(7, 2, 10)
        assert str(passed.value) == cause
        members[1].notify_failed(7, 0, str(passed.value))
        with pytest.raises(StepFailed) as failed:
            leader.wait_ready(7, 1, 10)
        assert str(failed.value) == cause and not isinstance(failed.value, ConnectionError)
        assert not leader.lost and lost == []

        members[2].notify_ready(8, 1)
        members[1].wait_ready(8, 2, 10)
        members[1].notify_ready(8, 0)
        leader.wait_ready(8, 1, 10)
        assert lost == []

        members[1].notify_failed(10, 0, cause)  # step 9 was due
        with pytest.raises(ConnectionError):
            leader.wait_ready(9, 1, 10)
        assert len(lost) == 1 and "out of order" in lost[0]
    finally:
        for m in members.values():
            m.close()
        leader.close()


def test_a_failed_notice_is_checked_as_it_is_read():
    payload = wire.failed_payload(3, 1, 0, "rank 1: ValueError: " + "x" * 10_000)
    step, src, dst, cause = wire.read_notice(wire.FAILED, payload)
    assert (step, src, dst) == (3, 1, 0) and cause.startswith("rank 1: ValueError") and len(cause) == wire.MAX_CAUSE
    assert wire.read_notice(wire.READY, wire.READY_MSG.pack(3, 1, 0)) == (3, 1, 0, None)
    for kind, bad in ((wire.READY, wire.READY_MSG.pack(3, 1, 0) + b"x"), (wire.FAILED, b"\0" * 4)):
        with pytest.raises(wire.ProtocolError):
            wire.read_notice(kind, bad)


def _single_beside_poison(model) -> dict:
    from group_driver import config, run_beside_poison

    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine

    def load():
        engine = Engine.from_pretrained(model, EngineConfig(**config()))
        engine.warm_up()
        return engine

    out = run_beside_poison(load, poison=False)
    del out["engine"]
    return out


@pytest.mark.parametrize("size, rank, inflight", [
    (2, 1, 1),
    (2, 1, 2),
    # a middle stage fails: it takes the first stage's hidden state all the same
    pytest.param(3, 1, 1, marks=pytest.mark.slow),
    # the first stage fails: the middle one passes FAILED on
    pytest.param(3, 2, 3, marks=pytest.mark.slow),
])
def test_a_request_that_breaks_a_members_step_fails_alone_and_the_group_goes_on(models, tmp_path, monkeypatch, size,
                                                                                rank, inflight):
    """A member's layers raise for any step holding the poison request (its fault file):
    that request fails alone, with that rank's cause; the streams batched beside it come
    back one at a time (rank 0's engine loop, as a single worker's) and end with exactly
    the tokens of a single process that never saw it; the group is never lost and its
    members end with rank 0 (exit 0). With batches in flight, those behind the failed
    batch are seen through first."""
    from group_driver import POISON_RUN

    model = models("llama", layers=4)
    (tmp_path / f"rank{rank}.poison").write_text(" ".join(map(str, POISON_RUN)))
    monkeypatch.setenv("ORCHARD_FAULT_DIR", str(tmp_path))  # the members' environment (run_group's)
    group = run_group(model, size, poison=True, inflight=inflight)
    assert list(group["failed"]) == ["poison"]
    assert f"rank {rank}: RuntimeError: a poisoned request is in this step on rank {rank}" in group["failed"]["poison"]
    assert group["group"]["failed_steps"] >= 1 and not group["group"]["lost"]
    single = _single_beside_poison(model)
    assert {rid: t for rid, t in group["results"].items() if rid != "poison"} == single["results"]
    assert all(len(t) == 16 for t in single["results"].values())


@pytest.mark.parametrize("fails", ["member", "rank 0", "ring"])
def test_rank_0_finishes_a_failed_pipeline_step_in_order(models, monkeypatch, fails):
    """A pipeline step that fails on a member (its FAILED comes) or in rank 0's own layers
    (after the hidden state came): rank 0's forward raises that error as an ordinary one,
    the step is finished in order, and the next step is planned and run as usual; the group
    is not lost. The hidden state not arriving (the ring failing) loses it."""
    import mlx.core as mx

    from cluster.worker.group.config import GroupOptions, Topology
    from cluster.worker.group.leader import GroupRunner, GroupState, GroupStats
    from cluster.worker.group.stage import Assignment, StageRunner
    from cluster.worker.model_runner import load_model, text_args
    from cluster.worker.sampling_params import SamplingParams
    from cluster.worker.scheduler import ScheduledSeq, SchedulerOutput
    from cluster.worker.sequence import Sequence
    from test_group import _NoMembers

    model, _ = load_model(models("llama", layers=2))
    hidden_size = int(text_args(model).hidden_size)
    assignment = Assignment("pipeline", 2, ((1, 2), (0, 1)), 2)
    topo = Topology(0, (("127.0.0.1", 1), ("127.0.0.1", 2)), ("127.0.0.1", 1001))
    leader = _NoMembers()
    group = GroupState(leader, None, topo, assignment, GroupOptions(size=2), hidden_size, GroupStats())
    runner = GroupRunner(model, 8, 16, None, stage=assignment.stage(0), group=group)

    def batch(block: int):
        seq = Sequence(f"s{block}", [5, 6, 7], SamplingParams(max_tokens=1), num_prompt_tokens=3)
        seq.block_table = [block]
        return runner.prepare(SchedulerOutput([ScheduledSeq(seq, 0, 3)]))

    def hidden(step, num_tokens, dtype):
        return mx.zeros((num_tokens, hidden_size), dtype)

    def raising(error):
        def fail(*args, **kwargs):
            raise error
        return fail

    try:
        if fails == "member":
            monkeypatch.setattr(group, "receive_hidden", raising(StepFailed("rank 1: RuntimeError: poisoned")))
        else:
            monkeypatch.setattr(group, "receive_hidden", hidden if fails == "rank 0" else raising(
                RuntimeError("[ring] the connection closed")))
            monkeypatch.setattr(StageRunner, "forward", raising(RuntimeError("rank 0's layers")))
        first = batch(0)
        with pytest.raises(Exception) as failed:
            runner.forward(first)
        if fails == "ring":
            assert len(leader.lost) == 1 and "the connection closed" in leader.lost[0]
            return
        assert str(failed.value) == ("rank 1: RuntimeError: poisoned" if fails == "member" else "rank 0's layers")
        assert leader.lost == [] and not group.in_flight and group.stats.failed_steps == 1
        monkeypatch.undo()
        monkeypatch.setattr(group, "receive_hidden", hidden)
        assert runner.forward(batch(1)).shape[0] == 1
        assert leader.lost == [] and not group.in_flight and group.stats.steps == 2
    finally:
        group.close()


def _streams_and_poison(router: str, texts: list[str], max_tokens: int) -> tuple[list[list[int]], list]:
    """`greedy_streams`, and a quarter of the way through them a request carrying the
    poison run: the streams' tokens, and what the poison request raised (one error)."""
    from group_driver import POISON_RUN

    from cluster.sdk import Client

    poison: list[BaseException] = []

    def send_poison() -> None:
        try:
            with Client(router, timeout=300) as client:
                client.generate([5, 6, 7, *POISON_RUN], max_tokens=8, temperature=0.0)
        except BaseException as e:  # noqa: BLE001  (asserted by the caller)
            poison.append(e)

    sender = threading.Thread(target=send_poison, daemon=True)
    once = threading.Lock()  # (the streams' threads report progress)

    def fault(n: int) -> None:
        with once:
            if n >= len(texts) * max_tokens // 4 and sender.ident is None:
                sender.start()

    got = greedy_streams(router, texts, max_tokens, on_progress=fault)
    sender.join(300)
    return got, poison


@pytest.mark.slow
def test_a_poison_request_through_the_router_fails_alone_and_the_group_serves_on(models, tmp_path):
    """`orchard up --workers 1 --group-size 2` (pipeline), 8 greedy streams through the
    router, and mid-stream a request that makes rank 1's step raise (its fault file): that
    request gets INTERNAL naming rank 1's error, every stream ends with the tokens of the
    run without it, and the group is never started again (its processes are the same)."""
    from group_driver import POISON_RUN

    from cluster.api.errors import InternalError
    from cluster.up import LocalCluster, free_port

    model = models("qwen3", layers=4)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "rank1.poison").write_text(" ".join(map(str, POISON_RUN)))
    texts = [f"stream {i}: " + " ".join(["orchard", "pear", "apple", "branch"][(i + j) % 4] for j in range(i + 3))
             for i in range(8)]
    max_tokens = 60
    cluster = LocalCluster(model, workers=1, group_size=2, parallel="pipeline", grpc_address=f"127.0.0.1:{free_port()}",
                           http_address=None, metrics_address=None, worker_port_base=0, worker_metrics_port_base=0,
                           log_dir=tmp_path / "logs", worker_env={"ORCHARD_FAULT_DIR": str(faults)})
    with cluster:
        baseline = greedy_streams(cluster.router_address, texts, max_tokens)
        pids = [c.proc.pid for c in cluster.group_processes(0)]
        got, poison = _streams_and_poison(cluster.router_address, texts, max_tokens)
        assert got == baseline
        assert len(poison) == 1 and isinstance(poison[0], InternalError), poison
        assert "rank 1: RuntimeError: a poisoned request is in this step on rank 1" in str(poison[0])
        assert cluster.group_restarts == 0 and [c.proc.pid for c in cluster.group_processes(0)] == pids
        assert all(c.proc.poll() is None for c in cluster.group_processes(0))


def test_a_pipelined_step_sees_a_request_added_to_a_busy_engine_through_its_first_batch(models):
    """A request added to a virtual engine whose batch is in flight, while the oldest batch
    is another engine's: `step()` returns only once the request has been through a batch,
    as a single engine's step does (the engine loop counts a request added back after a
    failed step as cleared by the step after it: had it not run, a later failure of its
    own would be pinned on the next request added back)."""
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.group.pipelined import PipelinedEngine
    from cluster.worker.model_runner import load_model
    from cluster.worker.sampling_params import SamplingParams

    model, tokenizer = load_model(models("llama", layers=2))
    pipelined = PipelinedEngine([Engine(model, tokenizer, EngineConfig(num_kv_blocks=32)) for _ in range(2)], None)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    pipelined.add_request("a", [5, 6, 7], params)
    pipelined.add_request("b", [8, 9, 10], params)
    pipelined.step()
    pipelined.step()  # the oldest batch in flight is now b's engine's, then a's
    (older, _), (newer, _) = pipelined.in_flight
    assert older != newer
    pipelined.add_request("c", [11, 12, 13], params)
    assert pipelined._owner("c") == newer
    assert "c" in [out.request_id for out in pipelined.step()]


@pytest.mark.slow
def test_a_poison_request_takes_down_a_tensor_group_twice_and_no_more(models, tmp_path):
    """`orchard up --workers 1 --group-size 2 --parallel tensor`, supervised as `orchard up`
    does: a request that makes rank 1's step raise takes the group down (rank 1 is inside a
    collective: the group exits 75), is held until the group is back, takes it down once
    more, and is failed as poison (INTERNAL, naming the 2 workers it took down). The
    streams under way each time resume and complete on the next start, which serves on."""
    from group_driver import POISON_RUN

    from cluster.api.errors import InternalError
    from cluster.sdk import Client
    from cluster.up import LocalCluster, free_port

    model = models("llama", layers=2)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "rank1.poison").write_text(" ".join(map(str, POISON_RUN)))
    texts = [f"stream {i}: orchard pear apple" for i in range(4)]
    max_tokens = 40
    cluster = LocalCluster(model, workers=1, group_size=2, parallel="tensor", grpc_address=f"127.0.0.1:{free_port()}",
                           http_address=None, metrics_address=None, worker_port_base=0, worker_metrics_port_base=0,
                           log_dir=tmp_path / "logs", worker_env={"ORCHARD_FAULT_DIR": str(faults)})
    stop = threading.Event()

    def supervise() -> None:  # what `orchard up` does while it runs
        while not stop.wait(0.5):
            cluster.supervise()

    with cluster:
        watcher = threading.Thread(target=supervise, daemon=True)
        watcher.start()
        try:
            got, poison = _streams_and_poison(cluster.router_address, texts, max_tokens)
            assert all(len(t) == max_tokens for t in got)
            assert len(poison) == 1 and isinstance(poison[0], InternalError), poison
            assert "took down 2 workers" in str(poison[0])
            deadline = time.monotonic() + 120  # the streams may end before the second take-down's restart
            while cluster.group_restarts < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert cluster.group_restarts == 2
            cluster.wait_ready(120)
            with Client(cluster.router_address, timeout=120) as client:  # the group is back and serves on
                assert len(client.generate([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True).token_ids) == 4
        finally:
            stop.set()
            watcher.join(10)
