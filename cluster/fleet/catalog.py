"""The catalog: the models a fleet serves on demand, what was placed where, and the claims
that make a load single-flight across routers.

One SQLite file (stdlib `sqlite3`) holds three tables:
- `entries`: a `pb.CatalogModel`'s configuration per model (name, source, pin,
  keep-alive, max nodes, context, engine args, min and max replicas) and when it was last
  used;
- `placements`: each worker the fleet started for a model (node, worker id, group rank
  and size, bytes reserved, state, when started, which router placed it), so a router
  that starts again finds what it had placed;
- `loads`: at most one claim per model: the router that is loading it and until when.

Two routers (Orchard runs two for failover) may open the same file. Rule: a router starts
a load only while it holds the model's claim. `claim` takes it in an `IMMEDIATE`
transaction (SQLite's write lock, so two claims cannot both see the row free): it
succeeds when no router holds it, when this router holds it already (a holder calls it
again to extend its claim while a long load runs), or when the holder's claim is past
its ttl (a router that died mid-load); `release` gives it back. The file is in WAL mode
(readers never wait for the writer) with a busy timeout (a writer waits for the other's
transaction instead of failing). SQLite's locks need both routers on one machine or a
file system whose locks work (not a network share).

A `Catalog` opens one connection per thread (and per process, after a fork). Times are
wall-clock seconds (`time.time()`), the same in every process. Bad entries are refused
before anything is written, with a `CatalogError` naming the field, the limit and the
value.

Schema versions (`PRAGMA user_version`): 2 added `entries.min_replicas` / `max_replicas`; a
file of version 1 gets the columns (0: one replica) when it is opened, its entries kept.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc

from cluster.api.limits import quoted
from cluster.fleet import FleetError, hub
from cluster.proto.orchard.v1 import orchard_pb2 as pb

SCHEMA_VERSION = 2
BUSY_TIMEOUT_SECONDS = 30.0  # a writer waits this long for the other router's transaction

MAX_NAME_CHARS = 128
MAX_SOURCE_CHARS = 255  # a file name on macOS and Linux
MAX_KEEP_ALIVE_SECONDS = 365 * 86400.0
MIN_CONTEXT, MAX_CONTEXT = 16, 1 << 24
MAX_NODES = 64
MAX_REPLICAS = 64
MAX_ENGINE_ARGS, MAX_ENGINE_ARG_CHARS = 64, 1024
SHOWN_NAMES = 20  # catalog names listed in a NOT_FOUND message

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
_OLLAMA = re.compile(r"ollama:([A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?)"  # [NAMESPACE/]NAME
                     r"(?::([A-Za-z0-9_][A-Za-z0-9._-]{0,127}))?")  # :TAG
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+ -]*")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
DURATION_EXAMPLES = "e.g. 5m, 1h30m, 30s, 0, -1"

# `orchard worker serve` flags the fleet sets itself for each worker it starts: an entry
# may not set them (its source, its place, its addresses, its context and KV pool, its TLS
# files are the controller's and the node's).
FLEET_FLAGS = frozenset({"--model", "--gguf-file", "--grpc", "--router", "--worker-id", "--served-model-name",
                         "--advertise", "--metrics", "--max-model-len", "--kv-cache-memory-bytes",
                         "--num-kv-blocks", "--memory-budget", "--tls-cert", "--tls-key", "--tls-ca"})
FLEET_FLAG_PREFIXES = ("--group-",)
# Secrets: an entry's engine args are stored in the catalog, listed by ListCatalog and seen
# on each node's `ps`. The node agent gives its workers the fleet's keys in the environment.
SECRET_FLAGS = frozenset({"--join-token", "--api-key", "--api-key-file", "--admin-key"})
# A fleet's workers serve through the router: no address of their own that nothing placed.
UNPLACED_FLAGS = frozenset({"--http"})


class CatalogError(FleetError):
    """A catalog operation refused: ALREADY_EXISTS, NOT_FOUND, INVALID_ARGUMENT (naming the
    field, the limit and the value), FAILED_PRECONDITION (the file cannot be used) or
    UNAVAILABLE (the other router held the file's write lock past the busy timeout)."""


def _invalid(message: str) -> CatalogError:
    return CatalogError(grpc.StatusCode.INVALID_ARGUMENT, message)


# -- durations (Ollama's keep_alive) ------------------------------------------------------------

def parse_duration(text: str | float | int, field: str = "keep_alive") -> float:
    """Seconds of a duration written as Ollama takes one: a number of seconds ("300", "-1",
    "2.5") or Go's form with units h, m, s, ms ("5m", "1h30m", "-1h"). Negative means never
    (callers keep the sign), 0 means at once."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text):
            raise _invalid(f"{field}: {text!r} is not a duration ({DURATION_EXAMPLES})")
        return float(text)
    s = str(text).strip()
    if _NUMBER.fullmatch(s):
        return float(s)
    sign, body = (-1.0, s[1:]) if s[:1] == "-" else (1.0, s.lstrip("+"))
    parts = list(_DURATION_PART.finditer(body))
    if not body or "".join(p.group(0) for p in parts) != body:
        raise _invalid(f"{field}: {quoted(str(text))} is not a duration ({DURATION_EXAMPLES})")
    return sign * sum(float(p.group(1)) * _UNIT_SECONDS[p.group(2)] for p in parts)


def format_duration(seconds: float) -> str:
    """A duration as `parse_duration` reads it back: "5m", "1h30m", "45s", "0"; "-1" for never."""
    if seconds < 0:
        return "-1"
    if seconds != int(seconds):
        return f"{seconds:g}s"
    h, rest = divmod(int(seconds), 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v) or "0"


# -- validation -----------------------------------------------------------------------------------

def check_name(name: str) -> str:
    """A catalog name (what requests name as `model`), or INVALID_ARGUMENT saying why not."""
    if not name:
        raise _invalid("name: empty; a model needs a name (letters, digits and . _ : / -)")
    if len(name) > MAX_NAME_CHARS:
        raise _invalid(f"name: {len(name)} characters, at most {MAX_NAME_CHARS}: {quoted(name)}")
    if not _NAME.fullmatch(name):
        raise _invalid(f"name: {quoted(name)} is not a model name: it starts with a letter or digit "
                       "and has only letters, digits and . _ : / -")
    return name


def check_source(source: str) -> str:
    """A source in one of its forms: DIR or FILE.gguf, a name looked up under each node's
    --models-dir (never a path: each Mac finds its own copy), ollama:NAME[:TAG] (TAG
    "latest" when left out) or hf:ORG/REPO[@REVISION] (a node pulls it from the hub;
    REVISION "main" when left out). Returns it normalised."""
    if hub.is_hub_source(source):
        try:
            return hub.canonical(source)
        except FleetError as e:
            raise _invalid(e.message) from None
    if source.startswith("ollama:"):
        m = _OLLAMA.fullmatch(source)
        if not m:
            raise _invalid(f"source: {quoted(source)} is not ollama:NAME:TAG (e.g. ollama:llama3.2:3b)")
        return f"ollama:{m.group(1)}:{m.group(2) or 'latest'}"
    if len(source) > MAX_SOURCE_CHARS:
        raise _invalid(f"source: {len(source)} characters, at most {MAX_SOURCE_CHARS}: {quoted(source)}")
    if "/" in source or "\\" in source:
        kind = "an absolute path" if source.startswith(("/", "\\", "~")) else "a path"
        raise _invalid(f"source: {quoted(source)} is {kind}; a source is a name directly under each node's "
                       "--models-dir (DIR or FILE.gguf, e.g. qwen3-8b), so each Mac finds its own copy, "
                       "ollama:NAME:TAG or hf:ORG/REPO[@REVISION]")
    if not _FILE_NAME.fullmatch(source):
        raise _invalid(f"source: {quoted(source)} is not a directory or file name under --models-dir "
                       "(it starts with a letter, digit or _ and has only letters, digits, spaces and . _ + -)")
    return source


def check_engine_args(args: list[str]) -> list[str]:
    """More `orchard worker serve` flags for an entry's workers: real flags with valid
    values, none of those the fleet sets itself (`FLEET_FLAGS`, --group-*)."""
    if len(args) > MAX_ENGINE_ARGS:
        raise _invalid(f"engine_args: {len(args)} arguments, at most {MAX_ENGINE_ARGS}")
    for arg in args:
        if len(arg) > MAX_ENGINE_ARG_CHARS:
            raise _invalid(f"engine_args: an argument of {len(arg)} characters, at most {MAX_ENGINE_ARG_CHARS}: "
                           f"{quoted(arg)}")
        flag = arg.split("=", 1)[0]
        if flag in SECRET_FLAGS:
            raise _invalid(f"engine_args: {quoted(flag)} is a secret, and engine args are stored in the catalog, "
                           "listed and on each node's command lines; the workers get the fleet's keys from their "
                           "node agent's environment (ORCHARD_JOIN_TOKEN, ORCHARD_API_KEY, ORCHARD_ADMIN_KEY)")
        if flag in UNPLACED_FLAGS:
            raise _invalid(f"engine_args: {quoted(flag)}: the fleet's workers serve through the router, on the "
                           "addresses their node gives them; leave it out")
        if flag in FLEET_FLAGS or flag.startswith(FLEET_FLAG_PREFIXES):
            raise _invalid(f"engine_args: {quoted(flag)} is set by the fleet for each worker it starts "
                           "(the source, the node, its addresses, the context and KV pool, TLS, the group); "
                           "leave it out")
    _check_speculation(_parse_worker_flags(args).speculative_config)
    return list(args)


def _check_speculation(text: str | None) -> None:
    """Speculation without a draft model: a draft model's path would be read on every node
    as given (any file there), and its weights are outside the entry's footprint."""
    try:
        config = json.loads(text) if text else None
    except ValueError:
        config = None  # the worker's own check (at its start) says what is wrong with it
    if isinstance(config, dict) and (config.get("model") is not None
                                      or config.get("method") in ("draft", "draft_model")):
        raise _invalid("engine_args: --speculative-config names a draft model, which would be loaded from a path "
                       "on each node and is not counted in the model's footprint; the fleet runs ngram "
                       'speculation only (e.g. {"method": "ngram", "num_speculative_tokens": 4})')


class _WorkerFlags:
    """The `orchard worker serve` parser, whose errors are INVALID_ARGUMENT on engine_args."""

    parser = None

    @classmethod
    def get(cls):
        if cls.parser is None:
            import argparse

            from cluster.config import add_flags
            from cluster.worker.config import WorkerOptions  # no MLX: its flags only

            class Parser(argparse.ArgumentParser):
                def error(self, message):
                    raise _invalid(f"engine_args: {message} (flags of orchard worker serve)")

            parser = Parser(prog="orchard worker serve", add_help=False, allow_abbrev=False)
            add_flags(parser, WorkerOptions)
            cls.parser = parser
        return cls.parser


def _parse_worker_flags(args: list[str]):
    if args and not args[0].startswith("-"):
        raise _invalid(f"engine_args: {quoted(args[0])} is not a flag; give flags of orchard worker serve "
                       "(e.g. --max-num-seqs 16)")
    return _WorkerFlags.get().parse_args(["--model", "m", *args])


def worker_flags(args: list[str]):
    """An entry's engine args as `orchard worker serve` reads them, its defaults for the
    flags they leave out (the controller sizes a worker by its --max-num-seqs and
    --block-size). CatalogError: args that are not its flags."""
    return _parse_worker_flags(list(args))


def validate(entry: pb.CatalogModel) -> pb.CatalogModel:
    """A copy of `entry` with its configuration checked and normalised (an empty source is
    the name itself; a negative keep-alive is -1; none given stays unset: the router's
    default applies), the fields ListCatalog fills cleared.
    INVALID_ARGUMENT names the field, the limit and the value."""
    name = check_name(entry.name)
    if entry.source:
        source = check_source(entry.source)
    else:
        try:
            source = check_source(name)
        except CatalogError:
            raise _invalid(f"source: not given, and the name {quoted(name)} cannot stand for it; give a directory or "
                           "FILE.gguf name under each node's --models-dir, or ollama:NAME:TAG") from None
    keep_alive = entry.keep_alive_seconds if entry.HasField("keep_alive_seconds") else None
    if keep_alive is None:
        pass  # not given: the router's --default-keep-alive applies
    elif not math.isfinite(keep_alive):
        raise _invalid(f"keep_alive: {keep_alive} is not a duration ({DURATION_EXAMPLES})")
    elif keep_alive > MAX_KEEP_ALIVE_SECONDS:
        raise _invalid(f"keep_alive: {format_duration(keep_alive)} is more than "
                       f"{format_duration(MAX_KEEP_ALIVE_SECONDS)}; a negative keep_alive (-1) never unloads")
    if entry.context and not MIN_CONTEXT <= entry.context <= MAX_CONTEXT:
        raise _invalid(f"context: {entry.context} tokens, not in {MIN_CONTEXT}..{MAX_CONTEXT} "
                       "(0: the model's own)")
    if entry.max_nodes > MAX_NODES:
        raise _invalid(f"max_nodes: {entry.max_nodes}, at most {MAX_NODES} (0: any; 1: never a group)")
    check_replicas(entry.min_replicas, entry.max_replicas)
    return pb.CatalogModel(name=name, source=source, pin=entry.pin,
                           keep_alive_seconds=None if keep_alive is None else -1.0 if keep_alive < 0 else keep_alive,
                           max_nodes=entry.max_nodes, context=entry.context,
                           engine_args=check_engine_args(list(entry.engine_args)),
                           min_replicas=entry.min_replicas, max_replicas=entry.max_replicas)


def check_replicas(min_replicas: int, max_replicas: int, names: tuple[str, str] = ("min_replicas", "max_replicas")
                   ) -> None:
    """0 <= min <= max <= MAX_REPLICAS, max 0 standing for min (or 1); INVALID_ARGUMENT naming
    the field (`names`: how the caller spells them), the limit and the value."""
    low, high = names
    for field, value in ((low, min_replicas), (high, max_replicas)):
        if not 0 <= value <= MAX_REPLICAS:
            raise _invalid(f"{field}: {value}, not in 0..{MAX_REPLICAS} (replicas of the model, each a worker "
                           "or a group; 0: one)")
    if max_replicas and max_replicas < min_replicas:
        raise _invalid(f"{high}: {max_replicas}, less than {low} {min_replicas} (0: {low}, or 1)")


# -- the file -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """A worker (or group member) the fleet started for a catalog model."""

    model: str
    node_id: str
    worker_id: str
    rank: int = 0
    size: int = 1  # 1: a plain worker; else its group's size
    reserved_bytes: int = 0
    state: str = "starting"  # pb.ManagedWorker.state
    started_at: float = 0.0  # wall-clock seconds
    router_id: str = ""  # the router that placed it


@dataclass(frozen=True)
class Claim:
    """The router loading a model, until when its claim holds (wall-clock seconds)."""

    model: str
    router_id: str
    claimed_at: float
    expires_at: float


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    name TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    pin INTEGER NOT NULL DEFAULT 0,
    keep_alive REAL,  -- NULL: not given (the router's default)
    max_nodes INTEGER NOT NULL DEFAULT 0,
    context INTEGER NOT NULL DEFAULT 0,
    engine_args TEXT NOT NULL DEFAULT '[]',
    added_at REAL NOT NULL,
    last_used REAL,
    min_replicas INTEGER NOT NULL DEFAULT 0,
    max_replicas INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS placements (
    worker_id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    node_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    size INTEGER NOT NULL,
    reserved_bytes INTEGER NOT NULL,
    state TEXT NOT NULL,
    started_at REAL NOT NULL,
    router_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS placements_by_model ON placements (model);
CREATE TABLE IF NOT EXISTS loads (
    model TEXT PRIMARY KEY,
    router_id TEXT NOT NULL,
    claimed_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
"""

_ENTRY_COLUMNS = "name, source, pin, keep_alive, max_nodes, context, engine_args, min_replicas, max_replicas"
# columns later schema versions added to `entries`, and their definitions (the migration adds them)
_ADDED_COLUMNS = {"min_replicas": "INTEGER NOT NULL DEFAULT 0", "max_replicas": "INTEGER NOT NULL DEFAULT 0"}


def _entry(row) -> pb.CatalogModel:
    name, source, pin, keep_alive, max_nodes, context, engine_args, min_replicas, max_replicas = row
    return pb.CatalogModel(name=name, source=source, pin=bool(pin), keep_alive_seconds=keep_alive,
                           max_nodes=max_nodes, context=context, engine_args=json.loads(engine_args),
                           min_replicas=min_replicas, max_replicas=max_replicas)


def _migrate(db: sqlite3.Connection) -> None:
    """Bring an older file's tables up to this schema (their rows kept)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(entries)")}
    for column, definition in _ADDED_COLUMNS.items():
        if column not in have:
            db.execute(f"ALTER TABLE entries ADD COLUMN {column} {definition}")


class Catalog:
    """The catalog in the SQLite file at `path` (created with its tables if absent).
    Safe to use from several threads and processes: each gets its own connection."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time,
                 busy_timeout: float = BUSY_TIMEOUT_SECONDS):
        self.path = str(path)
        self.clock = clock
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        with self._write() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise CatalogError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"catalog {self.path}: written by a newer Orchard (schema {version}, "
                                   f"this one reads {SCHEMA_VERSION})")
            for statement in _SCHEMA.split(";"):  # not executescript: it commits first
                if statement.strip():
                    db.execute(statement)
            _migrate(db)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # -- connections and transactions --

    def _db(self) -> sqlite3.Connection:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():  # a forked child opens its own
            try:
                db = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
                db.execute("PRAGMA journal_mode = WAL")
                db.execute("PRAGMA synchronous = NORMAL")  # durable at each checkpoint: WAL keeps it consistent
            except sqlite3.Error as e:
                raise CatalogError(grpc.StatusCode.FAILED_PRECONDITION, f"catalog {self.path}: {e}") from None
            local.db, local.pid = db, os.getpid()
        return local.db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction holding SQLite's write lock from its start (`IMMEDIATE`): what
        it reads cannot change before it commits."""
        db = self._db()
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:  # the other router held the lock past the busy timeout
            raise CatalogError(grpc.StatusCode.UNAVAILABLE, f"catalog {self.path}: {e}") from None
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        """Close this thread's connection (others close when their threads end)."""
        db = getattr(self._local, "db", None)
        if db is not None and self._local.pid == os.getpid():
            db.close()
        self._local.__dict__.clear()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- entries --

    def add(self, entry: pb.CatalogModel, replace: bool = False) -> pb.CatalogModel:
        """Add `entry` (validated; `replace` or `entry.replace` changes an existing one, else
        ALREADY_EXISTS). Returns the entry as stored."""
        replace = replace or entry.replace
        entry = validate(entry)
        with self._write() as db:
            old = db.execute("SELECT source FROM entries WHERE name = ?", (entry.name,)).fetchone()
            if old is not None and not replace:
                raise CatalogError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"model {quoted(entry.name)} is in the catalog already (source {quoted(old[0])}); "
                                   "add it with --replace to change it")
            keep_alive = entry.keep_alive_seconds if entry.HasField("keep_alive_seconds") else None
            values = (entry.name, entry.source, int(entry.pin), keep_alive, entry.max_nodes,
                      entry.context, json.dumps(list(entry.engine_args)), entry.min_replicas, entry.max_replicas)
            if old is None:
                db.execute(f"INSERT INTO entries ({_ENTRY_COLUMNS}, added_at) VALUES ({', '.join('?' * 10)})",
                           (*values, self.clock()))
            else:
                db.execute("UPDATE entries SET source = ?, pin = ?, keep_alive = ?, max_nodes = ?, context = ?, "
                           "engine_args = ?, min_replicas = ?, max_replicas = ? WHERE name = ?",
                           (*values[1:], entry.name))
        return entry

    def remove(self, name: str) -> None:
        """Remove the entry and any claim on it; NOT_FOUND (listing the catalog) when absent.
        Its placements stay until `forget_placement`: they are workers that may still run."""
        with self._write() as db:
            if db.execute("DELETE FROM entries WHERE name = ?", (name,)).rowcount == 0:
                raise self._not_found(db, name)
            db.execute("DELETE FROM loads WHERE model = ?", (name,))

    def _not_found(self, db: sqlite3.Connection, name: str) -> CatalogError:
        names = [r[0] for r in db.execute("SELECT name FROM entries ORDER BY name LIMIT ?", (SHOWN_NAMES + 1,))]
        listed = ", ".join(names[:SHOWN_NAMES]) + (", ..." if len(names) > SHOWN_NAMES else "")
        return CatalogError(grpc.StatusCode.NOT_FOUND, f"model {quoted(name)} is not in the catalog "
                            f"({'it has: ' + listed if names else 'it is empty'})")

    def get(self, name: str) -> pb.CatalogModel | None:
        row = self._db().execute(f"SELECT {_ENTRY_COLUMNS} FROM entries WHERE name = ?", (name,)).fetchone()
        return None if row is None else _entry(row)

    def require(self, name: str) -> pb.CatalogModel:
        """The entry, or NOT_FOUND whose message lists the catalog."""
        entry = self.get(name)
        if entry is None:
            raise self._not_found(self._db(), name)
        return entry

    def entries(self) -> list[pb.CatalogModel]:
        """Every entry, by name."""
        return [_entry(r) for r in self._db().execute(f"SELECT {_ENTRY_COLUMNS} FROM entries ORDER BY name")]

    def touch(self, name: str, when: float | None = None) -> None:
        """Record that `name` was used at `when` (now). A write: callers batch it (on a
        request's end, not per token)."""
        with self._write() as db:
            db.execute("UPDATE entries SET last_used = MAX(COALESCE(last_used, 0), ?) WHERE name = ?",
                       (self.clock() if when is None else when, name))

    def last_used(self, name: str) -> float | None:
        """When `name` was last used (wall-clock seconds); None: never, or not in the catalog."""
        row = self._db().execute("SELECT last_used FROM entries WHERE name = ?", (name,)).fetchone()
        return None if row is None else row[0]

    # -- single-flight loads --

    def claim(self, model: str, router_id: str, ttl: float) -> bool:
        """Take (or extend) the claim to load `model` for `ttl` seconds: True when this router
        holds it now. Free, already this router's, or past its holder's ttl: taken."""
        now = self.clock()
        with self._write() as db:
            row = db.execute("SELECT router_id, claimed_at, expires_at FROM loads WHERE model = ?",
                             (model,)).fetchone()
            if row is None:
                db.execute("INSERT INTO loads (model, router_id, claimed_at, expires_at) VALUES (?, ?, ?, ?)",
                           (model, router_id, now, now + ttl))
                return True
            holder, claimed_at, expires_at = row
            if holder != router_id and expires_at > now:
                return False
            db.execute("UPDATE loads SET router_id = ?, claimed_at = ?, expires_at = ? WHERE model = ?",
                       (router_id, claimed_at if holder == router_id else now, now + ttl, model))
        return True

    def release(self, model: str, router_id: str) -> bool:
        """Give back this router's claim on `model` (False: it held none, e.g. taken over)."""
        with self._write() as db:
            return db.execute("DELETE FROM loads WHERE model = ? AND router_id = ?", (model, router_id)).rowcount > 0

    def claim_of(self, model: str) -> Claim | None:
        """The live claim on `model` (an expired one is no claim)."""
        row = self._db().execute("SELECT model, router_id, claimed_at, expires_at FROM loads "
                                 "WHERE model = ? AND expires_at > ?", (model, self.clock())).fetchone()
        return None if row is None else Claim(*row)

    # -- placements --

    def record_placement(self, placement: Placement) -> None:
        """Record a worker the fleet started, or its new state (keyed by worker id)."""
        p = placement
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO placements (worker_id, model, node_id, rank, size, reserved_bytes, "
                       "state, started_at, router_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (p.worker_id, p.model, p.node_id, p.rank, p.size, p.reserved_bytes, p.state,
                        p.started_at or self.clock(), p.router_id))

    def forget_placement(self, worker_id: str) -> bool:
        """Forget a worker that stopped (False: not recorded)."""
        with self._write() as db:
            return db.execute("DELETE FROM placements WHERE worker_id = ?", (worker_id,)).rowcount > 0

    def placements(self, model: str | None = None) -> list[Placement]:
        """The recorded workers of `model` (None: of every model), by model, then rank."""
        where, args = ("WHERE model = ?", (model,)) if model is not None else ("", ())
        rows = self._db().execute("SELECT model, node_id, worker_id, rank, size, reserved_bytes, state, started_at, "
                                  f"router_id FROM placements {where} ORDER BY model, started_at, rank", args)
        return [Placement(*r) for r in rows]
