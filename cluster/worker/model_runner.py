"""Loads an mlx-lm model and runs one packed varlen forward per step over the paged pool.

mlx-lm's model code is used unchanged. The T packed tokens of a step are laid out as a
batch of T rows of length 1: every Linear sees the same matrix it would see for one long
row, RoPE takes a per-row offset array (each token's own position), and no mask is
built. Each layer gets a `PagedKVCache` that writes the step's K/V into the block pool
through `slot_mapping`; the model module's `scaled_dot_product_attention` is wrapped so
that, for such a cache, attention goes to `kernels.paged_attention` (varlen, paged).
Only the rows that are sampled reach the LM head.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from cluster import platform
from cluster.worker import cpu_math, kernels
from cluster.worker.kernels import AttentionPlan
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
    sample_rows: mx.array  # [N] int32: rows whose logits are sampled
    plan: AttentionPlan | None  # host-side grouping, for the backends that use one
    num_tokens: int


class PagedKVCache:
    """Per-layer cache object handed to mlx-lm's attention: the layer's index and its
    attention window (-1: full); the K/V live in the runner's pool."""

    def __init__(self, runner: "ModelRunner", layer: int, window: int = -1):
        self.runner = runner
        self.layer = layer
        self.window = window

    @property
    def offset(self) -> mx.array:
        return self.runner.batch.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys/values: [T, KVH, 1, D] -> written to the flat pool [slots, KVH, D].
        r = self.runner
        T, KVH, _, D = keys.shape
        slots = r.batch.slot_mapping
        r.k_pool[self.layer][slots] = keys.reshape(T, KVH, D).astype(r.dtype)
        r.v_pool[self.layer][slots] = values.reshape(T, KVH, D).astype(r.dtype)
        return keys, values

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        r = self.runner
        b = r.batch
        T, H, _, D = queries.shape
        shape = (r.num_blocks, r.block_size, r.num_kv_heads, r.head_dim)
        out = kernels.paged_attention(
            queries.reshape(T, H, D),
            r.k_pool[self.layer].reshape(shape),
            r.v_pool[self.layer].reshape(shape),
            b.block_tables,
            b.seq_lens,
            b.cu_seqlens_q,
            scale=scale,
            sliding_window=self.window,
            plan=b.plan,
        )
        return out.reshape(T, H, 1, D)


def _route_attention(model: nn.Module) -> None:
    """Wrap the model module's SDPA so PagedKVCache layers use paged attention."""
    module = sys.modules[type(model).__module__]
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        raise ValueError(
            f"model type {getattr(model, 'model_type', type(model).__name__)!r} does not use mlx-lm's "
            "scaled_dot_product_attention; Orchard serves architectures with the standard attention"
        )
    if getattr(original, "_orchard_paged", False):
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, *args, **kwargs):
        if isinstance(cache, PagedKVCache):
            if args or kwargs.get("sinks") is not None:
                raise NotImplementedError("attention sinks are not supported by the paged attention")
            return cache.attend(queries, scale)
        return original(queries, keys, values, cache, scale, mask, *args, **kwargs)

    scaled_dot_product_attention._orchard_paged = True
    module.scaled_dot_product_attention = scaled_dot_product_attention


def _use_fast_swiglu(model: nn.Module) -> None:
    """On the CPU, give this model's SwiGLU MLPs a fast SwiGLU: the C kernel (`kernels/cpu`),
    else `cpu_math.swiglu` (MLX's CPU exp is scalar libm: at 512 rows, MLX 11.6 ms, the
    compiled polynomial 3.0 ms, C 0.3 ms). Per instance (a subclass swap), so mlx-lm
    itself is left as it is."""
    module = sys.modules[type(model).__module__]
    if platform.has_metal() or getattr(module, "swiglu", None) is None:
        return
    from cluster.worker.kernels import cpu

    use_c = kernels.backend() == "cpu" and cpu.available()
    for layer in model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            continue
        mlp.__class__ = _fast_swiglu_class(type(mlp), use_c)


_FAST_CLASSES: dict[tuple[type, bool], type] = {}


def _fast_swiglu_class(cls: type, use_c: bool) -> type:
    if (cls, use_c) not in _FAST_CLASSES:
        from cluster.worker.kernels import cpu

        def __call__(self, x):
            gate, up = self.gate_proj(x), self.up_proj(x)
            if use_c and gate.dtype == mx.float32 and up.dtype == mx.float32:
                return self.down_proj(cpu.swiglu(gate, up))
            return self.down_proj(cpu_math.swiglu(gate, up))

        _FAST_CLASSES[(cls, use_c)] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _FAST_CLASSES[(cls, use_c)]


class UnsupportedModel(ValueError):
    """The model needs something of its attention that the engine does not honour: refused
    when it loads, never served wrong."""


# Families whose sliding-window layers are served exactly: their attention masks the same
# window their RotatingKVCache keeps, which the paged kernels apply per layer. Each is
# checked token for token against mlx-lm (tests/test_engine.py); a family is added here
# only with that test.
SLIDING_WINDOW_FAMILIES = frozenset({"gemma3_text", "ministral3"})


def _model_type(model: nn.Module) -> str:
    return getattr(model, "model_type", None) or getattr(model.args, "model_type", type(model).__name__)


def layer_windows(model: nn.Module) -> list[int]:
    """Each layer's attention window (-1: full causal attention), or UnsupportedModel for a
    model with a layer the paged engine cannot serve exactly. mlx-lm tells what a layer
    needs by the cache it makes for it: a plain `KVCache` is full attention; a
    RotatingKVCache is a sliding window, served for the families above; anything else (a
    recurrent layer's ArraysCache, ...), fewer caches than layers (K/V shared between
    layers), attention sinks and multi-head latent attention would be silently ignored."""
    model_type = _model_type(model)
    layers = len(model.layers)
    if getattr(model.args, "kv_lora_rank", None):
        raise UnsupportedModel(f"model type {model_type!r} is not served: it uses multi-head latent attention "
                               "(MLA, kv_lora_rank), which the paged engine does not cache yet")
    if any(hasattr(getattr(layer, "self_attn", None), "sinks") for layer in model.layers):
        raise UnsupportedModel(f"model type {model_type!r} is not served: its attention has sinks (a learned "
                               "logit per head in the softmax), which the paged kernels do not apply yet")
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return [-1] * layers  # mlx-lm gives every layer a KVCache
    caches = make_cache()
    if len(caches) != layers:
        raise UnsupportedModel(f"model type {model_type!r} is not served: it has {layers} layers but {len(caches)} "
                               "caches (layers sharing K/V), which the paged engine does not honour yet")
    windows, other = [], {}
    for i, cache in enumerate(caches):
        name = type(cache).__name__
        if name == "KVCache":
            windows.append(-1)
        elif name == "RotatingKVCache" and model_type in SLIDING_WINDOW_FAMILIES and not getattr(cache, "keep", 0):
            windows.append(int(cache.max_size))
        else:
            other.setdefault(name, []).append(i)
    if other:
        what = "; ".join(f"layers {_ranges(ids)} use {name} ({_CACHE_MEANING.get(name, 'an attention the engine does not know')})"
                         for name, ids in other.items())
        raise UnsupportedModel(f"model type {model_type!r} is not served: {what}. The paged engine would give "
                               "those layers full attention and generate the wrong tokens, so it refuses the model")
    return windows


def check_served(model: nn.Module) -> None:
    """Raise UnsupportedModel for a model the engine cannot serve exactly (`layer_windows`)."""
    layer_windows(model)


_CACHE_MEANING = {
    "RotatingKVCache": "sliding-window attention",
    "ArraysCache": "a recurrent state: linear attention, Mamba or convolutions",
    "MambaCache": "a recurrent Mamba state",
    "CacheList": "several caches per layer",
    "ChunkedKVCache": "chunked local attention",
    "QuantizedKVCache": "a quantized K/V cache",
}


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2, 4'."""
    out, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ", ".join(out)


def load_model(path: str | Path):
    """Load through mlx-lm (the path a real model takes), refuse what the engine cannot
    serve exactly (`check_served`), and pick the compute dtype."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(path))
    check_served(model)
    dtype = weight_dtype(model)
    target = platform.compute_dtype(dtype)
    if target != dtype:
        model.set_dtype(target)
        mx.eval(model.parameters())
    _route_attention(model)
    _use_fast_swiglu(model)
    return model, tokenizer


def weight_dtype(model: nn.Module):
    """The dtype of the model's first floating-point parameter (float32 if it has none)."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


def model_geometry(model: nn.Module) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from the model's args."""
    args = model.args
    n_layers = len(model.layers)
    n_heads = args.num_attention_heads
    n_kv = getattr(args, "num_key_value_heads", None) or n_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // n_heads
    return n_layers, n_kv, head_dim


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype) -> int:
    n_layers, n_kv, head_dim = model_geometry(model)
    return 2 * n_layers * block_size * n_kv * head_dim * dtype.size


def default_kv_budget(model: nn.Module) -> int:
    """Bytes for the KV pool: 60% of what Metal recommends beyond the weights, or on the
    CPU an eighth of RAM (at most 1 GiB; raise it with --num-kv-blocks)."""
    from mlx.utils import tree_flatten

    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    if platform.has_metal():
        limit = mx.device_info()["max_recommended_working_set_size"]
        return max(256 << 20, int(0.6 * (limit - weights)))
    try:
        import os

        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return min(1 << 30, ram // 8)


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int):
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers, self.num_kv_heads, self.head_dim = model_geometry(model)
        self.dtype = weight_dtype(model)
        slots = num_blocks * block_size
        self.k_pool = [mx.zeros((slots, self.num_kv_heads, self.head_dim), self.dtype) for _ in range(self.num_layers)]
        self.v_pool = [mx.zeros((slots, self.num_kv_heads, self.head_dim), self.dtype) for _ in range(self.num_layers)]
        mx.eval(self.k_pool, self.v_pool)
        self.windows = layer_windows(model)
        self.caches = [PagedKVCache(self, i, w) for i, w in enumerate(self.windows)]
        self.head_only = getattr(model, "model_type", None) in _HEAD_ONLY_ARCHS and hasattr(model, "model")
        self.batch: StepBatch | None = None
        self.attention_backend = kernels.check_backend()
        log.info("attention backend: %s", self.attention_backend)

    def prepare(self, plan: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        tables: list[list[int]] = []
        for e in plan.scheduled:
            seq = e.seq
            bt = seq.block_table
            input_ids += seq.token_ids[e.start : e.end]
            positions += range(e.start, e.end)
            slot_mapping += [bt[p // bs] * bs + p % bs for p in range(e.start, e.end)]
            cu.append(cu[-1] + e.num_new_tokens)
            seq_lens.append(e.end)
            tables.append(bt[: -(-e.end // bs)])
            if e.sample:
                sample_rows.append(cu[-1] - 1)
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
            sample_rows=mx.array(sample_rows, dtype=mx.int32),
            plan=AttentionPlan.build(cu, seq_lens, block_tables, bs) if kernels.needs_plan(self.dtype) else None,
            num_tokens=cu[-1],
        )

    def forward(self, batch: StepBatch) -> mx.array:
        """Logits [N, vocab] (float32) for the sampled rows. K/V land in the pool."""
        self.batch = batch
        inputs = batch.input_ids[:, None]
        model = self.model
        if self.head_only:
            h = model.model(inputs, cache=self.caches)[batch.sample_rows, 0]
            if getattr(model, "lm_head", None) is not None:
                logits = model.lm_head(h)
            else:
                logits = model.model.embed_tokens.as_linear(h)
        else:
            logits = model(inputs, cache=self.caches)[batch.sample_rows, 0]
        return logits.astype(mx.float32)

    def pool_arrays(self) -> list[mx.array]:
        return self.k_pool + self.v_pool
