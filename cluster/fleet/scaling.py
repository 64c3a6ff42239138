"""Replicas that follow traffic: when a loaded model gets one replica more or one fewer
(pure: no I/O, no clock of its own, no asyncio; the controller feeds it and acts on it).

A replica is a worker of the model, or a pipeline group. The controller tells a model's
`Traffic` each request's wait for its first token (`waited`: from the request's arrival at
the router to its first token, or to its failure) and its requests in flight (`in_flight`),
and asks `decide` once a tick. The rule, for a model with R replicas, a floor
F = max(min_replicas, 1) and a ceiling C = max_replicas, or F when that is 0:

- **Below the floor or above the ceiling** (a replica lost, the entry changed): one replica
  towards [F, C] at once.
- **Up (+1)** when R < C, the window has run a full --scale-window, at least `MIN_WAITS`
  requests got their first token (or failed) over the last --scale-window seconds, and
  more than half of them waited longer than --scale-up-wait (their median, the lower one
  for an even count, is above it).
- **Down (-1)** when R > F, the window has run --scale-down-idle (and at least a full
  --scale-window), and over the last --scale-down-idle seconds the peak of its requests in
  flight would have fit in half the slots of R - 1 replicas (`slots` each: their
  --max-num-seqs) and no more than half their waits were longer than half --scale-up-wait.
- Else 0.

Hysteresis: up needs waits above the threshold; down needs waits below half of it and a
load that one replica fewer carries at half its slots. Between the two nothing changes.
A window starts when the model is loaded and at each change of its replica count (by this
rule or any other: a replica lost, another router's change), so there is at most one
change per window per model, and each decision weighs only the requests that arrived since
the last change: the traffic the replicas of now served (not a burst held while it loaded).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_WAITS = 5  # first tokens a window must see before its waits say anything
BUCKET_SECONDS = 1.0  # traffic is kept per bucket of this long: memory per model is bounded by time, not requests
DOWN_WAIT_FRACTION = 0.5  # down only while waits stay under this part of --scale-up-wait


@dataclass(frozen=True)
class ScalePolicy:
    """The router's --scale-up-wait, --scale-window and --scale-down-idle, seconds."""

    up_wait: float = 2.0
    window: float = 30.0
    down_idle: float = 120.0

    @property
    def horizon(self) -> float:
        """How far back a decision looks."""
        return max(self.window, self.down_idle)


@dataclass(frozen=True)
class Bounds:
    """A model's replicas as its catalog entry bounds them, and each replica's slots."""

    min_replicas: int = 0
    max_replicas: int = 0  # 0: the floor
    slots: int = 1  # requests a replica runs at once (its --max-num-seqs)

    @property
    def floor(self) -> int:
        return max(self.min_replicas, 1)

    @property
    def ceiling(self) -> int:
        return max(self.max_replicas, self.floor) if self.max_replicas else self.floor


@dataclass
class _Bucket:
    start: float
    waits: int = 0
    slow: int = 0  # waits over --scale-up-wait
    slowish: int = 0  # waits over DOWN_WAIT_FRACTION of it
    peak: int = 0  # requests in flight at most
    last: int = 0  # requests in flight at its end


@dataclass(frozen=True)
class Decision:
    delta: int  # +1, -1 or 0
    why: str


@dataclass
class Traffic:
    """One loaded model's recent traffic, as the rule sees it."""

    policy: ScalePolicy
    since: float  # the window's start: the load, or the last change of the replica count
    replicas: int = 1  # as of `since`
    in_flight_now: int = 0
    buckets: deque[_Bucket] = field(default_factory=deque)

    def _bucket(self, now: float) -> _Bucket:
        if not self.buckets or now >= self.buckets[-1].start + BUCKET_SECONDS:
            self.buckets.append(_Bucket(now, peak=self.in_flight_now, last=self.in_flight_now))
            # keep one bucket older than the horizon: its `last` is what was in flight at the horizon
            while len(self.buckets) > 2 and self.buckets[1].start + BUCKET_SECONDS < now - self.policy.horizon:
                self.buckets.popleft()
        return self.buckets[-1]

    def waited(self, now: float, seconds: float) -> None:
        """A request's wait for its first token (or its failure), ended at `now`. One that
        arrived before the window's start is the traffic of the replicas before (or of the
        load: a request held while the model loaded), and is not counted."""
        if now - seconds < self.since:
            return
        b = self._bucket(now)
        b.waits += 1
        b.slow += seconds > self.policy.up_wait
        b.slowish += seconds > self.policy.up_wait * DOWN_WAIT_FRACTION

    def in_flight(self, now: float, count: int) -> None:
        """The model's requests in flight at `now`."""
        b = self._bucket(now)  # a new bucket starts with what was in flight before
        b.peak, b.last = max(b.peak, count), count
        self.in_flight_now = count

    def seen(self, now: float, replicas: int) -> None:
        """The model has `replicas` now: a count other than the last one starts a window."""
        if replicas != self.replicas:
            self.changed(now, replicas)

    def changed(self, now: float, replicas: int) -> None:
        """A change of the replicas took effect at `now` (an added one serves, a removed one
        is gone): a window starts."""
        self.replicas, self.since = replicas, now

    def _span(self, now: float, seconds: float) -> list[_Bucket]:
        return [b for b in self.buckets if b.start >= now - seconds and b.start >= self.since]

    def peak(self, now: float, seconds: float) -> int:
        """The most requests in flight over the last `seconds` (those still in flight at its
        start count: a long request starts no bucket)."""
        start = max(now - seconds, self.since)
        before = [b.last for b in self.buckets if b.start < start]
        return max([before[-1] if before else self.in_flight_now, self.in_flight_now,
                    *(b.peak for b in self._span(now, seconds))])


def decide(traffic: Traffic, bounds: Bounds, now: float) -> Decision:
    """+1, -1 or 0 replicas for the model now, and why (the rule is the module's docstring)."""
    p, r = traffic.policy, traffic.replicas
    if r < bounds.floor:
        return Decision(+1, f"{r} replicas, below its min_replicas {bounds.floor}")
    if r > bounds.ceiling:
        return Decision(-1, f"{r} replicas, above its max_replicas {bounds.ceiling}")
    age = now - traffic.since
    if r < bounds.ceiling and age >= p.window:
        window = traffic._span(now, p.window)
        waits, slow = sum(b.waits for b in window), sum(b.slow for b in window)
        if waits >= MIN_WAITS and 2 * slow > waits:
            return Decision(+1, f"{slow} of {waits} requests waited over {p.up_wait:g} s for their first token "
                                f"in the last {p.window:g} s")
    if r > bounds.floor and age >= max(p.down_idle, p.window):
        idle = traffic._span(now, p.down_idle)
        waits, slowish = sum(b.waits for b in idle), sum(b.slowish for b in idle)
        peak, room = traffic.peak(now, p.down_idle), (r - 1) * bounds.slots
        if 2 * peak <= room and 2 * slowish <= waits:
            return Decision(-1, f"at most {peak} requests in flight in the last {p.down_idle:g} s: the replicas "
                                f"but one carry them at half their {room} slots or less")
    return Decision(0, "")
