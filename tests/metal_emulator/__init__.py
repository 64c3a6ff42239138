"""Run `mx.fast.metal_kernel` sources on the CPU, so Metal kernels are tested on Linux.

`metal_kernel(...)` takes exactly what `mx.fast.metal_kernel` takes and returns a callable
that takes what MLX's kernel object takes (inputs, template, grid, threadgroup,
output_shapes, output_dtypes, init_value, verbose) and returns `mx.array` outputs, so real
kernel wrappers run unchanged under

    monkeypatch.setattr(mx.fast, "metal_kernel", metal_emulator.metal_kernel)

How: the kernel body is wrapped in the signature MLX generates (see MLX's
`mlx/backend/metal/custom_kernel.cpp`): `const device T*` inputs (`const constant T&`
for 0-d ones, `constant` for fewer than 8 elements), `<name>_shape` / `_strides` /
`_ndim` for inputs whose names appear so suffixed in the source, `device T*` (or
`device atomic<T>*`) outputs, template parameters (`int`, `bool`, `typename`), and the
thread-position attributes the source mentions. A C++ prelude (`prelude.h`) gives Metal's
address spaces (empty), vector types, `half` (`_Float16`), `bfloat` (16-bit storage,
float arithmetic), `metal::` math incl. `fast::` / `precise::`, simdgroup functions,
barriers and atomics, and of the utils header MLX puts in front of every custom kernel
the common part (`float16_t`, `bfloat16_t`, `Limits<T>`, `using namespace metal`). g++
compiles it into a shared library, cached by source hash in `$ORCHARD_METAL_EMU_CACHE`
(default: `<tmp>/orchard-metal-emu-<uid>`).

Every GPU thread really runs the kernel body with its own stack; barriers are real
barriers (see `runtime.cpp`). Backends (`config.backend`, env
`ORCHARD_METAL_EMU_BACKEND`):
  "fibers"  (default) the threads of a threadgroup are user-space fibers on one OS
            thread, switching at each barrier / simd operation; threadgroups run in
            parallel on `config.workers` OS threads (env `ORCHARD_METAL_EMU_WORKERS`).
  "threads" one OS thread per GPU thread, threadgroups one after another. Slow; it
            shows that nothing depends on the fibers' deterministic interleaving.
SIMD width is 32; simdgroup operations exchange values through a per-simdgroup buffer
and a barrier; reductions are computed once (pairwise tree) and every lane gets the
same value.

Checks the GPU would also make: threadgroup size <= 1024 threads, threadgroup memory
<= 32 KiB (`config.threadgroup_memory`). Checks the GPU would not make: a barrier or
simd operation not reached by every thread (lane) is reported as a deadlock instead of
being undefined behaviour. Outputs without `init_value` and fresh threadgroup memory
are filled with 0xFF bytes (NaN for floats), so reading them shows.

Limits (what differs from a GPU):
- The only rewrites of the source text: `threadgroup T name[dims];` declarations become
  references to per-threadgroup storage (one declarator per statement; the type is a
  (qualified) name with optional template arguments), and `#include <metal_*>` lines are
  dropped. Address-space qualifiers are empty macros, so code that overloads on address
  space does not compile.
- The "threads" backend reports a barrier nobody completes only after a 60 s timeout.
- Simdgroup operations need all lanes of the simdgroup (no divergent simd_* calls, no
  inactive-lane semantics); quad_* functions, simd_ballot / simd_vote, simdgroup_matrix,
  textures, samplers, function constants and `[[...]]` attributes in the header are not
  supported. Vectors have .x/.y/.z/.w and [i] but no swizzles (.xy); no `h` literal suffix.
- Inputs are always passed row-contiguous with matching `_strides` (MLX passes the real
  strides when `ensure_row_contiguous=False`), so a kernel that ignores strides is not
  caught.
- No bounds checking: an out-of-bounds access is undefined behaviour, here as there
  (it may crash the test process).
- Math is IEEE libm in float: `fast::` functions are as precise as the others, and
  half arithmetic rounds like `_Float16` (GPU rounding may differ in the last bit).
- The order of threads between barriers is deterministic in "fibers" (thread order
  within a threadgroup); data races that a GPU might expose can stay hidden there.
- Grid and threadgroup as in MLX (`dispatch_threads`: edge threadgroups are smaller);
  `stream` is ignored; everything runs synchronously when the kernel is called.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import mlx.core as mx

__all__ = ["metal_kernel", "config", "settings", "available", "EmulatorError", "CompileError"]

_HERE = Path(__file__).resolve().parent
_PRELUDE = (_HERE / "prelude.h").read_text()
_RUNTIME_SRC = (_HERE / "runtime.cpp").read_text()

CXX = os.environ.get("CXX", "g++")
_KERNEL_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-w", "-fno-strict-aliasing"]
_RUNTIME_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-pthread"]
if sys.platform == "darwin":  # kernels resolve the runtime's emu_* symbols when loaded
    _KERNEL_FLAGS += ["-undefined", "dynamic_lookup"]

# Inputs with fewer elements go in the constant address space (as in MLX).
_MAX_CONSTANT_ARRAY_SIZE = 8
MAX_THREADS_PER_THREADGROUP = 1024

# The attributes MLX adds to the signature when the source mentions them.
_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
# How each attribute is read from the runtime's `emu_thread_info`.
_ATTRIBUTE_VALUES = {
    "dispatch_quadgroups_per_threadgroup": "t->dispatch_quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup": "t->dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup": "emu::u3(t->dispatch_threads_per_threadgroup)",
    "grid_origin": "emu::u3(t->grid_origin)",
    "grid_size": "emu::u3(t->threads_per_grid)",
    "quadgroup_index_in_threadgroup": "t->quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup": "t->quadgroups_per_threadgroup",
    "simdgroup_index_in_threadgroup": "t->simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "t->simdgroups_per_threadgroup",
    "thread_execution_width": "t->threads_per_simdgroup",
    "thread_index_in_quadgroup": "t->thread_index_in_quadgroup",
    "thread_index_in_simdgroup": "t->thread_index_in_simdgroup",
    "thread_index_in_threadgroup": "t->thread_index_in_threadgroup",
    "thread_position_in_grid": "emu::u3(t->thread_position_in_grid)",
    "thread_position_in_threadgroup": "emu::u3(t->thread_position_in_threadgroup)",
    "threadgroup_position_in_grid": "emu::u3(t->threadgroup_position_in_grid)",
    "threadgroups_per_grid": "emu::u3(t->threadgroups_per_grid)",
    "threads_per_grid": "emu::u3(t->threads_per_grid)",
    "threads_per_simdgroup": "t->threads_per_simdgroup",
    "threads_per_threadgroup": "emu::u3(t->threads_per_threadgroup)",
}

# mlx dtype -> (Metal type name as MLX writes it, numpy storage dtype)
_DTYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.bool_: ("bool", np.bool_),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
}


class EmulatorError(RuntimeError):
    """A kernel failed at run time (deadlock, too much threadgroup memory, ...)."""


class CompileError(EmulatorError):
    """The kernel source did not compile as C++ under the prelude."""


@dataclass
class Config:
    backend: str = field(default_factory=lambda: os.environ.get("ORCHARD_METAL_EMU_BACKEND", "fibers"))
    workers: int = field(default_factory=lambda: int(os.environ.get("ORCHARD_METAL_EMU_WORKERS", os.cpu_count() or 1)))
    threadgroup_memory: int = 32 * 1024
    cache_dir: Path = field(
        default_factory=lambda: Path(
            os.environ.get("ORCHARD_METAL_EMU_CACHE")
            or Path(tempfile.gettempdir()) / f"orchard-metal-emu-{os.getuid()}"
        )
    )


config = Config()


@contextlib.contextmanager
def settings(**changes):
    """Temporarily change `config` fields, e.g. `with settings(backend="threads"): ...`."""
    old = {k: getattr(config, k) for k in changes}
    for k, v in changes.items():
        setattr(config, k, v)
    try:
        yield config
    finally:
        for k, v in old.items():
            setattr(config, k, v)


# ------------------------------------------------------------------------- compiling

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_runtime: ctypes.CDLL | None = None


def _compile(source: str, flags: list[str], prefix: str) -> Path:
    key = hashlib.sha256("\0".join([CXX, *flags, source]).encode()).hexdigest()[:32]
    cache = Path(config.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{prefix}-{key}.so"
    if out.exists():
        return out
    src = cache / f"{prefix}-{key}.{os.getpid()}.{threading.get_ident()}.cpp"
    tmp = src.with_suffix(".so.tmp")
    src.write_text(source)
    try:
        proc = subprocess.run([CXX, *flags, str(src), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"{CXX} failed on the emulated kernel ({src}):\n{proc.stderr[-6000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders of the same source are fine
    finally:
        if out.exists():
            src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out


def _load_runtime() -> ctypes.CDLL:
    global _runtime
    if _runtime is None:
        path = _compile(_RUNTIME_SRC, _RUNTIME_FLAGS, "runtime")
        rt = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)  # kernels resolve emu_* against it
        rt.emu_launch.restype = ctypes.c_int
        rt.emu_launch.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_ulong,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        _runtime = rt
    return _runtime


def _load_kernel(source: str) -> ctypes.CDLL:
    with _lock:
        _load_runtime()
        lib = _libs.get(source)
        if lib is None:
            lib = ctypes.CDLL(str(_compile(source, _KERNEL_FLAGS, "kernel")))
            _libs[source] = lib
        return lib


_available: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """(True, "") when a C++ compiler here builds and runs the emulator; else (False, why)."""
    global _available
    if _available is None:
        try:
            k = metal_kernel(name="probe", input_names=["a"], output_names=["out"],
                             source="out[thread_position_in_grid.x] = simd_sum(a[0]);")
            (out,) = k(inputs=[mx.ones(1)], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
                       output_dtypes=[mx.float32])
            ok = bool(np.all(np.array(out) == 32.0))
            _available = (ok, "" if ok else "the emulator computed a wrong probe result")
        except (OSError, EmulatorError) as e:
            _available = (False, f"the Metal emulator cannot run here: {e}"[:500])
    return _available


# ------------------------------------------------------------------------- source text

_METAL_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_\w+>[^\n]*$", re.M)
_TG_DECL = re.compile(
    r"\bthreadgroup\s+"
    r"(?P<type>(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()*&]*?>)?)\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\[\];]+\]\s*)*);"
)


def _rewrite(text: str, counter: list[int]) -> str:
    """Make `threadgroup` variables shared by the threads of a threadgroup."""

    def repl(m: re.Match) -> str:
        counter[0] += 1
        ty, name = m.group("type"), m.group("name")
        dims = re.sub(r"\s+", " ", m.group("dims")).strip()
        if dims:
            return f"{ty} (&{name}){dims} = *::emu::tg_var<{ty}{dims}>({counter[0]});"
        return f"{ty}& {name} = *::emu::tg_var<{ty}>({counter[0]});"

    text = _METAL_INCLUDE.sub("", text)
    return _TG_DECL.sub(repl, text)


def _template_value(v) -> tuple[str, str]:
    if isinstance(v, bool):
        return "bool", "true" if v else "false"
    if isinstance(v, int):
        return "int", str(int(v))
    if isinstance(v, mx.Dtype):
        return "typename", _DTYPES[v][0]
    raise TypeError(f"template argument must be int, bool or mlx Dtype, got {v!r}")


def _as_numpy(x) -> tuple[np.ndarray, mx.Dtype]:
    if isinstance(x, bool):
        x = mx.array(x, dtype=mx.bool_)
    elif isinstance(x, int):
        x = mx.array(x, dtype=mx.int32)
    elif isinstance(x, float):
        x = mx.array(x, dtype=mx.float32)
    elif not isinstance(x, mx.array):
        x = mx.array(x)
    if x.dtype not in _DTYPES:
        raise TypeError(f"the emulator does not support {x.dtype}")
    if x.dtype == mx.bfloat16:
        a = np.array(x.view(mx.uint16))
    else:
        a = np.array(x)
    return (a if a.flags.c_contiguous else a.copy(order="C")), x.dtype  # (ascontiguousarray makes 0-d 1-d)


def _to_mx(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a)


def _filled(shape, dtype: mx.Dtype, init_value) -> np.ndarray:
    np_dtype = _DTYPES[dtype][1]
    out = np.empty(tuple(int(s) for s in shape), dtype=np_dtype)
    if init_value is None:
        out.view(np.uint8).fill(0xFF)  # uninitialised on the GPU: make reading it visible
    elif dtype == mx.bfloat16:
        out.fill(int(np.array(mx.array(init_value, dtype=mx.bfloat16).view(mx.uint16))))
    else:
        out.fill(init_value)
    return out


# ------------------------------------------------------------------------- the kernel


class EmulatedKernel:
    """What `mx.fast.metal_kernel` returns, running on the CPU."""

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        # As MLX: looked up in the body only.
        self.shape_infos = [
            (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in self.input_names
        ]
        self.attributes = [(a, t) for a, t in _ATTRIBUTES if a in source]
        self.last_source: str | None = None

    def _translation_unit(self, inputs, output_dtypes, template) -> str:
        counter = [0]
        fname = "custom_kernel_" + re.sub(r"\W", "_", self.name)
        parts = [_PRELUDE, "\n// ---- header\n", _rewrite(self.header, counter), "\n// ---- kernel\n"]
        if template:
            parts.append("template <" + ", ".join(f"{_template_value(v)[0]} {n}" for n, v in template) + ">\n")
        params, args = [], []
        index = 0
        for name, (arr, dtype), info in zip(self.input_names, inputs, self.shape_infos):
            ty = _DTYPES[dtype][0]
            loc = "constant" if arr.size < _MAX_CONSTANT_ARRAY_SIZE else "device"
            if arr.ndim == 0:
                params.append(f"  const {loc} {ty}& {name}")
                args.append(f"*(const {ty}*)a[{index}]")
            else:
                params.append(f"  const {loc} {ty}* {name}")
                args.append(f"(const {ty}*)a[{index}]")
            index += 1
            if arr.ndim > 0:
                if info[0]:
                    params.append(f"  const constant int* {name}_shape")
                    args.append(f"(const int*)a[{index}]")
                    index += 1
                if info[1]:
                    params.append(f"  const constant int64_t* {name}_strides")
                    args.append(f"(const int64_t*)a[{index}]")
                    index += 1
                if info[2]:
                    params.append(f"  const constant int& {name}_ndim")
                    args.append(f"*(const int*)a[{index}]")
                    index += 1
        for name, dtype in zip(self.output_names, output_dtypes):
            ty = _DTYPES[dtype][0]
            ty = f"atomic<{ty}>" if self.atomic_outputs else ty
            params.append(f"  device {ty}* {name}")
            args.append(f"({ty}*)a[{index}]")
            index += 1
        for attr, ty in self.attributes:
            params.append(f"  {ty} {attr}")
            args.append(_ATTRIBUTE_VALUES[attr])
        parts.append(f"void {fname}(\n" + ",\n".join(params) + ") {\n")
        parts.append(_rewrite(self.source, counter))
        parts.append("\n}\n")
        targs = "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">" if template else ""
        parts.append(
            'extern "C" void emu_entry(void** a, const emu_thread_info* t) {\n'
            f"  {fname}{targs}(\n    " + ",\n    ".join(args) + ");\n}\n"
        )
        return "".join(parts)

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None,
                 verbose=False, stream=None):
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} but got size {len(inputs)}."
            )
        if len(output_shapes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected `output_shapes` to have size {len(self.output_names)}.")
        if len(output_dtypes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected `output_dtypes` to have size {len(self.output_names)}.")
        template = [(str(n), v) for n, v in (template.items() if isinstance(template, dict) else (template or []))]
        arrays = [_as_numpy(x) for x in inputs]
        source = self._translation_unit(arrays, list(output_dtypes), template)
        self.last_source = source
        if verbose:
            print(f"Generated source code for `{self.name}` (emulated):\n```\n{source[len(_PRELUDE):]}\n```")

        grid = tuple(int(g) for g in grid)
        tg = tuple(min(int(t), g) if g > 0 else int(t) for t, g in zip(threadgroup, grid))
        if len(grid) != 3 or len(tg) != 3:
            raise ValueError("grid and threadgroup must have three dimensions")
        if tg[0] * tg[1] * tg[2] > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(
                f"Thread group size ({tg[0] * tg[1] * tg[2]}) is greater than  the maximum allowed threads per "
                f"threadgroup ({MAX_THREADS_PER_THREADGROUP})."
            )
        if config.backend not in ("fibers", "threads"):
            raise ValueError(f"unknown emulator backend {config.backend!r}")

        keep = []
        ptrs = []
        for (arr, _), info in zip(arrays, self.shape_infos):
            keep.append(arr)
            ptrs.append(arr.ctypes.data)
            if arr.ndim > 0:
                extra = []
                if info[0]:
                    extra.append(np.array(arr.shape, dtype=np.int32))
                if info[1]:
                    extra.append(np.array([s // arr.itemsize for s in arr.strides], dtype=np.int64))
                if info[2]:
                    extra.append(np.array(arr.ndim, dtype=np.int32))
                for e in extra:
                    keep.append(e)
                    ptrs.append(e.ctypes.data)
        outs = [_filled(shape, dtype, init_value) for shape, dtype in zip(output_shapes, output_dtypes)]
        for o in outs:
            ptrs.append(o.ctypes.data)

        lib = _load_kernel(source)
        rt = _load_runtime()
        entry = ctypes.cast(lib.emu_entry, ctypes.c_void_p)
        args = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        err = ctypes.create_string_buffer(4096)
        rc = rt.emu_launch(
            entry,
            args,
            (ctypes.c_uint32 * 3)(*grid),
            (ctypes.c_uint32 * 3)(*tg),
            0 if config.backend == "fibers" else 1,
            int(config.workers),
            int(config.threadgroup_memory),
            err,
            len(err),
        )
        if rc != 0:
            raise EmulatorError(f"[metal_kernel emulator] {self.name}: {err.value.decode(errors='replace')}")
        return [_to_mx(o, dtype) for o, dtype in zip(outs, output_dtypes)]


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None) -> EmulatedKernel:
    """Drop-in for `mx.fast.metal_kernel` that runs the kernel on the CPU."""
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs,
                          compile_options)
