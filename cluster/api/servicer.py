"""`Generation` over gRPC on any `Backend`: the one servicer of the worker and the router.

`Backend` writes down the interface that the worker's service, the router's proxy and the
SDK's `GrpcBackend` share, and that the OpenAI HTTP front sits on.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Protocol

from cluster.api.errors import OrchardError, Unavailable
from cluster.api.wire import num_choices
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc


STREAM_ENDED_SHORT = "the stream ended before the request finished (its server went away): retry it"


class Backend(Protocol):
    """The contract of a `Generation` backend (the worker's `WorkerService`, the router's
    `RouterBackend`, the SDK's `GrpcBackend`).

    `generate(request, timeout)` is an async generator of `GenerateResponse` chunks: the
    tokens and text of each step, the last one with `finish_reason` and `usage` (a stream
    that ends without one is an error to its client, never a short answer). It raises
    `cluster.api.errors` exceptions (before or during the stream); closing it early (the
    client left) cancels the request wherever it runs. `timeout` is the seconds left of
    the caller's deadline, or None. `list_models()` names what it serves. `embed(request,
    timeout)` and `score(request, timeout)` answer an `EmbedRequest` / `ScoreRequest` whole
    (cluster/api/pooling.py), raising the same errors; cancelling them cancels the request.
    `tokenize(request, timeout)` is the prompt a `GenerateRequest` makes, not run."""

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        ...

    async def list_models(self) -> pb.ListModelsResponse:
        ...

    async def embed(self, request: pb.EmbedRequest, timeout: float | None = None) -> pb.EmbedResponse:
        ...

    async def score(self, request: pb.ScoreRequest, timeout: float | None = None) -> pb.ScoreResponse:
        ...

    async def tokenize(self, request: pb.GenerateRequest, timeout: float | None = None) -> pb.TokenizeResponse:
        ...


async def finished(chunks: AsyncIterator[pb.GenerateResponse], n: int = 1) -> AsyncIterator[pb.GenerateResponse]:
    """A backend's stream up to its last finish chunk (one per sample of `n`; an abort
    ends them all); Unavailable if it ends before, so a client never takes a cut-off
    answer for a whole one. Closing this closes `chunks`."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield chunk
            if chunk.finish_reason:
                n -= 1
                if n <= 0 or chunk.finish_reason == pb.FINISH_REASON_ABORT:
                    return
    raise Unavailable(STREAM_ENDED_SHORT)


class GenerationServicer(pb_grpc.GenerationServicer):
    """`Generation` on a backend: chunks are relayed as they come, errors become statuses,
    and the RPC's end (done, cancelled, deadline) closes the backend's stream at once."""

    def __init__(self, backend: Backend):
        self.backend = backend

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        try:
            # closed here when the RPC ends or is cancelled: the backend's stream at once
            async with contextlib.aclosing(finished(self.backend.generate(request, timeout=context.time_remaining()),
                                                    num_choices(request))) as chunks:
                async for chunk in chunks:
                    yield chunk
        except OrchardError as e:
            await context.abort(e.code, e.message)

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        try:
            return await self.backend.embed(request, timeout=context.time_remaining())
        except OrchardError as e:
            await context.abort(e.code, e.message)

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        try:
            return await self.backend.score(request, timeout=context.time_remaining())
        except OrchardError as e:
            await context.abort(e.code, e.message)

    async def Tokenize(self, request: pb.GenerateRequest, context) -> pb.TokenizeResponse:
        try:
            return await self.backend.tokenize(request, timeout=context.time_remaining())
        except OrchardError as e:
            await context.abort(e.code, e.message)

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        try:
            return await self.backend.list_models()
        except OrchardError as e:
            await context.abort(e.code, e.message)
