"""`Client` (blocking) and `AsyncClient` (asyncio) over gRPC, for a worker or the router.

    from cluster.sdk import Client
    with Client("127.0.0.1:50051") as c:   # api_key= (default $ORCHARD_API_KEY), tls_ca= for TLS
        print(c.generate("Once upon a time", max_tokens=32, temperature=0).text)
        for chunk in c.stream("Hello", max_tokens=16):
            print(chunk.text, end="", flush=True)
        vectors = c.embed(["a text", "another"], dimensions=256)      # an embedding model
        best = c.rerank("a query", ["doc one", "doc two"], top_n=1)   # a reranker

`stream` yields `Chunk`s; closing the iterator (or leaving the loop early) cancels the
request, which frees its place on the worker at once. Failed calls raise the typed
errors of `cluster.api.errors`, exported by `cluster.sdk` (InvalidRequest, NotFound,
Overloaded, Unavailable, DeadlineExceeded, Cancelled, ...). `timeout` is in seconds, per
call or per client. Give several targets (routers) and a stream survives a router's
death: it resumes on the next one after the tokens already received.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api.errors import OrchardError, Unavailable, from_rpc_error
from cluster.api.pooling import build_embed_request, build_score_request
from cluster.api.servicer import STREAM_ENDED_SHORT, finished
from cluster.api.wire import Message, build_request, num_choices
from cluster.net import CHANNEL_OPTIONS
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.sdk.types import Chunk, Completion, Embeddings, Ranked, ranked
from cluster.security import ClientSecurity
from cluster.security import channel as open_channel

DEFAULT_TARGET = "127.0.0.1:50051"  # the router; a worker (127.0.0.1:50061) answers too
_UNSET = object()
log = logging.getLogger(__name__)


def _options(options) -> list[tuple]:
    """Keepalive and quick reconnects (`cluster.net.CHANNEL_OPTIONS`), then the caller's."""
    return [*CHANNEL_OPTIONS, *(options or ())]


def _request(prompt, messages, params) -> pb.GenerateRequest:
    if isinstance(prompt, pb.GenerateRequest):
        return prompt
    return build_request(prompt, messages=messages, **params)


def _targets(target: str | Sequence[str]) -> list[str]:
    targets = [t.strip() for t in target.split(",")] if isinstance(target, str) else [str(t) for t in target]
    targets = [t for t in targets if t]
    if not targets:
        raise ValueError("no target: give HOST:PORT, or several (a list or comma-separated)")
    return targets


# A target gone (its process died, the network to it broke): worth the next one.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})


class _Failover:
    """One stream's way across targets: the tokens received so far, and the request that
    resumes after them on the next target (as the router resumes on another worker)."""

    def __init__(self, request: pb.GenerateRequest, targets: list[str], index: int, timeout: float | None):
        self.request = request
        self.base = list(request.resume_token_ids)
        self.got: list[int] = []
        self.targets, self.index, self.tried = targets, index, 1
        self.n = num_choices(request)
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def received(self, response: pb.GenerateResponse) -> None:
        self.got.extend(response.token_ids)

    def next_target(self, error: OrchardError) -> int:
        """The index of the target to resume on; raises `error` when it is not a target's
        failure or every target was tried."""
        if error.code not in FAILOVER_CODES or self.tried >= len(self.targets) or (self.n > 1 and self.got):
            raise error  # (n samples cannot resume where they stopped)
        self.tried += 1
        self.index = (self.index + 1) % len(self.targets)
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(self.request)
        del resumed.resume_token_ids[:]
        resumed.resume_token_ids.extend(self.base + self.got)
        if self.got:  # the first chunk, with the prompt's logprobs and text, was received
            resumed.sampling.ClearField("prompt_logprobs")
            resumed.sampling.echo = False
        self.request, self.base, self.got = resumed, self.base + self.got, []
        log.info("stream on %s failed (%s); resuming on %s after %d tokens", self.targets[self.index - 1],
                 error.code.name, self.targets[self.index], len(self.base))
        return self.index


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

    async def embed(self, request: pb.EmbedRequest, timeout=_UNSET) -> pb.EmbedResponse:
        try:
            return await self._stub.Embed(request, timeout=self.timeout if timeout is _UNSET else timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def tokenize(self, request: pb.GenerateRequest, timeout=_UNSET) -> pb.TokenizeResponse:
        try:
            return await self._stub.Tokenize(request, timeout=self.timeout if timeout is _UNSET else timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def score(self, request: pb.ScoreRequest, timeout=_UNSET) -> pb.ScoreResponse:
        try:
            return await self._stub.Score(request, timeout=self.timeout if timeout is _UNSET else timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


class _Targets:
    """A client's targets and one channel to each, opened on first use (`_open` is the
    sync or the asyncio channel factory); `_use(i)` makes target i the current one."""

    _aio = True

    def __init__(self, target, timeout, channel, options, security: ClientSecurity):
        self.targets = _targets(target)
        self.timeout = timeout
        self.security = security
        self._options = _options(options)
        self._channels: dict = {}
        self._own_channel = channel is None
        if channel is not None:
            self._channels[self.targets[0]] = channel
        self._use(0)

    def _use(self, index: int) -> None:
        self._index = index
        self.target = self.targets[index]
        if self.target not in self._channels:
            self._channels[self.target] = open_channel(self.target, self.security, aio=self._aio, options=self._options)
        self.channel = self._channels[self.target]


class AsyncClient(_Targets):
    """`target`: one HOST:PORT, or several (a list, or comma-separated) for a fleet with
    more than one router: a stream broken by its router's death (UNAVAILABLE) resumes on
    the next with the tokens already received (`resume_token_ids`), so the caller sees
    one stream; other calls go to the next target when one is unreachable."""

    _aio = True

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET, *, timeout: float | None = None,
                 channel: grpc.aio.Channel | None = None, options: Sequence[tuple] | None = None,
                 api_key: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None):
        _Targets.__init__(self, target, timeout, channel, options,
                          ClientSecurity.from_env(api_key, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key))

    def _use(self, index: int) -> None:
        _Targets._use(self, index)
        self.backend = GrpcBackend(self.channel, self.timeout)
        self._admin = pb_grpc.WorkerAdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_channel:
            for channel in self._channels.values():
                await channel.close()

    def _timeout(self, timeout):
        return self.timeout if timeout is _UNSET else timeout

    async def stream(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
                     messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> AsyncIterator[Chunk]:
        """Yield chunks as they come. `await it.aclose()` (or leaving `async for`) cancels."""
        request = _request(prompt, messages, params)
        failover = _Failover(request, self.targets, self._index, self._timeout(timeout))
        while True:
            gen = finished(self.backend.generate(failover.request, timeout=failover.remaining()), failover.n)
            try:
                async for response in gen:
                    failover.received(response)
                    yield Chunk.from_proto(response)
                return
            except OrchardError as e:
                self._use(failover.next_target(e))  # or raises e
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
        return list((await self._unary(lambda: self.backend._stub.ListModels, pb.ListModelsRequest(), timeout)).models)

    async def tokenize(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
                       messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> list[int]:
        """The token ids of the prompt `generate` with the same arguments would prefill (a
        chat through the model's template, with its tools), not run."""
        request = _request(prompt, messages, params)
        return list((await self._unary(lambda: self.backend._stub.Tokenize, request, timeout)).token_ids)

    async def embed(self, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *, model: str = "",
                    dimensions: int | None = None, normalize: bool | None = None, timeout=_UNSET) -> Embeddings:
        """Embeddings of a text, a list of texts, a list of token ids or a list of those
        (an embedding model; `dimensions`: Matryoshka truncation where the model allows it)."""
        request = build_embed_request(inputs, model=model, dimensions=dimensions, normalize=normalize)
        return Embeddings.from_proto(await self._unary(lambda: self.backend._stub.Embed, request, timeout))

    async def score(self, queries: str | Sequence[str], documents: str | Sequence[str], *, model: str = "",
                    instruction: str = "", timeout=_UNSET) -> list[float]:
        """A reranker's relevance scores (0..1): one query against each document, or in pairs."""
        request = build_score_request(queries, documents, model=model, instruction=instruction)
        return list((await self._unary(lambda: self.backend._stub.Score, request, timeout)).scores)

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None, model: str = "",
                     instruction: str = "", timeout=_UNSET) -> list[Ranked]:
        """The documents best first by a reranker's score (the first `top_n`)."""
        scores = await self.score(query, documents, model=model, instruction=instruction, timeout=timeout)
        return ranked(list(documents), scores, top_n)

    async def _unary(self, method, request, timeout):
        """`method()` (re-read after a failover) called on the current target; the next
        target when this one is unreachable."""
        for tried in range(len(self.targets)):
            try:
                return await method()(request, timeout=self._timeout(timeout))
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if err.code not in FAILOVER_CODES or tried == len(self.targets) - 1:
                    raise err from None
                self._use((self._index + 1) % len(self.targets))

    async def get_load(self, *, timeout=_UNSET) -> pb.LoadReport:
        """A worker's load report (WorkerAdmin)."""
        return await self._unary(lambda: self._admin.GetLoad, pb.GetLoadRequest(), timeout)

    async def drain(self, drain: bool = True, *, timeout=_UNSET) -> pb.DrainResponse:
        """Make a worker stop (or resume) taking new requests (WorkerAdmin)."""
        return await self._unary(lambda: self._admin.Drain, pb.DrainRequest(drain=drain), timeout)

    async def health(self, service: str = "", *, timeout=_UNSET) -> str:
        """grpc.health.v1 status name: 'SERVING', 'NOT_SERVING', ..."""
        r = await self._unary(lambda: self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class Client(_Targets):
    """The blocking twin of `AsyncClient` (plain grpc channels, no event loop), with the
    same failover across several targets."""

    _aio = False

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET, *, timeout: float | None = None,
                 channel: grpc.Channel | None = None, options: Sequence[tuple] | None = None,
                 api_key: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None):
        _Targets.__init__(self, target, timeout, channel, options,
                          ClientSecurity.from_env(api_key, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key))

    def _use(self, index: int) -> None:
        _Targets._use(self, index)
        self._stub = pb_grpc.GenerationStub(self.channel)
        self._admin = pb_grpc.WorkerAdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._own_channel:
            for channel in self._channels.values():
                channel.close()

    def _timeout(self, timeout):
        return self.timeout if timeout is _UNSET else timeout

    def stream(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
               messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> Iterator[Chunk]:
        """Yield chunks as they come. `it.close()` (or leaving the loop) cancels the request."""
        request = _request(prompt, messages, params)
        failover = _Failover(request, self.targets, self._index, self._timeout(timeout))
        while True:
            call = self._stub.Generate(failover.request, timeout=failover.remaining())
            try:
                try:
                    left = failover.n
                    for response in call:
                        failover.received(response)
                        yield Chunk.from_proto(response)
                        if response.finish_reason:
                            left -= 1
                            if not left or response.finish_reason == pb.FINISH_REASON_ABORT:
                                return
                except grpc.RpcError as e:
                    raise from_rpc_error(e) from None
                raise Unavailable(STREAM_ENDED_SHORT)  # never take a cut-off answer for a whole one
            except OrchardError as e:
                self._use(failover.next_target(e))  # or raises e
            finally:
                call.cancel()

    def generate(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
                 messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> Completion:
        result = Completion()
        for chunk in self.stream(prompt, messages=messages, timeout=timeout, **params):
            result.add(chunk)
        return result

    def chat(self, messages: Iterable[Message], *, timeout=_UNSET, **params) -> Completion:
        return self.generate(messages=messages, timeout=timeout, **params)

    def _unary(self, method, request, timeout):
        for tried in range(len(self.targets)):
            try:
                return method()(request, timeout=self._timeout(timeout))
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if err.code not in FAILOVER_CODES or tried == len(self.targets) - 1:
                    raise err from None
                self._use((self._index + 1) % len(self.targets))

    def list_models(self, *, timeout=_UNSET) -> list[pb.ModelInfo]:
        return list(self._unary(lambda: self._stub.ListModels, pb.ListModelsRequest(), timeout).models)

    def tokenize(self, prompt: str | Sequence[int] | pb.GenerateRequest | None = None, *,
                 messages: Iterable[Message] | None = None, timeout=_UNSET, **params) -> list[int]:
        """See `AsyncClient.tokenize`."""
        return list(self._unary(lambda: self._stub.Tokenize, _request(prompt, messages, params), timeout).token_ids)

    def embed(self, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *, model: str = "",
              dimensions: int | None = None, normalize: bool | None = None, timeout=_UNSET) -> Embeddings:
        """See `AsyncClient.embed`."""
        request = build_embed_request(inputs, model=model, dimensions=dimensions, normalize=normalize)
        return Embeddings.from_proto(self._unary(lambda: self._stub.Embed, request, timeout))

    def score(self, queries: str | Sequence[str], documents: str | Sequence[str], *, model: str = "",
              instruction: str = "", timeout=_UNSET) -> list[float]:
        """See `AsyncClient.score`."""
        request = build_score_request(queries, documents, model=model, instruction=instruction)
        return list(self._unary(lambda: self._stub.Score, request, timeout).scores)

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None, model: str = "",
               instruction: str = "", timeout=_UNSET) -> list[Ranked]:
        """See `AsyncClient.rerank`."""
        return ranked(list(documents), self.score(query, documents, model=model, instruction=instruction,
                                                  timeout=timeout), top_n)

    def get_load(self, *, timeout=_UNSET) -> pb.LoadReport:
        return self._unary(lambda: self._admin.GetLoad, pb.GetLoadRequest(), timeout)

    def drain(self, drain: bool = True, *, timeout=_UNSET) -> pb.DrainResponse:
        return self._unary(lambda: self._admin.Drain, pb.DrainRequest(drain=drain), timeout)

    def health(self, service: str = "", *, timeout=_UNSET) -> str:
        r = self._unary(lambda: self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
