"""The worker's asyncio side: requests in, chunks out, one engine thread behind it.

`WorkerService` is a `cluster.api.servicer.Backend` (`generate`, `list_models`), used as
is by the gRPC servicer and by the OpenAI HTTP front, plus the admin calls
(`load_report`, `set_draining`). It owns the engine thread (`EngineLoop`, whose event
sink it is), checks that it can take a request, has it made ready for the engine
(prompt.py: tokens, chat templates, tool forcing, thinking, grammars), hands it to the
engine thread, routes the engine's events to one asyncio queue per request and has them
made into responses (stream.py; embed and score: embed_score.py). It never touches
MLX.

Errors are `cluster.api.errors` exceptions; the front ends map them to gRPC statuses
and HTTP codes. A request whose consumer goes away (cancel, disconnect, closed
iterator, the gRPC deadline) is aborted in the engine at once, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from cluster.api.errors import AlreadyExists, NotFound, Unavailable
from cluster.api.limits import RequestLimits, quoted
from cluster.api.pooling import EMBED, GENERATE, SCORE, refuse_task
from cluster.api.tokenizer_files import tokenizer_files
from cluster.api.wire import SPECULATIVE, features_asked, refuse_features, validate_request
from cluster.platform import process_memory
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.worker.chat_render import ChatTemplateLimits, RenderPool, jinja_tokenizer
from cluster.worker.config import WorkerOptions
from cluster.worker.engine import EngineStats, RequestOutput
from cluster.worker.engine_loop import AbortRequest, AddRequest, EngineLoop, Failed, Rejected, Scheduled
from cluster.worker.engine_protocol import EngineProtocol
from cluster.worker.faults import FaultInjection
from cluster.worker.metrics import WorkerMetrics
from cluster.worker.embed_score import EmbedScoreRequests
from cluster.worker.prompt import PromptBuilder, probe_call
from cluster.worker.sampling_params import SamplingParams
from cluster.worker.stream import Stream, StreamAssembler, TokenTexts, engine_verdict

log = logging.getLogger(__name__)
RESIDENT_READ_SECONDS = 1.0  # the least time between two reads of the process's memory (load_report)
ENGINE_STOP_SECONDS = 30.0  # how long a stopping worker waits for its engine thread's last step and close


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
        self._streams: dict[str, Stream] = {}
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
        self.prompts: PromptBuilder | None = None  # the model's prompts (set by start)
        self.pooler = None  # the model's pooling (set by start)
        self.config = None  # the engine's (set by start)
        self.pooling: EmbedScoreRequests | None = None  # its embed and score requests (set by start, for a pooler)
        self.group_stats = None  # a worker group's (set by start)
        self.group = None  # a worker group's rank 0 view (`GroupState`, set by start)
        self.kv_tier = None  # the engine's disk tier, when it has one (set by start)
        self.tasks: tuple[str, ...] = (GENERATE,)
        self.features: tuple[str, ...] = ()  # per-request features it has (LoadReport.features)
        self._loaded = False  # its model is loaded (start)
        self._resident = (0.0, 0)  # (when read, bytes): the process's memory, read at most once a second
        self.tokenizer_files = None  # GetTokenizer's answer (set by start; None: none can be sent)

    async def start(self, timeout: float | None = None) -> None:
        """Load the engine (on its thread) and route its events into the running loop."""
        self._loop = asyncio.get_running_loop()
        engine = await self._loop.run_in_executor(None, self.engine_loop.start, timeout)
        # Read-only after the engine is built: safe to use from this side.
        self.model_name = engine.model_name
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.texts = TokenTexts(self.tokenizer)
        # thread-safe: specs are compiled by the prompt builder, before queueing (None: an engine without them)
        grammars = getattr(engine, "grammars", None)
        # what the model serves, and how it pools (pooling.py; an engine without one generates)
        self.pooler = getattr(engine, "pooler", None)
        self.tasks = self.pooler.tasks if self.pooler is not None else (GENERATE,)
        self.features = (SPECULATIVE,) if getattr(engine, "speculator", None) is not None else ()
        self.stats = engine.stats
        self.kv_tier = getattr(engine, "kv_tier", None)  # the disk tier (--kv-disk-dir)
        self._loaded = True
        group = getattr(engine, "group", None)  # rank 0 of a worker group (cluster/worker/group/)
        self.group_stats = group.stats if group is not None else None
        self.group = group
        if GENERATE in self.tasks and jinja_tokenizer(self.tokenizer) is not None:
            self.renders = RenderPool(self.templates, probe_call(self.tokenizer))
            self.renders.start()
        self.prompts = PromptBuilder(self.model_name, self.tokenizer, self.vocab_size, self.config.max_model_len,
                                     grammars, self.renders, self._pool, self._grammar_pool)
        if GENERATE in self.tasks:  # for routers that hash prompts as this worker does (api/tokenizer_files.py)
            self.tokenizer_files = await self._loop.run_in_executor(None, self._saved_tokenizer)
        if self.pooler is not None:
            self.pooling = EmbedScoreRequests(self.model_name, self.worker_id, self.pooler, self.tokenizer,
                                           self.vocab_size, self.config, self.limits, self._pool, self._run_pooled)
        if self._with_metrics:
            self.metrics = WorkerMetrics(engine.model_name, self.worker_id, lambda: engine.stats,
                                         group=lambda: self.group_stats)

    async def stop(self) -> None:
        """Stop the engine thread (live requests end as aborted; the engine closes, its disk
        tier's queued writes landing first, for up to --kv-disk-flush-timeout more), the
        tokenizer pool and the render processes."""
        disk = self.config is not None and self.config.kv_disk_dir
        timeout = ENGINE_STOP_SECONDS + (self.config.kv_disk_flush_timeout if disk else 0.0)
        await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop, timeout)
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
        prompt = await self.prompts.build(request)
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._running:
            raise AlreadyExists(f"request id {quoted(rid)} is already running on this worker: use a unique id")
        if prompt.params is None:  # everything was generated elsewhere already
            yield pb.GenerateResponse(
                request_id=rid, finish_reason=pb.FINISH_REASON_LENGTH, worker_id=self.worker_id,
                usage=pb.Usage(prompt_tokens=len(prompt.token_ids), completion_tokens=len(prompt.resume)),
            )
            return
        assembler = StreamAssembler(request, rid, self.worker_id, prompt, self.texts)
        stream = Stream(arrival)
        engine_id = f"{rid}@{next(self._next_id)}"
        self._streams[engine_id] = stream
        self._running.add(rid)
        if self.faults is not None:
            self.faults.on_request(engine_id, request.text)
        self.engine_loop.submit(AddRequest(engine_id, prompt.token_ids, prompt.params, arrival,
                                           tuple(prompt.resume)))
        try:
            while not assembler.finished:
                events = [await stream.queue.get()]
                while not stream.queue.empty():  # a slow reader gets the backlog as one chunk
                    events.append(stream.queue.get_nowait())
                for chunk in assembler.chunks(events):
                    yield chunk
        finally:
            self._streams.pop(engine_id, None)
            self._running.discard(rid)
            if not assembler.finished or assembler.left > 0:  # the client left, or one sample aborted and ended it
                self.engine_loop.submit(AbortRequest(engine_id))

    async def tokenize(self, request: pb.GenerateRequest, timeout: float | None = None) -> pb.TokenizeResponse:
        """See `Backend`: the prompt generation would prefill for `request`, not run."""
        self._check_serving(request.model)
        validate_request(request, self.limits)
        if GENERATE not in self.tasks:
            raise refuse_task(self.model_name, GENERATE, self.tasks)
        ids = await self.prompts.count(request)
        return pb.TokenizeResponse(model=self.model_name, token_ids=ids, max_model_len=self.config.max_model_len,
                                   worker_id=self.worker_id)

    # -- embeddings and scores (embed_score.py; the engine's: pooling.py) -----------------
    async def embed(self, request: pb.EmbedRequest, timeout: float | None = None) -> pb.EmbedResponse:
        """See `Backend`: each input is a prefill-only request in the engine; the embeddings
        come back in input order."""
        arrival = time.monotonic()
        self._check_pooling_request(request.model, EMBED)
        return await self.pooling.embed(request, arrival)

    async def score(self, request: pb.ScoreRequest, timeout: float | None = None) -> pb.ScoreResponse:
        """See `Backend`: each (query, document) pair is a prefill-only request scored by
        the reranker (pooling.py); the scores come back in document order."""
        arrival = time.monotonic()
        self._check_pooling_request(request.model, SCORE)
        return await self.pooling.score(request, arrival)

    def _check_pooling_request(self, model: str, task: str) -> None:
        self._check_serving(model)
        if task not in self.tasks:
            raise refuse_task(self.model_name, task, self.tasks)

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

    async def _run_pooled(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                          arrival: float) -> list[RequestOutput]:
        """Queue one pooling request per prompt (packed by the engine like any prompts) and
        wait for them all; their outputs in order. Leaving early (cancel, deadline) aborts
        the ones still running."""
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._running:
            raise AlreadyExists(f"request id {quoted(rid)} is already running on this worker: use a unique id")
        stream = Stream(arrival)
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
                if isinstance(ev, (Rejected, Failed)):
                    raise engine_verdict(ev)
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
            features=self.features, resident_bytes=self.resident_bytes(),
            kv_disk=self.kv_tier.info() if self.kv_tier is not None else None,
            prefill_tokens_per_second=s.prefill_tokens_per_second, queued_prefill_tokens=s.queued_prefill_tokens,
            tokenizer_digest=self.tokenizer_files.digest if self.tokenizer_files is not None else "",
        )

    def _saved_tokenizer(self):
        try:
            return tokenizer_files(self.tokenizer, renders_jinja=self.renders is not None)
        except Exception as e:  # routers then place this model's requests by their approximate map
            log.warning("worker %s: its tokenizer cannot be sent to routers: %s", self.worker_id, e)
            return None

    def resident_bytes(self) -> int:
        """The process's resident memory once its model is loaded (0 before), what the
        fleet's footprint estimate is checked against; read at most once a second, since
        every heartbeat and GetLoad asks."""
        if not self._loaded:
            return 0
        when, value = self._resident
        now = time.monotonic()
        if now - when >= RESIDENT_READ_SECONDS or not value:
            value = process_memory()
            self._resident = (now, value)
        return value

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
