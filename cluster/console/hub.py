"""Live pushes to the open consoles: one loop per server, not one poll per page.

While at least one page listens, the hub builds the state once a second and, when it
differs from what it pushed last, hands the encoded JSON to every listener. A listener
holds at most one payload, the newest: a slow page skips states rather than queueing
them. With no listener, nothing runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

log = logging.getLogger(__name__)

PUSH_INTERVAL_SECONDS = 1.0  # at most one push a second, and only on change


def encode(state: dict) -> bytes:
    return json.dumps(state, separators=(",", ":"), ensure_ascii=False).encode()


class Hub:
    def __init__(self, snapshot: Callable[[], dict], interval: float = PUSH_INTERVAL_SECONDS):
        self.snapshot = snapshot
        self.interval = interval
        self.listeners: set[asyncio.Queue] = set()
        self.latest: bytes | None = None  # the last payload pushed
        self._task: asyncio.Task | None = None
        self._closed = False

    def subscribe(self) -> asyncio.Queue:
        """A new listener's queue: payloads (bytes), then None when the server stops. It
        holds the latest state at once when the hub has one."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        if self._closed:
            queue.put_nowait(None)
            return queue
        self.listeners.add(queue)
        if self.latest is not None:
            queue.put_nowait(self.latest)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="console-hub")
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self.listeners.discard(queue)

    async def _run(self) -> None:
        try:
            while self.listeners:
                try:
                    payload = encode(self.snapshot())
                except Exception:  # a bug in a snapshot: the pages keep their last state, the server goes on
                    log.exception("console: the state could not be built")
                    payload = self.latest
                if payload != self.latest:
                    self.latest = payload
                    for queue in list(self.listeners):
                        _offer(queue, payload)
                await asyncio.sleep(self.interval)
        finally:
            if not self.listeners:
                self.latest = None  # the next page's first state is built fresh

    async def close(self, app=None) -> None:
        """The server stops: every listener's stream ends (an open page would otherwise
        hold the HTTP server's shutdown)."""
        self._closed = True
        for queue in list(self.listeners):
            _offer(queue, None)
        self.listeners.clear()
        if self._task is not None:
            self._task.cancel()


def _offer(queue: asyncio.Queue, item) -> None:
    """Put `item`, dropping what the listener has not read yet (only the newest matters)."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)
