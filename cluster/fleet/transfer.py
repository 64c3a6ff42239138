"""Copying a model's files from one node agent to another (node side; no MLX).

Serving (`ListModelFiles` / `ReadModelFile` on the holder): the files of a model this node
holds, a plain directory or .gguf file under --models-dir or a hub snapshot, each named by
its path relative to the model (`relative_path` refuses `..` and absolute paths before
anything is read), with its size and sha256 (and, for a hub snapshot, its blob's name);
read in chunks of `CHUNK_BYTES` from an offset, so that a receiver resumes.

Receiving (`copy_model`, the agent's `FetchModel` from a peer): up to `streams` files at
once, all bounded together by one `TokenBucket` so that copying does not starve serving.
Each file is written to a partial file first and resumed from what that holds; its sha256
is checked once it is whole: a mismatch is fetched once more from offset 0, a second one
is DATA_LOSS (the caller goes on to the next peer). Where the files land is a `Destination`:

- `HubDestination`: a hub source's snapshot in huggingface_hub's cache layout, as a pull
  writes it: `blobs/<etag>` (partial: `blobs/<etag>.incomplete`, the name huggingface_hub
  resumes from too), `snapshots/<commit>/<path>` a relative symlink to its blob, and
  `refs/<revision>` holding the commit; so huggingface_hub, `scan_cache_dir` and mlx-lm read
  a copied model as if pulled.
- `PlainDestination`: `<models-dir>/<name>` (a directory or a .gguf file), written under a
  hidden `.<name>.part` and renamed when every file is whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path, PurePosixPath

import grpc

from cluster.fleet import FleetError, hub
from cluster.fleet.disk import repo_folder
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
HASH_BLOCK = 8 << 20  # a resumed partial file is hashed in blocks of this
BURST_S = 0.5  # a token bucket holds this many seconds of its rate
STALL_S = 60.0  # a peer that sends nothing of a file for this long is given up (it may be alive but stuck)
_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a git sha1 or a sha256, as the hub's etags


# -- serving ---------------------------------------------------------------------------------
def relative_path(path: str) -> PurePosixPath:
    """A model file's path as a peer names it: relative, inside the model. INVALID_ARGUMENT
    for an empty or absolute path or one with `..` (before anything is read)."""
    rel = PurePosixPath(path)
    if not path or "\\" in path or "\0" in path or rel.is_absolute() or ".." in rel.parts or rel == PurePosixPath("."):
        raise FleetError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"path {path!r} must be a file's path relative to the model, without '..'")
    return rel


def model_file(root: Path, path: str) -> Path:
    """The file `path` names in the model at `root` (a directory, or a .gguf file whose one
    file is its own name). NOT_FOUND when there is none."""
    rel = relative_path(path)
    target = root if root.is_file() and str(rel) == root.name else root / rel
    if not target.is_file() or (root.is_file() and target != root):
        raise FleetError(grpc.StatusCode.NOT_FOUND, f"model {root.name} has no file {path!r}")
    return target


def list_files(root: Path, layers: tuple[int, int] | None = None) -> list[pb.ModelFile]:
    """The files of the model at `root` with their sizes and sha256 (`hub.files`: a hub
    snapshot's with their blobs' names; `layers`: a pipeline rank's only); a .gguf file is
    its one file."""
    if root.is_file():
        stat = root.stat()
        key = (str(root), stat.st_size, stat.st_mtime_ns)
        if key not in _gguf_sha256:
            _gguf_sha256[key] = file_sha256(root)
        return [pb.ModelFile(path=root.name, size=stat.st_size, sha256=_gguf_sha256[key])]
    return hub.files(root, layers)


_gguf_sha256: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256: hashed once


def file_sha256(path: Path, length: int | None = None) -> str:
    return _hash_prefix(path, length).hexdigest()


def _hash_prefix(path: Path, length: int | None = None):
    """sha256 of the first `length` bytes of `path` (all of it: None)."""
    digest = hashlib.sha256()
    left = path.stat().st_size if length is None else length
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(HASH_BLOCK, left))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest


async def read_chunks(path: Path, offset: int) -> AsyncIterator[bytes]:
    """The file's bytes from `offset` in chunks of CHUNK_BYTES (read off the event loop)."""
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
            yield chunk


# -- the bandwidth bound ----------------------------------------------------------------------
class TokenBucket:
    """Bytes per second shared by every stream of a fetch: `take(n)` returns when `n` bytes
    may pass. It holds at most BURST_S seconds of its rate; `rate` 0 is unbounded."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        self.rate = float(rate)
        self.clock = clock
        self.tokens = self.rate * BURST_S
        self.at = clock()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = self.clock()
        self.tokens = min(self.rate * BURST_S, self.tokens + (now - self.at) * self.rate) - n
        self.at = now
        if self.tokens < 0:  # in debt: the next taker waits for this one's share too
            await asyncio.sleep(-self.tokens / self.rate)


# -- where a copy lands -------------------------------------------------------------------------
class Destination:
    """Where a copy's files are written: `partial(f)` while it arrives, `complete(f, p)` once
    whole and checked; `finish()` makes the model visible and returns its path."""

    def done(self, f: pb.ModelFile) -> bool:
        return False

    def partial(self, f: pb.ModelFile) -> Path:
        raise NotImplementedError

    def complete(self, f: pb.ModelFile, partial: Path) -> None:
        raise NotImplementedError

    def finish(self) -> Path:
        raise NotImplementedError

    def present_bytes(self, files: list[pb.ModelFile]) -> int:
        """What of `files` is already here (whole or partial): not to be made room for."""
        total = 0
        for f in files:
            p = self.partial(f)
            total += f.size if self.done(f) else min(f.size, p.stat().st_size) if p.is_file() else 0
        return total


class HubDestination(Destination):
    """Snapshot `commit` of `repo` in the hub cache at `cache`; `revision` (a branch or tag)
    gets a ref to it."""

    def __init__(self, cache: Path, repo: str, revision: str, commit: str):
        if not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise FleetError(grpc.StatusCode.DATA_LOSS, f"the peer gave {repo} a revision {commit!r}, not a commit")
        self.root = Path(cache) / repo_folder(repo)
        self.revision, self.commit = revision, commit
        self.snapshot = self.root / "snapshots" / commit

    def blob(self, f: pb.ModelFile) -> Path:
        name = f.blob or f.sha256
        if not _BLOB_NAME.fullmatch(name):
            raise FleetError(grpc.StatusCode.DATA_LOSS, f"the peer named {f.path}'s blob {name!r}, not a hash")
        if len(name) == 64 and name != f.sha256:
            raise FleetError(grpc.StatusCode.DATA_LOSS, f"the peer named {f.path}'s blob {name}, not its sha256 "
                                                        f"{f.sha256}")
        return self.root / "blobs" / name

    def done(self, f: pb.ModelFile) -> bool:
        return self.blob(f).is_file()

    def partial(self, f: pb.ModelFile) -> Path:
        return self.blob(f).with_name(self.blob(f).name + ".incomplete")

    def complete(self, f: pb.ModelFile, partial: Path) -> None:
        blob = self.blob(f)
        if partial.is_file():
            if len(blob.name) == 40 and (got := hub.git_sha1(partial)) != blob.name:  # a small file's etag
                partial.unlink()
                raise FleetError(grpc.StatusCode.DATA_LOSS, f"the peer named {f.path}'s blob {blob.name}, not its "
                                                            f"git blob sha1 {got}")
            os.replace(partial, blob)
        link = self.snapshot / relative_path(f.path)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))

    def finish(self) -> Path:
        self.snapshot.mkdir(parents=True, exist_ok=True)
        hub.write_ref(self.root, self.revision, self.commit)
        return self.snapshot

    def prepare(self) -> None:
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)


class PlainDestination(Destination):
    """`<models_dir>/<name>`: a directory (or, `single`, a .gguf file) written under a
    hidden `.<name>.part` and renamed once whole."""

    def __init__(self, models_dir: Path, name: str, single: bool):
        self.final = Path(models_dir) / name
        self.staging = Path(models_dir) / f".{name}.part"
        self.single = single

    def partial(self, f: pb.ModelFile) -> Path:
        return self.staging if self.single else self.staging / relative_path(f.path)

    def complete(self, f: pb.ModelFile, partial: Path) -> None:
        pass  # whole in place; the rename in `finish` makes it visible

    def finish(self) -> Path:
        os.replace(self.staging, self.final)
        return self.final

    def prepare(self) -> None:
        if not self.single:
            self.staging.mkdir(parents=True, exist_ok=True)


# -- copying ------------------------------------------------------------------------------------
class Copy:
    """Copy `files` of `source` from the peer behind `stub` into `dest`, `streams` files at
    once, through `bucket`. `on_bytes(n)` is told of each n bytes that arrive (negative: a
    file found bad and dropped); `received` counts what the peer sent."""

    def __init__(self, stub: pb_grpc.NodeStub, source: str, files: list[pb.ModelFile], dest: Destination,
                 streams: int, bucket: TokenBucket, on_bytes: Callable[[int], None] = lambda n: None):
        self.stub, self.source, self.files, self.dest = stub, source, files, dest
        self.streams, self.bucket, self.on_bytes = max(1, streams), bucket, on_bytes
        self.received = 0

    async def run(self) -> Path:
        await asyncio.to_thread(self.dest.prepare)
        # Files of one blob (the same bytes under two names) are written once, then linked:
        # two streams appending to one partial file would corrupt it.
        firsts: dict[Path, pb.ModelFile] = {}
        twins = []
        for f in sorted(self.files, key=lambda f: -f.size):  # the largest first: the streams end together
            if self.dest.partial(f) in firsts:
                twins.append(f)
            else:
                firsts[self.dest.partial(f)] = f
        queue = list(firsts.values())
        streams = [asyncio.create_task(self._drain(queue)) for _ in range(min(self.streams, len(queue)))]
        try:
            await asyncio.gather(*streams)
        finally:  # one file's failure ends the others
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        for f in twins:
            await self.copy_file(f)  # its blob is whole now
        return await asyncio.to_thread(self.dest.finish)

    async def _drain(self, queue: list[pb.ModelFile]) -> None:
        while queue:
            await self.copy_file(queue.pop(0))

    async def copy_file(self, f: pb.ModelFile) -> None:
        if self.dest.done(f):
            self.on_bytes(f.size)
            await asyncio.to_thread(self.dest.complete, f, self.dest.partial(f))
            return
        partial = self.dest.partial(f)
        for attempt in range(2):
            digest, have = await asyncio.to_thread(_resume, partial, f.size)
            self.on_bytes(have)
            if have < f.size:
                await self._receive(f, partial, have, digest)
            if digest.hexdigest() == f.sha256:
                await asyncio.to_thread(self.dest.complete, f, partial)
                return
            log.warning("copy of %s/%s: sha256 %s, the peer listed %s: %s", self.source, f.path, digest.hexdigest(),
                        f.sha256, "fetching it again" if attempt == 0 else "giving up on this peer")
            partial.unlink(missing_ok=True)
            self.on_bytes(-f.size)
        raise FleetError(grpc.StatusCode.DATA_LOSS, f"{self.source}: {f.path} arrived twice with a sha256 other than "
                                                    f"its listed {f.sha256}")

    async def _receive(self, f: pb.ModelFile, partial: Path, offset: int, digest) -> None:
        """Append the file's bytes from `offset` to `partial`, hashing them into `digest`."""
        stream = self.stub.ReadModelFile(pb.ReadModelFileRequest(source=self.source, path=f.path, offset=offset))
        chunks = aiter(stream)
        with open(partial, "ab") as out:
            while True:
                try:
                    data = (await asyncio.wait_for(anext(chunks), STALL_S)).data
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    stream.cancel()
                    raise FleetError(grpc.StatusCode.UNAVAILABLE, f"{self.source}: the peer sent nothing of {f.path} "
                                                                  f"for {STALL_S:.0f} s (at {offset} of {f.size} "
                                                                  "bytes)") from None
                if offset + len(data) > f.size:
                    stream.cancel()
                    raise FleetError(grpc.StatusCode.DATA_LOSS, f"{self.source}: the peer sent more of {f.path} "
                                                                f"than its listed {f.size} bytes")
                await self.bucket.take(len(data))
                await asyncio.to_thread(_append, out, digest, data)
                offset += len(data)
                self.received += len(data)
                self.on_bytes(len(data))
        if offset < f.size:
            raise FleetError(grpc.StatusCode.UNAVAILABLE, f"{self.source}: the peer's {f.path} ended at {offset} of "
                                                          f"{f.size} bytes")


def _resume(partial: Path, size: int):
    """The partial file's sha256 so far and its length; one longer than the file is dropped."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.is_file() else 0
    if have > size:
        partial.unlink()
        have = 0
    return (_hash_prefix(partial, have) if have else hashlib.sha256()), have


def _append(out, digest, data: bytes) -> None:
    out.write(data)
    digest.update(data)


# -- a fetch in progress ------------------------------------------------------------------------
class Fetch:
    """One fetch of a source onto this node (from a peer or the hub): every FetchModel call
    for the source follows it, and the node's report lists it while it runs."""

    def __init__(self, source: str, clock: Callable[[], float] = time.monotonic,
                 layers: tuple[int, int] | None = None):
        self.source = source
        self.layers = layers  # a pipeline rank's (first, last); None: every file
        self.clock = clock
        self.started = clock()
        self.origin = ""  # "hub" or the peer's node id
        self.bytes_done = self.bytes_total = 0
        self.result: pb.FetchProgress | None = None
        self.error: FleetError | None = None
        self.task: asyncio.Task | None = None
        # A fetch into the hub cache: its repository, and the bytes that will be on disk for it
        # once it is done (what the disk budget reckons with while it runs).
        self.repo = ""
        self.disk_bytes_when_done = 0
        self._ended = asyncio.Event()

    def begin(self, origin: str, bytes_total: int) -> None:
        self.origin, self.bytes_done, self.bytes_total = origin, 0, bytes_total

    def add(self, n: int) -> None:
        self.bytes_done = max(0, self.bytes_done + n)

    def set(self, done: int, total: int) -> None:
        self.bytes_done, self.bytes_total = done, total

    def end(self, result: pb.FetchProgress | None = None, error: FleetError | None = None) -> None:
        self.result, self.error = result, error
        self._ended.set()

    def serves(self, layers: tuple[int, int] | None) -> bool:
        """Whether what it fetches is what a fetch of `layers` needs (a whole model serves any)."""
        return self.layers is None or self.layers == layers

    async def ended(self) -> None:
        await self._ended.wait()

    def progress(self) -> pb.FetchProgress:
        return pb.FetchProgress(**{"from": self.origin}, bytes_done=self.bytes_done, bytes_total=self.bytes_total)

    def transfer(self) -> pb.Transfer:
        return pb.Transfer(source=self.source, **{"from": self.origin}, bytes_done=self.bytes_done,
                           bytes_total=self.bytes_total, seconds=self.clock() - self.started)

    async def follow(self, every: float) -> AsyncIterator[pb.FetchProgress]:
        """Its progress every `every` seconds while it changes, then its last message (or
        its error, raised)."""
        last = None
        while not self._ended.is_set():
            now = (self.origin, self.bytes_done, self.bytes_total)
            if now != last and self.origin:
                last = now
                yield self.progress()
            try:
                await asyncio.wait_for(self._ended.wait(), every)
            except asyncio.TimeoutError:
                pass
        if self.error is not None:
            raise self.error
        yield self.result
