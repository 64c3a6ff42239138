"""A Hugging Face Hub on 127.0.0.1 for the real `huggingface_hub` client (no network in tests).

It speaks the part of the hub's API that downloads use:
- `GET /api/models/{repo}[/revision/{rev}]`: the repo's commit (`sha`) and `siblings`
  (`rfilename`; with `?blobs=true` also `size`, `blobId` and, for LFS files, `lfs`);
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: the files (`oid`, `size`, `lfs`), as
  `snapshot_download` lists them;
- `HEAD` / `GET /{repo}/resolve/{rev}/{file}`: `X-Repo-Commit` and `ETag` (the git blob sha1);
  an LFS file (`.safetensors`, `.gguf`) answers 302 to its blob on a second server (a CDN:
  another origin, so the client stops its HEAD there and sends no token on) with
  `X-Linked-Etag` (its sha256) and `X-Linked-Size`; bodies honour `Range`.
Errors carry `X-Error-Code` as the hub's do (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo). No xet headers: the client downloads over plain HTTP.

Knobs for the failure cases: `cut_once(file, fraction)` ends the next body of that file
after that fraction with the connection dropped; `corrupt(file, times)` flips a byte in
its next `times` bodies; `token` makes every API and resolve call without
`Authorization: Bearer TOKEN` a 401 (a gated repo); `slow(file, bytes_per_s)` sends that
file's bodies at that rate and records in `abandoned` a file whose client went away. It
counts per file the bytes it served (`served`) and the first byte of each ranged request
(`range_starts`).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class HubFile:
    name: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return self.name.endswith(LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        """The git blob's sha1: of the LFS pointer for an LFS file, as on the hub."""
        if not self.lfs:
            return git_blob_sha1(self.data)
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n"
        return git_blob_sha1(pointer.encode())

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else git_blob_sha1(self.data)


@dataclass
class Repo:
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)  # commit -> path -> file
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit


class FakeHub:
    """Two ThreadingHTTPServers on 127.0.0.1: the hub (`endpoint`) and its blob store."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.token: str | None = None
        self.served: dict[str, int] = {}
        self.range_starts: dict[str, list[int]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self._cuts: dict[str, float] = {}
        self._rates: dict[str, float] = {}
        self.abandoned: set[str] = set()  # files whose client left mid-body (slow ones)
        self.slow_bodies = self.most_slow_bodies = 0  # slow bodies being sent: now, and at most at once
        self._corrupt: dict[str, int] = {}
        self._lock = threading.Lock()
        self._connections: set = set()  # open keep-alive connections, closed with the hub
        self._api = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, blobs=False))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, blobs=True))
        for server in (self._api, self._cdn):
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._api.server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    def close(self) -> None:
        """Stop both servers and drop their open connections: a client's pooled connection must
        not reach this hub's handlers after a new hub takes the same port."""
        for server in (self._api, self._cdn):
            server.shutdown()
            server.server_close()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- content ----------------------------------------------------------------------------------
    def add(self, repo: str, model_dir: Path, refs: tuple[str, ...] = ("main",)) -> str:
        """A commit of `repo` holding the files of `model_dir` (what `orchard model create`
        wrote), pointed at by each of `refs` (branches or tags). Returns the commit's sha."""
        model_dir = Path(model_dir)
        files = {p.relative_to(model_dir).as_posix(): HubFile(p.relative_to(model_dir).as_posix(), p.read_bytes())
                 for p in sorted(model_dir.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(repo.encode() + b"".join(f"{k}:{f.etag}".encode() for k, f in files.items())).hexdigest()
        r = self.repos.setdefault(repo, Repo())
        r.commits[commit] = files
        for ref in refs:
            r.refs[ref] = commit
        return commit

    def file(self, repo: str, rev: str, path: str) -> HubFile:
        r = self.repos[repo]
        return r.commits[r.refs.get(rev, rev)][path]

    # -- knobs ------------------------------------------------------------------------------------
    def cut_once(self, path: str, fraction: float) -> None:
        """The next body of `path` stops after `fraction` of the file, the connection dropped."""
        self._cuts[path] = fraction

    def corrupt(self, path: str, times: int = 1) -> None:
        """The next `times` bodies of `path` carry one byte flipped."""
        self._corrupt[path] = times

    def slow(self, path: str, bytes_per_s: float) -> None:
        """Bodies of `path` go out at `bytes_per_s`."""
        self._rates[path] = bytes_per_s

    def _take_cut(self, path: str) -> float | None:
        with self._lock:
            return self._cuts.pop(path, None)

    def _take_corruption(self, path: str) -> bool:
        with self._lock:
            left = self._corrupt.get(path, 0)
            self._corrupt[path] = max(0, left - 1)
            return left > 0

    def _count(self, path: str, n: int, start: int | None) -> None:
        with self._lock:
            self.served[path] = self.served.get(path, 0) + n
            if start is not None:
                self.range_starts.setdefault(path, []).append(start)


def _handler(hub: FakeHub, blobs: bool):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            with hub._lock:
                hub._connections.add(self.connection)

        def finish(self) -> None:
            with hub._lock:
                hub._connections.discard(self.connection)
            super().finish()

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        # -- routing ------------------------------------------------------------------------------
        def _route(self, body: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            hub.requests.append((self.command, path))
            if blobs:
                return self._blob(path, body)
            if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self._error(401, "GatedRepo", "Access to this model is restricted: a token is needed")
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path):
                return self._info(m.group(1), m.group(2) or "main", parse_qs(url.query))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path):
                return self._tree(m.group(1), m.group(2), m.group(3) or "")
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                return self._resolve(m.group(1), m.group(2), m.group(3), body)
            self._error(404, "", f"no route {path}")

        def _commit(self, repo: str, rev: str) -> str | None:
            r = hub.repos.get(repo)
            if r is None:
                self._error(404, "RepoNotFound", f"Repository {repo} not found")
                return None
            commit = r.refs.get(rev, rev)
            if commit not in r.commits:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return commit

        def _info(self, repo: str, rev: str, query: dict) -> None:
            if (commit := self._commit(repo, rev)) is None:
                return
            with_blobs = query.get("blobs", ["false"])[0].lower() == "true"
            siblings = []
            for name, f in hub.repos[repo].commits[commit].items():
                s: dict = {"rfilename": name}
                if with_blobs:
                    s.update(size=len(f.data), blobId=f.blob_id)
                    if f.lfs:
                        s["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": 134}
                siblings.append(s)
            self._json({"id": repo, "modelId": repo, "sha": commit, "private": False, "siblings": siblings})

        def _tree(self, repo: str, rev: str, under: str) -> None:
            if (commit := self._commit(repo, rev)) is None:
                return
            entries = []
            for name, f in hub.repos[repo].commits[commit].items():
                if under and not name.startswith(under.rstrip("/") + "/"):
                    continue
                e: dict = {"type": "file", "oid": f.blob_id, "size": len(f.data), "path": name}
                if f.lfs:
                    e["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
                entries.append(e)
            self._json(entries)

        def _resolve(self, repo: str, rev: str, name: str, body: bool) -> None:
            if (commit := self._commit(repo, rev)) is None:
                return
            f = hub.repos[repo].commits[commit].get(name)
            if f is None:
                return self._error(404, "EntryNotFound", f"{name} does not exist", {"X-Repo-Commit": commit})
            if f.lfs:
                self.send_response(302)
                self.send_header("Location", f"{hub.cdn}/blobs/{f.sha256}?repo={repo}&file={name}")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{f.blob_id}"')
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(len(f.data)))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._body(name, f, body, {"X-Repo-Commit": commit, "ETag": f'"{f.etag}"'})

        def _blob(self, path: str, body: bool) -> None:
            query = parse_qs(urlsplit(self.path).query)
            m = re.fullmatch(r"/blobs/([0-9a-f]{64})", path)
            repo, name = query.get("repo", [""])[0], query.get("file", [""])[0]
            for r in hub.repos.values() if m else ():
                for files in r.commits.values():
                    f = files.get(name)
                    if f is not None and f.sha256 == m.group(1):
                        return self._body(name, f, body, {"ETag": f'"{f.sha256}"'})
            self._error(404, "", f"no blob {path} for {repo}/{name}")

        # -- answers ------------------------------------------------------------------------------
        def _body(self, name: str, f: HubFile, body: bool, headers: dict[str, str]) -> None:
            data, size = f.data, len(f.data)
            start, end, ranged = 0, size - 1, None
            if (r := self.headers.get("Range")) and (m := _RANGE.fullmatch(r.strip())):
                start, ranged = int(m.group(1)), int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            if start >= size and size:
                return self._error(416, "", f"range {r} past the end ({size} bytes)")
            self.send_response(206 if ranged is not None else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            if ranged is not None:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if not body:
                return
            if hub._take_corruption(name):
                flipped = bytearray(data)
                flipped[size // 2] ^= 0xFF
                data = bytes(flipped)
            chunk = data[start:end + 1]
            cut = hub._take_cut(name)
            if cut is not None:
                chunk = chunk[:max(0, int(size * cut) - start)]
            if (rate := hub._rates.get(name)) is not None:
                return self._slowly(name, chunk, rate, ranged)
            self.wfile.write(chunk)
            hub._count(name, len(chunk), ranged)
            if cut is not None:
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        def _slowly(self, name: str, chunk: bytes, rate: float, ranged: int | None) -> None:
            with hub._lock:
                hub.slow_bodies += 1
                hub.most_slow_bodies = max(hub.most_slow_bodies, hub.slow_bodies)
            try:
                self._pieces(name, chunk, rate, ranged)
            finally:
                with hub._lock:
                    hub.slow_bodies -= 1

        def _pieces(self, name: str, chunk: bytes, rate: float, ranged: int | None) -> None:
            piece = 64 << 10
            for at in range(0, len(chunk), piece):
                if at:
                    time.sleep(piece / rate)
                try:
                    self.wfile.write(chunk[at:at + piece])
                    self.wfile.flush()
                except OSError:
                    hub.abandoned.add(name)
                    self.close_connection = True
                    return
                hub._count(name, len(chunk[at:at + piece]), ranged if at == 0 else None)

        def _json(self, value) -> None:
            raw = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

        def _error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
            raw = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

    return Handler
