"""The router's record of its recent requests: a bounded ring the console shows.

One `RequestRecord` per generation request, begun when the request arrives and finished
when it ends: the worker that served it (the last one tried), its time to first token,
the tokens relayed, how many times it was placed again (retried before its first token,
resumed after it) and its outcome with the cause. Only the newest `size` are kept; nothing
here is on a request's path beyond a few attribute writes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from cluster.api.limits import MAX_ID_CHARS, MAX_NAME_CHARS

RUNNING, OK, RETRIED, RESUMED, FAILED, CANCELLED = "running", "ok", "retried", "resumed", "failed", "cancelled"
MAX_CAUSE_CHARS = 300  # of a failure's message, kept


@dataclass(eq=False)
class RequestRecord:
    request_id: str
    model: str
    started: float = field(default_factory=time.time)  # wall clock: what a page shows
    t0: float = field(default_factory=time.perf_counter)
    worker: str = ""  # the worker of its latest attempt
    ttft: float | None = None  # seconds
    tokens: int = 0  # relayed to the client
    retries: int = 0  # placed again before its first token
    resumes: int = 0  # ... after it
    outcome: str = RUNNING
    cause: str = ""  # why it failed, or why it was placed again
    seconds: float | None = None  # from arrival to its end

    def placed_again(self, resumed: bool, why: str) -> None:
        if resumed:
            self.resumes += 1
        else:
            self.retries += 1
        self.cause = why[:MAX_CAUSE_CHARS]

    def as_dict(self) -> dict:
        return {"id": self.request_id, "model": self.model, "started": round(self.started, 3),
                "worker": self.worker, "ttft": None if self.ttft is None else round(self.ttft, 4),
                "tokens": self.tokens, "retries": self.retries, "resumes": self.resumes, "outcome": self.outcome,
                "cause": self.cause, "seconds": None if self.seconds is None else round(self.seconds, 3)}


class RecentRequests:
    """The newest `size` requests, newest last."""

    def __init__(self, size: int = 200):
        self._ring: deque[RequestRecord] = deque(maxlen=size)

    def begin(self, request_id: str, model: str) -> RequestRecord:
        """A request's record, begun before it is checked: its id and model cut to their
        bounds (a refused one's may be megabytes, and every console is pushed the ring)."""
        record = RequestRecord(request_id[:MAX_ID_CHARS], model[:MAX_NAME_CHARS])
        self._ring.append(record)
        return record

    def finish(self, record: RequestRecord, outcome: str, cause: str = "") -> None:
        """The request ended: `outcome` is OK, FAILED or CANCELLED; an OK request that was
        placed again is shown as RESUMED or RETRIED, with the cause of its move."""
        if outcome == OK and record.resumes:
            outcome = RESUMED
        elif outcome == OK and record.retries:
            outcome = RETRIED
        record.outcome = outcome
        if cause:
            record.cause = cause[:MAX_CAUSE_CHARS]
        record.seconds = time.perf_counter() - record.t0

    def rows(self, limit: int = 100) -> list[dict]:
        """The newest `limit` records, newest first."""
        return [r.as_dict() for r in list(self._ring)[-limit:][::-1]]

    def ttfts(self, since: float) -> dict[str, list[float]]:
        """The TTFTs of the records begun at or after `since` (wall clock), by worker: one
        walk over the ring, however many workers."""
        out: dict[str, list[float]] = {}
        for r in self._ring:
            if r.ttft is not None and r.started >= since:
                out.setdefault(r.worker, []).append(r.ttft)
        return out
