"""The router's `Generation` service: place, relay chunk by chunk, fail over.

One request, one loop of attempts (at most `max_attempts`):
  place it on a candidate (policy) -> open a stream there -> relay each chunk.
If the worker fails before the first token, the request is placed again elsewhere; if it
fails mid-stream, it is resumed elsewhere with `resume_token_ids` = the tokens already
relayed, so the worker continues after them and the client sees one stream with no
duplicated or missing token. A failed worker is excluded for the rest of the request
(unless it comes back to health or restarts, and no other is left) and marked unhealthy
if it is unreachable. When the healthy workers left have all failed the request but
another serving the model is only unhealthy (it missed heartbeats on a busy machine), the
request waits up to `worker_wait` seconds for it to report in before it fails UNAVAILABLE.
Errors that are the request's fault (INVALID_ARGUMENT, ...) go back to the client
unchanged. A client cancel cancels the worker's stream.

A hold: when no worker of the request's model can take it (all unhealthy, draining, with
an open circuit, or gone a moment ago: a sole worker or group restarting), the request is
held, its stream kept open, until one registers or comes back, for at most `resume_wait`
seconds and the request's deadline; then it resumes there as any failover does (a hold
is no attempt until a worker is tried). New requests for the model are held the same
way. Past the wait, or with `max_held` requests held already, UNAVAILABLE naming the
model and the wait, with a `retry_after`. `waiting(request_id)` names the model a request
is held for (the HTTP front keeps an SSE client connected with comments meanwhile).

With a fleet (`cluster.fleet.controller`), a request for a catalog model that no worker
can take asks the controller to load it (one load, however many ask) and is held the same
way, for up to the router's --load-timeout and its deadline; a failed load fails the
requests held for it at once with the reason (503, Retry-After). A model neither served
nor in the catalog is NOT_FOUND naming the catalog's models. Each catalog request's wait
for its first token (from its arrival here) is told to the controller, whose replicas
follow it.

A poison request (one that breaks whatever serves it) is failed with INTERNAL rather than
tried a third time: after failing on two workers with INTERNAL (a worker isolates a step
that raises and fails its cause alone), or after two workers or groups went away under it
before it had a token from them (a group whose rank fails inside a collective exits, and
its streams see the connection go; streams already under way there are not suspects).

A stream never ends short: a worker's stream that stops without a finish reason, or that
sends nothing for `stream_idle_timeout` seconds once started (the worker is wedged, or
asleep behind a live connection), is that worker failing, and the request resumes
elsewhere. So are all the streams of a worker that reports its engine stalled (its
watchdog), started or not. A worker that reports itself lagging (a step well past its
usual time: the start of a stall, perhaps) gets no new request while another can take it,
and its streams with no output yet move to one that is not lagging (a move is no failure
and no attempt; `MAX_MOVES` a request). Keepalive on the channels (`cluster.net`) finds a peer that
stopped answering.
"""

from __future__ import annotations

import asyncio
import math
import logging
import time
import uuid
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

import grpc

from cluster.api import errors
from cluster.api.limits import GRPC_MAX_MESSAGE_BYTES, MAX_TIMEOUT_SECONDS, RequestLimits, quoted
from cluster.api.pooling import EMBED, GENERATE, SCORE, validate_embed_request, validate_score_request
from cluster.api.wire import features_asked, num_choices, validate_request
from cluster.fleet import FleetError
from cluster.fleet.catalog import MAX_KEEP_ALIVE_SECONDS
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router import metrics as m
from cluster.router import recent
from cluster.router.breaker import RetryBudget, backoff
from cluster.router.config import RouterConfig
from cluster.router.policy import KvAware, Policy, PrefixAware, PromptKeys
from cluster.router.prefix_index import prompt_keys
from cluster.router.prompt_blocks import PromptBlocks
from cluster.router.registry import HEALTHY, Registry, RegistryError

if TYPE_CHECKING:
    from cluster.fleet.controller import FleetController

log = logging.getLogger(__name__)

# Failures of the worker (or the path to it), not of the request: worth another worker.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,  # unreachable, died, shutting down, draining
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # its queue is full
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,  # cancelled on the worker's side (we never cancel a live attempt)
    }
)
# The worker itself is gone or unreachable: stop placing anything there until it reports in.
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN})
# gRPC's words for a call whose connection ended under it (the worker's process ended while
# it held the request), as against one that never reached the worker ("failed to connect")
# or the worker's own answer ("draining").
GONE_UNDER = ("stream removed", "socket closed", "connection reset", "broken pipe")


def _went_away_under(e: grpc.aio.AioRpcError) -> bool:
    """Whether the attempt's worker went away while it held the request."""
    details = (e.details() or "").lower()
    return e.code() is grpc.StatusCode.UNAVAILABLE and any(words in details for words in GONE_UNDER)


def _poison(internal: int, took_down: int, last: str) -> str:
    """Why a request is failed as poison: the workers it failed on (INTERNAL) and took down."""
    if not took_down:
        return f"the request failed on {internal} workers ({last}): not tried again"
    failed = f"failed on {internal} worker{'s' * (internal > 1)} and " if internal else ""
    return (f"the request {failed}took down {took_down} worker{'s' * (took_down > 1)} (each went away while "
            f"serving it, before its first token there; last: {last}): not tried again")


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy's part of `RouterConfig`: meanings and defaults are there."""

    max_attempts: int = RouterConfig.max_attempts  # placements per request, the first included
    worker_wait: float = RouterConfig.worker_wait  # seconds a request waits for an unhealthy worker to come back
    stream_idle_timeout: float = RouterConfig.stream_idle_timeout  # a started stream's longest silence
    resume_wait: float = RouterConfig.resume_wait  # seconds a request is held for a worker of its model
    max_held: int = RouterConfig.max_held  # requests held at once
    limits: RequestLimits = field(default_factory=RequestLimits)  # what a request may ask for (RouterConfig.limits)


class _Attempt:
    """One stream open on a worker; the registry abandons it when the worker reports its
    engine stalled (the call is cancelled, and the request resumes elsewhere), or moves it
    when the worker lags and the stream has had no output (`movable`: once a request)."""

    def __init__(self, call, movable: bool = False):
        self.call = call
        self.abandoned: str | None = None
        self.movable = movable
        self.started = False  # its first chunk came
        self.moved = False

    def abandon(self, reason: str) -> None:
        if self.abandoned is None:
            self.abandoned = reason
            self.call.cancel()

    def move(self, reason: str) -> bool:
        """Abandon it to be placed on another worker, if it has had no output and may move."""
        if not self.movable or self.started or self.abandoned is not None:
            return False
        self.moved = True
        self.abandon(reason)
        return True


def _cancelling() -> bool:
    """Whether the current task is being cancelled (the client left, the router stops)."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


def _too_large(e: grpc.aio.AioRpcError) -> bool:
    """gRPC refused a message of the call over its size limit (RESOURCE_EXHAUSTED, as a
    full queue is): the request's size is at fault, not the worker."""
    return e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or "")


def _client_error(e: grpc.aio.AioRpcError) -> errors.OrchardError:
    """The client's error for a worker's answer that is not the worker failing."""
    if _too_large(e):
        return errors.InvalidRequest(f"a message of this request is larger than gRPC's {GRPC_MAX_MESSAGE_BYTES} "
                                     f"byte limit: {e.details()}")
    return errors.from_rpc_error(e)


def _waited_out(deadline: float | None, no_worker: RegistryError) -> bool:
    return (deadline is not None and time.monotonic() >= deadline
            and no_worker.code is grpc.StatusCode.UNAVAILABLE)


def _deadline_held(timeout: float | None) -> float | None:
    """A deadline gRPC can hold: one past MAX_TIMEOUT_SECONDS (inf, 1e308) is none; gRPC's
    own arithmetic overflows and fails the call at once."""
    return None if timeout is None or not timeout < MAX_TIMEOUT_SECONDS else timeout


# Seconds a client refused after a hold is told to wait before asking again (Retry-After):
# it is held afresh then, so soon is enough.
RETRY_AFTER = 5
# Times a request may be moved off a lagging worker before its first chunk: a move is no
# failure and no attempt, and a request moves only to a worker that is not lagging, but
# workers that lag in turn must not pass it around for ever.
MAX_MOVES = 2
# A held request re-checks its model's workers at least this often: a circuit's cool-down
# ends without any change of the workers to wake it.
HOLD_RECHECK = 1.0


class _WorkerFailed(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _Tries:
    """One request's attempts: its id and deadline, and what the failed ones have taught
    (the workers excluded, the last failure, the attempts that broke a worker)."""

    def __init__(self, rid: str, timeout: float | None, worker_wait: float):
        self.rid = rid
        self.t0 = time.perf_counter()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_until = time.monotonic() + worker_wait  # for an unhealthy worker, once per request
        if self.deadline is not None:
            self.wait_until = min(self.wait_until, self.deadline)
        self.excluded: dict[str, int] = {}  # worker id -> its epoch when it failed the request
        self.failure: _WorkerFailed | None = None
        self.internal = 0  # attempts failed with INTERNAL
        self.took_down = 0  # attempts whose worker went away under it before it sent a token

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


@dataclass
class _Progress:
    """What a stream has relayed to its client, across its attempts."""

    n: int  # samples asked for (n > 1 streams carry one finish chunk per sample)
    base_resume: list[int]  # tokens the client resumed from, if it did
    t0: float
    sent: list[int] = field(default_factory=list)  # tokens relayed so far
    finishes: int = 0  # samples finished
    first_token_at: float | None = None
    done: bool = False  # the last sample finished: the request is served
    record: recent.RequestRecord | None = None  # the console's record of it

    def took(self, token_ids, metrics: m.RouterMetrics) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            metrics.ttft.observe(self.first_token_at - self.t0)
            if self.record is not None:
                self.record.ttft = self.first_token_at - self.t0
        self.sent.extend(token_ids)
        if self.record is not None:
            self.record.tokens = len(self.base_resume) + len(self.sent)

    def finished(self, chunk: pb.GenerateResponse) -> bool:
        """A sample's finish chunk: whether it is the request's last (its usage then counts
        every token, those of earlier attempts too)."""
        self.finishes += 1
        if self.finishes < self.n:
            return False
        if self.n == 1:
            chunk.usage.completion_tokens = max(chunk.usage.completion_tokens, len(self.base_resume) + len(self.sent))
        self.done = True
        if self.record is not None:
            self.record.outcome = recent.OK
        return True


class _FirstToken:
    """Called at a catalog request's first token (and at its end): tells the fleet, once,
    how long the request waited for it since it arrived (the replicas follow that)."""

    def __init__(self, fleet: FleetController, model: str):
        self.fleet, self.model, self.t0 = fleet, model, time.perf_counter()
        self.told = False

    def __call__(self) -> None:
        if not self.told:
            self.told = True
            self.fleet.request_waited(self.model, time.perf_counter() - self.t0)


def _resume_after(upstream: pb.GenerateRequest, progress: _Progress) -> None:
    """The request as the next attempt sends it: resumed after every token the client has."""
    if progress.sent:  # the first chunk (prompt logprobs, echo) reached the client already
        upstream.sampling.ClearField("prompt_logprobs")
        upstream.sampling.echo = False
    del upstream.resume_token_ids[:]
    upstream.resume_token_ids.extend(progress.base_resume + progress.sent)


class RouterBackend:
    """The router's `cluster.api.servicer.Backend` (as `WorkerService` is the worker's):
    `generate(request)` yields chunks and raises `cluster.api.errors` exceptions. The gRPC
    servicer and the OpenAI HTTP front both sit on it."""

    def __init__(self, registry: Registry, policy: Policy, metrics: m.RouterMetrics,
                 config: ProxyConfig = ProxyConfig(), fleet: FleetController | None = None,
                 prompt_blocks: PromptBlocks | None = None):
        self.registry = registry
        self.policy = policy
        # a prompt's KV block hashes for the kv_aware policy (None: placed by the approximate map)
        self.prompt_blocks = prompt_blocks if isinstance(policy, KvAware) else None
        self.metrics = metrics
        self.config = config
        self.fleet = fleet  # loads catalog models on demand (None: no fleet)
        self.budget = RetryBudget()
        self.held: dict[str, str] = {}  # request id -> the model it is held for (a hold)
        self.loading: set[str] = set()  # ... of those, the ids held for a fleet load of their model
        self.holding = 0  # requests held now (ids may repeat: this is what `max_held` bounds)
        self.recent = recent.RecentRequests()  # the console's requests view

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for here (the HTTP front checks the same)."""
        return self.config.limits

    @property
    def serving(self) -> bool:
        """Some worker can take a request (the HTTP /health and gRPC health say so)."""
        return self.registry.can_serve

    def waiting(self, request_id: str) -> str | None:
        """The model request `request_id` is held for (no worker of it can take it now), or
        None: it runs or queues on a worker."""
        return self.held.get(request_id)

    def hold_status(self, request_id: str) -> str | None:
        """What a held request waits for, in words (an SSE comment while it waits), or None."""
        model = self.held.get(request_id)
        if model is None:
            return None
        if request_id in self.loading:
            try:
                return f"loading {_model_named(model)}: {self.fleet.describe(model).status}"
            except FleetError as e:  # e.g. removed from the catalog while held: the stream's error event
                raise errors.from_status(e.code, e.message) from None
        return f"waiting for a worker of {model or 'any model'}"

    async def list_models(self) -> pb.ListModelsResponse:
        served = self.registry.models()
        if self.fleet is None:
            return pb.ListModelsResponse(models=served)
        try:
            catalog = {info.id: info for info in self.fleet.model_infos()}
        except FleetError as e:  # the catalog file unreadable for a moment: the models served, at least
            log.warning("models: the fleet's catalog could not be read: %s", e)
            catalog = {}
        for info in served:  # a catalog model served: what its workers report, with the catalog's state
            entry = catalog.pop(info.id, None)
            if entry is not None:
                info.state, info.status = entry.state, entry.status
        return pb.ListModelsResponse(models=sorted([*served, *catalog.values()], key=lambda i: i.id))

    async def generate(self, request: pb.GenerateRequest,
                       timeout: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        record = self.recent.begin(request.request_id, request.model)
        outcome, cause = recent.CANCELLED, ""
        try:
            with self._in_use(request) as first_token:
                async with aclosing(self._generate(request, timeout, record)) as chunks:
                    async for chunk in chunks:
                        if chunk.token_ids:
                            first_token()
                        yield chunk
        except errors.OrchardError as e:
            outcome, cause = recent.FAILED, e.message
            raise
        finally:  # served once its last chunk went out, whether or not the client read on
            self.recent.finish(record, recent.OK if record.outcome == recent.OK else outcome, cause)

    @contextmanager
    def _in_use(self, request):
        """A request for a catalog model, counted by the fleet while it runs (its model's
        idle time and keep-alive: the request's `keep_alive_seconds`, when it has one)."""
        fleet, model = self.fleet, request.model
        if fleet is None or not fleet.knows(model):
            yield lambda: None
            return
        keep_alive = (request.keep_alive_seconds if "keep_alive_seconds" in request.DESCRIPTOR.fields_by_name
                      and request.HasField("keep_alive_seconds") else None)
        if keep_alive is not None:
            _check_keep_alive(keep_alive)
        fleet.request_started(model, keep_alive)
        first_token = _FirstToken(fleet, model)
        try:
            yield first_token
        finally:
            first_token()  # no token: its wait ended with its answer, or its failure
            fleet.request_finished(model)

    async def _generate(self, request: pb.GenerateRequest, timeout: float | None,
                        record: recent.RequestRecord) -> AsyncIterator[pb.GenerateResponse]:
        tries, upstream = self._begin(request, validate_request, timeout)  # refused there, before any placement
        record.request_id = tries.rid
        keys = PromptKeys(prompt_keys(request) if isinstance(self.policy, PrefixAware) else [])
        hash_blocks = self.prompt_blocks is not None  # once, for the first attempt's workers
        progress = _Progress(num_choices(request), list(request.resume_token_ids), tries.t0, record=record)
        moves, just_moved = 0, False  # times moved off a lagging worker before its first chunk (no attempts)
        features = features_asked(request)  # placed only where a worker has them
        attempt = 0
        while attempt < self.config.max_attempts:
            pool = await self._next_pool(tries, request.model, attempt, features=features, retry=not just_moved)
            just_moved = False
            # n samples cannot resume where they stopped: only a retry before any token
            if progress.sent and progress.n > 1:
                failure = tries.failure
                raise errors.Unavailable(f"the worker failed ({failure.code.name}: {failure.details}) after tokens "
                                         "were sent, and a request with n > 1 cannot be resumed: retry it")
            if hash_blocks:
                hash_blocks = False
                keys.blocks = await self.prompt_blocks.keys(request, pool)
                # the pool again: a worker may have been removed, or turned unhealthy, while it hashed
                pool = await self._next_pool(tries, request.model, attempt, features=features, retry=False)
            worker = self.policy.choose(pool, keys)  # settled by the attempt, whatever happens to it
            epoch, breaker = worker.epoch, worker.breaker  # this process's (a restart gets new ones)
            breaker.on_start()
            record.worker = worker.worker_id
            if attempt:
                record.placed_again(bool(progress.sent), f"{tries.failure.code.name}: {tries.failure.details}")
                self.metrics.retries.labels(kind="resume" if progress.sent else "retry").inc()
                log.info("request %s: %s on %s after %d tokens", tries.rid, "resuming" if progress.sent else "retrying",
                         worker.worker_id, len(progress.sent))
            _resume_after(upstream, progress)
            worker.inflight += 1
            stream = _Attempt(worker.generation.Generate(upstream, timeout=tries.remaining()),
                              movable=moves < MAX_MOVES)
            worker.attempts.add(stream)
            async with aclosing(self._attempt(stream, worker, breaker, progress, tries, keys)) as chunks:
                async for chunk in chunks:
                    yield chunk
            if progress.done:
                return
            if stream.moved:  # not the worker failing: it may take the request again; no attempt, no retry spent
                moves, just_moved = moves + 1, True
                log.info("request %s: %s", tries.rid, tries.failure.details)
                continue
            self._exclude(tries, worker, epoch)
            attempt += 1
        raise self._gave_up(tries)

    async def _attempt(self, stream: _Attempt, worker, breaker, progress: _Progress, tries: _Tries,
                       keys) -> AsyncIterator[pb.GenerateResponse]:
        """One attempt of a stream on `worker`: relays its chunks and sets `progress.done`
        once the request finished there. A failure after which the request may be placed
        again ends it quietly (`tries.failure` says why); any other raises. Whatever
        happens, the worker's counts, the policy, the breaker and the metrics learn of it."""
        outcome = m.CANCELLED
        accepted = False
        tokens_before = len(progress.sent)
        try:
            async for chunk in self._relay(stream.call, tries.rid, worker.worker_id):
                stream.started = True
                if not accepted:  # the worker took it: its cache holds the prompt now
                    accepted = True
                    self.policy.settled(worker.worker_id, keys, accepted=True)
                if chunk.token_ids:
                    progress.took(chunk.token_ids, self.metrics)
                    worker.tokens_relayed += len(chunk.token_ids)
                if chunk.finish_reason == pb.FINISH_REASON_ABORT:  # the worker gave up on it (stopping)
                    if chunk.token_ids or chunk.text or chunk.reasoning or chunk.tool_calls:
                        chunk.finish_reason = pb.FINISH_REASON_UNSPECIFIED
                        chunk.ClearField("usage")
                        yield chunk
                    raise _WorkerFailed(grpc.StatusCode.ABORTED, "the worker aborted the request")
                if chunk.finish_reason and progress.finished(chunk):
                    # counted before the last yield: the consumer may stop reading at it
                    outcome = m.SUCCESS
                    self.metrics.e2e.observe(time.perf_counter() - progress.t0)
                    self._count_cached(keys, worker.worker_id, chunk)
                    yield chunk
                    return
                yield chunk
            # Never end a client's stream short: a worker's stream that stops without a
            # finish reason (its channel closed under it) is a failed worker.
            raise _WorkerFailed(grpc.StatusCode.UNAVAILABLE, "the worker's stream ended before the request finished")
        except (asyncio.CancelledError, grpc.aio.AioRpcError, _WorkerFailed) as e:
            outcome, error = self._outcome(e, stream, worker, tries, fresh=len(progress.sent) == tokens_before)
            if error is e:
                raise
            if error is not None:
                raise error from None
        finally:
            if not accepted:  # refused, failed or left before its first chunk: nothing to learn
                self.policy.settled(worker.worker_id, keys, accepted=False)
            worker.inflight -= 1
            worker.attempts.discard(stream)
            stream.call.cancel()
            # A stream the router abandoned (its worker reported a stall, or went silent) is
            # no verdict for the breaker: the worker's own reports say when it serves again.
            # (No-op once it finished; reaches it if the client left.)
            self._judge(worker, breaker, outcome if stream.abandoned is None else None)
            self.metrics.requests.labels(worker=worker.worker_id, outcome=outcome).inc()

    def _count_cached(self, keys: PromptKeys, worker_id: str, chunk: pb.GenerateResponse) -> None:
        """A request placed by its block hashes finished: the cached tokens the policy
        expected of the worker that served it, and those the worker served (its usage), both
        counted here so that the two totals cover the same requests."""
        predicted = keys.predicted.get(worker_id)
        if predicted is None:
            return
        self.metrics.predicted_cached_tokens.labels(tier="memory").inc(predicted[0])
        self.metrics.predicted_cached_tokens.labels(tier="disk").inc(predicted[1])
        self.metrics.actual_cached_tokens.inc(chunk.usage.cached_tokens)

    async def embed(self, request: pb.EmbedRequest, timeout: float | None = None) -> pb.EmbedResponse:
        """An embedding request, placed by load on a worker whose model serves embeddings;
        another worker if that one fails before it answers."""
        with self._in_use(request):
            return await self._unary(EMBED, request, validate_embed_request, lambda w: w.generation.Embed, timeout)

    async def score(self, request: pb.ScoreRequest, timeout: float | None = None) -> pb.ScoreResponse:
        """A rerank / score request, placed as `embed` is, on a reranker's worker."""
        with self._in_use(request):
            return await self._unary(SCORE, request, validate_score_request, lambda w: w.generation.Score, timeout)

    async def tokenize(self, request: pb.GenerateRequest, timeout: float | None = None) -> pb.TokenizeResponse:
        """The prompt a generation request makes, from a worker of its model (placed as
        `embed` is: by load, another worker if that one fails)."""
        with self._in_use(request):
            return await self._unary(GENERATE, request, validate_request, lambda w: w.generation.Tokenize, timeout)

    async def _unary(self, task: str, request, validate, method, timeout: float | None):
        """Place a one-answer request (`method(worker)` is the worker's RPC) with the same
        failover as a stream before its first token: a worker that fails (unreachable,
        INTERNAL, queue full, stalled) is excluded and the request placed again, within
        `max_attempts`, the retry budget and the deadline."""
        tries, upstream = self._begin(request, validate, timeout)
        for attempt in range(self.config.max_attempts):
            pool = await self._next_pool(tries, request.model, attempt, task)
            worker = self.policy.choose(pool, [])
            epoch, breaker = worker.epoch, worker.breaker
            breaker.on_start()
            if attempt:
                self.metrics.retries.labels(kind="retry").inc()
                log.info("request %s: retrying on %s", tries.rid, worker.worker_id)
            worker.inflight += 1
            call = method(worker)(upstream, timeout=tries.remaining())
            pending = _Attempt(call)
            worker.attempts.add(pending)
            outcome = m.CANCELLED
            try:
                response = await call
                outcome = m.SUCCESS
                self.metrics.e2e.observe(time.perf_counter() - tries.t0)
                return response
            except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
                outcome, error = self._outcome(e, pending, worker, tries)
                if error is e:
                    raise
                if error is not None:
                    raise error from None
            finally:
                worker.inflight -= 1
                worker.attempts.discard(pending)
                call.cancel()
                self._judge(worker, breaker, outcome)
                self.metrics.requests.labels(worker=worker.worker_id, outcome=outcome).inc()
            self._exclude(tries, worker, epoch)
        raise self._gave_up(tries)

    def _begin(self, request, validate, timeout: float | None):
        """A request's attempts begun: `validate(request, limits)` (an error is refused here,
        before any placement), its id, and the copy sent upstream (with that id)."""
        try:
            validate(request, self.config.limits)
        except errors.InvalidRequest:
            self.metrics.requests.labels(worker="none", outcome=m.ERROR).inc()
            raise
        tries = _Tries(request.request_id or f"req-{uuid.uuid4().hex[:16]}", _deadline_held(timeout),
                       self.config.worker_wait)
        upstream = type(request)()
        upstream.CopyFrom(request)
        upstream.request_id = tries.rid
        self.budget.on_request()
        return tries, upstream

    def _outcome(self, e: BaseException, attempt: _Attempt, worker, tries: _Tries,
                 fresh: bool = False) -> tuple[str, BaseException | None]:
        """How an attempt that raised `e` ended: its outcome (the metrics', the breaker's)
        and the error that ends the request, or None where it may be placed again
        (`tries.failure` says why). `fresh`: the attempt sent no token, so a worker that went
        away under it counts toward poison (a stream's; a one-answer request's never does)."""
        if isinstance(e, asyncio.CancelledError):
            if _cancelling():  # the client left, or the router stops
                return m.CANCELLED, e
            # not this task's: the router abandoned the call, or closed its channel (the
            # worker left the pool: its node lost, its replica removed) and gRPC cancelled it
            tries.failure = _WorkerFailed(grpc.StatusCode.UNAVAILABLE, attempt.abandoned
                                          or f"worker {worker.worker_id} left the pool under the request")
            return (m.CANCELLED if attempt.moved else m.FAILED), None
        if isinstance(e, _WorkerFailed):
            tries.failure = e
            if e.code is grpc.StatusCode.UNAVAILABLE:
                self.registry.mark_failed(worker.worker_id, e.details)
            return m.FAILED, None
        code = e.code()
        if attempt.abandoned is not None:  # we cancelled it: the worker stalled (or lags)
            tries.failure = _WorkerFailed(grpc.StatusCode.UNAVAILABLE, attempt.abandoned)
            return (m.CANCELLED if attempt.moved else m.FAILED), None
        if code not in RETRYABLE or _too_large(e):  # the request's own error: the worker answered
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                self.metrics.deadline_exceeded.inc()
            return m.ERROR, _client_error(e)
        tries.failure = _WorkerFailed(code, e.details() or code.name)
        if code in UNREACHABLE:
            self.registry.mark_failed(worker.worker_id, f"{code.name}: {e.details()}")
        if code is grpc.StatusCode.INTERNAL:
            tries.internal += 1
        elif fresh and _went_away_under(e):
            tries.took_down += 1
        if tries.internal + tries.took_down >= 2:  # the same request broke two workers: it is the cause
            self.metrics.poison.inc()
            reason = _poison(tries.internal, tries.took_down, e.details())
            log.error("request %s: %s", tries.rid, reason)
            return m.FAILED, errors.InternalError(reason)
        return m.FAILED, None

    def _exclude(self, tries: _Tries, worker, epoch: int) -> None:
        """The worker failed the request: not placed there again (while it is this process)."""
        tries.excluded[worker.worker_id] = epoch
        log.warning("request %s: worker %s failed (%s: %s)", tries.rid, worker.worker_id, tries.failure.code.name,
                    tries.failure.details)

    def _gave_up(self, tries: _Tries) -> errors.OrchardError:
        self.metrics.requests.labels(worker="none", outcome=m.ERROR).inc()
        return errors.Unavailable(f"gave up after {self.config.max_attempts} attempts; last: "
                                  f"{tries.failure.code.name}: {tries.failure.details}")

    async def _next_pool(self, tries: _Tries, model: str, attempt: int, task: str = GENERATE,
                         features: frozenset[str] = frozenset(), retry: bool = True):
        """The workers attempt `attempt` may go to (a `retry` first spends the retry budget
        and backs off), or the error that ends the request: no worker serves it (for `task`,
        with `features`), the deadline passed waiting for one, or the last attempt's failure
        and why no other is left."""
        failure, deadline = tries.failure, tries.deadline
        if attempt and retry:
            await self._before_retry(attempt, failure, deadline)
        pool, no_worker = await self._pool(tries.rid, model, tries.excluded, tries.wait_until, deadline, task, features)
        if pool:
            return pool
        self.metrics.requests.labels(worker="none", outcome=m.NO_WORKER).inc()
        # the deadline is the reason only where waiting could have helped (not: no worker serves it)
        if _waited_out(deadline, no_worker):
            self.metrics.deadline_exceeded.inc()
            raise errors.DeadlineExceeded(f"the deadline passed while waiting for a worker ({no_worker})")
        if failure is None:
            error = errors.from_status(no_worker.code, str(no_worker))
            if isinstance(error, errors.InvalidRequest):
                error.param = no_worker.param
        elif failure.code is grpc.StatusCode.INTERNAL:  # the worker failed it alone (its engine found the cause)
            error = errors.InternalError(f"{failure.details} (not tried elsewhere: {no_worker})")
        else:
            error = errors.Unavailable(f"worker failed ({failure.code.name}: {failure.details}) and {no_worker}")
        if isinstance(no_worker, _HoldOver):
            error.retry_after = RETRY_AFTER
        raise error

    async def _before_retry(self, attempt: int, failure: "_WorkerFailed", deadline: float | None) -> None:
        """Spend the retry budget (or fail fast when it is spent) and back off."""
        if not self.budget.try_retry():
            self.metrics.retry_budget_exhausted.inc()
            raise errors.Unavailable(f"worker failed ({failure.code.name}: {failure.details}); the router's retry "
                                     "budget is spent (too many failures at once): retry later")
        delay = backoff(attempt)
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - time.monotonic()))
        await asyncio.sleep(delay)

    def _judge(self, worker, breaker, outcome: str) -> None:
        """The circuit breaker of the worker's process the attempt ran on (not that of a
        process that replaced it since) learns from how the attempt ended."""
        if outcome == m.FAILED:
            if breaker.on_failure():
                log.warning("worker %s: %d failures in a row: circuit open for %.1f s", worker.worker_id,
                            breaker.failures, breaker.cooldown)
        elif outcome == m.SUCCESS:
            breaker.on_success()
        else:  # the client left, or the request's own error: no verdict on the worker either way (a
            breaker.on_abandon()  # stream of bad requests must not keep a failing worker's breaker shut)

    async def _relay(self, call, rid: str, worker_id: str) -> AsyncIterator[pb.GenerateResponse]:
        """The worker's chunks; once the stream has started, a gap longer than
        `stream_idle_timeout` fails it (the worker is wedged or gone, for this stream)."""
        idle = self.config.stream_idle_timeout
        chunks = call.__aiter__()
        started = False
        while True:
            try:
                if started and idle > 0:
                    chunk = await asyncio.wait_for(chunks.__anext__(), idle)
                else:
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                log.warning("request %s: no output from %s for %.1f s", rid, worker_id, idle)
                raise _WorkerFailed(grpc.StatusCode.UNAVAILABLE,
                                    f"no output for {idle:g} s (stream idle timeout)") from None
            started = True
            yield chunk

    async def _pool(self, rid: str, model: str, excluded: dict[str, int], wait_until: float,
                    deadline: float | None, task: str = GENERATE, features: frozenset[str] = frozenset()):
        """(healthy workers for `model`, `task` and `features` to try, the error to give if
        there are none): those the request has not failed on; else, after waiting until
        `wait_until` for one that may come back (unhealthy, not draining, not tried) to
        report in, those it failed on that came back since (a new epoch: healthy again, or
        restarted). While no worker of the model can take a request at all, the request is
        held (`_hold_until`) instead. Every wait re-checks at each change of the workers."""
        waited = False
        held_until = None
        held_at = 0.0  # when it began to wait for a fleet load
        try:
            while True:
                try:
                    ready = self.registry.candidates(model, task, features)
                except RegistryError as e:
                    ready, no_worker = [], self._not_in_catalog(model, e)
                else:
                    no_worker = RegistryError(grpc.StatusCode.UNAVAILABLE, "no other healthy worker")
                fresh = [w for w in ready if w.worker_id not in excluded]
                if fresh:
                    if waited:
                        log.info("request %s: placed after the wait", rid)
                    return fresh, no_worker
                if not ready and self._fleet_loads(model, no_worker):
                    if (failed := self.fleet.load_error(model)) is not None:
                        return [], _HoldOver(f"{_model_named(model)} could not be loaded: {failed.message}")
                    self.fleet.ensure_loaded(model)
                    if held_until is None:
                        held_until = self._hold_until(rid, model, deadline, self.fleet.config.load_timeout)
                        self.loading.add(rid)
                        held_at = time.monotonic()
                    left = held_until - time.monotonic()
                    if left <= 0:
                        return [], _HoldOver(f"{_model_named(model)} was not loaded within "
                                             f"{self.fleet.config.load_timeout:g} s (the router's --load-timeout)")
                    left = min(left, HOLD_RECHECK)
                elif not ready and self._may_hold(model, no_worker):
                    if held_until is None:
                        held_until = self._hold_until(rid, model, deadline)
                    left = held_until - time.monotonic()
                    if left <= 0:
                        log.warning("request %s: no worker of %s within %g s", rid, _model_named(model),
                                    self.config.resume_wait)
                        return [], _HoldOver(f"no worker of {_model_named(model)} could take it within "
                                             f"{self.config.resume_wait:g} s (the router's --resume-wait): {no_worker}")
                    left = min(left, HOLD_RECHECK)
                else:
                    hope = [w.worker_id for w in self.registry.may_come_back(model, excluded, task, features)]
                    left = wait_until - time.monotonic()
                    if not hope or left <= 0:
                        back = [w for w in ready if excluded[w.worker_id] != w.epoch]
                        if waited or back:
                            log.info("request %s: %s", rid, f"trying {back[0].worker_id} again: it came back"
                                     if back else "no worker came back after the wait")
                        return back, no_worker
                    if not waited:
                        log.info("request %s: no healthy worker; waiting up to %.1f s for %s", rid, left,
                                 ", ".join(hope))
                waited = True
                await self.registry.wait_changed(left)
        except asyncio.CancelledError:  # the client went away (or the router stops) while it waited
            self.metrics.requests.labels(worker="none", outcome=m.CANCELLED).inc()
            raise
        finally:
            if held_until is not None:
                self.holding -= 1
                self.held.pop(rid, None)
            if rid in self.loading:
                self.loading.discard(rid)
                self.fleet.waited(time.monotonic() - held_at)

    def _not_in_catalog(self, model: str, no_worker: RegistryError) -> RegistryError:
        """With a fleet, a model that no worker serves and the catalog does not list is
        NOT_FOUND naming the catalog's models."""
        if (self.fleet is None or not model or no_worker.code is not grpc.StatusCode.NOT_FOUND
                or self.fleet.knows(model)):
            return no_worker
        return RegistryError(grpc.StatusCode.NOT_FOUND, self.fleet.unknown(model))

    def _fleet_loads(self, model: str, no_worker: RegistryError) -> bool:
        """Whether a request that no worker can take now waits for the fleet to load its
        model: a catalog model none of whose workers can take any request (as `_may_hold`
        says), whether it was served lately or never."""
        return (self.fleet is not None
                and no_worker.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
                and self.fleet.knows(model)
                and not any(w.state == HEALTHY and not w.breaker.allows() for w in self.registry.serving(model)))

    def _may_hold(self, model: str, no_worker: RegistryError) -> bool:
        """Whether a request that no worker can take now may be held for one: none can take
        any request of the model (not: the request asks what its workers lack), one serves
        it, or did a moment ago, none of them failed to start for good (nothing will come back
        until someone fixes it), and none is up and failing requests (healthy with its
        circuit open: it is not coming back, it is there; a held request would wait out the
        cool-down only to fail on it again, so the error is given at once)."""
        return (self.config.resume_wait > 0
                and no_worker.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
                and self.registry.served_lately(model, self.config.resume_wait)
                and self.registry.failed_for_good(model) is None
                and not any(w.state == HEALTHY and not w.breaker.allows() for w in self.registry.serving(model)))

    def _hold_until(self, rid: str, model: str, deadline: float | None, wait: float | None = None) -> float:
        """Start holding request `rid`: when its hold ends (after `wait` seconds, by default
        `resume_wait`, or at its deadline). UNAVAILABLE at once when `max_held` requests are
        held already (what a hold may cost is bounded)."""
        if self.holding >= self.config.max_held:
            self.metrics.requests.labels(worker="none", outcome=m.NO_WORKER).inc()
            error = errors.Unavailable(f"no worker of {_model_named(model)} can take the request, and "
                                       f"{self.config.max_held} requests wait for one already (the router's "
                                       "--max-held): retry later")
            error.retry_after = RETRY_AFTER
            raise error
        self.held[rid] = model
        self.holding += 1
        wait = self.config.resume_wait if wait is None else wait
        until = time.monotonic() + wait
        log.info("request %s: no worker of %s can take it; held up to %g s for one", rid, _model_named(model), wait)
        return until if deadline is None else min(until, deadline)


class _HoldOver(RegistryError):
    """A hold ended with no worker of the model back."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


def _check_keep_alive(seconds: float) -> None:
    """A gRPC request's `keep_alive_seconds`, checked as the HTTP body's `keep_alive` is."""
    if not math.isfinite(seconds):
        raise errors.BadField("keep_alive_seconds", f"keep_alive_seconds: {seconds} is not a number of seconds "
                                                    "(a negative one never unloads)")
    if seconds > MAX_KEEP_ALIVE_SECONDS:
        raise errors.BadField("keep_alive_seconds", f"keep_alive_seconds: {seconds:g} is more than "
                                                    f"{MAX_KEEP_ALIVE_SECONDS:g} seconds; a negative one never unloads")


def _model_named(model: str) -> str:
    return f"model {quoted(model)}" if model else "any model"
