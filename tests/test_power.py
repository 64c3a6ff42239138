"""A Mac about to sleep (cluster/worker/power.py), driven by a fake notifier: a worker that
holds its model keeps the Mac awake; when the Mac sleeps anyway the worker drains first,
its report says so, the router holds its streams; on wake it serves again and the held
streams resume on it token-exact."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

import grpc
import pytest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.registry import HEALTHY
from cluster.router.server import RouterConfig, RouterServer
from cluster.worker.power import (CAN_SYSTEM_SLEEP, PREVENT_IDLE_SLEEP, SYSTEM_HAS_POWERED_ON, SYSTEM_WILL_SLEEP,
                                  MacPower, NoPower, StayAwake, system_power)
from conftest import run
from fake_power import FakeFrameworks, FakePower


async def until(condition, what: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not condition():
        if loop.time() - t0 > timeout:
            raise TimeoutError(f"{what} not within {timeout} s")
        await asyncio.sleep(0.05)


def test_stay_awake_holds_the_assertion_drains_before_sleep_and_undrains_on_wake():
    power, calls = FakePower(), []
    awake = StayAwake(power, "serving", drain=lambda s: calls.append(("drain", s)),
                      undrain=lambda: calls.append("undrain"), drain_s=7.0).start()
    assert power.assertion == "serving"
    assert power.sleep() and calls == [("drain", 7.0)] and awake.asleep
    assert power.wake() and calls == [("drain", 7.0), "undrain"] and not awake.asleep
    assert power.wake() and calls.count("undrain") == 1  # a wake with no sleep before it: nothing to undo
    awake.stop()
    assert power.assertion is None and power.closed


def test_a_drain_that_fails_still_lets_the_mac_sleep():
    def drain(seconds: float) -> None:
        raise RuntimeError("no event loop")

    power = FakePower()
    StayAwake(power, "serving", drain, lambda: None).start()
    assert power.sleep(ack_s=10)


def test_mac_power_takes_the_assertion_and_answers_each_sleep_after_the_drain():
    """`MacPower` over stand-ins for IOKit and CoreFoundation: the assertion is
    PreventUserIdleSystemSleep, held until close; a will-sleep is acknowledged with its own
    argument only once `will_sleep` has returned (and also when it raised); an idle-sleep
    query is answered without a drain; a wake calls `did_wake`; close stops the run loop,
    deregisters and releases the assertion."""
    fw, events = FakeFrameworks(), []
    power = MacPower(iokit=fw, cf=fw)
    power._default_mode = lambda: None
    power.keep_awake("orchard worker w0 serves m")
    power.keep_awake("again")  # one assertion only
    assert len(fw.called("IOPMAssertionCreateWithName")) == 1
    made = [args[1] for args in fw.called("CFStringCreateWithCString")]
    assert made[:2] == [PREVENT_IDLE_SLEEP, b"orchard worker w0 serves m"]

    def will_sleep():
        events.append(("drain", len(fw.called("IOAllowPowerChange"))))
        if len(events) > 1:
            raise RuntimeError("no event loop")

    power.watch(will_sleep, lambda: events.append("wake"))
    fw.deliver(SYSTEM_WILL_SLEEP, 42)
    assert events == [("drain", 0)] and fw.called("IOAllowPowerChange") == [(99, 42)]
    fw.deliver(CAN_SYSTEM_SLEEP, 43)
    assert len(events) == 1 and fw.called("IOAllowPowerChange")[-1] == (99, 43)
    fw.deliver(SYSTEM_HAS_POWERED_ON)
    assert events[-1] == "wake"
    fw.deliver(SYSTEM_WILL_SLEEP, 44)  # a drain that fails still lets the Mac sleep
    assert fw.called("IOAllowPowerChange")[-1] == (99, 44)
    power.close()
    assert fw.called("CFRunLoopStop") and fw.called("IODeregisterForSystemPower") and fw.called("IOServiceClose")
    assert fw.called("IOPMAssertionRelease") == [(7,)]


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_off_macos_the_notifier_is_a_no_op_that_says_so_at_debug(caplog):
    power = system_power()
    assert isinstance(power, NoPower)
    with caplog.at_level(logging.DEBUG, logger="cluster.worker.power"):
        StayAwake(power, "serving", lambda s: None, lambda: None).start().stop()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]
    assert "only macOS" in caplog.text


def test_a_members_sleep_has_rank_0_drain_the_group_before_the_mac_sleeps():
    """A group member's Mac about to sleep: the member asks rank 0 over the side channel,
    rank 0 drains (its `on_sleep`), and only then does the member let the Mac sleep; on
    wake rank 0 is told, and takes requests again."""
    from cluster.worker.group.channel import Leader, Member
    from cluster.worker.group.member import _drain_group

    token, lost, calls = "power-test-token", [], []
    release = threading.Event()
    leader = Leader(("127.0.0.1", 0), 2, token, 30.0, on_lost=lost.append)
    member = Member(leader.address, 1, 2, token, 30.0, on_lost=lost.append)
    admit = threading.Thread(target=leader.admit, args=(time.monotonic() + 30,), daemon=True)
    admit.start()
    member.join(time.monotonic() + 30)
    admit.join(30)

    def on_sleep(rank: int, sleeping: bool) -> None:  # rank 0's drain
        calls.append((rank, sleeping))
        if sleeping:
            release.wait(30)

    leader.on_sleep(on_sleep)
    leader.serve()
    member.serve()
    power = FakePower()
    StayAwake(power, "rank 1", lambda s: _drain_group(member, s), member.awake, drain_s=10).start()
    try:
        slept = []
        sleeping = threading.Thread(target=lambda: slept.append(power.sleep()), daemon=True)
        sleeping.start()
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls == [(1, True)]
        time.sleep(0.3)
        assert sleeping.is_alive(), "the Mac slept before rank 0 had drained the group"
        release.set()
        sleeping.join(30)
        assert slept == [True]
        assert power.wake()
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls == [(1, True), (1, False)] and not lost
    finally:
        release.set()
        leader.close()
        member.close()


def test_a_worker_drains_before_sleep_its_streams_are_held_and_resume_on_wake(tiny_model_dir):
    """One router, its model's only worker (in this process, a fake notifier). A greedy
    stream runs; the Mac sleeps: the worker drains (report and the router say so), the
    stream it could not finish is ended and held by the router, a request sent meanwhile
    is held too; on wake both are served by the same worker, the stream identical to a
    run without the sleep. The assertion is taken while the model is loaded and given
    back when the worker stops."""
    from cluster.worker.config import EngineConfig, WorkerOptions
    from cluster.worker.server import WorkerServer

    power = FakePower()

    async def main():
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                           join_token="tok", heartbeat_interval=0.2))
        await router.start()
        options = WorkerOptions(str(tiny_model_dir), EngineConfig(num_kv_blocks=256, max_model_len=512),
                                grpc_address="127.0.0.1:0", metrics_address=None, router=router.grpc_address,
                                join_token="tok", worker_id="w0", heartbeat_interval=0.2)
        worker = WorkerServer(options, power=power)
        record = lambda: router.registry.workers.get("w0")  # noqa: E731
        try:
            await worker.start()
            assert power.assertion and "w0" in power.assertion  # the model is loaded: the Mac stays awake
            await until(lambda: record() is not None and record().state == HEALTHY, "w0 registered")
            worker.awake.drain_s = 0.0  # no time to finish: the running stream is ended at once
            async with grpc.aio.insecure_channel(router.grpc_address) as ch:
                stub = pb_grpc.GenerationStub(ch)
                expected = await collect(stub, request("Before the Mac sleeps, the router"))
                slept = asyncio.Event()

                def on_chunk(chunk) -> None:
                    if chunk.token_ids and not slept.is_set():
                        slept.set()

                stream = asyncio.create_task(collect(stub, request("Before the Mac sleeps, the router"), on_chunk))
                await slept.wait()
                assert await asyncio.to_thread(power.sleep)  # drained, then acknowledged
                assert worker.service.load_report().draining
                await until(lambda: record().state == pb.WORKER_STATE_DRAINING, "the router seeing the drain")
                late = asyncio.create_task(collect(stub, request("Sent while the Mac slept", 20)))
                await asyncio.sleep(1.0)  # both held: nothing can serve them
                assert not stream.done() and not late.done()
                assert worker.service.num_streams == 0
                assert await asyncio.to_thread(power.wake)
                assert not worker.service.load_report().draining
                assert await asyncio.wait_for(stream, 60) == expected
                assert len(await asyncio.wait_for(late, 60)) == 20
            assert power.assertion is not None
        finally:
            await worker.stop()
            await router.stop(grace=0)
        assert power.assertion is None and power.closed  # stopped: the Mac may sleep again

    run(main())


def test_an_operators_drain_outlasts_a_sleep(tiny_model_dir):
    from cluster.worker.config import EngineConfig, WorkerOptions
    from cluster.worker.server import WorkerServer

    power = FakePower()

    async def main():
        options = WorkerOptions(str(tiny_model_dir), EngineConfig(num_kv_blocks=64, max_model_len=256),
                                grpc_address="127.0.0.1:0", metrics_address=None)
        worker = WorkerServer(options, power=power)
        try:
            await worker.start()
            await worker.set_draining(True)
            assert await asyncio.to_thread(power.sleep)
            assert await asyncio.to_thread(power.wake)
            assert worker.service.load_report().draining
        finally:
            await worker.stop()

    run(main())


def request(text: str, max_tokens: int = 400) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True))


async def collect(stub, req, on_chunk=None) -> list[int]:
    tokens = []
    async for chunk in stub.Generate(req):
        tokens += chunk.token_ids
        if on_chunk is not None:
            on_chunk(chunk)
    return tokens
