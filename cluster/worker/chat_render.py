"""Chat templates rendered where a render can be abandoned: a small pool of warm child
processes (`cluster/chat_render_process.py`: forked from one fork server that has
transformers imported, so a process is replaced in milliseconds), each render within a
time, size and memory limit.

A chat template is code from the model's files (GGUF metadata, chat_template.jinja,
tokenizer_config.json). Jinja's sandbox keeps it from doing harm, not from running for
ever or building a huge string, and a Python thread cannot be stopped. So the worker
renders it in a child process: a render past `chat_template_timeout` has its process
killed (SIGKILL) and replaced, and its request refused (400); a child's address space is
capped (`chat_template_memory_mb`); a text over `max_chat_template_chars` is refused in
the child, before it reaches the worker. The text is transformers' own rendering
(`render_jinja_template`), byte for byte what `apply_chat_template(tokenize=False)` gives;
tokenizing it stays in the worker, on the tokenizer's thread pool, which stuck renders
therefore never hold.

The template itself runs in a sandbox that refuses, before building it, any string or list
over `max_chat_template_chars` (`chat_render_process.sized_sandbox`): memory is bounded
where RLIMIT_AS is not enforced too.

The pool is `stuck` (the worker reports itself unhealthy, so the router places nothing
there) while no child can be started, or while probe renders fail: once
`unhealthy_after_template_timeouts` renders in a row ran out of time, a probe render (the
model's template on a one-line chat) runs at once, and only if it too runs out of time is
the pool stuck, until a probe finishes in time. Chats that time out because of what a
client sent (a long history through a quadratic template) therefore never take the worker
out of service. A fork that is slow (a loaded machine) delays that one start alone; a
render whose process ended under it (not by its deadline) is tried once more on another.
A request that goes away leaves its render to finish, within its deadline, on its child.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import socket
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import cluster
from cluster.api.errors import InvalidRequest, OrchardError, Unavailable
from cluster.chat_render_process import (ANSWER_HEADER, COMMAND, FAILED, FORK, HEADER, MEMORY, OK, OVERSIZED, PID,
                                         READY, REAP, TOO_LARGE, TYPE_ERROR, decode)
from cluster.config import setting

log = logging.getLogger(__name__)

MIN_TRANSFORMERS = "4.52"  # the first release with render_jinja_template
START_TIMEOUT_SECONDS = 120.0  # the fork server's start (Python and transformers' import) on a loaded machine
FORK_TIMEOUT_SECONDS = 30.0  # a fork slower than this is logged (and waited for)
CLOSE_TIMEOUT_SECONDS = 5.0
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)  # between failed starts
PROBE_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)  # between probes while probes fail
PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]
# A probe that needs no model template: the pool itself renders.
PLAIN_PROBE = {"conversations": [PROBE_MESSAGES], "chat_template": "{{ messages[0]['content'] }}"}
TIMED_OUT, DIED = b"t", b"d"  # the pool's own outcomes beside the child's answers


@dataclass(frozen=True)
class ChatTemplateLimits:
    """How long and how large a chat template's render may be, and where it runs."""

    chat_template_timeout: float = setting(
        5.0, "a chat template's render that takes longer is stopped (its process killed and replaced) and its "
             "request refused (400)", metavar="SECONDS")
    max_chat_template_chars: int = setting(
        8_000_000, "a chat template's rendered prompt longer than this many characters is refused (400)",
        metavar="CHARS")
    chat_template_memory_mb: int = setting(
        256, "memory a chat template's render may take, in MiB: its process's address space past its start-up "
             "size (where the OS enforces RLIMIT_AS: Linux)", metavar="MIB")
    chat_template_processes: int = setting(
        4, "processes that render chat templates at once (kept warm, forked from one Python with transformers "
           "imported)", metavar="N")
    unhealthy_after_template_timeouts: int = setting(
        3, "after this many chat-template renders in a row past --chat-template-timeout, a probe render (the "
           "model's template on a one-line chat) runs at once; if it too runs out of time, the worker reports "
           "itself unhealthy (the router places nothing there) until a probe finishes in time", metavar="N")

    def check(self) -> None:
        """ValueError naming the flag for a value no render could run under."""
        for name, value, least in (("chat-template-timeout", self.chat_template_timeout, 0.001),
                                   ("max-chat-template-chars", self.max_chat_template_chars, 1),
                                   ("chat-template-memory-mb", self.chat_template_memory_mb, 16),
                                   ("chat-template-processes", self.chat_template_processes, 1),
                                   ("unhealthy-after-template-timeouts", self.unhealthy_after_template_timeouts, 1)):
            if not value >= least:
                raise ValueError(f"--{name} must be at least {least:g}, not {value:g}")


def check_renderer() -> None:
    """ValueError (one line) unless the installed transformers has the renderer the render
    processes use."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401
    except ImportError as e:
        raise ValueError(f"chat templates render with transformers' render_jinja_template, which this install "
                         f"lacks ({' '.join(str(e).split())}): pip install 'transformers>={MIN_TRANSFORMERS}'"
                         ) from None


def jinja_tokenizer(tokenizer):
    """The Hugging Face tokenizer whose Jinja chat template renders `tokenizer`'s chats, or
    None where it has no template or renders chats its own way (mlx-lm's Python chat
    templates, a tokenizer class with its own apply_chat_template): trusted code, which
    the worker runs in-process."""
    base = sys.modules.get("transformers.tokenization_utils_base")  # loaded with any of its tokenizers
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF one
    if base is None or not isinstance(hf, base.PreTrainedTokenizerBase):
        return None
    own = type(hf).apply_chat_template is not base.PreTrainedTokenizerBase.apply_chat_template
    if own or getattr(tokenizer, "_chat_template", None) is not None or not hf.chat_template:
        return None
    return hf


# render_jinja_template's own parameters: a template variable of the same name cannot pass.
RENDER_PARAMETERS = frozenset({"conversations", "tools", "documents", "chat_template", "return_assistant_tokens_mask",
                               "continue_final_message", "add_generation_prompt"})


def render_call(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                kwargs: dict | None = None) -> dict:
    """The arguments of transformers' `render_jinja_template` that
    `tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
    tokenize=False, **kwargs)` renders with (`tokenizer`: one `jinja_tokenizer` accepts).
    ValueError where it would fail before rendering (no template for these tools, a
    variable named as one of the parameters)."""
    hf = jinja_tokenizer(tokenizer)
    kwargs = dict(kwargs or {})
    if clash := sorted(RENDER_PARAMETERS & kwargs.keys()):
        raise ValueError(f"{clash[0]!r} is not a template variable a request may set")
    if getattr(tokenizer, "_thinking_kwarg", None) == "enable_thinking":  # mlx-lm's wrapper says if the model thinks
        kwargs.setdefault("enable_thinking", tokenizer.has_thinking)
    return {"conversations": [messages], "tools": tools, "chat_template": hf.get_chat_template(None, tools),
            "add_generation_prompt": True, **hf.special_tokens_map, **kwargs}


class TemplateTypeError(InvalidRequest):
    """The template raised a TypeError (one that reads a call's arguments as text does)."""


class _Child:
    """One render process: its pid (the fork server's child) and its socket."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: "_ForkServer"):
        self.pid, self.reader, self.writer, self.server = pid, reader, writer, server
        self.killed = False

    async def exchange(self, payload: bytes) -> tuple[bytes, str]:
        self.writer.write(HEADER.pack(len(payload)) + payload)
        await self.writer.drain()
        kind, size = ANSWER_HEADER.unpack(await self.reader.readexactly(ANSWER_HEADER.size))
        return kind, decode(await self.reader.readexactly(size))


class _ForkServer:
    """The process that forks render processes (`cluster.chat_render_process`): started
    once (a Python with transformers imported), then each render process costs a fork."""

    def __init__(self, proc: asyncio.subprocess.Process, control: socket.socket):
        self.proc, self.control = proc, control
        self._lock = asyncio.Lock()  # one command at a time on the control socket

    @classmethod
    async def start(cls, limits: ChatTemplateLimits) -> "_ForkServer":
        root = str(Path(cluster.__file__).resolve().parents[1])  # it imports this same package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")  # not its notes at every start
        control, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cluster.chat_render_process", str(theirs.fileno()),
                str(limits.max_chat_template_chars), str(limits.chat_template_memory_mb << 20),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                env=env)
        except BaseException:
            control.close()
            raise
        finally:
            theirs.close()
        control.setblocking(False)
        server = cls(proc, control)
        try:
            ready = await server._recv(1)
            if ready == FAILED:
                size = HEADER.unpack(await server._recv(HEADER.size))[0]
                raise ValueError(f"the fork server cannot start: {decode(await server._recv(size))}")
            if ready != READY:
                raise ValueError(f"the fork server exited ({await proc.wait()}) before it was ready")
        except BaseException:
            await server.close()
            raise
        return server

    async def fork(self) -> _Child:
        mine, theirs = socket.socketpair()
        try:
            async with self._lock:
                socket.send_fds(self.control, [COMMAND.pack(FORK, 0)], [theirs.fileno()])
                data = await self._recv(PID.size)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        if len(data) < PID.size:
            mine.close()
            raise ConnectionError("the fork server is gone")
        reader, writer = await asyncio.open_connection(sock=mine)
        return _Child(PID.unpack(data)[0], reader, writer, self)

    def kill(self, child: _Child) -> None:
        """SIGKILL `child` by its pid: still the fork server's unreaped child (it reaps
        only when told), so never another process's."""
        if not child.killed and self.alive:
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        child.killed = True

    async def reap(self, child: _Child) -> None:
        """Kill `child` (if it is not yet), then have the fork server reap it."""
        self.kill(child)
        child.writer.close()
        if not self.alive:
            return  # its render processes went with it
        try:
            async with self._lock:
                await asyncio.get_running_loop().sock_sendall(self.control, COMMAND.pack(REAP, child.pid))
        except OSError:
            pass

    async def _recv(self, n: int) -> bytes:
        loop, data = asyncio.get_running_loop(), b""
        while len(data) < n:
            chunk = await loop.sock_recv(self.control, n - len(data))
            if not chunk:
                break
            data += chunk
        return data

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and self.control.fileno() >= 0

    async def close(self) -> None:
        """Close its socket: it kills its render processes and exits (killed if it does not)."""
        self.control.close()
        try:
            await asyncio.wait_for(self.proc.wait(), CLOSE_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


class RenderPool:
    """`chat_template_processes` warm render processes. `start()` (in the running loop)
    starts them in the background; `render(call)` waits for a free one (a chat waits for
    the one before it, never for a thread) and returns the text or raises an
    `OrchardError`: InvalidRequest for what the template did with these messages
    (`TemplateTypeError` for a TypeError), Unavailable while no process can be started.
    `probe_call`: what a probe renders (default: a template-free one)."""

    def __init__(self, limits: ChatTemplateLimits = ChatTemplateLimits(), probe_call: dict | None = None):
        limits.check()
        self.limits = limits
        self.probe_call = probe_call or PLAIN_PROBE
        self._server: _ForkServer | None = None
        self._server_lock = asyncio.Lock()
        self._children: set[_Child] = set()  # forked and not killed: idle or rendering
        self._idle: list[_Child] = []
        self._waiters: deque[asyncio.Future] = deque()
        self._starting = 0
        self._start_error = ""  # why the last start failed ('' once one succeeds)
        self._timeouts_in_a_row = 0
        self._probe_failure = ""  # why the last probe failed ('' once a render finishes in time)
        self.rendering = 0  # renders in progress
        self._tasks: set[asyncio.Task] = set()
        self._probing: asyncio.Task | None = None
        self._closed = False

    # -- health ---------------------------------------------------------------------------
    @property
    def stuck(self) -> str:
        """Why renders cannot be served now ('' when they can)."""
        if not self._children and self._start_error:
            return f"no chat-template render process can be started ({self._start_error})"
        return self._probe_failure

    @property
    def probing(self) -> bool:
        """A probe render is due or running (renders ran out of time in a row)."""
        return self._probing is not None and not self._probing.done()

    @property
    def pids(self) -> list[int]:
        """The render processes' ids (tests)."""
        return sorted(c.pid for c in self._children)

    @property
    def idle_pids(self) -> list[int]:
        """The idle render processes' ids (tests)."""
        return sorted(c.pid for c in self._idle)

    @property
    def fork_server_pid(self) -> int | None:
        """The fork server's process id (tests)."""
        return self._server.proc.pid if self._server is not None else None

    # -- life -----------------------------------------------------------------------------
    def start(self) -> None:
        self._fill()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for child in self._children:
            child.writer.close()
        self._children.clear()
        self._idle.clear()
        self._fail_waiters(Unavailable("the worker is stopping: it renders no more chat templates"))
        if self._server is not None:
            await self._server.close()

    # -- rendering -------------------------------------------------------------------------
    async def render(self, call: dict) -> str:
        payload = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        kind, text = await self._submit(payload)
        if kind == DIED:  # not by its deadline: its fork server may have gone, as likely as the template did it
            kind, text = await self._submit(payload)
        if kind == OK:
            return text
        raise self._refusal(kind, text)

    async def _submit(self, payload: bytes) -> tuple[bytes, str]:
        child = await self._acquire()
        # Held by the pool: a request that goes away leaves it to end (by its deadline at the latest).
        return await asyncio.shield(self._background(self._run(child, payload)))

    def _refusal(self, kind: bytes, text: str) -> OrchardError:
        lim = self.limits
        if kind == TIMED_OUT:
            return InvalidRequest(f"the model's chat template exceeded its time limit on these messages "
                                  f"(chat_template_timeout={lim.chat_template_timeout:g} s): its render was stopped")
        if kind == OVERSIZED:
            return InvalidRequest(f"the model's chat template would build a string or list of {text} characters "
                                  f"from these messages, over its limit (max_chat_template_chars="
                                  f"{lim.max_chat_template_chars}): refused")
        if kind == TOO_LARGE:
            return InvalidRequest(f"the model's chat template rendered {text} characters from these messages, over "
                                  f"its limit (max_chat_template_chars={lim.max_chat_template_chars}): refused")
        if kind == MEMORY:
            return InvalidRequest(f"the model's chat template exceeded its memory limit on these messages "
                                  f"(chat_template_memory_mb={lim.chat_template_memory_mb} MiB): its render was "
                                  "stopped")
        if kind == DIED:
            return InvalidRequest(f"the model's chat template ended its render process on these messages ({text})")
        if kind == TYPE_ERROR:
            return TemplateTypeError(f"the chat template could not be applied to these messages: {text}")
        return InvalidRequest(f"the chat template could not be applied to these messages: {text}")

    async def _run(self, child: _Child, payload: bytes) -> tuple[bytes, str]:
        """One render on `child` within the deadline; the child goes back to the pool, or is
        killed and replaced. Never raises (its request may be gone)."""
        self.rendering += 1
        try:
            return await self._render_on(child, payload)
        finally:
            self.rendering -= 1

    async def _render_on(self, child: _Child, payload: bytes) -> tuple[bytes, str]:
        deadline = asyncio.get_running_loop().call_later(self.limits.chat_template_timeout, child.server.kill, child)
        try:
            kind, text = await child.exchange(payload)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._replace(child)
            if child.killed:
                return self._timed_out(child)
            log.warning("a chat-template render process (pid %d) ended mid-render (%s)", child.pid, e)
            return DIED, "its process ended"
        except asyncio.CancelledError:  # the pool is closing
            self._replace(child)
            raise
        finally:
            deadline.cancel()
        if self._probe_failure:
            log.warning("chat-template renders finish in time again: the worker is healthy")
        self._timeouts_in_a_row, self._probe_failure = 0, ""
        if kind == MEMORY or child.killed:  # what it freed may sit in its heap; or its deadline came as it answered
            self._replace(child)
        else:
            self._release(child)
        return kind, text

    def _timed_out(self, child: _Child) -> tuple[bytes, str]:
        self._timeouts_in_a_row += 1
        log.warning("a chat-template render ran past chat_template_timeout=%g s: its process (pid %d) killed",
                    self.limits.chat_template_timeout, child.pid)
        if self._timeouts_in_a_row == self.limits.unhealthy_after_template_timeouts:
            log.warning("%d chat-template renders in a row ran past their deadline: a probe render tells whether "
                        "the render processes or these chats are stuck", self._timeouts_in_a_row)
            self._probe_soon()
        return TIMED_OUT, ""

    # -- the processes -----------------------------------------------------------------------
    async def _acquire(self) -> _Child:
        while self._idle:
            child = self._idle.pop()
            if not child.reader.at_eof():
                return child
            self._replace(child)  # ended while idle (killed from outside)
        if self._closed or (not self._children and self._start_error):
            raise Unavailable(f"this worker cannot render chat templates now: {self.stuck or 'it is stopping'}; "
                              "send this request elsewhere")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed over as the request went away
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _release(self, child: _Child) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(child)
                return
        self._idle.append(child)

    def _fail_waiters(self, error: OrchardError) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def _replace(self, child: _Child) -> None:
        self._children.discard(child)
        self._background(child.server.reap(child))
        self._fill()

    def _fill(self) -> None:
        while not self._closed and len(self._children) + self._starting < self.limits.chat_template_processes:
            self._starting += 1
            self._background(self._start_one())

    async def _start_one(self) -> None:
        try:
            child = await self._fork_until_one_starts()
        finally:
            self._starting -= 1
        if self._closed:
            await child.server.reap(child)
            return
        self._children.add(child)
        self._release(child)

    async def _fork_until_one_starts(self) -> _Child:
        """A new render process; where the fork server cannot start or is gone, it is
        started again (backing off) until one starts or the pool closes."""
        for attempt in range(sys.maxsize):
            server = None
            try:
                server = await self._fork_server()
                child = await self._fork(server)
                self._start_error = ""
                return child
            except (OSError, ValueError, asyncio.TimeoutError) as e:
                self._start_error = str(e) or type(e).__name__
            log.error("cannot start a chat-template render process: %s", self._start_error)
            if server is not None:  # gone: a new one next time
                await self._drop_server(server)
            if not self._children:
                self._fail_waiters(Unavailable(f"this worker cannot render chat templates now: {self.stuck}; "
                                               "send this request elsewhere"))
            await asyncio.sleep(RESTART_BACKOFF_SECONDS[min(attempt, len(RESTART_BACKOFF_SECONDS) - 1)])

    async def _fork(self, server: _ForkServer) -> _Child:
        """A render process from `server`. A slow fork (a loaded machine) is waited for, not
        given up: giving up would put the control socket out of step and take the fork
        server, and every render process with it, down for one late answer. While there is
        no other process, it counts as a failed start (the worker is stuck)."""
        fork = asyncio.ensure_future(server.fork())
        try:
            return await asyncio.wait_for(asyncio.shield(fork), FORK_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            self._start_error = f"the fork server has not forked a render process in {FORK_TIMEOUT_SECONDS:g} s"
            log.warning("%s: waiting for it", self._start_error)
            if not self._children:
                self._fail_waiters(Unavailable(f"this worker cannot render chat templates now: {self.stuck}; "
                                               "send this request elsewhere"))
            return await fork
        finally:
            fork.cancel()  # the pool is closing (no-op once it is done)

    async def _fork_server(self) -> _ForkServer:
        async with self._server_lock:  # one start at a time
            if self._server is None or not self._server.alive:
                if self._server is not None:
                    await self._server.close()
                self._server = await asyncio.wait_for(_ForkServer.start(self.limits), START_TIMEOUT_SECONDS)
            return self._server

    async def _drop_server(self, server: _ForkServer) -> None:
        async with self._server_lock:
            if self._server is server:
                self._server = None
        await server.close()

    # -- probing ---------------------------------------------------------------------------
    def _probe_soon(self) -> None:
        if self._probing is None or self._probing.done():
            self._probing = self._background(self._probe())

    async def _probe(self) -> None:
        """Renders ran out of time in a row: the chats' doing (what a client sent), or the
        render processes'? A probe render at once; while probes do not finish (past their
        deadline, or their process ended), the pool is stuck, and probes go on, backing
        off, until one finishes (any render that finishes clears the failure)."""
        lim = self.limits
        for attempt in range(sys.maxsize):
            try:
                kind, _ = await self._submit(pickle.dumps(self.probe_call, protocol=pickle.HIGHEST_PROTOCOL))
            except OrchardError:  # no process can start (`stuck` says so) or the pool is closing
                kind = None
            if self._closed or kind not in (TIMED_OUT, DIED, None):
                return
            if kind is not None:
                what = (f"ran past chat_template_timeout={lim.chat_template_timeout:g} s" if kind == TIMED_OUT
                        else "ended without an answer")
                self._probe_failure = (f"a probe render (the model's chat template on a one-line chat) {what}, after "
                                       f"{lim.unhealthy_after_template_timeouts} renders in a row ran past their "
                                       "deadline")
                log.error("%s: reporting the worker unhealthy until a probe render finishes in time",
                          self._probe_failure)
            await asyncio.sleep(PROBE_BACKOFF_SECONDS[min(attempt, len(PROBE_BACKOFF_SECONDS) - 1)])

    def _background(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
