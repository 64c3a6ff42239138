"""`hf:ORG/REPO[@REVISION]` sources (cluster/fleet/hub.py) through the real `huggingface_hub`
client against the fake hub (tests/fake_hub.py) serving models `orchard model create` made:
a transfer cut at 50% resumes with a Range request; a corrupted file is fetched again, one
corrupt twice is DATA_LOSS naming it; a revision pin (tag, commit) is honoured; HF_HUB_OFFLINE
with the files works and without them says so; a pipeline rank fetches only its shards;
describe() from the hub's metadata equals the facts of the downloaded directory; scan names
each snapshot by ref and by commit; `orchard model pull` shows a progress bar."""

from __future__ import annotations

import fcntl
import hashlib
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import grpc
import pytest

from cluster.fleet import FleetError, facts, hub
from cluster.fleet.catalog import CatalogError, check_source
from tests.fake_hub import FakeHub

REPO = "org/tiny"
SHARD = "model-00002-of-00004.safetensors"  # layer 1's weights only


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two revisions' worth of a 4-layer model in 4 shards (with an index), a one-file one and
    an embedding model (sentence-transformers modules: its task is read from them)."""
    from cluster.modelgen import create_model

    root = tmp_path_factory.mktemp("hub-models")
    return {"v1": create_model(root / "v1", "qwen3", "tiny", seed=0, layers=4, files=4),
            "v2": create_model(root / "v2", "qwen3", "tiny", seed=1, layers=4, files=4),
            "one": create_model(root / "one", "qwen3", "tiny", seed=2),
            "emb": create_model(root / "emb", "qwen3", "tiny", seed=3, kind="embedding")}


@pytest.fixture
def fake(models, tmp_path, monkeypatch):
    """The fake hub with REPO at two commits (tag v1: models["v1"], main: models["v2"]) and
    org/one; HF_* pointing at it and at tmp dirs."""
    server = FakeHub()
    server.commits = {"v1": server.add(REPO, models["v1"], refs=("v1",)),
                      "main": server.add(REPO, models["v2"], refs=("main",))}
    server.add("org/one", models["one"])
    server.add("org/emb", models["emb"])
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.close()


def same_files(snapshot: Path, model_dir: Path, names=None) -> None:
    names = names or sorted(p.name for p in model_dir.iterdir())
    for name in names:
        assert (snapshot / name).read_bytes() == (model_dir / name).read_bytes(), name


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- sources -----------------------------------------------------------------------------------------

def test_sources_parse_to_a_canonical_name_and_bad_ones_say_the_form():
    assert hub.parse_source("hf:org/repo") == hub.HubSource("org/repo", "main")
    assert hub.canonical("hf:mlx-community/Qwen3-0.6B-4bit") == "hf:mlx-community/Qwen3-0.6B-4bit@main"
    assert hub.canonical("hf:org/repo@v1.0") == "hf:org/repo@v1.0"
    assert hub.canonical("hf:org/repo@refs/pr/1") == "hf:org/repo@refs/pr/1"
    for bad in ("hf:", "hf:repo", "hf:a/b/c", "hf:org/-x", "hf:org/a--b", "hf:org/" + "x" * 97, "hf:org/x@",
                "hf:org/x@../main", "hf:org/x@a b", "org/x"):
        with pytest.raises(FleetError) as e:
            hub.parse_source(bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "source:" in e.value.message and "hf:ORG/REPO[@REVISION]" in e.value.message


def test_the_catalog_takes_hub_sources_canonically():
    assert check_source("hf:org/repo") == "hf:org/repo@main"
    assert check_source("hf:org/repo@abc") == "hf:org/repo@abc"
    with pytest.raises(CatalogError) as e:
        check_source("hf:org")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "hf:ORG/REPO" in e.value.message


# -- pulling -----------------------------------------------------------------------------------------

def test_a_transfer_cut_at_half_resumes_with_a_range_request(fake, models, tmp_path, monkeypatch):
    import huggingface_hub.constants

    # The client keeps what it received in chunks of this size and resumes after the last
    # whole one: a small chunk lets a small file show it.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    size = (models["v2"] / SHARD).stat().st_size
    fake.cut_once(SHARD, 0.5)
    reported = []
    snapshot = hub.pull(f"hf:{REPO}", tmp_path / "cache", progress=lambda done, total: reported.append((done, total)))
    same_files(snapshot, models["v2"])
    assert any(start > 0 for start in fake.range_starts[SHARD]), fake.range_starts
    assert size <= fake.served[SHARD] < 1.5 * size
    total = sum(p.stat().st_size for p in models["v2"].iterdir())
    assert reported[-1] == (total, total) and all(t == total for _, t in reported)


def test_a_corrupted_file_is_fetched_again_and_one_corrupt_twice_is_data_loss(fake, models, tmp_path):
    fake.corrupt(SHARD)
    fake.corrupt("config.json")
    snapshot = hub.pull(f"hf:{REPO}", tmp_path / "a")
    same_files(snapshot, models["v2"])
    assert fake.served[SHARD] == 2 * (models["v2"] / SHARD).stat().st_size

    fake.corrupt(SHARD, times=2)
    with pytest.raises(FleetError) as e:
        hub.pull(f"hf:{REPO}", tmp_path / "b")
    assert e.value.code == grpc.StatusCode.DATA_LOSS
    assert SHARD in e.value.message and "twice" in e.value.message and "\n" not in e.value.message
    assert hub.local_snapshot(f"hf:{REPO}", tmp_path / "b") is None  # nothing half-checked is reported
    blobs = tmp_path / "b" / "models--org--tiny" / "blobs"
    assert sha256(models["v2"] / SHARD) not in {p.name for p in blobs.iterdir()}


def test_a_revision_pin_is_honoured(fake, models, tmp_path):
    cache = tmp_path / "cache"
    v1 = hub.pull(f"hf:{REPO}@v1", cache)
    assert v1.name == fake.commits["v1"]
    same_files(v1, models["v1"])
    main = hub.pull(f"hf:{REPO}@{fake.commits['main']}", cache)
    assert main.name == fake.commits["main"]
    same_files(main, models["v2"])
    assert (models["v1"] / SHARD).read_bytes() != (models["v2"] / SHARD).read_bytes()
    assert hub.local_snapshot(f"hf:{REPO}@v1", cache) == v1
    assert hub.local_snapshot(f"hf:{REPO}@{fake.commits['main']}", cache) == main
    assert hub.local_snapshot(f"hf:{REPO}", cache) is None  # no ref main was pulled
    assert hub.pull(f"hf:{REPO}", cache) == main


def test_a_pulled_revision_is_not_fetched_nor_hashed_again(fake, tmp_path, monkeypatch):
    snapshot = hub.pull(f"hf:{REPO}", tmp_path / "cache")
    asked = len(fake.requests)
    monkeypatch.setattr(hub, "digest", lambda *a: pytest.fail("a checked snapshot was hashed again"))
    reported = []
    assert hub.pull(f"hf:{REPO}", tmp_path / "cache", progress=lambda *a: reported.append(a)) == snapshot
    assert [path for _, path in fake.requests[asked:]] == [f"/api/models/{REPO}/revision/main"]
    assert reported and reported[-1][0] == reported[-1][1] > 0


def test_a_progress_that_raises_stops_the_check_of_the_files_too(fake, tmp_path):
    """The agent stops a pull by raising from its progress (the pull runs on threads): hashing
    a large model's files must stop there as well, not only the download."""
    cache = tmp_path / "cache"
    snapshot = hub.pull(f"hf:{REPO}", cache)
    (snapshot.parent.parent / "refs" / "main").unlink()  # its files here, not yet checked
    calls = []

    def stopped(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) > 1:
            raise FleetError(grpc.StatusCode.CANCELLED, "stopped")

    hub._hashes.clear()
    with pytest.raises(FleetError) as e:
        hub.pull(f"hf:{REPO}", cache, progress=stopped)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert not (snapshot.parent.parent / "refs" / "main").exists()


def test_offline_with_the_files_works_and_without_them_says_so(fake, models, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    snapshot = hub.pull(f"hf:{REPO}", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = len(fake.requests)
    assert hub.pull(f"hf:{REPO}", cache) == snapshot
    assert hub.describe(f"hf:{REPO}", cache, "cpu").num_layers == 4
    assert len(fake.requests) == asked
    with pytest.raises(FleetError) as e:
        hub.pull(f"hf:{REPO}@v1", cache)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"hf:{REPO}@v1" in e.value.message and "HF_HUB_OFFLINE" in e.value.message
    assert len(fake.requests) == asked


def test_hub_errors_name_what_is_wrong(fake, tmp_path, monkeypatch):
    cases = [("hf:org/nothing", grpc.StatusCode.NOT_FOUND, "org/nothing"),
             (f"hf:{REPO}@nope", grpc.StatusCode.NOT_FOUND, "nope")]
    for source, code, named in cases:
        with pytest.raises(FleetError) as e:
            hub.pull(source, tmp_path / "cache")
        assert e.value.code == code and named in e.value.message, e.value
    fake.token = "sesame"
    with pytest.raises(FleetError) as e:
        hub.pull(f"hf:{REPO}", tmp_path / "cache")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "HF_TOKEN" in e.value.message
    monkeypatch.setenv("HF_TOKEN", "sesame")
    pulled = hub.pull(f"hf:{REPO}", tmp_path / "cache")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert hub.pull(f"hf:{REPO}", tmp_path / "cache") == pulled  # the cache's copy, while the hub is away
    with pytest.raises(FleetError) as e:
        hub.pull(f"hf:{REPO}@v1", tmp_path / "cache")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "127.0.0.1:9" in e.value.message


def test_a_pipeline_rank_fetches_only_its_shards(fake, models, tmp_path):
    cache = tmp_path / "cache"
    snapshot = hub.pull(f"hf:{REPO}", cache, layers=(1, 1))
    held = sorted(p.name for p in snapshot.iterdir())
    assert [n for n in held if n.endswith(".safetensors")] == [SHARD]
    assert {"config.json", "tokenizer.json", hub.INDEX} <= set(held)
    for other in ("model-00001-of-00004.safetensors", "model-00003-of-00004.safetensors"):
        assert other not in fake.served
    assert hub.local_snapshot(f"hf:{REPO}", cache, layers=(1, 1)) == snapshot
    assert hub.local_snapshot(f"hf:{REPO}", cache) is None  # not the whole model
    assert hub.scan(cache, "cpu") == []
    assert [f.path for f in hub.files(snapshot, layers=(1, 1)) if f.path.endswith(".safetensors")] == [SHARD]
    last = hub.pull(f"hf:{REPO}", cache, layers=(3, 3))  # the head's rank: the norm's shard too
    assert sorted(p.name for p in last.iterdir() if p.suffix == ".safetensors") == [  # a tied head: the embedding's
        "model-00001-of-00004.safetensors", SHARD, "model-00004-of-00004.safetensors"]


# -- what a node holds and could fetch ----------------------------------------------------------------

@pytest.mark.parametrize("platform", facts.PLATFORMS)
def test_describe_from_the_hub_is_the_facts_of_the_downloaded_model(fake, tmp_path, platform):
    for repo in (REPO, "org/one", "org/emb"):
        described = hub.describe(f"hf:{repo}", tmp_path / "cache", platform)
        weights = [n for n in fake.served if n.endswith(".safetensors")]
        assert weights and all(fake.served[n] <= 100_001 for n in weights)  # headers only
        assert not (tmp_path / "cache").exists()
        on_disk = facts.disk_model(hub.pull(f"hf:{repo}", tmp_path / "cache"), platform)
        assert described.name == f"hf:{repo}@main" and not described.error
        on_disk.name = described.name
        assert described == on_disk
        assert list(described.tasks) == (["embed"] if repo == "org/emb" else ["generate"])
        fake.served.clear()
        shutil.rmtree(tmp_path / "cache")


def test_describe_reads_the_shards_headers_at_once(fake, tmp_path):
    """A model of many shards is described within an RPC's deadline: their headers are read
    several at a time, not one after another."""
    for shard in (f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)):
        fake.slow(shard, 256 << 10)
    assert hub.describe(f"hf:{REPO}", tmp_path / "cache", "cpu").num_layers == 4
    assert fake.most_slow_bodies >= 2


def test_describe_of_a_repository_that_is_no_model_says_why(fake, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a model\n")
    fake.add("org/notes", tmp_path / "notes")
    described = hub.describe("hf:org/notes", tmp_path / "cache", "cpu")
    assert described.error and described.name == "hf:org/notes@main"


def test_scan_names_each_snapshot_by_ref_and_by_commit(fake, tmp_path):
    cache = tmp_path / "cache"
    hub.pull(f"hf:{REPO}", cache)
    hub.pull(f"hf:{REPO}@v1", cache)
    found = {m.name: m for m in hub.scan(cache, "cpu")}
    assert set(found) == {f"hf:{REPO}@main", f"hf:{REPO}@{fake.commits['main']}",
                          f"hf:{REPO}@v1", f"hf:{REPO}@{fake.commits['v1']}"}
    assert all(m.fetched and not m.error and m.num_layers == 4 for m in found.values())
    assert hub.scan(cache, "cpu") == list(found.values())  # unchanged files: the same facts
    assert hub.scan(tmp_path / "nothing", "cpu") == []


def test_files_carry_sha256_and_the_blob_names_a_pull_gives(fake, models, tmp_path):
    snapshot = hub.pull(f"hf:{REPO}", tmp_path / "cache")
    listed = {f.path: f for f in hub.files(snapshot)}
    assert set(listed) == {p.name for p in models["v2"].iterdir()}
    for name, f in listed.items():
        assert f.sha256 == sha256(models["v2"] / name) and f.size == (models["v2"] / name).stat().st_size
        assert f.blob == fake.file(REPO, "main", name).etag
    plain = {f.path: f for f in hub.files(models["v1"])}
    assert all(f.blob == "" and f.sha256 == sha256(models["v1"] / n) for n, f in plain.items())


# -- the CLI -------------------------------------------------------------------------------------------

def run_in_terminal(args: list[str], env: dict, timeout: float = 120.0) -> tuple[int, str]:
    """Run a command with a pseudo-terminal as its stdout and stderr (so progress bars show)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a width for the bars
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal closed: the process is gone
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_the_cli_pulls_with_a_progress_bar_and_refuses_a_bad_source_in_one_line(fake, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": fake.endpoint, "HF_HOME": str(tmp_path / "hf-home")}
    cache = tmp_path / "cache"
    code, out = run_in_terminal([sys.executable, "-m", "cluster", "model", "pull", f"hf:{REPO}@v1",
                                 "--hub-cache", str(cache)], env)
    assert code == 0, out
    assert "%|" in out and "█" in out, out
    assert f"pulled hf:{REPO}@v1 to {cache / 'models--org--tiny' / 'snapshots' / fake.commits['v1']}" in out
    bad = subprocess.run([sys.executable, "-m", "cluster", "model", "pull", "hf:org", "--hub-cache", str(cache)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "hf:ORG/REPO" in bad.stderr, bad.stderr
    missing = subprocess.run([sys.executable, "-m", "cluster", "model", "pull", "hf:org/nothing", "--hub-cache",
                              str(cache)], env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and missing.stderr.count("\n") == 1 and "org/nothing" in missing.stderr
