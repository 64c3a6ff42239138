"""The worker: a continuous-batching MLX engine behind a gRPC server.

Everything that runs MLX lives under this package, and importing it first makes MLX fast
on Linux: the system OpenBLAS is loaded before MLX so MLX's CPU matmuls use it (see
`cluster.platform`). A script that imports `mlx` itself imports `cluster.worker` first.
"""

import os as _os

from cluster import platform as _platform

_platform.preload_blas()
# The C kernels (and the OpenMP build of OpenBLAS) run on libgomp's threads, which spin
# when idle by default, stealing the cores from MLX's own thread between them (measured:
# a decode step no faster with spinning, and far slower beside a pthread OpenBLAS). Read
# once when libgomp loads: set it first.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
