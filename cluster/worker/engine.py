"""The continuous-batching engine: schedule -> prepare -> forward -> sample / verify ->
postprocess -> outputs.

Single-threaded: whoever owns the engine (the worker's engine thread, a test, a
benchmark) calls `step()` while `has_unfinished()`. Nothing here knows about gRPC. Each
concern of a step lives in its own module, which the step calls: admission and n > 1
forks (admission.py), pooling requests (pooling_requests.py), prompt logprobs
(prompt_logprobs.py), sampling and verifying drafts (step_sampling.py), stop checks
(stop_checks.py), thinking budgets (thinking_budget.py), speculation (spec_decode/).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from cluster import platform
from cluster.kv.events import KvJournal
from cluster.worker.admission import Admission, QueueFullError
from cluster.worker.block_manager import BlockManager
from cluster.worker.config import EngineConfig
from cluster.worker.detokenizer import IncrementalDetokenizer
from cluster.worker.engine_protocol import EngineProtocol
from cluster.worker.engine_stats import EngineStats
from cluster.worker.kv_tier import disk_tier
from cluster.worker.model_runner import (ModelRunner, StepBatch, default_kv_budget, has_recurrent_layers,
                                         kv_bytes_per_block, load_model, text_args, weight_dtype)
from cluster.worker.outputs import RequestOutput, pooled_output, token_output
from cluster.worker.pooling import Pooler
from cluster.worker.pooling_requests import PooledRows, PoolingRequests
from cluster.worker.prompt_logprobs import add_prompt_logprobs
from cluster.worker.sampler import SampleResult, Sampler
from cluster.worker.sampling_params import SamplingParams
from cluster.worker.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from cluster.worker.sequence import Sequence, SequenceStatus
from cluster.worker.spec_decode import build_speculator
from cluster.worker.spec_decode.calibration import calibrate
from cluster.worker.spec_decode.speculator import next_step_rows
from cluster.worker.state_slots import StateSlots
from cluster.worker.step_sampling import KeptTokens, sample, verify
from cluster.worker.stop_checks import StopChecks
from cluster.worker.structured import GrammarCompiler
from cluster.worker.thinking_budget import ThinkingBudgets

log = logging.getLogger(__name__)
__all__ = ["Engine", "EngineStats", "PendingStep", "QueueFullError", "RequestOutput"]


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


class Engine(EngineProtocol):
    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), model_name: str = "model",
                 pooler: Pooler | None = None, runner_factory=None, draft=None, model_path: str | Path | None = None):
        """`pooler`: the model's pooling and tasks (`Pooler.for_model`; None: a generation model,
        whose embeddings, when asked, pool its last token). `runner_factory(model, num_blocks,
        block_size, kv_dtype, num_state_slots=...)` builds the model runner (default:
        `ModelRunner`; a worker group's rank 0 gives its own, which sends each step to the
        other ranks: `cluster/worker/group/`). `draft`: a draft model already loaded
        (`spec_decode.load_draft`) that this engine shares with others instead of loading one.
        `model_path`: where the weights came from (the disk tier's identity hashes its files;
        without one, the parameters in memory)."""
        config.validate()
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.vocab_size = int(text_args(model).vocab_size)
        self.pooler = pooler or Pooler(hidden_size=int(text_args(model).hidden_size))
        kv_dtype = weight_dtype(model) if config.kv_cache_dtype == "auto" else getattr(mx, config.kv_cache_dtype)
        pool_dtype = None if config.kv_cache_dtype == "auto" else kv_dtype  # a draft model's pool's
        hybrid = has_recurrent_layers(model)
        # speculative decoding (--speculative-config; None: off): spec_decode/. A draft
        # model's pool shares the KV budget, block for block.
        self.speculator = build_speculator(config, model, model_name, hybrid, tokenizer, self.vocab_size,
                                           self.pooler.tasks, draft=draft)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = config.kv_cache_memory_bytes or default_kv_budget(model)
            per_block = kv_bytes_per_block(model, config.block_size, kv_dtype)
            if self.speculator is not None:
                per_block += self.speculator.kv_bytes_per_block(config.block_size, pool_dtype)
            num_blocks = max(1, budget // per_block)
        model_max = int(getattr(text_args(model), "max_position_embeddings", 0) or 32768)
        max_len = min(config.max_model_len or model_max, num_blocks * config.block_size)
        self.config = config.resolved(model_max_len=max_len, num_kv_blocks=num_blocks,
                                      default_batched_tokens=platform.default_max_num_batched_tokens())
        if hybrid and config.enable_prefix_caching:
            # A cached prefix's K/V is not enough: its recurrent state at the block boundary
            # would be needed too, and is not kept. Exact, at the cost of recomputing.
            log.info("prefix caching is off for %s: its recurrent layers' state is not cached", model_name)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching and not hybrid)
        # the blocks it holds, published to the routers (worker/registration.py)
        self.kv_journal = KvJournal(config.block_size)
        self.block_manager.listener = self.kv_journal.memory_listener()
        self.state_slots = StateSlots(self.config.max_num_seqs) if hybrid else None
        self.scheduler = Scheduler(self.config, self.block_manager, self.state_slots)
        self.runner = (runner_factory or ModelRunner)(model, num_blocks, config.block_size, kv_dtype,
                                                      num_state_slots=self.config.max_num_seqs if hybrid else 0)
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
        self.pooling = PoolingRequests(self.pooler, self.runner, model_name)
        grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        thinking = ThinkingBudgets(tokenizer)
        self.admission = Admission(self.config, self.vocab_size, self.scheduler, self.block_manager, grammars,
                                   thinking, self.pooling, self.speculator is not None, hybrid)
        self.stop_checks = StopChecks(self.eos_token_ids, self.config.max_model_len, grammars, thinking)
        self.stats = EngineStats(num_blocks_total=num_blocks,
                                 state_slots_total=self.state_slots.num_slots if hybrid else 0)
        if self.speculator is not None:
            self.speculator.attach(self.config, self.block_manager, pool_dtype)
            self.stats.spec_decode = self.speculator.stats
        self.kv_tier = (disk_tier(config, self.block_manager, self.runner, self.kv_journal, model, model_path, hybrid)
                        if config.kv_disk_dir is not None else None)
        self.stats.kv_tier = self.kv_tier

    def set_wake(self, wake) -> None:
        """`wake()` is called (on another thread) when work the engine waited for arrives:
        a disk tier's read. The engine loop posts itself a message."""
        if self.kv_tier is not None:
            self.kv_tier.wake = wake

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig = EngineConfig(),
                        model_name: str | None = None) -> "Engine":
        """`model_name`: what clients call it (default: the directory's or file's name)."""
        platform.warn_if_slow_blas()
        model, tokenizer = load_model(path, config.cpu_dequantize)
        pooler = Pooler.for_model(path, int(text_args(model).hidden_size), tokenizer, config.task, config.embeddings)
        log.info("%s serves: %s", Path(path).name, pooler.describe())
        return cls(model, tokenizer, config, model_name=model_name or Path(path).name, pooler=pooler,
                   model_path=path)

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output specs; shared with the worker's asyncio side, which
        checks a request's spec before queueing it (and in a pipelined group, with the
        other virtual engines: hence settable)."""
        return self.admission.grammars

    @grammars.setter
    def grammars(self, grammars: GrammarCompiler) -> None:
        self.admission.grammars = self.stop_checks.grammars = grammars

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
        self.admission.check(request_id, prompt_token_ids, params, resume_token_ids, self.seqs)
        seq = self.admission.sequence(request_id, prompt_token_ids, params, resume_token_ids, arrival_time)
        self._add_seq(seq, resume_token_ids)
        if params.n > 1:
            self.groups[request_id] = [request_id]
            self.forks[request_id] = params.n - 1
        self.stats.prompt_tokens += seq.num_prompt_tokens

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
        """Start the other n - 1 samples of `parent`'s request (`Admission.fork`)."""
        n = parent.sampling_params.n
        for child in self.admission.fork(parent, range(n - self.forks.pop(parent.request_id), n)):
            self._add_seq(child, front=True)
            self.groups[parent.request_id].append(child.request_id)

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

    def has_runnable(self) -> bool:
        """Whether a step would do something now (not only wait for disk reads)."""
        return self.scheduler.has_runnable()

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
        """One step: schedule, prepare (`begin_step`); forward, sample / verify,
        postprocess, outputs (`finish_step`)."""
        return self.finish_step(self.begin_step())

    def begin_step(self) -> PendingStep:
        """The first half of a step: schedule and prepare (a worker group's rank 0 also
        sends the plan to the other ranks here). `finish_step` does the rest; a pipelined
        group begins the next batch of another set of requests in between."""
        t0 = time.perf_counter()
        wall_trial = None
        if self.speculator is not None:  # drafts for the running decodes, before the plan
            rows = next_step_rows(self.scheduler, self.config.max_num_seqs, self.config.max_num_batched_tokens)
            wall_trial = self.speculator.propose(self.scheduler.running, rows)
        if self.kv_tier is not None:  # reads done into the pool; new ones started (kv_tier.py)
            self.kv_tier.complete_loads()
            self.kv_tier.probe(self.scheduler.waiting)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return PendingStep(t0, plan)
        self.stats.observe_kv_usage(self.block_manager.usage)
        batch = self.runner.prepare(plan)
        # (a model that serves no embeddings or scores never looks: its steps cost nothing more)
        pooling = self.pooling.pick_rows(plan, batch) if self.pooler.pools else []
        return PendingStep(t0, plan, batch, pooling, wall_trial)

    def finish_step(self, pending: PendingStep) -> list[RequestOutput]:
        """The second half: forward, sample / verify, postprocess, outputs."""
        outputs: list[RequestOutput] = []
        if pending.batch is not None:
            sampling = [e for e in pending.plan.scheduled if e.sample and e.seq.sampling_params.pooling is None]
            t1 = time.perf_counter()
            logits = self._forward(pending, bool(sampling))
            drawn = self._sample(sampling, logits)
            self.stats.forward_seconds += time.perf_counter() - t1
            kept = verify(sampling, logits, drawn)
            if self.speculator is not None:
                self.speculator.step_done(sampling, kept.tokens, pending.batch.num_tokens, pending.wall_trial,
                                          time.perf_counter() - pending.t0)
            outputs = self._postprocess(pending, kept)
            if self.kv_tier is not None:  # the blocks this step cached, to disk (before the next forward)
                self.kv_tier.save_blocks()
        self.stats.observe_step(pending.plan, time.perf_counter() - pending.t0)
        self._refresh_stats()
        return outputs

    def _forward(self, pending: PendingStep, sampled: bool) -> mx.array | None:
        """The step's forward, its final hidden states folded into its pooling requests
        and its prompt logprobs taken; the logits of its sampled rows (None: it samples
        none), lazy."""
        plan, batch = pending.plan, pending.batch
        if self.speculator is not None:
            self.speculator.forward_started()
        logits = self.runner.forward(batch)
        if pending.pooling:
            self.pooling.accumulate(plan, pending.pooling)
        if batch.prompt_rows:
            add_prompt_logprobs(plan, batch, logits)
            logits = logits[mx.array(batch.sample_index, dtype=mx.int32)] if sampled else None
        return logits

    def _sample(self, sampling: list[ScheduledSeq], logits: mx.array | None) -> SampleResult | None:
        """Draw the sampled rows (step_sampling.py); the forward's writes to the KV pool
        are done when this returns."""
        drawn = sample(self.sampler, sampling, logits) if sampling else None
        mx.eval(self.runner.pool_arrays())
        return drawn

    def _postprocess(self, pending: PendingStep, kept: KeptTokens) -> list[RequestOutput]:
        """Append the kept tokens, fork n > 1 samples whose prompt is done, stop checks;
        each request's output (a pooling request's vector or score once its prompt is done)."""
        produced = self.scheduler.postprocess(pending.plan, kept.tokens)
        for e in produced:  # before any finishes (and frees its blocks)
            if e.seq.request_id in self.forks:
                self._fork(e.seq)
        outputs = [self._on_tokens(e.seq, *kept.of(e.seq)) for e in produced]
        if pending.pooling:
            outputs += self._finish_pooled([e for e in pending.plan.scheduled
                                            if e.sample and e.seq.sampling_params.pooling is not None])
        return outputs

    def _on_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[float] | None,
                   top_logprobs: list | None) -> RequestOutput:
        """Stop checks for the tokens a step appended to `seq`; its output, and a request
        they finish retired. `logprobs`, `top_logprobs`: the tokens', when the request asks."""
        detok = self.detoks[seq.request_id]
        verdict = self.stop_checks.check(seq, detok, tokens)
        self.stats.generation_tokens += verdict.kept
        if verdict.status is not None:
            self._retire(seq, verdict.status)
        return token_output(seq, detok, tokens, verdict, logprobs, top_logprobs)

    def _finish_pooled(self, entries: list[ScheduledSeq]) -> list[RequestOutput]:
        """Pooling requests whose last chunk ran this step: their vector or score, and done."""
        outputs = []
        for e, pooled in zip(entries, self.pooling.results(entries)):
            self._retire(e.seq, SequenceStatus.FINISHED_STOPPED)
            outputs.append(pooled_output(e.seq, pooled))
        return outputs

    def _retire(self, seq: Sequence, status: SequenceStatus) -> None:
        """A finished sample out of the scheduler (its blocks freed) and the engine."""
        self.scheduler.finish(seq, status)
        self._count_finished(seq)
        self.seqs.pop(seq.request_id, None)
        self.detoks.pop(seq.request_id, None)
        members = self.groups.get(seq.group_id)  # n > 1: the request's live samples
        if members is not None:
            members.remove(seq.request_id)
            if not members and seq.group_id not in self.forks:
                del self.groups[seq.group_id]

    def warm_up(self) -> float:
        """Run one full-budget prefill step and one decode step through the model on free
        KV blocks, outside the scheduler (no request, no stats, nothing cached), so the
        first real burst does not pay for first-time work: MLX growing its buffer cache
        for step-sized arrays (fresh pages from the OS), compiled functions, kernel
        threads. The worker calls it at start (vLLM's profile run plays the same part).
        Returns the seconds it took."""
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
            room = min(self.block_manager.num_blocks * bs, self.config.max_model_len) - (n + 1)
            calibrate(self.speculator, self.runner, seq, n + 1, min(room, self.config.max_num_batched_tokens), bs)
        return time.perf_counter() - t0

    def _count_finished(self, seq: Sequence) -> None:
        reason = seq.finish_reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _refresh_stats(self) -> None:
        self.stats.refresh(self.scheduler, self.state_slots)

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
            if not self.has_runnable():
                self.kv_tier.wait(1.0)  # only disk reads in flight
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id] += out.new_token_ids
        return [results[rid] for rid in ids]

    def close(self) -> None:
        """When it stops serving (on its thread): the disk tier's waiting writes land, for up
        to --kv-disk-flush-timeout, and its threads and store close."""
        if self.kv_tier is not None:
            self.kv_tier.flush_and_close()

    def check_integrity(self) -> None:
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.block_manager.check_integrity(live)
        if self.state_slots is not None:
            self.state_slots.check_integrity(live)
