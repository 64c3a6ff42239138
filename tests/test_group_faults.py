"""A model's only worker is a group (`orchard up --workers 1 --group-size 2`, pipeline
parallel), and a fault strikes mid-stream: kill -9 of the member, SIGSTOP of the member
for 30 s, kill -9 of rank 0, or the member's step wedged for a few seconds. The router
holds the streams while `up`'s supervision starts the group again (or the wedge ends), and
resumes them there token-exact; a request sent during the outage is served once the group
is back (cluster/router/proxy.py, cluster/up.py). A stall's report names the late rank.

One router + one group of 2 on the tiny model for the module (`LocalCluster`, free ports,
0.2 s heartbeats, the default --resume-wait and --group-timeout), supervised as `orchard
up` does (`LocalCluster.supervise` every half second, on a thread).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.up import LocalCluster, free_port
from conftest import run
from test_router_procs import channel, collect, list_workers, metric, request, scrape, wait_for

HEARTBEAT = 0.2
STOP_FOR = 30.0  # seconds the stopped member stays stopped
PROMPTS = [f"Group {i}: the router keeps every token of" for i in range(8)]
LATE_PROMPT = "Sent while the group was down"
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def group(tiny_model_dir, tmp_path_factory):
    """The cluster, under `orchard up`'s supervision; supervision's lines in `.supervised`."""
    import test_router_procs

    faults = tmp_path_factory.mktemp("faults")
    c = LocalCluster(
        tiny_model_dir, workers=1, group_size=2, parallel="pipeline",
        grpc_address=f"127.0.0.1:{free_port()}", http_address=None, metrics_address=f"127.0.0.1:{free_port()}",
        worker_port_base=0, worker_metrics_port_base=0, log_dir=tmp_path_factory.mktemp("group-fault-logs"),
        router_args=["--heartbeat-interval", str(HEARTBEAT)],
        worker_args=["--max-num-seqs", "16"],
        worker_env={"ORCHARD_FAULT_DIR": str(faults)},  # the test-only fault hooks (cluster/worker/faults.py)
    )
    stop = threading.Event()
    c.supervised = []
    c.faults = faults

    def supervise():  # what `orchard up` does while it runs
        while not stop.wait(0.5):
            c.supervised += c.supervise()

    with c:
        watcher = threading.Thread(target=supervise, daemon=True)
        watcher.start()
        test_router_procs.CLUSTER = c  # the helpers present its (no) credentials
        try:
            yield c
        finally:
            stop.set()
            watcher.join(10)
            test_router_procs.CLUSTER = None


def _strike(c: LocalCluster, fault: str) -> None:
    member, rank0 = c.members[0][0].proc, c.workers[0].proc
    if fault == "kill-member":
        os.kill(member.pid, signal.SIGKILL)
    elif fault == "stop-member":
        os.kill(member.pid, signal.SIGSTOP)
        threading.Timer(STOP_FOR, _continue, (member,)).start()
    elif fault == "wedge-member":  # until the stall is seen (`_streams`)
        (c.faults / "rank1.wedge").touch()
    else:
        os.kill(rank0.pid, signal.SIGKILL)


def _continue(proc) -> None:
    if proc.poll() is None:  # not replaced meanwhile
        os.kill(proc.pid, signal.SIGCONT)


def _streams(c: LocalCluster, fault: str | None, timings: dict, reasons: dict):
    """The 8 streams and the late request. With `fault`: once about 16 tokens of each
    stream have arrived, strike; once the router sees the group down, send the late request
    (and, for a stall, keep what the group's report says of it in `reasons`)."""
    struck = asyncio.Event()

    async def main():
        async with channel(c.router_address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            seen = {"tokens": 0}

            def on_chunk(chunk):
                seen["tokens"] += len(chunk.token_ids)
                if fault and not struck.is_set() and seen["tokens"] >= 8 * 16:
                    timings["struck"] = time.monotonic()
                    _strike(c, fault)
                    struck.set()

            async def late():
                if fault:
                    await struck.wait()
                    await asyncio.to_thread(wait_for, lambda: list_workers(c)["worker-0"].state
                                            != pb.WORKER_STATE_HEALTHY, 60, "the router seeing the group down")
                    timings["seen_down"] = time.monotonic()
                    if fault in ("stop-member", "wedge-member"):  # stalled, not gone: its report says on what
                        reasons["stall"] = await asyncio.to_thread(
                            wait_for, lambda: list_workers(c)["worker-0"].load.unhealthy_reason, 15,
                            "the stall's reason at the router")
                    if fault == "wedge-member":  # the member moves again, before --group-timeout
                        (c.faults / "rank1.wedge").unlink()

                def first(chunk):
                    if chunk.token_ids and "late_first_token" not in timings:
                        timings["late_first_token"] = time.monotonic()

                return await collect(stub, request(LATE_PROMPT, 50), first)

            out = await asyncio.gather(*(collect(stub, request(p, MAX_TOKENS), on_chunk) for p in PROMPTS), late())
            timings["done"] = time.monotonic()
            return out

    return main()


@pytest.fixture(scope="module")
def reference(group):
    return run(_streams(group, None, {}, {}), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill-member", "stop-member", "wedge-member", "kill-rank0"])
def test_a_sole_group_survives_a_fault_mid_stream_with_nothing_lost(group, reference, fault):
    """Every stream completes identical to the run without the fault, no client sees an
    error, and the request sent while the group was down is served once it is back."""
    c = group
    for _ in range(3):  # a try whose strike came after the group had sent every token proves nothing
        before = metric(scrape(c.metrics_address), 'orchard_router_retries_total{kind="resume"}')
        timings: dict[str, float] = {}
        reasons: dict[str, str] = {}
        faulty = run(_streams(c, fault, timings, reasons), timeout=420)
        for (ref_toks, ref_text, _), (toks, text, chunks) in zip(reference, faulty):
            assert toks == ref_toks
            assert text == ref_text
            assert chunks[-1].finish_reason
        assert len(faulty[0][0]) == MAX_TOKENS and faulty[0][2][-1].usage.completion_tokens == MAX_TOKENS
        wait_for(lambda: list_workers(c)["worker-0"].state == pb.WORKER_STATE_HEALTHY, 240,
                 "the group back")  # before the next fault or try
        if metric(scrape(c.metrics_address), 'orchard_router_retries_total{kind="resume"}') > before:
            break
    else:
        pytest.fail("in 3 tries the fault never struck while the group still owed tokens")
    if fault == "stop-member":  # rank 0 knows which member it waits for, and that it is silent
        assert "rank 1 silent" in reasons["stall"] and "rank 0 has not finished" not in reasons["stall"], reasons
    if fault == "wedge-member":  # ... and which one is late with its part, though it answers heartbeats
        assert "rank 1 (" in reasons["stall"] and "has not finished its part of step" in reasons["stall"], reasons
    # each member's part of a step, as rank 0 sees it: in the group's row and its metrics
    assert list_workers(c)["worker-0"].load.group.members[1].step_seconds > 0
    assert metric(scrape(c.worker_metrics[0]), "orchard_group_rank_step_seconds_count") > 0
    t0 = timings["struck"]
    print(f"\n{fault}: {reasons.get('stall', '')}; seen down after {timings['seen_down'] - t0:.1f} s, "
          f"serving again (the late request's first token) after {timings['late_first_token'] - t0:.1f} s, "
          f"every stream done after {timings['done'] - t0:.1f} s; supervision: {c.supervised}")


# -- rank 0's view of each member's part of a step (cluster/worker/group/progress.py) ------------

def test_progress_times_each_members_part_and_names_the_late_one():
    """A pipeline of 3 (rank 2 first, then 1, then 0), two steps in flight: each member's
    part runs from when its input was there, or it finished its previous step if later,
    to its notice; a step in flight waits on the first stage that has not done its part."""
    from cluster.worker.group.progress import StepProgress

    p = StepProgress(3, clock=lambda: 0.0)
    p.sent(1, at=0.0)
    p.sent(2, at=0.1)  # the second batch goes out while the first is on rank 2
    p.finished(2, 1, at=0.5)  # rank 2: 0.0 -> 0.5
    assert p.late(1, now=0.7).rank == 1 and abs(p.late(1, now=0.7).seconds - 0.2) < 1e-9
    p.finished(2, 2, at=1.0)  # rank 2 began step 2 when it finished step 1: 0.5 -> 1.0
    p.finished(1, 1, at=0.6)  # rank 1: 0.5 -> 0.6
    p.finished(1, 2, at=1.1)  # 1.0 -> 1.1
    assert p.parts == {1: 2, 2: 2}
    assert abs(p.seconds[2] - 1.0) < 1e-9 and abs(p.seconds[1] - 0.2) < 1e-9
    assert p.recent[2] > p.recent[1], "rank 2 is the slow one"
    assert p.late(2, now=1.2) is None, "every member did its part: rank 0's turn"
    p.sent(3, at=1.2)
    late = p.late(3, now=4.2)
    assert (late.rank, late.step, round(late.seconds, 6)) == (2, 3, 3.0)
    assert sum(p.buckets[2]) == 2 and sum(p.buckets[1]) == 2


def test_progress_forgets_what_it_no_longer_needs():
    """Notices are kept only until the next stage has read them: a long run holds a few."""
    from cluster.worker.group.progress import StepProgress

    p = StepProgress(2)
    for step in range(1, 5001):
        p.sent(step, at=float(step))
        p.finished(1, step, at=step + 0.5)
    assert len(p._sent) == 0 and len(p._done[1]) <= 1024 and p.parts[1] == 5000


def test_a_group_with_a_silent_member_is_stalled_at_stall_report_whatever_its_steps_take():
    """A member silent on the side channel (a Mac stopped or asleep) for --stall-report
    makes rank 0 report a stall naming it, though rank 0's step bar (5x its slowest recent
    step) is longer: that member's steps cannot finish, however slow they may be."""
    from types import SimpleNamespace

    from cluster.worker.group.leader import GroupState, GroupStats
    from cluster.worker.group.progress import StepProgress
    from test_worker_service import run_with_service

    member = SimpleNamespace(last_heard=time.monotonic(), info={"host": "mac-2"})
    leader = SimpleNamespace(members={1: member}, progress=StepProgress(2), on_lost=lambda reason: None,
                             close=lambda: None)
    group = GroupState(leader, None, None, SimpleNamespace(parallel="pipeline"), None, 128, GroupStats(size=2))

    async def fn(svc, engine):
        svc.group = group
        svc.engine_loop.full_step = 10.0  # a model whose steps may take 50 s: the engine's own bar
        heard = (svc.stalled, svc.load_report().stalled)
        member.last_heard = time.monotonic() - 4
        return heard, svc.stalled, svc.load_report()

    try:
        heard, silent, report = run_with_service(fn, stall_report=3.0)
    finally:
        group.close()
    assert heard == (False, False)
    assert silent and report.stalled and report.unhealthy_reason.startswith("rank 1 silent for 4."), report
