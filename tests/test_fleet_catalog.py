"""The fleet's catalog (cluster/fleet/catalog.py): entries validated and persisted, placements
kept across restarts, and load claims that only one router wins, across threads and processes."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import subprocess
import sys
import threading

import grpc
import pytest

from cluster.fleet import FleetError
from cluster.fleet.catalog import (
    Catalog,
    CatalogError,
    Placement,
    check_engine_args,
    format_duration,
    parse_duration,
    validate,
)
from cluster.proto.orchard.v1 import orchard_pb2 as pb


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def path(tmp_path):
    return tmp_path / "catalog.db"


def entry(name="qwen3-8b", **kw) -> pb.CatalogModel:
    kw.setdefault("keep_alive_seconds", 300.0)
    return pb.CatalogModel(name=name, **kw)


# -- durations --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("30s", 30.0), ("0", 0.0), ("-1", -1.0), ("300", 300.0), ("2.5", 2.5),
    ("-1h", -3600.0), ("500ms", 0.5), ("1.5h", 5400.0), (" 10m ", 600.0), (60, 60.0), (-1, -1.0),
])
def test_durations_in_ollamas_forms(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5x", "", "m", "inf", "nan", "1h-5m", "5 m", "--1", "1d", float("inf")])
def test_a_bad_duration_names_the_field_and_the_value(text):
    with pytest.raises(CatalogError) as e:
        parse_duration(text, field="keep_alive")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith("keep_alive: ") and str(text) in e.value.message
    assert "e.g. 5m, 1h30m, 30s, 0, -1" in e.value.message


def test_format_duration_reads_back():
    for seconds in (0, 45, 300, 5400, 3600, 2.5, 86400):
        assert parse_duration(format_duration(seconds)) == seconds
    assert format_duration(-7) == "-1"
    assert format_duration(5400) == "1h30m"


# -- validation -------------------------------------------------------------------------------------

def test_keep_alive_not_given_stays_unset(path):
    assert not validate(pb.CatalogModel(name="chat")).HasField("keep_alive_seconds")
    with Catalog(path) as c:
        c.add(pb.CatalogModel(name="chat"))
        c.add(pb.CatalogModel(name="now", keep_alive_seconds=0))
        assert not c.get("chat").HasField("keep_alive_seconds")
        assert c.get("now").HasField("keep_alive_seconds") and c.get("now").keep_alive_seconds == 0


def test_validate_normalises():
    e = validate(entry("chat", source="", keep_alive_seconds=-30, state="serving", footprint_bytes=5, replace=True))
    assert (e.source, e.keep_alive_seconds, e.state, e.footprint_bytes, e.replace) == ("chat", -1.0, "", 0, False)
    assert validate(entry(source="ollama:llama3.2")).source == "ollama:llama3.2:latest"
    assert validate(entry(source="ollama:library/llama3.2:3b")).source == "ollama:library/llama3.2:3b"
    assert validate(entry(source="qwen3-8b-q4.gguf")).source == "qwen3-8b-q4.gguf"
    assert validate(entry(name="org/Model-7B:q4_K", source="m")).name == "org/Model-7B:q4_K"


@pytest.mark.parametrize("bad, field, words", [
    (dict(name=""), "name:", ["empty"]),
    (dict(name="a b"), "name:", ["'a b'", "letters, digits"]),
    (dict(name="-x"), "name:", ["'-x'"]),
    (dict(name="x" * 129), "name:", ["129 characters", "at most 128"]),
    (dict(name="qwen2.5:7b"), "source:", ["not given", "'qwen2.5:7b'", "--models-dir"]),
    (dict(source="/Users/me/models/qwen"), "source:", ["'/Users/me/models/qwen'", "absolute path", "--models-dir"]),
    (dict(source="models/qwen"), "source:", ["'models/qwen'", "a path", "--models-dir"]),
    (dict(source="~/qwen"), "source:", ["absolute path"]),
    (dict(source=".."), "source:", ["'..'"]),
    (dict(source="a\x00b"), "source:", ["not a directory or file name"]),
    (dict(source="x" * 300), "source:", ["300 characters", "at most 255"]),
    (dict(source="ollama:"), "source:", ["'ollama:'", "ollama:NAME:TAG"]),
    (dict(source="ollama:a:b:c"), "source:", ["ollama:NAME:TAG"]),
    (dict(keep_alive_seconds=float("nan")), "keep_alive:", ["nan", "not a duration"]),
    (dict(keep_alive_seconds=400 * 86400.0), "keep_alive:", ["9600h", "more than 8760h", "-1"]),
    (dict(context=8), "context:", ["8 tokens", "16..16777216"]),
    (dict(context=1 << 25), "context:", [str(1 << 25), "16..16777216"]),
    (dict(max_nodes=65), "max_nodes:", ["65", "at most 64"]),
    (dict(engine_args=["--max-model-len", "4096"]), "engine_args:", ["'--max-model-len'", "set by the fleet"]),
    (dict(engine_args=["--kv-cache-memory-bytes=1GiB"]), "engine_args:", ["'--kv-cache-memory-bytes'"]),
    (dict(engine_args=["--group-size", "2"]), "engine_args:", ["'--group-size'"]),
    (dict(engine_args=["--model", "/x"]), "engine_args:", ["'--model'"]),
    (dict(engine_args=["--max-model", "9"]), "engine_args:", ["unrecognized arguments: --max-model"]),
    (dict(engine_args=["--max-num-seqs", "many"]), "engine_args:", ["--max-num-seqs", "'many'"]),
    (dict(engine_args=["--no-such-flag"]), "engine_args:", ["--no-such-flag", "orchard worker serve"]),
    (dict(engine_args=["16"]), "engine_args:", ["'16' is not a flag"]),
    (dict(engine_args=["--max-num-seqs"] * 65), "engine_args:", ["65 arguments", "at most 64"]),
    # secrets would be stored, listed and on `ps`; paths and addresses are the node's
    (dict(engine_args=["--api-key", "sk-1"]), "engine_args:", ["'--api-key'", "secret", "ORCHARD_API_KEY"]),
    (dict(engine_args=["--admin-key=k"]), "engine_args:", ["'--admin-key'", "secret", "environment"]),
    (dict(engine_args=["--api-key-file", "/etc/keys"]), "engine_args:", ["'--api-key-file'", "secret"]),
    (dict(engine_args=["--join-token", "t"]), "engine_args:", ["'--join-token'", "secret"]),
    (dict(engine_args=["--http", "0.0.0.0:8000"]), "engine_args:", ["'--http'", "through the router"]),
    (dict(engine_args=["--metrics=0.0.0.0:9100"]), "engine_args:", ["'--metrics'", "set by the fleet"]),
    (dict(engine_args=["--tls-ca", "/tmp/ca.pem"]), "engine_args:", ["'--tls-ca'", "set by the fleet"]),
    (dict(engine_args=["--speculative-config", '{"method": "draft_model", "model": "/any/path", '
                                               '"num_speculative_tokens": 4}']),
     "engine_args:", ["--speculative-config", "draft model", "path", "ngram"]),
    (dict(engine_args=['--speculative-config={"model": "/x"}']), "engine_args:", ["draft model"]),
])
def test_a_bad_entry_is_refused_naming_field_limit_and_value(bad, field, words):
    with pytest.raises(CatalogError) as e:
        validate(entry(**bad))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith(field), e.value.message
    for w in words:
        assert w in e.value.message, (w, e.value.message)


def test_engine_args_that_the_worker_takes_pass():
    args = ["--max-num-seqs", "8", "--max-num-batched-tokens=512",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    assert check_engine_args(args) == args
    assert check_engine_args([]) == []


def test_catalog_error_is_a_fleet_error():
    assert issubclass(CatalogError, FleetError)


def test_catalog_imports_no_mlx():
    code = ("import sys; sys.modules['mlx'] = None\n"
            "from cluster.fleet.catalog import check_engine_args\n"
            "check_engine_args(['--max-num-seqs', '4'])\n"
            "assert not any(m == 'mlx' or m.startswith('mlx.') for m, v in sys.modules.items() if v is not None)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- entries ------------------------------------------------------------------------------------------

def test_add_get_list_remove(path):
    with Catalog(path) as c:
        assert c.entries() == [] and c.get("chat") is None
        stored = c.add(entry("chat", source="chat-model", pin=True, max_nodes=2, context=8192,
                             engine_args=["--max-num-seqs", "4"]))
        c.add(entry("a-code"))
        assert [e.name for e in c.entries()] == ["a-code", "chat"]
        got = c.get("chat")
        assert got == stored
        assert (got.source, got.pin, got.max_nodes, got.context, list(got.engine_args)) == \
            ("chat-model", True, 2, 8192, ["--max-num-seqs", "4"])
        c.remove("chat")
        assert c.get("chat") is None and [e.name for e in c.entries()] == ["a-code"]


def test_add_twice_is_already_exists_unless_replace(path):
    with Catalog(path) as c:
        c.add(entry("chat", source="one"))
        with pytest.raises(CatalogError) as e:
            c.add(entry("chat", source="two"))
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "'chat'" in e.value.message and "'one'" in e.value.message and "--replace" in e.value.message
        assert c.get("chat").source == "one"
        c.add(entry("chat", source="two"), replace=True)
        assert c.get("chat").source == "two"
        c.add(entry("chat", source="three", replace=True))
        assert c.get("chat").source == "three"


def test_an_invalid_entry_writes_nothing(path):
    with Catalog(path) as c:
        with pytest.raises(CatalogError):
            c.add(entry("chat", context=3))
        assert c.entries() == []


def test_not_found_lists_the_catalog(path):
    with Catalog(path) as c:
        with pytest.raises(CatalogError) as e:
            c.require("nope")
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "it is empty" in e.value.message
        for name in ("b", "a"):
            c.add(entry(name))
        for call in (c.require, c.remove):
            with pytest.raises(CatalogError) as e:
                call("nope")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            assert "'nope'" in e.value.message and "it has: a, b" in e.value.message


def test_last_used(path):
    clock = Clock(50.0)
    with Catalog(path, clock=clock) as c:
        c.add(entry("chat"))
        assert c.last_used("chat") is None and c.last_used("nope") is None
        c.touch("chat")
        assert c.last_used("chat") == 50.0
        c.touch("chat", when=40.0)  # a late write never moves it back
        assert c.last_used("chat") == 50.0
        c.touch("chat", when=70.0)
        assert c.last_used("chat") == 70.0


def test_everything_persists_across_a_restart(path):
    clock = Clock()
    with Catalog(path, clock=clock) as c:
        c.add(entry("chat", pin=True))
        c.touch("chat")
        c.record_placement(Placement("chat", "mac-1", "chat-w1", 0, 2, 5 << 30, "running", 900.0, "router-a"))
        c.record_placement(Placement("chat", "mac-2", "chat-w2", 1, 2, 4 << 30, "running", 900.0, "router-a"))
        assert c.claim("chat", "router-a", ttl=60)
    with Catalog(path, clock=clock) as again:
        assert again.get("chat").pin and again.last_used("chat") == clock.now
        assert [p.worker_id for p in again.placements("chat")] == ["chat-w1", "chat-w2"]
        assert again.placements("chat")[1] == Placement("chat", "mac-2", "chat-w2", 1, 2, 4 << 30, "running",
                                                        900.0, "router-a")
        assert again.claim_of("chat").router_id == "router-a"
        assert not again.claim("chat", "router-b", ttl=60)


def test_the_file_is_in_wal_mode(path):
    Catalog(path).close()
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()


def test_a_newer_schema_is_refused(path):
    Catalog(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(CatalogError) as e:
        Catalog(path)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "schema 99" in e.value.message


# The entries table as issue 40's Orchard (schema 1) wrote it.
SCHEMA_1_ENTRIES = """CREATE TABLE entries (name TEXT PRIMARY KEY, source TEXT NOT NULL,
    pin INTEGER NOT NULL DEFAULT 0, keep_alive REAL, max_nodes INTEGER NOT NULL DEFAULT 0,
    context INTEGER NOT NULL DEFAULT 0, engine_args TEXT NOT NULL DEFAULT '[]', added_at REAL NOT NULL,
    last_used REAL)"""


def test_a_schema_1_file_gets_the_replica_columns_and_keeps_its_entries(path):
    db = sqlite3.connect(path)
    db.execute(SCHEMA_1_ENTRIES)
    db.execute("INSERT INTO entries VALUES ('chat', 'qwen3-8b', 1, 300.0, 2, 8192, '[\"--max-num-seqs\", \"8\"]', "
               "1000.0, 1500.0)")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    c = Catalog(path)
    chat = c.require("chat")
    assert (chat.source, chat.pin, chat.keep_alive_seconds, chat.max_nodes, chat.context, list(chat.engine_args),
            chat.min_replicas, chat.max_replicas) == ("qwen3-8b", True, 300.0, 2, 8192, ["--max-num-seqs", "8"], 0, 0)
    assert c.last_used("chat") == 1500.0
    c.add(entry("chat", source="qwen3-8b", min_replicas=2, max_replicas=4), replace=True)
    c.close()
    again = Catalog(path)  # opened twice: migrated once
    assert (again.require("chat").min_replicas, again.require("chat").max_replicas) == (2, 4)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    db.close()


def test_replicas_are_stored(path):
    c = Catalog(path)
    c.add(entry("chat", source="qwen3-8b", min_replicas=1, max_replicas=3))
    c.add(entry("solo", source="qwen3-8b"))
    assert [(e.name, e.min_replicas, e.max_replicas) for e in c.entries()] == [("chat", 1, 3), ("solo", 0, 0)]


@pytest.mark.parametrize("low, high, message", [
    (65, 0, "min_replicas: 65, not in 0..64"),
    (0, 65, "max_replicas: 65, not in 0..64"),
    (3, 2, "max_replicas: 2, less than min_replicas 3"),
])
def test_bad_replicas_name_the_field_the_limit_and_the_value(path, low, high, message):
    with pytest.raises(CatalogError) as e:
        Catalog(path).add(entry("chat", source="qwen3-8b", min_replicas=low, max_replicas=high))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.message


def test_replicas_within_the_limits_are_taken():
    for low, high in ((0, 0), (2, 0), (0, 64), (64, 64), (1, 1)):
        checked = validate(entry("chat", source="m", min_replicas=low, max_replicas=high))
        assert (checked.min_replicas, checked.max_replicas) == (low, high)


def test_a_lock_held_past_the_busy_timeout_is_unavailable(path):
    c = Catalog(path, busy_timeout=0.1)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(CatalogError) as e:
            c.add(entry("chat"))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        other.execute("ROLLBACK")
        c.add(entry("chat"))  # the failed transaction left nothing open
        assert c.get("chat") is not None
    finally:
        other.close()
        c.close()


# -- placements ---------------------------------------------------------------------------------------

def test_placements_are_upserted_by_worker_and_forgotten(path):
    clock = Clock(123.0)
    with Catalog(path, clock=clock) as c:
        c.record_placement(Placement("chat", "mac-1", "w1"))
        c.record_placement(Placement("code", "mac-2", "w2", reserved_bytes=7))
        [p] = c.placements("chat")
        assert (p.state, p.started_at, p.size) == ("starting", 123.0, 1)  # started_at: now when not given
        c.record_placement(Placement("chat", "mac-1", "w1", state="running", started_at=p.started_at))
        assert [p.state for p in c.placements("chat")] == ["running"]
        assert {p.worker_id for p in c.placements()} == {"w1", "w2"}
        assert c.forget_placement("w1") and not c.forget_placement("w1")
        assert c.placements("chat") == [] and [p.worker_id for p in c.placements()] == ["w2"]


def test_remove_keeps_placements_but_drops_the_claim(path):
    with Catalog(path) as c:
        c.add(entry("chat"))
        c.record_placement(Placement("chat", "mac-1", "w1"))
        assert c.claim("chat", "r1", ttl=60)
        c.remove("chat")
        assert c.claim_of("chat") is None
        assert [p.worker_id for p in c.placements("chat")] == ["w1"]  # a worker that may still run


# -- claims -------------------------------------------------------------------------------------------

def test_claim_release_extend_and_take_over_after_ttl(path):
    clock = Clock(1000.0)
    with Catalog(path, clock=clock) as c:
        assert c.claim("chat", "r1", ttl=30)
        assert not c.claim("chat", "r2", ttl=30)
        assert c.claim_of("chat").router_id == "r1"
        clock.now = 1020.0
        assert c.claim("chat", "r1", ttl=30)  # the holder extends it: to 1050
        claim = c.claim_of("chat")
        assert (claim.claimed_at, claim.expires_at) == (1000.0, 1050.0)
        clock.now = 1040.0
        assert not c.claim("chat", "r2", ttl=30)
        clock.now = 1050.0
        assert c.claim_of("chat") is None  # past its ttl: no claim
        assert c.claim("chat", "r2", ttl=30)  # taken over
        assert c.claim_of("chat") == type(claim)("chat", "r2", 1050.0, 1080.0)
        assert not c.release("chat", "r1")  # r1's claim was taken over: nothing to give back
        assert c.claim_of("chat").router_id == "r2"
        assert c.release("chat", "r2")
        assert c.claim_of("chat") is None
        assert c.claim("chat", "r1", ttl=30)
        assert c.claim("code", "r2", ttl=30)  # one claim per model


def test_threads_racing_for_claims_one_wins_each(path):
    models = [f"m{i}" for i in range(40)]
    c = Catalog(path)  # one Catalog, a connection per thread
    wins: dict[str, list[str]] = {m: [] for m in models}
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def race(router_id: str) -> None:
        try:
            start.wait(timeout=60)
            for m in models:
                if c.claim(m, router_id, ttl=600):
                    wins[m].append(router_id)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=race, args=(f"r{i}",), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert {m: len(w) for m, w in wins.items()} == {m: 1 for m in models}


def _claim_all(path: str, router_id: str, models: list[str], start, results, inherited: Catalog | None) -> None:
    c = inherited or Catalog(path)  # inherited: opened in the parent, used after the fork
    start.wait(timeout=60)
    results.put((router_id, [m for m in models if c.claim(m, router_id, ttl=600)]))


@pytest.mark.parametrize("inherit", [False, True])
def test_processes_racing_for_claims_one_wins_each(path, inherit):
    models = [f"m{i}" for i in range(40)]
    parent = Catalog(path)
    parent.add(entry("warm"))  # the parent's connection is open before the fork
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(str(path), f"r{i}", models, start, results,
                                                  parent if inherit else None), daemon=True) for i in range(4)]
    try:
        for p in procs:
            p.start()
        won = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, 9)
    winners = [m for ms in won.values() for m in ms]
    assert sorted(winners) == sorted(models)  # each model exactly once
    holders = {m: parent.claim_of(m).router_id for m in models}
    assert all(m in won[r] for m, r in holders.items())
    assert parent.get("warm") is not None


@pytest.mark.parametrize("kind", ["missing dir", "not a database"])
def test_a_file_that_cannot_be_a_catalog_is_refused_naming_it(tmp_path, kind):
    path = tmp_path / "nowhere" / "catalog.db"
    if kind == "not a database":
        path = tmp_path / "catalog.db"
        path.write_bytes(b"not sqlite at all, " * 100)
    with pytest.raises(CatalogError) as e:
        Catalog(path)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and str(path) in e.value.message
