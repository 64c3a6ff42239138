"""Models from the Hugging Face Hub: catalog sources `hf:ORG/REPO[@REVISION]` (node side; no
MLX; `huggingface_hub` is imported where it is used).

A source names a repository and a revision (a branch, a tag or a commit; `main` when left
out); its canonical form always carries the revision (`hf:org/repo@main`), and that is the
name a node reports it under. A node keeps what it fetched in a hub cache in
huggingface_hub's own layout (`models--ORG--REPO/{blobs,snapshots,refs}`), so
huggingface_hub, `scan_cache_dir` and mlx-lm read it as their own.

- `pull`: `snapshot_download` into the cache (the client's own resume of a dropped
  transfer, HF_TOKEN, HF_ENDPOINT), then every file checked against the hub's hashes
  (`model_info(files_metadata=True)`: an LFS file's sha256, another's git blob sha1). A
  file that does not match is deleted and fetched once more; a second mismatch is
  DATA_LOSS. The ref (`refs/main`) is written once the snapshot is whole and checked, so
  a pull of a revision whose ref already points at a whole snapshot is done at once.
  A pipeline rank (`layers`) fetches only the weight shards its stage reads
  (`worker/group/split.stage_weight_files` over model.safetensors.index.json) and every
  file that is not a weight shard.
- `describe`: a model's facts (`facts.model_facts`) from the hub's metadata alone: its file
  list, config.json and the safetensors headers (range reads), before any weight moves.
- `scan`: the cache's whole snapshots as `DiskModel`s with `fetched` set, named once per ref
  that points at one (`hf:org/repo@main`) and once by its commit.
- `files`: a directory's files with their sha256, as a peer copies them.

HF_ENDPOINT and HF_HUB_OFFLINE are read at each call rather than when huggingface_hub is
imported (it reads them once), so a process that imported it earlier still honours them.
Errors are FleetErrors: NOT_FOUND (repository, revision or file), PERMISSION_DENIED (a
gated or private repository: HF_TOKEN), UNAVAILABLE (the hub unreachable, or HF_HUB_OFFLINE
without the files), DATA_LOSS (a file that twice did not match its hash).
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc

from cluster.api.limits import quoted
from cluster.config import setting
from cluster.fleet import FleetError, facts
from cluster.fleet.node_config import DEFAULT_MODELS_DIR
from cluster.proto.orchard.v1 import orchard_pb2 as pb

log = logging.getLogger(__name__)

PREFIX = "hf:"
DEFAULT_REVISION = "main"
INDEX = "model.safetensors.index.json"
SOURCE_FORM = "hf:ORG/REPO[@REVISION] (e.g. hf:mlx-community/Qwen3-0.6B-4bit@main)"
# the hub's repo id rules: each part letters, digits and . _ -, at most 96, no -- or ..,
# neither starting nor ending with - or .
_REPO_PART = re.compile(r"(?![-.])(?!.*(?:--|\.\.))[A-Za-z0-9._-]{1,96}(?<![-.])")
_REVISION = re.compile(r"(?![-./])(?!.*(?:\.\.|//))[A-Za-z0-9._/-]{1,200}(?<![./])")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
HEADER_READS = 8  # safetensors headers `describe` reads at once
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable
# the byte bars huggingface_hub opens for a snapshot's files and for one file's download
_BYTE_BARS = {"huggingface_hub.snapshot_download", "huggingface_hub.http_get"}

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass(frozen=True)
class HubSource:
    repo: str  # ORG/NAME
    revision: str = DEFAULT_REVISION  # a branch, a tag or a commit

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo}@{self.revision}"


def is_hub_source(source: str) -> bool:
    return source.startswith(PREFIX)


def parse_source(source: str) -> HubSource:
    """`hf:ORG/REPO[@REVISION]`, or INVALID_ARGUMENT naming the field and the form."""
    if not is_hub_source(source):
        raise _invalid(f"source: {quoted(source)} is not {SOURCE_FORM}")
    repo, at, revision = source[len(PREFIX):].partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) for p in parts):
        raise _invalid(f"source: {quoted(source)} is not {SOURCE_FORM}: the repository is ORG/NAME, each part "
                       "at most 96 letters, digits and . _ - (no -- or .., not starting or ending with - or .)")
    if at and not _REVISION.fullmatch(revision):
        raise _invalid(f"source: {quoted(source)} is not {SOURCE_FORM}: the revision after @ is a branch, tag or "
                       "commit (at most 200 letters, digits and . _ - /)")
    return HubSource(repo, revision or DEFAULT_REVISION)


def canonical(source: str) -> str:
    """The name a hub source is known by: `hf:ORG/REPO@REVISION` (`@main` added)."""
    return str(parse_source(source))


def default_hub_cache(models_dir: str | Path = DEFAULT_MODELS_DIR) -> Path:
    """Where a node keeps fetched models unless told (`--hub-cache`): hidden under its
    --models-dir, so that directory's own scan never lists it."""
    return Path(models_dir).expanduser() / ".hub"


# -- the cache --------------------------------------------------------------------------------------

def _storage(cache: Path, repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return Path(cache).expanduser() / repo_folder_name(repo_id=repo, repo_type="model")


def _commit_of(storage: Path, revision: str) -> str | None:
    if _COMMIT.fullmatch(revision):
        return revision
    try:
        commit = (storage / "refs" / revision).read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT.fullmatch(commit) else None


def local_snapshot(source: str | HubSource, cache: str | Path,
                   layers: tuple[int, int] | None = None) -> Path | None:
    """The snapshot directory `source` names in `cache` (its ref, or its commit) when it holds
    every file (for a pipeline rank, every file of `layers`); None else. No network."""
    src = _source(source)
    storage = _storage(Path(cache), src.repo)
    commit = _commit_of(storage, src.revision)
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir() or _missing(src, Path(cache), snapshot, layers):
        return None
    return snapshot


def missing(source: str | HubSource, cache: str | Path, layers: tuple[int, int] | None = None) -> list[str]:
    """The files the snapshot `source` names in `cache` lacks (those of `layers` for a rank);
    every file when there is no snapshot (["config.json"] without a file list). No network."""
    src = _source(source)
    storage = _storage(Path(cache), src.repo)
    commit = _commit_of(storage, src.revision)
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        return ["config.json"]
    return _missing(src, Path(cache), snapshot, layers)


def _missing(src: HubSource, cache: Path, snapshot: Path, layers: tuple[int, int] | None) -> list[str]:
    """The files `snapshot` lacks: against the file list huggingface_hub cached when it
    fetched it; without one (a copy made otherwise), the config and the indexed shards."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        names = [f.path for f in get_cached_repo_tree(src.repo, revision=snapshot.name,
                                                      cache_dir=Path(cache).expanduser())]
    except CachedRepoTreeNotFoundError:
        names = ["config.json", *sorted(set(_read_index(snapshot).get("weight_map", {}).values()))]
    wanted = _selected(names, _read_index(snapshot), _num_layers(snapshot), layers)
    return [n for n in wanted if not (snapshot / n).exists()]


def _read_index(model_dir: Path) -> dict:
    try:
        index = json.loads((model_dir / INDEX).read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _num_layers(model_dir: Path) -> int:
    try:
        return facts.num_layers(facts.read_config(model_dir))
    except facts.ModelFilesError:
        return 0


def _selected(names: list[str], index: dict, num_layers: int, layers: tuple[int, int] | None) -> list[str]:
    """Of a model's files, those a pipeline rank holding `layers` (first, last) reads: every
    file but the weight shards none of its tensors are in. All of them for `layers` None or
    a model without an index."""
    weight_map = index.get("weight_map")
    if layers is None or not isinstance(weight_map, dict):
        return sorted(names)
    # the group loader's own rule (pure, no MLX), imported here: a router never needs it
    from cluster.worker.group.split import stage_weight_files

    first, last = layers
    keep = set(stage_weight_files(weight_map, range(first, last + 1), embeds=first == 0,
                                  heads=num_layers == 0 or last >= num_layers - 1))
    shards = set(weight_map.values())
    return sorted(n for n in names if n not in shards or n in keep)


def write_ref(storage: Path, revision: str, commit: str) -> None:
    """`refs/REVISION` holds the commit (written whole: a reader never sees half of it)."""
    if revision == commit:
        return
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f"{ref.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


# -- pulling ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Settings:
    endpoint: str | None  # None: huggingface.co
    offline: bool

    @property
    def where(self) -> str:
        return self.endpoint or "https://huggingface.co"


def _settings() -> _Settings:
    return _Settings(endpoint=os.environ.get("HF_ENDPOINT", "").rstrip("/") or None,
                     offline=os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE)


@dataclass(frozen=True)
class _Expected:
    size: int
    algorithm: str  # "sha256" (an LFS file) or "git-sha1"
    digest: str


class _Bytes:
    """A pull's progress in bytes, reported to `report(done, total)` as they arrive (from
    huggingface_hub's worker threads)."""

    def __init__(self, report: Progress | None, done: int, total: int):
        self.report, self.done, self.total = report, done, total
        self._lock = threading.Lock()
        self.add(0)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            done = max(0, min(self.done, self.total))
        if self.report is not None:
            self.report(done, self.total)

    def bar_class(self):
        """A tqdm class for huggingface_hub: its own bars (shown on a terminal), and each byte
        they count added here."""
        from huggingface_hub.utils import tqdm as hf_tqdm

        counter = self

        class Bar(hf_tqdm):
            def __init__(self, *args, **kwargs):
                self._counts_bytes = kwargs.get("name") in _BYTE_BARS
                super().__init__(*args, **kwargs)

            def update(self, n=1):
                if self._counts_bytes and n:
                    counter.add(int(n))
                return super().update(n)

        return Bar


def pull(source: str | HubSource, cache: str | Path, layers: tuple[int, int] | None = None,
         progress: Progress | None = None) -> Path:
    """Fetch `source` into the hub cache `cache` (only the files of `layers` (first, last) for
    a pipeline rank) and check it against the hub's hashes; returns its snapshot directory.
    `progress(done, total)` is called as bytes arrive. With HF_HUB_OFFLINE set, the cache
    must hold it already."""
    src, cache = _source(source), Path(cache).expanduser()
    hub = _settings()
    if hub.offline:
        return _offline_snapshot(src, cache, layers, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    api = HfApi(endpoint=hub.endpoint)
    storage = _storage(cache, src.repo)
    with _hub_errors(src, hub):
        try:
            info = api.model_info(src.repo, revision=src.revision, files_metadata=True)
        except _unreachable() as e:  # the cache's copy serves while the hub is away
            snapshot = _offline_snapshot(src, cache, layers, f"the hub at {hub.where} cannot be reached ({_line(e)})")
            log.warning("%s: the hub at %s cannot be reached: using %s as it is", src, hub.where, snapshot)
            return snapshot
        commit = str(info.sha)
        expected = {s.rfilename: _expected(s) for s in info.siblings or []}
        snapshot = storage / "snapshots" / commit

        def fetch(names: list[str], bar) -> None:
            if names:
                snapshot_download(src.repo, revision=commit, cache_dir=cache, endpoint=hub.endpoint,
                                  allow_patterns=[glob.escape(n) for n in names], tqdm_class=bar)

        def fetch_again(name: str, bar) -> None:
            hf_hub_download(src.repo, name, revision=commit, cache_dir=cache, endpoint=hub.endpoint, tqdm_class=bar)

        if _commit_of(storage, src.revision) == commit and local_snapshot(src, cache, layers) is not None:
            whole = sum(e.size for n, e in expected.items() if (snapshot / n).exists())
            _Bytes(progress, whole, whole)
            return snapshot  # checked when it was pulled (its ref is written after that)
        wanted = sorted(expected)
        if layers is not None and INDEX in expected:  # the index says which shards the rank reads
            first = [n for n in ("config.json", INDEX) if n in expected]
            fetch(first, _Bytes(None, 0, 0).bar_class())
            _verify(src, snapshot, {n: expected[n] for n in first}, fetch_again, _Bytes(None, 0, 0))
            wanted = _selected(wanted, _read_index(snapshot), _num_layers(snapshot), layers)
        here = sum(expected[n].size for n in wanted if (snapshot / n).exists())
        counter = _Bytes(progress, here, sum(expected[n].size for n in wanted))
        fetch(wanted, counter.bar_class())
        _verify(src, snapshot, {n: expected[n] for n in wanted}, fetch_again, counter)
        write_ref(storage, src.revision, commit)
    return snapshot


def pull_bytes(source: str | HubSource, cache: str | Path, layers: tuple[int, int] | None = None) -> int:
    """The bytes a pull of `source` has still to write into `cache` (0 offline): the sizes the
    hub lists for its files (a rank's only, once the cache holds the index) less the files the
    snapshot holds. From the hub's file list alone: nothing is downloaded."""
    src, cache = _source(source), Path(cache).expanduser()
    hub = _settings()
    if hub.offline:
        return 0
    from huggingface_hub import HfApi

    with _hub_errors(src, hub):
        info = HfApi(endpoint=hub.endpoint).model_info(src.repo, revision=src.revision, files_metadata=True)
    sizes = {s.rfilename: _expected(s).size for s in info.siblings or []}
    snapshot = _storage(cache, src.repo) / "snapshots" / str(info.sha)
    wanted = _selected(sorted(sizes), _read_index(snapshot), _num_layers(snapshot), layers)
    return sum(sizes[n] for n in wanted if not (snapshot / n).exists())


def _offline_snapshot(src: HubSource, cache: Path, layers: tuple[int, int] | None, why: str) -> Path:
    snapshot = local_snapshot(src, cache, layers)
    if snapshot is not None:
        return snapshot
    storage = _storage(cache, src.repo)
    commit = _commit_of(storage, src.revision)
    held = storage / "snapshots" / commit if commit else None
    missing = _missing(src, cache, held, layers) if held is not None and held.is_dir() else []
    what = f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing else "does not hold it"
    fix = "unset HF_HUB_OFFLINE" if "HF_HUB_OFFLINE" in why else "check HF_ENDPOINT and the network"
    raise FleetError(grpc.StatusCode.UNAVAILABLE, f"{src}: {why} and the hub cache {cache} {what}; {fix} to pull it")


def _expected(sibling) -> _Expected:
    if sibling.lfs is not None:
        return _Expected(int(sibling.lfs.size), "sha256", str(sibling.lfs.sha256).lower())
    return _Expected(int(sibling.size or 0), "git-sha1", str(sibling.blob_id).lower())


def _verify(src: HubSource, snapshot: Path, expected: dict[str, _Expected],
            fetch_again: Callable[[str, type], None], counter: _Bytes) -> None:
    """Each file against the hub's hash; one that differs is deleted and fetched again once.
    The progress is told before each file: a caller stopping the pull (its report raises)
    stops the hashing too."""
    for name, want in sorted(expected.items()):
        counter.add(0)
        path = snapshot / name
        if digest(path, want.algorithm) == want.digest:
            continue
        log.warning("%s: %s does not match the hub's %s: fetching it again", src, name, want.algorithm)
        counter.add(-_forget(path))
        fetch_again(name, counter.bar_class())
        got = digest(path, want.algorithm)
        if got != want.digest:
            _forget(path)
            raise FleetError(grpc.StatusCode.DATA_LOSS,
                             f"{src}: {name} did not match the hub's {want.algorithm} twice (expected {want.digest}, "
                             f"got {got or 'no file'}); deleted it, pull again to retry")


def _forget(path: Path) -> int:
    """Delete a snapshot's file and its blob; returns the bytes it held."""
    size = 0
    try:
        blob = path.resolve()
        size = blob.stat().st_size
        blob.unlink(missing_ok=True)
    except OSError:
        pass
    path.unlink(missing_ok=True)
    return size


def _sha256(path: Path) -> str:
    return digest(path, "sha256")


def git_sha1(path: Path) -> str:
    """The file's git blob sha1: the hub's etag of a file not in LFS."""
    return digest(path, "git-sha1")


_hashes: dict[tuple[str, str, int, int], str] = {}  # (algorithm, real path, size, mtime) -> hex
_hashes_lock = threading.Lock()


def digest(path: Path, algorithm: str) -> str:
    """The file's sha256 or git blob sha1 ("" when it is missing), computed once per size and
    modification time."""
    try:
        real = path.resolve()
        st = real.stat()
    except OSError:
        return ""
    key = (algorithm, str(real), st.st_size, st.st_mtime_ns)
    with _hashes_lock:
        if key in _hashes:
            return _hashes[key]
    h = hashlib.sha256() if algorithm == "sha256" else hashlib.sha1(b"blob %d\0" % st.st_size)
    with open(real, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    with _hashes_lock:
        _hashes[key] = h.hexdigest()
    return _hashes[key]


def _unreachable() -> tuple[type[BaseException], ...]:
    import httpx2

    return httpx2.ConnectError, httpx2.TimeoutException


@contextmanager
def _hub_errors(src: HubSource, hub: _Settings) -> Iterator[None]:
    """huggingface_hub's exceptions as FleetErrors naming the source and what to do."""
    import httpx2
    from huggingface_hub import errors

    try:
        yield
    except FleetError:
        raise
    except errors.GatedRepoError as e:
        raise FleetError(grpc.StatusCode.PERMISSION_DENIED,
                         f"{src}: {src.repo} is gated on the hub at {hub.where}: accept its terms there and set "
                         f"HF_TOKEN to a token with access ({_line(e)})") from None
    except errors.RepositoryNotFoundError:
        raise FleetError(grpc.StatusCode.NOT_FOUND,
                         f"{src}: no repository {src.repo} on the hub at {hub.where} (a private one needs HF_TOKEN "
                         "set to a token with access)") from None
    except errors.RevisionNotFoundError:
        raise FleetError(grpc.StatusCode.NOT_FOUND,
                         f"{src}: {src.repo} has no revision {src.revision} (a branch, tag or commit)") from None
    except errors.RemoteEntryNotFoundError as e:
        raise FleetError(grpc.StatusCode.NOT_FOUND, f"{src}: a file is missing on the hub ({_line(e)})") from None
    except (errors.HfHubHTTPError, httpx2.HTTPError) as e:
        raise FleetError(grpc.StatusCode.UNAVAILABLE, f"{src}: the hub at {hub.where} failed: {_line(e)}") from None
    except OSError as e:  # a transfer cut short past the client's retries, a full disk
        if e.errno == errno.ENOSPC:
            raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{src}: the disk is full: {_line(e)}") from None
        raise FleetError(grpc.StatusCode.UNAVAILABLE, f"{src}: {_line(e)}") from None


def _line(e: BaseException) -> str:
    """An exception's message on one line (huggingface_hub's span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def _invalid(message: str) -> FleetError:
    return FleetError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _source(source: str | HubSource) -> HubSource:
    return source if isinstance(source, HubSource) else parse_source(source)


# -- what a node holds, what it could fetch ------------------------------------------------------

def scan(cache: str | Path, platform: str) -> list[pb.DiskModel]:
    """The whole snapshots in the hub cache `cache`, each named once per ref that points at it
    (`hf:org/repo@main`) and once by its commit, with `fetched` set; each read again only
    when its files changed. A pipeline rank's partial snapshot is not listed."""
    cache = Path(cache).expanduser()
    out: list[pb.DiskModel] = []
    for storage in sorted(cache.glob("models--*--*")):
        repo = storage.name[len("models--"):].replace("--", "/", 1)
        refs: dict[str, list[str]] = {}  # commit -> the refs pointing at it
        for ref in sorted(p.relative_to(storage / "refs").as_posix() for p in (storage / "refs").rglob("*")
                          if p.is_file() and not p.name.endswith(".tmp")):
            if (commit := _commit_of(storage, ref)) is not None:
                refs.setdefault(commit, []).append(ref)
        for snapshot in sorted((storage / "snapshots").glob("*")):
            model = _snapshot_facts(repo, cache, snapshot, platform) if _COMMIT.fullmatch(snapshot.name) else None
            if model is None:
                continue
            for revision in [*refs.get(snapshot.name, []), snapshot.name]:
                named = pb.DiskModel()
                named.CopyFrom(model)
                named.name = str(HubSource(repo, revision))
                out.append(named)
    return out


_scanned: dict[tuple[str, str], tuple[tuple, pb.DiskModel | None]] = {}  # (snapshot, platform) -> (files, facts)
_scanned_lock = threading.Lock()


def _snapshot_facts(repo: str, cache: Path, snapshot: Path, platform: str) -> pb.DiskModel | None:
    """A whole snapshot's facts (`fetched` set), None for a partial one; cached by its files'
    sizes and modification times."""
    try:
        sig = facts.signature(snapshot)
    except OSError:
        return None  # a file's blob removed while we looked
    key = (str(snapshot), platform)
    with _scanned_lock:
        cached = _scanned.get(key)
    if cached is not None and cached[0] == sig:
        return cached[1]
    model = None
    if not _missing(HubSource(repo, snapshot.name), cache, snapshot, None):
        model = facts.disk_model(snapshot, platform)
        model.fetched = True
    with _scanned_lock:
        _scanned[key] = (sig, model)
    return model


def describe(source: str | HubSource, cache: str | Path, platform: str) -> pb.DiskModel:
    """`source`'s facts for a worker on `platform`, named by its canonical source: from the
    cache when it holds it, else from the hub's metadata alone (its file list, config.json,
    the safetensors headers through range reads; no weight is downloaded). A model that
    cannot be served from these files gets `error` set, as `facts.disk_model` does."""
    src, cache = _source(source), Path(cache).expanduser()
    snapshot = local_snapshot(src, cache)
    if snapshot is not None:
        model = facts.disk_model(snapshot, platform)
        model.name, model.fetched = str(src), True
        return model
    hub = _settings()
    if hub.offline:
        _offline_snapshot(src, cache, None, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=hub.endpoint)
    with _hub_errors(src, hub), tempfile.TemporaryDirectory(prefix="orchard-describe-") as tmp:
        info = api.model_info(src.repo, revision=src.revision, files_metadata=True)
        sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
        model = pb.DiskModel(name=str(src), file_bytes=sum(sizes.values()))
        local = Path(tmp) / src.repo.split("/")[1]  # its name, as a directory's tells `tasks` a reranker
        for name in _config_files(sizes):
            hf_hub_download(src.repo, name, revision=info.sha, local_dir=local, endpoint=hub.endpoint)
        try:
            config = facts.read_config(local)
            tensors: dict[str, facts.Tensor] = {}
            weights = sorted(n for n in sizes if "/" not in n and fnmatch.fnmatch(n, facts.WEIGHT_FILES))
            if not weights:
                raise facts.ModelFilesError(f"{src.repo}: no {facts.WEIGHT_FILES} file")
            with ThreadPoolExecutor(HEADER_READS) as pool:  # a large model has many shards: one RPC's deadline
                headers = list(pool.map(lambda n: api.parse_safetensors_file_metadata(src.repo, n, revision=info.sha),
                                        weights))
            for name, header in zip(weights, headers):
                tensors.update(facts.header_tensors(
                    {k: {"dtype": t.dtype, "shape": t.shape} for k, t in header.tensors.items()}, name))
            model_tasks = facts.tasks(local, config)
        except Exception as e:  # noqa: BLE001  (a repository that is not a model Orchard serves: said in `error`)
            if isinstance(e, _hub_failures()):
                raise
            model.error = _line(e)
            return model
    return facts.model_facts(model, config, tensors, model_tasks, platform)


def _config_files(sizes: dict[str, int]) -> list[str]:
    """The small files that say what a model is: config.json, sentence-transformers'
    modules.json and its modules' configs (`pooling.Pooler.for_model` reads them)."""
    return sorted(n for n in sizes if n in ("config.json", "modules.json") or fnmatch.fnmatch(n, "*/config.json"))


def _hub_failures() -> tuple[type[BaseException], ...]:
    import httpx2
    from huggingface_hub import errors

    return errors.HfHubHTTPError, httpx2.HTTPError


def files(model_dir: str | Path, layers: tuple[int, int] | None = None,
          sha256_of: Callable[[Path], str] | None = None) -> list[pb.ModelFile]:
    """The files of a model directory (a hub snapshot or a plain one; hidden ones left out)
    with their size and sha256, those of `layers` (first, last) only for a pipeline rank. A
    snapshot's file also names its blob (the hub's etag); an LFS blob's name is its sha256
    already (`pull` checked it), any other file is hashed once per size and modification time
    (by `sha256_of(path)` where given: the disk KV tier keeps its hashes across restarts)."""
    root = Path(model_dir)
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    out = []
    for name in _selected(names, _read_index(root), _num_layers(root), layers):
        path = root / name
        real = path.resolve()
        blob = real.name if path.is_symlink() and real.parent.name == "blobs" else ""
        sha256 = blob if _SHA256.fullmatch(blob) else (sha256_of or _sha256)(path)
        out.append(pb.ModelFile(path=name, size=real.stat().st_size, sha256=sha256, blob=blob))
    return out


# -- `orchard model pull` ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PullConfig:
    """`orchard model pull`: a model from the hub into a node's hub cache."""

    source: str = setting(help=f"the model: {SOURCE_FORM}; HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE apply",
                          flag="source")
    hub_cache: str = setting("", "the hub cache to pull into, as the node agent's --hub-cache (default: "
                                 f"{DEFAULT_MODELS_DIR}/.hub, under --models-dir; "
                                 "~/.cache/huggingface/hub shares mlx-lm's downloads)", metavar="DIR")
    models_dir: str = setting(DEFAULT_MODELS_DIR, "the node's --models-dir (its hub cache is .hub in it)",
                              metavar="DIR")


def run_pull(config: PullConfig) -> int:
    """Pull with huggingface_hub's progress bars; a one-line error and exit 2 on failure."""
    cache = Path(config.hub_cache).expanduser() if config.hub_cache else default_hub_cache(config.models_dir)
    if not log.isEnabledFor(logging.DEBUG):  # a line per HTTP request is noise beside the bars (-v shows them)
        for name in ("httpx2", "httpcore2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        path = pull(config.source, cache)
    except FleetError as e:
        print(f"orchard model pull: {e.message}", file=sys.stderr)
        return 2
    print(f"pulled {canonical(config.source)} to {path}")
    return 0
