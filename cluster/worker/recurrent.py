"""A hybrid model's recurrent layers in the packed step, on per-request state slots.

Attention layers see the step as T rows of length 1 (model_runner.py). A recurrent
layer (gated delta net, Mamba-2, short convolution) cannot: each sequence's tokens must
run in order from that sequence's state. Its module is wrapped (`attach`: a subclass
swap of this instance, as attention's) so that, given a `RecurrentCache`, it runs
mlx-lm's own code for the module on:

- all decode rows together, as a batch [B, 1, D] whose state is stacked from their slots;
- prefill chunks as [G, L, D], the G chunks of the step that have the same length L (most
  often G = 1), from their slots' state, or from no state when the chunks start their
  sequences (exactly what mlx-lm's first call sees);

each with a plain mlx-lm `ArraysCache` (no mask, no padding: every row is a real token),
then writes the new states back to the slots (with the C kernels a memcpy a slot, in
place; else MLX's scatter) and puts the outputs back in packed order.
Chunked prefill carries the state from chunk to chunk; preemption frees the slot and the
request is recomputed from its tokens (state_slots.py).

On the CPU (no Metal), two pieces of mlx-lm's code that MLX runs op by op are swapped for
C (kernels/cpu_kernels.c) computing the same thing: the gated delta rule's recurrence
(`gated_delta_ops`) and the depthwise short convolution (`nn.Conv1d`, groups = channels).
On a Mac mlx-lm's own Metal kernels run.

The state arrays' shapes and dtypes are measured, not guessed: one token through the
model on mlx-lm's own caches (`measure_states`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from cluster.worker.attention import LayerSpec, is_recurrent, layer_modules, probe_forward
from cluster.worker.patching import original_call, rebind


@dataclass
class RecurrentGroup:
    """Sequences of the step that run through a recurrent layer as one batch [size, length]:
    the same number of new tokens, all continuing a state or all starting one."""

    rows: mx.array | slice  # their packed rows, sequence by sequence (a slice when contiguous)
    slots: mx.array  # [size] their state slots
    size: int
    length: int
    continues: bool  # False: each starts its sequence, from no state


@dataclass
class RecurrentPlan:
    """How a step's packed rows run through the recurrent layers (built once per step)."""

    groups: list[RecurrentGroup]
    write_slots: mx.array  # every group's slots, in group order
    order: mx.array | None  # packed row -> row of the groups' outputs; None: the same order


def plan_step(scheduled) -> RecurrentPlan:
    """`scheduled`: the step's ScheduledSeq entries, in packed order. Decode rows form one
    group; prefill chunks of equal length (the same prompt lengths, a shared budget split
    evenly) form one each."""
    members: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    row = 0
    for e in scheduled:
        slot = e.seq.state_slot
        assert slot >= 0, f"request {e.seq.request_id} is scheduled without a state slot"
        members.setdefault((e.num_new_tokens, e.start > 0), []).append((row, slot))
        row += e.num_new_tokens
    groups, produced, slots = [], [], []
    for (length, continues), seqs in members.items():
        rows = [r + i for r, _ in seqs for i in range(length)]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        groups.append(RecurrentGroup(
            rows=slice(rows[0], rows[0] + len(rows)) if contiguous else mx.array(rows, dtype=mx.int32),
            slots=mx.array([s for _, s in seqs], dtype=mx.int32), size=len(seqs), length=length,
            continues=continues))
        produced += rows
        slots += [s for _, s in seqs]
    order = None
    if produced != list(range(row)):
        inverse = [0] * row
        for i, r in enumerate(produced):
            inverse[r] = i
        order = mx.array(inverse, dtype=mx.int32)
    return RecurrentPlan(groups=groups, write_slots=mx.array(slots, dtype=mx.int32), order=order)


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
        for g in plan.groups:
            cache = ArraysCache(len(self.pools))
            if g.continues:
                cache.cache = [None if p is None else p[g.slots] for p in self.pools]
            y = call(x[g.rows].reshape(g.size, g.length, -1), cache)
            outs.append(y.reshape(g.size * g.length, -1))
            states.append(cache.cache)
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        news = [(pool, states[0][j] if len(states) == 1 else mx.concatenate([s[j] for s in states]))
                for j, pool in enumerate(self.pools) if pool is not None]
        if self.runner.write_kv_in_c and all(p.dtype.size in (2, 4) for p, _ in news):
            # a memcpy a slot in place (MLX's scatter moves the state element by element);
            # `out` is evaluated with the new states,
            # before the pools change under the gathers it was computed from
            from cluster.worker.kernels import cpu

            news = [(p, n.astype(p.dtype)) for p, n in news]
            mx.eval(out, *(n for _, n in news))
            for pool, new in news:
                cpu.write_kv(pool, None, plan.write_slots, new, None)
        else:
            for pool, new in news:
                pool[plan.write_slots] = new.astype(pool.dtype)
        if plan.order is not None:
            out = out[plan.order]
        return out[:, None]


def measure_states(model: nn.Module, specs: list[LayerSpec]) -> dict[int, list]:
    """For each recurrent layer, the (shape without the batch axis, dtype) of each entry of
    its mlx-lm cache after one token (None for an entry it leaves empty). Measured once per
    model object (a pipeline stage measures before it drops the other stages' layers)."""
    cached = model.__dict__.get("_orchard_states")
    if cached is None:
        parts = probe_forward(model, specs)
        cached = {s.layer: [None if a is None else (tuple(a.shape[1:]), a.dtype) for a in state.cache]
                  for s, (_, state) in zip(specs, parts) if s.recurrent}
        object.__setattr__(model, "_orchard_states", cached)  # a plain attribute, not a module child
    return dict(cached)


# -- wrapping the recurrent modules ----------------------------------------------------------

_WRAPPED: dict[type, type] = {}


def attach_model(model: nn.Module) -> None:
    """`attach` each of a hybrid model's recurrent modules (`attention.attach` wraps the
    attention ones). Idempotent."""
    for m in (m for ms in layer_modules(model) for m in ms):
        if is_recurrent(m):
            attach(m)


def attach(module: nn.Module) -> None:
    """Make this recurrent module run on state slots when handed a RecurrentCache (any
    other cache: mlx-lm's code, unchanged). Idempotent."""
    cls = type(module)
    if getattr(cls, "_orchard_recurrent", False):
        return
    if cls not in _WRAPPED:
        original = original_call(cls)
        signature = inspect.signature(original)
        names = list(signature.parameters)
        if len(names) < 2 or "cache" not in names:
            raise TypeError(f"{cls.__name__}.__call__{signature} takes no input and cache")
        x_name = names[1]
        on_slots = _with_c_recurrences(original)

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
                return on_slots(**arguments)

            return cache.run(call, bound.arguments[x_name])

        __call__._orchard_original = original
        _WRAPPED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_recurrent": True})
    module.__class__ = _WRAPPED[cls]
    _depthwise(module)


# -- the recurrences in C, where MLX's CPU runs them op by op -----------------------------------

def _gated_delta_ops(q, k, v, g, beta, state=None, mask=None):
    """mlx-lm's `gated_delta_ops` (its CPU path: a compiled step of six MLX ops per token,
    a Python loop over a prefill chunk's tokens) in
    one C call, where that is the same computation: no padding mask, float32 on the CPU.
    Anything else: mlx-lm's own."""
    from mlx_lm.models import gated_delta

    from cluster.worker.kernels import cpu

    if mask is None and state is not None and q.shape[-1] <= cpu.GDN_MAX_DK and cpu.runs_here(q, k, v, g, beta, state):
        return cpu.gated_delta(q, k, v, g, beta, state)
    return gated_delta.gated_delta_ops(q, k, v, g, beta, state, mask)


def _with_c_recurrences(call):
    """`call` (a recurrent module's own __call__) seeing mlx-lm's `gated_delta_update` run
    its recurrence through `_gated_delta_ops`: mlx-lm still computes the gates, the decay
    and the zero state, and still picks its Metal kernel on a Mac."""
    from mlx_lm.models import gated_delta

    if call.__globals__.get("gated_delta_update") is not gated_delta.gated_delta_update:
        return call
    update = rebind(gated_delta.gated_delta_update, gated_delta_ops=_gated_delta_ops)
    return rebind(call, gated_delta_update=update)


class _DepthwiseConv1d(nn.Conv1d):
    """A recurrent module's short causal convolution (depthwise: one filter a channel, on
    an input already padded with the state), in C where MLX's CPU convolution is slow;
    mlx's own anywhere else."""

    def __call__(self, x):
        from cluster.worker.kernels import cpu

        w = self.weight
        bias = self["bias"] if "bias" in self else None
        if x.ndim == 3 and x.shape[1] >= w.shape[1] and cpu.runs_here(x, w, *(() if bias is None else (bias,))):
            return cpu.depthwise_conv1d(x, w, bias)
        return super().__call__(x)


def _depthwise(module: nn.Module) -> None:
    """Its depthwise Conv1d children (stride 1, no padding or dilation) run in C."""
    for child in module.children().values():
        if (type(child) is nn.Conv1d and child.groups == child.weight.shape[0] > 1 and child.weight.shape[2] == 1
                and child.stride == 1 and child.padding == 0 and child.dilation == 1):
            child.__class__ = _DepthwiseConv1d
