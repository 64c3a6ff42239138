"""A request that takes down the workers it reaches (a tensor-parallel group whose rank
fails inside a collective exits): the router fails it as poison, with INTERNAL naming the
two workers it took down, instead of resuming it a third time, while the streams that
were under way there resume and finish exactly. The workers are fake ones in processes of
their own (tests/crashing_worker.py), so their deaths are real ones as gRPC sees them.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.registry import HEALTHY
from cluster.router.server import RouterConfig, RouterServer
from cluster.up import free_ports
from fake_worker import fake_token

ROOT = Path(__file__).resolve().parent.parent


class Workers:
    """Crashing fake workers as processes, each started again when it dies (as `orchard up`
    starts a lost group again) while `restart` allows; counts their starts."""

    def __init__(self, router: str, n: int, restart: bool):
        self.router = router
        self.ports = free_ports(n)
        self.restart = restart
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts = 0
        self.deaths = 0
        self.alive = 0  # processes serving at the end of the scenario
        for i in range(n):
            self.start(f"w{i}")

    def start(self, worker_id: str) -> None:
        port = self.ports[int(worker_id[1:])]
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "crashing_worker.py"), self.router, worker_id,
                                 str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout.readline().strip() == "SERVING"
        self.procs[worker_id] = proc
        self.starts += 1

    async def supervise(self) -> None:
        while True:
            for worker_id, proc in list(self.procs.items()):
                if proc.poll() is not None and proc.returncode != -9:
                    self.deaths += 1
                    proc.returncode = -9  # counted
                    if self.restart:
                        await asyncio.to_thread(self.start, worker_id)
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _expected(text: str, n: int) -> list[int]:
    req = pb.GenerateRequest(text=text)
    return [fake_token(req, i) for i in range(n)]


async def _scenario(n_workers: int, restart: bool, streams: int) -> tuple[grpc.aio.AioRpcError, Workers, list, str]:
    """`streams` streams under way, then a request that crashes any worker it reaches.
    Returns the poison's error, the workers, each stream's chunks and the router's metrics."""
    router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                       join_token="tok", heartbeat_interval=0.2, resume_wait=60.0))
    await router.start()
    workers = await asyncio.to_thread(Workers, router.grpc_address, n_workers, restart)
    supervisor = asyncio.create_task(workers.supervise())
    channel = grpc.aio.insecure_channel(router.grpc_address)
    gen = pb_grpc.GenerationStub(channel)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while sum(w.state == HEALTHY for w in router.registry.snapshot()) < n_workers:
            assert loop.time() < deadline, "the workers did not register"
            await asyncio.sleep(0.05)

        started = [asyncio.Event() for _ in range(streams)]

        async def stream(i: int) -> list:
            req = pb.GenerateRequest(text=f"stream {i}", sampling=pb.SamplingParams(max_tokens=80, temperature=0))
            out = []
            async for chunk in gen.Generate(req, timeout=120):
                out.append(chunk)
                started[i].set()
            return out

        tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
        for e in started:
            await asyncio.wait_for(e.wait(), 30)
        with pytest.raises(grpc.aio.AioRpcError) as poison:
            await gen.Generate(pb.GenerateRequest(text="crash me", sampling=pb.SamplingParams(max_tokens=8)),
                               timeout=120).read()
        chunks = await asyncio.gather(*tasks)
        workers.alive = sum(p.poll() is None for p in workers.procs.values())
        return poison.value, workers, chunks, generate_latest(router.metrics.prometheus).decode()
    finally:
        supervisor.cancel()
        await channel.close()
        await router.stop(grace=0)
        workers.stop()


def test_a_request_that_takes_down_two_workers_is_failed_as_poison():
    """Three workers, streams under way on each: the poison request ends the process of the
    worker it is placed on, then of the one it is resumed on, and is failed there (INTERNAL,
    naming the 2 workers it took down); the third worker is never tried with it. Every
    stream, resumed off the dead workers, ends with exactly its tokens."""
    error, workers, chunks, metrics = asyncio.run(asyncio.wait_for(_scenario(3, restart=False, streams=6), 180))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "took down 2 workers" in error.details() and "not tried again" in error.details()
    assert workers.deaths == 2 and workers.alive == 1
    for i, got in enumerate(chunks):
        assert _tokens(got) == _expected(f"stream {i}", 80), f"stream {i}"
    assert "orchard_router_poison_requests_total 1.0" in metrics


def test_a_sole_worker_restarted_after_a_poison_is_taken_down_once_more_and_no_more():
    """One worker, started again whenever it dies: the poison request takes it down, is
    held until it is back, takes it down once more and is failed as poison; the streams
    under way resume on each new start and finish exactly, and the third start serves on."""
    error, workers, chunks, _ = asyncio.run(asyncio.wait_for(_scenario(1, restart=True, streams=3), 180))
    assert error.code() == grpc.StatusCode.INTERNAL and "took down 2 workers" in error.details()
    assert workers.deaths == 2 and workers.starts == 3 and workers.alive == 1
    for i, got in enumerate(chunks):
        assert _tokens(got) == _expected(f"stream {i}", 80), f"stream {i}"


def test_a_request_that_fails_alone_on_a_sole_worker_gets_its_cause():
    """A worker that fails a request with INTERNAL (its engine found that request breaks its
    step) and no other worker to try it on: the client gets INTERNAL with the worker's
    cause (HTTP 500), not UNAVAILABLE (503, which says: try again)."""
    from conftest import run
    from test_router_fake import Cluster, expected_tokens, tokens

    async def main():
        async with Cluster(n_workers=1) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("poison pill")
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "the engine failed: RuntimeError: poisoned" in e.value.details()
            assert len(c.workers[0].requests) == 1
            assert tokens(await c.generate("fine")) == expected_tokens("fine", 8)

    run(main())
