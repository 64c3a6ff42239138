"""Orchard: serve LLMs from a fleet of Macs.

Importing `cluster` (or its SDK, `cluster.sdk`) has no side effects. The processes that run
MLX call `cluster.platform.preload_blas()` first, which loads OpenBLAS before MLX.
"""

__version__ = "0.1.0"
