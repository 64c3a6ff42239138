"""Network helpers shared by the router and the worker."""

from __future__ import annotations

# gRPC client channels: reconnect quickly after a peer or the network comes back (gRPC's
# default backoff starts at 1 s and grows to 120 s).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

