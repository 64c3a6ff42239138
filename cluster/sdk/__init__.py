"""Orchard's Python SDK: `Client` / `AsyncClient` over gRPC (a worker or the router)."""

from cluster.sdk.client import DEFAULT_TARGET, AsyncClient, Client, GrpcBackend
from cluster.api.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    NotFound,
    OrchardError,
    Overloaded,
    Unavailable,
)
from cluster.api.wire import build_request
from cluster.sdk.types import Chunk, Completion, Embeddings, Ranked, TokenLogprob, ToolCall, Usage

__all__ = [
    "DEFAULT_TARGET", "AsyncClient", "Client", "GrpcBackend",
    "OrchardError", "InvalidRequest", "NotFound", "AlreadyExists", "Overloaded", "Unavailable",
    "DeadlineExceeded", "Cancelled", "InternalError",
    "Chunk", "Completion", "Embeddings", "Ranked", "TokenLogprob", "ToolCall", "Usage", "build_request",
]
