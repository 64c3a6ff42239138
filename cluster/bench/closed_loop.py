"""A closed-loop gRPC load for the router benchmarks (load/bench_*.py): `orchard bench`
(cluster/bench/serve.py) is the open-loop, vllm-bench-serve-style one.

`run_load(target, requests, concurrency)` keeps `concurrency` streams open until every
request is done and returns per-request TTFT, tokens and latency, plus the wall time.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import urllib.request
from dataclasses import dataclass, field

import grpc

from cluster.bench.server_metrics import parse, total
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc


@dataclass
class RequestResult:
    ttft: float
    latency: float
    num_tokens: int
    cached_tokens: int
    prompt_tokens: int
    worker_id: str


@dataclass
class LoadResult:
    results: list[RequestResult] = field(default_factory=list)
    duration: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.num_tokens for r in self.results)

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the run."""
        return self.tokens / self.duration if self.duration else 0.0

    def ttft_percentile(self, q: float) -> float:
        xs = sorted(r.ttft for r in self.results)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def ttft_p50(self) -> float:
        return statistics.median(r.ttft for r in self.results)

    @property
    def ttft_mean(self) -> float:
        return statistics.fmean(r.ttft for r in self.results)


def text_request(text: str, max_tokens: int, model: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, model=model, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def one_request(stub, request: pb.GenerateRequest) -> RequestResult:
    """Send one request on `stub` and time it."""
    t0 = time.perf_counter()
    ttft, n, last = None, 0, None
    async for chunk in stub.Generate(request):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        n += len(chunk.token_ids)
        last = chunk
    return RequestResult(ttft=ttft or 0.0, latency=time.perf_counter() - t0, num_tokens=n,
                         cached_tokens=last.usage.cached_tokens, prompt_tokens=last.usage.prompt_tokens,
                         worker_id=last.worker_id)


async def run_load_async(target: str, requests: list[pb.GenerateRequest], concurrency: int) -> LoadResult:
    out = LoadResult()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await channel.channel_ready()
        queue = list(reversed(requests))

        async def client():
            while queue:
                out.results.append(await one_request(stub, queue.pop()))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        out.duration = time.perf_counter() - t0
    return out


def run_load(target: str, requests: list[pb.GenerateRequest], concurrency: int) -> LoadResult:
    return asyncio.run(run_load_async(target, requests, concurrency))


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_sum(text: str, name: str) -> float:
    """Sum of a metric's samples over all label sets."""
    return total(parse(text), name)
