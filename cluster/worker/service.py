"""The worker's asyncio side: requests in, chunks out, one engine thread behind it.

`WorkerService` is a `cluster.api.servicer.Backend` (`generate`, `list_models`), used as
is by the gRPC servicer and by the OpenAI HTTP front, plus the admin calls
(`load_report`, `set_draining`). It owns the engine thread (`EngineLoop`, whose event
sink it is), validates and tokenizes requests (tokenization in a thread pool, chat
templates in processes of their own: chat_render.py), hands them to the engine thread
and routes its events to one asyncio queue per request. It never touches MLX.

Errors are `cluster.api.errors` exceptions; the front ends map them to gRPC statuses
and HTTP codes. A request whose consumer goes away (cancel, disconnect, closed
iterator, the gRPC deadline) is aborted in the engine at once, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from cluster.api.errors import AlreadyExists, BadField, InternalError, InvalidRequest, NotFound, Overloaded, Unavailable
from cluster.api.limits import quoted
from cluster.api.pooling import (EMBED, GENERATE, SCORE, refuse_task, score_pairs, validate_embed_request,
                                 validate_score_request)
from cluster.api.tools import parse_tools, split_chunk, template_messages, tool_choice_mode
from cluster.api.wire import (CHARS_PER_TOKEN_BOUND, FINISH_REASON_TO_PROTO, SPECULATIVE, RequestLimits, check_fits,
                              features_asked, max_tokens, prompt_chars, refuse_features, template_kwargs,
                              validate_request)
from cluster.formats.calls import CallFormat
from cluster.formats.registry import call_format, reasoning_format
from cluster.formats.split import OutputSplitter, make_splitter
from cluster.formats.thinking import ReasoningFormat, ThinkingSpec, ThinkingTracker, prompt_state
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.worker.chat_render import (PROBE_MESSAGES, ChatTemplateLimits, RenderPool, TemplateTypeError,
                                        jinja_tokenizer, render_call)
from cluster.worker.config import WorkerOptions
from cluster.worker.detokenizer import decode_keeping, token_bytes
from cluster.worker.engine import EngineStats, QueueFullError, RequestOutput
from cluster.worker.engine_loop import AbortRequest, AddRequest, EngineLoop, Failed, Rejected, Scheduled
from cluster.worker.engine_protocol import EngineProtocol
from cluster.worker.faults import FaultInjection
from cluster.worker.metrics import WorkerMetrics
from cluster.worker.pooling import PoolingParams, yes_no_prompt
from cluster.worker.sampling_params import SamplingParams, StructuredOutput
from cluster.worker.structured import InvalidGrammar, call_constraint, with_thinking

log = logging.getLogger(__name__)
# Prompts shorter than this are tokenized inline: a thread-pool hop would cost more.
INLINE_TOKENIZE_CHARS = 512


@dataclass
class _Stream:
    """Asyncio-side state of one request."""

    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_token_time: float | None = None


def sampling_params_from_proto(request: pb.GenerateRequest, num_resumed: int = 0,
                               limit: int | None = None) -> SamplingParams | None:
    """The engine's params for a validated request (`limit`: its max_tokens, once fitted
    to max_model_len); None when the `num_resumed` tokens generated elsewhere already
    reach it (nothing is left to generate). Values out of the engine's ranges are
    InvalidRequest, in the engine's words."""
    s = request.sampling
    limit = max_tokens(request) if limit is None else limit
    kwargs = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "repetition_penalty",
                 "prompt_logprobs", "speculative"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    if s.HasField("structured"):
        kind = s.structured.WhichOneof("kind")
        spec = {"json_object": "", "choice": tuple(s.structured.choice.choices)}.get(kind)
        kwargs["structured"] = StructuredOutput(kind, getattr(s.structured, kind) if spec is None else spec)
    try:
        params = SamplingParams(
            max_tokens=limit,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            logit_bias=dict(s.logit_bias),
            n=max(1, s.n),
            **kwargs,
        )
    except (TypeError, ValueError) as e:
        raise InvalidRequest(str(e)) from None
    return params if limit > num_resumed else None


@dataclass
class _Usage:
    """A request's usage, summed over its samples."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def proto(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                        cached_tokens=self.cached_tokens, reasoning_tokens=self.reasoning_tokens)


@dataclass(frozen=True)
class _Chat:
    """How a chat request's output is read: the model's thinking format and where the
    prompt left it, the call format when tools are on, the special tokens kept (and the call
    markers among them, which never reach the text)."""

    reasoning: ReasoningFormat | None
    state: str
    calls: CallFormat | None
    tools: list
    parallel: bool
    kept: frozenset
    hidden: tuple[str, ...] = ()

    def splitter(self) -> OutputSplitter | None:
        return make_splitter(self.reasoning, self.state, self.calls, self.tools, self.parallel, self.hidden)

    def tracker(self, token_text: Callable[[int], str]) -> ThinkingTracker | None:
        """One sample's thinking over its token ids: usage's reasoning_tokens."""
        if self.reasoning is None:
            return None
        return ThinkingTracker(ThinkingSpec(self.reasoning.start, self.reasoning.end, self.state == "open"), token_text)


class WorkerService:
    """`start()` loads the engine on its own thread (`engine_factory` runs there) and
    takes the engine's read-only facts; `stop()` stops the engine thread. With
    `metrics`, it observes the Prometheus metrics (`self.metrics`) as events pass."""

    def __init__(self, worker_id: str, engine_factory: Callable[[], EngineProtocol], *, metrics: bool = True,
                 stall_report: float = WorkerOptions.stall_report, limits: RequestLimits = RequestLimits(),
                 templates: ChatTemplateLimits = ChatTemplateLimits()):
        self.worker_id = worker_id
        self.limits = limits
        self.templates = templates
        self.faults = FaultInjection.from_env(worker_id)  # None unless ORCHARD_FAULT_DIR is set (tests)
        self.engine_loop = EngineLoop(engine_factory, self.on_engine_events, self.faults, stall_report)
        self._with_metrics = metrics
        self.metrics: WorkerMetrics | None = None
        self.stats = EngineStats()  # the engine's own, once started
        self.draining = False
        # Keyed by the engine's id of a stream: the client's id plus "@n", unique for the
        # worker's life, so late events of a cancelled request can never reach a new
        # stream that reuses its id. `_running` holds the client ids live right now.
        self._streams: dict[str, _Stream] = {}
        self._running: set[str] = set()
        self._next_id = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="orchard-tokenize")
        # Grammars compile (and are walked a first step) on their own thread: a costly one
        # (up to seconds for a hostile regex) delays other constrained requests, never a
        # chat template or a tokenization.
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-grammar")
        # Chat templates render in processes of their own (chat_render.py): a render that
        # never ends is stopped there, and holds neither a tokenizer thread nor the loop.
        self.renders: RenderPool | None = None  # set by start for a model with a Jinja chat template
        self.pooler = None  # the model's pooling (set by start)
        self.group_stats = None  # a worker group's (set by start)
        self.group = None  # a worker group's rank 0 view (`GroupState`, set by start)
        self.tasks: tuple[str, ...] = (GENERATE,)
        self.features: tuple[str, ...] = ()  # per-request features it has (LoadReport.features)

    async def start(self, timeout: float | None = None) -> None:
        """Load the engine (on its thread) and route its events into the running loop."""
        self._loop = asyncio.get_running_loop()
        engine = await self._loop.run_in_executor(None, self.engine_loop.start, timeout)
        # Read-only after the engine is built: safe to use from this side.
        self.model_name = engine.model_name
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        # token id -> its logprob text: prompt logprobs with top k decode k + 1 texts per
        # prompt token on the event loop; each text is decoded once (at most the vocabulary)
        self._token_texts: dict[int, str] = {}
        self._piece_texts: dict[int, str] = {}  # token id -> its text, special tokens spelled (thinking markers)
        # thread-safe: specs are compiled here, before queueing (None: an engine without them)
        self.grammars = getattr(engine, "grammars", None)
        # what the model serves, and how it pools (pooling.py; an engine without one generates)
        self.pooler = getattr(engine, "pooler", None)
        self.tasks = self.pooler.tasks if self.pooler is not None else (GENERATE,)
        self.features = (SPECULATIVE,) if getattr(engine, "speculator", None) is not None else ()
        self.stats = engine.stats
        group = getattr(engine, "group", None)  # rank 0 of a worker group (cluster/worker/group/)
        self.group_stats = group.stats if group is not None else None
        self.group = group
        self._read_formats(self.tokenizer)
        if GENERATE in self.tasks and jinja_tokenizer(self.tokenizer) is not None:
            self.renders = RenderPool(self.templates, self._probe_call())
            self.renders.start()
        if self._with_metrics:
            self.metrics = WorkerMetrics(engine.model_name, self.worker_id, lambda: engine.stats,
                                         group=lambda: self.group_stats)

    async def stop(self) -> None:
        """Stop the engine thread (live requests end as aborted), the tokenizer pool and the
        render processes."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop)
        if self.renders is not None:
            await self.renders.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def on_engine_events(self, now: float, events: list) -> None:
        """Called on the engine thread: hop onto the event loop once per step."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, now, events)

    @property
    def stalled(self) -> bool:
        """The engine thread is wedged: one round of work has taken longer than its
        `stall_after` (`stall_report`, or more for a model whose steps are slow). Or, for a
        worker group, a member has been silent for `stall_report`: its steps cannot finish
        (a stopped Mac), however slow a step of the model may legitimately be."""
        return self.engine_loop.stalled() or (
            self.group is not None and bool(self.group.silent(self.engine_loop.stall_report)))

    @property
    def lagging(self) -> bool:
        """The engine's current step has run well past its usual time, not yet a stall: new
        requests are better placed elsewhere (`EngineLoop.lagging`)."""
        return not self.stalled and self.engine_loop.lagging()

    @property
    def stall_reason(self) -> str:
        """While stalled, what it says ('' otherwise): for a worker group, which rank the
        step waits on (rank 0 knows which member is late)."""
        if not self.stalled:
            return ""
        late = self.group.late() if self.group is not None else ""
        if not self.engine_loop.stalled():  # a member silent
            return late
        return f"the engine has made no progress for over {self.engine_loop.stall_after:.3g} s" + (
            f": {late}" if late else "")

    @property
    def unhealthy_reason(self) -> str:
        """Why the worker should take no new requests though its engine moves ('' when it
        may): its chat-template renders are stuck."""
        return self.renders.stuck if self.renders is not None else ""

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- Generation backend -------------------------------------------------------------
    async def list_models(self) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=self.model_name, max_model_len=self.config.max_model_len, owned_by="orchard",
                                 tasks=self.tasks)]
        )

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """See `Backend`. The gRPC deadline (`timeout`) is enforced by gRPC itself: when it
        passes, the RPC is cancelled, which closes this stream and aborts the request."""
        arrival = time.monotonic()
        self._check_serving(request.model)
        validate_request(request, self.limits)
        if GENERATE not in self.tasks:
            raise refuse_task(self.model_name, GENERATE, self.tasks)
        missing = features_asked(request) - set(self.features)
        if missing:  # as the router words it when no worker of the model has them
            raise refuse_features(self.model_name, missing)
        self._check_cost(request)  # before any work
        chat = request.WhichOneof("prompt") == "chat"
        calls = self._call_format(request)
        forced = self._force_tool_call(request, calls)
        resume = list(request.resume_token_ids)
        early = sampling_params_from_proto(request, len(resume))  # the engine's ranges, before tokenizing
        if early is not None and early.structured is not None:
            await self._compile(early.structured, forced)
        prompt = await self._prompt_token_ids(request)
        self._check_length(len(prompt), len(resume))
        params = sampling_params_from_proto(request, len(resume), check_fits(request, len(prompt),
                                                                             self.config.max_model_len))
        reading = self._chat(request, prompt, calls) if chat else None
        if params is not None and reading is not None:
            params = await self._chat_params(request, params, reading, forced)
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._running:
            raise AlreadyExists(f"request id {quoted(rid)} is already running on this worker: use a unique id")
        if params is None:  # everything was generated elsewhere already
            yield pb.GenerateResponse(
                request_id=rid, finish_reason=pb.FINISH_REASON_LENGTH, worker_id=self.worker_id,
                usage=pb.Usage(prompt_tokens=len(prompt), completion_tokens=len(resume)),
            )
            return
        splitters: dict[int, OutputSplitter] | None = None
        if reading is not None and reading.splitter() is not None:
            splitters = {0: reading.splitter()}
            if resume:  # resumed after failover: where the thinking and calls were, not sent again
                splitters[0].segments(decode_keeping(self.tokenizer, resume, reading.kept))
        # each sample's thinking followed over its tokens, here rather than in the engine's step
        # (which follows only a thinking with a budget)
        trackers: dict[int, ThinkingTracker] | None = None
        if reading is not None and reading.reasoning is not None:
            trackers = {0: reading.tracker(self._piece_text)}
            for t in resume:  # the resumed tokens count, as completion_tokens counts them
                trackers[0].add(t)
        stream = _Stream(arrival)
        engine_id = f"{rid}@{next(self._next_id)}"
        self._streams[engine_id] = stream
        self._running.add(rid)
        if self.faults is not None:
            self.faults.on_request(engine_id, request.text)
        self.engine_loop.submit(AddRequest(engine_id, prompt, params, arrival, tuple(resume)))
        finished = False
        left = params.n  # samples still running
        usage = _Usage(len(prompt))
        first = True
        try:
            while not finished:
                events = [await stream.queue.get()]
                while not stream.queue.empty():  # a slow reader gets the backlog as one chunk
                    events.append(stream.queue.get_nowait())
                chunks: dict[int, pb.GenerateResponse] = {}  # by sample index, in the order they come
                gave_up = None  # the client's error a sample ended with: raised after what came before it
                for ev in events:
                    if isinstance(ev, Rejected):
                        finished = True
                        raise (Overloaded if isinstance(ev.error, QueueFullError) else InvalidRequest)(str(ev.error))
                    if isinstance(ev, Failed):
                        finished = True
                        raise InternalError(ev.message)
                    if ev.error is not None:  # ended for what it asked: the client's error, not the worker's
                        gave_up, left = InvalidRequest(ev.error), left - 1
                        break
                    chunk = chunks.get(ev.index)
                    if chunk is None:
                        chunk = chunks[ev.index] = pb.GenerateResponse(request_id=rid, worker_id=self.worker_id,
                                                                       index=ev.index)
                    thinking = None
                    if trackers is not None:
                        thinking = trackers.get(ev.index) or trackers.setdefault(
                            ev.index, reading.tracker(self._piece_text))
                    if self._add_output(chunk, ev, usage, thinking):
                        left -= 1
                        finished = left == 0 or ev.finish_reason == "abort"
                for index, chunk in chunks.items():
                    if first and (chunk.token_ids or chunk.finish_reason):
                        first = False
                        if request.sampling.echo:
                            chunk.prompt_token_ids.extend(prompt)
                            chunk.prompt_text = self.tokenizer.decode(prompt)
                            if request.sampling.HasField("prompt_logprobs"):  # the first token leads, without one
                                rest = list(chunk.prompt_logprobs)
                                del chunk.prompt_logprobs[:]
                                chunk.prompt_logprobs.add(token_id=prompt[0], logprob=float("nan"),
                                                          token=self._token_text(prompt[0]))
                                chunk.prompt_logprobs.extend(rest)
                    if finished and chunk is list(chunks.values())[-1]:
                        chunk.usage.CopyFrom(usage.proto())
                    parts = [chunk]
                    if splitters is not None:  # each sample's thinking and calls are its own
                        if index not in splitters:
                            splitters[index] = reading.splitter()
                        parts = split_chunk(splitters[index], chunk)
                    for part in parts:
                        if (part.token_ids or part.text or part.reasoning or part.tool_calls or part.finish_reason
                                or part.HasField("usage")):
                            yield part
                if gave_up is not None:
                    finished = True
                    raise gave_up
        finally:
            self._streams.pop(engine_id, None)
            self._running.discard(rid)
            if not finished or left > 0:  # the client left, or one sample aborted and ended the stream
                self.engine_loop.submit(AbortRequest(engine_id))

    # -- embeddings and scores (pooling requests: cluster/worker/pooling.py) ---------------
    async def embed(self, request: pb.EmbedRequest, timeout: float | None = None) -> pb.EmbedResponse:
        """See `Backend`: each input is a prefill-only request in the engine; the embeddings
        come back in input order."""
        arrival = time.monotonic()
        self._check_pooling_request(request.model, EMBED)
        validate_embed_request(request, self.limits)
        self._check_queue_holds(len(request.inputs))
        params = PoolingParams(EMBED, request.dimensions if request.HasField("dimensions") else None,
                               request.normalize if request.HasField("normalize") else None)
        try:
            self.pooler.check(params)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        inputs = []
        for i, x in enumerate(request.inputs):
            if x.WhichOneof("input") == "text":
                inputs.append((f"input {i}", len(x.text), lambda text=x.text: self.tokenizer.encode(text)))
            else:
                ids = list(x.token_ids.ids)
                bad = [t for t in ids if t >= self.vocab_size]
                if bad:
                    raise InvalidRequest(f"input {i}: token id {bad[0]} is outside the vocabulary "
                                         f"(0 .. {self.vocab_size - 1})")
                inputs.append((f"input {i}", None, ids))
        prompts = await self._pooling_prompts(inputs)
        outs = await self._run_pooled(request.request_id, prompts, SamplingParams(max_tokens=1, pooling=params),
                                      arrival)
        response = pb.EmbedResponse(model=self.model_name, worker_id=self.worker_id, usage=self._pooled_usage(outs))
        for i, out in enumerate(outs):
            response.data.add(index=i, values=out.pooled.tolist())
        return response

    async def score(self, request: pb.ScoreRequest, timeout: float | None = None) -> pb.ScoreResponse:
        """See `Backend`: each (query, document) pair is a prefill-only request scored by
        the reranker (pooling.py); the scores come back in document order."""
        arrival = time.monotonic()
        self._check_pooling_request(request.model, SCORE)
        validate_score_request(request, self.limits)
        self._check_queue_holds(len(request.documents))
        inputs = []
        for i, (query, document) in enumerate(score_pairs(request)):
            if self.pooler.score_format == "pair":  # a cross-encoder: the tokenizer's own pair encoding
                chars = len(query) + len(document)
                encode = lambda q=query, d=document: self.tokenizer.encode(q, text_pair=d)  # noqa: E731
            else:  # Qwen3-Reranker's prompt, built when it is tokenized
                chars = len(yes_no_prompt("", "", request.instruction or None)) + len(query) + len(document)
                encode = lambda q=query, d=document: self.tokenizer.encode(  # noqa: E731
                    yes_no_prompt(q, d, request.instruction or None))
            inputs.append((f"document {i} with its query", chars, encode))
        prompts = await self._pooling_prompts(inputs)
        outs = await self._run_pooled(request.request_id, prompts,
                                      SamplingParams(max_tokens=1, pooling=PoolingParams(SCORE)), arrival)
        return pb.ScoreResponse(model=self.model_name, worker_id=self.worker_id, usage=self._pooled_usage(outs),
                                scores=[float(out.pooled[0]) for out in outs])

    def _check_pooling_request(self, model: str, task: str) -> None:
        self._check_serving(model)
        if task not in self.tasks:
            raise refuse_task(self.model_name, task, self.tasks)

    def _check_queue_holds(self, num_inputs: int) -> None:
        """Each input of a pooling request is queued as a request: more than the waiting
        queue holds could never be taken (it would come back as a full queue, a verdict on
        the worker, from every worker the router tries)."""
        cap = getattr(self.config, "max_waiting", 0)
        if cap and num_inputs > cap:
            raise InvalidRequest(f"{num_inputs} inputs: more than this worker's waiting queue holds at once "
                                 f"(max_waiting={cap}); send at most {cap} a request")

    def _check_serving(self, model: str) -> None:
        """Unavailable / NotFound for a request this worker cannot take now, whatever it asks."""
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is draining: it takes no new requests; send this one elsewhere")
        if not self.engine_loop.alive or self._loop is None:
            raise Unavailable(f"worker {self.worker_id} is not serving (starting or stopping)")
        if self.stalled:
            raise Unavailable(f"worker {self.worker_id}'s engine has made no progress for "
                              f"{self.engine_loop.stall_after:.3g} s "
                              "(stalled): send this request elsewhere")
        if model and model != self.model_name:
            raise NotFound(f"model {quoted(model)} is not served here; this worker serves {self.model_name!r}")

    async def _pooling_prompts(self, inputs: list[tuple[str, int | None, Callable | list[int]]]) -> list[list[int]]:
        """The token ids of a pooling request's inputs, in order: (what it is called in a
        message, its characters and a function that tokenizes it, or None and its token
        ids). Every bound that characters can tell is checked before anything is tokenized
        (each input within max_model_len here, all together within max_pooling_tokens by
        the request's validation), then each input's tokens as it is tokenized: a refused
        request costs at most one input's tokenization past the limits."""
        max_len, limit = self.config.max_model_len, self.limits.max_pooling_tokens
        bound = CHARS_PER_TOKEN_BOUND * max_len
        for what, chars, _ in inputs:  # (their total: validate_embed_request / validate_score_request)
            if chars is not None and chars > bound:
                raise InvalidRequest(f"{what} has {chars} characters, more than max_model_len={max_len} tokens can "
                                     f"hold (at most {bound} characters are read): shorten it")
        prompts: list[list[int]] = []
        total = 0
        for what, chars, ids in inputs:
            if chars is not None:
                ids = list(ids() if chars <= INLINE_TOKENIZE_CHARS else
                           await asyncio.get_running_loop().run_in_executor(self._pool, ids))
            if len(ids) > max_len:
                raise InvalidRequest(f"{what} has {len(ids)} tokens, more than max_model_len={max_len}: shorten it")
            total += len(ids)
            if total > limit:
                raise InvalidRequest(f"the inputs have at least {total} tokens together (up to {what}), more than "
                                     f"max_pooling_tokens={limit} (--max-pooling-tokens): send fewer or shorter "
                                     "inputs")
            prompts.append(ids)
        return prompts

    @staticmethod
    def _pooled_usage(outs: list[RequestOutput]) -> pb.Usage:
        return pb.Usage(prompt_tokens=sum(o.num_prompt_tokens for o in outs),
                        cached_tokens=sum(o.num_cached_tokens for o in outs))

    async def _run_pooled(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                          arrival: float) -> list[RequestOutput]:
        """Queue one pooling request per prompt (packed by the engine like any prompts) and
        wait for them all; their outputs in order. Leaving early (cancel, deadline) aborts
        the ones still running."""
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._running:
            raise AlreadyExists(f"request id {quoted(rid)} is already running on this worker: use a unique id")
        stream = _Stream(arrival)
        base = f"{rid}@{next(self._next_id)}"
        ids = [f"{base}/{i}" for i in range(len(prompts))]
        for engine_id in ids:
            self._streams[engine_id] = stream
        self._running.add(rid)
        done: dict[str, RequestOutput] = {}
        try:
            for engine_id, prompt in zip(ids, prompts):
                self.engine_loop.submit(AddRequest(engine_id, prompt, params, arrival))
            while len(done) < len(ids):
                ev = await stream.queue.get()
                if isinstance(ev, Rejected):
                    raise (Overloaded if isinstance(ev.error, QueueFullError) else InvalidRequest)(str(ev.error))
                if isinstance(ev, Failed):
                    raise InternalError(ev.message)
                if isinstance(ev, RequestOutput) and ev.finished:
                    if ev.pooled is None:  # aborted (the worker is stopping)
                        raise Unavailable(f"worker {self.worker_id} stopped before the request finished: retry it")
                    done[ev.request_id] = ev
        finally:
            for engine_id in ids:
                self._streams.pop(engine_id, None)
                if engine_id not in done:
                    self.engine_loop.submit(AbortRequest(engine_id))
            self._running.discard(rid)
        return [done[i] for i in ids]

    # -- admin ------------------------------------------------------------------------
    def load_report(self) -> pb.LoadReport:
        s, c = self.stats, self.config
        return pb.LoadReport(
            worker_id=self.worker_id, model=self.model_name, num_running=s.num_running, num_waiting=s.num_waiting,
            kv_blocks_used=s.num_blocks_used, kv_blocks_total=s.num_blocks_total, max_num_seqs=c.max_num_seqs,
            block_size=c.block_size, max_model_len=c.max_model_len, draining=self.draining, stalled=self.stalled,
            lagging=self.lagging,
            unhealthy_reason=self.unhealthy_reason or self.stall_reason, state_slots_used=s.state_slots_used,
            state_slots_total=s.state_slots_total, tasks=self.tasks, group=self._group_info(),
            features=self.features,
        )

    def _group_info(self) -> pb.GroupInfo | None:
        g = self.group_stats
        if g is None:
            return None
        return pb.GroupInfo(size=g.size, parallel=g.parallel, members=[
            pb.GroupMember(rank=m["rank"], host=m["host"], memory_bytes=m["memory"], weight_bytes=m["weights"],
                           first_layer=m["layers"][0], last_layer=m["layers"][1],
                           step_seconds=g.progress.recent.get(m["rank"], 0.0) if g.progress else 0.0)
            for m in g.members])

    def set_draining(self, draining: bool) -> pb.DrainResponse:
        if draining != self.draining:
            log.info("worker %s: %s", self.worker_id, "draining" if draining else "taking requests again")
        self.draining = draining
        return pb.DrainResponse(draining=draining, num_running=self.stats.num_running,
                                num_waiting=self.stats.num_waiting)

    def end_streams(self) -> int:
        """End every live stream now as aborted, its request taken out of the engine; how
        many. The router resumes each elsewhere after the tokens it sent, or holds it until
        this worker takes requests again (the machine is about to sleep)."""
        for engine_id, stream in list(self._streams.items()):
            stream.queue.put_nowait(RequestOutput(engine_id, [], "", True, "abort"))
        return len(self._running)

    # -- helpers ------------------------------------------------------------------------
    async def _prompt_token_ids(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt's token ids (a validated request has one of the three kinds)."""
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which == "text":
            return await self._encode(request.text)
        tools = parse_tools(request.tools) if tool_choice_mode(request) != "none" else None
        if self.renders is None:  # no Jinja template: the tokenizer's own rendering (trusted code)
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, self._apply_chat_template, request.chat.messages, tools, template_kwargs(request))
        text = await self._render_chat(request.chat.messages, tools or None, template_kwargs(request))
        return await self._encode(text, add_special_tokens=False)

    async def _encode(self, text: str, **kwargs) -> list[int]:
        """`text`'s token ids: inline when short, else on the tokenizer's thread pool."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text, **kwargs))
        return list(await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(self.tokenizer.encode, text, **kwargs)))

    async def _render_chat(self, messages, tools: list[dict] | None, kwargs: dict) -> str:
        """The chat's prompt text, rendered by the model's Jinja template in a render
        process. A template that takes a call's arguments only as text (DeepSeek's
        concatenate them) gets them so on a second try."""
        try:
            return await self.renders.render(self._render_call(template_messages(messages), tools, kwargs))
        except TemplateTypeError:
            if not any(m.tool_calls for m in messages):
                raise
        return await self.renders.render(self._render_call(template_messages(messages, arguments_as_text=True),
                                                           tools, kwargs))

    def _render_call(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> dict:
        try:
            return render_call(self.tokenizer, messages, tools, kwargs)
        except Exception as e:  # no template for these (a dict of templates without a default, ...)
            raise InvalidRequest(f"the chat template could not be applied to these messages: {e}") from None

    def _probe_call(self) -> dict | None:
        """What the render processes' health probe renders: the model's template on a
        one-line chat (None, where no call can be built for it: the pool's own probe)."""
        try:
            return render_call(self.tokenizer, PROBE_MESSAGES)
        except Exception:
            return None

    def _apply_chat_template(self, messages, tools: list[dict] | None = None, kwargs: dict | None = None) -> list[int]:
        """The chat's prompt tokens, for a tokenizer that renders chats its own way. A
        template that takes a call's arguments only as text gets them so on a second try."""
        extra = dict(kwargs or {}, **({"tools": tools} if tools else {}))
        try:
            try:
                ids = self.tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                                         tokenize=True, **extra)
            except TypeError:
                if not any(m.tool_calls for m in messages):
                    raise
                ids = self.tokenizer.apply_chat_template(template_messages(messages, arguments_as_text=True),
                                                         add_generation_prompt=True, tokenize=True, **extra)
        except Exception as e:
            raise InvalidRequest(f"the chat template could not be applied to these messages: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers may return an encoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    async def _compile(self, spec: StructuredOutput, forced: str | None = None) -> None:
        """Compile (and cache) a structured output's grammar before any engine work, off
        the event loop: a schema that cannot be compiled, or that no output can follow, is
        the request's fault. `forced`: the tool_choice whose call the grammar forces."""
        if self.grammars is None:
            raise InvalidRequest("structured outputs are not supported by this worker's engine")
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.grammars.compile, spec)
        except InvalidGrammar as e:
            if forced is not None:
                raise BadField("tools", f"tool_choice {forced} forces a call that the tools' parameters schemas "
                                        f"make impossible: {str(e).replace('the grammar', 'the call')}") from None
            raise BadField("response_format", str(e)) from None

    def _read_formats(self, tok) -> None:
        """The model's thinking and call formats, from its chat template and vocabulary, and
        its special tokens (a marker that is one is named <[id]> in a grammar)."""
        template = getattr(tok, "chat_template", None)
        vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}  # (a test's bare tokenizer has none)
        self.reasoning = reasoning_format(template, vocab)
        mlx = None
        if getattr(tok, "has_tool_calling", False):
            mlx = (tok.tool_call_start, tok.tool_call_end or "", tok.tool_parser,
                   getattr(tok.tool_parser, "__module__", "") or "")
        self.calls = call_format(template, vocab, mlx)
        added = getattr(tok, "added_tokens_decoder", None) or {}
        self._special = {t.content: i for i, t in added.items() if getattr(t, "special", False)}

    def _call_format(self, request: pb.GenerateRequest) -> CallFormat | None:
        """The model's call format for a request that offers tools (None without); a model
        with no tool calling refuses tools."""
        if tool_choice_mode(request) == "none":
            return None
        if self.calls is None:
            raise InvalidRequest(f"model {self.model_name!r} has no tool calling (its chat template and tokenizer "
                                 "have no tool-call format Orchard or mlx-lm knows): send the request without tools")
        return self.calls

    def _atom(self, text: str) -> str:
        """A marker as a grammar atom (a terminal of the grammar): <[id]> for a special token,
        else its quoted text."""
        i = self._special.get(text)
        return f"<[{i}]>" if i is not None else json.dumps(text)

    def _force_tool_call(self, request: pb.GenerateRequest, calls: CallFormat | None) -> str | None:
        """tool_choice "required" or a named function: the request's output is constrained
        (a grammar in its `structured` field) to one call in the family's own format, the
        arguments following the function's parameters schema; a format that allows no
        grammar (XML calls, pythonic ones) is refused by name. Returns the choice (for
        messages), None when nothing is forced."""
        mode = tool_choice_mode(request)
        if mode not in ("required", "function"):
            return None
        what = "'required'" if mode == "required" else f"function {quoted(request.tool_choice.function)}"
        if request.sampling.HasField("structured"):
            raise InvalidRequest(f"tool_choice {what} and a structured output (response_format) cannot be combined: "
                                 "send one of them")
        if calls.grammar is None:
            raise InvalidRequest(f"tool_choice {what} is enforced by constrained decoding, which the call format of "
                                 f"model {self.model_name!r} ({calls.name}) does not allow: use tool_choice 'auto'")
        choice = "required" if mode == "required" else request.tool_choice.function
        try:
            spec = call_constraint(calls.grammar, parse_tools(request.tools), choice, self._atom, calls.start, calls.end)
        except InvalidGrammar as e:
            raise InvalidRequest(str(e)) from None
        request.sampling.structured.grammar = spec.spec
        return what

    def _chat(self, request: pb.GenerateRequest, prompt: list[int], calls: CallFormat | None) -> _Chat:
        fmt = self.reasoning
        state = prompt_state(fmt, self.tokenizer.decode(prompt[-32:], skip_special_tokens=False)) if fmt else "free"
        markers = (fmt.markers if fmt else ()) + (calls.markers if calls else ())
        kept = frozenset(self._special[m] for m in markers if m in self._special)
        parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
        hidden = tuple(m for m in (calls.markers if calls else ()) if m in self._special)
        return _Chat(fmt, state, calls, parse_tools(request.tools) if calls else [], parallel, kept, hidden)

    async def _chat_params(self, request: pb.GenerateRequest, params: SamplingParams, reading: _Chat,
                           forced: str | None) -> SamplingParams:
        """A chat's params: the family's markers kept in its text; for a thinking model with a
        budget the thinking followed by the engine (and ended at the budget), and a structured
        output or forced call applied to the answer after the thinking."""
        fmt, changes = reading.reasoning, {"kept_special_ids": reading.kept}
        if fmt is not None:
            budget = request.thinking_token_budget if request.HasField("thinking_token_budget") else None
            if budget is not None:  # without one the engine's step does nothing for the thinking
                end_ids = tuple(self.tokenizer.encode(fmt.end, add_special_tokens=False))
                changes["thinking"] = ThinkingSpec(fmt.start, fmt.end, reading.state == "open", budget, end_ids)
            if params.structured is not None:
                thinking = None
                if reading.state != "closed":
                    # a model that opens its thinking itself may skip it, unless a budget asks for it
                    thinking = fmt.thinking_grammar(self._atom, open=reading.state == "open",
                                                    optional=reading.state == "free" and budget is None)
                prefix = fmt.answer_prefix(self._atom) if forced is None else ""  # a forced call has its own
                try:
                    changes["structured"] = with_thinking(params.structured, thinking, prefix)
                except InvalidGrammar as e:
                    raise InvalidRequest(str(e)) from None
                await self._compile(changes["structured"], forced)
        return replace(params, **changes)

    def _check_cost(self, request: pb.GenerateRequest) -> None:
        """What only the worker knows: the vocabulary, and how long a text can possibly fit."""
        bad = [t for t in request.sampling.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"stop token id {bad[0]} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        bad = [t for t in request.sampling.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token id {bad[0]} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        chars, bound = prompt_chars(request), CHARS_PER_TOKEN_BOUND * self.config.max_model_len
        if chars > bound:
            raise InvalidRequest(f"the prompt has {chars} characters, more than max_model_len={self.config.max_model_len} "
                                 f"tokens can hold (at most {bound} characters are read): shorten it")
        if len(request.token_ids.ids) > self.config.max_model_len:
            raise InvalidRequest(f"the prompt has {len(request.token_ids.ids)} tokens, more than "
                                 f"max_model_len={self.config.max_model_len}: shorten it")

    def _check_length(self, num_prompt: int, num_resumed: int) -> None:
        n, limit = num_prompt + num_resumed, self.config.max_model_len
        if n > limit:
            what = f"{num_prompt} prompt + {num_resumed} resumed tokens" if num_resumed else f"{num_prompt} tokens"
            raise InvalidRequest(f"the prompt has {what}, more than max_model_len={limit}: shorten it")

    def _add_output(self, chunk: pb.GenerateResponse, out: RequestOutput, usage: "_Usage",
                    thinking: ThinkingTracker | None = None) -> bool:
        """Append one engine output to `chunk` (and its tokens to its sample's `thinking`);
        True when it finished its sample."""
        chunk.token_ids.extend(out.new_token_ids)
        if thinking is not None:
            for t in out.new_token_ids:
                thinking.add(t)
        chunk.text += out.new_text
        if out.prompt_logprobs is not None:
            for token, lp, top in out.prompt_logprobs:
                chunk.prompt_logprobs.append(pb.TokenLogprob(
                    token_id=token, logprob=lp, token=self._token_text(token),
                    top=[pb.TopLogprob(token_id=t, logprob=v, token=self._token_text(t)) for t, v in top],
                ))
        if out.logprobs is not None:
            tops = out.top_logprobs or [[] for _ in out.logprobs]
            for token, lp, top in zip(out.new_token_ids, out.logprobs, tops):
                chunk.logprobs.append(pb.TokenLogprob(
                    token_id=token, logprob=lp, token=self._token_text(token),
                    top=[pb.TopLogprob(token_id=t, logprob=v, token=self._token_text(t)) for t, v in top],
                ))
        if not out.finished:
            return False
        chunk.finish_reason = FINISH_REASON_TO_PROTO.get(out.finish_reason, pb.FINISH_REASON_ABORT)
        if out.stop_reason is not None:
            chunk.stop_reason = str(out.stop_reason)
        usage.completion_tokens += out.num_output_tokens  # the resumed tokens included
        if thinking is not None:
            usage.reasoning_tokens += thinking.reasoning_tokens
        if out.index == 0 or out.finish_reason == "abort":
            usage.cached_tokens = min(out.num_cached_tokens, usage.prompt_tokens)
        return True

    def _token_text(self, token_id: int) -> str:
        """The token's text; a token that is part of a multi-byte character is spelled as
        its own bytes, "bytes:\\xe2\\x80" (as OpenAI does), not as U+FFFD."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            raw = token_bytes(self.tokenizer, token_id) if "\ufffd" in text else None
            if raw is not None and raw.decode("utf-8", "replace") == text:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_texts[token_id] = text
        return text

    def _piece_text(self, token_id: int) -> str:
        text = self._piece_texts.get(token_id)
        if text is None:
            text = self._piece_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _dispatch(self, now: float, events: list) -> None:
        """On the event loop: route one step's events to their streams; observe metrics."""
        m = self.metrics
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue  # cancelled meanwhile
            if isinstance(ev, Scheduled):
                if m is not None:
                    m.queue_time.observe(ev.queue_time)
                continue
            if m is not None and isinstance(ev, RequestOutput) and ev.pooled is None:  # (generation latencies)
                if ev.new_token_ids:
                    last = stream.last_token_time
                    if last is None:
                        m.ttft.observe(now - stream.arrival)
                    else:  # a step that kept draft tokens brought several: the interval spread over them
                        n = len(ev.new_token_ids)
                        for _ in range(n):
                            m.itl.observe((now - last) / n)
                    stream.last_token_time = now
                if ev.finished:
                    m.e2e.observe(now - stream.arrival)
            stream.queue.put_nowait(ev)
