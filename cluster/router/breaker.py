"""Failure containment at the router: a circuit breaker per worker, backoff between
attempts, and a retry budget for the whole router. Pure Python with an injectable clock.

- `CircuitBreaker`: `threshold` consecutive failures open it for `cooldown` seconds (no
  request is placed on the worker, however healthy its heartbeats look); then it is
  half-open and lets one probe request through: success closes it, failure opens it again
  for twice as long (up to `max_cooldown`).
- `backoff(attempt)`: exponential with full jitter before a request is placed again.
- `RetryBudget`: retries (and resumes) may be at most `ratio` of requests plus `per_second`,
  with a burst of `burst`: when every worker fails, the router fails requests fast instead
  of multiplying the load on what is left.
"""

from __future__ import annotations

import random
import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, threshold: int = 3, cooldown: float = 2.0, max_cooldown: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.threshold = threshold
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.clock = clock
        self.failures = 0  # consecutive
        self.cooldown = cooldown
        self.open_until: float | None = None
        self.probing = False  # a half-open probe is in flight

    @property
    def state(self) -> str:
        if self.open_until is None:
            return CLOSED
        return OPEN if self.clock() < self.open_until else HALF_OPEN

    def allows(self) -> bool:
        """Whether a request may be placed on the worker now."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self.probing)

    def on_start(self) -> None:
        if self.state == HALF_OPEN:
            self.probing = True

    def on_success(self) -> None:
        self.failures, self.open_until, self.probing, self.cooldown = 0, None, False, self.base_cooldown

    def on_failure(self) -> bool:
        """Count a failure; True when it opened the breaker."""
        self.failures += 1
        state, self.probing = self.state, False
        if state == HALF_OPEN:  # the probe failed: open again, for longer
            self.cooldown = min(self.max_cooldown, self.cooldown * 2)
        elif state == OPEN or self.failures < self.threshold:
            return False
        self.open_until = self.clock() + self.cooldown
        return True

    def on_abandon(self) -> None:
        """A request that ended without telling (the client left): a probe is over."""
        self.probing = False


def backoff(attempt: int, base: float = 0.025, cap: float = 1.0, rng: random.Random | None = None) -> float:
    """Seconds to wait before attempt `attempt` (1 = the first retry): full jitter over
    an exponentially growing window."""
    return (rng or random).uniform(0, min(cap, base * 2 ** (attempt - 1)))


class RetryBudget:
    def __init__(self, ratio: float = 0.2, per_second: float = 10.0, burst: float = 50.0,
                 clock: Callable[[], float] = time.monotonic):
        self.ratio, self.per_second, self.burst = ratio, per_second, burst
        self.clock = clock
        self.tokens = burst
        self.at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_second)
        self.at = now

    def on_request(self) -> None:
        self._refill()
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def try_retry(self) -> bool:
        self._refill()
        if self.tokens >= 1 - 1e-9:  # ten requests at 0.2 earn two retries, float sums or not
            self.tokens -= 1
            return True
        return False
