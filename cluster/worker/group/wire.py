"""The group's side channel, byte for byte: message framing, the join handshake, and each
step's plan. Pure Python and numpy (no MLX, no pickle): what a member decodes is a fixed
header and int32 arrays, or for the start-up messages a small JSON object.

Framing: every message is `FRAME` (magic, version, kind, payload length) and its payload.
A payload is at most `MAX_PAYLOAD` bytes (`MAX_HANDSHAKE` before a peer is authenticated);
a JSON one is nested at most `MAX_JSON_DEPTH` deep.

The join handshake (both sides prove they hold the join token, neither sends it):

    member -> leader  HELLO      {"rank", "size", "nonce", "host", "pid", "memory", ...}
    leader -> member  CHALLENGE  {"nonce", "proof": HMAC(token, "leader" | member nonce | leader nonce)}
    member -> leader  AUTH       {"proof": HMAC(token, "member" | rank | leader nonce | member nonce)}
    leader -> member  WELCOME, or ERROR with the reason (`Refused`)

An ERROR (a refusal, or a rank that could not start) carries the flag `PERMANENT` when
starting again cannot help (`cluster/exit_codes.py`): the receiver then exits 78 too.

A HELLO comes from a peer not yet authenticated: `check_hello` checks its fields' types.

While serving, a pipeline rank tells the next stage READY (step, from, to: its hidden
state is on its way) or FAILED (the same, and the cause: its step raised, and no hidden
state comes); a rank that gets FAILED passes it on in place of its own notice.

A step's plan (`PlanWriter` on rank 0, `PlanReader` on each member): the step's token ids,
and per scheduled sequence its handle (a small int naming it on every rank while it
runs), first position, number of new tokens and recurrent-state slot; the block-table
changes since the members last heard of each sequence (`[handle, offset, n, ids...]`: the
member's table becomes `table[:offset] + ids`); the handles dropped (finished, aborted,
preempted). Members rebuild positions, `cu_seqlens_q`, sequence lengths, block tables and
slot mapping from that and their mirrored tables, exactly as `ModelRunner.prepare` builds
them on rank 0; `checksum` (crc32 of the block tables and slot mapping) lets a debug run
compare the two each step.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np

from cluster.api.errors import BadField
from cluster.api.limits import check_json_depth

MAGIC = b"OGRP"
VERSION = 2  # 2: the disk KV tier's messages (KV_SAVE, KV_READ, KV_READ_DONE, KV_APPLY)
FRAME = struct.Struct("<4sBBHI")  # magic, version, kind, flags (unused), payload length
MAX_PAYLOAD = 1 << 30
MAX_HANDSHAKE = 1 << 16
MAX_JSON_DEPTH = 32  # the start-up messages are a few levels deep
MAX_NONCE = 256

# message kinds
# SLEEP (member -> rank 0): the member's Mac is about to sleep (payload SLEEPING: rank 0
# drains the group and answers SLEEP once it has) or is awake again (AWAKE: it takes
# requests again).
# STOP (member -> rank 0): the member was told to stop (SIGTERM); rank 0 drains, then sends
# every rank SHUTDOWN. Its payload: why, as text.
# KV_SAVE, KV_READ, KV_APPLY (rank 0 -> member) and KV_READ_DONE (member -> rank 0): the
# disk KV tier (group/kv.py), in order with the steps.
(HELLO, CHALLENGE, AUTH, WELCOME, ASSIGN, LOADED, START, STEP, READY, ACK, PING, PONG, SHUTDOWN, ERROR, RING,
 FAILED, SLEEP, STOP, KV_SAVE, KV_READ, KV_READ_DONE, KV_APPLY) = range(1, 23)
KIND_NAMES = {v: k for k, v in dict(HELLO=HELLO, CHALLENGE=CHALLENGE, AUTH=AUTH, WELCOME=WELCOME, ASSIGN=ASSIGN,
                                    LOADED=LOADED, START=START, STEP=STEP, READY=READY, ACK=ACK, PING=PING, PONG=PONG,
                                    SHUTDOWN=SHUTDOWN, ERROR=ERROR, RING=RING, FAILED=FAILED, SLEEP=SLEEP,
                                    STOP=STOP, KV_SAVE=KV_SAVE, KV_READ=KV_READ, KV_READ_DONE=KV_READ_DONE,
                                    KV_APPLY=KV_APPLY).items()}
KV_KINDS = (KV_SAVE, KV_READ, KV_APPLY)  # rank 0's disk tier messages, run by a member in step order
SLEEPING, AWAKE = b"\x01", b"\x00"  # SLEEP's payloads

STEP_HEAD = struct.Struct("<QIiiiiI")  # step id, flags, T, S, D (delta ints), R (drops), checksum
STEP_CHECK = 1  # flag: the plan carries rank 0's checksum; the member answers ACK with its own
READY_MSG = struct.Struct("<Qii")  # step id, from rank, to rank
# FAILED: READY_MSG's fields, then the cause (UTF-8, at most MAX_CAUSE bytes)
MAX_CAUSE = 4000
ACK_MSG = struct.Struct("<QI")  # step id, the member's checksum
PING_MSG = struct.Struct("<Q")
PERMANENT = 1  # flag of an ERROR: the sender's failure is permanent (a wrong token, a model rank 0 does not share)


class ProtocolError(ConnectionError):
    """The peer sent something that is not the group's protocol (or closed the connection)."""


class Refused(ProtocolError):
    """The peer refused us, saying why (an ERROR message), or failed to prove the join
    token. `permanent`: starting again will not change its answer (exit 78, not 75)."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


# -- framing ------------------------------------------------------------------------------------

def frame(kind: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return FRAME.pack(MAGIC, VERSION, kind, flags, len(payload)) + payload


def error_frame(reason: str, permanent: bool) -> bytes:
    """An ERROR saying why, flagged `PERMANENT` when starting again cannot help."""
    return frame(ERROR, reason.encode()[:MAX_CAUSE], PERMANENT if permanent else 0)


def failed_payload(step: int, src: int, dst: int, cause: str) -> bytes:
    """A FAILED notice: rank `src`'s step `step` raised (`cause`), so no hidden state comes."""
    return READY_MSG.pack(step, src, dst) + cause.encode()[:MAX_CAUSE]


def read_notice(kind: int, payload: bytes) -> tuple[int, int, int, str | None]:
    """A READY or FAILED notice: (step, from rank, to rank, the cause of a FAILED or None)."""
    if len(payload) < READY_MSG.size or (kind == READY and len(payload) != READY_MSG.size):
        raise ProtocolError(f"a {KIND_NAMES[kind]} notice of {len(payload)} bytes")
    step, src, dst = READY_MSG.unpack_from(payload)
    if kind == READY:
        return step, src, dst, None
    return step, src, dst, payload[READY_MSG.size:].decode(errors="replace")


def read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; by `deadline` (time.monotonic()) for all of them when given (TimeoutError
    past it: a peer sending a byte now and then cannot stretch the wait)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError("the connection closed")
        got += k
    return bytes(buf)


def read_message(sock: socket.socket, limit: int = MAX_PAYLOAD, deadline: float | None = None) -> tuple[int, bytes]:
    kind, _, payload = read_frame(sock, limit, deadline)
    return kind, payload


def read_frame(sock: socket.socket, limit: int = MAX_PAYLOAD,
               deadline: float | None = None) -> tuple[int, int, bytes]:
    """One message: its kind, flags and payload."""
    magic, version, kind, flags, length = FRAME.unpack(read_exact(sock, FRAME.size, deadline))
    if magic != MAGIC:
        raise ProtocolError("not an Orchard group peer (bad magic)")
    if version != VERSION:
        raise ProtocolError(f"group protocol version {version}, this process speaks {VERSION}")
    if kind not in KIND_NAMES:
        raise ProtocolError(f"unknown message kind {kind}")
    if length > limit:
        raise ProtocolError(f"a {KIND_NAMES[kind]} message of {length} bytes (at most {limit} here)")
    return kind, flags, read_exact(sock, length, deadline)


def expect(sock: socket.socket, kind: int, limit: int = MAX_PAYLOAD, deadline: float | None = None) -> bytes:
    got, flags, payload = read_frame(sock, limit, deadline)
    if got == ERROR:
        raise Refused(f"the peer failed: {payload.decode(errors='replace')}", permanent=bool(flags & PERMANENT))
    if got != kind:
        raise ProtocolError(f"expected {KIND_NAMES[kind]}, got {KIND_NAMES[got]}")
    return payload


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(payload: bytes) -> dict:
    """A start-up message's JSON object; ProtocolError for anything else, nested past
    MAX_JSON_DEPTH included (json's parser recurses once a level: a peer's 5,000 levels are
    its RecursionError)."""
    try:
        obj = json.loads(payload.decode())
        check_json_depth(obj, "a start-up message", MAX_JSON_DEPTH)
    except (RecursionError, BadField):
        raise ProtocolError(f"a start-up message nested more than {MAX_JSON_DEPTH} deep") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"a start-up message that is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a start-up message that is not a JSON object")
    return obj


# -- the join handshake ---------------------------------------------------------------------------

HELLO_FIELDS = {"rank": int, "size": int, "nonce": str}  # required
# optional: what rank 0 reports, splits by and checks (group/memory.py's join_info; config:
# the member's model's config digest), and hands every rank (ring: the member's own
# HOST:PORT for MLX's ring)
HELLO_INFO = {"host": str, "pid": int, "memory": int, "memory_from": str, "kv_budget": int, "ring": str,
              "config": str}


def check_hello(hello: dict) -> None:
    """A HELLO's fields are of their types (a bool is no int), its nonce of a sane length
    and its memory not negative; ProtocolError naming the field otherwise."""
    for name, kind in (*HELLO_FIELDS.items(), *HELLO_INFO.items()):
        if name not in hello and name in HELLO_INFO:
            continue
        value = hello.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProtocolError(f"a HELLO whose {name} is {type(value).__name__}, not {kind.__name__}")
    if not 16 <= len(hello["nonce"]) <= MAX_NONCE:
        raise ProtocolError(f"a HELLO whose nonce has {len(hello['nonce'])} characters (16 to {MAX_NONCE})")
    for name in ("memory", "kv_budget"):
        if hello.get(name, 0) < 0:
            raise ProtocolError(f"a HELLO whose {name} is {hello[name]}")
    if "ring" in hello:
        host, _, port = hello["ring"].rpartition(":")
        if not host or len(host) > 255 or not port.isdigit() or not 0 < int(port) < 65536:
            raise ProtocolError(f"a HELLO whose ring address {hello['ring'][:300]!r} is not HOST:PORT")


def leader_proof(token: str, member_nonce: str, leader_nonce: str) -> str:
    return _mac(token, b"leader", member_nonce.encode(), leader_nonce.encode())


def member_proof(token: str, rank: int, leader_nonce: str, member_nonce: str) -> str:
    return _mac(token, b"member", str(rank).encode(), leader_nonce.encode(), member_nonce.encode())


def _mac(token: str, *parts: bytes) -> str:
    return hmac.new(token.encode(), b"|".join(parts), hashlib.sha256).hexdigest()


def proofs_match(a: str, b: str) -> bool:
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())


# -- a step's plan ----------------------------------------------------------------------------------

def checksum(block_tables: np.ndarray, slot_mapping: np.ndarray) -> int:
    """crc32 of a step's block tables and slot mapping (int32): what the mirrored-state
    check compares across ranks."""
    crc = zlib.crc32(np.ascontiguousarray(block_tables, dtype=np.int32).tobytes())
    return zlib.crc32(np.ascontiguousarray(slot_mapping, dtype=np.int32).tobytes(), crc)


class PlanWriter:
    """Rank 0's side: encodes each step and remembers what the members' tables hold."""

    def __init__(self):
        self.tables: dict[int, list[int]] = {}  # handle -> the block table the members hold
        self.handles: dict[int, tuple[int, object]] = {}  # id(seq) -> (handle, seq): the seq kept, so its id stays its
        self._next = 0

    def encode(self, step: int, scheduled, block_size: int, check: int | None = None) -> bytes:
        """The STEP payload for `scheduled` (the scheduler's entries: `.seq` with
        `token_ids`, `block_table`, `state_slot`, `status`; `.start`, `.num_new_tokens`).
        `check`: rank 0's checksum, for members to compare theirs with."""
        S = len(scheduled)
        handles = np.empty(S, np.int32)
        starts = np.empty(S, np.int32)
        counts = np.empty(S, np.int32)
        slots = np.empty(S, np.int32)
        ids: list[int] = []
        deltas: list[int] = []
        here = set()
        for i, e in enumerate(scheduled):
            seq = e.seq
            key = id(seq)
            here.add(key)
            known = self.handles.get(key)
            if known is None:
                handle = self._next
                self._next = (self._next + 1) & 0x7FFFFFFF
                self.handles[key] = (handle, seq)
                mirror = self.tables[handle] = []
            else:
                handle = known[0]
                mirror = self.tables[handle]
            end = e.start + e.num_new_tokens
            want = seq.block_table[: -(-end // block_size)]
            if mirror != want[: len(mirror)] or len(mirror) > len(want):
                first = next((j for j, (a, b) in enumerate(zip(mirror, want)) if a != b), min(len(mirror), len(want)))
                deltas += [handle, first, len(want) - first, *want[first:]]
                self.tables[handle] = list(want)
            elif len(mirror) < len(want):
                deltas += [handle, len(mirror), len(want) - len(mirror), *want[len(mirror):]]
                mirror += want[len(mirror):]
            handles[i], starts[i], counts[i], slots[i] = handle, e.start, e.num_new_tokens, seq.state_slot
            ids += seq.token_ids[e.start:end]
            ids += getattr(e, "spec_token_ids", ())  # draft tokens after the last one (speculative decoding)
        drops = self._drops(here)
        head = STEP_HEAD.pack(step, 0 if check is None else STEP_CHECK, len(ids), S, len(deltas), len(drops),
                              0 if check is None else check)
        body = np.concatenate([np.asarray(ids, np.int32), handles, starts, counts, slots,
                               np.asarray(deltas, np.int32), np.asarray(drops, np.int32)])
        return head + body.tobytes()

    def _drops(self, here: set[int]) -> list[int]:
        """Handles of sequences no longer running (finished, aborted, preempted) that this
        step does not schedule: the members forget their tables."""
        gone = []
        for key, (handle, seq) in list(self.handles.items()):
            if key not in here and getattr(getattr(seq, "status", None), "value", None) != "running":
                gone.append(handle)
                del self.handles[key]
                del self.tables[handle]
        return gone


@dataclass
class StepPlan:
    """A decoded step, as the member's runner takes it (numpy int32 arrays)."""

    step: int
    check: int | None  # rank 0's checksum, when it asked for the comparison
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    cu_seqlens_q: np.ndarray  # [S + 1]
    seq_lens: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, width]
    starts: np.ndarray  # [S]
    counts: np.ndarray  # [S]
    state_slots: np.ndarray  # [S]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def checksum(self) -> int:
        return checksum(self.block_tables, self.slot_mapping)


class PlanReader:
    """A member's side: applies each step's table changes to its mirrored tables and
    rebuilds the step's arrays."""

    def __init__(self, block_size: int, num_blocks: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tables: dict[int, list[int]] = {}

    def decode(self, payload: bytes) -> StepPlan:
        if len(payload) < STEP_HEAD.size:
            raise ProtocolError("a STEP message shorter than its header")
        step, flags, T, S, D, R, check = STEP_HEAD.unpack_from(payload)
        if min(T, S, D, R) < 0 or len(payload) != STEP_HEAD.size + 4 * (T + 4 * S + D + R):
            raise ProtocolError(f"a STEP message of {len(payload)} bytes for T={T} S={S} D={D} R={R}")
        body = np.frombuffer(payload, np.int32, offset=STEP_HEAD.size)
        ids, body = body[:T], body[T:]
        handles, starts, counts, slots = body[:S], body[S:2 * S], body[2 * S:3 * S], body[3 * S:4 * S]
        body = body[4 * S:]
        deltas, drops = body[:D], body[D:]
        self._apply(deltas.tolist(), drops.tolist())
        bs = self.block_size
        if (counts < 0).any() or (starts < 0).any() or int(counts.sum()) != T:
            raise ProtocolError("a STEP message whose sequences do not add up to its tokens")
        cu = np.zeros(S + 1, np.int32)
        np.cumsum(counts, out=cu[1:])
        lens = (starts + counts).astype(np.int32)
        need = -(-lens // bs)
        width = int(need.max()) if S else 0
        tables = np.zeros((S, width), np.int32)
        for i, (h, n) in enumerate(zip(handles.tolist(), need.tolist())):
            table = self.tables.get(h)
            if table is None or len(table) < n:
                raise ProtocolError(f"step {step}: sequence handle {h} needs {n} blocks, the mirror has "
                                    f"{None if table is None else len(table)}")
            tables[i, :n] = table[:n]
        positions = np.arange(T, dtype=np.int32) - np.repeat(cu[:-1] - starts, counts).astype(np.int32)
        rows = np.repeat(np.arange(S), counts)
        slot_mapping = (tables[rows, positions // bs] * bs + positions % bs).astype(np.int32) if T else \
            np.zeros(0, np.int32)
        return StepPlan(step, check if flags & STEP_CHECK else None, ids, positions, slot_mapping, cu, lens, tables,
                        starts, counts, slots)

    def _apply(self, deltas: list[int], drops: list[int]) -> None:
        i = 0
        while i < len(deltas):
            if i + 3 > len(deltas):
                raise ProtocolError("a truncated block-table change")
            handle, offset, n = deltas[i:i + 3]
            ids = deltas[i + 3:i + 3 + n]
            if n < 0 or len(ids) != n or offset < 0:
                raise ProtocolError("a malformed block-table change")
            if any(not 0 <= b < self.num_blocks for b in ids):
                raise ProtocolError(f"a block-table change outside the pool of {self.num_blocks} blocks")
            table = self.tables.setdefault(handle, [])
            if offset > len(table):
                raise ProtocolError(f"a block-table change at {offset} past the end of handle {handle}'s "
                                    f"{len(table)} blocks")
            self.tables[handle] = table[:offset] + ids
            i += 3 + n
        for h in drops:
            self.tables.pop(h, None)


# -- the disk KV tier's messages (group/kv.py) ------------------------------------------------------
#
#   KV_SAVE       count, then per block: block id i32, hash [16], parent [16] (zeros: a first block)
#   KV_READ       ticket u64, count, then per block: hash [16], parent [16]
#   KV_READ_DONE  ticket u64, good i32 (the first `good` blocks read and checked)
#   KV_APPLY      ticket u64, count, then per block: index into the read i32, block id i32 (none: drop)

MAX_KV_BLOCKS = 1 << 16  # blocks in one KV message (a read is at most the pool's quarter)
KV_COUNT = struct.Struct("<I")
KV_TICKET = struct.Struct("<QI")  # ticket, count
KV_READ_DONE_MSG = struct.Struct("<Qi")
_SAVE_ROW = np.dtype([("id", "<i4"), ("hash", "S16"), ("parent", "S16")])
_READ_ROW = np.dtype([("hash", "S16"), ("parent", "S16")])
_APPLY_ROW = np.dtype([("index", "<i4"), ("id", "<i4")])
NO_PARENT = bytes(16)


def _rows(payload: bytes, head: struct.Struct, row: np.dtype, what: str) -> tuple[tuple, np.ndarray]:
    if len(payload) < head.size:
        raise ProtocolError(f"a {what} message shorter than its header")
    fields = head.unpack_from(payload)
    n = fields[-1]
    if n > MAX_KV_BLOCKS or len(payload) != head.size + n * row.itemsize:
        raise ProtocolError(f"a {what} message of {len(payload)} bytes for {n} blocks (at most {MAX_KV_BLOCKS})")
    return fields, np.frombuffer(payload, row, n, head.size)


def _hashes(rows: np.ndarray, name: str) -> list[bytes]:
    # numpy's S16 strips trailing zero bytes: padded back to the 16 they were
    return [bytes(x).ljust(16, b"\0") for x in rows[name].tolist()]


def kv_save(blocks: list[tuple[int, bytes, bytes | None]]) -> bytes:
    """KV_SAVE: the blocks (id, hash, parent or None) rank 0 offered its disk writer."""
    rows = np.array([(b, h, p or NO_PARENT) for b, h, p in blocks], _SAVE_ROW)
    return KV_COUNT.pack(len(blocks)) + rows.tobytes()


def read_kv_save(payload: bytes, num_blocks: int) -> list[tuple[int, bytes, bytes | None]]:
    _, rows = _rows(payload, KV_COUNT, _SAVE_ROW, "KV_SAVE")
    ids = rows["id"].tolist()
    if any(not 0 <= b < num_blocks for b in ids):
        raise ProtocolError(f"a KV_SAVE of a block outside the pool of {num_blocks} blocks")
    return [(b, h, None if p == NO_PARENT else p)
            for b, h, p in zip(ids, _hashes(rows, "hash"), _hashes(rows, "parent"))]


def kv_read(ticket: int, entries: list[tuple[bytes, bytes | None]]) -> bytes:
    """KV_READ: read these blocks (hash, parent or None), in prefix order, into host buffers."""
    rows = np.array([(h, p or NO_PARENT) for h, p in entries], _READ_ROW)
    return KV_TICKET.pack(ticket, len(entries)) + rows.tobytes()


def read_kv_read(payload: bytes) -> tuple[int, list[tuple[bytes, bytes | None]]]:
    (ticket, _), rows = _rows(payload, KV_TICKET, _READ_ROW, "KV_READ")
    return ticket, [(h, None if p == NO_PARENT else p) for h, p in zip(_hashes(rows, "hash"), _hashes(rows, "parent"))]


def read_kv_read_done(payload: bytes) -> tuple[int, int]:
    if len(payload) != KV_READ_DONE_MSG.size:
        raise ProtocolError(f"a KV_READ_DONE message of {len(payload)} bytes")
    return KV_READ_DONE_MSG.unpack(payload)


def kv_apply(ticket: int, rows: list[tuple[int, int]]) -> bytes:
    """KV_APPLY: read `ticket`'s buffers at these indices go into these pool blocks; the
    rest (all of them when `rows` is empty) are dropped."""
    return KV_TICKET.pack(ticket, len(rows)) + np.array(rows, _APPLY_ROW).tobytes()


def read_kv_apply(payload: bytes, num_blocks: int) -> tuple[int, list[tuple[int, int]]]:
    (ticket, _), rows = _rows(payload, KV_TICKET, _APPLY_ROW, "KV_APPLY")
    pairs = list(zip(rows["index"].tolist(), rows["id"].tolist()))
    if any(j < 0 or not 0 <= b < num_blocks for j, b in pairs):
        raise ProtocolError(f"a KV_APPLY of a block outside the pool of {num_blocks} blocks (or a negative index)")
    return ticket, pairs
