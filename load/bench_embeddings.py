"""Embeddings: Orchard's worker against mlx-lm's forward one input at a time, and what an
embedding load does to the TTFT of generation requests on the same worker.

    .venv/bin/python load/bench_embeddings.py                 # everything (a few minutes on 2 cores)
    .venv/bin/python load/bench_embeddings.py --skip-ttft

1. Throughput, on a `small` Qwen3-Embedding-style model (qwen3, 8 layers, hidden 512,
   last-token pooling, normalized: `orchard model create --kind embedding --size small`):
   - baseline: mlx-lm's own model in this process, one input at a time, as a user's
     script would (`model.model(ids)`, the last row, normalized; float32 on the CPU, the
     same OpenBLAS) -- sentence-transformers would need torch, which this machine has no
     build of beside MLX's;
   - Orchard: `orchard worker serve` with HTTP, the same inputs as POST /v1/embeddings
     requests of `--batch` inputs, `--concurrency` requests in flight.
   For short texts (~16 tokens) and long ones (~400 tokens): inputs/s, tokens/s, and
   Orchard's ratio to the baseline. Every Orchard embedding is checked against the
   baseline's (cosine > 0.9999) before any figure is printed. The measured inputs are
   distinct and new to the worker (no prefix-cache hit).
2. TTFT beside an embedding load: a `small` generation model served with --embeddings;
   `--streams` concurrent generation streams (prompt ~64 tokens, 32 new tokens, one
   after another per stream) measured alone, then again while a client keeps requests of
   16 long texts in flight on /v1/embeddings. TTFT mean / p50 / p90 both ways, and the
   embedding inputs/s served meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from cluster import platform  # noqa: E402

platform.preload_blas()  # before MLX is imported
from cluster.modelgen import create_model  # noqa: E402
from cluster.models_cache import builtin_model  # noqa: E402
from conftest import WorkerProcess  # noqa: E402  (the tests' `orchard worker serve` subprocess helper)


def texts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` distinct inputs of about `length` tokens (random words of the tokenizer's vocabulary)."""
    rng = random.Random(seed)
    vocab = [t for t in range(tokenizer.vocab_size) if t > 20]
    return [[rng.choice(vocab) for _ in range(max(1, length + rng.randint(-length // 4, length // 4)))]
            for _ in range(n)]


def baseline(path: Path, inputs: list[list[int]]) -> tuple[float, list[np.ndarray]]:
    """mlx-lm one input at a time: seconds, embeddings."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, _ = load(str(path))
    model.set_dtype(mx.float32)

    def one(ids):
        h = model.model(mx.array([ids]))[0, -1].astype(mx.float32)
        v = h / mx.linalg.norm(h)
        mx.eval(v)
        return np.array(v)

    one(inputs[0])  # warm up
    t0 = time.perf_counter()
    out = [one(ids) for ids in inputs]
    return time.perf_counter() - t0, out


async def orchard(http: str, inputs: list[list[int]], batch: int, concurrency: int,
                  warm_up: list[list[int]]) -> tuple[float, list[np.ndarray]]:
    """The inputs as /v1/embeddings requests of `batch` token-id lists, `concurrency` at a
    time, after one request of other inputs (`warm_up`: the measured ones must not be in
    the prefix cache, which last-token pooling uses)."""
    chunks = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    out: list = [None] * len(chunks)
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def send(i):
            async with sem, session.post(f"http://{http}/v1/embeddings",
                                         json={"input": chunks[i], "encoding_format": "float"}) as r:
                body = await r.json()
                assert r.status == 200, body
                out[i] = [np.array(d["embedding"], np.float32) for d in body["data"]]

        async with session.post(f"http://{http}/v1/embeddings", json={"input": warm_up}) as r:
            assert r.status == 200, await r.text()
        t0 = time.perf_counter()
        await asyncio.gather(*(send(i) for i in range(len(chunks))))
        return time.perf_counter() - t0, [v for c in out for v in c]


def throughput(args, tmp: Path) -> None:
    path = create_model(tmp / "emb-small", "qwen3", "small", seed=0, kind="embedding")
    from mlx_lm.utils import load

    tokenizer = load(str(path))[1]
    cases = [("short", texts(tokenizer, args.short, 16, 1)), ("long", texts(tokenizer, args.long, 400, 2))]
    w = WorkerProcess(path, "--max-model-len", "1024", "--max-pooling-inputs", "256", http=True)
    try:
        print(f"model: {path.name} (qwen3 small, hidden 512, last-token pooling); batch {args.batch}, "
              f"concurrency {args.concurrency}")
        print(f"{'texts':>6} {'inputs':>6} {'tokens':>7} | {'mlx-lm 1-by-1 in/s':>18} {'tok/s':>8} | "
              f"{'Orchard in/s':>12} {'tok/s':>8} | {'ratio':>5}")
        for name, inputs in cases:
            n_tok = sum(map(len, inputs))
            base_s, want = baseline(path, inputs)
            warm_up = texts(tokenizer, 4, len(inputs[0]), 99)
            ours_s, got = asyncio.run(orchard(w.http, inputs, args.batch, args.concurrency, warm_up))
            worst = min(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(got, want))
            assert worst > 0.9999, f"an embedding differs from mlx-lm's (cosine {worst})"
            print(f"{name:>6} {len(inputs):>6} {n_tok:>7} | {len(inputs) / base_s:>18.1f} {n_tok / base_s:>8.0f} | "
                  f"{len(inputs) / ours_s:>12.1f} {n_tok / ours_s:>8.0f} | {base_s / ours_s:>5.2f}x"
                  f"   (min cosine {worst:.6f})")
    finally:
        w.stop()


async def ttft_load(http: str, prompts: list[list[int]], streams: int, per_stream: int) -> list[float]:
    ttfts: list[float] = []
    async with aiohttp.ClientSession() as session:
        async def stream(k):
            for j in range(per_stream):
                body = {"prompt": prompts[(k * per_stream + j) % len(prompts)], "max_tokens": 32, "stream": True,
                        "temperature": 0, "ignore_eos": True}
                t0 = time.perf_counter()
                first = None
                async with session.post(f"http://{http}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.perf_counter() - t0
                ttfts.append(first)

        await asyncio.gather(*(stream(k) for k in range(streams)))
    return ttfts


async def embed_load(http: str, tokenizer, seed: int, stop: asyncio.Event, counter: list[int]) -> None:
    """Requests of 16 new long texts (never a prefix-cache hit), one after another."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            seed += 1000
            batch = texts(tokenizer, 16, 400, seed)
            async with session.post(f"http://{http}/v1/embeddings", json={"input": batch}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            counter[0] += len(batch)


async def ttft_pair(http: str, prompts, tokenizer, args) -> tuple[list[float], list[float], float]:
    alone = await ttft_load(http, prompts[: len(prompts) // 2], args.streams, args.per_stream)
    stop, counter = asyncio.Event(), [0]
    t0 = time.perf_counter()
    loaders = [asyncio.create_task(embed_load(http, tokenizer, 10 + k, stop, counter)) for k in range(2)]
    await asyncio.sleep(1.0)  # the embedding load is running
    beside = await ttft_load(http, prompts[len(prompts) // 2:], args.streams, args.per_stream)
    stop.set()
    await asyncio.gather(*loaders)
    return alone, beside, counter[0] / (time.perf_counter() - t0)


def ttft(args) -> None:
    path = builtin_model()
    from mlx_lm.utils import load

    tokenizer = load(str(path))[1]
    prompts = texts(tokenizer, 2 * args.streams * args.per_stream, 64, 3)
    w = WorkerProcess(path, "--embeddings", "--max-model-len", "2048", http=True)
    try:
        alone, beside, rate = asyncio.run(ttft_pair(w.http, prompts, tokenizer, args))
    finally:
        w.stop()

    def stats(xs):
        xs = sorted(xs)
        return f"{statistics.mean(xs) * 1000:7.0f} {xs[len(xs) // 2] * 1000:7.0f} {xs[int(0.9 * len(xs))] * 1000:7.0f}"

    print(f"\nTTFT of generation ({args.streams} streams x {args.per_stream} requests, ~64-token prompts, 32 tokens) "
          f"on {path.name} served with --embeddings")
    print(f"{'':>28} {'mean':>7} {'p50':>7} {'p90':>7}  (ms)")
    print(f"{'alone':>28} {stats(alone)}")
    print(f"{'beside an embedding load':>28} {stats(beside)}   ({rate:.1f} long inputs/s embedded meanwhile)")
    print(f"{'ratio (beside / alone)':>28} {statistics.mean(beside) / statistics.mean(alone):7.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", type=int, default=96, help="short texts")
    p.add_argument("--long", type=int, default=16, help="long texts")
    p.add_argument("--batch", type=int, default=32, help="inputs per /v1/embeddings request")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    p.add_argument("--streams", type=int, default=4, help="generation streams (TTFT)")
    p.add_argument("--per-stream", type=int, default=6, help="requests per stream (TTFT)")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_throughput:
            throughput(args, Path(tmp))
        if not args.skip_ttft:
            ttft(args)


if __name__ == "__main__":
    main()
