"""The disk budget of a node's fetched models (node side; no MLX).

Fetched models are the repositories in the agent's hub cache (`--hub-cache`, in
huggingface_hub's layout): pulled from the hub or copied from a peer, they are the agent's
to delete. Models a user put in `--models-dir` never are. When a fetch needs room, under
`--disk-budget` (the fetched models' bytes at most that) and within the disk's free space,
the least recently used repositories go first (a repository is used when a worker starts on
it: its snapshot's modification time, so the order outlives the agent), never one that is
protected (pinned, or loaded anywhere in the fleet) or that a worker here runs.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.config import human_bytes as human
from cluster.fleet import FleetError

REPO_PREFIX = "models--"
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class CachedRepo:
    repo: str  # ORG/NAME
    path: Path
    bytes: int  # its blobs (partial ones too)
    last_used: float  # wall-clock seconds: its newest snapshot's modification time


def repo_folder(repo: str) -> str:
    """huggingface_hub's folder for a model repository: models--ORG--NAME."""
    return REPO_PREFIX + repo.replace("/", "--")


def snapshot_dir(cache: Path, repo: str, revision: str) -> Path | None:
    """The snapshot directory of `repo` at `revision` (a commit, or a ref to one) in the hub
    cache, whole or not (`hub.local_snapshot` says whether it holds every file)."""
    root = Path(cache) / repo_folder(repo)
    commit = revision if _COMMIT.fullmatch(revision) else None
    if commit is None:
        try:
            commit = (root / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = root / "snapshots" / commit
    return snapshot if _COMMIT.fullmatch(commit) and snapshot.is_dir() else None


def cached_repos(cache: Path) -> list[CachedRepo]:
    """The model repositories in the hub cache at `cache`."""
    try:
        folders = [p for p in Path(cache).iterdir() if p.name.startswith(REPO_PREFIX) and p.is_dir()]
    except OSError:
        return []
    repos = []
    for folder in folders:
        try:
            size = sum(f.stat().st_size for f in (folder / "blobs").iterdir() if f.is_file())
        except OSError:
            size = 0
        try:
            used = max((s.stat().st_mtime for s in (folder / "snapshots").iterdir()), default=folder.stat().st_mtime)
        except OSError:
            used = 0.0
        repos.append(CachedRepo(folder.name[len(REPO_PREFIX):].replace("--", "/"), folder, size, used))
    return repos


def touch(snapshot: Path) -> None:
    """Mark the snapshot's repository used now (LRU)."""
    try:
        os.utime(snapshot)
    except OSError:
        pass


def seconds_since_used(repo: CachedRepo, now: float | None = None) -> float:
    return max(0.0, (time.time() if now is None else now) - repo.last_used)


def evictions(repos: list[CachedRepo], need: int, budget: int, disk_free: int, keep: set[str],
              what: str) -> list[CachedRepo]:
    """The repositories to delete, least recently used first, so that `need` more bytes fit
    both the `budget` (0: none) and `disk_free`; never one in `keep`. RESOURCE_EXHAUSTED
    naming the numbers when even deleting every other one would not make room (nothing is
    chosen then)."""
    used = sum(r.bytes for r in repos)
    free = disk_free

    def short() -> bool:
        return (budget > 0 and used + need > budget) or need > free

    chosen = []
    for repo in sorted((r for r in repos if r.repo not in keep), key=lambda r: r.last_used):
        if not short():
            break
        chosen.append(repo)
        used, free = used - repo.bytes, free + repo.bytes
    if short():
        kept = sorted(r.repo for r in repos if r.repo in keep)
        budget_words = f"--disk-budget {human(budget)} holds {human(sum(r.bytes for r in repos))} of fetched " \
                       f"models, " if budget else ""
        raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{what} needs {human(need)} more on disk: {budget_words}the disk has {human(disk_free)} "
                         f"free, and the fetched models that could make room are in use or protected "
                         f"({', '.join(kept) or 'none'})")
    return chosen


def drop_partials(cache: Path, repo: str) -> None:
    """Delete a repository's partial blobs (`<etag>.incomplete`, a peer copy's) whose blob is
    whole now: a pull does not resume from them (huggingface_hub downloads to files of its own)."""
    for partial in (Path(cache) / repo_folder(repo) / "blobs").glob("*.incomplete"):
        if partial.with_suffix("").is_file():
            partial.unlink(missing_ok=True)


def delete(repo: CachedRepo) -> None:
    shutil.rmtree(repo.path, ignore_errors=True)
