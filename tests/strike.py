"""Faults struck mid-stream at the worker serving most streams, for the failover tests.

The client decides when to strike from the tokens it has read. A client that lags behind
a fast worker (a loaded machine) may read its Nth token after the victim has sent every
stream whole: the victim then has nothing left to lose, each stream ends unchanged and
none moves. Such a try proves nothing about failover, so `until_one_moves` runs it again.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import pytest

TRIES = 3
NEVER = "in {tries} tries the fault never struck while the victim still owed tokens"


class Striker:
    """Watches the chunks of several streams (`on_chunk(i)` is stream i's callback) and,
    once `after` tokens have arrived in all, calls `strike(worker_id)` once, with the
    worker serving most of the unfinished streams. `after=None`: never strikes."""

    def __init__(self, after: int | None, strike: Callable[[str], None]):
        self.after = after
        self.strike = strike
        self.tokens = 0
        self.serving: dict[int, str] = {}  # unfinished stream -> its worker
        self.struck: list[str] = []  # the victim, once struck

    def on_chunk(self, i: int) -> Callable:
        def seen(chunk) -> None:
            self.tokens += len(chunk.token_ids)
            self.serving[i] = chunk.worker_id
            if chunk.finish_reason:
                self.serving.pop(i, None)
            if self.after and not self.struck and self.tokens >= self.after and self.serving:
                values = list(self.serving.values())
                busiest = max(set(values), key=values.count)
                self.struck.append(busiest)
                self.strike(busiest)
        return seen


def until_one_moves(attempt: Callable[[], bool], tries: int = TRIES) -> None:
    """Run `attempt` until it returns True (a stream moved off the victim: the fault
    landed while the victim owed tokens), at most `tries` times. `attempt` asserts what
    must hold either way (unchanged outputs) and brings the victim back before it returns."""
    for _ in range(tries):
        if attempt():
            return
    pytest.fail(NEVER.format(tries=tries))


async def until_one_moves_async(attempt: Callable[[], Awaitable[bool]], tries: int = TRIES) -> None:
    """`until_one_moves` for an `attempt` that is a coroutine function."""
    for _ in range(tries):
        if await attempt():
            return
    pytest.fail(NEVER.format(tries=tries))


def greedy_streams(router: str, texts: list[str], max_tokens: int, on_progress=None) -> list[list[int]]:
    """Greedy streams through the router (the SDK), all at once; each one's tokens.
    `on_progress(n)` is called with the tokens read so far, in all (from the streams'
    threads). Any stream's error fails the caller's test."""
    from cluster.sdk import Client

    out: list[list[int]] = [[] for _ in texts]
    errors: list[str] = []
    lock = threading.Lock()
    total = [0]

    def one(i: int) -> None:
        try:
            with Client(router, timeout=600) as client:
                for chunk in client.stream(texts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                    with lock:
                        out[i] += chunk.token_ids
                        total[0] += len(chunk.token_ids)
                        n = total[0]
                    if on_progress is not None:
                        on_progress(n)
        except Exception as e:  # noqa: BLE001  (reported by the assertion below)
            errors.append(f"stream {i}: {e}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors, errors
    return out
