"""A fake worker for router tests: `Generation` + `WorkerAdmin` + gRPC health, no model.

Token i of a request is a pure function of its prompt and i, so any worker continues any
stream exactly (what greedy decoding gives the real engine); `resume_token_ids` are
honoured as the real worker does. It can be told to die (now, or after a number of
tokens): from then on every stream fails with UNAVAILABLE, as calls to a dead process do.
(Stopping the grpc.aio server from inside its own handler can crash grpc; real process
deaths are tested with real workers.)
"""

from __future__ import annotations

import asyncio
import hashlib

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc


def fake_token(request: pb.GenerateRequest, i: int) -> int:
    prompt = request.WhichOneof("prompt")
    data = f"{prompt}:{getattr(request, prompt) if prompt else ''}:{i}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little") % 1000


class FakeWorker(pb_grpc.GenerationServicer, pb_grpc.WorkerAdminServicer):
    def __init__(self, worker_id: str, model: str = "fake", token_delay: float = 0.005,
                 features: tuple[str, ...] = ()):
        self.worker_id = worker_id
        self.model = model
        self.features = features  # per-request features it reports ("speculative"), and refuses without
        self.token_delay = token_delay
        self.die_after_tokens: int | None = None  # total tokens streamed before dying
        self.hang_after_tokens: int | None = None  # total tokens streamed before going silent (a sleeping Mac)
        self.end_after_tokens: int | None = None  # total tokens streamed before ending streams without a finish
        self.stalled = False  # what its load reports say of its engine (a wedged engine's watchdog)
        self.lagging = False  # ... of its current step: running well past its usual time
        self.fail_with: grpc.StatusCode | None = None  # fail every request at once with this status
        self.padding = 0  # characters added to each chunk's text (messages past gRPC's size limits)
        self.dead = False
        self.requests: list[pb.GenerateRequest] = []
        self.running = 0
        self.extra_running = 0  # pretend load
        self.draining = False
        self.cancelled = 0
        self.tokens_streamed = 0
        self.server = None
        self.port = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> "FakeWorker":
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GenerationServicer_to_server(self, self.server)
        pb_grpc.add_WorkerAdminServicer_to_server(self, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    def die(self) -> None:
        self.dead = True

    def load_report(self) -> pb.LoadReport:
        return pb.LoadReport(
            worker_id=self.worker_id, model=self.model, num_running=self.running + self.extra_running,
            kv_blocks_used=0, kv_blocks_total=100, max_num_seqs=64, block_size=16, max_model_len=2048,
            draining=self.draining, stalled=self.stalled, lagging=self.lagging, features=self.features,
        )

    async def GetLoad(self, request, context):
        return self.load_report()

    async def Drain(self, request, context):
        self.draining = request.drain
        return pb.DrainResponse(draining=self.draining, num_running=self.running)

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=self.model, max_model_len=2048)])

    async def Generate(self, request, context):
        if self.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused (dead)")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        if request.text == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt")
        if request.sampling.speculative and "speculative" not in self.features:  # as a real worker refuses it
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "speculative: true, but speculative decoding is off "
                                                                  "on this worker")
        self.requests.append(request)
        if self.fail_with is not None:
            await context.abort(self.fail_with, f"failing on purpose ({self.fail_with.name})")
        if request.text.startswith("poison"):  # breaks any engine it reaches
            await context.abort(grpc.StatusCode.INTERNAL, "the engine failed: RuntimeError: poisoned")
        self.running += 1
        try:
            max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
            start = len(request.resume_token_ids)
            for i in range(start, max_tokens):
                await asyncio.sleep(self.token_delay)
                if self.die_after_tokens is not None and self.tokens_streamed >= self.die_after_tokens:
                    self.dead = True
                if self.dead:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (dead)")
                if self.hang_after_tokens is not None and self.tokens_streamed >= self.hang_after_tokens:
                    await asyncio.Event().wait()  # the connection stays open and nothing more comes
                if self.end_after_tokens is not None and self.tokens_streamed >= self.end_after_tokens:
                    return  # the stream ends OK, but short: no finish reason
                self.tokens_streamed += 1
                tok = fake_token(request, i)
                last = i == max_tokens - 1
                yield pb.GenerateResponse(
                    request_id=request.request_id, token_ids=[tok], text=f"<{tok}>" + "x" * self.padding,
                    worker_id=self.worker_id,
                    finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                    usage=pb.Usage(prompt_tokens=3, completion_tokens=max_tokens) if last else None,
                )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
