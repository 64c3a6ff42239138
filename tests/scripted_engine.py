"""The tests' fake engines: the engine's protocol (`EngineProtocol`) with no model behind
it, driven by the real engine loop, worker service and HTTP app.

`FakeEngine` emits tokens 100, 101, ... one a step, with hooks for the failures a test
plays (a refusal, a step that raises, a step held). `ScriptedEngine` answers with text
the test chooses: random weights never call a tool by themselves; it answers each
request with the text `reply(prompt_text)` returns, tokenized by the model's real
tokenizer and streamed one token per step through the engine's own incremental
detokenizer, so everything after the sampler (detokenizing, stop strings, tool-call
parsing, the OpenAI / Responses / Messages fronts) runs as it does on a real worker. It
records the rendered prompts.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from aiohttp import web

from cluster.worker.detokenizer import IncrementalDetokenizer
from cluster.worker.engine import EngineStats, QueueFullError, RequestOutput
from cluster.worker.engine_protocol import EngineProtocol
from cluster.worker.sampling_params import SamplingParams
from cluster.worker.sequence import SequenceStatus

BOOM = 999  # a prompt starting with this token makes a FakeEngine's step raise


@dataclass
class FakeSeq:
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)  # output tokens so far (resumed ones first)
    status: SequenceStatus = SequenceStatus.WAITING
    arrival: float = 0.0
    script: list[int] = field(default_factory=list)  # a ScriptedEngine's reply, tokenized
    detok: IncrementalDetokenizer | None = None

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens


class FakeEngine(EngineProtocol):
    """Emits tokens 100, 101, ... one per step (text "<100>", ...) until max_tokens. Refuses
    token ids past its vocabulary (500) and "queue full" past `max_waiting` waiting
    requests (None: never); a prompt starting with BOOM makes the step raise; a step
    blocks while `unwedged` is clear. Records what was added (`added`: request id and
    resumed tokens), aborted (`aborted`), and the thread that added the last (`thread`)."""

    def __init__(self, max_waiting: int | None = 3, step_seconds: float = 0.0):
        self.model_name = "fake"
        self.vocab_size = 500
        self.config = SimpleNamespace(max_model_len=2048, max_num_seqs=4, block_size=16, finish_wait_ms=0.0,
                                      kv_disk_dir=None, kv_disk_flush_timeout=10.0)
        self.tokenizer = SimpleNamespace(encode=lambda text: [ord(c) % 50 + 1 for c in text],
                                         decode=lambda ids: "".join(f"<{i}>" for i in ids))
        self.stats = EngineStats(num_blocks_total=8)
        self.seqs: dict[str, FakeSeq] = {}
        self.aborted: list[str] = []
        self.added: list[tuple[str, tuple[int, ...]]] = []  # (request id, resumed tokens), in order
        self.thread = None
        self.unwedged = threading.Event()
        self.unwedged.set()
        self.max_waiting = max_waiting
        self.step_seconds = step_seconds  # a step's time, as a real model's (each step's chunk then travels alone)

    poison: int | None = BOOM  # a prompt that starts with it makes the step raise

    def add_request(self, rid, prompt, params, arrival_time=None, resume_token_ids=()):
        self.thread = threading.current_thread().name
        seq = self.new_seq(list(prompt), params, list(resume_token_ids), arrival_time or 0.0)
        waiting = sum(s.status is SequenceStatus.WAITING for s in self.seqs.values())
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests): retry later")
        self.seqs[rid] = seq
        self.added.append((rid, tuple(resume_token_ids)))

    def new_seq(self, prompt: list[int], params, resumed: list[int], arrival: float) -> FakeSeq:
        if any(t >= self.vocab_size and t != self.poison for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        return FakeSeq(prompt, params, resumed, arrival=arrival)

    def abort(self, rid):
        self.aborted.append(rid)
        return self.seqs.pop(rid, None) is not None

    def abort_all(self):
        ids = list(self.seqs)
        for rid in ids:
            self.abort(rid)
        return ids

    def has_unfinished(self):
        return bool(self.seqs)

    def live_request_ids(self):
        return list(self.seqs)

    def request_state(self, rid):
        s = self.seqs[rid]
        return list(s.prompt), list(s.out), s.params, s.arrival

    num_waiting = 0  # nothing is held back for admission here

    def is_waiting(self, rid):
        return rid in self.seqs and self.seqs[rid].status is SequenceStatus.WAITING

    def step(self):
        self.unwedged.wait()  # a test-only wedge: the step blocks while it is clear
        if self.step_seconds:
            time.sleep(self.step_seconds)
        if any(s.prompt[0] == self.poison for s in self.seqs.values()):
            raise RuntimeError("boom")
        outs = []
        for rid, s in list(self.seqs.items()):
            s.status = SequenceStatus.RUNNING
            out = self.advance(rid, s)
            outs.append(out)
            if out.finished:
                del self.seqs[rid]
        self.stats.num_running = len(self.seqs)
        self.stats.num_steps += 1
        return outs

    def advance(self, rid: str, s: FakeSeq) -> RequestOutput:
        """One step of one request: its next token."""
        tok = 100 + len(s.out)
        s.out.append(tok)
        done = len(s.out) >= s.max_tokens
        return RequestOutput(rid, [tok], f"<{tok}>", done, "length" if done else None,
                             num_prompt_tokens=len(s.prompt), num_output_tokens=len(s.out))


class ScriptedEngine(FakeEngine):
    """A FakeEngine with the model's real tokenizer whose requests answer `reply` (see the
    module docstring); it takes any number of requests waiting, and no prompt fails."""

    poison = None

    def __init__(self, model_dir: Path, reply: Callable[[str], str] | str = "hello", step_seconds: float = 0.0):
        from mlx_lm.tokenizer_utils import load

        super().__init__(max_waiting=None, step_seconds=step_seconds)
        self.tokenizer = load(Path(model_dir))
        self.model_name = Path(model_dir).name
        self.vocab_size = len(self.tokenizer.get_vocab())
        self.config = SimpleNamespace(max_model_len=4096, max_num_seqs=8, block_size=16, finish_wait_ms=0.0,
                                      kv_disk_dir=None, kv_disk_flush_timeout=10.0)
        self.stats = EngineStats(num_blocks_total=64)
        self.reply = reply
        self.prompts: list[str] = []  # every request's rendered prompt, in order
        self.params: list = []

    def new_seq(self, prompt: list[int], params, resumed: list[int], arrival: float) -> FakeSeq:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        self.prompts.append(text)
        self.params.append(params)
        reply = self.reply(text) if callable(self.reply) else self.reply
        # the script continues after the resumed tokens, as a resumed request does
        return FakeSeq(prompt, params, resumed, arrival=arrival,
                       script=self.tokenizer.encode(reply, add_special_tokens=False),
                       detok=IncrementalDetokenizer(self.tokenizer, prompt + resumed, params.stop,
                                                    kept_special=params.kept_special_ids))

    def request_state(self, rid):
        s = self.seqs[rid]
        return s.prompt, s.script[: len(s.out)], s.params, 0.0

    def advance(self, rid: str, s: FakeSeq) -> RequestOutput:
        """The script's next token, or at its end the model's end of turn."""
        i = len(s.out)
        if i >= len(s.script):
            return RequestOutput(rid, [], s.detok.take_delta(final=True), True, "stop", num_prompt_tokens=len(s.prompt),
                                 num_output_tokens=i)
        tok = s.script[i]
        s.out.append(tok)
        stop = s.detok.add(tok)
        done = stop is not None or len(s.out) >= s.max_tokens
        text = s.detok.take_delta(final=done)
        return RequestOutput(rid, [tok], text, done, ("stop" if stop else "length") if done else None,
                             stop_reason=stop, num_prompt_tokens=len(s.prompt), num_output_tokens=len(s.out))


class ScriptedServer:
    """The worker service over a `ScriptedEngine`, its HTTP app (`url`) and gRPC
    `Generation` (`grpc_address`), on 127.0.0.1 and free ports, in a thread of its own (so
    that sync clients can call it) until `stop()`."""

    def __init__(self, engine: ScriptedEngine | Callable[[], object], *, router: bool = False, templates=None,
                 **app_kwargs):
        # an engine, or a function that makes one (a real Engine is built on its own thread:
        # MLX's streams belong to the thread that made them)
        self.engine = engine if not callable(engine) else None
        self._factory = engine if callable(engine) else None
        self.with_router = router  # also a router in front of it (`router_url`), with it as a static worker
        self.templates = templates  # the worker's ChatTemplateLimits (None: the defaults)
        self._app_kwargs = app_kwargs
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        if not self._ready.wait(60) or self.error is not None:
            raise RuntimeError(f"the scripted server did not start: {self.error!r}")

    async def _main(self):
        import grpc

        from cluster.api.app import create_app
        from cluster.api.servicer import GenerationServicer
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
        from cluster.router.config import RouterConfig
        from cluster.router.server import RouterServer
        from cluster.worker.server import WorkerAdminServicer
        from cluster.worker.service import WorkerService

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        def factory():
            if self.engine is None:
                self.engine = self._factory()
            return self.engine

        svc = WorkerService("scripted", factory, metrics=False,
                            **({"templates": self.templates} if self.templates is not None else {}))
        try:
            await svc.start(timeout=30)
            runner = web.AppRunner(create_app(svc, **self._app_kwargs))
            await runner.setup()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            sock.setblocking(False)
            await web.SockSite(runner, sock).start()
            self.port = sock.getsockname()[1]
            grpc_server = grpc.aio.server()
            pb_grpc.add_GenerationServicer_to_server(GenerationServicer(svc), grpc_server)
            admin = WorkerAdminServicer(SimpleNamespace(service=svc, kv_journal=None))
            pb_grpc.add_WorkerAdminServicer_to_server(admin, grpc_server)
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
            self.grpc_address = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
            await grpc_server.start()
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            router = None
            if self.with_router:
                router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0",
                                                   metrics_address=None, heartbeat_interval=0.2,
                                                   static_workers=(self.grpc_address,)))
                await router.start()
                self.router_url = f"http://{router.http_address}"
                self.router_grpc = router.grpc_address
                for _ in range(500):
                    if router.registry.can_serve:
                        break
                    await asyncio.sleep(0.02)
        except BaseException as e:
            self.error = e
            self._ready.set()
            raise
        self._ready.set()
        await self._stop.wait()
        if router is not None:
            await router.stop(grace=0)
        await grpc_server.stop(0)
        await runner.cleanup()
        await svc.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
