"""The worker: a continuous-batching MLX engine behind a gRPC server.

Everything that runs MLX lives under this package, and importing it first makes MLX fast
on Linux: the system OpenBLAS is loaded before MLX so MLX's CPU matmuls use it (see
`cluster.platform`). A script that imports `mlx` itself imports `cluster.worker` first.
"""

import os as _os

from cluster import platform as _platform

# The C kernels and the OpenMP build of OpenBLAS run on libgomp's threads. A thread that
# reaches a barrier first spins before it sleeps, by default for ~300,000 turns (a few
# ms); on a CPU shared with other work it spun while the thread it waited for sat
# unscheduled, and every step took a core's time in spinning (beside a busy loop per
# core, 1-row steps 64-260 ms, 16-row ones 102-215 ms, each all CPU). 3,000 turns cover
# the gaps between a step's parallel loops on a quiet machine (no step slower than with
# the default) and waste little where the CPU is shared (83-96 ms and 105-116 ms, steady);
# sleeping at once (OMP_WAIT_POLICY=PASSIVE) made a quiet 16-row step 47 -> 59 ms.
# libgomp reads it once, when OpenBLAS loads it: set before `preload_blas`.
_os.environ.setdefault("GOMP_SPINCOUNT", "3000")
_platform.preload_blas()
