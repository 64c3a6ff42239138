"""The router's failure containment, pure (cluster/router/breaker.py): circuit breaker,
backoff, retry budget, on a fake clock."""

from __future__ import annotations

import random

from cluster.router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, RetryBudget, backoff


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_consecutive_failures_and_probes_once():
    clock = Clock()
    b = CircuitBreaker(threshold=3, cooldown=2.0, max_cooldown=5.0, clock=clock)
    assert not b.on_failure() and not b.on_failure() and b.allows()
    b.on_success()  # a success in between resets the count
    assert [b.on_failure() for _ in range(3)] == [False, False, True]
    assert b.state == OPEN and not b.allows()
    clock.t += 1.9
    assert not b.allows()
    clock.t += 0.2
    assert b.state == HALF_OPEN and b.allows()
    b.on_start()  # the probe
    assert not b.allows()  # one probe at a time
    assert b.on_failure()  # the probe failed: open again, for twice as long
    assert b.state == OPEN and b.cooldown == 4.0
    clock.t += 4.1
    b.on_start()
    b.on_abandon()  # the probe's client left: another probe may go
    assert b.allows()
    b.on_start()
    assert b.on_failure() and b.cooldown == 5.0  # capped
    clock.t += 5.1
    b.on_start()
    b.on_success()
    assert b.state == CLOSED and b.allows() and b.cooldown == 2.0 and b.failures == 0


def test_backoff_grows_with_full_jitter_and_a_cap():
    rng = random.Random(0)
    for attempt, window in ((1, 0.025), (2, 0.05), (3, 0.1), (10, 1.0)):
        delays = [backoff(attempt, rng=rng) for _ in range(200)]
        assert all(0 <= d <= window for d in delays)
        assert max(delays) > 0.8 * window  # spread over the whole window


def test_retry_budget_is_a_share_of_requests_plus_a_rate():
    clock = Clock()
    budget = RetryBudget(ratio=0.2, per_second=10.0, burst=5.0, clock=clock)
    assert sum(budget.try_retry() for _ in range(10)) == 5  # the burst
    for _ in range(10):
        budget.on_request()  # 10 requests earn 2 retries
    assert sum(budget.try_retry() for _ in range(10)) == 2
    clock.t += 0.35  # 3.5 more from the rate
    assert sum(budget.try_retry() for _ in range(10)) == 3
    clock.t += 100
    assert sum(budget.try_retry() for _ in range(10)) == 5  # never more than the burst
