"""The worker: a continuous-batching MLX engine behind a gRPC server.

Everything that runs MLX lives under this package, and importing it first makes MLX fast
on Linux: the system OpenBLAS is loaded before MLX so MLX's CPU matmuls use it (see
`cluster.platform`). A script that imports `mlx` itself imports `cluster.worker` first.
"""

import os as _os

from cluster import platform as _platform

_platform.preload_blas()
# The CPU attention kernel uses OpenMP; libgomp's idle threads spin by default, stealing
# the cores from OpenBLAS between layers. Read once when libgomp loads: set it first.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
