"""What the load/ scripts share: a server subprocess and its output lines, Orchard's worker
and mlx_lm.server started alike (OpenBLAS first, float32 weights reported), prompts of a
given length, a streaming completions load over HTTP and its summary (TTFT, ITL, TPOT,
percentiles). A script imports it as `_common` (load/ is on its path when it runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]

# mlx_lm.server, started the way the worker starts: OpenBLAS first. It reports the dtypes
# of the weights it loaded and the BLAS it runs on, then runs mlx_lm.server's own main().
MLX_WRAPPER = r"""
import json, sys
from cluster import platform
platform.preload_blas()  # OpenBLAS before MLX, exactly as `orchard worker serve` does
import mlx_lm.server as server
from mlx.utils import tree_flatten

_load = server.load
def load(*args, **kwargs):
    out = _load(*args, **kwargs)
    dtypes = sorted({str(p.dtype).removeprefix("mlx.core.") for _, p in tree_flatten(out[0].parameters())})
    print("BENCH_LOADED " + json.dumps({"dtypes": dtypes, "blas": platform.blas_path()}), flush=True)
    return out
server.load = load
sys.argv = ["mlx_lm.server", *sys.argv[1:]]
server.main()
"""


class Server:
    """A server subprocess whose output lines are collected by a thread."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=ROOT)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no {prefix!r} line in {timeout:.0f} s:\n"
                                   + "".join(self.log[-20:])) from None
            if line is None:
                raise RuntimeError(f"{self.name} exited with {self.proc.wait()}:\n" + "".join(self.log[-30:]))
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# -- the load ---------------------------------------------------------------------------------
def make_prompts(model_dir: Path, n: int, tokens: int) -> list[str]:
    """n distinct texts of about `tokens` tokens (the model's own tokenizer)."""
    from tokenizers import Tokenizer

    from cluster.modelgen import synthetic_corpus

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lines = synthetic_corpus(seed=1234, num_words=40_000)[50:]  # skip the fixed English header
    prompts = []
    for i in range(n):
        ids: list[int] = []
        j = i * 41
        while len(ids) < tokens:
            ids += tok.encode(lines[j % len(lines)]).ids
            j += 1
        prompts.append(f"Request {i}: " + tok.decode(ids[:tokens]))
    return prompts


@dataclass
class RequestResult:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    end: float = 0.0


async def one_request(session: aiohttp.ClientSession, url: str, payload: dict) -> RequestResult:
    r = RequestResult(time.perf_counter())
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                r.completion_tokens = obj["usage"]["completion_tokens"]
                r.prompt_tokens = obj["usage"]["prompt_tokens"]
            choices = obj.get("choices") or []
            if choices and choices[0].get("text"):
                r.chunk_times.append(time.perf_counter())
    r.end = time.perf_counter()
    return r


async def run_load(url: str, prompts: list[str], extra: dict, max_tokens: int, concurrency: int,
                   force_close: bool = False) -> tuple[list, float]:
    """force_close: a connection per request (llama-server closes a connection after a
    streamed response, which a pooled connection would find only when it writes)."""
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=concurrency * 2, force_close=force_close)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def limited(prompt: str) -> RequestResult:
            async with sem:
                payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                           "stream_options": {"include_usage": True}, **extra}
                return await one_request(session, url, payload)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return results, time.perf_counter() - t0


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall: float, max_tokens: int) -> dict:
    ttft = [r.chunk_times[0] - r.start for r in results if r.chunk_times]
    itl = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.completion_tokens - 1)
            for r in results if r.completion_tokens > 1 and len(r.chunk_times) > 1]
    tokens = sum(r.completion_tokens for r in results)
    return {
        "requests": len(results),
        "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in results),
        "completion_tokens": tokens,
        "all_full_length": all(r.completion_tokens == max_tokens for r in results),
        "wall_s": wall,
        "ttft_mean": statistics.mean(ttft), "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
        "itl_mean": statistics.mean(itl) if itl else float("nan"), "itl_p50": percentile(itl, 0.5),
        "tpot_mean": statistics.mean(tpot) if tpot else float("nan"),
        "output_tok_s": tokens / wall,
    }


# -- the servers -----------------------------------------------------------------------------
def start_orchard(model: Path, worker_args: list[str], started: list[Server] | None = None
                  ) -> tuple[Server, str, dict]:
    """`started`: the server is added to it at once, so a caller stops it even when it
    never comes up."""
    argv = [sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(model), "--grpc", "127.0.0.1:0",
            "--metrics", "127.0.0.1:0", "--http", "127.0.0.1:0", *worker_args]
    server = Server("orchard worker", argv)
    if started is not None:
        started.append(server)
    info = json.loads(server.wait_line("ORCHARD_WORKER_READY ", timeout=600))
    return server, f"http://{info['http']}", info


def start_mlx(model: Path, extra_args: list[str] = (), name: str = "mlx_lm.server") -> tuple[Server, str, dict]:
    """mlx_lm.server through MLX_WRAPPER; `extra_args`: its own flags (e.g. a draft model)."""
    from cluster.up import free_port

    port = free_port()
    argv = [sys.executable, "-c", MLX_WRAPPER, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "WARNING", *extra_args]
    server = Server(name, argv)
    info = json.loads(server.wait_line("BENCH_LOADED ", timeout=600))
    return server, f"http://127.0.0.1:{port}", info


async def wait_http(url: str, extra: dict, timeout: float = 300) -> None:
    """Ready when a tiny completion succeeds (this also warms the server up)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 4,
                                                                        "temperature": 0.0, **extra}) as r:
                    if r.status == 200:
                        await r.read()
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer")
            await asyncio.sleep(0.2)
