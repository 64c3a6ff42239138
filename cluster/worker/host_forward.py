"""A step of a llama-style model on the CPU, with no MLX graph around the C kernels.

On the CPU, MLX runs every op on its stream's own thread: each evaluation hands the graph
to that thread and waits to be woken, however small the op. A step of the paged engine
through mlx-lm's model code evaluates 6-7 times a layer (each C kernel evaluates what it
is given: the residual add and norm before a projection, the reshape and norm before
RoPE, ...), and on a CPU those hand-offs cost a small decode step more than its
attention (MEASUREMENTS.md).

For the families whose decoder block is exactly mlx-lm's llama / qwen2 / qwen3 block
(Llama, Mistral, Qwen2, Qwen2.5, Qwen3 and what mlx-lm maps onto them) every step runs
here instead: numpy arrays on the host, one C call for each norm (fused with the
residual add before it), RoPE, K/V write, attention and SwiGLU, in the order mlx-lm's code
runs them and through the same C kernels the MLX path calls (the norm is the only new
one: MLX's `rms_norm` formula in float32). A projection of fewer than
`cpu_layers.C_LINEAR_MAX_ROWS` rows (every decode step of a smaller batch) runs in the C
linear; a larger one (a prefill chunk, a step full of drafts) in OpenBLAS's sgemm, called
from this thread with the arguments MLX's own CPU matmul passes it, on slices of the
output columns, one per thread (`orch_sgemm_nt`): nn.Linear's product to float32
rounding. The weights are the model's own, read in place. Small decode steps gain the
most, large ones a little (`load/bench_engine.py`; MEASUREMENTS.md).

Calling OpenBLAS here rather than through MLX (which runs it on its stream's thread, with
that thread's own OpenMP team and OpenBLAS's spin-waiting threads) is faster on a quiet
machine and what keeps a step's time sane on a CPU shared with other work, where MLX's
threads wait on each other while unscheduled.

`HostForward.build` admits a model only when every piece of it is one this file knows:
mlx-lm's block, attention and MLP classes of those families, float32 C Linears, plain
RMSNorms, a plain RoPE, attention with no soft-cap or sinks over each layer's own float32
or float16 pool. Anything else (a bfloat16 pool, a scaled RoPE class, another family)
keeps the MLX path, which serves every family, and the log says why.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cluster import platform
from cluster.worker import cpu_layers
from cluster.worker.kernels.cpu import host_view

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
        self.q, self.k, self.v, self.o = (_Weights.of(a.q_proj), _Weights.of(a.k_proj), _Weights.of(a.v_proj),
                                          _Weights.of(a.o_proj))
        self.gate, self.up, self.down = _Weights.of(m.gate_proj), _Weights.of(m.up_proj), _Weights.of(m.down_proj)
        self.heads, self.kv_heads = a.n_heads, a.n_kv_heads
        self.head_dim = self.q.w.shape[0] // self.heads
        self.scale = float(a.scale)
        self.q_norm = (_host(a.q_norm.weight), float(a.q_norm.eps)) if with_qk_norm else None
        self.k_norm = (_host(a.k_norm.weight), float(a.k_norm.eps)) if with_qk_norm else None
        r = a.rope
        self.rope = (int(r.dims), bool(r.traditional), float(r.scale), _host(cpu.rope_frequencies(r.dims, r.base)))


def _host(a: mx.array) -> np.ndarray:
    """A float32, C-contiguous host array of `a`: a view of its memory, or for a float16 /
    bfloat16 array (a quantized model's norms keep the checkpoint's dtype) a widened copy,
    exact, as MLX widens it where it meets float32 activations."""
    if a.dtype != mx.float32:
        a = a.astype(mx.float32)
    mx.eval(a)
    return host_view(a, np.float32)


class _Weights(NamedTuple):
    """A Linear's weight and bias as host arrays (for the C linear and OpenBLAS) and as the
    module's own MLX arrays (for MLX's matmul, where no OpenBLAS is loaded)."""

    w: np.ndarray
    b: np.ndarray | None
    w_mx: mx.array
    b_mx: mx.array | None

    @classmethod
    def of(cls, module) -> "_Weights":
        bias = module["bias"] if "bias" in module else None
        return cls(_host(module.weight), None if bias is None else _host(bias), module.weight, bias)


def blas_gemm() -> int | None:
    """The address of `cblas_sgemm` in the OpenBLAS `cluster.platform` loaded before MLX
    (the one MLX's CPU matmuls call), or None where it loaded none (macOS, a Linux without
    OpenBLAS)."""
    lib = platform.blas_library()
    gemm = getattr(lib, "cblas_sgemm", None) if lib is not None else None
    return None if gemm is None else ctypes.cast(gemm, ctypes.c_void_p).value


def _why_not(model: nn.Module, runner) -> str | None:
    """Why this model's steps cannot run here (None: they can)."""
    from cluster.worker import kernels
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
    stage = runner.stage
    head = getattr(model, "lm_head", None) if not model.args.tie_word_embeddings else inner.embed_tokens
    if stage.embeds and not isinstance(inner.embed_tokens, cpu_layers.CEmbedding):
        return "the embedding is not a float32 C layer"
    if stage.heads and not isinstance(head, (cpu_layers.CEmbedding, cpu_layers.CLinear)):
        return "the LM head is not a float32 C layer"
    if stage.heads and type(inner.norm) is not nn.RMSNorm:
        return "the final norm is not a plain RMSNorm"
    for block, spec in zip(inner.layers, runner.specs):
        if spec.layer not in stage.layers:
            continue
        a, m = block.self_attn, block.mlp
        if not (isinstance(block, code.TransformerBlock) and isinstance(a, code.Attention) and isinstance(m, code.MLP)):
            return f"layer {spec.layer} is not mlx-lm's {family} block"
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if not all(isinstance(x, cpu_layers.CLinear) for x in linears):
            return f"layer {spec.layer} has a projection that is not a float32 C Linear"
        norms = [block.input_layernorm, block.post_attention_layernorm] + (
            [a.q_norm, a.k_norm] if family == "qwen3" else [])
        if not all(type(n) is nn.RMSNorm for n in norms):
            return f"layer {spec.layer} has a norm that is not a plain RMSNorm"
        if not isinstance(a.rope, cpu_layers.CRoPE):
            return f"layer {spec.layer}'s RoPE is {type(a.rope).__name__}, not a plain RoPE"
        if (not spec.attention or spec.recurrent or not spec.owns_kv or spec.kv_layer != spec.layer or spec.latent
                or spec.softcap or spec.sinks or spec.cache_list):
            return f"layer {spec.layer}'s attention is not plain softmax attention over its own K/V pool"
        head_dim = a.q_proj.weight.shape[0] // a.n_heads
        if not kernels.c_kernel_serves("cpu", mx.float32, runner.kv_dtype, (a.n_heads, a.n_kv_heads, head_dim)) \
                or a.rope.dims > head_dim:
            return (f"layer {spec.layer}'s heads ({a.n_heads} on {a.n_kv_heads} KV heads of {head_dim}) are beyond "
                    "the C attention kernel")
    return None


class HostForward:
    """Runs every step of an admitted model (`build`)."""

    def __init__(self, model: nn.Module, runner):
        from cluster.worker.kernels import cpu

        self.lib = cpu.load()
        self.runner = runner
        self.in_c = cpu_layers.c_rows  # which row counts a projection runs in C (the MLX path's rule)
        self.gemm = blas_gemm()  # the larger ones: OpenBLAS from this thread (None: MLX's matmul)
        inner = model.model
        qk_norm = type(model).__module__.endswith("qwen3")
        stage = runner.stage  # a pipeline stage holds some layers, the embedding or the head
        self.layers = [_Layer(b, s, qk_norm) for b, s in zip(inner.layers, runner.specs) if s.layer in stage.layers]
        self.vocab_size = int(model.args.vocab_size)
        self.embed = _host(inner.embed_tokens.weight) if stage.embeds else None
        self.head = self.norm = None
        if stage.heads:
            self.head = _Weights.of(inner.embed_tokens if model.args.tie_word_embeddings else model.lm_head)
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

    def _linear(self, x: np.ndarray, lin: _Weights) -> np.ndarray:
        """x @ w.T (+ b): in C for few rows, else by BLAS as nn.Linear computes it."""
        w, b = lin.w, lin.b
        if not self.in_c(x.shape[0]):
            if self.gemm is not None:
                return self._blas(x, lin)
            xm = mx.array(x)
            y = xm @ lin.w_mx.T if lin.b_mx is None else mx.addmm(lin.b_mx, xm, lin.w_mx.T)
            mx.eval(y)
            return host_view(y, np.float32)
        y = np.empty((x.shape[0], w.shape[0]), np.float32)
        rc = self.lib.orch_linear_f32(x.ctypes.data, x.shape[0], w.shape[1], w.ctypes.data,
                                      None if b is None else b.ctypes.data, y.ctypes.data, w.shape[0])
        if rc != 0:
            raise MemoryError("the C linear could not allocate its scratch")
        return y

    def _blas(self, x: np.ndarray, lin: _Weights) -> np.ndarray:
        """x @ w.T (+ b) by OpenBLAS, with the arguments MLX's CPU matmul passes it for
        nn.Linear (row-major, w transposed; with a bias, mx.addmm's: the bias copied into
        every output row, then added to with beta 1), on slices of the output columns, one
        per thread (`orch_sgemm_nt`)."""
        x = np.ascontiguousarray(x, np.float32)
        (M, K), N = x.shape, lin.w.shape[0]
        if lin.b is None:
            y, beta = np.empty((M, N), np.float32), 0.0
        else:
            y, beta = np.repeat(lin.b[None], M, axis=0), 1.0
        self.lib.orch_sgemm_nt(self.gemm, x.ctypes.data, M, K, lin.w.ctypes.data, N, beta, y.ctypes.data)
        return y

    def _add_norm(self, h: np.ndarray, residual: np.ndarray | None, wn: tuple[np.ndarray, float]) -> np.ndarray:
        """h += residual (in place: h is the residual stream), then rms_norm(h) over the last
        axis, as a new array."""
        w, eps = wn
        out = np.empty_like(h)
        self.lib.orch_add_rmsnorm_f32(h.ctypes.data, None if residual is None else residual.ctypes.data,
                                      w.ctypes.data, out.ctypes.data, h.size // w.shape[0], w.shape[0], eps)
        return out

    def _rope(self, x: np.ndarray, positions: np.ndarray, rope) -> np.ndarray:
        dims, traditional, scale, freqs = rope
        T, H, D = x.shape
        out = np.empty_like(x)
        if self.lib.orch_rope_f32(x.ctypes.data, positions.ctypes.data, freqs.ctypes.data, out.ctypes.data, T, H, D,
                                  dims, int(traditional), scale):
            raise ValueError(f"rope: dims {dims} of head size {D}")  # refused at build: unreachable
        return out

    def _check(self, T, ids, slots, cu, lens, tables) -> None:
        """The C kernels trust their indices: a batch that would send them outside the pools
        is an error here (as `cpu.write_kv` and `cpu.paged_attention_cpu` check on the MLX
        path), never a write to the wrong memory."""
        r = self.runner
        q_lens = np.diff(cu)
        if not (ids.shape == slots.shape == (T,) and cu.shape == (lens.shape[0] + 1,) and cu[0] == 0
                and cu[-1] == T and (q_lens >= 0).all() and (lens >= q_lens).all()
                and tables.shape[0] == lens.shape[0]):
            raise ValueError(f"a step batch that does not add up: {T} rows, cu_seqlens_q {cu.tolist()}, "
                             f"seq_lens {lens.tolist()}, block tables {tables.shape}")
        if T and (ids.min() < 0 or ids.max() >= self.vocab_size or slots.min() < 0
                  or slots.max() >= r.num_blocks * r.block_size):
            raise ValueError("a step batch with token ids outside the vocabulary or slots outside the pool")
        if tables.size and (tables.min() < 0 or tables.max() >= r.num_blocks
                            or lens.max() > tables.shape[1] * r.block_size):
            raise ValueError("a step batch whose block tables leave the pool or do not cover its contexts")

    def forward(self, batch, hidden: mx.array | None = None) -> mx.array:
        """Logits [M, vocab] float32 for `batch.logit_rows`; K/V land in the pools, as
        `ModelRunner.forward` does through MLX. A pipeline stage without the embedding
        starts from `hidden` [T, hidden size], the previous stage's; one without the head
        returns its own hidden state (its last residual added: the add the next layer's
        fused norm would have made)."""
        r = self.runner
        T = batch.num_tokens
        arrays = (batch.input_ids, batch.positions, batch.slot_mapping, batch.cu_seqlens_q, batch.seq_lens,
                  batch.block_tables, batch.logit_rows)
        mx.eval(*arrays)
        ids, pos, slots, cu, lens, tables, rows = (host_view(a, np.int32) for a in arrays)
        S = lens.shape[0]
        self._check(T, ids, slots, cu, lens, tables)
        half = r.kv_dtype == mx.float16
        if self.embed is not None:
            h = np.ascontiguousarray(self.embed[ids])  # [T, hidden]
        else:
            mx.eval(hidden)
            h = np.array(host_view(hidden, np.float32))  # a copy: the residual stream is updated in place
        residual = None
        for L in self.layers:
            x = self._add_norm(h, residual, L.in_norm)
            q = self._linear(x, L.q).reshape(T, L.heads, L.head_dim)
            k = self._linear(x, L.k).reshape(T, L.kv_heads, L.head_dim)
            v = self._linear(x, L.v).reshape(T, L.kv_heads, L.head_dim)
            if L.q_norm is not None:
                q, k = self._add_norm(q, None, L.q_norm), self._add_norm(k, None, L.k_norm)
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
            x = self._add_norm(h, o, L.post_norm)
            gate, up = self._linear(x, L.gate), self._linear(x, L.up)
            act = np.empty_like(gate)
            self.lib.orch_swiglu_f32(gate.ctypes.data, up.ctypes.data, act.ctypes.data, gate.size)
            residual = self._linear(act, L.down)
        if self.head is None:
            if residual is not None:
                h += residual
            return mx.array(h)
        final = self._add_norm(h, residual, self.norm)
        if batch.hidden_rows is not None:  # pooling requests: final hidden states, before the head
            mx.eval(batch.hidden_rows)
            r.hidden = mx.array(final[host_view(batch.hidden_rows, np.int32)])
        if not rows.size:  # a step of pooling requests alone
            return mx.zeros((0, self.head.w.shape[0]), mx.float32)
        return mx.array(self._linear(np.ascontiguousarray(final[rows]), self.head))
