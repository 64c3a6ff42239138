"""The disk tier's store: full KV blocks as files, named by their chained hash, one
directory per model identity, LRU within a byte budget.

Layout: `ROOT/<identity id>/` holds `identity.json`, `lock` (fcntl.flock: one writer per
store; a second process opens it read-only), `tmp/` (writes in flight, emptied at open)
and `blocks/<hh>/<32 hex>.kvb` (hh: the hash's first byte). A block file, little-endian:

    0  magic "OKVB" | 4 version u16 | 6 flags u16 (bit 0: tokens present)
    8  identity id [16]     a file moved into another model's directory is refused
    24 block hash [16] | 40 parent hash [16] (hashing.SEED for a first block)
    56 block_size u32 | 60 pools u32 | 64 payload bytes u64 | 72 payload xxh3_64
    80 header crc32 (of bytes 0-80) | 84 zero
    88 tokens u32[block_size] (when flagged), then each pool's block in identity order

Contract:
- `open` never raises: `mode` is "ok", "read_only" (a read-only or unwritable directory, or
  another process holds the lock: reads verified and served, nothing written or deleted)
  or "off" (unusable); `reason` says why when not "ok".
- Every read verifies: size (`truncated`), magic, version and crc (`header`), identity
  (`identity`), hash, parent and tokens against the request's (`tokens`), the payload's
  xxh3 (`checksum`); a failure raises `KvReadError(kind)` and deletes the file (unless
  read-only). A block is never served from a file that fails any of them.
- Writes go to `tmp/` in one writev, then `os.replace` into `blocks/`, so a kill mid-write
  leaves only a `.part` (removed at the next open), never a half block under its name.
  Without fsync a power cut can leave a file whose checksum refuses it: a recompute.
- LRU: the index is ordered by use; a file's mtime records its last use, so the order
  survives a restart. Before a write the front is evicted until the block fits the
  budget and `min_free_bytes` stays free on the filesystem. A full disk (ENOSPC, EDQUOT,
  EFBIG) drops the block, evicts 5% of the budget, warns, and writing goes on.
- Warnings are one per kind a minute; `stats` counts everything.
- `listener` hears the DISK tier's events, in order: `stored(hashes)` (the index at open,
  then each new file), `removed(hashes)` (evicted, corrupt or dropped), `cleared()` (the
  store turned off).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import numpy as np
import xxhash

from cluster.kv import hashing
from cluster.kv.identity import KvIdentity

log = logging.getLogger(__name__)

MAGIC = b"OKVB"
VERSION = 1
FLAG_TOKENS = 1
_HEAD = struct.Struct("<4sHH16s16s16sIIQQ")  # up to the crc
_CRC = struct.Struct("<II")  # crc32, zero
HEADER_BYTES = _HEAD.size + _CRC.size
SUFFIX = ".kvb"
READ_ERROR_KINDS = ("truncated", "header", "identity", "tokens", "checksum", "io")
DROP_REASONS = ("queue_full", "disk_full", "read_only", "error")
WARN_INTERVAL = 60.0  # seconds between two warnings of one kind
STATVFS_INTERVAL = 1.0  # seconds a filesystem free-space reading is trusted
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}
try:
    _IOV_MAX = os.sysconf("SC_IOV_MAX")
except (AttributeError, OSError, ValueError):
    _IOV_MAX = 1024


class KvReadError(Exception):
    """A block file that cannot be served; `kind` is one of READ_ERROR_KINDS."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class DiskListener(Protocol):
    """The DISK tier's events (KvJournal.disk_listener() implements it)."""

    def stored(self, hashes: list[bytes]) -> None: ...

    def removed(self, hashes: list[bytes]) -> None: ...

    def cleared(self) -> None: ...


@dataclass
class DiskStats:
    """Counters since open (the worker's metrics read them)."""

    bytes_written: int = 0
    blocks_written: int = 0
    bytes_read: int = 0
    blocks_read: int = 0
    evictions: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason (DROP_REASONS) -> blocks
    errors: Counter = field(default_factory=Counter)  # kind (READ_ERROR_KINDS) -> reads


class DiskStore:
    """Block files of one identity under `root`; see the module docstring for the contract.
    Thread-safe: the writer thread writes, reader threads read, the engine looks up."""

    def __init__(self, root: str | Path, identity: KvIdentity, budget_bytes: int, min_free_bytes: int,
                 listener: DiskListener | None = None, fsync: bool = False):
        self.root = Path(root)
        self.identity = identity
        self.dir = self.root / identity.id
        self.budget_bytes = int(budget_bytes)
        self.min_free_bytes = int(min_free_bytes)
        self.listener = listener
        self.fsync = fsync
        self.mode = "off"
        self.reason = "not opened"
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the index, counters and events
        self._write_lock = threading.Lock()  # one write (room, file, index) at a time
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recent first
        self._used = 0
        self._pinned: Counter = Counter()  # hashes a reader will read: not evicted
        self._lock_fd: int | None = None
        self._made: set[str] = set()  # blocks/<hh> directories known to exist
        self._parts = 0
        self._clock = 0  # last mtime given (ns), strictly increasing: the LRU order on disk
        self._free_seen = (0.0, 0)  # (monotonic time, bytes free) of the last statvfs
        self._warned: dict[str, float] = {}
        bs = identity.block_size
        self.file_bytes = HEADER_BYTES + 4 * bs + identity.payload_bytes
        self._sizes = {self.file_bytes, HEADER_BYTES + identity.payload_bytes}  # with or without tokens

    # -- open and close ----------------------------------------------------------------------

    @classmethod
    def open(cls, root: str | Path, identity: KvIdentity, budget_bytes: int, min_free_bytes: int = 2 << 30,
             listener: DiskListener | None = None, *, fsync: bool = False) -> DiskStore:
        """The store of `identity` under `root`, its index read; never raises (see `mode`)."""
        store = cls(root, identity, budget_bytes, min_free_bytes, listener, fsync)
        try:
            store._open()
        except Exception as e:  # noqa: BLE001 - a broken disk tier must not stop the worker
            log.exception("KV disk store %s unusable", store.dir)
            store._turn_off(f"cannot open {store.dir}: {e}")
        return store

    def _open(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if not self.dir.is_dir():
                self._turn_off(f"cannot create {self.dir}: {e.strerror or e}")
                return
        writable, why = self._probe_writable()
        if writable:
            writable, why = self._take_lock()
        if writable:
            self._empty_tmp()
            self._write_identity()
        self._load_index(writable)
        self.mode, self.reason = ("ok", "") if writable else ("read_only", why)
        if not writable:
            log.warning("KV disk store %s is read-only: %s", self.dir, why)
        if writable and self._used > self.budget_bytes:
            with self._write_lock:
                self._evict(self._used - self.budget_bytes)
        if self._index and self.listener is not None:
            self.listener.stored(list(self._index))
        log.info("KV disk store %s: %s, %d blocks, %d of %d bytes", self.dir, self.mode, len(self._index),
                 self._used, self.budget_bytes)

    def _probe_writable(self) -> tuple[bool, str]:
        try:
            (self.dir / "tmp").mkdir(exist_ok=True)
            (self.dir / "blocks").mkdir(exist_ok=True)
            probe = self.dir / "tmp" / f"probe.{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            probe.unlink()
            return True, ""
        except OSError as e:
            return False, f"cannot write {self.dir}: {e.strerror or e}"

    def _take_lock(self) -> tuple[bool, str]:
        path = self.dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            return False, f"another process (pid {holder}) writes this store"
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        return True, ""

    def _empty_tmp(self) -> None:
        for entry in os.scandir(self.dir / "tmp"):
            try:
                os.unlink(entry.path)
            except OSError as e:
                log.warning("KV disk store: cannot remove %s: %s", entry.path, e)

    def _write_identity(self) -> None:
        path = self.dir / "identity.json"
        try:
            if path.read_text() == self.identity.canonical:
                return
        except OSError:
            pass
        tmp = self.dir / "tmp" / f"identity.{os.getpid()}.json"
        tmp.write_text(self.identity.canonical)
        os.replace(tmp, path)

    def _load_index(self, writable: bool) -> None:
        """The index from the files under blocks/, least recently used (oldest mtime) first;
        a file of no valid size is a torn write from an older format or a crash: deleted."""
        found = []
        blocks = self.dir / "blocks"
        for sub in _scandir(blocks):
            if not (sub.is_dir() and _is_hex(sub.name, 1)):
                continue
            for entry in _scandir(Path(sub.path)):
                name = entry.name
                if not (name.endswith(SUFFIX) and _is_hex(name[:-4], 16) and name.startswith(sub.name)):
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if st.st_size not in self._sizes:
                    if writable:
                        _unlink(entry.path)
                    continue
                found.append((st.st_mtime_ns, name, st.st_size))
        found.sort()
        for mtime, name, size in found:
            self._index[bytes.fromhex(name[:-4])] = size
            self._used += size
        self._clock = found[-1][0] if found else 0

    def close(self) -> None:
        """Releases the lock: another process may write the store now."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _turn_off(self, reason: str) -> None:
        with self._lock:
            was_on = self.mode != "off"
            self.mode, self.reason = "off", reason
            self._index.clear()
            self._used = 0
            if was_on and self.listener is not None:
                self.listener.cleared()
        self.close()
        log.warning("KV disk tier off: %s", reason)

    # -- lookups --------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, h: bytes) -> bool:
        return h in self._index

    def lookup(self, hashes: Iterable[bytes]) -> int:
        """How many of `hashes`, from the first, have a file (consecutive hits)."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._index:
                    break
                n += 1
        return n

    def pin(self, hashes: Iterable[bytes]) -> None:
        """Keeps `hashes` from eviction until `unpin` (a read is on its way)."""
        with self._lock:
            self._pinned.update(hashes)

    def unpin(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            self._pinned.subtract(hashes)
            self._pinned = +self._pinned

    def path(self, h: bytes) -> Path:
        """Where block `h`'s file lives."""
        hx = h.hex()
        return self.dir / "blocks" / hx[:2] / (hx + SUFFIX)

    # -- reads ----------------------------------------------------------------------------

    def read(self, h: bytes, parent: bytes | None, tokens: Sequence[int] | np.ndarray | None,
             out: Sequence[np.ndarray]) -> None:
        """Block `h` (after `parent`, None for a prompt's first block, holding `tokens`, or
        unchecked when None) into `out`: one C-contiguous array per pool, shaped as the
        identity's block shapes. Raises KvReadError; `out` then holds garbage."""
        self._check_buffers(out)
        try:
            fd = os.open(self.path(h), os.O_RDONLY)
        except FileNotFoundError:
            self._forget([h])  # evicted or deleted since the lookup: a miss, not an error
            raise KvReadError("io", "no such block file") from None
        except OSError as e:
            self._read_failed(h, KvReadError("io", str(e)))
        try:
            size = self._read_file(fd, h, parent, tokens, out)
        except KvReadError as e:
            self._read_failed(h, e)
        except OSError as e:
            self._read_failed(h, KvReadError("io", str(e)))
        finally:
            os.close(fd)
        self._used_now(h, size)

    def _read_file(self, fd: int, h: bytes, parent: bytes | None, tokens, out: Sequence[np.ndarray]) -> int:
        """Reads and verifies the open block file `fd`; its size."""
        size = os.fstat(fd).st_size
        header = os.pread(fd, HEADER_BYTES, 0)
        if len(header) < HEADER_BYTES:
            raise KvReadError("truncated", f"{size} bytes")
        magic, version, flags, ident, fh, fparent, bs, pools, nbytes, xxh = _HEAD.unpack_from(header)
        crc, _ = _CRC.unpack_from(header, _HEAD.size)
        if magic != MAGIC or version != VERSION or crc != zlib.crc32(header[:_HEAD.size]):
            raise KvReadError("header", "bad magic, version or crc")
        if ident != self.identity.id_bytes:
            raise KvReadError("identity", f"written for identity {ident.hex()}")
        idt = self.identity
        if bs != idt.block_size or pools != len(idt.pool_layout) or nbytes != idt.payload_bytes:
            raise KvReadError("header", "block size, pools or payload bytes differ from the identity's")
        has_tokens = bool(flags & FLAG_TOKENS)
        expected = HEADER_BYTES + (4 * bs if has_tokens else 0) + nbytes
        if size != expected:
            raise KvReadError("truncated", f"{size} bytes, expected {expected}")
        file_tokens = np.empty(bs, dtype="<u4")
        buffers = ([file_tokens] if has_tokens else []) + list(out)
        got = _preadv_all(fd, buffers, HEADER_BYTES)
        if got != expected - HEADER_BYTES:
            raise KvReadError("truncated", f"{HEADER_BYTES + got} bytes read, expected {expected}")
        if fh != h or fparent != (parent or hashing.SEED):
            raise KvReadError("tokens", "hash or parent differ")
        if has_tokens:
            if tokens is not None:
                if not np.array_equal(file_tokens, np.asarray(tokens, dtype=np.int64)):
                    raise KvReadError("tokens", "tokens differ from the request's")
            elif hashing.hash_block(parent, file_tokens.tolist()) != h:
                raise KvReadError("tokens", "tokens do not hash to the block's hash")
        if _xxh3(out) != xxh:
            raise KvReadError("checksum", "payload xxh3 differs")
        return size

    def _check_buffers(self, arrays: Sequence[np.ndarray]) -> None:
        layout = self.identity.pool_layout
        if len(arrays) != len(layout):
            raise ValueError(f"KV disk store: {len(arrays)} pool arrays, the identity has {len(layout)}")
        for a, (shape, _), nbytes in zip(arrays, layout, self.identity.pool_nbytes):
            if tuple(a.shape) != shape or a.nbytes != nbytes or not a.flags.c_contiguous:
                raise ValueError(f"KV disk store: a pool array {a.shape} {a.dtype} ({a.nbytes} bytes) is not "
                                 f"a C-contiguous {list(shape)} of {nbytes} bytes")

    def _read_failed(self, h: bytes, error: KvReadError):
        """Counts, warns and (but for an I/O error, and unless read-only) deletes; raises `error`."""
        with self._lock:
            self.stats.errors[error.kind] += 1
        self._warn(error.kind, f"KV disk block {h.hex()} not served ({error}): recomputed")
        if error.kind != "io":
            if self.mode == "ok":
                _unlink(self.path(h))
            self._forget([h])
        raise error

    def _used_now(self, h: bytes, size: int) -> None:
        with self._lock:
            self.stats.blocks_read += 1
            self.stats.bytes_read += size
            if h in self._index:
                self._index.move_to_end(h)
            stamp = self._tick() if self.mode == "ok" else 0
        if stamp:
            try:
                os.utime(self.path(h), ns=(stamp, stamp))
            except OSError:
                pass  # only the order after a restart suffers

    def _tick(self) -> int:
        """A strictly increasing mtime (ns) under the lock: files' mtimes keep the LRU order."""
        self._clock = max(self._clock + 1, time.time_ns())
        return self._clock

    # -- writes ---------------------------------------------------------------------------

    def write(self, h: bytes, parent: bytes | None, tokens: Sequence[int] | np.ndarray | None,
              arrays: Sequence[np.ndarray]) -> bool:
        """Stores block `h` (its `parent`, `tokens` and one array per pool, shaped as the
        identity's block shapes); True if it is on disk now. Never raises for the disk's
        sake: a failure drops the block (counted, warned)."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        self._check_buffers(arrays)
        if tokens is not None and len(tokens) != self.identity.block_size:
            raise ValueError(f"KV disk store: {len(tokens)} tokens in a block of {self.identity.block_size}")
        with self._write_lock:
            if h in self._index:
                return True
            if self.mode != "ok":
                self.note_dropped("read_only")
                return False
            data = self._encode(h, parent, tokens, arrays)
            size = sum(memoryview(b).nbytes for b in data)
            if not self._make_room(size):
                self.note_dropped("disk_full")
                self._warn("disk_full", f"KV disk store {self.dir}: no room for a block within the budget "
                                        f"({self.budget_bytes} bytes) and {self.min_free_bytes} bytes kept free")
                return False
            try:
                self._write_file(h, data)
            except OSError as e:
                self._write_failed(e)
                return False
            with self._lock:
                self._index[h] = size
                self._used += size
                self.stats.blocks_written += 1
                self.stats.bytes_written += size
                self._free_seen = (self._free_seen[0], self._free_seen[1] - size)
                if self.listener is not None:
                    self.listener.stored([h])
            return True

    def _encode(self, h: bytes, parent: bytes | None, tokens, arrays: list[np.ndarray]) -> list:
        idt = self.identity
        flags = FLAG_TOKENS if tokens is not None else 0
        head = _HEAD.pack(MAGIC, VERSION, flags, idt.id_bytes, h, parent or hashing.SEED, idt.block_size,
                          len(arrays), idt.payload_bytes, _xxh3(arrays))
        data = [head + _CRC.pack(zlib.crc32(head), 0)]
        if tokens is not None:
            data.append(np.asarray(tokens, dtype="<u4"))
        return data + [memoryview(a).cast("B") for a in arrays]

    def _write_file(self, h: bytes, data: list) -> None:
        final = self.path(h)
        self._parts += 1
        tmp = self.dir / "tmp" / f"{h.hex()}.{os.getpid()}.{self._parts}.part"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _writev_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
                with self._lock:
                    stamp = self._tick()
                os.utime(fd, ns=(stamp, stamp))
            finally:
                os.close(fd)
            if final.parent.name not in self._made:
                final.parent.mkdir(exist_ok=True)
                self._made.add(final.parent.name)
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise

    def _write_failed(self, e: OSError) -> None:
        if e.errno in _FULL:
            self.note_dropped("disk_full")
            self._warn("disk_full", f"KV disk store {self.dir}: {e.strerror or e}: a block dropped, "
                                    f"{self.budget_bytes // 20} bytes evicted")
            self._evict(max(1, self.budget_bytes // 20))
            self._free_seen = (0.0, 0)  # read the filesystem again
        elif e.errno == errno.ENOENT:  # the directory was removed under the store: made again
            self.note_dropped("error")
            self._made.clear()
            try:
                (self.dir / "tmp").mkdir(parents=True, exist_ok=True)
                (self.dir / "blocks").mkdir(exist_ok=True)
            except OSError as again:
                self._turn_off(f"{self.dir} is gone and cannot be made again: {again.strerror or again}")
        elif e.errno in _READ_ONLY:
            self.note_dropped("read_only")
            self.mode, self.reason = "read_only", f"cannot write {self.dir}: {e.strerror or e}"
            log.warning("KV disk store %s is read-only now: %s", self.dir, self.reason)
        else:
            self.note_dropped("error")
            self._warn("write", f"KV disk store {self.dir}: a block not written: {e}")

    def note_dropped(self, reason: str) -> None:
        """Counts a block not written (`reason` in DROP_REASONS)."""
        with self._lock:
            self.stats.dropped[reason] += 1

    def _make_room(self, size: int) -> bool:
        """Evicts from the LRU front until `size` more bytes fit the budget and leave
        `min_free_bytes` free; False if they cannot."""
        if size > self.budget_bytes:
            return False
        over_budget = self._used + size - self.budget_bytes
        short_of_free = self.min_free_bytes + size - self._free_bytes()
        self._evict(max(over_budget, short_of_free, 0))
        return self._used + size <= self.budget_bytes and self._free_bytes() >= self.min_free_bytes + size

    def _free_bytes(self) -> int:
        """The filesystem's free bytes: statvfs at most once a STATVFS_INTERVAL, our own
        writes and evictions counted in between."""
        now = time.monotonic()
        if now - self._free_seen[0] > STATVFS_INTERVAL:
            try:
                st = os.statvfs(self.dir)
                self._free_seen = (now, st.f_bavail * st.f_frsize)
            except OSError:
                self._free_seen = (now, 1 << 62)  # unknown: the budget alone decides
        return self._free_seen[1]

    def _evict(self, nbytes: int) -> None:
        """Deletes least recently used files (not pinned) until `nbytes` are freed."""
        if nbytes <= 0:
            return
        gone, freed = [], 0
        with self._lock:
            for h, size in self._index.items():
                if freed >= nbytes:
                    break
                if self._pinned[h] <= 0:
                    gone.append(h)
                    freed += size
        for h in gone:
            _unlink(self.path(h))
        self._forget(gone, evicted=True)

    # -- removal --------------------------------------------------------------------------

    def drop(self, hashes: Iterable[bytes]) -> None:
        """Deletes these blocks' files (unless read-only) and forgets them."""
        hashes = [h for h in hashes if h in self._index]
        if self.mode == "ok":
            for h in hashes:
                _unlink(self.path(h))
        self._forget(hashes)

    def _forget(self, hashes: list[bytes], evicted: bool = False) -> None:
        with self._lock:
            gone = []
            for h in hashes:
                size = self._index.pop(h, None)
                if size is not None:
                    self._used -= size
                    gone.append(h)
                    if evicted:
                        self._free_seen = (self._free_seen[0], self._free_seen[1] + size)
            if evicted:
                self.stats.evictions += len(gone)
            if gone and self.listener is not None:
                self.listener.removed(gone)

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._warned.get(kind, -WARN_INTERVAL) < WARN_INTERVAL:
                return
            self._warned[kind] = now
        log.warning("%s", message)


def _xxh3(arrays: Iterable) -> int:
    h = xxhash.xxh3_64()
    for a in arrays:
        h.update(memoryview(a).cast("B"))
    return h.intdigest()


def _writev_all(fd: int, data: list) -> None:
    """All of `data`'s buffers written in order (os.writev may write less than asked)."""
    views = [memoryview(b).cast("B") for b in data]
    while views:
        _advance(views, os.writev(fd, views[:_IOV_MAX]))


def _preadv_all(fd: int, buffers: list[np.ndarray], offset: int) -> int:
    """Reads into `buffers` from `offset` until they are full or the file ends; bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = _preadv(fd, views[:_IOV_MAX], offset + total)
        if n <= 0:
            break
        total += n
        _advance(views, n)
    return total


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first `n` bytes from `views` (a vectored read or write moved them)."""
    while n and views:
        if n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def _preadv(fd: int, views: list[memoryview], offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, views, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # each reader has its own fd: no shared offset
    return os.readv(fd, views)


def _scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _is_hex(text: str, nbytes: int) -> bool:
    return len(text) == 2 * nbytes and all(c in "0123456789abcdef" for c in text)


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("KV disk store: cannot remove %s: %s", path, e)
