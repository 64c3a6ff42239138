"""The router in-process against fake workers (no model): proxying, failover, registration.

Cheap (a few seconds in all); the same behaviours against real `orchard worker serve`
processes are in test_router_procs.py.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from cluster.api.errors import InvalidRequest
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.registry import HEALTHY
from cluster.router.server import RouterConfig, RouterServer
from conftest import run
from fake_worker import FakeWorker, fake_token
from cluster.worker.registration import Registration


class Cluster:
    """A router on a free port and fake workers registered with it."""

    def __init__(self, n_workers: int = 2, policy: str = "prefix_aware", http: bool = False, **router_kwargs):
        self.n_workers = n_workers
        self.http = http  # the OpenAI HTTP front on a free port
        self.policy = policy
        self.router_kwargs = router_kwargs
        self.workers: list[FakeWorker] = []
        self.registrations: list[Registration] = []

    async def __aenter__(self):
        cfg = RouterConfig(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0" if self.http else None,
                           metrics_address="127.0.0.1:0",
                           policy=self.policy, join_token="tok", heartbeat_interval=0.2, **self.router_kwargs)
        self.router = RouterServer(cfg)
        await self.router.start()
        for i in range(self.n_workers):
            await self.add_worker(f"w{i}")
        await self.wait_healthy(self.n_workers)
        self.channel = grpc.aio.insecure_channel(self.router.grpc_address)
        self.gen = pb_grpc.GenerationStub(self.channel)
        self.ctl = pb_grpc.RouterStub(self.channel)
        return self

    async def add_worker(self, worker_id: str, **kw) -> FakeWorker:
        w = await FakeWorker(worker_id, **kw).start()
        self.workers.append(w)
        self.register(w)
        return w

    def register(self, w: FakeWorker) -> Registration:
        """Start `w`'s registration: a new one is a new start of its process for the router."""
        reg = Registration(self.router.grpc_address, w.address, w.load_report, join_token="tok",
                           worker_id=w.worker_id, interval=0.2)
        reg.start()
        self.registrations.append(reg)
        return reg

    async def kill(self, w: FakeWorker) -> None:
        """`w` dies as a killed process does: its streams fail and its heartbeats stop."""
        for reg in self.registrations:
            if reg.address == w.address:
                await reg.stop()
        w.die()

    def restart(self, w: FakeWorker) -> Registration:
        """`w` back as a new process at the same address, under the same id."""
        w.dead, w.die_after_tokens = False, None
        return self.register(w)

    async def wait_until(self, condition, what: str, timeout: float = 5.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if condition():
                return
            await asyncio.sleep(0.02)
        raise TimeoutError(f"{what} not seen in {timeout} s")

    async def wait_healthy(self, n: int, timeout: float = 5.0):
        await self.wait_until(lambda: sum(w.state == HEALTHY for w in self.router.registry.snapshot()) >= n,
                              f"{n} healthy workers", timeout)

    async def wait_unhealthy(self, worker_id: str, timeout: float = 5.0):
        await self.wait_until(lambda: self.router.registry.workers[worker_id].state != HEALTHY,
                              f"{worker_id} unhealthy", timeout)

    async def __aexit__(self, *exc):
        await self.channel.close()
        for reg in self.registrations:
            await reg.stop()
        await self.router.stop(grace=0)
        for w in self.workers:
            await w.server.stop(0)

    async def generate(self, text: str, max_tokens: int = 8, **kw):
        req = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0), **kw)
        return [c async for c in self.gen.Generate(req)]

    async def metrics(self) -> str:
        """A scrape, from another thread: the event loop serves /metrics."""
        def scrape() -> str:
            with urllib.request.urlopen(f"http://{self.router.metrics_address}/metrics", timeout=5) as r:
                return r.read().decode()

        return await asyncio.to_thread(scrape)


def expected_tokens(text: str, n: int) -> list[int]:
    req = pb.GenerateRequest(text=text)
    return [fake_token(req, i) for i in range(n)]


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_relays_a_stream():
    async def main():
        async with Cluster() as c:
            chunks = await c.generate("hello", max_tokens=6, request_id="r1")
            assert tokens(chunks) == expected_tokens("hello", 6)
            assert all(ch.request_id == "r1" for ch in chunks)
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert chunks[-1].usage.completion_tokens == 6
            models = await c.gen.ListModels(pb.ListModelsRequest())
            assert [m.id for m in models.models] == ["fake"]
            text = await c.metrics()
            assert 'orchard_router_requests_total{outcome="success",worker=' in text
            assert 'orchard_router_workers{state="healthy"} 2.0' in text
            assert "orchard_router_time_to_first_token_seconds_count 1.0" in text

    run(main())


def test_retry_before_the_first_token():
    async def main():
        async with Cluster() as c:
            await c.registrations[0].stop()
            c.workers[0].die()  # still registered and healthy for the router
            for i in range(4):
                chunks = await c.generate(f"prompt {i}")
                assert tokens(chunks) == expected_tokens(f"prompt {i}", 8)
                assert {ch.worker_id for ch in chunks} == {"w1"}
            assert c.router.registry.workers["w0"].state != HEALTHY
            assert 'orchard_router_retries_total{kind="retry"} 1.0' in await c.metrics()

    run(main())


@pytest.mark.parametrize("die_after", [1, 5])
def test_resume_mid_stream(die_after):
    async def main():
        async with Cluster(policy="round_robin") as c:
            c.workers[0].die_after_tokens = die_after
            c.workers[0].token_delay = 0.01
            chunks = await c.generate("resume me", max_tokens=12)
            assert tokens(chunks) == expected_tokens("resume me", 12)
            assert [ch.worker_id for ch in chunks][: die_after] == ["w0"] * die_after
            assert chunks[-1].worker_id == "w1"
            assert chunks[-1].usage.completion_tokens == 12
            assert len(c.workers[1].requests[-1].resume_token_ids) == die_after
            assert 'orchard_router_retries_total{kind="resume"} 1.0' in await c.metrics()

    run(main())


def test_many_streams_survive_a_worker_death():
    async def main():
        async with Cluster() as c:
            c.workers[0].die_after_tokens = 40
            texts = [f"stream {i}" for i in range(16)]
            results = await asyncio.gather(*(c.generate(t, max_tokens=20) for t in texts))
            for t, chunks in zip(texts, results):
                assert tokens(chunks) == expected_tokens(t, 20)

    run(main())


def test_resume_waits_for_a_worker_that_missed_heartbeats():
    """w0 dies mid-stream while w1, the only other worker, is unhealthy for the router (its
    heartbeats stopped, as on an overloaded machine) but alive: the request waits for w1 to
    report in and resumes there as soon as it does. With nothing coming back (and no hold:
    --resume-wait 0), it fails once `worker_wait` is over."""

    async def main():
        loop = asyncio.get_running_loop()
        async with Cluster(policy="round_robin", worker_wait=30) as c:
            await c.registrations[1].stop()
            await c.wait_unhealthy("w1")
            c.workers[0].die_after_tokens, c.workers[0].token_delay = 3, 0.01
            task = asyncio.create_task(c.generate("wait for me", max_tokens=12))
            await asyncio.sleep(0.5)
            assert not task.done()  # waiting, not failed
            back = loop.time()
            reg = Registration(c.router.grpc_address, c.workers[1].address, c.workers[1].load_report,
                               join_token="tok", worker_id="w1", interval=0.2)
            reg.start()
            c.registrations.append(reg)
            chunks = await asyncio.wait_for(task, 5)
            assert loop.time() - back < 2.0  # woken by w1's heartbeat, not by the end of the wait
            assert tokens(chunks) == expected_tokens("wait for me", 12)
            assert chunks[0].worker_id == "w0" and chunks[-1].worker_id == "w1"
            assert 'orchard_router_retries_total{kind="resume"} 1.0' in await c.metrics()

        async with Cluster(n_workers=1, worker_wait=0.3, resume_wait=0) as c:
            await c.registrations[0].stop()
            await c.wait_unhealthy("w0")
            t0 = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("nobody comes")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "w0: unhealthy" in e.value.details()
            assert loop.time() - t0 >= 0.3

    run(main())


def test_a_waiting_request_sees_drains_and_removals():
    """While a request waits for unhealthy w1, an operator's undrain of w0 places it on w0 at
    once; the removal of w1 (nothing left to wait for, and no hold: --resume-wait 0) fails
    the next one at once."""

    async def main():
        loop = asyncio.get_running_loop()
        async with Cluster(worker_wait=30, resume_wait=0) as c:
            await c.ctl.DrainWorker(pb.DrainWorkerRequest(worker_id="w0", drain=True))
            await c.registrations[1].stop()
            await c.wait_unhealthy("w1")
            task = asyncio.create_task(c.generate("undrained", max_tokens=4))
            await asyncio.sleep(0.3)
            assert not task.done()
            t0 = loop.time()
            await c.ctl.DrainWorker(pb.DrainWorkerRequest(worker_id="w0", drain=False))
            chunks = await asyncio.wait_for(task, 5)
            assert loop.time() - t0 < 2.0
            assert {ch.worker_id for ch in chunks} == {"w0"}

            await c.ctl.DrainWorker(pb.DrainWorkerRequest(worker_id="w0", drain=True))
            task = asyncio.create_task(c.generate("removed", max_tokens=4))
            await asyncio.sleep(0.3)
            assert not task.done()
            t0 = loop.time()
            await c.ctl.RemoveWorker(pb.RemoveWorkerRequest(worker_id="w1"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(task, 5)
            assert loop.time() - t0 < 2.0
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()

    run(main())


def test_request_errors_are_not_retried():
    async def main():
        async with Cluster() as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("invalid")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert sum(len(w.requests) for w in c.workers) == 0
            assert 'orchard_router_retries_total{kind="retry"} 0.0' in await c.metrics()

    run(main())


def test_no_worker_for_the_model():
    async def main():
        async with Cluster(n_workers=1, resume_wait=0) as c:  # no hold: a drained model's requests fail at once
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("x", model="nope")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert "fake" in e.value.details()
            await c.ctl.DrainWorker(pb.DrainWorkerRequest(worker_id="w0", drain=True))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("x", model="fake")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in e.value.details()
            assert c.workers[0].draining  # forwarded to the worker
            await c.ctl.DrainWorker(pb.DrainWorkerRequest(worker_id="w0", drain=False))
            assert tokens(await c.generate("x", model="fake"))

    run(main())


def test_a_per_request_feature_goes_only_to_a_worker_that_has_it():
    """`speculative: true` over two workers of a model, one speculating: it alternated 200
    and 400 (the 400 telling the client to restart a worker with a flag). Now it goes to the
    one that speculates every time, and when none does it is the same 400 every time, naming
    the model, without reaching a worker."""
    def asking(text: str, speculative: bool | None = True) -> pb.GenerateRequest:
        return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=2, speculative=speculative))

    async def main():
        async with Cluster(n_workers=0, policy="round_robin") as c:
            plain = await c.add_worker("w0")
            fast = await c.add_worker("w1", features=("speculative",))
            await c.wait_healthy(2)
            for i in range(8):
                chunks = [ch async for ch in c.gen.Generate(asking(f"q{i}"))]
                assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(fast.requests) == 8 and not plain.requests
            for i in range(4):  # the rest still go anywhere
                await c.generate(f"r{i}", max_tokens=2)
                chunks = [ch async for ch in c.gen.Generate(asking(f"s{i}", speculative=False))]
                assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(plain.requests) == 4

            fast.features = ()  # its next heartbeat says it no longer speculates
            await c.wait_until(lambda: not c.router.registry.workers["w1"].report.features, "w1's new report")
            reached = len(plain.requests) + len(fast.requests)
            answers = set()
            for i in range(6):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [ch async for ch in c.gen.Generate(asking(f"t{i}"))]
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                answers.add(e.value.details())
            assert len(answers) == 1, answers
            (details,) = answers
            assert "no worker of model 'fake' runs speculative decoding" in details, details
            assert "--speculative-config" not in details and "start" not in details, details
            with pytest.raises(InvalidRequest) as e:  # the HTTP fronts' 400 names the field, as a worker's does
                [ch async for ch in c.router.backend.generate(asking("u"))]
            assert e.value.param == "speculative" and e.value.message == details
            assert len(plain.requests) + len(fast.requests) == reached

    run(main())


def test_wrong_join_token_is_refused():
    async def main():
        async with Cluster(n_workers=0) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.ctl.RegisterWorker(pb.RegisterWorkerRequest(worker_id="x", address="127.0.0.1:1",
                                                                    join_token="bad"))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            w = await FakeWorker("x").start()
            reg = Registration(c.router.grpc_address, w.address, w.load_report, join_token="bad", interval=0.1)
            await asyncio.wait_for(reg.start(), 5)  # the loop ends by itself
            assert reg.denied and not c.router.registry.workers
            await w.server.stop(0)

    run(main())


def test_client_cancel_reaches_the_worker():
    async def main():
        async with Cluster(n_workers=1) as c:
            w = c.workers[0]
            w.token_delay = 0.05
            call = c.gen.Generate(pb.GenerateRequest(text="long", sampling=pb.SamplingParams(max_tokens=1000)))
            async for _ in call:
                break
            call.cancel()
            # a loaded machine may take seconds to carry the cancel through the router; the
            # stream's 1000 tokens take far longer than the bound, so only a cancel ends it
            await c.wait_until(lambda: w.cancelled and not w.running and not c.router.registry.workers["w0"].inflight,
                               "the cancel at the worker", timeout=30)
            assert w.cancelled == 1 and w.tokens_streamed < 1000

    run(main())


def test_router_restart_workers_register_again():
    async def main():
        async with Cluster() as c:
            port = c.router.grpc_port
            await c.router.stop(grace=0)
            cfg = RouterConfig(grpc_address=f"127.0.0.1:{port}", http_address=None, metrics_address=None,
                               join_token="tok", heartbeat_interval=0.2)
            c.router = RouterServer(cfg)
            await c.router.start()
            await c.wait_healthy(2, timeout=5)
            # the router counts a worker healthy as it registers it, a moment before the
            # worker has read the reply: wait for the workers' own count
            await c.wait_until(lambda: all(r.registrations >= 2 for r in c.registrations), "re-registrations")
            assert all(r.registrations == 2 for r in c.registrations)

    run(main())


def test_silent_worker_becomes_unhealthy():
    async def main():
        async with Cluster() as c:
            await c.registrations[0].stop()  # no more heartbeats
            await asyncio.sleep(0.9)  # > 3 intervals of 0.2 s
            states = {w.worker_id: w.state for w in c.router.registry.snapshot()}
            assert states == {"w0": pb.WORKER_STATE_UNHEALTHY, "w1": HEALTHY}
            for i in range(3):
                assert {ch.worker_id for ch in await c.generate(f"p{i}")} == {"w1"}

    run(main())


def test_static_worker_is_polled():
    async def main():
        async with Cluster(n_workers=0) as c:
            w = await FakeWorker("s0").start()
            c.workers.append(w)
            resp = await c.ctl.AddWorker(pb.AddWorkerRequest(address=w.address))
            assert resp.worker_id == "s0"
            w.extra_running = 5
            await asyncio.sleep(0.5)
            info = (await c.ctl.ListWorkers(pb.ListWorkersRequest())).workers
            assert [(i.worker_id, i.static, i.state, i.load.num_running) for i in info] == [("s0", True, HEALTHY, 5)]
            assert tokens(await c.generate("static"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.ctl.AddWorker(pb.AddWorkerRequest(address="127.0.0.1:1"))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    run(main())


def test_placement_follows_load_and_prefix():
    async def main():
        async with Cluster() as c:
            c.workers[0].extra_running = 30
            await asyncio.sleep(0.5)  # a heartbeat carries it
            for i in range(4):
                assert {ch.worker_id for ch in await c.generate(f"short {i}")} == {"w1"}
            c.workers[0].extra_running = 0
            await asyncio.sleep(0.5)
            prefix = "a long shared system prompt about apples and pears. " * 10
            first = (await c.generate(prefix + "q0"))[0].worker_id
            for i in range(1, 5):
                assert (await c.generate(prefix + f"q{i}"))[0].worker_id == first

    run(main())


def test_a_refused_request_leaves_the_prefix_index_unchanged():
    """The prefix index learns a placement once the worker accepted the request (its first
    chunk): a prompt the worker refused is in no worker's cache, and hostile refused
    prompts must not fill the router's index."""
    async def main():
        async with Cluster() as c:
            index = c.router.policy.index
            for w in c.workers:
                w.fail_with = grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("a prompt every worker refuses. " * 10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(index) == 0 and not +index.held and len(c.router.policy.placing) == 0
            for w in c.workers:
                w.fail_with = None
            served = (await c.generate("a prompt a worker serves. " * 10))[0].worker_id
            assert len(index) > 0 and set(+index.held) == {served} and len(c.router.policy.placing) == 0

    run(main())


def test_start_failure_frees_what_started():
    """A busy metrics port: start() raises a clear error and the gRPC port is free again."""
    import socket

    from cluster.up import free_port

    async def main():
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen(1)
            metrics = f"127.0.0.1:{busy.getsockname()[1]}"
            grpc_address = f"127.0.0.1:{free_port()}"
            router = RouterServer(RouterConfig(grpc_address=grpc_address, http_address=None,
                                               metrics_address=metrics))
            with pytest.raises(OSError, match=f"cannot listen on {metrics} for metrics"):
                await router.start()
        again = RouterServer(RouterConfig(grpc_address=grpc_address, http_address=None, metrics_address=None))
        await again.start()  # the same gRPC port: the first router let it go
        await again.stop(grace=0)

    run(main())


async def _victim_first(c: Cluster, attr: str, after: int, stop_heartbeats: bool = False):
    """Make whichever worker streams first misbehave (`attr` = `after` tokens) and the other
    behave; optionally stop the victim's heartbeats too (a sleeping Mac)."""
    for w in c.workers:
        setattr(w, attr, after)
    while not any(w.tokens_streamed >= after for w in c.workers):
        await asyncio.sleep(0.005)
    victim = next(i for i, w in enumerate(c.workers) if w.tokens_streamed >= after)
    setattr(c.workers[1 - victim], attr, None)
    if stop_heartbeats:
        await c.registrations[victim].stop()
    return victim


@pytest.mark.parametrize("heartbeats", ["on", "off"])
def test_a_stream_that_goes_silent_resumes_elsewhere(heartbeats):
    """A worker that stops sending mid-stream while its connection lives (a wedged engine
    still heartbeating, or a sleeping Mac) is dead for that stream after the idle timeout:
    the stream resumes on the other worker, token-exact, instead of hanging."""
    async def main():
        async with Cluster(stream_idle_timeout=0.5) as c:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            victim = asyncio.create_task(_victim_first(c, "hang_after_tokens", 3, heartbeats == "off"))
            chunks = await c.generate("hello there", max_tokens=10)
            took = loop.time() - t0
            v = await victim
            assert tokens(chunks) == expected_tokens("hello there", 10)
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert {ch.worker_id for ch in chunks[3:]} == {f"w{1 - v}"}
            assert took < 5.0
            assert 'orchard_router_retries_total{kind="resume"} 1.0' in await c.metrics()

    run(main())


def test_a_stream_whose_worker_leaves_the_pool_under_it_resumes_elsewhere():
    """A worker removed from the registry mid-stream (its node lost, a replica removed):
    its channel closes and gRPC cancels the call locally, which is no client leaving: the
    stream resumes on the other worker, token-exact (it ended with a CancelledError)."""
    async def main():
        async with Cluster(stream_idle_timeout=60) as c:
            victim = asyncio.create_task(_victim_first(c, "hang_after_tokens", 3))
            streaming = asyncio.ensure_future(c.generate("hello there", max_tokens=10))
            v = await asyncio.wait_for(victim, 10)
            c.router.registry.remove(f"w{v}")
            chunks = await asyncio.wait_for(streaming, 20)
            assert tokens(chunks) == expected_tokens("hello there", 10)
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert {ch.worker_id for ch in chunks[3:]} == {f"w{1 - v}"}

    run(main())


def test_a_silent_worker_has_its_streams_resumed_even_before_their_first_token():
    """A Mac asleep: no heartbeat, and its open streams quiet (no token yet, so no idle
    timeout applies): once it has missed its heartbeats they resume elsewhere, long before
    the stream idle timeout."""
    async def main():
        async with Cluster(stream_idle_timeout=60) as c:
            for w in c.workers:
                w.hang_after_tokens = 0

            async def sleep_one():
                while not any(w.requests for w in c.workers):
                    await asyncio.sleep(0.005)
                victim = next(i for i, w in enumerate(c.workers) if w.requests)
                c.workers[1 - victim].hang_after_tokens = None
                await c.registrations[victim].stop()
                return victim

            loop = asyncio.get_running_loop()
            t0 = loop.time()
            asleep = asyncio.create_task(sleep_one())
            chunks = await c.generate("asleep", max_tokens=6)
            victim = await asleep
            assert tokens(chunks) == expected_tokens("asleep", 6)
            assert {ch.worker_id for ch in chunks} == {f"w{1 - victim}"}
            assert loop.time() - t0 < 10.0

    run(main())


def test_a_stream_that_ends_without_finishing_resumes_elsewhere():
    async def main():
        async with Cluster() as c:
            victim = asyncio.create_task(_victim_first(c, "end_after_tokens", 4))
            chunks = await c.generate("cut short", max_tokens=12)
            await victim
            assert tokens(chunks) == expected_tokens("cut short", 12)
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH

    run(main())


def test_a_stream_never_ends_short_even_with_nowhere_to_resume():
    """With no other worker to resume on, the client gets an error, never a short answer
    that looks finished."""
    async def main():
        async with Cluster(n_workers=1, worker_wait=0.2) as c:
            c.workers[0].end_after_tokens = 3
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("cut short", max_tokens=12)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "ended before the request finished" in e.value.details()

    run(main())


def test_a_worker_reporting_a_stalled_engine_has_its_streams_resumed_at_once():
    """A wedged engine's watchdog says so in the load report: its streams, even those that
    have no token yet (no idle timeout applies to them), resume elsewhere at once."""
    async def main():
        async with Cluster(stream_idle_timeout=60) as c:
            for w in c.workers:
                w.hang_after_tokens = 0  # whoever gets it sends nothing at all

            async def wedge():
                while not any(w.requests for w in c.workers):
                    await asyncio.sleep(0.005)
                victim = next(w for w in c.workers if w.requests)
                other = next(w for w in c.workers if w is not victim)
                other.hang_after_tokens = None
                victim.stalled = True
                return victim

            loop = asyncio.get_running_loop()
            t0 = loop.time()
            wedged = asyncio.create_task(wedge())
            chunks = await c.generate("stuck", max_tokens=6)
            victim = await wedged
            assert loop.time() - t0 < 5.0
            assert tokens(chunks) == expected_tokens("stuck", 6)
            assert {ch.worker_id for ch in chunks} == {next(w for w in c.workers if w is not victim).worker_id}
            assert c.router.registry.workers[victim.worker_id].state == pb.WORKER_STATE_UNHEALTHY
            victim.stalled = False
            await c.wait_healthy(2)  # its next report clears it

    run(main())



def test_a_poison_request_fails_after_two_workers_and_no_more():
    """A request that breaks the engine (INTERNAL) on two workers is failed to its client
    with INTERNAL and not tried on a third; other requests go on."""
    async def main():
        async with Cluster(n_workers=3) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("poison pill")
            assert e.value.code() == grpc.StatusCode.INTERNAL and "2 workers" in e.value.details()
            assert sum(len(w.requests) for w in c.workers) == 2
            assert tokens(await c.generate("fine")) == expected_tokens("fine", 8)
            text = await c.metrics()
            assert "orchard_router_poison_requests_total 1.0" in text

    run(main())


def test_a_failing_worker_that_heartbeats_is_held_off_by_its_circuit_breaker():
    """A worker that fails every request but keeps reporting healthy: after 3 failures in a
    row its circuit opens and it gets no requests (while it stays open), then one probe."""
    async def main():
        # a cool-down that the requests sent while it is open cannot outlast on a loaded machine
        async with Cluster(circuit_cooldown=3.0) as c:
            bad, good = c.workers
            bad.fail_with = grpc.StatusCode.UNAVAILABLE
            for i in range(12):
                assert tokens(await c.generate(f"q{i}")) == expected_tokens(f"q{i}", 8)
                await c.wait_healthy(2)  # its heartbeats make it healthy again at once
            assert len(bad.requests) == 3  # then the circuit held it off
            assert "orchard_router_circuit_open{worker=\"w0\"} 1.0" in await c.metrics()
            await asyncio.sleep(3.1)  # the cool-down is over: one probe; it fails, open again
            for i in range(4):
                await c.generate(f"r{i}")
            assert len(bad.requests) == 4
            bad.fail_with = None
            await asyncio.sleep(6.1)  # open for twice as long, then a probe that succeeds closes it
            for i in range(6):
                await c.generate(f"s{i}")
            assert len(bad.requests) >= 5 and bad.requests[-1].text.startswith("s")
            assert "orchard_router_circuit_open{worker=\"w0\"} 0.0" in await c.metrics()

    run(main())


def test_a_second_router_carries_an_sdk_stream_through_the_first_ones_death():
    """Workers register with two routers; the SDK, given both, resumes a stream broken by
    its router's death on the other, after the tokens it has: one unbroken stream."""
    from cluster.sdk import AsyncClient

    async def main():
        routers = []
        for _ in range(2):
            r = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                          join_token="tok", heartbeat_interval=0.2))
            await r.start()
            routers.append(r)
        workers = [await FakeWorker(f"w{i}", token_delay=0.02).start() for i in range(2)]
        regs = [Registration(r.grpc_address, w.address, w.load_report, join_token="tok", worker_id=w.worker_id,
                             interval=0.2) for w in workers for r in routers]
        for reg in regs:
            reg.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while any(sum(x.state == HEALTHY for x in r.registry.snapshot()) < 2 for r in routers):
                assert loop.time() < deadline, "workers did not register with both routers"
                await asyncio.sleep(0.02)
            got, seen = [], []
            async with AsyncClient([routers[0].grpc_address, routers[1].grpc_address], timeout=20) as client:
                async for chunk in client.stream("two routers", max_tokens=30, temperature=0):
                    got += chunk.token_ids
                    seen.append(client.target)
                    if len(got) == 5:
                        await routers[0].stop(grace=0)  # the first router dies mid-stream
                    last = chunk
            assert got == expected_tokens("two routers", 30)
            assert last.finish_reason == "length" and last.usage.completion_tokens == 30
            assert seen[0] == routers[0].grpc_address and seen[-1] == routers[1].grpc_address
        finally:
            for reg in regs:
                await reg.stop()
            for r in routers:
                await r.stop(grace=0)
            for w in workers:
                await w.server.stop(0)

    run(main())


def test_a_restarted_worker_starts_with_its_circuit_closed():
    """A worker whose circuit is half-open keeps its one probe while it stays registered
    (a registration of the same process changes nothing); once it registers as a new
    process, its circuit is closed and 6 requests sent together all go through."""
    async def main():
        async with Cluster(n_workers=1, circuit_cooldown=0.5, resume_wait=0) as c:
            record = c.router.registry.workers["w0"]

            async def half_open():
                for _ in range(3):
                    record.breaker.on_failure()  # as 3 failed requests in a row do
                await c.wait_until(lambda: record.breaker.state == "half_open", "a half-open circuit")

            async def six():
                return await asyncio.gather(*(c.generate(f"six {i}") for i in range(6)), return_exceptions=True)

            await half_open()
            same = c.registrations[0]
            await c.ctl.RegisterWorker(pb.RegisterWorkerRequest(
                worker_id="w0", address=c.workers[0].address, join_token="tok", load=c.workers[0].load_report(),
                instance_id=same.instance_id))
            results = await six()
            failed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert len(failed) == 5 and all("circuit half_open" in e.details() for e in failed)

            await half_open()
            await c.kill(c.workers[0])
            c.restart(c.workers[0])
            await c.wait_until(lambda: record.breaker.state == "closed", "a closed circuit")
            assert record.breaker.failures == 0
            results = await six()
            for i, r in enumerate(results):
                assert tokens(r) == expected_tokens(f"six {i}", 8)

    run(main())


def test_a_sole_workers_streams_are_held_until_it_restarts():
    """The only worker of the model dies mid-stream: its streams are held (no error), a new
    request sent meanwhile too, and all resume token-exact on the restarted worker."""
    async def main():
        async with Cluster(n_workers=1, resume_wait=30) as c:
            w = c.workers[0]
            w.token_delay, w.die_after_tokens = 0.01, 20
            for reg in c.registrations:
                await reg.stop()  # dead processes send no heartbeats
            streams = [asyncio.create_task(c.generate(f"held {i}", max_tokens=12, model="fake")) for i in range(4)]
            held = c.router.backend.held
            await c.wait_until(lambda: len(held) == 4, "4 held streams", timeout=10)
            late = asyncio.create_task(c.generate("sent during the outage", max_tokens=5, model="fake"))
            await c.wait_until(lambda: len(held) == 5, "the new request held", timeout=10)
            assert not any(t.done() for t in streams) and set(held.values()) == {"fake"}
            c.restart(w)
            for i, t in enumerate(streams):
                chunks = await asyncio.wait_for(t, 10)
                assert tokens(chunks) == expected_tokens(f"held {i}", 12)
                assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert tokens(await asyncio.wait_for(late, 10)) == expected_tokens("sent during the outage", 5)
            assert not held and c.router.backend.holding == 0
            assert 'orchard_router_retries_total{kind="resume"} 4.0' in await c.metrics()

    run(main())


def test_a_hold_ends_with_503_and_retry_after():
    """Past --resume-wait a held request gets UNAVAILABLE (HTTP 503 with Retry-After) naming
    the model and the wait; past --max-held a request is refused at once."""
    import aiohttp

    async def main():
        loop = asyncio.get_running_loop()
        async with Cluster(n_workers=1, http=True, resume_wait=1.0, max_held=1) as c:
            await c.kill(c.workers[0])
            await c.wait_unhealthy("w0")
            t0 = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("nobody comes", model="fake")
            assert loop.time() - t0 >= 1.0
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no worker of model 'fake'" in e.value.details() and "within 1 s" in e.value.details()
            assert "--resume-wait" in e.value.details()
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with aiohttp.ClientSession() as http:
                url = f"http://{c.router.http_address}/v1/chat/completions"
                async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=20)) as r:
                    assert r.status == 503 and int(r.headers["Retry-After"]) > 0
                    assert "no worker of model 'fake'" in (await r.json())["error"]["message"]
                completion = {"model": "fake", "prompt": "hi", "stream": True}
                async with http.post(f"http://{c.router.http_address}/v1/completions", json=completion,
                                     timeout=aiohttp.ClientTimeout(total=20)) as r:
                    assert r.status == 503 and int(r.headers["Retry-After"]) > 0
                first = asyncio.create_task(c.generate("holds the one place", model="fake"))
                await c.wait_until(lambda: c.router.backend.holding == 1, "one held request")
                t0 = loop.time()
                async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=20)) as r:
                    assert r.status == 503 and "Retry-After" in r.headers
                    assert "--max-held" in (await r.json())["error"]["message"]
                assert loop.time() - t0 < 0.9  # at once, not after a hold
                with pytest.raises(grpc.aio.AioRpcError):
                    await first

    run(main())


def test_an_openai_stream_stays_connected_through_a_hold(monkeypatch):
    """The real `openai` client streams through the router's HTTP front while the only
    worker dies and restarts: it gets the whole stream; a raw reader sees the SSE comments
    that kept the connection in use meanwhile."""
    import aiohttp
    import openai

    from cluster.api import streams

    monkeypatch.setattr(streams, "KEEPALIVE_SECONDS", 0.1)

    async def main():
        async with Cluster(n_workers=1, http=True, resume_wait=30) as c:
            w = c.workers[0]
            w.token_delay = 0.01
            client = openai.AsyncOpenAI(base_url=f"http://{c.router.http_address}/v1", api_key="x", timeout=30,
                                        max_retries=0)
            messages = [{"role": "user", "content": "hold on"}]

            async def text() -> str:
                parts = []
                stream = await client.chat.completions.create(model="fake", messages=messages, max_tokens=24,
                                                              temperature=0, stream=True)
                async for chunk in stream:
                    parts += [ch.delta.content or "" for ch in chunk.choices]
                return "".join(parts)

            whole = await text()
            assert whole.count("<") == 24
            for reg in c.registrations:
                await reg.stop()
            w.die_after_tokens = w.tokens_streamed + 6
            comments = []

            async def raw():
                body = {"model": "fake", "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True}
                async with aiohttp.ClientSession() as http:
                    async with http.post(f"http://{c.router.http_address}/v1/chat/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=30)) as r:
                        async for line in r.content:
                            if line.startswith(b":"):
                                comments.append(line.decode().strip())

            streams = asyncio.create_task(text()), asyncio.create_task(raw())
            await c.wait_until(lambda: len(c.router.backend.held) == 2, "2 held streams", timeout=10)
            await c.wait_until(lambda: len(comments) >= 2, "keepalive comments", timeout=10)
            c.restart(w)
            got, _ = await asyncio.wait_for(asyncio.gather(*streams), 20)
            assert got == whole
            assert set(comments) == {": waiting for a worker of fake"}
            await client.close()

    run(main())


@pytest.mark.slow
def test_a_held_grpc_stream_outlasts_its_clients_keepalive_pings():
    """A gRPC client with Orchard's keepalive (a ping every 10 s) held for over a minute,
    past the worker's removal: its pings are not taken for abuse (GOAWAY "too_many_pings"
    cut such a call after about 50 s), and the stream completes once a worker is back."""
    from cluster.net import CHANNEL_OPTIONS

    async def main():
        async with Cluster(n_workers=1, resume_wait=120) as c:
            w = c.workers[0]
            await c.kill(w)
            await c.wait_unhealthy("w0")
            async with grpc.aio.insecure_channel(c.router.grpc_address, options=CHANNEL_OPTIONS) as ch:
                req = pb.GenerateRequest(text="a long hold", model="fake",
                                         sampling=pb.SamplingParams(max_tokens=6, temperature=0))
                held = asyncio.create_task(_chunks(pb_grpc.GenerationStub(ch).Generate(req)))
                done, _ = await asyncio.wait({held}, timeout=65)
                assert not done, held.result()
                assert "w0" not in c.router.registry.workers  # removed after its silence: still held
                c.restart(w)
                assert tokens(await asyncio.wait_for(held, 20)) == expected_tokens("a long hold", 6)

    run(main(), timeout=120)


async def _chunks(call) -> list:
    return [c async for c in call]


def test_a_worker_that_cannot_start_is_listed_with_why_and_a_permanent_failure_ends_the_hold():
    """The model's only worker dies and its restart fails: a transient failure keeps the
    model's requests held (the launcher starts it again), a permanent one (exit 78) fails
    them at once with the reason instead of after --resume-wait; ListWorkers and `orchard
    router workers` show the failure until the worker registers again."""
    from cluster.router.admin import format_workers

    async def main():
        async with Cluster(n_workers=1, resume_wait=30) as c:
            w = c.workers[0]
            w.token_delay, w.die_after_tokens = 0.01, 5
            for reg in c.registrations:
                await reg.stop()
            held = c.router.backend.held
            stream = asyncio.create_task(c.generate("cut short", max_tokens=12, model="fake"))
            await c.wait_until(lambda: len(held) == 1, "the stream held", timeout=10)

            def report(code: int, reason: str):
                return c.ctl.ReportFailure(pb.ReportFailureRequest(
                    worker_id="w0", join_token="tok", model="fake", reason=reason, exit_code=code,
                    permanent=code == 78))

            await report(75, "rank 1 did not join within 60 s")
            rows = (await c.ctl.ListWorkers(pb.ListWorkersRequest())).workers
            assert [(r.worker_id, r.state, r.failure.exit_code) for r in rows] == [("w0", pb.WORKER_STATE_FAILED, 75)]
            await asyncio.sleep(0.5)
            assert not stream.done() and len(held) == 1  # transient: still held for the restart
            late = asyncio.create_task(c.generate("sent meanwhile", max_tokens=3, model="fake"))
            await c.wait_until(lambda: len(held) == 2, "the new request held", timeout=10)

            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await report(78, "the model at /m is not rank 0's (its config.json differs)")
            for t in (stream, late):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await asyncio.wait_for(t, 10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "worker w0 could not start" in e.value.details()
                assert "config.json differs" in e.value.details() and "until that is fixed" in e.value.details()
            assert loop.time() - t0 < 10 and not held  # at once, not after --resume-wait (30 s)
            with pytest.raises(grpc.aio.AioRpcError) as e:  # a new request: the same answer, no hold
                await c.generate("after", model="fake")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "config.json differs" in e.value.details()
            table = format_workers(list((await c.ctl.ListWorkers(pb.ListWorkersRequest())).workers))
            assert "failed" in table and "exit 78; not started again until that is fixed" in table
            assert "config.json differs" in table

            with pytest.raises(grpc.aio.AioRpcError) as e:  # only the fleet may report
                await c.ctl.ReportFailure(pb.ReportFailureRequest(worker_id="w0", join_token="wrong", model="fake"))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

            c.restart(w)  # fixed and started: the failure is forgotten
            await c.wait_healthy(1)
            rows = (await c.ctl.ListWorkers(pb.ListWorkersRequest())).workers
            assert [(r.worker_id, r.state) for r in rows] == [("w0", pb.WORKER_STATE_HEALTHY)]
            assert tokens(await c.generate("served", max_tokens=4, model="fake")) == expected_tokens("served", 4)

    run(main())


def test_start_failures_are_bounded_in_number_and_length():
    """A fleet's failure reports take bounded memory: the oldest go first, a long reason is
    cut, and a report needs a worker id."""
    from cluster.router.registry import MAX_FAILURE_REASON, MAX_FAILURES, Registry, RegistryConfig, RegistryError

    async def main():
        reg = Registry(RegistryConfig(join_token="tok"), connect=False)
        for i in range(MAX_FAILURES + 5):
            reg.report_failure(f"w{i}", "tok", "m", "x" * (MAX_FAILURE_REASON * 3), 75, False)
        assert len(reg.failures) == MAX_FAILURES and "w0" not in reg.failures and f"w{MAX_FAILURES + 4}" in reg.failures
        assert all(len(f.reason) <= MAX_FAILURE_REASON + 4 for f in reg.failures.values())
        with pytest.raises(RegistryError) as e:
            reg.report_failure("", "tok", "m", "why", 78, True)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.param == "worker_id"

    run(main())
