"""Facts about the machine that change how Orchard runs MLX.

- Linux: MLX's CPU wheel links a slow reference BLAS. Loading OpenBLAS with RTLD_GLOBAL
  *before* the first `import mlx` makes MLX's fp32 matmuls about 25x faster.
  `preload_blas()` does that. Each entry point of a process that runs MLX calls it before
  anything imports MLX: the CLI's MLX commands, `create_model`, `orchard bench`, the Ray
  worker actors, the tests' conftest, the load/ scripts. Importing a module never does (the
  SDK and the router never load it). The OpenMP build (Debian's `libopenblas0-openmp`)
  comes first: its worker threads are libgomp's, which go to sleep soon after they go idle
  (GOMP_SPINCOUNT, set by `preload_blas`) like the threads of Orchard's C kernels. The pthread build's workers
  spin after every call, taking the cores from the C kernels and MLX's own thread that
  run between the matmuls, so a decode step is slower with it (MEASUREMENTS.md).
- On the CPU, fp16/bf16 matmuls do not go through BLAS and are slow: run fp32 there
  (`compute_dtype`).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

# Where distributions put OpenBLAS. Searched one directory level each, never recursively:
# a walk of /usr/lib took over 10 minutes on one machine (issue 26). The OpenMP builds
# come first (see above).
OPENBLAS_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/opt/OpenBLAS/lib",
)
LDCONFIG_TIMEOUT_S = 5.0

_blas_state: dict = {"tried": False, "path": None, "lib": None, "looked": ""}


def find_openblas() -> str | None:
    """OpenBLAS's shared library, in bounded time: $ORCHARD_OPENBLAS if set (and nothing
    else), else `libopenblas*.so*` in OPENBLAS_DIRS and their `openblas*/` subdirectories,
    else the loader's cache (`ldconfig -p`). The OpenMP build first. None if none of them has it."""
    env = os.environ.get("ORCHARD_OPENBLAS")
    if env:
        _blas_state["looked"] = f"ORCHARD_OPENBLAS={env} (no such file)"
        return env if os.path.exists(env) else None
    found = []
    for d in OPENBLAS_DIRS:
        found += glob.glob(os.path.join(d, "openblas*", "libopenblas*.so*")) + glob.glob(
            os.path.join(d, "libopenblas*.so*"))
    found = found or _ldconfig_openblas()
    _blas_state["looked"] = f"{', '.join(OPENBLAS_DIRS)} and the loader's cache (ldconfig -p)"
    return min(found, key=lambda p: ("openmp" not in p, ".so.0" not in p, p)) if found else None


def _ldconfig_openblas() -> list[str]:
    """The loader cache's OpenBLAS libraries (as `ctypes.util.find_library` reads it, with a timeout)."""
    for ldconfig in ("/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=LDCONFIG_TIMEOUT_S).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        return [line.rsplit("=>", 1)[1].strip() for line in out.splitlines()
                if "libopenblas" in line and "=>" in line]
    return []


# The C kernels and the OpenMP build of OpenBLAS run on libgomp's threads. A thread that
# reaches a barrier first spins before it sleeps, by default for ~300,000 turns; on a CPU
# shared with other work it spins while the thread it waits for sits unscheduled, and
# every step takes a core's time in spinning. 3,000 turns cover the gaps between a step's
# parallel loops on a quiet machine and waste little where the CPU is shared; sleeping at
# once (OMP_WAIT_POLICY=PASSIVE) slows a quiet step (`load/bench_engine.py` quiet and
# beside busy loops; MEASUREMENTS.md).
GOMP_SPINCOUNT = "3000"


def preload_blas() -> str | None:
    """Load OpenBLAS globally before MLX (Linux only; a no-op after the first call). Call
    it before anything in the process imports MLX.
    It also sets GOMP_SPINCOUNT (unless set), which libgomp reads once, when it loads.
    Returns the path loaded, if any."""
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    if _blas_state["tried"] or not sys.platform.startswith("linux"):
        return _blas_state["path"]
    _blas_state["tried"] = True
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before preload_blas: OpenBLAS cannot speed up its matmuls now")
        return None
    path = find_openblas()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError as e:  # pragma: no cover - broken install
        log.warning("could not load OpenBLAS from %s: %s", path, e)
        return None
    _blas_state["path"], _blas_state["lib"] = path, lib
    return path


def blas_path() -> str | None:
    return _blas_state["path"]


def blas_library() -> ctypes.CDLL | None:
    """The OpenBLAS `preload_blas` loaded (the library MLX's CPU matmuls call), if any."""
    return _blas_state["lib"]


def warn_if_slow_blas() -> None:
    """The worker calls this at start-up: on Linux without OpenBLAS, say how to fix it."""
    if sys.platform.startswith("linux") and _blas_state["path"] is None:
        looked = _blas_state["looked"] or "nowhere: preload_blas ran after MLX was imported, or not at all"
        log.warning(
            "OpenBLAS is not loaded (looked in %s): MLX's CPU matmuls will be ~25x slower. Install it with "
            "`apt-get install libopenblas0-openmp` (or set ORCHARD_OPENBLAS=/path/libopenblas.so.0).", looked)


def available_memory() -> int:
    """Bytes of RAM a new allocation can have: Linux's MemAvailable; on macOS the free,
    speculative and file-backed pageable pages (what `vm_stat` shows as reclaimable); else
    the free pages, else all of RAM (an upper bound keeps a size check on); 0: unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "darwin":
        page = darwin_sysctl("hw.pagesize") or 16384
        counts = [darwin_sysctl(f"vm.page_{k}_count") for k in ("free", "speculative", "pageable_external")]
        if counts[0] is not None:
            return page * sum(c or 0 for c in counts)
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)
        except (ValueError, OSError, AttributeError):
            continue
    return 0


METAL_PROBE_TIMEOUT_S = 60.0  # importing MLX for the first time after an install compiles its caches


def metal_working_set() -> int | None:
    """Metal's recommended working set (`max_recommended_working_set_size`: the memory the
    GPU can use) on a Mac with Metal, else None. Asked of a short-lived Python, so that the
    caller (the node agent) never imports MLX."""
    if sys.platform != "darwin":
        return None
    probe = ("import mlx.core as mx; print(int(mx.device_info()['max_recommended_working_set_size']) "
             "if mx.metal.is_available() else 0)")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=METAL_PROBE_TIMEOUT_S, check=True).stdout
        return int(out.strip()) or None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def darwin_sysctl(name: str) -> int | None:
    """An integer sysctl of macOS (sysctlbyname), None where it is not there."""
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        value, size = ctypes.c_uint64(0), ctypes.c_size_t(8)
        if libc.sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)):
            return None
    except (OSError, AttributeError):
        return None
    return value.value & ((1 << (8 * size.value)) - 1)  # a 4-byte value fills the low half


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (0 where /proc is not there)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_memory() -> int:
    """This process's resident memory now, for its load report: its RSS (Linux:
    /proc/self/statm; macOS: the task's resident size), plus, on Metal, MLX's active
    memory, which lives in Metal buffers outside it. 0: unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    if sys.platform != "darwin":
        return 0
    rss = _darwin_resident_bytes()
    if not rss:  # the peak, where the current size cannot be read
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    if has_metal():
        import mlx.core as mx

        rss += mx.get_active_memory()
    return rss


class _MachTaskBasicInfo(ctypes.Structure):  # <mach/task_info.h>'s mach_task_basic_info
    _fields_ = [("virtual_size", ctypes.c_uint64), ("resident_size", ctypes.c_uint64),
                ("resident_size_max", ctypes.c_uint64), ("user_time", ctypes.c_int32 * 2),
                ("system_time", ctypes.c_int32 * 2), ("policy", ctypes.c_int32), ("suspend_count", ctypes.c_int32)]


MACH_TASK_BASIC_INFO = 20  # the flavor of task_info that fills it


def _darwin_resident_bytes() -> int:
    """macOS: this task's resident size now (task_info, as `ps` and psutil read it); 0 where
    it cannot be read."""
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        task = ctypes.c_uint32.in_dll(libc, "mach_task_self_")  # what mach_task_self() returns
        info = _MachTaskBasicInfo()
        count = ctypes.c_uint32(ctypes.sizeof(info) // 4)
        if libc.task_info(task, MACH_TASK_BASIC_INFO, ctypes.byref(info), ctypes.byref(count)):
            return 0
    except (OSError, AttributeError, ValueError):
        return 0
    return int(info.resident_size)


def _glibc_function(name: str, argtypes: list):
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


_MALLOC_TRIM = _glibc_function("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int])
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
LARGE_BLOCK_BYTES = 128 << 10  # glibc's own default threshold, kept fixed


def give_back_large_blocks_when_freed() -> None:
    """Have glibc map each block of LARGE_BLOCK_BYTES or more on its own and unmap it when
    it is freed. Its default threshold moves up to the largest block freed (up to 32 MiB),
    and from then on such blocks come from a heap: one freed at the top of a thread's arena
    (where grpc's threads receive each message) stays resident for good, since
    malloc_trim gives back the main heap's top but no thread arena's. A process that had
    received a few large messages stayed that much larger. Call it at start-up, before the
    threads; a no-op where the allocator is not glibc's."""
    if _MALLOPT is not None:
        _MALLOPT(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)


def can_give_back_freed_memory() -> bool:
    """Whether `give_back_freed_memory` does anything here (glibc, with /proc to see it)."""
    return _MALLOC_TRIM is not None and os.path.exists("/proc/self/statm")


def give_back_freed_memory() -> None:
    """Return to the system what the C allocator holds freed: glibc's malloc_trim(0), which
    also releases the free pages in the middle of its heaps (glibc keeps them for good
    otherwise: a process stays as large as its largest burst). Milliseconds for a heap of
    hundreds of MB. A no-op where the allocator is not glibc's (macOS's returns freed
    memory by itself)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def has_metal() -> bool:
    import mlx.core as mx

    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


def default_max_num_batched_tokens() -> int:
    """The step token budget when none is given: 2048 on Metal (the contract), 512 on the
    CPU, where a 2048-token step stalls every running stream and the first token of every
    prompt in it for long; 512-token steps keep the throughput and cut the mean time to
    first token (load/bench_worker_vs_mlx.py; MEASUREMENTS.md)."""
    return 2048 if has_metal() else 512


def compute_dtype(model_dtype):
    """fp32 on the CPU (fp16/bf16 matmuls skip BLAS there); the model's own dtype on Metal."""
    import mlx.core as mx

    return model_dtype if has_metal() else mx.float32
