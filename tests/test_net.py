"""gRPC channel options against a slow peer: a server whose HTTP/2 handshake answers late
(a busy Mac, a loaded CI machine) is still reached."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.net import CHANNEL_OPTIONS


def _slow_relay(target_port: int, delay: float) -> tuple[socket.socket, int]:
    """A TCP relay to 127.0.0.1:target_port that holds the server's first bytes (its
    SETTINGS frame) for `delay` seconds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def pipe(src, dst, hold):
        try:
            first = True
            while data := src.recv(65536):
                if first and hold:
                    time.sleep(delay)
                first = False
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", target_port))
            threading.Thread(target=pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=pipe, args=(server, client, True), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener, listener.getsockname()[1]


def test_a_late_handshake_still_connects():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener, relay = _slow_relay(port, delay=1.5)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{relay}", options=CHANNEL_OPTIONS) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        listener.close()
        server.stop(0)
