"""The side channel of a group: TCP between rank 0 and each member, authenticated with
the join token (`wire.py`'s handshake), beside MLX's collectives.

It carries what is not a tensor: the start-up agreement (which layers each rank holds,
how many KV blocks), each step's plan, the "my hidden state is on its way" notices that
let a rank post its MLX receive only when the data is coming (a posted ring receive spins
a core while it waits) or say that the step failed instead (`StepFailed`: the group goes
on), the mirrored-state checksums in debug runs, heartbeats, and shutdown. A notice
between two members goes through rank 0 (a star: one listening port, one place that
checks tokens).

Nothing here waits for ever: every wait has a deadline, a closed connection is noticed
at once, and a silent peer (stopped, wedged, cut off) within `timeout` seconds, through
heartbeats. That holds from a member's join on, not only once the group serves: each
connection is read on a thread of its own from then, so a member that dies while the
group starts is noticed at once too. A member gone while rank 0 still admits is dropped,
and may join again (restarted); gone later, the group is lost. What to do then is the
caller's `on_lost` (the group's processes exit, so that whatever started them starts the
group again: a blocked MLX collective cannot be cancelled).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from cluster.exit_codes import EXIT_PERMANENT, EXIT_TRANSIENT, describe
from cluster.worker.group import wire
from cluster.worker.group.config import GroupOptions, require_join_token
from cluster.worker.group.progress import StepProgress

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # a ping from rank 0 every second; members answer at once
HANDSHAKE_S = GroupOptions.handshake_timeout  # an unauthenticated peer's time for the whole handshake
MAX_PENDING_HANDSHAKES = 16  # handshakes at once while the members join
MAX_PENDING_PER_ADDRESS = 4  # of them from one peer address (strangers on a member's own machine included)
JOIN_RETRY_FIRST_S = 0.1  # a member's first wait before trying again; doubled each try, with jitter
JOIN_RETRY_MAX_S = 2.0
SHUTDOWN_SEND_S = 1.0  # rank 0's orderly end waits this long at most to tell each member
START_BACKSTOP_S = 5.0  # a start's watchdog fires this long past the join deadline: the waits say why first


class _Conn:
    """One authenticated connection: sends under a lock (several threads send)."""

    def __init__(self, sock: socket.socket, rank: int, info: dict):
        self.sock = sock
        self.rank = rank
        self.info = info
        self.lock = threading.Lock()
        self.last_heard = time.monotonic()

    def send(self, kind: int, payload: bytes = b"") -> None:
        data = wire.frame(kind, payload)
        with self.lock:
            self.sock.sendall(data)

    def send_within(self, seconds: float, kind: int, payload: bytes = b"") -> None:
        """`send`, given up (TimeoutError) past `seconds`: waiting for the lock (another
        sender stuck on a peer that reads nothing) and sending alike."""
        self.send_frame_within(seconds, wire.frame(kind, payload))

    def send_frame_within(self, seconds: float, data: bytes) -> None:
        if not self.lock.acquire(timeout=seconds):
            raise TimeoutError(f"rank {self.rank}'s connection is busy")
        try:
            self.sock.settimeout(seconds)
            self.sock.sendall(data)
        finally:
            self.lock.release()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


EXIT_GROUP_LOST = EXIT_TRANSIENT  # the group lost a member: start the whole group again


def _exit_lost(reason: str, code: int = EXIT_GROUP_LOST) -> None:
    if code == EXIT_PERMANENT:
        log.error("worker group lost: %s; exiting for good (%s)", reason, describe(code))
    else:
        log.error("worker group lost: %s; exiting so that the whole group is started again", reason)
    logging.shutdown()
    os._exit(code)


class StepFailed(RuntimeError):
    """A pipeline rank's step raised, and it said so (FAILED) in place of sending its hidden
    state: every rank is done with that step and the ranks are still in step, so the group
    goes on; the step's requests are the engine's to sort out, as for any failed step. The
    message is the failing rank's cause."""


class HandshakeSlots:
    """The handshakes under way on rank 0's join port, bounded per peer address and in
    total. A connection past a bound takes the slot of the oldest handshake of the address
    that holds the most: a stranger that connects and stalls keeps its slot only until
    someone needs it (or its handshake's deadline passes), while a member's handshake takes
    a round trip, so strangers cannot keep a member out, from its own address or another."""

    def __init__(self, per_address: int = MAX_PENDING_PER_ADDRESS, total: int = MAX_PENDING_HANDSHAKES):
        self.per_address = per_address
        self.total = total
        self.dropped = 0  # handshakes that gave their slot to a newer one
        self._lock = threading.Lock()
        self._pending: dict[object, str] = {}  # connection -> its peer's address, oldest first
        self._gave_way: set = set()  # dropped, not yet released by their threads

    def add(self, conn, address: str) -> list:
        """Take a slot for `conn`; returns the connections whose slots it took (to be shut)."""
        with self._lock:
            ours = [c for c, a in self._pending.items() if a == address]
            if len(ours) >= self.per_address:
                out = [ours[0]]
            elif len(self._pending) >= self.total:
                busiest = max(Counter(self._pending.values()).items(), key=lambda kv: kv[1])[0]
                out = [next(c for c, a in self._pending.items() if a == busiest)]
            else:
                out = []
            for c in out:
                del self._pending[c]
                self._gave_way.add(c)
            self.dropped += len(out)
            self._pending[conn] = address
            return out

    def release(self, conn) -> bool:
        """Give `conn`'s slot back; True when `add` had already taken it for another."""
        with self._lock:
            self._pending.pop(conn, None)
            if conn in self._gave_way:
                self._gave_way.discard(conn)
                return True
            return False

    def __len__(self) -> int:
        return len(self._pending)


def _shut(sock: socket.socket) -> None:
    """Wake whatever thread reads `sock` (it closes it): closing it here could close a
    descriptor number that thread's next call finds reused."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _take(inbox: queue.Queue, kind: int, deadline: float, lost: Callable[[], str], late: str) -> dict:
    """A start-up message of `kind` (JSON) from `inbox`, which a reader thread fills with
    (kind, payload) or the peer's failure (raised): by `deadline` (TimeoutError, `late`),
    unless the group is lost first (ConnectionError; `lost()` says why, "" while it is not)."""
    while True:
        try:
            got = inbox.get(timeout=0.25)
            break
        except queue.Empty:
            if lost():
                raise ConnectionError(f"the group is lost: {lost()}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(late) from None
    if isinstance(got, Exception):
        raise got
    got_kind, payload = got
    if got_kind != kind:
        raise wire.ProtocolError(f"expected {wire.KIND_NAMES[kind]}, got {wire.KIND_NAMES[got_kind]}")
    return wire.loads(payload)


class Leader:
    """Rank 0's end: listens, admits `size - 1` members, then serves them. Each member's
    connection is read (and pinged) from its join on."""

    def __init__(self, address: tuple[str, int], size: int, token: str, timeout: float,
                 on_lost: Callable[[str], None] | None = None, handshake_timeout: float = HANDSHAKE_S):
        """`on_lost`: what to do when the group is lost (default: exit, 78 when a member
        said its failure is permanent, else 75)."""
        require_join_token(token)
        self.size = size
        self.token = token
        self.timeout = timeout
        self.on_lost = on_lost or self._exit
        self.handshake_timeout = handshake_timeout
        self.handshakes = HandshakeSlots()
        self.members: dict[int, _Conn] = {}
        self._joined = threading.Lock()  # members and _admitting, while admit runs
        self._admitting = True
        self.ready: queue.Queue = queue.Queue()  # notices addressed to rank 0: (step, from, FAILED's cause or None)
        self.acks: dict[int, queue.Queue] = {}  # per member: ACK (step, checksum)
        self.progress = StepProgress(size)  # each member's part of each step, from the notices
        self.startup: dict[int, queue.Queue] = {}  # per member: its start-up replies (kind, payload), or its failure
        self.failure: wire.Refused | None = None  # a member's start failure, as it told rank 0
        self.stop_asked: str | None = None  # a member asked for an orderly stop (STOP): which, and why
        self._on_stop: Callable[[str], None] | None = None
        self.bytes_sent = 0
        self.lost_reason = ""
        self._lost = threading.Event()
        self._on_sleep: Callable[[int, bool], None] | None = None  # see on_sleep
        # kv_read_done(rank, ticket, good): a member's answer to a disk read (group/kv.py)
        self.kv_read_done: Callable[[int, int, int], None] | None = None
        self._closing = False
        self._serving = False
        self._beating = False
        self._listener = socket.create_server(address, reuse_port=False)
        self.address = self._listener.getsockname()[:2]

    # -- start-up --------------------------------------------------------------------------------
    def admit(self, deadline: float) -> None:
        """Accept and authenticate until every rank 1..size-1 has joined once. Each
        connection's handshake runs on a thread of its own, with `handshake_timeout` for
        the whole exchange (not for each read): a peer that connects and stalls, or sends
        a byte now and then, delays no member. A peer that fails it is dropped with one log
        line, the wait goes on; handshakes at once are bounded (`HandshakeSlots`)."""
        self._listener.settimeout(0.25)
        self._start_heartbeat()
        try:
            while True:
                with self._joined:  # complete, and closed to newcomers, at once: a member dropped meanwhile is seen
                    if len(self.members) >= self.size - 1:
                        self._admitting = False
                        return
                if time.monotonic() > deadline:
                    with self._joined:
                        missing = sorted(set(range(1, self.size)) - set(self.members))
                    raise TimeoutError(f"group members {missing} did not join {self.address[0]}:{self.address[1]} "
                                       "in time")
                try:
                    sock, peer = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._closing:  # closed while admitting: an orderly end
                        return
                    raise
                for other in self.handshakes.add(sock, peer[0]):
                    _shut(other)
                threading.Thread(target=self._admit_one, args=(sock, peer), name="orchard-group-join",
                                 daemon=True).start()
        finally:
            with self._joined:
                self._admitting = False
            self._listener.close()

    def _admit_one(self, sock: socket.socket, peer) -> None:
        try:
            conn = self._handshake(sock, time.monotonic() + self.handshake_timeout)
        except Exception as e:  # noqa: BLE001  (a stranger's bytes: one line, never a traceback)
            if self.handshakes.release(sock):
                reason = "its slot went to a newer connection (too many handshakes at once)"
            elif isinstance(e, TimeoutError):
                reason = f"no handshake within {self.handshake_timeout:g} s"
            elif isinstance(e, (OSError, wire.ProtocolError)):
                reason = str(e) or type(e).__name__
            else:
                reason = f"{type(e).__name__}: {e}"
            log.warning("group: refused a connection from %s: %s", peer[0], reason)
            sock.close()
            return
        log.info("group: rank %d joined from %s (%s)", conn.rank, peer[0], conn.info.get("host", "?"))

    def _handshake(self, sock: socket.socket, deadline: float) -> _Conn:
        """Authenticate a peer (`wire.py`'s handshake) by `deadline`; on success it is a member."""
        hello = wire.loads(wire.expect(sock, wire.HELLO, wire.MAX_HANDSHAKE, deadline))
        wire.check_hello(hello)
        rank, nonce = hello["rank"], hello["nonce"]
        mine = secrets.token_hex(16)
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        sock.sendall(wire.frame(wire.CHALLENGE, wire.dumps(
            {"nonce": mine, "proof": wire.leader_proof(self.token, nonce, mine)})))
        auth = wire.loads(wire.expect(sock, wire.AUTH, wire.MAX_HANDSHAKE, deadline))
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        if not wire.proofs_match(auth.get("proof"), wire.member_proof(self.token, rank, mine, nonce)):
            sock.sendall(wire.error_frame("the join token does not match", permanent=True))
            raise wire.ProtocolError(f"rank {rank} presented a wrong join token")
        if hello.get("size") != self.size or not 1 <= rank < self.size:
            msg = f"rank {rank} of a group of {hello.get('size')}: this group has {self.size} ranks"
            sock.sendall(wire.error_frame(msg, permanent=True))
            raise wire.ProtocolError(msg)
        if self.handshakes.release(sock):  # its slot was taken meanwhile, and the connection shut
            raise wire.ProtocolError("its slot went to a newer connection (too many handshakes at once)")
        with self._joined:  # one connection per rank, and none once the group is complete
            if rank in self.members or not self._admitting:
                sock.sendall(wire.error_frame(f"rank {rank} has already joined", permanent=False))
                raise wire.ProtocolError(f"rank {rank} joined twice")
            sock.sendall(wire.frame(wire.WELCOME))
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self.members[rank] = _Conn(sock, rank, hello)
            self.acks[rank] = queue.Queue()
            self.startup[rank] = queue.Queue()
            threading.Thread(target=self._read, args=(conn,), name=f"orchard-group-r{rank}", daemon=True).start()
        return conn

    def broadcast(self, kind: int, payload: bytes = b"") -> None:
        for conn in self.members.values():
            self._send(conn, kind, payload)

    def gather(self, kind: int, deadline: float) -> dict[int, dict]:
        """One start-up message of `kind` from every member (JSON), by `deadline`: a
        member's failure (its ERROR) is raised as it said it (`wire.Refused`), a group
        lost meanwhile as ConnectionError."""
        return {rank: _take(self.startup[rank], kind, deadline, lambda: self.lost_reason,
                            f"group rank {rank} did not answer {wire.KIND_NAMES[kind]} in time")
                for rank in sorted(self.members)}

    # -- serving -------------------------------------------------------------------------------
    def serve(self) -> None:
        """The group has started: from now on a member's start-up message is a protocol
        error, and the heartbeat runs (it does from `admit` on)."""
        self._serving = True
        self._start_heartbeat()

    def on_stop(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` when a member asks for an orderly stop (at once if one has)."""
        self._on_stop = callback
        if self.stop_asked is not None:
            callback(self.stop_asked)

    def _start_heartbeat(self) -> None:
        if not self._beating:
            self._beating = True
            threading.Thread(target=self._heartbeat, name="orchard-group-heartbeat", daemon=True).start()

    def _read(self, conn: _Conn) -> None:
        try:
            while True:
                kind, flags, payload = wire.read_frame(conn.sock)
                conn.last_heard = time.monotonic()
                if kind in (wire.READY, wire.FAILED):
                    step, src, dst, cause = wire.read_notice(kind, payload)
                    self.progress.finished(src, step, conn.last_heard)
                    if dst == 0:
                        self.ready.put((step, src, cause))
                    else:  # a notice between two members: passed on
                        self._send(self.members[dst], kind, payload)
                elif kind == wire.ACK:
                    self.acks[conn.rank].put(wire.ACK_MSG.unpack(payload))
                elif kind == wire.KV_READ_DONE and self.kv_read_done is not None:
                    self.kv_read_done(conn.rank, *wire.read_kv_read_done(payload))
                elif kind == wire.PONG:
                    pass
                elif kind == wire.SLEEP:
                    self._member_sleeps(conn, payload == wire.SLEEPING)
                elif kind == wire.STOP:
                    self._stop_asked(conn.rank, payload.decode(errors="replace"))
                elif kind == wire.ERROR:
                    raise wire.Refused(f"rank {conn.rank} failed: {payload.decode(errors='replace')}",
                                       permanent=bool(flags & wire.PERMANENT))
                elif kind == wire.LOADED and not self._serving:
                    self.startup[conn.rank].put((kind, payload))
                else:
                    raise wire.ProtocolError(f"rank {conn.rank} sent {wire.KIND_NAMES[kind]} "
                                             + ("while serving" if self._serving else "while the group starts"))
        except (OSError, wire.ProtocolError, KeyError, ValueError) as e:
            if self._drop(conn, str(e) or type(e).__name__):
                return
            if isinstance(e, wire.Refused) and not self._serving:  # for `gather`, and the exit code
                self.failure = e
                self.startup[conn.rank].put(e)
            self.lose(f"rank {conn.rank}: {e}")

    def on_sleep(self, callback: Callable[[int, bool], None]) -> None:
        """`callback(rank, sleeping)` when a member's Mac is about to sleep (True: it
        returns once the group is drained; the member is then told) or is awake again.
        It runs on a thread of its own: the member's reader goes on meanwhile."""
        self._on_sleep = callback

    def _member_sleeps(self, conn: _Conn, sleeping: bool) -> None:
        log.warning("group: rank %d's Mac is %s", conn.rank, "going to sleep: draining" if sleeping else "awake again")
        callback = self._on_sleep

        def run() -> None:
            try:
                if callback is not None:
                    callback(conn.rank, sleeping)
            except Exception:  # the member's sleep waits for the answer all the same
                log.exception("group: draining for rank %d's sleep failed", conn.rank)
            if sleeping:
                self._send(conn, wire.SLEEP, wire.SLEEPING)

        threading.Thread(target=run, name=f"orchard-group-sleep-r{conn.rank}", daemon=True).start()

    def _stop_asked(self, rank: int, why: str) -> None:
        reason = f"rank {rank} asked the group to stop" + (f" ({why})" if why else "")
        log.warning("group: %s: draining, then stopping every rank", reason)
        if self.stop_asked is None:
            self.stop_asked = reason
            if self._on_stop is not None:
                self._on_stop(reason)

    def _drop(self, conn: _Conn, reason: str) -> bool:
        """A member gone (closed, silent, failed) while rank 0 still admits: dropped, so
        that it can join again (restarted). False once the group is complete: lost then."""
        with self._joined:
            if not self._admitting:
                return False
            if self.members.get(conn.rank) is conn:
                del self.members[conn.rank]
            else:  # dropped already
                return True
        conn.close()
        log.warning("group: rank %d left before the group formed (%s); waiting for it to join again", conn.rank,
                    reason)
        return True

    def _heartbeat(self) -> None:
        n = 0
        while not self._lost.is_set() and not self._closing:
            n += 1
            with self._joined:
                conns = list(self.members.values())
            for conn in conns:
                self._send(conn, wire.PING, wire.PING_MSG.pack(n))
            now = time.monotonic()
            for conn in conns:
                silent = now - conn.last_heard
                if silent > self.timeout:
                    reason = f"rank {conn.rank} has been silent for {silent:.0f} s (stopped, wedged or cut off)"
                    if not self._drop(conn, reason):
                        self.lose(reason)
                        return
            self._lost.wait(HEARTBEAT_S)

    def _send(self, conn: _Conn, kind: int, payload: bytes = b"") -> None:
        try:
            conn.send(kind, payload)
            self.bytes_sent += wire.FRAME.size + len(payload)
        except OSError as e:
            if not self._drop(conn, str(e)):
                self.lose(f"rank {conn.rank}: {e}")

    def wait_ready(self, step: int, src: int, timeout: float) -> None:
        """Block until rank `src` says step `step`'s hidden state is on its way; StepFailed
        with the cause when it says the step failed instead."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self._lost.is_set():
                raise ConnectionError("the group is lost")
            try:
                got = self.ready.get(timeout=max(0.0, min(left, 0.5)))
            except queue.Empty:
                if left <= 0:
                    self.lose(f"rank {src} did not finish step {step} within {timeout:.0f} s")
                    raise ConnectionError("the group is lost") from None
                continue
            _check_notice(got, step, src, self.lose)
            return

    def wait_ack(self, rank: int, step: int, timeout: float) -> int:
        """Rank `rank`'s checksum of step `step` (debug runs)."""
        try:
            got_step, crc = self.acks[rank].get(timeout=timeout)
        except queue.Empty:
            self.lose(f"rank {rank} did not acknowledge step {step} within {timeout:.0f} s")
            raise ConnectionError("the group is lost") from None
        if got_step != step:
            self.lose(f"rank {rank} acknowledged step {got_step} where {step} was due")
            raise ConnectionError("the group is lost")
        return crc

    def lose(self, reason: str) -> None:
        if self._closing or self._lost.is_set():
            return
        self.lost_reason = reason
        self._lost.set()
        for conn in list(self.members.values()):  # best effort: members exit on the closed connection anyway
            conn.close()
        self.on_lost(reason)

    def _exit(self, reason: str) -> None:
        _exit_lost(reason, EXIT_PERMANENT if self.failure is not None and self.failure.permanent else EXIT_GROUP_LOST)

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def refuse(self, reason: str, permanent: bool) -> None:
        """The group cannot start: every member is told why (an ERROR, flagged permanent
        when starting again cannot help, so that it exits 78 as rank 0 does), each within
        a second, then the connections close."""
        self._closing = True
        data = wire.error_frame(reason, permanent)
        for conn in self.members.values():
            try:
                conn.send_frame_within(SHUTDOWN_SEND_S, data)
            except OSError:
                pass
            conn.close()
        try:
            self._listener.close()
        except OSError:
            pass

    def close(self, shutdown: bool = True) -> None:
        """An orderly end: members are told to stop (each within a second: a member that
        reads nothing finds its connection closed instead), then the connections close.
        `shutdown=False` (a start that failed): the connections only close, and the
        members exit as from a lost group (to be started again)."""
        if self._lost.is_set():
            return
        self._closing = True
        with self._joined:
            conns = list(self.members.values())
        for conn in conns if shutdown else ():
            try:
                conn.send_within(SHUTDOWN_SEND_S, wire.SHUTDOWN)
            except OSError:
                pass
        for conn in conns:
            conn.close()
        try:
            self._listener.close()
        except OSError:
            pass


class Member:
    """A member's end: joins rank 0, then (`listen`) reads everything rank 0 sends on a
    thread of its own: the start-up messages (`receive`), plans, notices, pings."""

    def __init__(self, address: tuple[str, int], rank: int, size: int, token: str, timeout: float,
                 info: dict | None = None, on_lost: Callable[[str], None] = _exit_lost,
                 handshake_timeout: float = HANDSHAKE_S):
        require_join_token(token)
        self.address = address
        self.rank = rank
        self.size = size
        self.token = token
        self.timeout = timeout
        self.info = info or {}
        self.on_lost = on_lost
        self.handshake_timeout = handshake_timeout
        self.plans: queue.Queue = queue.Queue()  # (kind, payload): STEP, a KV message or SHUTDOWN
        self.startup: queue.Queue = queue.Queue()  # (kind, payload): ASSIGN, RING, START (or SHUTDOWN)
        self.ready: queue.Queue = queue.Queue()  # notices for this rank: (step, from, FAILED's cause or None)
        self.last_heard = time.monotonic()
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self._done = False
        self._drained = threading.Event()  # rank 0 answered SLEEP: the group is drained
        self.lost_reason = ""  # why rank 0 is gone, once it is
        self._listening = False

    def join(self, deadline: float) -> None:
        """Connect and authenticate by `deadline`. Rank 0 may not listen yet, or may drop the
        connection (restarting, or busy with strangers): each failed try is tried again,
        after a backoff with jitter, until `deadline`. A refusal by rank 0 (a wrong token,
        rank or size) or a rank 0 that cannot prove the token ends it at once."""
        delay = JOIN_RETRY_FIRST_S
        told = False
        while True:
            try:
                self.sock = self._try_join(deadline)
                return
            except wire.Refused:
                raise
            except (OSError, wire.ProtocolError) as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"could not join group rank 0 at {self.address[0]}:{self.address[1]}: "
                                       f"{e or type(e).__name__}") from None
                if not told:
                    log.info("group: rank 0 at %s:%d not joined yet (%s); trying again until the join deadline",
                             *self.address, e or type(e).__name__)
                    told = True
                time.sleep(min(left, random.uniform(delay / 2, delay)))
                delay = min(2 * delay, JOIN_RETRY_MAX_S)

    def _try_join(self, deadline: float) -> socket.socket:
        """One connection and handshake, within `handshake_timeout` (and `deadline`)."""
        until = min(deadline, time.monotonic() + self.handshake_timeout)
        sock = socket.create_connection(self.address, timeout=max(0.01, until - time.monotonic()))
        try:
            nonce = secrets.token_hex(16)
            sock.sendall(wire.frame(wire.HELLO, wire.dumps({**self.info, "rank": self.rank, "size": self.size,
                                                            "nonce": nonce})))
            challenge = wire.loads(wire.expect(sock, wire.CHALLENGE, wire.MAX_HANDSHAKE, until))
            theirs = challenge.get("nonce")
            if not isinstance(theirs, str) or not wire.proofs_match(challenge.get("proof"),
                                                                    wire.leader_proof(self.token, nonce, theirs)):
                raise wire.Refused("rank 0 does not hold this group's join token", permanent=True)
            sock.settimeout(max(0.01, until - time.monotonic()))
            sock.sendall(wire.frame(wire.AUTH, wire.dumps(
                {"proof": wire.member_proof(self.token, self.rank, theirs, nonce)})))
            wire.expect(sock, wire.WELCOME, wire.MAX_HANDSHAKE, until)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def send(self, kind: int, payload: bytes = b"") -> None:
        data = wire.frame(kind, payload)
        with self.lock:
            self.sock.sendall(data)

    def send_error(self, reason: str, permanent: bool = False) -> None:
        """Tell rank 0 why this rank cannot go on (best effort: it may be gone already).
        This rank is ending: rank 0 closing the connection now is no loss to report."""
        self._done = True
        if self.sock is None:
            return
        try:
            with self.lock:
                self.sock.sendall(wire.error_frame(reason, permanent))
        except OSError:
            pass

    def ask_to_stop(self, why: str = "") -> bool:
        """Ask rank 0 for an orderly stop (STOP): it drains, then sends every rank SHUTDOWN.
        False when there is no rank 0 to ask (not joined, or its connection gone)."""
        if self.sock is None or self._done:
            return False
        try:
            self.send(wire.STOP, why.encode()[:1000])
        except OSError:
            return False
        return True

    def receive(self, kind: int, deadline: float) -> dict:
        """One start-up message (JSON), by `deadline` (after `listen`)."""
        return _take(self.startup, kind, deadline, lambda: self.lost_reason,
                     f"rank 0 sent no {wire.KIND_NAMES[kind]} in time")

    def listen(self) -> None:
        """Read rank 0's messages, and watch for its silence, from now on (right after `join`)."""
        if self._listening:
            return
        self._listening = True
        self.last_heard = time.monotonic()
        threading.Thread(target=self._read, name="orchard-group-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="orchard-group-watch", daemon=True).start()

    def serve(self) -> None:
        """`listen`, for a member that read nothing while it started (as tests' members do)."""
        self.listen()

    def _read(self) -> None:
        try:
            while True:
                kind, flags, payload = wire.read_frame(self.sock)
                self.last_heard = time.monotonic()
                if kind == wire.PING:
                    self.send(wire.PONG, payload)
                elif kind in (wire.READY, wire.FAILED):
                    step, src, _, cause = wire.read_notice(kind, payload)
                    self.ready.put((step, src, cause))
                elif kind == wire.SLEEP:
                    self._drained.set()
                elif kind in (wire.ASSIGN, wire.RING, wire.START):
                    self.startup.put((kind, payload))
                elif kind == wire.ERROR:  # rank 0 refused to start the group (`Leader.refuse`), saying why
                    self.startup.put(wire.Refused(f"rank 0 failed: {payload.decode(errors='replace')}",
                                                  permanent=bool(flags & wire.PERMANENT)))
                    return
                elif kind in wire.KV_KINDS:  # run in order with the steps
                    self.plans.put((kind, payload))
                elif kind in (wire.STEP, wire.SHUTDOWN):
                    self.plans.put((kind, payload))
                    if kind == wire.SHUTDOWN:
                        self.startup.put((kind, payload))  # rank 0 stopped before the group started
                        self._done = True
                        return
                else:
                    raise wire.ProtocolError(f"rank 0 sent {wire.KIND_NAMES[kind]}")
        except (OSError, wire.ProtocolError, ValueError) as e:
            if not self._done:
                self._lose(f"rank 0: {e}")

    def _watch(self) -> None:
        while not self._done:
            silent = time.monotonic() - self.last_heard
            if silent > self.timeout:
                self._lose(f"rank 0 has been silent for {silent:.0f} s (stopped, wedged or cut off)")
                return
            time.sleep(0.5)

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        self.on_lost(reason)

    def wait_ready(self, step: int, src: int, timeout: float) -> None:
        """As `Leader.wait_ready`: StepFailed when rank `src`'s step failed."""
        try:
            got = self.ready.get(timeout=timeout)
        except queue.Empty:
            self.on_lost(f"rank {src} did not finish step {step} within {timeout:.0f} s")
            raise ConnectionError("the group is lost") from None
        _check_notice(got, step, src, self.on_lost)

    def notify_ready(self, step: int, dst: int) -> None:
        self.send(wire.READY, wire.READY_MSG.pack(step, self.rank, dst))

    def sleeping(self, timeout: float) -> bool:
        """Tell rank 0 this Mac is about to sleep; whether it drained the group within
        `timeout` seconds."""
        self._drained.clear()
        self.send(wire.SLEEP, wire.SLEEPING)
        return self._drained.wait(timeout)

    def awake(self) -> None:
        self.send(wire.SLEEP, wire.AWAKE)

    def notify_failed(self, step: int, dst: int, cause: str) -> None:
        """In place of `notify_ready` (and the hidden state): this rank's step failed, or the
        one before it did (`cause` passed on)."""
        self.send(wire.FAILED, wire.failed_payload(step, self.rank, dst, cause))

    def close(self) -> None:
        self._done = True
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass


def _check_notice(got: tuple[int, int, str | None], step: int, src: int, lose: Callable[[str], None]) -> None:
    """A notice waited for: step `step` from rank `src`, or the group is lost (ConnectionError);
    StepFailed when it is a FAILED."""
    if got[:2] != (step, src):
        lose(f"out of order: waited for step {step} from rank {src}, got step {got[0]} from rank {got[1]}")
        raise ConnectionError("the group is lost")
    if got[2] is not None:
        raise StepFailed(got[2])


class Watchdog:
    """A deadline on whatever the group is doing (joining, loading, a step): past it,
    `on_lost` (a blocked collective cannot be cancelled, so the process ends)."""

    def __init__(self, on_lost: Callable[[str], None] = _exit_lost):
        self.on_lost = on_lost
        self._deadline: float | None = None
        self._what = ""
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="orchard-group-watchdog", daemon=True).start()

    def arm(self, seconds: float, what: str) -> None:
        self._what = what
        self._deadline = time.monotonic() + seconds

    def disarm(self) -> None:
        self._deadline = None

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._stop.set()
                self.on_lost(f"{self._what} did not finish in time")
                return
