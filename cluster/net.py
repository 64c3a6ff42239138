"""Network helpers shared by the router and the worker."""

from __future__ import annotations

import ipaddress
import socket

from cluster.api.limits import GRPC_MAX_MESSAGE_BYTES

# Keepalive: a peer that stops answering HTTP/2 pings (a Mac asleep, a process stopped,
# a cable pulled) is found within KEEPALIVE_TIME + KEEPALIVE_TIMEOUT, even mid-stream and
# while the TCP connection looks open, and its calls fail UNAVAILABLE instead of hanging.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# gRPC client channels: keepalive, and reconnect quickly after a peer or the network comes
# back (gRPC's default backoff starts at 1 s and grows to 120 s). Not
# grpc.min_reconnect_backoff_ms: gRPC takes it as the minimum *connect timeout* too
# (default 20 s), and at 100 ms a busy server's handshake fails the call with "connection
# attempt timed out before receiving SETTINGS frame".
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # the servers' message limit both ways (gRPC's client default is 4 MB to receive): what a
    # server sends, its client takes
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
]
# gRPC servers: accept the clients' keepalive pings (by default a server answers pings
# more often than every 5 minutes with GOAWAY "too_many_pings": a call that waits with
# nothing to send, such as a request the router holds for a worker of its model, was cut
# after a few of its client's pings), and ping idle clients. A peer pinging faster than
# that still draws strikes (gRPC's ping-flood protection stays on). The argument's name is
# gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS.
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 2 * KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
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


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name, [V6] too) is this machine's loopback only:
    reachable from no other machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports (held open together while they are picked: one at a time,
    the OS may hand out the same port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
