"""Network helpers shared by the router and the worker."""

from __future__ import annotations

# gRPC client channels: reconnect quickly after a peer or the network comes back (gRPC's
# default backoff starts at 1 s and grows to 120 s).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def parse_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """HOST:PORT (or [V6]:PORT) -> (host, port); an empty host is `default_host`."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]") or default_host, int(port)


def check_addresses(*addresses: str | None) -> None:
    """Raise ValueError for the first of `addresses` (None or empty: skipped) that is not HOST:PORT."""
    for address in addresses:
        if address:
            parse_address(address)
