"""A `PowerNotifier` (cluster/worker/power.py) that a test drives in place of macOS."""

from __future__ import annotations

import threading
from collections.abc import Callable

from cluster.worker.power import SLEEP_ACK_S


class FakePower:
    """`sleep()` delivers a will-sleep as macOS does (on a thread of the notifier's, the
    sleep waiting for the callback to return); `wake()` a did-wake. `assertion` is the
    reason of the assertion held (None: the Mac may sleep)."""

    def __init__(self):
        self.assertion: str | None = None
        self.closed = False
        self._will_sleep: Callable[[], None] | None = None
        self._did_wake: Callable[[], None] | None = None

    def keep_awake(self, reason: str) -> None:
        self.assertion = reason

    def allow_sleep(self) -> None:
        self.assertion = None

    def watch(self, will_sleep: Callable[[], None], did_wake: Callable[[], None]) -> None:
        self._will_sleep, self._did_wake = will_sleep, did_wake

    def close(self) -> None:
        self.closed = True
        self.allow_sleep()

    def sleep(self, ack_s: float = SLEEP_ACK_S) -> bool:
        """Whether the will-sleep was acknowledged within `ack_s` (blocks until then)."""
        return self._deliver(self._will_sleep, ack_s)

    def wake(self, timeout: float = 30.0) -> bool:
        return self._deliver(self._did_wake, timeout)

    @staticmethod
    def _deliver(callback: Callable[[], None] | None, timeout: float) -> bool:
        assert callback is not None, "nothing watches for power notifications"

        def run() -> None:
            try:
                callback()
            except Exception:  # as MacPower: a failed callback still answers the system
                pass

        thread = threading.Thread(target=run, name="fake-power", daemon=True)
        thread.start()
        thread.join(timeout)
        return not thread.is_alive()


class FakeFrameworks:
    """IOKit and CoreFoundation as `MacPower` calls them through ctypes (off macOS): each
    call recorded in `calls` as (name, args); an assertion gets id 7, the registration root
    port 99; `CFRunLoopRun` blocks until `CFRunLoopStop`. `deliver(message, argument)`
    calls the registered callback as IOKit does."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.callback = None
        self._stopped = threading.Event()

    def __getattr__(self, name: str):
        fn = _FakeFunction(self, name)
        setattr(self, name, fn)
        return fn

    def called(self, name: str) -> list[tuple]:
        return [args for n, args in self.calls if n == name]

    def deliver(self, message: int, argument: int = 0) -> None:
        self.callback(None, 0, message, argument)

    def answer(self, name: str, args: tuple):
        if name == "IOPMAssertionCreateWithName":
            args[3]._obj.value = 7  # the IOPMAssertionID out-parameter (ctypes.byref)
        elif name == "IORegisterForSystemPower":
            self.callback = args[2]
            return 99
        elif name == "CFStringCreateWithCString":
            return id(args[1])
        elif name == "CFRunLoopGetCurrent":
            return 1234
        elif name == "CFRunLoopRun":
            self._stopped.wait(30)
        elif name == "CFRunLoopStop":
            self._stopped.set()
        return 0


class _FakeFunction:
    def __init__(self, owner: FakeFrameworks, name: str):
        self.owner, self.name = owner, name
        self.argtypes = self.restype = None  # as MacPower declares them

    def __call__(self, *args):
        self.owner.calls.append((self.name, args))
        return self.owner.answer(self.name, args)
