"""The processes chat templates render in (`cluster/worker/chat_render.py` runs them).

`python -m cluster.chat_render_process FD MAX_CHARS MEMORY_BYTES` is a fork server: it
imports transformers once, then, for each FORK on its control socket (FD, a Unix socket
to the worker), forks a render process that serves the socket passed with it. A render
process renders with transformers' own `render_jinja_template`, so its text is byte for
byte what `apply_chat_template(tokenize=False)` gives; its address space is capped at its
size when forked plus MEMORY_BYTES (where the OS enforces RLIMIT_AS), so a template that
builds a huge string fails there with a MemoryError; a text over MAX_CHARS is refused
there. The worker kills a render process (SIGKILL, by its pid) whose render runs past its
deadline; the fork server reaps it when told (REAP), so its pid is never reused while the
worker may still kill it. Everything here exits when the worker goes away. Nothing of
Orchard's that loads a library is imported (not `cluster.worker`: no OpenBLAS here).

The control socket: the worker sends FORK (with one socket's descriptor) or REAP, each
followed by an 8-byte pid (0 for FORK); the fork server answers READY once at start and
the pid of each render process it forks. A render socket: a render is a 4-byte length and
the pickled keyword arguments of `render_jinja_template` (the worker is trusted); each
answer is one kind byte, a 4-byte length and UTF-8 text (surrogates passed through):
OK (the text), TOO_LARGE (its length), MEMORY, TYPE_ERROR or ERROR (the message).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time

FORK, REAP, READY = b"F", b"K", b"R"
OK, TOO_LARGE, MEMORY, TYPE_ERROR, ERROR = b"O", b"L", b"M", b"T", b"E"
COMMAND = struct.Struct(">cq")  # a command and a pid
PID = struct.Struct(">q")
HEADER = struct.Struct(">I")
ANSWER_HEADER = struct.Struct(">cI")
ORPHAN_CHECK_SECONDS = 0.5
MAX_MESSAGE_CHARS = 1000  # of an error's message (a template may put the whole chat in one)


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogatepass")


def _cap_memory(extra_bytes: int) -> None:
    """RLIMIT_AS at this process's size now plus `extra_bytes` (Linux: macOS does not
    enforce it, and there a render is bounded by its deadline alone)."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _exit_when_orphaned(parent: int) -> None:
    """A render in progress reads nothing: leave when the fork server is gone all the same."""
    while True:
        time.sleep(ORPHAN_CHECK_SECONDS)
        if os.getppid() != parent:
            os._exit(0)


def _read(stream, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _render(render, call: dict, max_chars: int) -> tuple[bytes, str]:
    try:
        text = render(**call)[0][0]
    except MemoryError:
        return MEMORY, ""
    except TypeError as e:
        return TYPE_ERROR, str(e)[:MAX_MESSAGE_CHARS]
    except Exception as e:  # the template's own error (raise_exception, a TemplateError, ...)
        return ERROR, (str(e) or type(e).__name__)[:MAX_MESSAGE_CHARS]
    if len(text) > max_chars:
        return TOO_LARGE, str(len(text))
    return OK, text


def serve_renders(sock: socket.socket, max_chars: int, memory_bytes: int) -> None:
    """A render process: renders what comes on `sock` until it closes."""
    from transformers.utils.chat_template_utils import render_jinja_template

    _cap_memory(memory_bytes)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    reader, writer = sock.makefile("rb"), sock.makefile("wb")
    while True:
        header = _read(reader, HEADER.size)
        data = header and _read(reader, HEADER.unpack(header)[0])
        if data is None:
            return
        kind, text = _render(render_jinja_template, pickle.loads(data), max_chars)
        answer = encode(text)
        writer.write(ANSWER_HEADER.pack(kind, len(answer)) + answer)
        writer.flush()


def _receive(control: socket.socket) -> tuple[bytes, int, list[int]] | None:
    data, fds = b"", []
    while len(data) < COMMAND.size:
        chunk, more, _, _ = socket.recv_fds(control, COMMAND.size - len(data), 1)
        if not chunk:
            return None
        data, fds = data + chunk, fds + list(more)
    return (*COMMAND.unpack(data), fds)


def serve_forks(control: socket.socket, max_chars: int, memory_bytes: int) -> None:
    """The fork server: forks render processes and reaps them, as the worker asks, until
    the worker closes the socket (or goes away); then kills them."""
    children: set[int] = set()
    try:
        control.sendall(READY)
        while (command := _receive(control)) is not None:
            kind, pid, fds = command
            if kind == FORK and len(fds) == 1:
                pid = os.fork()
                if pid == 0:
                    try:
                        control.close()
                        serve_renders(socket.socket(fileno=fds[0]), max_chars, memory_bytes)
                    finally:
                        os._exit(0)
                os.close(fds[0])
                children.add(pid)
                control.sendall(PID.pack(pid))
            elif kind == REAP and pid in children:
                children.discard(pid)
                _kill(pid)
                os.waitpid(pid, 0)
            else:
                for fd in fds:
                    os.close(fd)
    except OSError:  # the worker is gone
        pass
    for pid in children:
        _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> None:
    fd, max_chars, memory_bytes = (int(a) for a in argv)
    os.dup2(2, 1)  # whatever a library prints goes to stderr
    from transformers.utils import chat_template_utils  # noqa: F401  (imported once, shared by every fork)

    serve_forks(socket.socket(fileno=fd), max_chars, memory_bytes)


if __name__ == "__main__":
    main(sys.argv[1:])
