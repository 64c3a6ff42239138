"""The worker: a continuous-batching MLX engine behind a gRPC server.

Everything that runs MLX lives under this package, and importing it first makes MLX fast
on Linux: the system OpenBLAS is loaded before MLX so MLX's CPU matmuls use it (see
`cluster.platform`). A script that imports `mlx` itself imports `cluster.worker` first.
"""

import os as _os

from cluster import platform as _platform

# The C kernels and the OpenMP build of OpenBLAS run on libgomp's threads. A thread that
# reaches a barrier first spins before it sleeps, by default for ~300,000 turns; on a CPU
# shared with other work it spins while the thread it waits for sits unscheduled, and
# every step takes a core's time in spinning. 3,000 turns cover the gaps between a step's
# parallel loops on a quiet machine and waste little where the CPU is shared; sleeping at
# once (OMP_WAIT_POLICY=PASSIVE) slows a quiet step (`load/bench_engine.py` quiet and
# beside busy loops; MEASUREMENTS.md).
# libgomp reads it once, when OpenBLAS loads it: set before `preload_blas`.
_os.environ.setdefault("GOMP_SPINCOUNT", "3000")
_platform.preload_blas()
