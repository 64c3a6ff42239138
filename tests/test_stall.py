"""A stall is seen in seconds: a worker whose engine step does not finish says so at once
(load report and health, pushed to the router, not left for the next heartbeat); the
router places nothing there and resumes its streams on another worker of the model, and
places there again once the step finishes. A worker that sends nothing at all (stopped,
asleep) is left once it misses its heartbeats.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.registry import HEALTHY
from cluster.router.server import RouterConfig, RouterServer
from cluster.security import channel as secure_channel
from cluster.up import LocalCluster, free_port
from cluster.worker.registration import Registration
from conftest import run
from fake_worker import FakeWorker
from strike import Striker, until_one_moves_async


async def until(condition, what: str, timeout: float) -> float:
    """Seconds until `condition()` (a blocking call, run on a thread) holds; bounded."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < timeout:
        if await asyncio.to_thread(condition):
            return loop.time() - t0
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what} not within {timeout} s")


def test_a_stall_is_pushed_to_the_router_at_once_not_at_the_next_heartbeat():
    """Heartbeats every 30 s: `report_now` (what the worker's watchdog calls when its
    health changes) gets the stall, and its end, to the router in well under that."""
    async def main():
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                           join_token="tok", heartbeat_interval=30.0))
        await router.start()
        w = await FakeWorker("w0").start()
        reg = Registration(router.grpc_address, w.address, w.load_report, join_token="tok", worker_id="w0",
                           interval=30.0)
        reg.start()
        state = lambda: router.registry.workers["w0"].state if "w0" in router.registry.workers else None  # noqa: E731
        try:
            await until(lambda: state() == HEALTHY, "w0 registered", 10)
            w.stalled = True
            reg.report_now()
            await until(lambda: state() == pb.WORKER_STATE_UNHEALTHY, "the stall at the router", 10)
            w.stalled = False
            reg.report_now()
            await until(lambda: state() == HEALTHY, "the worker healthy again at the router", 10)
        finally:
            await reg.stop()
            await router.stop(grace=0)
            await w.server.stop(0)

    run(main(), 60)


def test_a_round_past_four_times_the_usual_one_is_lagging_long_before_a_stall():
    """The engine lags (new work is better placed elsewhere) once a round runs past 4x its
    usual round, a third of --stall-report and the slowest recent round (or the warm-up's
    full prefill step): seconds before a stall is reported."""
    from cluster.worker.engine_loop import EngineLoop

    loop = EngineLoop(lambda: None, lambda now, events: None, stall_report=3.0)
    for _ in range(50):
        loop._round_done(0.1)
    assert loop.lag_after == 1.0  # 4 x 0.1 is less than a third of 3 s
    for _ in range(200):
        loop._round_done(0.5)
    assert abs(loop.lag_after - 2.0) < 0.01 and loop.stall_after == 3.0
    now = time.monotonic()
    loop.busy_since = now - 2.5
    assert loop.lagging(now) and not loop.stalled(now)
    loop.busy_since = now - 1.5
    assert not loop.lagging(now)
    loop.busy_since = None
    assert not loop.lagging(now)
    loop._round_done(2.8)  # a step that long lately is the workload's: not lagging before it
    assert loop.lag_after >= 2.8 and loop.stall_after > 13
    fresh = EngineLoop(lambda: None, lambda now, events: None, stall_report=3.0)
    fresh.full_step = 1.5  # nor one as long as the warm-up's full prefill step, before any is seen
    assert fresh.lag_after == 1.5


def test_a_lagging_worker_gets_no_new_requests_and_its_requests_with_no_output_move():
    """A worker whose step runs well past its usual time (lagging, not yet a stall) says so
    at once: the router moves the requests it holds that have had no output yet to another
    worker of the model (the client sees one stream), and places new ones there too, though
    the lagging worker looks the less loaded. A request moved onto a worker that lags in
    turn moves again."""
    async def main():
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                           join_token="tok", heartbeat_interval=30.0))
        await router.start()
        w0, w1, w2 = [await FakeWorker(f"w{i}").start() for i in range(3)]
        w1.extra_running, w2.extra_running = 10, 20  # the request goes to w0, then w1, then w2
        w0.hang_after_tokens = w1.hang_after_tokens = 0  # each waits for a step that does not end
        regs = [Registration(router.grpc_address, w.address, w.load_report, join_token="tok", worker_id=w.worker_id,
                             interval=30.0) for w in (w0, w1, w2)]
        for reg in regs:
            reg.start()
        try:
            await until(lambda: len([w for w in router.registry.workers.values() if w.state == HEALTHY]) == 3,
                        "all registered", 10)
            async with grpc.aio.insecure_channel(router.grpc_address) as ch:
                stub = pb_grpc.GenerationStub(ch)
                task = asyncio.ensure_future(collect(stub, request("moved", 8)))
                for w, reg in ((w0, regs[0]), (w1, regs[1])):
                    await until(lambda: w.running == 1, f"the request on {w.worker_id}", 10)
                    w.lagging = True
                    reg.report_now()
                toks, workers = await asyncio.wait_for(task, 10)
                new = await collect(stub, request("new", 4))
            assert len(toks) == 8 and workers == {"w2"} and w0.cancelled == w1.cancelled == 1
            assert new[1] == {"w2"}
        finally:
            for reg in regs:
                await reg.stop()
            await router.stop(grace=0)
            for w in (w0, w1, w2):
                await w.server.stop(0)

    run(main(), 60)


def test_a_sole_worker_lagging_keeps_its_requests():
    """With no other worker of the model to take them, a lagging worker's requests stay
    where they are (moving them would only queue them again behind the same step)."""
    async def main():
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                           join_token="tok", heartbeat_interval=30.0))
        await router.start()
        w0 = await FakeWorker("w0").start()
        w0.hang_after_tokens = 0
        reg = Registration(router.grpc_address, w0.address, w0.load_report, join_token="tok", worker_id="w0",
                           interval=30.0)
        reg.start()
        try:
            await until(lambda: "w0" in router.registry.workers, "w0 registered", 10)
            async with grpc.aio.insecure_channel(router.grpc_address) as ch:
                task = asyncio.ensure_future(collect(pb_grpc.GenerationStub(ch), request("stays", 8)))
                await until(lambda: w0.running == 1, "the request on w0", 10)
                w0.lagging = True
                reg.report_now()
                await until(lambda: router.registry.workers["w0"].report.lagging, "the report at the router", 10)
                await asyncio.sleep(0.5)  # a cancel of its call would reach w0 by now
                assert w0.cancelled == 0 and not task.done()
                task.cancel()
        finally:
            await reg.stop()
            await router.stop(grace=0)
            await w0.server.stop(0)

    run(main(), 60)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    faults = tmp_path_factory.mktemp("faults")
    c = LocalCluster(
        tiny_model_dir, workers=2,
        grpc_address=f"127.0.0.1:{free_port()}", http_address=None, metrics_address=None,
        worker_port_base=0, worker_metrics_port_base=0, log_dir=tmp_path_factory.mktemp("stall-logs"),
        worker_env={"ORCHARD_FAULT_DIR": str(faults)},  # the test-only fault hooks (cluster/worker/faults.py)
        worker_args=["--num-kv-blocks", "1024", "--max-num-seqs", "64"],  # default stall and heartbeat settings
    )
    with c:
        yield c, faults


def request(text: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True))


async def collect(stub, req, on_chunk=None) -> tuple[list[int], set[str]]:
    """A stream's tokens and the workers that sent them."""
    toks, workers = [], set()
    async for c in stub.Generate(req):
        toks += c.token_ids
        if c.token_ids:
            workers.add(c.worker_id)
        if on_chunk is not None:
            on_chunk(c)
    return toks, workers


def states(c: LocalCluster) -> dict[str, int]:
    with secure_channel(c.router_address, c.client_security(admin=True), aio=False) as ch:
        resp = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    return {w.worker_id: w.state for w in resp.workers}


@pytest.mark.slow
def test_a_wedged_worker_is_left_within_seconds_and_placed_on_again_when_it_moves(cluster):
    """Two workers, the default settings. Mid-stream, the engine of the worker serving most
    streams blocks in a step: within seconds the router lists it unhealthy and places new
    requests on the other worker; its streams resume there, token-exact. When the step
    finishes, the router places on it again."""
    c, faults = cluster
    prompts = [f"Stall {i}: the router keeps every token of" for i in range(6)]
    max_tokens = 400  # the tiny model is fast: the streams must still be running at the wedge

    async def streams(stub, striker: Striker):
        return await asyncio.gather(*(collect(stub, request(p, max_tokens), striker.on_chunk(i))
                                      for i, p in enumerate(prompts)))

    async def attempt(stub, reference) -> bool:
        striker = Striker(6 * 16, lambda busiest: (faults / f"{busiest}.wedge").touch())  # ~16 tokens a stream
        try:
            results = await asyncio.wait_for(streams(stub, striker), 60)  # not waiting for the wedge to end
            assert [t for t, _ in results] == [t for t, _ in reference]
            assert striker.struck, "the streams ended before the wedge"
            victim = striker.struck[0]
            other = next(w for w in states(c) if w != victim)
            if not any(workers == {victim, other} for _, workers in results):
                return False  # the victim had sent everything before the client struck
            await until(lambda: states(c)[victim] == pb.WORKER_STATE_UNHEALTHY,
                        "the wedged worker unhealthy at the router", 15)
            new = await asyncio.gather(*(collect(stub, request(f"New {i} while wedged", 8)) for i in range(4)))
            assert all(workers == {other} for _, workers in new), (victim, new)
        finally:
            for f in faults.iterdir():
                f.unlink()
        await until(lambda: states(c)[victim] == HEALTHY, "the worker healthy once its step finished", 20)
        for i in range(5):  # placed there again (the policy spreads concurrent requests)
            again = await asyncio.gather(*(collect(stub, request(f"Back {i}.{j}", 8)) for j in range(8)))
            if any(victim in workers for _, workers in again):
                return True
        pytest.fail(f"nothing placed on {victim} after its step finished")

    async def main():
        async with grpc.aio.insecure_channel(c.router_address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            reference = await streams(stub, Striker(None, print))
            await until_one_moves_async(lambda: attempt(stub, reference))

    run(main(), 540)


@pytest.mark.slow
def test_a_stopped_worker_has_its_streams_resumed_once_it_misses_its_heartbeats(cluster):
    """SIGSTOP (a Mac asleep: connections open, nothing sent, not even heartbeats) of the
    worker serving most streams: they resume on the other worker, token-exact, after the
    heartbeats it misses, not after the stream idle timeout (30 s)."""
    c, _ = cluster
    prompts = [f"Asleep {i}: the router keeps every token of" for i in range(6)]
    max_tokens = 400

    def pid(worker_id: str) -> int:
        return c.workers[int(worker_id.split("-")[1])].proc.pid

    async def streams(stub, striker: Striker):
        return await asyncio.gather(*(collect(stub, request(p, max_tokens), striker.on_chunk(i))
                                      for i, p in enumerate(prompts)))

    async def attempt(stub, reference) -> bool:
        striker = Striker(6 * 16, lambda busiest: os.kill(pid(busiest), signal.SIGSTOP))
        try:
            results = await asyncio.wait_for(streams(stub, striker), 25)  # under the 30 s idle timeout
        finally:
            for victim in striker.struck:
                os.kill(pid(victim), signal.SIGCONT)
        assert [t for t, _ in results] == [t for t, _ in reference]
        await until(lambda: list(states(c).values()) == [HEALTHY, HEALTHY], "the stopped worker back", 30)
        return any(len(workers) == 2 for _, workers in results)

    async def main():
        async with grpc.aio.insecure_channel(c.router_address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            reference = await streams(stub, Striker(None, print))
            await until_one_moves_async(lambda: attempt(stub, reference))

    run(main(), 400)
