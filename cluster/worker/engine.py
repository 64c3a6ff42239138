"""The continuous-batching engine: schedule -> prepare -> forward -> sample -> postprocess.

Single-threaded: whoever owns the engine (the worker's engine thread, a test, a
benchmark) calls `step()` while `has_unfinished()`. Nothing here knows about gRPC.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from cluster import platform
from cluster.api.buckets import KV_USAGE_BUCKETS
from cluster.formats.thinking import ThinkingTracker
from cluster.worker.block_manager import BlockManager
from cluster.worker.config import EngineConfig
from cluster.worker.detokenizer import IncrementalDetokenizer
from cluster.worker.model_runner import (ModelRunner, StepBatch, default_kv_budget, has_recurrent_layers,
                                         kv_bytes_per_block, load_model, text_args, weight_dtype)
from cluster.worker.pooling import Pooler
from cluster.worker.pooling_requests import PooledRows, PoolingRequests
from cluster.worker.sampler import Sampler
from cluster.worker.sampling_params import SamplingParams
from cluster.worker.scheduler import Scheduler, SchedulerOutput
from cluster.worker.sequence import Sequence, SequenceStatus
from cluster.worker.spec_decode import build_speculator
from cluster.worker.spec_decode.verify import accept_drafts, verify_sampled_drafts
from cluster.worker.state_slots import StateSlots
from cluster.worker.structured import GrammarCompiler, allocate_bitmask, fill_bitmasks, grammar_error

if TYPE_CHECKING:
    from cluster.worker.spec_decode.speculator import SpecStats

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`: try again later (HTTP 429 / RESOURCE_EXHAUSTED)."""


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str  # the request's (its n samples share it; `index` tells them apart)
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None  # of new_token_ids, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0  # which of the request's n samples
    # with the first token, when asked: for each prompt token after the first, (its id,
    # its logprob given the tokens before it, the top alternatives [(id, logprob)])
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # a pooling request's result, with its finish: the embedding (float32 [dimensions]) or
    # the score ([1]); no tokens
    pooled: np.ndarray | None = None
    # set when the request ended ("abort") for what it asked: its structured output could not
    # go on (the grammar ran past the constrained decoder's limits). The client's error.
    error: str | None = None


@dataclass
class EngineStats:
    """Counters for metrics and load reports (read from any thread: plain ints)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    state_slots_used: int = 0  # a hybrid model's recurrent-state slots (0 / 0 otherwise)
    state_slots_total: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_steps: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    finished: dict = field(default_factory=dict)
    # Each step's KV usage (blocks held once the step is scheduled / total), counted into
    # KV_USAGE_BUCKETS: a load's peak from every step, not from when a scraper looked.
    kv_usage_step_counts: list = field(default_factory=lambda: [0] * len(KV_USAGE_BUCKETS))
    kv_usage_step_sum: float = 0.0
    spec_decode: SpecStats | None = None  # when speculating (vLLM's counters)

    def observe_kv_usage(self, usage: float) -> None:
        self.kv_usage_step_counts[bisect.bisect_left(KV_USAGE_BUCKETS, usage)] += 1
        self.kv_usage_step_sum += usage


@dataclass
class PendingStep:
    """A step between `Engine.begin_step` and `Engine.finish_step`."""

    t0: float
    plan: SchedulerOutput
    batch: StepBatch | None = None  # for a plan that is not empty
    pooling: PooledRows = field(default_factory=list)
    # (batch-size bucket, drafts kept) when the speculation policy drew this step for its
    # wall-clock trial of drafts against none (spec_decode/policy.py: WallCheck)
    wall_trial: tuple[int, bool] | None = None


def _history(entry, j: int) -> tuple[list[int], int]:
    """The penalties' history of an entry's sampled row j: its tokens, then its first j drafts."""
    seq = entry.seq
    if j and seq.sampling_params.processes_logits:
        return seq.token_ids + entry.spec_token_ids[:j], seq.num_prompt_tokens
    return seq.token_ids, seq.num_prompt_tokens


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), model_name: str = "model",
                 pooler: Pooler | None = None, runner_factory=None, draft=None):
        """`pooler`: the model's pooling and tasks (`Pooler.for_model`; None: a generation model,
        whose embeddings, when asked, pool its last token). `runner_factory(model, num_blocks,
        block_size, kv_dtype, num_state_slots=...)` builds the model runner (default:
        `ModelRunner`; a worker group's rank 0 gives its own, which sends each step to the
        other ranks: `cluster/worker/group/`). `draft`: a draft model already loaded
        (`spec_decode.load_draft`) that this engine shares with others instead of loading one."""
        config.validate()
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.pooler = pooler or Pooler(hidden_size=int(text_args(model).hidden_size))
        kv_dtype = weight_dtype(model) if config.kv_cache_dtype == "auto" else getattr(mx, config.kv_cache_dtype)
        hybrid = has_recurrent_layers(model)
        # speculative decoding (--speculative-config; None: off): spec_decode/. A draft
        # model's pool shares the KV budget, block for block.
        self.speculator = build_speculator(config, model, model_name, hybrid, tokenizer,
                                           int(text_args(model).vocab_size), self.pooler.tasks, draft=draft)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = config.kv_cache_memory_bytes or default_kv_budget(model)
            per_block = kv_bytes_per_block(model, config.block_size, kv_dtype)
            if self.speculator is not None:
                per_block += self.speculator.kv_bytes_per_block(
                    config.block_size, None if config.kv_cache_dtype == "auto" else kv_dtype)
            num_blocks = max(1, budget // per_block)
        model_max = int(getattr(text_args(model), "max_position_embeddings", 0) or 32768)
        max_len = min(config.max_model_len or model_max, num_blocks * config.block_size)
        self.config = config.resolved(model_max_len=max_len, num_kv_blocks=num_blocks,
                                      default_batched_tokens=platform.default_max_num_batched_tokens())
        prefix_caching = config.enable_prefix_caching and not hybrid
        if hybrid and config.enable_prefix_caching:
            # A cached prefix's K/V is not enough: its recurrent state at the block boundary
            # would be needed too, and is not kept. Exact, at the cost of recomputing.
            log.info("prefix caching is off for %s: its recurrent layers' state is not cached", model_name)
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_caching)
        self.state_slots = StateSlots(self.config.max_num_seqs) if hybrid else None
        self.scheduler = Scheduler(self.config, self.block_manager, self.state_slots)
        self.runner = (runner_factory or ModelRunner)(model, num_blocks, config.block_size, kv_dtype,
                                                      num_state_slots=self.config.max_num_seqs if hybrid else 0)
        self.pooling = PoolingRequests(self.pooler, self.runner, model_name)
        if hybrid:
            log.info("recurrent state: %d slots of %.1f KiB (%.1f MiB)", self.config.max_num_seqs,
                     self.runner.state_bytes_per_slot / 1024,
                     self.config.max_num_seqs * self.runner.state_bytes_per_slot / (1 << 20))
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        if not self.eos_token_ids and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids = {tokenizer.eos_token_id}
        self.seqs: dict[str, Sequence] = {}  # by each sample's own id (`Sequence.request_id`)
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        # n > 1: a request's live samples, and how many are still to fork from its first
        self.groups: dict[str, list[str]] = {}
        self.forks: dict[str, int] = {}
        self.vocab_size = int(text_args(model).vocab_size)
        # Compiles structured-output specs; shared with the worker's asyncio side, which
        # checks a request's spec before queueing it.
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        self.stats = EngineStats(num_blocks_total=num_blocks,
                                 state_slots_total=self.state_slots.num_slots if hybrid else 0)
        if self.speculator is not None:
            self.speculator.attach(self.config, self.block_manager,
                                   None if config.kv_cache_dtype == "auto" else kv_dtype)
            self.stats.spec_decode = self.speculator.stats
        self._piece_texts: dict[int, str] = {}  # token id -> its text, special tokens spelled (thinking markers)

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig = EngineConfig()) -> "Engine":
        platform.warn_if_slow_blas()
        model, tokenizer = load_model(path, config.cpu_dequantize)
        pooler = Pooler.for_model(path, int(text_args(model).hidden_size), tokenizer, config.task, config.embeddings)
        log.info("%s serves: %s", Path(path).name, pooler.describe())
        return cls(model, tokenizer, config, model_name=Path(path).name, pooler=pooler)

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        resume_token_ids: list[int] = (),
    ) -> None:
        """Queue a request. `resume_token_ids` are tokens already generated for it
        elsewhere (router failover): they are computed as context, count as output
        (max_tokens, seeds, stop strings) and are not emitted again."""
        params = sampling_params or SamplingParams()
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        bad = [t for t in (*prompt_token_ids, *resume_token_ids) if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: send at least one token")
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        if len(resume_token_ids) >= params.max_tokens:
            raise ValueError(f"{len(resume_token_ids)} resumed tokens already reach max_tokens={params.max_tokens}")
        self.scheduler.check_fits(len(prompt_token_ids) + len(resume_token_ids))
        if self.scheduler.queue_full(params.pooling is not None):
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests): retry later")
        if params.n > 1 and resume_token_ids:
            raise ValueError("a request with n > 1 cannot be resumed")
        if params.speculative and self.speculator is None:
            raise ValueError("speculative: true, but speculative decoding is off on this worker: start it with "
                             "--speculative-config (or leave speculative unset)")
        if params.n > 1 and any(rid.startswith(request_id + "#") for rid in self.seqs):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.pooling is not None:
            self.pooling.check(params, resume_token_ids)
        prompt = [int(t) for t in prompt_token_ids]
        seq = Sequence(request_id, prompt + [int(t) for t in resume_token_ids], params, num_prompt_tokens=len(prompt))
        if params.pooling is not None:
            self.pooling.start(seq)
        if params.structured is not None:
            seq.matcher = self.grammars.matcher_for(params.structured, resume_token_ids)
        if params.thinking is not None:
            seq.thinking = self._tracker(params)
            for t in resume_token_ids:
                self._follow_thinking(seq, int(t))
            self._end_thinking_if_spent(seq)  # a budget of 0 in a thinking the prompt opened
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self._add_seq(seq, resume_token_ids)
        if params.n > 1:
            self.groups[request_id] = [request_id]
            self.forks[request_id] = params.n - 1
        self.stats.prompt_tokens += len(prompt)

    def _tracker(self, params: SamplingParams) -> ThinkingTracker:
        return ThinkingTracker(params.thinking, self._piece_text)

    def _piece_text(self, token_id: int) -> str:
        text = self._piece_texts.get(token_id)
        if text is None:
            text = self._piece_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _follow_thinking(self, seq: Sequence, token: int) -> None:
        """The thinking after `token`: once its budget is spent, the end marker's tokens are
        forced, one a step (the answer then follows)."""
        if seq.forced and seq.forced[0] == token:
            seq.forced.pop(0)
        seq.thinking.add(token)
        self._end_thinking_if_spent(seq)

    @staticmethod
    def _end_thinking_if_spent(seq: Sequence) -> None:
        if seq.thinking.must_end and not seq.forced:
            seq.forced = list(seq.sampling_params.thinking.end_ids)

    def _add_seq(self, seq: Sequence, resume_token_ids=(), front: bool = False) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens], seq.sampling_params.stop,
                                       kept_special=seq.sampling_params.kept_special_ids)
        for t in resume_token_ids:
            detok.add(int(t))
        # Mark sent exactly what the first worker sent: it held back a split UTF-8 character
        # or a possible stop-string prefix at the end, so those are still to come from here.
        detok.take_delta()
        self.scheduler.add(seq, front=front)
        self.seqs[seq.request_id] = seq
        self.detoks[seq.request_id] = detok

    def _fork(self, parent: Sequence) -> None:
        """Start the other n - 1 samples of `parent`'s request now that its prompt is
        computed: each takes the prompt's full blocks by reference (all but the block of
        the last prompt token, whose logits each sample computes itself), so only that
        tail is forwarded again, with or without prefix caching. Sample i draws from
        seed + i when the request has a seed."""
        rid = parent.request_id
        params = parent.sampling_params
        bs = self.block_manager.block_size
        shared = (parent.num_prompt_tokens - 1) // bs
        if getattr(self, "state_slots", None) is not None:
            shared = 0  # a recurrent state is not in the blocks: each sample prefills the whole prompt
        for i in range(params.n - self.forks.pop(rid), params.n):
            seed = None if params.seed is None else (params.seed + i) & 0xFFFF_FFFF_FFFF_FFFF
            child = Sequence(f"{rid}#{i}", parent.token_ids[: parent.num_prompt_tokens],
                             replace(params, seed=seed, prompt_logprobs=None),
                             arrival_time=parent.arrival_time, group_id=rid, index=i)
            child.num_cached_tokens = parent.num_cached_tokens
            if params.structured is not None:  # each sample walks its own grammar
                child.matcher = self.grammars.matcher_for(params.structured, ())
            if params.thinking is not None:
                child.thinking = self._tracker(params)
                self._end_thinking_if_spent(child)
            self.block_manager.share_blocks(parent, child, shared)
            self._add_seq(child, front=True)
            self.groups[rid].append(child.request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its samples) now and free its blocks. False if it is
        unknown or done."""
        self.forks.pop(request_id, None)
        members = self.groups.pop(request_id, None)
        if members is not None:
            return any([self._abort_seq(m) for m in members])
        return self._abort_seq(request_id)

    def _abort_seq(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        self.detoks.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.abort(seq)
        self._count_finished(seq)
        self._refresh_stats()
        return True

    def abort_all(self) -> list[str]:
        """Abort every live request (shutdown, or after a failed step); their ids. A
        request whose abort raises is still taken out of the engine and the scheduler's
        queues, so it is never scheduled again."""
        ids = self.live_request_ids()
        for rid in ids:
            seq = self.seqs.get(rid)
            try:
                self.abort(rid)
            except Exception:
                log.exception("engine: aborting %s failed; dropping it", rid)
                self.seqs.pop(rid, None)
                self.detoks.pop(rid, None)
                if seq is not None:
                    self.scheduler.drop(seq)
        self._refresh_stats()
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def live_request_ids(self) -> list[str]:
        return list(dict.fromkeys(s.group_id for s in self.seqs.values()))

    def request_state(self, request_id: str) -> tuple[list[int], list[int], SamplingParams, float]:
        """(prompt token ids, output token ids so far (resumed ones included), sampling
        params, arrival time) of a live request: what it takes to add it again."""
        seq = self.seqs[request_id]
        if seq.sampling_params.n > 1:
            raise ValueError("a request with n > 1 cannot be resumed")
        n = seq.num_prompt_tokens
        return list(seq.token_ids[:n]), list(seq.token_ids[n:]), seq.sampling_params, seq.arrival_time

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (new or preempted)."""
        return len(self.scheduler.waiting)

    def is_waiting(self, request_id: str) -> bool:
        """Whether a live request is waiting for the scheduler (not yet, or no longer, running)."""
        seq = self.seqs.get(request_id)
        return seq is not None and seq.status is SequenceStatus.WAITING

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self.finish_step(self.begin_step())

    def begin_step(self) -> "PendingStep":
        """The first half of a step: schedule and prepare (a worker group's rank 0 also
        sends the plan to the other ranks here). `finish_step` does the rest; a pipelined
        group begins the next batch of another set of requests in between."""
        t0 = time.perf_counter()
        wall_trial = None
        if self.speculator is not None:
            wall_trial = self.speculator.propose(self.scheduler.running, self._rows_estimate())
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return PendingStep(t0, plan)
        self.stats.observe_kv_usage(self.block_manager.usage)
        batch = self.runner.prepare(plan)
        # (a model that serves no embeddings or scores never looks: its steps cost nothing more)
        return PendingStep(t0, plan, batch, self.pooling.pick_rows(plan, batch) if self.pooler.pools else [], wall_trial)

    def finish_step(self, pending: "PendingStep") -> list[RequestOutput]:
        """The second half: forward, sample, postprocess."""
        t0, plan, batch, pooling = pending.t0, pending.plan, pending.batch, pending.pooling
        outputs: list[RequestOutput] = []
        if not plan.is_empty:
            t1 = time.perf_counter()
            cost0 = self.speculator.clock() if self.speculator is not None else 0.0
            logits = self.runner.forward(batch)
            if pooling:
                self.pooling.accumulate(plan, pooling)
            sampling = ([e for e in plan.scheduled if e.sample and e.seq.sampling_params.pooling is None] if pooling
                        else [e for e in plan.scheduled if e.sample])  # (no pooling request in this step)
            if batch.prompt_rows:
                self._prompt_logprobs(plan, batch, logits)
                logits = logits[mx.array(batch.sample_index, dtype=mx.int32)] if sampling else None
            result = self._sample(sampling, logits) if sampling else None
            mx.eval(self.runner.pool_arrays())
            elapsed = time.perf_counter() - t1
            self.stats.forward_seconds += elapsed
            kept: dict[int, list[int]] = {}
            logprobs: dict[int, tuple[list | None, list | None]] = {}  # id(seq) -> kept tokens' (logprobs, tops)
            row = 0
            for e in sampling:
                n = 1 + len(e.spec_token_ids)
                q = getattr(getattr(e.seq.spec_state, "proposer", None), "probs", None)
                if q is not None and e.spec_token_ids:  # drafts drawn from the draft model's q
                    tokens, lps = verify_sampled_drafts(logits[row : row + n], e.seq.sampling_params,
                                                        [_history(e, j) for j in range(n)], e.spec_token_ids,
                                                        q[: n - 1])
                else:
                    tokens = accept_drafts(e.spec_token_ids, result.token_ids[row : row + n])
                    lps = result.logprobs[row : row + len(tokens)] if result.logprobs is not None else None
                kept[id(e.seq)] = tokens
                logprobs[id(e.seq)] = (lps, result.top_logprobs[row : row + len(tokens)])
                row += n
                if self.speculator is not None:
                    self.speculator.record(e.spec_token_ids, tokens, e.seq)
            if self.speculator is not None:
                self.speculator.observe_step(self.speculator.clock() - cost0, batch.num_tokens, pending.wall_trial,
                                             sum(len(t) for t in kept.values()), time.perf_counter() - t0)
            produced = self.scheduler.postprocess(plan, kept)
            for e in produced:  # before any finishes (and frees its blocks)
                if e.seq.request_id in self.forks:
                    self._fork(e.seq)
            for e in produced:
                outputs.append(self._on_tokens(e.seq, kept[id(e.seq)], *logprobs[id(e.seq)]))
            if pooling:
                outputs += self._finish_pooled([e for e in plan.scheduled
                                                if e.sample and e.seq.sampling_params.pooling is not None])
        self.stats.num_steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self._refresh_stats()
        return outputs

    def _rows_estimate(self) -> int:
        """The next step's rows before drafts: its decodes, and the prefill tokens that
        will run beside them as far as the budget allows."""
        s = self.scheduler
        decodes = sum(1 for q in s.running if not q.is_prefilling)
        pending = sum(q.num_uncomputed_tokens for q in s.running if q.is_prefilling)
        if len(s.running) < self.config.max_num_seqs:
            pending += sum(q.num_uncomputed_tokens for q in itertools.islice(s.waiting, 8))
        return decodes + min(pending, max(0, self.config.max_num_batched_tokens - decodes))

    def _sample(self, sampling, logits: mx.array):
        """Sample every sampled row: one per entry, or 1 + k for an entry with drafts, row j
        as a plain decode would sample it after the entry's first j drafts (its penalties'
        history, its grammar's state, its seed's noise for that output index)."""
        rows = [(e, j) for e in sampling for j in range(1 + len(e.spec_token_ids))]
        masked = [i for i, (e, _) in enumerate(rows) if e.seq.matcher is not None or e.seq.forced]
        bitmask = None
        if masked:  # the grammar masks, on this thread, while MLX runs the forward
            mx.async_eval(logits)
            bitmask = self._masks([e for e in sampling if e.seq.matcher is not None or e.seq.forced], logits.shape[1])

        return self.sampler(
            logits, [e.seq.sampling_params for e, _ in rows], [e.seq.num_output_tokens + j for e, j in rows],
            [_history(e, j) for e, j in rows], bitmask, masked,
        )

    def _finish_pooled(self, entries) -> list[RequestOutput]:
        """Pooling requests whose last chunk ran this step: their vector or score, and done."""
        outputs = []
        for e, pooled in zip(entries, self.pooling.results(entries)):
            seq = e.seq
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            self._count_finished(seq)
            self.seqs.pop(seq.request_id, None)
            self.detoks.pop(seq.request_id, None)
            outputs.append(RequestOutput(
                request_id=seq.group_id, new_token_ids=[], new_text="", finished=True, finish_reason="stop",
                num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens, pooled=pooled))
        return outputs

    @staticmethod
    def _masks(entries, vocab_size: int) -> np.ndarray:
        """The allowed-token bitmask rows of `entries` (scheduled, in order): a grammar's
        (1 + drafts rows), or one row with only the token the entry is forced to (a spent
        thinking budget's end marker; such an entry has no drafts). A grammar that cannot
        take the forced token yet (the thinking's last token left a character's bytes
        unfinished) has its way until it can: at most three more tokens."""
        forced = [bool(e.seq.forced) and not e.spec_token_ids and
                  (e.seq.matcher is None or e.seq.matcher.validate_tokens([e.seq.forced[0]]) == 1) for e in entries]
        grammar = [e for e, f in zip(entries, forced) if not f]
        rows = fill_bitmasks([e.seq.matcher for e in grammar], vocab_size,
                             [e.spec_token_ids for e in grammar]) if grammar else None
        if not any(forced):
            return rows
        blocks, k = [], 0
        for e, f in zip(entries, forced):
            if f:
                row = allocate_bitmask(1, vocab_size)
                row[:] = 0
                t = e.seq.forced[0]
                row.view(np.uint32)[0, t // 32] = np.uint32(1 << (t % 32))
                blocks.append(row)
            else:
                n = 1 + len(e.spec_token_ids)
                blocks.append(rows[k:k + n])
                k += n
        return np.concatenate(blocks)

    def _prompt_logprobs(self, plan, batch, logits: mx.array) -> None:
        """Log-softmax the prompt rows of this step (float32, the raw model distribution,
        as the sampler's logprobs) and append each one's target token, logprob and top k
        to its sequence."""
        rows, targets = [], []
        for i, first, positions in batch.prompt_rows:
            seq = plan.scheduled[i].seq
            rows += range(first, first + len(positions))
            targets += seq.token_ids[positions.start + 1 : positions.stop + 1]
        x = logits[mx.array(rows, dtype=mx.int32)]
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        target_ids = mx.array(targets, dtype=mx.int32)
        chosen = mx.take_along_axis(lp, target_ids[:, None], axis=-1)[:, 0]
        k = max(plan.scheduled[i].seq.sampling_params.prompt_logprobs for i, _, _ in batch.prompt_rows)
        top_ids = top_vals = None
        if k:
            top_ids = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
            top_vals = mx.take_along_axis(lp, top_ids, axis=-1)
            mx.eval(chosen, top_ids, top_vals)
            top_ids, top_vals = top_ids.tolist(), top_vals.tolist()
        chosen = chosen.tolist()
        r = 0
        for i, _, positions in batch.prompt_rows:
            seq = plan.scheduled[i].seq
            kk = seq.sampling_params.prompt_logprobs
            for _ in positions:
                top = sorted(zip(top_ids[r], top_vals[r]), key=lambda t: -t[1])[:kk] if kk else []
                seq.prompt_logprobs.append((targets[r], chosen[r], top))
                r += 1

    def warm_up(self) -> float:
        """Run one full-budget prefill step and one decode step through the model on free
        KV blocks, outside the scheduler (no request, no stats, nothing cached), so the
        first real burst does not pay for first-time work: MLX growing its buffer cache
        for step-sized arrays (fresh pages from the OS), compiled functions, kernel
        threads. The worker calls it at start (vLLM's profile run plays the same part).
        Returns the seconds it took."""
        from cluster.worker.scheduler import ScheduledSeq, SchedulerOutput

        t0 = time.perf_counter()
        bs = self.config.block_size
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len - 1,
                self.block_manager.num_blocks * bs - 1)
        if n < 1 or self.block_manager.num_used_blocks or self.block_manager.cached:
            return 0.0  # only on a fresh engine: no block holds anything anyone may read
        seq = Sequence("warm-up", [0] * n, SamplingParams(max_tokens=2, temperature=0.0))  # greedy: no RNG draw
        seq.block_table = list(range(-(-(n + 1) // bs)))
        seq.state_slot = 0  # free on a fresh engine; a request's first chunk never reads a slot
        for start, length in ((0, n), (n, 1)):  # the prefill, then a decode row
            plan = SchedulerOutput([ScheduledSeq(seq, start, length)])
            logits = self.runner.forward(self.runner.prepare(plan))
            self.sampler(logits, [seq.sampling_params], [start])
            mx.eval(self.runner.pool_arrays())
            seq.token_ids.append(0)
        if self.speculator is not None:  # its policy's step times, by rows, before any request
            ctx = n + 1
            room = min(self.block_manager.num_blocks * bs, self.config.max_model_len) - ctx

            def timed(rows: int) -> float:
                seq.token_ids = [0] * (ctx + rows)
                seq.block_table = list(range(-(-(ctx + rows) // bs)))
                plan = SchedulerOutput([ScheduledSeq(seq, ctx, rows)])
                t = self.speculator.clock()
                logits = self.runner.forward(self.runner.prepare(plan))
                mx.eval(logits, *self.runner.pool_arrays())
                return self.speculator.clock() - t

            self.speculator.calibrate(timed, min(room, self.config.max_num_batched_tokens))
        return time.perf_counter() - t0

    def _on_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[float] | None,
                   top_logprobs: list | None) -> RequestOutput:
        """Stop checks for the tokens a step appended to `seq` (several with drafts kept),
        one at a time, as if each came from its own step: the first that finishes the
        request ends it, and the tokens after it are dropped. `logprobs`, `top_logprobs`:
        the tokens', when the request asks."""
        params = seq.sampling_params
        detok = self.detoks[seq.request_id]
        status = error = None
        kept = len(tokens)
        past = seq.num_tokens - len(tokens)  # tokens before this step's
        for i, token in enumerate(tokens):
            num_tokens = past + i + 1
            stop_string = detok.add(token)
            if seq.thinking is not None:
                self._follow_thinking(seq, token)
            if seq.matcher is not None and (not seq.matcher.consume_token(token) or seq.matcher.is_error()):
                # The matcher gave up (its mask then allows only EOS): the grammar ran past llguidance's
                # limits. The request's fault: it ends with the reason, never as an empty "stop".
                error = grammar_error(params.structured, seq.matcher, num_tokens - seq.num_prompt_tokens - 1)
                log.warning("engine: %s: %s", seq.request_id, error)
                self.grammars.forget(params.structured)  # its shared lexer may be spent: compiled afresh next time
                status = SequenceStatus.FINISHED_ABORTED
            elif stop_string is not None:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_string
            elif token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif seq.matcher is not None and seq.matcher.is_stopped():  # the structured output is complete
                status = SequenceStatus.FINISHED_STOPPED
            elif num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.config.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None:
                kept = i + 1
                break
        if kept < len(tokens):
            del seq.token_ids[past + kept :]
        self.stats.generation_tokens += kept
        if status is not None:
            self.scheduler.finish(seq, status)
            self._count_finished(seq)
            del self.seqs[seq.request_id]
            del self.detoks[seq.request_id]
            members = self.groups.get(seq.group_id)
            if members is not None:
                members.remove(seq.request_id)
                if not members and seq.group_id not in self.forks:
                    del self.groups[seq.group_id]
        out = RequestOutput(
            request_id=seq.group_id,
            index=seq.index,
            new_token_ids=list(tokens[:kept]),
            new_text=detok.take_delta(final=status is not None),
            finished=status is not None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
        )
        if params.logprobs is not None:
            out.logprobs = list(logprobs[:kept])
            out.top_logprobs = [t or [] for t in top_logprobs[:kept]]
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return out

    def _count_finished(self, seq: Sequence) -> None:
        reason = seq.finish_reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _refresh_stats(self) -> None:
        s, bm = self.stats, self.block_manager
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_blocks_used = bm.num_used_blocks
        if self.state_slots is not None:
            s.state_slots_used = self.state_slots.num_used
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_queries = bm.prefix_queries
        s.prefix_hits = bm.prefix_hits

    # -- convenience --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | None = None) -> list[list[int]]:
        """Run prompts to completion; generated token ids per prompt, in order (n = 1:
        for n > 1 samples, step the engine and read each output's `index`)."""
        if sampling_params is not None and sampling_params.n > 1:
            raise ValueError("generate() returns one completion per prompt: use n=1")
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, sampling_params)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id] += out.new_token_ids
        return [results[rid] for rid in ids]

    def check_integrity(self) -> None:
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.block_manager.check_integrity(live)
        if self.state_slots is not None:
            self.state_slots.check_integrity(live)
