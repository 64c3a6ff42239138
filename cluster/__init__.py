"""Orchard: serve LLMs from a fleet of Macs.

Importing `cluster` (or its SDK, `cluster.sdk`) has no side effects. The processes that
run MLX import `cluster.worker` first, which loads OpenBLAS before MLX (see
`cluster.platform`).
"""

__version__ = "0.1.0"
