"""The built-in model cache: made once, and two processes making it at once both succeed."""

from __future__ import annotations

from pathlib import Path

from cluster import modelgen, models_cache, owned_dir


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
