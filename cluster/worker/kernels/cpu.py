"""The CPU kernels: `cpu_kernels.c`, compiled on first use, called through ctypes.

Where there is no Metal, MLX's CPU backend is slow at two things the engine does every
step: paged attention (the pure-MLX reference gathers K/V rows and runs many tiny
matmuls: `load/bench_attention.py`) and SwiGLU (a scalar `exp`). MEASUREMENTS.md has
the figures. The C attention reads the block pool in place (zero-copy through the
buffer protocol) and walks each token's context through its block table with an online
softmax, one call per layer per step; the C SwiGLU is a vectorised polynomial exp.

The shared library is built with the system compiler (`$CC`, else `cc`) into
`$ORCHARD_HOME/kernels`, keyed by the source, the flags and the machine; nothing is built
at install time. Without a compiler `available()` is False and MLX serves (a warning says
so once). Queries and outputs are float32 (what the CPU computes in: fp16/bf16 matmuls are
slow there); the K/V pools may be float32, float16 or bfloat16 (`--kv-cache-dtype`), a
half-precision tile widened to float32 as it is read.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import logging
import os
import platform as _platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
_I32 = ctypes.c_int32
_I64 = ctypes.c_int64
_F32 = ctypes.c_float
_PTR = ctypes.c_void_p

MAX_GROUP, MAX_HEAD_DIM = 32, 576  # as in cpu_kernels.c

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _cache_dirs() -> list[Path]:
    from cluster.models_cache import home

    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [home() / "kernels", Path(tempfile.gettempdir()) / f"orchard-kernels-{uid}"]


# Compile flags (-ffast-math lets the dot products and the exp loop vectorise) are kept
# apart from link flags: linking a shared library with -ffast-math pulls in crtfastmath.o
# (GCC <= 12), which turns on flush-to-zero for the whole process when it is loaded.
_COMPILE = ["-O3", "-fPIC", "-ffast-math", "-std=c11"]


def _variants() -> list[tuple[list[str], list[str]]]:
    """(extra compile flags, extra link flags), best first; each later one drops something
    a compiler may lack (OpenMP on Apple clang, -march/-mcpu=native on old compilers)."""
    arch = ["-march=native"] if _platform.machine() in ("x86_64", "AMD64") else ["-mcpu=native"]
    return [(arch + ["-fopenmp"], ["-fopenmp"]), (arch, []), ([], [])]


def _machine_key() -> str:
    """What a -march=native build depends on: the host and its CPU's description."""
    key = [_platform.node(), _platform.machine(), _platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            key += [line for line in f if not line.startswith(("cpu MHz", "bogomips", "BogoMIPS"))]
    except OSError:
        pass
    return "\n".join(key)


def _compile(cc: list[str], cflags: list[str], lflags: list[str], target: Path) -> str | None:
    """Build `target` (atomically: concurrent builders both succeed). None, or the error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / target.name
        for cmd in ([*cc, *_COMPILE, *cflags, "-c", str(SOURCE), "-o", str(obj)],
                    [*cc, "-shared", *lflags, str(obj), "-o", str(lib), "-lm"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                return f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}"
        os.replace(lib, target)
    return None


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.orch_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I32, _PTR, _I32, _PTR, _PTR, _I32, _I32,
                   _I32, _I32, _I32, _I32, _F32, _I32, _F32, _PTR, _PTR]
    lib.orch_swiglu_f32.restype = None
    lib.orch_swiglu_f32.argtypes = [_PTR, _PTR, _PTR, _I64]
    lib.orch_gated_delta.restype = ctypes.c_int
    lib.orch_gated_delta.argtypes = [_PTR] * 8 + [_I64, _I64, _I32, _I32, _I32, _I32, _I32]
    lib.orch_depthwise_conv1d.restype = ctypes.c_int
    lib.orch_depthwise_conv1d.argtypes = [_PTR] * 4 + [_I64, _I64, _I64, _I32]
    lib.orch_linear_f32.restype = ctypes.c_int
    lib.orch_linear_f32.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64]
    lib.orch_sgemm_nt.restype = None
    lib.orch_sgemm_nt.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _I64, _F32, _PTR]
    lib.orch_rope_f32.restype = ctypes.c_int
    lib.orch_rope_f32.argtypes = [_PTR] * 4 + [_I64, _I64, _I32, _I32, _I32, _F32]
    lib.orch_add_rmsnorm_f32.restype = None
    lib.orch_add_rmsnorm_f32.argtypes = [_PTR] * 4 + [_I64, _I64, _F32]
    lib.orch_write_rows.restype = None
    lib.orch_write_rows.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR]
    return lib


def _build() -> ctypes.CDLL:
    cc_env = os.environ.get("CC")
    cc = shlex.split(cc_env) if cc_env else [shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or ""]
    if not cc or not cc[0]:
        raise RuntimeError("no C compiler found (set CC, or install gcc/clang)")
    source = SOURCE.read_bytes()
    errors = []
    for cflags, lflags in _variants():
        key = hashlib.sha256(b"\0".join([source, " ".join(cc + _COMPILE + cflags + lflags).encode(),
                                          _machine_key().encode()])).hexdigest()[:16]
        for directory in _cache_dirs():  # the user cache; a temp dir when it is read-only
            target = directory / f"cpu_kernels-{key}.so"
            failed = directory / f"cpu_kernels-{key}.failed"  # don't retry a known failure every start
            try:
                if failed.exists():
                    errors.append(failed.read_text())
                    break
                if not target.exists():
                    error = _compile(cc, cflags, lflags, target)
                    if error is not None:
                        errors.append(error)
                        failed.write_text(error)
                        break
                return _open(target)
            except FileNotFoundError as e:  # the compiler itself is missing
                raise RuntimeError(f"C compiler {cc[0]!r} not found") from e
            except OSError as e:  # unwritable cache, or a library that does not load
                errors.append(f"{target}: {e}")
    raise RuntimeError("could not build the CPU attention kernel:\n" + "\n".join(errors))


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first call; None (with a warning) if it cannot be built."""
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except Exception as e:  # no compiler, a broken toolchain: the reference serves
                _error = str(e)
                log.warning("CPU attention kernel unavailable, using the pure-MLX reference (slower): %s", e)
        return _lib


def available() -> bool:
    return load() is not None


def build_error() -> str | None:
    """Why the kernels could not be built (None: built, or not tried yet)."""
    return _error


def _loaded() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {_error}")
    return lib


def runs_here(*arrays: mx.array) -> bool:
    """Whether an op on these arrays can take a C kernel: all float32, on MLX's CPU device,
    the kernels built. (The callers' own checks are about shapes.)"""
    return mx.default_device() == mx.cpu and all(a.dtype == mx.float32 for a in arrays) and available()


def _float32_host(what: str, *arrays: mx.array | None) -> list[np.ndarray | None]:
    """The float32 inputs of the C `what`, evaluated, as C-contiguous numpy views (None
    stays None): a TypeError naming their dtypes for any other dtype."""
    given = [a for a in arrays if a is not None]
    if any(a.dtype != mx.float32 for a in given):
        raise TypeError(f"the C {what} takes float32 arrays, not " + ", ".join(str(a.dtype) for a in given))
    mx.eval(*given)
    return [None if a is None else host_view(a, np.float32) for a in arrays]


GDN_MAX_DK = 1024  # as in cpu_kernels.c

# the C kernel's kv_kind for each pool dtype
KV_KINDS = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}


def host_view(a: mx.array, dtype) -> np.ndarray:
    """A zero-copy, C-contiguous numpy view of an evaluated MLX array (copy only if strided)."""
    return np.ascontiguousarray(np.asarray(memoryview(a)), dtype=dtype)


def paged_attention_cpu(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    sinks: mx.array | None = None,
) -> mx.array:
    """Same contract as `paged_attention_reference`: float32 queries, float32 / float16 /
    bfloat16 caches. Evaluates its inputs."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {_error}")
    T, H, D = q.shape
    NB, BS, KVH, Dk = k_cache.shape
    if q.dtype != mx.float32 or k_cache.dtype not in KV_KINDS or v_cache.dtype != k_cache.dtype:
        raise TypeError("the CPU attention kernel takes float32 queries and float32, float16 or bfloat16 caches "
                        f"(one dtype for K and V), not {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if v_cache.shape != k_cache.shape or Dk != D:
        raise ValueError(f"q {q.shape}, k_cache {k_cache.shape} and v_cache {v_cache.shape} do not agree")
    if not (KVH >= 1 and H % KVH == 0 and H // KVH <= MAX_GROUP and 1 <= D <= MAX_HEAD_DIM):
        raise ValueError(f"the CPU attention kernel does not support H={H}, KVH={KVH}, D={D} "
                         f"(needs H % KVH == 0, H / KVH <= {MAX_GROUP}, D <= {MAX_HEAD_DIM})")
    mx.eval(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    cu = host_view(cu_seqlens_q, np.int32)
    lens = host_view(seq_lens, np.int32)
    tables = host_view(block_tables, np.int32)
    S = lens.shape[0]
    # The C code trusts its indices: check them here, where a bad batch is a clear error.
    if cu.shape != (S + 1,) or cu[0] != 0 or cu[-1] != T or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens_q {cu.tolist()} does not split the {T} query rows over {S} sequences")
    q_lens = np.diff(cu)
    if tables.ndim != 2 or tables.shape[0] != S:
        raise ValueError(f"block_tables {tables.shape} needs one row per sequence ({S})")
    if S and ((lens < q_lens).any() or int(lens.max()) > tables.shape[1] * BS):
        raise ValueError(f"each seq_len must cover its queries and fit its block table ({tables.shape[1]} "
                         f"blocks of {BS}): seq_lens {lens.tolist()}, q_lens {q_lens.tolist()}")
    if tables.size and (int(tables.min()) < 0 or int(tables.max()) >= NB):
        raise ValueError(f"block tables name blocks outside the pool of {NB}")
    qh = np.asarray(memoryview(q))
    if qh.strides[2] != 4 or qh.strides[0] % 4 or qh.strides[1] % 4:
        qh = np.ascontiguousarray(qh)
    kind = KV_KINDS[k_cache.dtype]
    if kind:  # half precision: the C code reads the raw 16-bit words
        k_cache, v_cache = k_cache.view(mx.uint16), v_cache.view(mx.uint16)
    k = np.asarray(memoryview(k_cache))
    v = np.asarray(memoryview(v_cache))
    if not (k.flags.c_contiguous and v.flags.c_contiguous):
        raise ValueError("the K/V pools must be contiguous")
    sink = None if sinks is None else np.ascontiguousarray(np.asarray(sinks.astype(mx.float32)), np.float32).reshape(H)
    out = np.empty((T, H, D), np.float32)
    rc = lib.orch_paged_attention(
        qh.ctypes.data, qh.strides[0] // 4, qh.strides[1] // 4, k.ctypes.data, v.ctypes.data, kind,
        tables.ctypes.data, tables.shape[1], lens.ctypes.data, cu.ctypes.data, S,
        T, H, KVH, D, BS,
        scale, sliding_window if sliding_window and sliding_window > 0 else -1, softcap or 0.0,
        None if sink is None else sink.ctypes.data, out.ctypes.data,
    )
    del qh, k, v  # drop the views now: a live view would stop MLX updating the pool in place
    if rc == -2:
        raise MemoryError("the CPU attention kernel could not allocate its work list")
    if rc != 0:
        raise ValueError(f"the CPU attention kernel refused H={H}, KVH={KVH}, D={D}")
    return mx.array(out)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x in float32, as mlx-lm's `swiglu` (evaluates its inputs)."""
    lib = _loaded()
    if gate.shape != x.shape or gate.dtype != mx.float32 or x.dtype != mx.float32:
        raise TypeError(f"swiglu takes two float32 arrays of one shape, not {gate.shape} {gate.dtype} "
                        f"and {x.shape} {x.dtype}")
    mx.eval(gate, x)
    g = np.ascontiguousarray(np.asarray(memoryview(gate)))
    xv = np.ascontiguousarray(np.asarray(memoryview(x)))
    out = np.empty(g.shape, np.float32)
    lib.orch_swiglu_f32(g.ctypes.data, xv.ctypes.data, out.ctypes.data, out.size)
    del g, xv
    return mx.array(out)


def write_kv(k_pool: mx.array, v_pool: mx.array | None, slot_mapping: mx.array, keys: mx.array,
             values: mx.array | None) -> None:
    """Write the step's K/V rows into the pools in place: keys/values [T, ...] (each row
    KVH x D) to rows `slot_mapping` of the flat pools [slots, KVH, D]; converted to the
    pool's dtype by MLX first (the same rounding as a scatter would do). Evaluates its
    inputs; the pools must be evaluated arrays nobody else is updating (the engine's)."""
    lib = _loaded()
    T, row = slot_mapping.shape[0], k_pool.shape[1:]
    keys = keys.reshape(T, *row).astype(k_pool.dtype)
    values = None if values is None else values.reshape(T, *row).astype(k_pool.dtype)
    mx.eval(keys, slot_mapping, *(() if values is None else (values,)))
    slots = host_view(slot_mapping, np.int32)
    if T and (int(slots.min()) < 0 or int(slots.max()) >= k_pool.shape[0]):
        raise ValueError(f"slot mapping names slots outside the pool of {k_pool.shape[0]}")
    if k_pool.dtype.size not in (2, 4):
        raise TypeError(f"K/V pools of {k_pool.dtype} are not written here")
    raw = np.uint16 if k_pool.dtype.size == 2 else np.float32
    view = (lambda a: a.view(mx.uint16)) if raw is np.uint16 else (lambda a: a)
    kp = np.asarray(memoryview(view(k_pool)))
    vp = None if v_pool is None else np.asarray(memoryview(view(v_pool)))
    kh = host_view(view(keys), raw)
    vh = None if values is None else host_view(view(values), raw)
    if not kp.flags.c_contiguous or not kp.flags.writeable or (vp is not None and not vp.flags.c_contiguous):
        raise ValueError("the K/V pools must be contiguous and writable")
    # a row's size from the pool, not from kh.strides[0]: numpy calls an array whose first
    # axis has length 1 contiguous whatever that axis's stride is (a slice's, say)
    row_bytes = kp.nbytes // max(kp.shape[0], 1)
    if not (kh.flags.c_contiguous and kh.nbytes == T * row_bytes and (vh is None or vh.nbytes == kh.nbytes)
            and (vp is None or (vp.flags.writeable and vp.nbytes == kp.nbytes))):
        raise ValueError(f"rows {kh.shape} do not fit pool rows of {row_bytes} bytes")
    lib.orch_write_rows(kh.ctypes.data, None if vh is None else vh.ctypes.data, slots.ctypes.data, T,
                        row_bytes, kp.ctypes.data, None if vp is None else vp.ctypes.data)
    del kp, vp


def gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                state: mx.array) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_ops` (the gated delta rule over T tokens, in order) in C, all
    float32: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv] or [B, T, Hv, Dk]; beta
    [B, T, Hv]; state [B, Hv, Dv, Dk]. Returns y [B, T, Hv, Dv] and the new state.
    Evaluates its inputs."""
    lib = _loaded()
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    g_vec = g.ndim == 4
    if (k.shape != q.shape or v.shape[:2] != (B, T) or g.shape != (B, T, Hv, Dk)[: 4 if g_vec else 3]
            or beta.shape != (B, T, Hv) or state.shape != (B, Hv, Dv, Dk) or Hv % Hk):
        raise ValueError(f"gated delta shapes do not agree: q {q.shape} k {k.shape} v {v.shape} g {g.shape} "
                         f"beta {beta.shape} state {state.shape}")
    qh, kh, vh, gh, bh, sh = _float32_host("gated delta rule", q, k, v, g, beta, state)
    y = np.empty((B, T, Hv, Dv), np.float32)
    new = np.empty((B, Hv, Dv, Dk), np.float32)
    rc = lib.orch_gated_delta(qh.ctypes.data, kh.ctypes.data, vh.ctypes.data, gh.ctypes.data, bh.ctypes.data,
                              sh.ctypes.data, new.ctypes.data, y.ctypes.data, B, T, Hk, Hv, Dk, Dv, int(g_vec))
    del qh, kh, vh, gh, bh, sh
    if rc != 0:
        raise ValueError(f"the C gated delta rule does not take Dk={Dk} (at most {GDN_MAX_DK}), Hv={Hv}, Hk={Hk}")
    return mx.array(y), mx.array(new)


def depthwise_conv1d(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """`mx.conv1d(x, weight, groups=C)` (+ bias), stride 1, no padding, all float32: x [B, L,
    C], weight [C, K, 1]; returns [B, L - K + 1, C]. Evaluates its inputs."""
    lib = _loaded()
    B, L, C = x.shape
    K = weight.shape[1]
    if weight.shape != (C, K, 1) or (bias is not None and bias.shape != (C,)) or L < K:
        raise ValueError(f"not a depthwise convolution: x {x.shape}, weight {weight.shape}, "
                         f"bias {None if bias is None else bias.shape}")
    xh, wh, bh = _float32_host("depthwise convolution", x, weight, bias)
    out = np.empty((B, L - K + 1, C), np.float32)
    rc = lib.orch_depthwise_conv1d(xh.ctypes.data, wh.ctypes.data, None if bh is None else bh.ctypes.data,
                                   out.ctypes.data, B, L, C, K)
    del xh, wh, bh
    if rc == -2:
        raise MemoryError("the C depthwise convolution could not allocate its transposed weights")
    if rc != 0:
        raise ValueError(f"the C depthwise convolution refused L={L}, K={K}")
    return mx.array(out)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ weight.T (+ bias), float32, for a few rows: x [..., K], weight [N, K] (an
    nn.Linear's). Evaluates its inputs. Fastest when the weight is 32-byte aligned
    (`aligned_copy`)."""
    lib = _loaded()
    N, K = weight.shape
    if x.shape[-1] != K or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"linear: x {x.shape}, weight {weight.shape}, bias {None if bias is None else bias.shape}")
    xh, wh, bh = _float32_host("linear", x, weight, bias)
    xh = xh.reshape(-1, K)
    y = np.empty((xh.shape[0], N), np.float32)
    rc = lib.orch_linear_f32(xh.ctypes.data, xh.shape[0], K, wh.ctypes.data, None if bh is None else bh.ctypes.data,
                             y.ctypes.data, N)
    del xh, wh, bh
    if rc != 0:
        raise MemoryError("the C linear could not allocate its scratch")
    return mx.array(y).reshape(*x.shape[:-1], N)


def aligned_copy(a: mx.array, alignment: int = 64) -> mx.array:
    """A float32 copy of `a` whose data starts on an `alignment`-byte boundary: a view
    into a buffer a little larger (MLX's allocator puts data 24 bytes past a 64-byte
    boundary, a loaded weight anywhere), so the C kernels' vector loads never straddle
    cache lines. Written through the buffer, as the K/V pools are. A weight of 2^31 elements
    or more is returned as it is."""
    if a.dtype != mx.float32:
        raise TypeError(f"aligned_copy takes float32, not {a.dtype}")
    n, step = a.size, alignment // 4
    if n + step >= 2**31:  # MLX's axis lengths are int32: such a weight stays as it is (correct, a little slower)
        return a
    buf = mx.zeros((n + step,), mx.float32)
    mx.eval(buf, a)
    host = np.asarray(memoryview(buf))
    skip = (-host.ctypes.data % alignment) // 4
    host[skip: skip + n] = np.asarray(memoryview(a)).reshape(-1)
    del host
    view = buf[skip: skip + n].reshape(a.shape)
    mx.eval(view)
    return view


def rope(x: mx.array, positions: mx.array, dims: int, traditional: bool, inv_freq: mx.array,
         scale: float) -> mx.array:
    """mlx's `fast.rope(x, dims, traditional=..., base=..., scale=..., offset=positions)` for a
    packed step: x [T, H, 1, D] float32 (a row per token), positions [T]; the frequencies
    `inv_freq` [dims / 2] as `rope_frequencies` gives them. Evaluates its inputs."""
    lib = _loaded()
    T, H, L, D = x.shape
    if L != 1 or positions.shape != (T,) or dims > D or dims % 2 or inv_freq.shape != (dims // 2,) \
            or D > MAX_HEAD_DIM:
        raise ValueError(f"rope: x {x.shape}, positions {positions.shape}, dims {dims}, inv_freq {inv_freq.shape}")
    if x.dtype != mx.float32:
        raise TypeError(f"the C rope takes float32, not {x.dtype}")
    mx.eval(x, positions, inv_freq)
    xh, ph, fh = host_view(x, np.float32), host_view(positions, np.int32), host_view(inv_freq, np.float32)
    out = np.empty((T, H, 1, D), np.float32)
    rc = lib.orch_rope_f32(xh.ctypes.data, ph.ctypes.data, fh.ctypes.data, out.ctypes.data, T, H, D, dims,
                           int(traditional), scale)
    del xh, ph, fh
    if rc != 0:
        raise ValueError(f"rope: dims {dims} of head size {D} (at most {MAX_HEAD_DIM})")
    return mx.array(out)


def rope_frequencies(dims: int, base: float) -> mx.array:
    """The dims / 2 inverse frequencies of RoPE with this base, in float32, computed as mlx
    computes them: base ** (-2i / dims)."""
    return mx.exp(mx.arange(dims // 2, dtype=mx.float32) * (-math.log(base) / (dims // 2)))
