"""A scripted engine behind the real worker service and HTTP app: the model's real
tokenizer and chat template, an output chosen by the test.

Random weights never call a tool by themselves; this engine answers each request with the
text `reply(prompt_text)` returns, tokenized by the model's tokenizer and streamed one
token per step through the engine's own incremental detokenizer, so everything after the
sampler (detokenizing, stop strings, tool-call parsing, the OpenAI / Responses / Messages
fronts) runs as it does on a real worker. It records the rendered prompts.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from aiohttp import web

from cluster.worker.detokenizer import IncrementalDetokenizer
from cluster.worker.engine import EngineStats, RequestOutput


class ScriptedEngine:
    def __init__(self, model_dir: Path, reply: Callable[[str], str] | str = "hello", step_seconds: float = 0.0):
        from mlx_lm.tokenizer_utils import load

        self.tokenizer = load(Path(model_dir))
        self.model_name = Path(model_dir).name
        self.vocab_size = len(self.tokenizer.get_vocab())
        self.config = SimpleNamespace(max_model_len=4096, max_num_seqs=8, block_size=16, finish_wait_ms=0.0)
        self.stats = EngineStats(num_blocks_total=64)
        self.reply = reply
        self.prompts: list[str] = []  # every request's rendered prompt, in order
        self.params: list = []
        self.seqs: dict[str, dict] = {}
        self.step_seconds = step_seconds  # a step's time, as a real model's (each step's chunk then travels alone)

    def add_request(self, rid, prompt, params, arrival_time=None, resume_token_ids=()):
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        self.prompts.append(text)
        self.params.append(params)
        reply = self.reply(text) if callable(self.reply) else self.reply
        resumed = list(resume_token_ids)  # the script continues after them, as a resumed request does
        self.seqs[rid] = dict(out=self.tokenizer.encode(reply, add_special_tokens=False), i=len(resumed),
                              prompt=list(prompt), params=params,
                              detok=IncrementalDetokenizer(self.tokenizer, list(prompt) + resumed, params.stop,
                                                           kept_special=params.kept_special_ids))

    def abort(self, rid):
        return self.seqs.pop(rid, None) is not None

    def abort_all(self):
        ids = list(self.seqs)
        self.seqs.clear()
        return ids

    def has_unfinished(self):
        return bool(self.seqs)

    def live_request_ids(self):
        return list(self.seqs)

    def request_state(self, rid):
        s = self.seqs[rid]
        return s["prompt"], s["out"][:s["i"]], s["params"], 0.0

    num_waiting = 0

    def is_waiting(self, rid):
        return False

    def step(self):
        if self.step_seconds:
            time.sleep(self.step_seconds)
        outs = []
        for rid, s in list(self.seqs.items()):
            if s["i"] >= len(s["out"]):  # the script is done: the model's end of turn
                text = s["detok"].take_delta(final=True)
                outs.append(RequestOutput(rid, [], text, True, "stop", num_prompt_tokens=len(s["prompt"]),
                                          num_output_tokens=s["i"]))
                del self.seqs[rid]
                continue
            tok = s["out"][s["i"]]
            s["i"] += 1
            stop = s["detok"].add(tok)
            done = stop is not None or s["i"] >= s["params"].max_tokens
            text = s["detok"].take_delta(final=done)
            outs.append(RequestOutput(rid, [tok], text, done, ("stop" if stop else "length") if done else None,
                                      stop_reason=stop, num_prompt_tokens=len(s["prompt"]), num_output_tokens=s["i"]))
            if done:
                del self.seqs[rid]
        self.stats.num_steps += 1
        return outs


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
            pb_grpc.add_WorkerAdminServicer_to_server(WorkerAdminServicer(SimpleNamespace(service=svc)), grpc_server)
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
