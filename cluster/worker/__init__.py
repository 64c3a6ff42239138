"""The worker: a continuous-batching MLX engine behind a gRPC server."""
