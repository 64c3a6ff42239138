"""The processes chat templates render in (`cluster/worker/chat_render.py` runs them).

`python -m cluster.chat_render_process FD MAX_CHARS MEMORY_BYTES` is a fork server: it
imports transformers once, then, for each FORK on its control socket (FD, a Unix socket
to the worker), forks a render process that serves the socket passed with it. A render
process renders with transformers' own `render_jinja_template`, so its text is byte for
byte what `apply_chat_template(tokenize=False)` gives; its address space is capped at its
size when forked plus MEMORY_BYTES (where the OS enforces RLIMIT_AS), so a template that
builds a huge string fails there with a MemoryError; a text over MAX_CHARS is refused
there. The template runs in transformers' sandbox with sizes bounded (`sized_sandbox`): a
string or list that `*`, `+`, `~` or `**` would make longer than MAX_CHARS is refused
before it is built, so a template cannot take the machine's memory where RLIMIT_AS is not
enforced (macOS). The worker kills a render process (SIGKILL, by its pid) whose render runs past its
deadline; the fork server reaps it when told (REAP), so its pid is never reused while the
worker may still kill it. Everything here exits when the worker goes away. Nothing of
Orchard's that loads a library is imported (not `cluster.worker`: no OpenBLAS here).

The control socket: the worker sends FORK (with one socket's descriptor) or REAP, each
followed by an 8-byte pid (0 for FORK); the fork server answers READY once at start and
the pid of each render process it forks; one that cannot start (transformers without
`render_jinja_template`) answers FAILED, a 4-byte length and the reason, and exits. A
render socket: a render is a 4-byte length and the pickled keyword arguments of
`render_jinja_template` (the worker is trusted); each answer is one kind byte, a 4-byte
length and UTF-8 text (surrogates passed through): OK (the text), TOO_LARGE (its length),
OVERSIZED (the size of the value refused), MEMORY, TYPE_ERROR or ERROR (the message).
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

FORK, REAP, READY, FAILED = b"F", b"K", b"R", b"X"
OK, TOO_LARGE, OVERSIZED, MEMORY, TYPE_ERROR, ERROR = b"O", b"L", b"S", b"M", b"T", b"E"
COMMAND = struct.Struct(">cq")  # a command and a pid
PID = struct.Struct(">q")
HEADER = struct.Struct(">I")
ANSWER_HEADER = struct.Struct(">cI")
ORPHAN_CHECK_SECONDS = 0.5
MAX_MESSAGE_CHARS = 1000  # of an error's message (a template may put the whole chat in one)
DIGITS_PER_BIT = 0.30103  # log10(2): an integer's size, as text, from its bits


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


class Oversized(Exception):
    """A value the template would build is over the size limit (its size in characters)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


class TooLong(Exception):
    """The rendered text is over the size limit (counted before it is joined)."""


def _size(value) -> int:
    """What `value` holds, in characters: a string's length; a list's or tuple's items, a
    string among them counted by its length (so joining it is bounded too); an integer's
    decimal digits; 0 for anything else."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(len(v) if isinstance(v, str) else 1 for v in value)
    if isinstance(value, int):
        return int(value.bit_length() * DIGITS_PER_BIT)
    return 0


def _product_size(operator: str, left, right) -> int:
    """The size of `left operator right`, known before it is built."""
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            return int((left.bit_length() + right.bit_length()) * DIGITS_PER_BIT)
        if isinstance(right, int):
            return _size(left) * max(right, 0)
        return _size(right) * max(left, 0) if isinstance(left, int) else 0
    if operator == "+":
        return _size(left) + _size(right) if isinstance(left, (str, list, tuple)) else 0
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return int(max(left.bit_length() - 1, 0) * right * DIGITS_PER_BIT)
    return 0


def sized_sandbox(max_chars: int):
    """transformers' sandbox (ImmutableSandboxedEnvironment), with every `*`, `+`, `**` and
    `~`, and a string's or list's method given a number over `max_chars` (`'x'.ljust(n)`),
    checked first: one that would build a value over `max_chars` raises `Oversized`;
    and a rendered text's pieces counted as they come: past `max_chars`, `TooLong` before
    they are joined. What it builds otherwise is what the plain sandbox builds."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class SizedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:  # `a ~ b`: Jinja's own join, of parts checked first
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"{join}(environment.checked_parts((")
            for part in node.nodes:
                self.visit(part, frame)
                self.write(", ")
            self.write(")))")

    class SizedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = SizedCodeGenerator
        intercepted_binops = frozenset({"*", "+", "**"})

        def call_binop(self, context, operator, left, right):
            if (size := _product_size(operator, left, right)) > max_chars:
                raise Oversized(size)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (the sandbox's own spelling)
            # a string's or list's method given a size ('x'.ljust(n), 'x'.center(n), 'x'.zfill(n))
            if isinstance(getattr(__obj, "__self__", None), (str, list, tuple)):
                for arg in (*args, *kwargs.values()):
                    if isinstance(arg, int) and arg > max_chars:
                        raise Oversized(arg)
            return super().call(__context, __obj, *args, **kwargs)

        def concat(self, pieces) -> str:  # what Template.render joins its output with
            kept, size = [], 0
            for piece in pieces:
                size += len(piece)
                if size > max_chars:
                    raise TooLong()
                kept.append(piece)
            return "".join(kept)

        def checked_parts(self, parts: tuple) -> tuple:
            if (size := sum(len(p) if isinstance(p, str) else _size(p) for p in parts)) > max_chars:
                raise Oversized(size)
            return parts

    return SizedSandbox


def _bound_sizes(max_chars: int) -> None:
    """Make transformers compile chat templates in `sized_sandbox` (its compile step
    builds the environment from this module-level name). ImportError naming what is
    missing where this transformers renders another way."""
    from transformers.utils import chat_template_utils

    chat_template_utils.ImmutableSandboxedEnvironment = sized_sandbox(max_chars)
    if not isinstance(chat_template_utils._compile_jinja_template("{{ 1 }}").environment,
                      chat_template_utils.ImmutableSandboxedEnvironment):
        raise ImportError("this transformers compiles chat templates without its ImmutableSandboxedEnvironment: "
                          "render sizes cannot be bounded")


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
    except Oversized as e:
        return OVERSIZED, str(e.size)
    except TooLong:
        return TOO_LARGE, f"more than {max_chars}"
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
    control = socket.socket(fileno=fd)
    try:
        # imported once, shared by every fork
        from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401

        _bound_sizes(max_chars)
    except Exception as e:  # an older transformers, a broken install: the worker says so, once
        reason = encode(" ".join(f"{type(e).__name__}: {e}".split())[:MAX_MESSAGE_CHARS])
        control.sendall(FAILED + HEADER.pack(len(reason)) + reason)
        sys.exit(1)
    serve_forks(control, max_chars, memory_bytes)


if __name__ == "__main__":
    main(sys.argv[1:])
