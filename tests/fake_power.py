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
