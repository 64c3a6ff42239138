"""A deadline that ends the process even while its threads cannot run Python.

MLX's ring init (`mx.distributed.init`) holds the GIL while it blocks in accept() for its
left neighbour: a neighbour that died before connecting leaves it there for ever, and no
Python thread (`channel.Watchdog`, the side channel's readers) runs meanwhile. So the
bound on it is a timer of the C library, which calls `_exit(code)` on a thread of its own
unless cancelled first: `timer_create` (SIGEV_THREAD) on Linux, a dispatch timer on macOS.
Where neither can be set up, `faulthandler`'s watchdog (also a C thread) ends the process
with status 1, after writing every thread's traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import sys
from collections.abc import Iterator

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)


class _Timer:
    def cancel(self) -> None:
        raise NotImplementedError


class _PosixTimer(_Timer):
    """timer_create(CLOCK_MONOTONIC, SIGEV_THREAD): the C library calls `_exit(code)` on a
    new thread when it fires."""

    CLOCK_MONOTONIC = 1
    SIGEV_THREAD = 2

    class _SigEvent(ctypes.Structure):  # struct sigevent, 64 bytes on Linux
        _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                    ("function", ctypes.c_void_p), ("attribute", ctypes.c_void_p), ("pad", ctypes.c_byte * 32)]

    class _ITimerSpec(ctypes.Structure):  # two struct timespec: seconds, nanoseconds
        _fields_ = [("interval", ctypes.c_long * 2), ("value", ctypes.c_long * 2)]

    def __init__(self, seconds: float, code: int):
        self._id = ctypes.c_void_p()
        event = self._SigEvent(value=code, notify=self.SIGEV_THREAD,
                               function=ctypes.cast(_libc._exit, ctypes.c_void_p).value)
        if _libc.timer_create(self.CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(self._id)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create failed")
        spec = self._ITimerSpec()
        spec.value[0], spec.value[1] = int(seconds), int(seconds % 1 * 1e9)
        if _libc.timer_settime(self._id, 0, ctypes.byref(spec), None) != 0:
            _libc.timer_delete(self._id)
            raise OSError(ctypes.get_errno(), "timer_settime failed")

    def cancel(self) -> None:
        _libc.timer_delete(self._id)


class _DispatchTimer(_Timer):
    """A dispatch timer source on a global queue, whose handler is `_exit` and whose
    context (the handler's argument) is `code`."""

    FOREVER = 2**64 - 1

    def __init__(self, seconds: float, code: int):
        lib = _libc
        lib.dispatch_get_global_queue.restype = ctypes.c_void_p
        lib.dispatch_get_global_queue.argtypes = [ctypes.c_long, ctypes.c_ulong]
        lib.dispatch_source_create.restype = ctypes.c_void_p
        lib.dispatch_source_create.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_void_p]
        lib.dispatch_time.restype = ctypes.c_uint64
        lib.dispatch_time.argtypes = [ctypes.c_uint64, ctypes.c_int64]
        lib.dispatch_source_set_timer.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]
        for name in ("dispatch_set_context", "dispatch_source_set_event_handler_f"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        for name in ("dispatch_resume", "dispatch_source_cancel", "dispatch_release"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
        timer_type = ctypes.addressof(ctypes.c_void_p.in_dll(lib, "_dispatch_source_type_timer"))
        source = lib.dispatch_source_create(timer_type, 0, 0, lib.dispatch_get_global_queue(0, 0))
        if not source:
            raise OSError("dispatch_source_create failed")
        lib.dispatch_set_context(source, code)
        lib.dispatch_source_set_event_handler_f(source, ctypes.cast(lib._exit, ctypes.c_void_p).value)
        lib.dispatch_source_set_timer(source, lib.dispatch_time(0, int(seconds * 1e9)), self.FOREVER, 0)
        lib.dispatch_resume(source)
        self._source = source

    def cancel(self) -> None:
        _libc.dispatch_source_cancel(self._source)
        _libc.dispatch_release(self._source)


class _FaulthandlerTimer(_Timer):
    def __init__(self, seconds: float, code: int):
        faulthandler.dump_traceback_later(seconds, exit=True)

    def cancel(self) -> None:
        faulthandler.cancel_dump_traceback_later()


def _timer(seconds: float, code: int) -> _Timer:
    native = _DispatchTimer if sys.platform == "darwin" else _PosixTimer
    try:
        return native(seconds, code)
    except (AttributeError, OSError, ValueError) as e:  # no such call here: a timer that exits 1
        log.warning("no C library timer here (%s): past the deadline the process exits with status 1", e)
        return _FaulthandlerTimer(seconds, code)


@contextlib.contextmanager
def exit_after(seconds: float, code: int, what: str) -> Iterator[None]:
    """Run the block; if it has not finished after `seconds`, the process ends with
    `code` at once (no cleanup: `os._exit`), whatever holds its threads."""
    log.info("group: %s (the process ends, exit %d, if it takes more than %g s)", what, code, seconds)
    timer = _timer(seconds, code)
    try:
        yield
    finally:
        timer.cancel()
