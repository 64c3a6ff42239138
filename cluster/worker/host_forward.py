"""A step of a llama-style model on the CPU, with no MLX graph around the C kernels.

On the CPU, MLX runs every op on its stream's own thread: each evaluation hands the graph
to that thread and waits to be woken, ~20 us however small the op. A step of the paged
engine through mlx-lm's model code evaluates 6-7 times a layer (each C kernel evaluates
what it is given: the residual add and norm before a projection, the reshape and norm
before RoPE, ...), and on 2 cores those hand-offs were 28% of a 16-row decode step, more
than its attention.

For the families whose decoder block is exactly mlx-lm's llama / qwen2 / qwen3 block
(Llama, Mistral, Qwen2, Qwen2.5, Qwen3 and what mlx-lm maps onto them) every step runs
here instead: numpy arrays on the host, one C call for each norm (fused with the
residual add before it), RoPE, K/V write, attention and SwiGLU, in the order mlx-lm's code
runs them and through the same C kernels the MLX path calls (the norm is the only new
one: MLX's `rms_norm` formula in float32). A projection of fewer than
`model_runner.C_LINEAR_MAX_ROWS` rows (every decode step of a smaller batch) runs in the C
linear; a larger one (a prefill chunk) through MLX's BLAS, exactly as nn.Linear computes
it, one hand-off beside a large product. The weights are the model's own, read in place.
Measured on 2 cores: a 16-row decode step 1.5x faster, 32 and 64 rows and a 512-token
prefill step 5-10% faster.

`HostForward.build` admits a model only when every piece of it is one this file knows:
mlx-lm's block, attention and MLP classes of those families, float32 C Linears, plain
RMSNorms, a plain RoPE, attention with no soft-cap or sinks over each layer's own float32
or float16 pool. Anything else (a bfloat16 pool, a scaled RoPE class, another family)
keeps the MLX path, which serves every family, and the log says why.
"""

from __future__ import annotations

import importlib
import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

log = logging.getLogger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3")  # mlx_lm.models.<name>: the block code this file mirrors


class _Layer:
    """One decoder block's weights as host arrays (views of the model's own memory)."""

    def __init__(self, block, spec, with_qk_norm: bool):
        from cluster.worker.kernels import cpu

        a, m = block.self_attn, block.mlp
        self.spec = spec
        self.in_norm = (_host(block.input_layernorm.weight), float(block.input_layernorm.eps))
        self.post_norm = (_host(block.post_attention_layernorm.weight), float(block.post_attention_layernorm.eps))
        self.q, self.k, self.v, self.o = (_linear(a.q_proj), _linear(a.k_proj), _linear(a.v_proj), _linear(a.o_proj))
        self.gate, self.up, self.down = _linear(m.gate_proj), _linear(m.up_proj), _linear(m.down_proj)
        self.heads, self.kv_heads = a.n_heads, a.n_kv_heads
        self.head_dim = self.q[0].shape[0] // self.heads
        self.scale = float(a.scale)
        self.q_norm = (_host(a.q_norm.weight), float(a.q_norm.eps)) if with_qk_norm else None
        self.k_norm = (_host(a.k_norm.weight), float(a.k_norm.eps)) if with_qk_norm else None
        r = a.rope
        self.rope = (int(r.dims), bool(r.traditional), float(r.scale), _host(cpu.rope_frequencies(r.dims, r.base)))


def _host(a: mx.array) -> np.ndarray:
    mx.eval(a)
    return np.asarray(memoryview(a))


def _linear(module) -> tuple:
    """(weight, bias or None) as host views, then as MLX arrays (for BLAS, at many rows)."""
    bias = module["bias"] if "bias" in module else None
    return _host(module.weight), (None if bias is None else _host(bias)), module.weight, bias


def _why_not(model: nn.Module, runner) -> str | None:
    """Why this model's small steps cannot run here (None: they can)."""
    from cluster.worker import model_runner
    from cluster.worker.kernels import cpu

    family = type(model).__module__.rpartition(".")[2]
    if family not in FAMILIES or type(model).__name__ != "Model" or not type(model).__module__.startswith("mlx_lm."):
        return f"{type(model).__module__}.{type(model).__name__} is not one of mlx-lm's {', '.join(FAMILIES)} models"
    if runner.attention_backend != "cpu" or not cpu.available():
        return "the attention backend is not the CPU kernels"
    if runner.dtype != mx.float32 or runner.kv_dtype not in (mx.float32, mx.float16):
        return f"compute {runner.dtype} / KV pool {runner.kv_dtype} (needs float32 / float32 or float16)"
    code = importlib.import_module(type(model).__module__)
    inner = model.model
    head = getattr(model, "lm_head", None) if not model.args.tie_word_embeddings else inner.embed_tokens
    if not isinstance(inner.embed_tokens, model_runner._CEmbedding) or (
            head is not inner.embed_tokens and not isinstance(head, model_runner._CLinear)):
        return "the embedding or LM head is not a float32 C layer"
    if type(inner.norm) is not nn.RMSNorm:
        return "the final norm is not a plain RMSNorm"
    for block, spec in zip(inner.layers, runner.specs):
        a, m = block.self_attn, block.mlp
        if not (isinstance(block, code.TransformerBlock) and isinstance(a, code.Attention) and isinstance(m, code.MLP)):
            return f"layer {spec.layer} is not mlx-lm's {family} block"
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if not all(isinstance(x, model_runner._CLinear) for x in linears):
            return f"layer {spec.layer} has a projection that is not a float32 C Linear"
        norms = [block.input_layernorm, block.post_attention_layernorm] + (
            [a.q_norm, a.k_norm] if family == "qwen3" else [])
        if not all(type(n) is nn.RMSNorm for n in norms):
            return f"layer {spec.layer} has a norm that is not a plain RMSNorm"
        if not isinstance(a.rope, model_runner._CRoPE):
            return f"layer {spec.layer}'s RoPE is {type(a.rope).__name__}, not a plain RoPE"
        if (not spec.attention or spec.recurrent or not spec.owns_kv or spec.kv_layer != spec.layer or spec.latent
                or spec.softcap or spec.sinks or spec.cache_list):
            return f"layer {spec.layer}'s attention is not plain (window only)"
    return None


class HostForward:
    """Runs every step of an admitted model (`build`)."""

    def __init__(self, model: nn.Module, runner):
        from cluster.worker.kernels import cpu

        self.lib = cpu.load()
        self.runner = runner
        from cluster.worker.model_runner import C_LINEAR_MAX_ROWS

        self.c_rows = C_LINEAR_MAX_ROWS
        inner = model.model
        qk_norm = type(model).__module__.endswith("qwen3")
        self.layers = [_Layer(b, s, qk_norm) for b, s in zip(inner.layers, runner.specs)]
        self.embed = _host(inner.embed_tokens.weight)
        self.head = _linear(inner.embed_tokens if model.args.tie_word_embeddings else model.lm_head)
        self.norm = (_host(inner.norm.weight), float(inner.norm.eps))

    @classmethod
    def build(cls, model: nn.Module, runner) -> "HostForward | None":
        why = _why_not(model, runner)
        if why is not None:
            log.info("steps run through MLX: %s", why)
            return None
        log.info("steps run on the host, around the C kernels (%s)", type(model).__module__)
        return cls(model, runner)

    # -- the step --------------------------------------------------------------------------------

    def _linear(self, x: np.ndarray, wb: tuple) -> np.ndarray:
        """x @ w.T (+ b): in C below C_LINEAR_MAX_ROWS rows, else by MLX's BLAS as nn.Linear
        computes it (one hand-off, small beside the product)."""
        w, b, w_mx, b_mx = wb
        if x.shape[0] >= self.c_rows:
            xm = mx.array(x)
            y = xm @ w_mx.T if b_mx is None else mx.addmm(b_mx, xm, w_mx.T)
            mx.eval(y)
            return np.asarray(memoryview(y))
        y = np.empty((x.shape[0], w.shape[0]), np.float32)
        rc = self.lib.orch_linear_f32(x.ctypes.data, x.shape[0], w.shape[1], w.ctypes.data,
                                      None if b is None else b.ctypes.data, y.ctypes.data, w.shape[0])
        if rc != 0:
            raise MemoryError("the C linear could not allocate its scratch")
        return y

    def _norm(self, h: np.ndarray, residual: np.ndarray | None, wn: tuple[np.ndarray, float]) -> np.ndarray:
        """rms_norm(h (+= residual, in place)) over the last axis."""
        w, eps = wn
        out = np.empty_like(h)
        self.lib.orch_add_rmsnorm_f32(h.ctypes.data, None if residual is None else residual.ctypes.data,
                                      w.ctypes.data, out.ctypes.data, h.size // w.shape[0], w.shape[0], eps)
        return out

    def _rope(self, x: np.ndarray, positions: np.ndarray, rope) -> np.ndarray:
        dims, traditional, scale, freqs = rope
        T, H, D = x.shape
        out = np.empty_like(x)
        self.lib.orch_rope_f32(x.ctypes.data, positions.ctypes.data, freqs.ctypes.data, out.ctypes.data, T, H, D,
                               dims, int(traditional), scale)
        return out

    def forward(self, batch) -> mx.array:
        """Logits [M, vocab] float32 for `batch.logit_rows`; K/V land in the pools, as
        `ModelRunner.forward` does through MLX."""
        r = self.runner
        T = batch.num_tokens
        mx.eval(batch.input_ids, batch.positions, batch.slot_mapping, batch.cu_seqlens_q, batch.seq_lens,
                batch.block_tables, batch.logit_rows)
        ids, pos, slots, cu, lens, tables = (np.asarray(memoryview(a)) for a in (
            batch.input_ids, batch.positions, batch.slot_mapping, batch.cu_seqlens_q, batch.seq_lens,
            batch.block_tables))
        S = lens.shape[0]
        half = r.kv_dtype == mx.float16
        h = np.ascontiguousarray(self.embed[ids])  # [T, hidden]
        residual = None
        for L in self.layers:
            x = self._norm(h, residual, L.in_norm)
            q = self._linear(x, L.q).reshape(T, L.heads, L.head_dim)
            k = self._linear(x, L.k).reshape(T, L.kv_heads, L.head_dim)
            v = self._linear(x, L.v).reshape(T, L.kv_heads, L.head_dim)
            if L.q_norm is not None:
                q, k = self._norm(q, None, L.q_norm), self._norm(k, None, L.k_norm)
            q, k = self._rope(q, pos, L.rope), self._rope(k, pos, L.rope)
            layer = L.spec.layer
            kp, vp = r.k_pool[layer], r.v_pool[layer]
            if half:
                k, v = k.astype(np.float16), v.astype(np.float16)
                kp, vp = kp.view(mx.uint16), vp.view(mx.uint16)
            kh, vh = np.asarray(memoryview(kp)), np.asarray(memoryview(vp))
            row_bytes = kh.nbytes // kh.shape[0]
            self.lib.orch_write_rows(k.ctypes.data, v.ctypes.data, slots.ctypes.data, T, row_bytes, kh.ctypes.data,
                                     vh.ctypes.data)
            out = np.empty((T, L.heads, L.head_dim), np.float32)
            rc = self.lib.orch_paged_attention(
                q.ctypes.data, L.heads * L.head_dim, L.head_dim, kh.ctypes.data, vh.ctypes.data, 1 if half else 0,
                tables.ctypes.data, tables.shape[1], lens.ctypes.data, cu.ctypes.data, S, T, L.heads, L.kv_heads,
                L.head_dim, r.block_size, L.scale, L.spec.window if L.spec.window > 0 else -1, 0.0, None,
                out.ctypes.data)
            del kh, vh  # no live view of a pool outside the step
            if rc != 0:
                raise RuntimeError(f"the CPU attention kernel failed ({rc}) on layer {layer}")
            o = self._linear(out.reshape(T, -1), L.o)
            x = self._norm(h, o, L.post_norm)
            gate, up = self._linear(x, L.gate), self._linear(x, L.up)
            act = np.empty_like(gate)
            self.lib.orch_swiglu_f32(gate.ctypes.data, up.ctypes.data, act.ctypes.data, gate.size)
            residual = self._linear(act, L.down)
        final = self._norm(h, residual, self.norm)
        rows = np.asarray(memoryview(batch.logit_rows))
        return mx.array(self._linear(np.ascontiguousarray(final[rows]), self.head))
