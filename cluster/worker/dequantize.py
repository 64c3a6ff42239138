"""Quantized models on the CPU: dequantize their weights to float32 when they load.

MLX's CPU backend has no fast path for its quantized matmuls (`quantized_matmul`,
`gather_qmm`): a 4-bit or 8-bit model decodes about 25x slower there than the same model
in float32 through BLAS. So on a CPU, where memory allows, each quantized layer becomes
its float32 twin with the weights `mx.dequantize` gives: the values the quantized kernels
multiply by, computed once. Tokens are mlx-lm's on the same quantized weights (the oracle
tests run the quantized model through mlx-lm); only the order of the float32 sums
differs. On a Mac, MLX's Metal quantized kernels are fast and the weights stay quantized.

    --cpu-dequantize auto   (default) when the float32 weights fit in half the free memory
    --cpu-dequantize yes    always on the CPU
    --cpu-dequantize no     keep the quantized layers (slow on the CPU, 4-8x less memory)
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from cluster import platform

log = logging.getLogger(__name__)

CHOICES = ("auto", "yes", "no")


def _quantized_kinds():
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return {nn.QuantizedLinear: nn.Linear, nn.QuantizedEmbedding: nn.Embedding, QuantizedSwitchLinear: SwitchLinear}


def _weight(m) -> mx.array:
    return mx.dequantize(m.weight, m.scales, getattr(m, "biases", None), group_size=m.group_size, bits=m.bits,
                         mode=getattr(m, "mode", "affine"))


def _float_twin(m, cls) -> nn.Module:
    """The float32 module computing what the quantized `m` computes."""
    w = _weight(m).astype(mx.float32)
    if cls is nn.Embedding:
        twin = nn.Embedding(*w.shape)
    elif cls is nn.Linear:
        twin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    else:  # SwitchLinear: (experts, out, in)
        twin = cls(w.shape[2], w.shape[1], w.shape[0], bias=False)
    twin.weight = w
    if "bias" in m:
        twin.bias = m.bias.astype(mx.float32)
    return twin


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    kinds = tuple(_quantized_kinds())
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]


def float32_bytes(layers: list[tuple[str, nn.Module]]) -> int:
    """What the layers' weights take in float32."""
    total = 0
    for _, m in layers:
        packed = m.weight.shape[-1] * 32 // m.bits
        total += 4 * (m.weight.size // m.weight.shape[-1]) * packed
    return total


def maybe_dequantize(model: nn.Module, policy: str = "auto") -> int:
    """Dequantize the model's quantized layers to float32 when `policy` says so on this
    device; returns how many layers were. Says what it did and what it cost."""
    if policy not in CHOICES:
        raise ValueError(f"cpu_dequantize must be one of {', '.join(CHOICES)}, not {policy!r}")
    layers = quantized_layers(model)
    if not layers or platform.has_metal() or policy == "no":
        return 0
    before = sum(v.nbytes for _, m in layers for _, v in tree_flatten(m.parameters()))
    after = float32_bytes(layers)
    free = platform.available_memory()
    if policy == "auto" and free and after - before > free // 2:
        log.warning("keeping %d quantized layers: float32 weights would take %.0f MB more and %.0f MB are free "
                    "(quantized matmuls are slow on the CPU; --cpu-dequantize yes forces it)",
                    len(layers), (after - before) / 2**20, free / 2**20)
        return 0
    kinds = _quantized_kinds()
    twins = []
    for name, m in layers:
        twin = _float_twin(m, kinds[type(m)])
        mx.eval(twin.parameters())  # one layer at a time: the peak is one layer's float32 weights
        twins.append((name, twin))
    model.update_modules(tree_unflatten(twins))
    log.info("dequantized %d quantized layers to float32 for the CPU: %.0f MB -> %.0f MB of weights "
             "(--cpu-dequantize no keeps them quantized)", len(layers), before / 2**20, after / 2**20)
    return len(layers)
