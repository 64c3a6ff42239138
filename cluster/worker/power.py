"""A Mac that serves stays awake, and one about to sleep anyway drains first.

While a worker or group member holds loaded weights it keeps the Mac out of idle sleep
with a power assertion (what `caffeinate -i` takes: IOKit's
kIOPMAssertionTypePreventUserIdleSystemSleep), released when it stops. A sleep the user
or the OS forces (a closed lid, the Apple menu, a low battery) still comes: macOS says
so first (kIOMessageSystemWillSleep) and waits for an acknowledgement, up to
`SLEEP_ACK_S`. `StayAwake` then calls the process's `drain` (stop taking requests, tell
the router, let running streams finish for up to `SLEEP_DRAIN_S`, end the rest so the
router resumes them elsewhere or holds them), acknowledges, and on wake calls `undrain`.

`PowerNotifier` is the one seam: `MacPower` speaks to IOKit through ctypes (the
notifications arrive on a CFRunLoop on a thread of its own), `NoPower` stands in off
macOS, and tests drive a fake.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

SLEEP_ACK_S = 30.0  # macOS sleeps anyway this long after a will-sleep that nobody acknowledged
SLEEP_DRAIN_S = 20.0  # of it, how long running streams get to finish before a sleep


class PowerNotifier(Protocol):
    """The system's power management, as a worker needs it.

    `keep_awake(reason)` takes the assertion (once; `reason` is what `pmset -g assertions`
    shows) and `allow_sleep()` gives it back. `watch(will_sleep, did_wake)` starts
    delivering notifications on a thread of the notifier's: `will_sleep()` is called when
    the system is about to sleep and the sleep waits until it returns (or `SLEEP_ACK_S`
    passes); `did_wake()` once it is awake again. `close()` stops the notifications and
    gives the assertion back; it may be called more than once."""

    def keep_awake(self, reason: str) -> None: ...

    def allow_sleep(self) -> None: ...

    def watch(self, will_sleep: Callable[[], None], did_wake: Callable[[], None]) -> None: ...

    def close(self) -> None: ...


class NoPower:
    """Off macOS: no assertion to take, no sleep notifications (said once, at debug level)."""

    def keep_awake(self, reason: str) -> None:
        log.debug("power: no sleep assertion on %s (only macOS has one): %s", sys.platform, reason)

    def allow_sleep(self) -> None:
        pass

    def watch(self, will_sleep: Callable[[], None], did_wake: Callable[[], None]) -> None:
        log.debug("power: no sleep notifications on %s (only macOS sends them)", sys.platform)

    def close(self) -> None:
        pass


# IOKit's message types (IOKit/IOMessage.h: iokit_common_msg(n) = 0xe0000000 | n)
CAN_SYSTEM_SLEEP = 0xE0000270
SYSTEM_WILL_SLEEP = 0xE0000280
SYSTEM_HAS_POWERED_ON = 0xE0000300
ASSERTION_LEVEL_ON = 255
PREVENT_IDLE_SLEEP = b"PreventUserIdleSystemSleep"  # kIOPMAssertionTypePreventUserIdleSystemSleep
UTF8 = 0x08000100  # kCFStringEncodingUTF8
IOKIT = "/System/Library/Frameworks/IOKit.framework/IOKit"
CORE_FOUNDATION = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"

# void callback(void *refcon, io_service_t service, natural_t type, void *argument)
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)


class MacPower:
    """IOKit through ctypes: IOPMAssertionCreateWithName / IOPMAssertionRelease for the
    assertion; IORegisterForSystemPower on a CFRunLoop thread for the notifications,
    each will-sleep (and idle-sleep query) answered with IOAllowPowerChange."""

    def __init__(self, iokit=None, cf=None):
        """`iokit`, `cf`: the frameworks (a test passes stand-ins)."""
        self.iokit = iokit = iokit or ctypes.cdll.LoadLibrary(IOKIT)
        self.cf = cf = cf or ctypes.cdll.LoadLibrary(CORE_FOUNDATION)
        cf.CFStringCreateWithCString.restype = ctypes.c_void_p
        cf.CFStringCreateWithCString.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
        cf.CFRelease.argtypes = [ctypes.c_void_p]
        cf.CFRunLoopGetCurrent.restype = ctypes.c_void_p
        cf.CFRunLoopAddSource.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        cf.CFRunLoopStop.argtypes = [ctypes.c_void_p]
        iokit.IOPMAssertionCreateWithName.restype = ctypes.c_int32
        iokit.IOPMAssertionCreateWithName.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p,
                                                      ctypes.POINTER(ctypes.c_uint32)]
        iokit.IOPMAssertionRelease.restype = ctypes.c_int32
        iokit.IOPMAssertionRelease.argtypes = [ctypes.c_uint32]
        iokit.IORegisterForSystemPower.restype = ctypes.c_uint32
        iokit.IORegisterForSystemPower.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), _CALLBACK,
                                                   ctypes.POINTER(ctypes.c_uint32)]
        iokit.IONotificationPortGetRunLoopSource.restype = ctypes.c_void_p
        iokit.IONotificationPortGetRunLoopSource.argtypes = [ctypes.c_void_p]
        iokit.IOAllowPowerChange.restype = ctypes.c_int32
        iokit.IOAllowPowerChange.argtypes = [ctypes.c_uint32, ctypes.c_long]
        iokit.IODeregisterForSystemPower.argtypes = [ctypes.POINTER(ctypes.c_uint32)]
        iokit.IOServiceClose.argtypes = [ctypes.c_uint32]
        iokit.IONotificationPortDestroy.argtypes = [ctypes.c_void_p]
        self._lock = threading.Lock()
        self._assertion: int | None = None
        self._thread: threading.Thread | None = None
        self._run_loop: int | None = None
        self._callback = None  # kept alive while IOKit may call it

    def _cfstring(self, text: bytes) -> int:
        return self.cf.CFStringCreateWithCString(None, text, UTF8)

    def keep_awake(self, reason: str) -> None:
        with self._lock:
            if self._assertion is not None:
                return
            kind, name = self._cfstring(PREVENT_IDLE_SLEEP), self._cfstring(reason[:120].encode())
            assertion = ctypes.c_uint32(0)
            try:
                code = self.iokit.IOPMAssertionCreateWithName(kind, ASSERTION_LEVEL_ON, name, ctypes.byref(assertion))
            finally:
                for made in (kind, name):
                    if made:  # (CFRelease(NULL) crashes)
                        self.cf.CFRelease(made)
            if code != 0:
                log.warning("power: cannot keep the Mac awake (IOPMAssertionCreateWithName: 0x%x)", code & 0xFFFFFFFF)
                return
            self._assertion = assertion.value
            log.info("power: keeping the Mac out of idle sleep while %s", reason)

    def allow_sleep(self) -> None:
        with self._lock:
            if self._assertion is not None:
                self.iokit.IOPMAssertionRelease(self._assertion)
                self._assertion = None

    def watch(self, will_sleep: Callable[[], None], did_wake: Callable[[], None]) -> None:
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(will_sleep, did_wake, started),
                                        name="orchard-power", daemon=True)
        self._thread.start()
        started.wait(5.0)

    def _run(self, will_sleep: Callable[[], None], did_wake: Callable[[], None], started: threading.Event) -> None:
        iokit, cf = self.iokit, self.cf
        port, notifier = ctypes.c_void_p(), ctypes.c_uint32(0)
        root = ctypes.c_uint32(0)

        def on_message(refcon, service, kind, argument) -> None:
            if kind == CAN_SYSTEM_SLEEP:  # an idle sleep asked: the assertion answers it
                iokit.IOAllowPowerChange(root.value, argument or 0)
            elif kind == SYSTEM_WILL_SLEEP:
                try:
                    will_sleep()
                except Exception:  # whatever happened, the Mac must not wait out the timeout for us
                    log.exception("power: preparing for sleep failed")
                iokit.IOAllowPowerChange(root.value, argument or 0)
            elif kind == SYSTEM_HAS_POWERED_ON:
                try:
                    did_wake()
                except Exception:
                    log.exception("power: coming back from sleep failed")

        self._callback = _CALLBACK(on_message)
        root.value = iokit.IORegisterForSystemPower(None, ctypes.byref(port), self._callback, ctypes.byref(notifier))
        if not root.value:
            log.warning("power: IORegisterForSystemPower failed: a forced sleep will not be drained for")
            started.set()
            return
        self._run_loop = cf.CFRunLoopGetCurrent()
        cf.CFRunLoopAddSource(self._run_loop, iokit.IONotificationPortGetRunLoopSource(port), self._default_mode())
        started.set()
        try:
            cf.CFRunLoopRun()  # until close() stops it
        finally:
            iokit.IODeregisterForSystemPower(ctypes.byref(notifier))
            iokit.IOServiceClose(root.value)
            iokit.IONotificationPortDestroy(port)

    def _default_mode(self):
        return ctypes.c_void_p.in_dll(self.cf, "kCFRunLoopDefaultMode")

    def close(self) -> None:
        if self._run_loop is not None:
            self.cf.CFRunLoopStop(self._run_loop)
            self._run_loop = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        self.allow_sleep()


def system_power() -> PowerNotifier:
    """This machine's notifier: `MacPower` on macOS (`NoPower` where IOKit cannot be
    loaded, with a warning), `NoPower` elsewhere."""
    if sys.platform != "darwin":
        return NoPower()
    try:
        return MacPower()
    except (OSError, AttributeError) as e:
        log.warning("power: IOKit unavailable (%s): the Mac may sleep while serving", e)
        return NoPower()


class StayAwake:
    """While started, the Mac stays out of idle sleep; a sleep that comes anyway is
    prepared for with `drain(seconds)` (which returns once the process is ready to sleep,
    within about `seconds`), and the wake is followed by `undrain()`."""

    def __init__(self, power: PowerNotifier, reason: str, drain: Callable[[float], None],
                 undrain: Callable[[], None], drain_s: float = SLEEP_DRAIN_S):
        self.power = power
        self.reason = reason
        self.drain = drain
        self.undrain = undrain
        self.drain_s = drain_s
        self.asleep = False  # drained for a sleep, not yet woken

    def start(self) -> "StayAwake":
        self.power.keep_awake(self.reason)
        self.power.watch(self._will_sleep, self._did_wake)
        return self

    def stop(self) -> None:
        self.power.close()

    def _will_sleep(self) -> None:
        log.warning("power: the Mac is going to sleep: draining (up to %g s) before it does", self.drain_s)
        self.asleep = True
        self.drain(self.drain_s)

    def _did_wake(self) -> None:
        if not self.asleep:
            return
        self.asleep = False
        log.warning("power: the Mac is awake again: taking requests")
        self.undrain()
