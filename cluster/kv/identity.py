"""Which KV a disk block holds: the model's identity (`KvIdentity`) and the weights digest in it.

A block's K/V is valid only for the exact weights, dtypes, KV layout, block size, layers
and attention path that computed it. All of that goes into one canonical JSON whose
blake2b names the store's directory and is written into every block's header, so a file
from another model or layout is refused, never served.

`weights_digest` names the weights by content: a hub snapshot's LFS file by its blob name
(its sha256 already), any other file by its sha256, computed once and kept in a small JSON
beside the store (keyed by path, size and mtime) so a restart does not read the weights again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from hashlib import blake2b
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cluster.fleet import hub
from cluster.kv import hashing

log = logging.getLogger(__name__)

KV_FORMAT_VERSION = 1  # the block file's layout (disk_store.py); a new one starts a new store
HASH_SCHEME = "blake2b-16/" + hashing.SEED.hex()  # a new hashing.SEED changes every block's name
DIGEST_CACHE = "weights-sha256.json"  # beside the stores, in the --kv-disk-dir

# numpy has no bfloat16: a pool in it is handled as its raw 2-byte elements.
_ITEMSIZE = {"bfloat16": 2}


def itemsize(dtype: str) -> int:
    """Bytes per element of a pool dtype named as numpy (or MLX's "bfloat16") spells it."""
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    return np.dtype(dtype).itemsize


class KvIdentity:
    """Everything a block's K/V depends on, as canonical JSON; `id` (32 hex) names it.

    Required: `weights` (`weights_digest`), `block_size` and `pool_layout`: one (shape of a
    single block, dtype) per pool array in the order the payload stores them (K then V per
    owned layer; MLA: one), each shape starting with `block_size`. Any other keyword goes in
    as given (JSON values): the compute and KV dtypes, `cpu_dequantize`, the rank's layers
    and their (layer, num_kv_heads, head_dim, latent), the attention backend and whether the
    host path runs (exactness is per path), the group's mode, rank and size.
    """

    def __init__(self, *, weights: str, block_size: int, pool_layout: Sequence[tuple[Sequence[int], str]],
                 **fields: Any):
        if block_size < 1:
            raise ValueError(f"KvIdentity: block_size must be at least 1, got {block_size}")
        layout = tuple((tuple(int(d) for d in shape), str(dtype)) for shape, dtype in pool_layout)
        if not layout:
            raise ValueError("KvIdentity: pool_layout is empty")
        for shape, dtype in layout:
            if not shape or shape[0] != block_size or min(shape) < 1:
                raise ValueError(f"KvIdentity: a pool's block shape {list(shape)} must start with "
                                 f"block_size {block_size} and have no empty dimension")
            itemsize(dtype)  # an unknown dtype fails here, not at the first write
        self.block_size = int(block_size)
        self.pool_layout = layout
        self.pool_nbytes = tuple(int(np.prod(shape)) * itemsize(dtype) for shape, dtype in layout)
        self.payload_bytes = sum(self.pool_nbytes)
        self.fields = json.loads(json.dumps(
            {**fields, "kv_format": KV_FORMAT_VERSION, "hash": HASH_SCHEME, "weights": weights,
             "block_size": self.block_size, "pool_layout": [[list(s), d] for s, d in layout]},
            default=_plain))
        self.canonical = json.dumps(self.fields, sort_keys=True, separators=(",", ":"))
        self.id_bytes = blake2b(self.canonical.encode(), digest_size=16).digest()
        self.id = self.id_bytes.hex()

    @classmethod
    def from_json(cls, text: str) -> KvIdentity:
        """The identity `canonical` (identity.json) describes."""
        fields = json.loads(text)
        for key in ("kv_format", "hash"):
            fields.pop(key, None)
        return cls(**fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KvIdentity) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"KvIdentity({self.id})"


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as JSON values; anything else is refused."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"KvIdentity: {type(value).__name__} is not a JSON value")


def weights_digest(model_dir: str | Path, cache_dir: str | Path | None = None,
                   layers: tuple[int, int] | None = None) -> str:
    """sha256 over the sorted (name, sha256) of the model's files (`hub.files`; those of
    `layers` for a pipeline rank; a .gguf: that file). Reads every byte of a file the hub
    has not named once; with `cache_dir` (the --kv-disk-dir) those sums persist in
    `DIGEST_CACHE` there, keyed by real path, size and mtime. Slow the first time for a large
    plain directory: call it off the engine thread."""
    cache = _DigestCache(Path(cache_dir) / DIGEST_CACHE if cache_dir else None)
    root = Path(model_dir)
    if root.is_file():
        entries = [(root.name, cache.sha256(root))]
    else:
        entries = [(f.path, f.sha256) for f in hub.files(root, layers, sha256_of=cache.sha256)]
    cache.save()
    h = hashlib.sha256()
    for name, sha256 in sorted(entries):
        h.update(f"{name}\0{sha256}\n".encode())
    return h.hexdigest()


_cache_lock = threading.Lock()  # two engines in one process may hash at once


class _DigestCache:
    """File sha256s by (real path, size, mtime_ns), loaded from and saved to a JSON file."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, list] = {}
        self.changed = False
        if path is not None:
            try:
                loaded = json.loads(path.read_text())
                self.entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                pass  # none yet, or unreadable: hashed again

    def sha256(self, path: Path) -> str:
        try:
            real = path.resolve()
            st = real.stat()
        except OSError:
            return ""
        key, stamp = str(real), [st.st_size, st.st_mtime_ns]
        kept = self.entries.get(key)
        if isinstance(kept, list) and kept[:2] == stamp and isinstance(kept[-1], str):
            return kept[-1]
        sha256 = hub.digest(real, "sha256")
        self.entries[key] = [*stamp, sha256]
        self.changed = True
        return sha256

    def save(self) -> None:
        """Best effort: a read-only --kv-disk-dir only costs hashing again at the next start."""
        if self.path is None or not self.changed:
            return
        with _cache_lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".weights-", suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump(self.entries, f)
                os.replace(tmp, self.path)
            except OSError as e:
                log.debug("weights digest cache %s not saved: %s", self.path, e)
