"""The worker: a continuous-batching MLX engine behind a gRPC server.

Everything that runs MLX lives under this package. Importing it loads nothing: a process
that runs MLX calls `cluster.platform.preload_blas()` first (see `cluster.platform`).
"""
