"""Directories Orchard writes whole (model imports, its caches), and never anything else.

Contract:
- `write_dir(dst, kind, source, fill)` has `fill` write into a new temporary directory
  beside `dst`, adds the marker (`MARKER`: the kind and the source), and renames it into
  place. Readers see no directory or a complete one.
- `dst` may be absent, an empty directory, or an earlier directory of the same kind (it
  carries the marker). Anything else is refused (`TargetError`, naming the path and why)
  before any work: an existing file, a symbolic link, a directory holding other files, the
  current or home directory or one of their parents (so `.`, `..` and `/`).
- An earlier directory is replaced only once the new one is complete, and only removed
  if it still carries the marker. With `replace=False` an earlier one is kept as it is
  (another process wrote the same thing first).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

MARKER = ".orchard-import.json"


class TargetError(ValueError):
    """A directory Orchard will not write over; the message names it and why."""


# Directories Orchard wrote before it marked them, known by a file only it writes there
LEGACY_MARKERS = {"gguf_import.json": "gguf-import"}  # gguf.IMPORT_KIND


def marker_kind(path: Path) -> str | None:
    """The kind an Orchard-written directory's marker names (None: no readable marker)."""
    try:
        kind = json.loads((path / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError, RecursionError):
        return next((k for name, k in LEGACY_MARKERS.items() if (path / name).is_file()), None)
    return kind if isinstance(kind, str) else None


def _protected(path: Path) -> str | None:
    """Why `path` (resolved) is never written whole, or None."""
    for name, place in (("the current directory", Path.cwd()), ("the home directory", Path.home())):
        place = place.resolve()
        if path == place:
            return f"it is {name}"
        if path in place.parents:
            return f"it holds {name}"
    return None


def check_target(dst: Path, kind: str) -> None:
    """TargetError unless `write_dir` may write `dst` (see the module's contract)."""
    dst = Path(dst)
    full = Path(os.path.abspath(dst.expanduser()))
    why = _protected(full.resolve())
    if why is None and full.is_symlink():
        why = "it is a symbolic link"
    elif why is None and full.exists() and not full.is_dir():
        why = "it exists and is not a directory"
    elif why is None and full.is_dir() and any(full.iterdir()):
        found = marker_kind(full)
        if found is None:
            why = (f"it exists and is not an earlier Orchard import (no {MARKER} in it): name a new directory, "
                   "or remove it yourself")
        elif found != kind:
            why = f"it holds an Orchard {found}, not a {kind}"
    if why:
        raise TargetError(f"refusing to write {dst}: {why}")


def _new_temporary(dst: Path) -> Path:
    """A new directory beside `dst` (never one that was there: mkdir fails on those)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.tmp")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def write_dir(dst: str | Path, kind: str, source: str, fill: Callable[[Path], None], replace: bool = True) -> Path:
    """`fill(tmp)` writes the directory's contents; `dst` then holds them (see the contract)."""
    check_target(Path(dst), kind)
    dst = Path(os.path.abspath(Path(dst).expanduser()))
    tmp = _new_temporary(dst)
    try:
        fill(tmp)
        (tmp / MARKER).write_text(json.dumps({"kind": kind, "source": source}) + "\n")
        _install(tmp, dst, kind, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _install(tmp: Path, dst: Path, kind: str, replace: bool) -> None:
    try:
        os.rename(tmp, dst)  # dst absent or an empty directory: one atomic step
        return
    except OSError:
        if not dst.is_dir() or dst.is_symlink() or not any(dst.iterdir()):
            raise
    if marker_kind(dst) != kind:  # someone else's, put there since the check
        check_target(dst, kind)
        raise TargetError(f"refusing to write {dst}: it is not an earlier Orchard {kind}")
    if not replace:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.old")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except OSError:
        os.rename(old, dst)
        raise
    if marker_kind(old) == kind:
        shutil.rmtree(old, ignore_errors=True)
    else:  # swapped under us between the check and the rename: not ours to remove
        log.warning("left %s in place of an earlier %s: it carries no %s", old, kind, MARKER)
