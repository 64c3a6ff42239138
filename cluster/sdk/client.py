"""`Client` (blocking) and `AsyncClient` (asyncio) over gRPC, for a worker or the router.

    from cluster.sdk import Client
    with Client("127.0.0.1:50051") as c:
        print(c.generate("Once upon a time", max_tokens=32, temperature=0).text)
        for chunk in c.stream("Hello", max_tokens=16):
            print(chunk.text, end="", flush=True)

`stream` yields `Chunk`s; closing the iterator (or leaving the loop early) cancels the
request, which frees its place on the worker at once. Failed calls raise the typed
errors of `cluster.api.errors`, exported by `cluster.sdk` (InvalidRequest, NotFound,
Overloaded, Unavailable, DeadlineExceeded, Cancelled, ...). `timeout` is in seconds, per
call or per client.
"""

from __future__ import annotations

from typing import AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api.errors import Unavailable, from_rpc_error
from cluster.api.servicer import STREAM_ENDED_SHORT, finished
from cluster.api.wire import Message, build_request
from cluster.net import CHANNEL_OPTIONS
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.sdk.types import Chunk, Completion

DEFAULT_TARGET = "127.0.0.1:50051"  # the router; a worker (127.0.0.1:50061) answers too
_UNSET = object()


def _options(options) -> list[tuple]:
    """Keepalive and quick reconnects (`cluster.net.CHANNEL_OPTIONS`), then the caller's."""
    return [*CHANNEL_OPTIONS, *(options or ())]


def _request(prompt, messages, params) -> pb.GenerateRequest:
    if isinstance(prompt, pb.GenerateRequest):
        return prompt
    return build_request(prompt, messages=messages, **params)


class GrpcBackend:
    """A `cluster.api.servicer.Backend` over a grpc.aio channel (a remote worker or
    router): what `AsyncClient` calls through, and what the OpenAI HTTP front can sit on.
    Errors come out as `cluster.api.errors` exceptions."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float | None = None):
        self.channel = channel
        self.timeout = timeout
        self._stub = pb_grpc.GenerationStub(channel)

    async def generate(self, request: pb.GenerateRequest, timeout=_UNSET) -> AsyncIterator[pb.GenerateResponse]:
        call = self._stub.Generate(request, timeout=self.timeout if timeout is _UNSET else timeout)
        try:
            async for response in call:
                yield response
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once the call is done; cancels it if the consumer left early

    async def list_models(self, timeout=_UNSET) -> pb.ListModelsResponse:
        try:
            timeout = self.timeout if timeout is _UNSET else timeout
            return await self._stub.ListModels(pb.ListModelsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


class AsyncClient:
    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 channel: grpc.aio.Channel | None = None, options: Sequence[tuple] | None = None):
        self.target = target
        self.timeout = timeout
        self._own_channel = channel is None
        self.channel = channel or grpc.aio.insecure_channel(target, options=_options(options))
        self.backend = GrpcBackend(self.channel, timeout)
        self._admin = pb_grpc.WorkerAdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_channel:
            await self.channel.close()

    def _timeout(self, timeout):
        return self.timeout if timeout is _UNSET else timeout

    async def stream(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
                     messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> AsyncIterator[Chunk]:
        """Yield chunks as they come. `await it.aclose()` (or leaving `async for`) cancels."""
        request = _request(prompt, messages, params)
        gen = finished(self.backend.generate(request, timeout=self._timeout(timeout)))
        try:
            async for response in gen:
                yield Chunk.from_proto(response)
        finally:
            await gen.aclose()

    async def generate(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
                       messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> Completion:
        """The whole generation: text, token ids, finish reason, usage."""
        result = Completion()
        async for chunk in self.stream(prompt, messages=messages, timeout=timeout, **params):
            result.add(chunk)
        return result

    async def chat(self, messages: Iterable[Message], *, timeout=_UNSET, **params) -> Completion:
        return await self.generate(messages=messages, timeout=timeout, **params)

    async def list_models(self, *, timeout=_UNSET) -> list[pb.ModelInfo]:
        return list((await self.backend.list_models(timeout=self._timeout(timeout))).models)

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, timeout=self._timeout(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def get_load(self, *, timeout=_UNSET) -> pb.LoadReport:
        """A worker's load report (WorkerAdmin)."""
        return await self._unary(self._admin.GetLoad, pb.GetLoadRequest(), timeout)

    async def drain(self, drain: bool = True, *, timeout=_UNSET) -> pb.DrainResponse:
        """Make a worker stop (or resume) taking new requests (WorkerAdmin)."""
        return await self._unary(self._admin.Drain, pb.DrainRequest(drain=drain), timeout)

    async def health(self, service: str = "", *, timeout=_UNSET) -> str:
        """grpc.health.v1 status name: 'SERVING', 'NOT_SERVING', ..."""
        r = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class Client:
    """The blocking twin of `AsyncClient` (plain grpc channel, no event loop)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 channel: grpc.Channel | None = None, options: Sequence[tuple] | None = None):
        self.target = target
        self.timeout = timeout
        self._own_channel = channel is None
        self.channel = channel or grpc.insecure_channel(target, options=_options(options))
        self._stub = pb_grpc.GenerationStub(self.channel)
        self._admin = pb_grpc.WorkerAdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._own_channel:
            self.channel.close()

    def _timeout(self, timeout):
        return self.timeout if timeout is _UNSET else timeout

    def stream(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
               messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> Iterator[Chunk]:
        """Yield chunks as they come. `it.close()` (or leaving the loop) cancels the request."""
        request = _request(prompt, messages, params)
        call = self._stub.Generate(request, timeout=self._timeout(timeout))
        try:
            for response in call:
                yield Chunk.from_proto(response)
                if response.finish_reason:
                    return
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()
        raise Unavailable(STREAM_ENDED_SHORT)  # never take a cut-off answer for a whole one

    def generate(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
                 messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> Completion:
        result = Completion()
        for chunk in self.stream(prompt, messages=messages, timeout=timeout, **params):
            result.add(chunk)
        return result

    def chat(self, messages: Iterable[Message], *, timeout=_UNSET, **params) -> Completion:
        return self.generate(messages=messages, timeout=timeout, **params)

    def _unary(self, method, request, timeout):
        try:
            return method(request, timeout=self._timeout(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def list_models(self, *, timeout=_UNSET) -> list[pb.ModelInfo]:
        return list(self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout).models)

    def get_load(self, *, timeout=_UNSET) -> pb.LoadReport:
        return self._unary(self._admin.GetLoad, pb.GetLoadRequest(), timeout)

    def drain(self, drain: bool = True, *, timeout=_UNSET) -> pb.DrainResponse:
        return self._unary(self._admin.Drain, pb.DrainRequest(drain=drain), timeout)

    def health(self, service: str = "", *, timeout=_UNSET) -> str:
        r = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
