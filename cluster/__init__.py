"""Orchard: serve LLMs from a fleet of Macs.

Importing any part of `cluster` first makes MLX fast on Linux: the system OpenBLAS is
loaded before MLX so MLX's CPU matmuls use it (see `cluster.platform`).
"""

from cluster import platform as _platform

_platform.preload_blas()

__version__ = "0.1.0"
