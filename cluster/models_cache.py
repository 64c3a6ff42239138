"""The built-in model: created once (offline, deterministic) and reused."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

BUILTIN_ARCH, BUILTIN_SIZE = "qwen3", "small"


def home() -> Path:
    """Orchard's cache root: $ORCHARD_HOME, else ~/.cache/orchard."""
    return Path(os.environ.get("ORCHARD_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "orchard"))


def cache_dir() -> Path:
    return home() / "models"


def builtin_model(arch: str = BUILTIN_ARCH, size: str = BUILTIN_SIZE, seed: int = 0) -> Path:
    from cluster.modelgen import create_model

    path = cache_dir() / f"{arch}-{size}-seed{seed}"
    if not (path / "model.safetensors").exists():
        log.info("creating the built-in %s %s model in %s (once)", arch, size, path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        create_model(tmp, arch=arch, size=size, seed=seed)
        try:
            tmp.rename(path)
        except OSError:  # another process got there first (same seed: the same model)
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve_model(model: str | None) -> Path:
    if model is None:
        return builtin_model()
    path = Path(model)
    if not (path / "config.json").exists():
        raise SystemExit(f"{model}: not an mlx-lm model directory (no config.json); create one with `orchard model create DIR`")
    return path
