"""The replica rule (cluster/fleet/scaling.py) as plain Python on a hand-moved clock: known
answers for each clause, every bounds and replica count, then hypothesis traces that check
the rule's promises: at most one change per window, never past the bounds, and no flapping
while waits hover around the threshold."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.fleet.scaling import (BUCKET_SECONDS, MIN_WAITS, Bounds, Decision, ScalePolicy, Traffic,
                                   decide)

POLICY = ScalePolicy(up_wait=2.0, window=30.0, down_idle=120.0)
BOUNDS = Bounds(min_replicas=1, max_replicas=3, slots=4)


def traffic(replicas: int = 1, since: float = 0.0, policy: ScalePolicy = POLICY) -> Traffic:
    return Traffic(policy, since=since, replicas=replicas)


def steady(t: Traffic, start: float, end: float, wait: float, in_flight: int, every: float = 1.0) -> float:
    """One request a second from `start` to `end`, each waiting `wait`, `in_flight` at once."""
    now = start
    while now < end:
        t.in_flight(now, in_flight)
        t.waited(now, wait)
        now += every
    return now


def test_a_sustained_wait_adds_a_replica_after_a_full_window_not_before():
    t = traffic()
    steady(t, 0, 29, wait=5.0, in_flight=8)
    assert decide(t, BOUNDS, 29.0).delta == 0  # the window has not run yet
    d = decide(t, BOUNDS, 30.0)
    assert d.delta == +1 and "waited over 2 s" in d.why


def test_a_change_starts_a_window_one_change_per_window():
    t = traffic()
    steady(t, 0, 30, wait=5.0, in_flight=8)
    assert decide(t, BOUNDS, 30.0).delta == +1
    t.changed(30.0, 2)
    steady(t, 30, 59, wait=5.0, in_flight=8)
    assert decide(t, BOUNDS, 59.0).delta == 0  # the new replica's window has not run
    assert decide(t, BOUNDS, 60.0).delta == +1
    t.changed(60.0, 3)
    steady(t, 60, 200, wait=5.0, in_flight=8)
    assert decide(t, BOUNDS, 200.0).delta == 0  # at its max_replicas


def test_too_few_waits_or_half_of_them_slow_add_nothing():
    t = traffic()
    for i in range(MIN_WAITS - 1):
        t.waited(10.0 + i, 6.0)
    assert decide(t, BOUNDS, 30.0).delta == 0
    t = traffic()
    for i in range(10):
        t.waited(10.0 + i, 5.0 if i % 2 else 0.1)  # the lower median is fast
    assert decide(t, BOUNDS, 30.0).delta == 0
    t.waited(21.0, 5.0)
    assert decide(t, BOUNDS, 30.0).delta == +1


def test_only_the_last_window_counts():
    t = traffic()
    steady(t, 0, 20, wait=5.0, in_flight=8)
    steady(t, 20, 60, wait=0.1, in_flight=2)
    assert decide(t, BOUNDS, 60.0).delta == 0


def test_replicas_come_down_to_the_floor_after_the_idle_span():
    t = traffic(replicas=3)
    steady(t, 0, 119, wait=0.1, in_flight=4)  # 4 in flight: 2 replicas of 4 slots carry them at half
    assert decide(t, BOUNDS, 119.0).delta == 0
    d = decide(t, BOUNDS, 120.0)
    assert d.delta == -1 and "the replicas but one carry them at half their 8 slots" in d.why
    t.changed(120.0, 2)
    steady(t, 120, 241, wait=0.1, in_flight=2)
    assert decide(t, BOUNDS, 240.0).delta == 0  # the 4 in flight until 120 count
    assert decide(t, BOUNDS, 241.0).delta == -1
    t.changed(241.0, 1)
    assert decide(t, BOUNDS, 1000.0).delta == 0  # at its floor


def test_a_load_one_replica_fewer_cannot_carry_at_half_keeps_them():
    t = traffic(replicas=3)
    steady(t, 0, 200, wait=0.1, in_flight=5)  # 5 > half of 8
    assert decide(t, BOUNDS, 200.0).delta == 0


def test_a_long_request_in_flight_counts_without_new_events():
    t = traffic(replicas=2)
    t.in_flight(0.0, 3)  # three long requests start and run on; nothing more happens
    assert t.peak(500.0, POLICY.down_idle) == 3
    assert decide(t, BOUNDS, 500.0).delta == 0  # 3 > half of one replica's 4 slots
    t.in_flight(500.0, 0)
    assert decide(t, BOUNDS, 619.0).delta == 0
    assert decide(t, BOUNDS, 621.0).delta == -1


def test_a_burst_within_the_idle_span_holds_the_replicas():
    t = traffic(replicas=2)
    t.in_flight(100.0, 4)
    t.in_flight(100.5, 0)
    assert decide(t, BOUNDS, 200.0).delta == 0
    assert decide(t, BOUNDS, 100.5 + POLICY.down_idle + BUCKET_SECONDS + 1).delta == -1


def test_waits_between_the_thresholds_neither_add_nor_remove():
    t = traffic(replicas=2)
    steady(t, 0, 500, wait=1.5, in_flight=0)  # over half of 2 s, under 2 s
    assert decide(t, BOUNDS, 500.0).delta == 0


def test_bounds_every_count():
    """Every min/max a catalog entry may hold and every replica count: below the floor one
    more, above the ceiling one fewer, at once; within them whatever the traffic, never out."""
    for lo, hi, r in itertools.product(range(5), range(5), range(7)):
        if hi and hi < lo:
            continue
        b = Bounds(lo, hi, slots=4)
        assert b.floor == max(lo, 1) and b.ceiling == (hi or b.floor) and b.floor <= b.ceiling
        for wait, in_flight in ((60.0, 100), (0.0, 0)):
            t = traffic(replicas=r, since=0.0)
            steady(t, 0, 300, wait=wait, in_flight=in_flight)
            d = decide(t, b, 300.0)
            if r < b.floor:
                assert d.delta == +1, (lo, hi, r)
            elif r > b.ceiling:
                assert d.delta == -1, (lo, hi, r)
            else:
                assert b.floor <= r + d.delta <= b.ceiling, (lo, hi, r, wait)
                assert d.delta == (+1 if wait and r < b.ceiling else -1 if not wait and r > b.floor else 0)


def test_requests_that_arrived_before_the_window_do_not_count():
    """A burst held while the model loaded (or served by the replicas before the last
    change) waited long for reasons another replica does not cure."""
    t = traffic(since=100.0)
    for i in range(50):
        t.waited(100.5 + i / 10, 60.0)  # first tokens after the load, for requests that arrived during it
    assert decide(t, BOUNDS, 130.0).delta == 0
    steady(t, 110, 130, wait=5.0, in_flight=8)
    assert decide(t, BOUNDS, 130.0).delta == +1


def test_no_change_in_a_window_that_has_not_run():
    t = traffic(replicas=2, since=100.0)
    steady(t, 0, 100, wait=60.0, in_flight=100)  # before the window: not this replica count's traffic
    assert decide(t, BOUNDS, 129.0) == Decision(0, "")


# -- traces -----------------------------------------------------------------------------------------

# a trace: phases of steady traffic, each (how long, the gap between requests, their wait,
# requests in flight)
phases = st.lists(st.tuples(st.floats(1.0, 300.0), st.floats(0.2, 5.0), st.floats(0.0, 10.0), st.integers(0, 12)),
                  min_size=1, max_size=10)


def replay(trace, bounds: Bounds, wait_range=None) -> list[tuple[float, int]]:
    """Play the phases, deciding at each request and acting on it as the controller does:
    the changes made. With `wait_range` (low, high), the waits are scaled into it."""
    t = traffic(replicas=bounds.floor)
    now, changes = 0.0, []
    for length, gap, wait, in_flight in trace:
        if wait_range is not None:
            wait = wait_range[0] + wait / 10 * (wait_range[1] - wait_range[0])
        end = now + length
        while now < end:
            now += gap
            t.in_flight(now, in_flight)
            t.waited(now, wait)
            d = decide(t, bounds, now)
            if d.delta:
                changes.append((now, d.delta))
                t.changed(now, t.replicas + d.delta)
    return changes


@settings(max_examples=200, deadline=None)
@given(phases, st.integers(0, 3), st.integers(0, 4))
def test_any_trace_one_change_per_window_within_bounds(trace, lo, extra):
    b = Bounds(lo, lo + extra, slots=8)
    replicas, last = b.floor, None
    for when, delta in replay(trace, b):
        replicas += delta
        assert b.floor <= replicas <= b.ceiling
        if last is not None:
            assert when - last >= POLICY.window
        last = when


@settings(max_examples=200, deadline=None)
@given(phases, st.integers(0, 3))
def test_waits_around_the_threshold_never_flap(trace, lo):
    """Waits anywhere from just over half the threshold to well past it: replicas may grow,
    and never come back down (that needs waits under half the threshold)."""
    b = Bounds(lo, 6, slots=4)
    changes = replay(trace, b, wait_range=(POLICY.up_wait * 0.51, POLICY.up_wait * 1.5))
    assert all(delta == +1 for _, delta in changes)
