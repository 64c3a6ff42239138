"""On the CPU: mlx-lm's modules swapped, per instance, for ones that run in Orchard's C kernels.

`use_fast_swiglu`: SwiGLU MLPs through the C SwiGLU (else `cpu_math.swiglu`).
`use_c_kernels`: float32 Linears (and a tied LM head) take the few rows of a decode step
in C (`CLinear`, `CEmbedding`: `c_rows` says which row counts), plain RoPEs run in C
(`CRoPE`). The model runner applies both when a model loads; the host path
(`host_forward.py`) runs the same rule on its own arrays. On a Mac none of this applies.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

from cluster import platform
from cluster.worker import cpu_math, kernels
from cluster.worker.patching import calls


def use_fast_swiglu(model: nn.Module) -> None:
    """On the CPU, give this model's SwiGLU MLPs a fast SwiGLU: the C kernel (`kernels/cpu`),
    else `cpu_math.swiglu` (MLX's CPU exp is scalar libm; the C kernel is the fastest,
    then the compiled polynomial: MEASUREMENTS.md). Per instance (a subclass swap), so mlx-lm
    itself is left as it is."""
    if platform.has_metal():
        return
    family_swiglu = getattr(sys.modules[type(model).__module__], "swiglu", None) is not None
    from cluster.worker.kernels import cpu

    use_c = kernels.backend() == "cpu" and cpu.available()
    for layer in model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            continue
        # the family's module uses SwiGLU, or this MLP's own call does (qwen3_5 takes qwen3_next's MLP)
        if not (family_swiglu or calls(type(mlp), "swiglu")):
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


# Which row counts a Linear runs in C (`cpu.linear`: each weight row read once, in place)
# rather than BLAS. OpenBLAS packs the weights before every product, so C wins at few
# rows; on the machine it was set on they tie at 48 rows and past it BLAS wins
# (`load/bench_engine.py` shows the step; MEASUREMENTS.md). Each path sums
# a row's products in its own order (the C kernels: 1-3 rows as 8-lane dot products, 4-47
# rows in plain k order; BLAS: its own blocking), so a request's logits can move in the
# last bits with the number of rows beside it in the step; a greedy token can change only
# at a near-tie.
C_LINEAR_MAX_ROWS = 48


def c_rows(rows: int) -> bool:
    return rows < C_LINEAR_MAX_ROWS


def c_linear(x: mx.array) -> bool:
    from cluster.worker.kernels import cpu

    return c_rows(x.size // x.shape[-1]) and cpu.runs_here(x)


class CLinear(nn.Linear):
    def __call__(self, x):
        from cluster.worker.kernels import cpu

        if c_linear(x):
            return cpu.linear(x, self.weight, self["bias"] if "bias" in self else None)
        return super().__call__(x)


class CEmbedding(nn.Embedding):
    def as_linear(self, x):  # a tied LM head
        from cluster.worker.kernels import cpu

        if c_linear(x):
            return cpu.linear(x, self.weight)
        return super().as_linear(x)


class CRoPE(nn.RoPE):
    """mlx's RoPE on a packed step (a row per token, a position per row) in C: MLX's CPU
    fallback builds it from a dozen ops, a quarter of a millisecond a layer at 16 rows."""

    def __call__(self, x, offset=0):
        from cluster.worker.kernels import cpu

        if (isinstance(offset, mx.array) and x.ndim == 4 and x.shape[2] == 1 and offset.shape == (x.shape[0],)
                and x.shape[-1] <= cpu.MAX_HEAD_DIM and cpu.runs_here(x)):
            freqs = self.__dict__.get("_orchard_freqs")
            if freqs is None:
                freqs = cpu.rope_frequencies(self.dims, self.base)
                object.__setattr__(self, "_orchard_freqs", freqs)  # not a parameter
            return cpu.rope(x, offset, self.dims, self.traditional, freqs, self.scale)
        return super().__call__(x, offset)


def use_c_kernels(model: nn.Module) -> None:
    """On the CPU with the C kernels: this model's float32 Linears (and a tied LM head)
    run the few rows of a decode step in C, on weights copied to 64-byte-aligned memory
    (the copy replaces the weight: no memory is added; OpenBLAS at a few rows packs each
    weight matrix before using it); its plain RoPEs run in C. Per instance (a subclass
    swap), so mlx-lm itself is left as it is."""
    from cluster.worker.kernels import cpu

    if platform.has_metal() or kernels.backend() != "cpu" or not cpu.available():
        return
    swaps = {nn.Linear: CLinear, nn.Embedding: CEmbedding, nn.RoPE: CRoPE}
    copies: dict[int, tuple[mx.array, mx.array]] = {}  # a weight two modules share (a tied head) is copied once
    for _, m in model.named_modules():
        cls = swaps.get(type(m))
        if cls is CRoPE:
            m.__class__ = cls
        elif cls is not None and m.weight.dtype == mx.float32:
            w = m.weight
            if id(w) not in copies:
                copies[id(w)] = (w, cpu.aligned_copy(w))  # the original kept until done: ids stay unique
            m.weight = copies[id(w)][1]
            m.__class__ = cls
