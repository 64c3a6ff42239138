"""The engine thread: owns the engine and every MLX call; talks through two queues.

In: small dataclass messages on a thread-safe inbox (`submit`). The thread drains the
whole inbox before every step, and blocks on it only when nothing is runnable. After a
step that finished requests it first waits up to `finish_wait_ms` for as many new ones:
closed-loop clients come back a few ms after their last token, and would otherwise wait
for the whole next step (a prefill step, long on a CPU) before joining one.
Out: after each step, one call of the event sink, `sink(timestamp, events)`, with
everything the step produced (engine `RequestOutput`s, `Scheduled`, `Rejected`,
`Failed`). The sink decides how to cross into its own world (the worker's service uses
`call_soon_threadsafe`). Nothing here knows about gRPC or asyncio, and the engine is used
only through its protocol (`EngineProtocol`: `add_request`, `abort`, `abort_all`, `step`,
`has_unfinished`, `num_waiting`, `is_waiting`, `live_request_ids`, `request_state`).
What the thread keeps between rounds of work is one `LoopState`.

A failed step does not fail its whole batch: its requests come back one at a time, each
resumed exactly after the tokens its client has, until one fails a step on its own (the
cause, failed alone) or all went through (see `CulpritSearch`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from cluster.platform import give_back_freed_memory
from cluster.worker.config import WorkerOptions
from cluster.worker.engine import QueueFullError, RequestOutput
from cluster.worker.engine_protocol import EngineProtocol
from cluster.worker.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# Seconds without a message after which the idle engine thread gives MLX's buffer cache back.
IDLE_RELEASE_SECONDS = 1.0
# A round of work counts as stalled past max(stall_report, STALL_STEP_FACTOR x the slowest
# recent round): a model whose legitimate steps are slow (a big one on a Mac) gets room.
STALL_STEP_FACTOR = 5.0
STEP_WINDOW = 256  # rounds per window of "recent" step times
# A round past this many times the usual one, a third of --stall-report and the longest
# recent round (or the warm-up's full prefill step) is lagging: not yet a stall, but new
# requests are better placed on another worker meanwhile (and those that have not started
# moved there: a step of a length seen lately is the workload's, and its requests stay).
LAG_STEP_FACTOR = 4.0
USUAL_WEIGHT = 0.1  # the newest round's weight in the usual round's moving average


class EngineLoadError(RuntimeError):
    """The engine could not be built (the model did not load, or is refused)."""


# -- inbox ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the request reached the worker
    resume_token_ids: tuple[int, ...] = ()  # generated elsewhere; not emitted again


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class KvReadsDone:
    """A disk tier's read finished (posted by a reader thread): the loop wakes to step."""


# -- outbox -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Scheduled:
    """The request was scheduled for the first time (its queue time is over)."""

    request_id: str
    queue_time: float


@dataclass(frozen=True)
class Rejected:
    """add_request refused the request: `error` is a ValueError or QueueFullError."""

    request_id: str
    error: Exception


@dataclass(frozen=True)
class Failed:
    """The engine raised while the request was live; it has been aborted."""

    request_id: str
    message: str


Event = RequestOutput | Scheduled | Rejected | Failed
# Called on the engine thread once per step with (time.monotonic(), that step's events).
EventSink = Callable[[float, list[Event]], None]


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], EngineProtocol], sink: EventSink, faults=None,
                 stall_report: float = WorkerOptions.stall_report):
        self._factory = engine_factory
        self._sink = sink
        self.faults = faults  # cluster.worker.faults.FaultInjection, in fault tests only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="orchard-engine", daemon=True)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.engine: EngineProtocol | None = None  # set once loaded; read-only for other threads
        # time.monotonic() when the current round of work (messages, a step) began; None
        # while the thread waits for work. Written by the engine thread, read by a watchdog.
        self.busy_since: float | None = None
        # The longest round of the current and of the previous STEP_WINDOW rounds: how long
        # a legitimate step of this model on this machine takes. Floats, each written whole
        # by the engine thread and read by the watchdog.
        self._slowest = (0.0, 0.0)
        self.stall_report = stall_report  # seconds: the least a round takes before it is a stall
        # Seconds of the warm-up's full-budget prefill step (set once the engine is warm): the
        # longest step the model may legitimately take, long after the recent ones were short.
        self.full_step = 0.0
        self._rounds = 0
        self._usual = 0.0  # moving average of recent rounds (what the engine usually takes)

    # -- any thread -------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> EngineProtocol:
        """Build the engine on the engine thread; return it once ready (or raise)."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not load in time")
        if self._load_error is not None:
            raise EngineLoadError(str(self._load_error) or type(self._load_error).__name__) from self._load_error
        return self.engine

    def submit(self, msg: AddRequest | AbortRequest | Shutdown | KvReadsDone) -> None:
        self._inbox.put(msg)

    def stop(self, timeout: float | None = 30.0) -> None:
        if self._thread.is_alive():
            self.submit(Shutdown())
            self._thread.join(timeout)
        if not self._thread.is_alive() and self._thread.native_id is not None:
            _wait_os_thread_gone(self._thread.native_id, 5.0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.engine is not None

    @property
    def stall_after(self) -> float:
        """Seconds one round of work may take before the engine counts as stalled:
        `stall_report`, or STALL_STEP_FACTOR x the slowest recent round (or the warm-up's
        full-budget prefill step) if longer."""
        return max(self.stall_report, STALL_STEP_FACTOR * max(*self._slowest, self.full_step))

    def stalled(self, now: float | None = None) -> bool:
        """Whether the engine thread has been in one round of work (a step, or handling
        its messages) for longer than `stall_after`: wedged, while the process lives."""
        since = self.busy_since
        return since is not None and (time.monotonic() if now is None else now) - since > self.stall_after

    @property
    def lag_after(self) -> float:
        """Seconds one round of work may take before the engine counts as lagging:
        LAG_STEP_FACTOR x its usual round, or a third of `stall_report`, or the slowest
        recent round (or the warm-up's full-budget prefill step), whichever is longest; at
        most `stall_after`."""
        return min(self.stall_after, max(self.stall_report / 3, LAG_STEP_FACTOR * self._usual, *self._slowest,
                                         self.full_step))

    def lagging(self, now: float | None = None) -> bool:
        """Whether the current round has run past `lag_after`: new requests would wait for
        it (a long step, or the start of a stall), so another worker should take them."""
        since = self.busy_since
        return since is not None and (time.monotonic() if now is None else now) - since > self.lag_after

    def _round_done(self, took: float) -> None:
        """Remember a round's time; one that was a stall is not a step time (a wedge must
        not make the next one take longer to see)."""
        if took > self.stall_after:
            return
        self._usual = took if not self._usual else (1 - USUAL_WEIGHT) * self._usual + USUAL_WEIGHT * took
        current, previous = self._slowest
        self._rounds += 1
        if self._rounds % STEP_WINDOW == 0:  # a new window: the old one is remembered one window more
            self._slowest = (took, current)
        elif took > current:
            self._slowest = (took, previous)

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        _name_os_thread("orchard-engine")
        try:
            self.engine = self._factory()
            set_wake = getattr(self.engine, "set_wake", None)
            if set_wake is not None:  # a disk tier's reads wake the thread when nothing else runs
                set_wake(lambda: self.submit(KvReadsDone()))
            # what loading freed (dtype conversions, dequantized layers, aligned copies) goes
            # back before serving, so the process's resident memory is its working size
            mx.clear_cache()
            give_back_freed_memory()
        except BaseException as e:  # reported by start()
            self._load_error = e
            return
        finally:
            self._ready.set()
        state = LoopState(self.engine, self.faults)
        while True:
            msgs = self._take_messages(state)
            self.busy_since = now = time.monotonic()
            state.clients.observe(msgs, now)
            events: list[Event] = []
            try:
                if state.handle_all(msgs, events):
                    events += state.shut_down()
                    self._emit(time.monotonic(), events)
                    return
                state.work(events)
            except Exception as e:  # keep serving: isolate the cause, recompute the rest
                events += state.isolate(e)
            if events:
                self._emit(time.monotonic(), events)
            self._round_done(time.monotonic() - now)
            self.busy_since = None

    def _take_messages(self, state: LoopState) -> list:
        """The messages of the next round: with nothing to run, it waits for one; after a
        step that finished requests, for as many new ones, a while (`ClosedLoopClients`);
        then whatever else the inbox holds."""
        msgs = [] if state.has_work() else [self._next_message()]
        if state.clients.worth_waiting() and not state.engine.num_waiting:
            self._wait_for_comebacks(msgs, state.clients)
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _next_message(self) -> AddRequest | AbortRequest | Shutdown:
        """The next message, however long it takes. Once none has come for
        IDLE_RELEASE_SECONDS, MLX's buffer cache is given back first: every buffer a step
        freed stays in it for reuse (on a CPU, as much as the largest steps' activations:
        after a long prompt's prefill, its activations), and a server that is idle holds
        none of it."""
        try:
            return self._inbox.get(timeout=IDLE_RELEASE_SECONDS)
        except queue.Empty:
            pass
        mx.clear_cache()
        give_back_freed_memory()  # what the cache held is free in this thread's heap: to the system
        return self._inbox.get()

    def _wait_for_comebacks(self, msgs: list, clients: ClosedLoopClients) -> None:
        """Take inbox messages until as many new requests arrived as the last step
        finished, a Shutdown comes, or the wait is over."""
        adds = 0
        while adds < clients.expected and (left := clients.deadline - time.monotonic()) > 0:
            try:
                msg = self._inbox.get(timeout=left)
            except queue.Empty:
                return
            msgs.append(msg)
            if isinstance(msg, Shutdown):
                return
            adds += isinstance(msg, AddRequest)

    def _emit(self, now: float, events: list[Event]) -> None:
        try:
            self._sink(now, events)
        except Exception:  # the receiver is gone (shutting down): nothing to deliver to
            log.debug("engine loop: could not deliver %d events", len(events), exc_info=True)


class LoopState:
    """What the engine thread keeps from one round of work to the next, and the round's
    work: the engine, each request's queue and sent counts, the search for the cause of
    a failed step, and whether clients come back as requests finish."""

    def __init__(self, engine: EngineProtocol, faults=None):
        self.engine = engine
        self.faults = faults  # cluster.worker.faults.FaultInjection, in fault tests only
        self.queued: dict[str, float] = {}  # request id -> arrival, until first scheduled (`Scheduled`)
        self.sent: dict[str, int] = {}  # request id -> output tokens its client has (resumed + emitted)
        self.culprits = CulpritSearch()
        self.clients = ClosedLoopClients(engine.config.finish_wait_ms / 1000)

    def has_work(self) -> bool:
        """Something to run without a new message: a live request that is not only
        waiting for its disk reads (their end posts a message), or one still to come back
        after a failed step."""
        runnable = getattr(self.engine, "has_runnable", self.engine.has_unfinished)
        return runnable() or bool(self.culprits.suspects)

    def handle_all(self, msgs: list, events: list[Event]) -> bool:
        """Every inbox message of the round, in order. True means shut down."""
        stop = False
        for msg in msgs:
            stop = self.handle(msg, events) or stop
        return stop

    def handle(self, msg, events: list[Event]) -> bool:
        """One dispatch point for inbox messages. True means shut down."""
        if isinstance(msg, AddRequest):
            if self.culprits.active:
                self.culprits.held.append(msg)  # new work waits until the cause of a failed step is found
            else:
                self.add(msg, events)
        elif isinstance(msg, AbortRequest):
            self.queued.pop(msg.request_id, None)
            self.sent.pop(msg.request_id, None)
            self.culprits.drop(msg.request_id)
            self.engine.abort(msg.request_id)
        elif isinstance(msg, Shutdown):
            return True
        elif isinstance(msg, KvReadsDone):
            pass  # it woke the thread: the next step installs the read
        else:
            log.error("engine loop: unknown message %r", msg)
        return False

    def work(self, events: list[Event]) -> None:
        """After the messages: add what comes back after a failed step, then one step."""
        culprits, engine = self.culprits, self.engine
        for msg in culprits.next_adds():  # searching: the next suspect, or at the end what was held
            self.add(msg, events, returning=culprits.on_probation == msg.request_id)
        if culprits.on_probation is not None and culprits.on_probation not in engine.live_request_ids():
            culprits.on_probation = None  # it could not be added again (failed above): on to the next
        if engine.has_unfinished():
            self.step(events)
            culprits.on_probation = None  # it went through a step: not the cause
            self.clients.finished(time.monotonic(), sum(
                1 for e in events if isinstance(e, RequestOutput) and e.finished and e.finish_reason != "abort"))

    def add(self, msg: AddRequest, events: list[Event], returning: bool = False) -> None:
        """Add a request (`returning`: one coming back after a failed step; its queue time and
        its refusal were dealt with the first time)."""
        try:
            self.engine.add_request(
                msg.request_id, msg.prompt_token_ids, msg.params,
                arrival_time=msg.arrival_time, resume_token_ids=msg.resume_token_ids,
            )
            self.sent[msg.request_id] = len(msg.resume_token_ids)
            if not returning:
                self.queued[msg.request_id] = msg.arrival_time
        except (ValueError, QueueFullError) as e:
            events.append(Rejected(msg.request_id, e) if not returning else Failed(msg.request_id, str(e)))
        except Exception as e:
            log.exception("add_request failed for %s", msg.request_id)
            events.append(Failed(msg.request_id, f"the engine could not take the request: {type(e).__name__}: {e}"))

    def step(self, events: list[Event]) -> None:
        engine = self.engine
        start = time.monotonic()
        slower = self.faults.before_step(engine.live_request_ids()) if self.faults is not None else 0.0
        outputs = engine.step()
        if slower:
            time.sleep((time.monotonic() - start) * (slower - 1))
        for rid, arrival in list(self.queued.items()):  # only requests not yet scheduled
            if not engine.is_waiting(rid):
                events.append(Scheduled(rid, max(0.0, start - arrival)))
                del self.queued[rid]
        for out in outputs:
            if out.finished:
                self.sent.pop(out.request_id, None)
            elif out.request_id in self.sent:
                self.sent[out.request_id] += len(out.new_token_ids)
        events += outputs

    def shut_down(self) -> list[Event]:
        """Every live request, and every one held or still to come back, ends as aborted;
        then the engine closes (`close()`, where it has one: a disk tier's writes land)."""
        gone = self.engine.abort_all() + self.culprits.drop_all()
        close = getattr(self.engine, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("engine: closing failed")
        return [RequestOutput(rid, [], "", True, "abort") for rid in gone]

    def isolate(self, error: Exception) -> list[Event]:
        """After a failed step: fail the request on probation if there was one (it failed
        with only cleared requests beside it: it is the cause); take every other live
        request out, to come back one at a time, each resumed after the tokens its client
        has, so it continues exactly (the same path as a router's resume)."""
        engine, culprits = self.engine, self.culprits
        message = f"the engine failed: {type(error).__name__}: {error}"
        culprit, culprits.on_probation = culprits.on_probation, None
        failed: list[Event] = []
        if culprit is not None:
            log.error("engine: request %s failed a step on probation: failing it (%s)", culprit, message)
            failed.append(Failed(culprit, message))
        else:
            log.exception("engine step failed; its requests come back one at a time to find the cause")
        for rid in engine.live_request_ids():
            if rid == culprit:
                continue
            try:
                prompt, output, params, arrival = engine.request_state(rid)
            except Exception:
                failed.append(Failed(rid, message))
                continue
            culprits.suspects.append(AddRequest(rid, prompt, params, arrival, tuple(output[: self.sent.get(rid, 0)])))
        engine.abort_all()
        for ev in failed:
            self.sent.pop(ev.request_id, None)
        return failed


class CulpritSearch:
    """The search for the request that made a step fail: the step's requests come back one
    at a time (`suspects`), each on probation (`on_probation`) until it has gone through
    one step with only cleared requests beside it. New requests are held meanwhile, so a
    failure is pinned on the one that came back last. When no suspect is left, the held
    requests are added."""

    def __init__(self):
        self.suspects: deque[AddRequest] = deque()
        self.held: list[AddRequest] = []
        self.on_probation: str | None = None  # the request id that came back last, until it passes a step

    @property
    def active(self) -> bool:
        return bool(self.suspects) or self.on_probation is not None

    def next_adds(self) -> list[AddRequest]:
        """What to add before the next step."""
        if self.on_probation is not None:
            return []
        if self.suspects:
            msg = self.suspects.popleft()
            self.on_probation = msg.request_id
            return [msg]
        held, self.held = self.held, []
        return held

    def drop(self, request_id: str) -> None:
        """Its client went away."""
        self.suspects = deque(m for m in self.suspects if m.request_id != request_id)
        self.held = [m for m in self.held if m.request_id != request_id]

    def drop_all(self) -> list[str]:
        ids = [m.request_id for m in (*self.suspects, *self.held)]
        self.suspects.clear()
        self.held.clear()
        return ids


class ClosedLoopClients:
    """Whether this worker's clients send a new request right after one finishes (a
    closed loop: benchmarks, agents, batch jobs), and so whether the loop waits for them
    after a step that finished requests. Each such step opens a window of `wait` seconds;
    requests arriving in it count as comebacks (measured whether or not the loop waited),
    and a moving average of comebacks per finished request decides whether waiting pays.
    With clients that do not come back (open-loop traffic) it stops waiting, so running
    streams do not pay for nothing."""

    def __init__(self, wait: float):
        self.wait = wait
        self.rate = 1.0  # moving average of comebacks per finished request
        self.expected = 0  # requests the last step finished
        self.deadline = 0.0  # end of the last step's window
        self._windows: list[list] = []  # [start, end, finished, comebacks], oldest first

    def finished(self, now: float, n: int) -> None:
        self.expected = n
        if n and self.wait > 0:
            self.deadline = now + self.wait
            self._windows.append([now, self.deadline, n, 0])

    def worth_waiting(self) -> bool:
        return self.expected > 0 and self.wait > 0 and self.rate >= 0.5

    def observe(self, msgs: list, drained_at: float) -> None:
        """Count the new requests among `msgs` (just drained from the inbox) against the
        windows they arrived in; close the windows that ended before this drain."""
        self.expected = 0
        for msg in msgs:
            if isinstance(msg, AddRequest):
                for w in self._windows:
                    if w[0] <= msg.arrival_time <= w[1]:
                        w[3] += 1
                        break
        while self._windows and self._windows[0][1] <= drained_at:
            _, _, n, got = self._windows.pop(0)
            self.rate = 0.7 * self.rate + 0.3 * min(1.0, got / n)


def _wait_os_thread_gone(native_id: int, timeout: float) -> None:
    """`join()` returns before the OS thread runs its C++ thread-local destructors. MLX's
    per-thread compile cache is one of them and takes the GIL to drop Python objects; if
    the interpreter is finalizing by then, that aborts the process (SIGABRT, "terminate
    called without an active exception"). Wait for the thread to be really gone (Linux;
    elsewhere `orchard worker serve` ends with `os._exit` after its orderly shutdown)."""
    task = f"/proc/self/task/{native_id}"
    if not sys.platform.startswith("linux"):
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.002)


def _name_os_thread(name: str) -> None:
    """Show the thread's name in top -H / ps -L (Linux); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
