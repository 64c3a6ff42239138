"""Loads an mlx-lm model and runs one packed varlen forward per step over the paged pool.

mlx-lm's model code is used unchanged. The T packed tokens of a step are laid out as a
batch of T rows of length 1: every Linear sees the same matrix it would see for one long
row, RoPE takes a per-row offset array (each token's own position), and no mask is
built. Each layer gets a `PagedKVCache` that writes the step's K/V into that layer's pool
through `slot_mapping`, and each layer's attention module is wrapped (`attention.attach`)
so that its attention runs in `kernels.paged_attention` (varlen, paged) with the layer's
window, soft-cap, sinks and head geometry (`attention.LayerSpec`). A hybrid model's
recurrent layers get a `recurrent.RecurrentCache` instead: each sequence's rows run from
its state slot (decode rows batched, prefill chunks one by one); a layer with a recurrent
mixer beside its attention (mlx-lm's CacheList of the two) gets both, in an
`attention.LayerCaches` indexed as mlx-lm's CacheList. Only the rows that are
sampled, and the prompt rows of a request that asks for prompt logprobs, reach the LM
head. On a CPU a llama / qwen2 / qwen3 model's step skips mlx-lm's module code and MLX's
graph altogether (`host_forward.py`), through the same C kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cluster import platform
from cluster.worker import attention, cpu_layers, kernels, recurrent
from cluster.worker.attention import LayerSpec, PagedKVCache, UnsupportedModel  # noqa: F401  (re-exported)
from cluster.worker.kernels import AttentionPlan
from cluster.worker.dequantize import maybe_dequantize
from cluster.worker.host_forward import HostForward
from cluster.worker.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# Architectures whose `Model.__call__` is exactly `head(self.model(inputs, cache))`, so
# the LM head can run on the sampled rows alone. Others run the whole model and gather.
_HEAD_ONLY_ARCHS = {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "olmo2", "internlm3"}


@dataclass
class StepBatch:
    """One step's packed inputs (built on the host, converted to arrays once)."""

    input_ids: mx.array  # [T] int32
    positions: mx.array  # [T] int32
    slot_mapping: mx.array  # [T] int32: flat pool slot of each token's K/V
    cu_seqlens_q: mx.array  # [S+1] int32
    seq_lens: mx.array  # [S] int32: context length after this step
    block_tables: mx.array  # [S, max_blocks] int32, padded with 0
    logit_rows: mx.array  # [M] int32: rows that reach the LM head
    sample_index: list[int]  # [N]: which of the M logit rows are sampled, in plan order (1 + k per entry with drafts)
    # per scheduled entry with prompt logprobs: (entry index, first logit row, positions)
    prompt_rows: list[tuple[int, int, range]]
    plan: AttentionPlan | None  # host-side grouping, for the backends that use one
    num_tokens: int
    recurrent: recurrent.RecurrentPlan | None = None  # a hybrid model's recurrent layers' grouping
    # rows whose final hidden states (after the last norm) `forward` leaves in `runner.hidden`,
    # for pooling requests (pooling.py); None: none
    hidden_rows: mx.array | None = None


def attach(model: nn.Module) -> None:
    """Wrap the model's attention modules for the paged pool and its recurrent ones (a
    hybrid's) for state slots. Idempotent."""
    attention.attach(model)
    recurrent.attach_model(model)


def check_served(model: nn.Module) -> list[LayerSpec]:
    """Each layer's LayerSpec, or UnsupportedModel for a model the engine cannot serve exactly."""
    return attention.layer_specs(model, fresh=True)


def load_model(path: str | Path, cpu_dequantize: str = "auto"):
    """Load through mlx-lm (the path a real model takes), refuse what the engine cannot
    serve exactly (`check_served`), pick the compute dtype, and on the CPU dequantize a
    quantized model (`dequantize.maybe_dequantize`)."""
    from mlx_lm.utils import load

    from cluster.worker import pooling

    # a cross-encoder reranker (a `score` head), an embedding model saved as its bare backbone (pooling.py)
    model, tokenizer = pooling.load_pooling_model(path) if pooling.needs_own_loader(path) else load(str(path))
    check_served(model)  # before anything costly
    ready_to_serve(model, cpu_dequantize)
    return model, tokenizer


def ready_to_serve(model: nn.Module, cpu_dequantize: str = "auto") -> None:
    """What a loaded model (a whole one, or a worker group's part of one) needs before it
    serves: dequantized on the CPU (`dequantize.maybe_dequantize`), in the compute dtype,
    its weights evaluated, its modules attached and swapped for the C kernels' (a CPU)."""
    maybe_dequantize(model, cpu_dequantize)
    dtype = weight_dtype(model)
    target = platform.compute_dtype(dtype)
    if target != dtype:
        model.set_dtype(target)
    mx.eval(model.parameters())  # nothing left lazy (a no-op for weights already read)
    attach(model)
    cpu_layers.use_fast_swiglu(model)
    cpu_layers.use_c_kernels(model)


def weight_dtype(model: nn.Module):
    """The dtype of the model's first floating-point parameter (float32 if it has none)."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype, layers: range | None = None) -> int:
    """Pool bytes one block of tokens takes over all layers, or over `layers` (a pipeline
    stage's): a layer sharing another's K/V adds nothing; an MLA layer holds one row of
    latent + rope key."""
    return block_size * dtype.size * sum(s.num_kv_heads * s.head_dim * (1 if s.latent else 2)
                                         for s in attention.layer_specs(model)
                                         if s.owns_kv and (layers is None or s.layer in layers))


KV_SHARE = 0.6  # of the memory the weights leave, for the KV pool by default


def default_kv_budget(model: nn.Module, available: int | None = None, other_weights: int = 0) -> int:
    """Bytes for the KV pool: 60% of what Metal recommends beyond the weights, or on the
    CPU an eighth of RAM (at most 1 GiB; raise it with --num-kv-blocks or
    --kv-cache-memory-bytes). `available`: the memory this process gives the model (a
    worker group's rank: `group/memory.py`), of which the weights (and `other_weights`,
    a draft model's) leave the share taken, on the CPU too."""
    from mlx.utils import tree_flatten

    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters())) + other_weights
    if platform.has_metal():
        if available is not None:
            return int(KV_SHARE * max(0, available - weights))
        limit = mx.device_info()["max_recommended_working_set_size"]
        return max(256 << 20, int(KV_SHARE * (limit - weights)))
    try:
        import os

        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    budget = min(1 << 30, ram // 8)
    return budget if available is None else min(budget, int(KV_SHARE * max(0, available - weights)))


def text_args(model: nn.Module):
    """The model's arguments, or a multimodal wrapper's language model's (qwen3_5's
    `args` only hold its text_config): vocab_size, max_position_embeddings, ..."""
    args = model.args
    lm = getattr(model, "language_model", None)
    if not hasattr(args, "vocab_size") and lm is not None and hasattr(lm, "args"):
        return lm.args
    return args


def has_recurrent_layers(model: nn.Module) -> bool:
    return any(s.recurrent for s in attention.layer_specs(model))


@dataclass(frozen=True)
class Stage:
    """The part of the model a runner computes: all of it in one process; in a pipeline
    group (`cluster/worker/group/`) a run of layers, the embedding only on the first stage
    and the LM head only on the last."""

    layers: range  # the layers (their specs' indices) whose pools and weights are here
    embeds: bool = True  # takes token ids (else the previous stage's hidden state)
    heads: bool = True  # computes logits (else hands its hidden state on)

    @classmethod
    def whole(cls, num_layers: int) -> "Stage":
        return cls(range(num_layers))


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, kv_dtype=None, num_state_slots: int = 0,
                 stage: Stage | None = None):
        """`num_state_slots`: rows of each recurrent layer's state pools (a hybrid model:
        the engine's max_num_seqs). `stage`: the layers computed here (default: all)."""
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = weight_dtype(model)  # what the model computes in
        self.kv_dtype = kv_dtype or self.dtype  # what the pools hold
        self.specs = attention.layer_specs(model)
        self.stage = stage or Stage.whole(len(self.specs))
        held = self.stage.layers
        attach(model)
        slots = num_blocks * block_size
        # one pool per layer that owns K/V, shaped by that layer (Gemma 4's global layers
        # have their own head size); an MLA layer's one pool serves as both K and V
        self.k_pool: list[mx.array | None] = [None] * len(self.specs)
        self.v_pool: list[mx.array | None] = [None] * len(self.specs)
        for s in self.specs:
            if s.owns_kv and s.layer in held:
                self.k_pool[s.layer] = mx.zeros((slots, s.num_kv_heads, s.head_dim), self.kv_dtype)
                self.v_pool[s.layer] = self.k_pool[s.layer] if s.latent else mx.zeros_like(self.k_pool[s.layer])
        mx.eval(self.pool_arrays())
        self.windows = [s.window for s in self.specs]
        self.has_recurrent = any(s.recurrent for s in self.specs)
        states = recurrent.measure_states(model, self.specs) if self.has_recurrent else {}
        if self.has_recurrent and num_state_slots < 1:
            raise ValueError("a model with recurrent layers needs num_state_slots >= 1")
        self.state_caches: list[recurrent.RecurrentCache] = []
        self.kv_caches: list[PagedKVCache] = []
        self.caches = []
        for s in self.specs:
            # a layer held elsewhere (a pipeline stage's) still gets a cache object, with no
            # pool: its module is a pass-through, but model code may read a cache by index
            kv = PagedKVCache(self, s) if s.attention else None
            state = (recurrent.RecurrentCache(self, s, states[s.layer], num_state_slots if s.layer in held else 0)
                     if s.recurrent else None)
            if state is not None and s.layer in held:
                self.state_caches.append(state)
            if kv is not None and s.layer in held:
                self.kv_caches.append(kv)
            self.caches.append(attention.layer_cache(s, kv, state))
        self.state_bytes_per_slot = sum(c.bytes_per_slot for c in self.state_caches)
        mx.eval(self.pool_arrays())
        self.head_only = getattr(model, "model_type", None) in _HEAD_ONLY_ARCHS and hasattr(model, "model")
        self.batch: StepBatch | None = None
        self.hidden: mx.array | None = None  # [len(batch.hidden_rows), hidden] float32, after a forward that asked
        self.stage_input: mx.array | None = None  # a later pipeline stage's input (forward)
        self.attention_backend = kernels.check_backend()
        log.info("attention backend: %s", self.attention_backend)
        # the C kernels copy each step's K/V rows into the pools in place (PagedKVCache)
        self.write_kv_in_c = self.attention_backend == "cpu" and self.kv_dtype.size in (2, 4)
        # a llama / qwen2 / qwen3 model's steps on the CPU: no MLX graph (host_forward)
        self.host = HostForward.build(model, self)

    def prepare(self, plan: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        sample_index: list[int] = []
        prompt_rows: list[tuple[int, int, range]] = []
        tables: list[list[int]] = []
        for i, e in enumerate(plan.scheduled):
            seq = e.seq
            bt = seq.block_table
            input_ids += e.input_token_ids
            positions += range(e.start, e.end)
            slot_mapping += [bt[p // bs] * bs + p % bs for p in range(e.start, e.end)]
            cu.append(cu[-1] + e.num_new_tokens)
            seq_lens.append(e.end)
            tables.append(bt[: -(-e.end // bs)])
            if seq.wants_prompt_logprobs:
                # rows at positions p predict token p + 1: every prompt position not done yet
                # but the last (which is the sample row)
                done = len(seq.prompt_logprobs)
                positions_ = range(max(e.start, done), min(e.end, seq.num_prompt_tokens - 1))
                if len(positions_):
                    prompt_rows.append((i, len(logit_rows), positions_))
                    logit_rows += [cu[-2] + p - e.start for p in positions_]
            if e.sample and seq.sampling_params.pooling is None:  # a pooling request's rows: `hidden_rows`
                # the last row, or with drafts the last 1 + k (each one verified)
                for row in range(cu[-1] - 1 - len(e.spec_token_ids), cu[-1]):
                    sample_index.append(len(logit_rows))
                    logit_rows.append(row)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        block_tables = mx.array(tables, dtype=mx.int32)
        return StepBatch(
            input_ids=mx.array(input_ids, dtype=mx.int32),
            positions=mx.array(positions, dtype=mx.int32),
            slot_mapping=mx.array(slot_mapping, dtype=mx.int32),
            cu_seqlens_q=mx.array(cu, dtype=mx.int32),
            seq_lens=mx.array(seq_lens, dtype=mx.int32),
            block_tables=block_tables,
            logit_rows=mx.array(logit_rows, dtype=mx.int32),
            sample_index=sample_index,
            prompt_rows=prompt_rows,
            plan=(AttentionPlan.build(cu, seq_lens, block_tables, bs)
                  if kernels.needs_plan(self.dtype, self.kv_dtype) else None),
            num_tokens=cu[-1],
            recurrent=recurrent.plan_step(plan.scheduled) if self.has_recurrent else None,
        )

    def forward(self, batch: StepBatch, stage_input: mx.array | None = None) -> mx.array:
        """Logits [M, vocab] (float32) for `batch.logit_rows` (the sampled rows, and the
        prompt rows of requests with prompt logprobs). K/V land in the pool. With
        `batch.hidden_rows`, those rows' final hidden states go to `self.hidden`. `stage_input`:
        a later pipeline stage's input, the previous stage's hidden state [T, hidden size]
        (`cluster/worker/group/stage.py`)."""
        self.batch = batch
        self.hidden = None
        if batch.hidden_rows is not None and not self.can_pool:
            raise ValueError(f"{getattr(self.model, 'model_type', 'this model')}'s hidden states are not reachable "
                             "apart from its logits: it cannot serve embeddings or scores")
        if self.host is not None:
            return self.host.forward(batch) if stage_input is None else self.host.forward(batch, stage_input)
        self.stage_input = stage_input
        inputs = batch.input_ids[:, None]
        model = self.model
        if self.head_only:
            hidden = model.model(inputs, cache=self.caches)
            if batch.hidden_rows is not None:
                self.hidden = hidden[batch.hidden_rows, 0].astype(mx.float32)
            logits = self.head_logits(hidden[batch.logit_rows, 0]) if batch.logit_rows.size else None
            if logits is None:  # a step of pooling requests alone
                logits = mx.zeros((0, int(text_args(model).vocab_size)), mx.float32)
        else:
            logits = model(inputs, cache=self.caches)[batch.logit_rows, 0]
        for c in self.kv_caches:  # a layer that wrote K/V but did not attend (none should): into the pool now
            c.write_pending()
        return logits.astype(mx.float32)

    @property
    def can_pool(self) -> bool:
        """Whether the final hidden states are reachable (pooling requests): the model is
        exactly `head(model.model(x))` (head_only), on either path."""
        return self.head_only

    def head_logits(self, h: mx.array) -> mx.array:
        """The model's LM head on final hidden states [N, hidden] (a head-only model)."""
        model = self.model
        if getattr(model, "lm_head", None) is not None:
            return model.lm_head(h)
        return model.model.embed_tokens.as_linear(h)

    # -- whole blocks in and out of the pools (the disk tier: worker/kv_tier.py) ------------------
    def kv_pools(self) -> list[tuple[int, str, mx.array]]:
        """The K/V pools this runner holds, in the disk tier's order: (layer, "k" | "v" |
        "kv", pool) per owned layer in layer order, K before V (an MLA layer's one pool: "kv")."""
        out = []
        for s in self.specs:
            if s.owns_kv and s.layer in self.stage.layers:
                if s.latent:
                    out.append((s.layer, "kv", self.k_pool[s.layer]))
                else:
                    out += [(s.layer, "k", self.k_pool[s.layer]), (s.layer, "v", self.v_pool[s.layer])]
        return out

    def kv_pool_layout(self) -> list[tuple[int, str, tuple[int, ...], str]]:
        """(layer, "k" | "v" | "kv", one block's shape [block_size, kv heads, head dim], the
        pool's dtype) per pool, in `kv_pools` order: what a block's bytes mean."""
        return [(layer, kind, (self.block_size, *pool.shape[1:]), str(pool.dtype).rpartition(".")[2])
                for layer, kind, pool in self.kv_pools()]

    def read_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        """Copies of blocks `block_ids`' rows: one array [len(block_ids), block_size, ...]
        per pool (`kv_pools` order), raw (a 2-byte dtype as uint16). Between steps: the
        pools hold every forward's rows by then."""
        ids = np.asarray(block_ids, np.int64)
        return [_raw_blocks(pool, self.block_size)[ids] for _, _, pool in self.kv_pools()]

    def write_blocks(self, block_ids: list[int], arrays: list[np.ndarray]) -> None:
        """Put whole blocks' rows (`read_blocks`' form: an array per pool) into blocks
        `block_ids`, between steps. Where the C kernels write K/V in place (`write_kv_in_c`),
        copied in place the same way; otherwise through MLX, then evaluated."""
        pools = self.kv_pools()
        if len(arrays) != len(pools):
            raise ValueError(f"{len(arrays)} arrays for {len(pools)} K/V pools")
        if not block_ids:
            return
        ids = np.asarray(block_ids, np.int64)
        if self.write_kv_in_c:
            for (_, _, pool), a in zip(pools, arrays):
                _raw_blocks(pool, self.block_size)[ids] = a
            return
        bs = self.block_size
        slots = mx.array((ids[:, None] * bs + np.arange(bs)[None, :]).reshape(-1).astype(np.int32))
        for (_, _, pool), a in zip(pools, arrays):
            rows = mx.array(a.reshape(-1, *pool.shape[1:]))
            if rows.dtype != pool.dtype:
                rows = rows.view(pool.dtype)  # raw 2-byte rows
            pool[slots] = rows  # the array object is updated: the runner's lists hold it
        mx.eval(self.pool_arrays())

    def pool_arrays(self) -> list[mx.array]:
        """Every pool array once (an MLA layer's K and V pool are one array), recurrent
        state pools included."""
        seen: dict[int, mx.array] = {}
        states = [p for c in getattr(self, "state_caches", ()) for p in c.pools]
        for a in self.k_pool + self.v_pool + states:
            if a is not None:
                seen.setdefault(id(a), a)
        return list(seen.values())


def _raw_blocks(pool: mx.array, block_size: int) -> np.ndarray:
    """A writable numpy view [num_blocks, block_size, ...] of an evaluated pool's memory, a
    2-byte dtype as uint16 (numpy has no bfloat16), as `kernels.cpu.write_kv` views it."""
    if pool.dtype.size == 2:
        pool = pool.view(mx.uint16)
    mx.eval(pool)
    rows = np.asarray(memoryview(pool))
    return rows.reshape(rows.shape[0] // block_size, block_size, *rows.shape[1:])
