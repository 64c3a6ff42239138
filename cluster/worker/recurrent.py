"""A hybrid model's recurrent layers in the packed step, on per-request state slots.

Attention layers see the step as T rows of length 1 (model_runner.py). A recurrent
layer (gated delta net, Mamba-2, short convolution) cannot: each sequence's tokens must
run in order from that sequence's state. Its module is wrapped (`attach`: a subclass
swap of this instance, as attention's) so that, given a `RecurrentCache`, it runs
mlx-lm's own code for the module on:

- all decode rows together, as a batch [B, 1, D] whose state is stacked from their slots;
- each prefill chunk alone, as [1, L, D] from its slot's state, or from no state when the
  chunk starts the sequence (exactly what mlx-lm's first call sees);

each with a plain mlx-lm `ArraysCache` (no mask, no padding: every row is a real token),
then writes the new states back to the slots and puts the outputs back in packed order.
Chunked prefill carries the state from chunk to chunk; preemption frees the slot and the
request is recomputed from its tokens (state_slots.py).

The state arrays' shapes and dtypes are measured, not guessed: one token through the
model on mlx-lm's own caches (`measure_states`), graph built, never evaluated.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from cluster.worker.attention import LayerSpec, _original_call, _ProbeCache


@dataclass
class RecurrentPlan:
    """How a step's packed rows run through the recurrent layers (built once per step)."""

    decode_rows: mx.array | None  # [B] packed rows that continue a state by one token
    decode_slots: mx.array | None  # [B] their slots
    chunks: list[tuple[int, int, int, bool]]  # (first row, end row, slot, continues a state)
    write_slots: mx.array  # the slot of each output group: decode rows, then chunks
    order: mx.array | None  # packed row -> row of the groups' outputs; None: same order


def plan_step(scheduled) -> RecurrentPlan:
    """`scheduled`: the step's ScheduledSeq entries, in packed order."""
    decode_rows, decode_slots, chunks = [], [], []
    row = 0
    for e in scheduled:
        slot = e.seq.state_slot
        assert slot >= 0, f"request {e.seq.request_id} is scheduled without a state slot"
        if e.num_new_tokens == 1 and e.start > 0:
            decode_rows.append(row)
            decode_slots.append(slot)
        else:
            chunks.append((row, row + e.num_new_tokens, slot, e.start > 0))
        row += e.num_new_tokens
    produced = decode_rows + [r for a, b, _, _ in chunks for r in range(a, b)]
    order = None
    if produced != list(range(row)):
        inverse = [0] * row
        for i, r in enumerate(produced):
            inverse[r] = i
        order = mx.array(inverse, dtype=mx.int32)
    return RecurrentPlan(
        decode_rows=mx.array(decode_rows, dtype=mx.int32) if decode_rows else None,
        decode_slots=mx.array(decode_slots, dtype=mx.int32) if decode_slots else None,
        chunks=chunks,
        write_slots=mx.array(decode_slots + [c[2] for c in chunks], dtype=mx.int32),
        order=order,
    )


class RecurrentCache:
    """What one recurrent layer is handed: its state pools (one array per state entry of
    mlx-lm's ArraysCache, a row per slot) and the runner's current step."""

    def __init__(self, runner, spec: LayerSpec, shapes: list[tuple[tuple[int, ...], mx.Dtype] | None],
                 num_slots: int):
        self.runner = runner
        self.spec = spec
        self.pools: list[mx.array | None] = [
            None if s is None else mx.zeros((num_slots, *s[0]), dtype=s[1]) for s in shapes
        ]

    @property
    def bytes_per_slot(self) -> int:
        return sum(p.nbytes // p.shape[0] for p in self.pools if p is not None)

    def run(self, call, x: mx.array) -> mx.array:
        """`call(x, cache)` is the module's own code; `x` the packed [T, 1, D] input."""
        plan: RecurrentPlan = self.runner.batch.recurrent
        T = x.shape[0]
        x = x.reshape(T, -1)
        outs, states = [], []
        if plan.decode_rows is not None:
            cache = self._cache(lambda p: p[plan.decode_slots])
            y = call(x[plan.decode_rows][:, None], cache)
            outs.append(y.reshape(y.shape[0], -1))
            states.append(cache.cache)
        for start, end, slot, continues in plan.chunks:
            cache = self._cache(lambda p: p[slot : slot + 1]) if continues else ArraysCache(len(self.pools))
            y = call(x[start:end][None], cache)
            outs.append(y[0])
            states.append(cache.cache)
        for j, pool in enumerate(self.pools):
            if pool is not None:
                new = states[0][j] if len(states) == 1 else mx.concatenate([s[j] for s in states])
                pool[plan.write_slots] = new.astype(pool.dtype)
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        if plan.order is not None:
            out = out[plan.order]
        return out[:, None]

    def _cache(self, rows) -> ArraysCache:
        cache = ArraysCache(len(self.pools))
        cache.cache = [None if p is None else rows(p) for p in self.pools]
        return cache


def measure_states(model: nn.Module, specs: list[LayerSpec]) -> dict[int, list]:
    """For each recurrent layer, the (shape without the batch axis, dtype) of each entry of
    its mlx-lm cache after one token (None for an entry it leaves empty)."""
    fresh = model.make_cache()
    caches = [fresh[s.layer] if s.recurrent else _ProbeCache(s) for s in specs]
    model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    return {s.layer: [None if a is None else (tuple(a.shape[1:]), a.dtype) for a in caches[s.layer].cache]
            for s in specs if s.recurrent}


# -- wrapping the recurrent modules ----------------------------------------------------------

_WRAPPED: dict[type, type] = {}


def attach(module: nn.Module) -> None:
    """Make this recurrent module run on state slots when handed a RecurrentCache (any
    other cache: mlx-lm's code, unchanged). Idempotent."""
    cls = type(module)
    if getattr(cls, "_orchard_recurrent", False):
        return
    if cls not in _WRAPPED:
        original = _original_call(cls)
        signature = inspect.signature(original)
        names = list(signature.parameters)
        if len(names) < 2 or "cache" not in names:
            raise TypeError(f"{cls.__name__}.__call__{signature} takes no input and cache")
        x_name = names[1]

        def __call__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            cache = bound.arguments.get("cache")
            if not isinstance(cache, RecurrentCache):
                return original(self, *args, **kwargs)

            def call(x, c):
                arguments = dict(bound.arguments)
                arguments.update({x_name: x, "cache": c})
                if "mask" in arguments:
                    arguments["mask"] = None  # every row a real token: nothing to mask
                return original(**arguments)

            return cache.run(call, bound.arguments[x_name])

        __call__._orchard_original = original
        _WRAPPED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_recurrent": True})
    module.__class__ = _WRAPPED[cls]
