"""A model's tokenizer as files (`WorkerAdmin.GetTokenizer`), so that a router tokenizes a
prompt exactly as the worker does and names its KV blocks by the same hashes.

The worker writes its tokenizer with `save_pretrained` into a temporary directory and
sends every file, plus `PROMPT_FILE`: what mlx-lm's tokenizer wrapper adds to the Hugging
Face tokenizer when it renders a chat (whether the template gets `enable_thinking` and its
default, whether the worker renders Jinja templates at all). The digest is sha256 over the
files' names and bytes, so equal digests mean equal tokenizers; the router keeps the files
under its --tokenizer-cache by digest and checks the digest before it uses them.

No MLX here: the router and the worker both import it.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from cluster.api.limits import GRPC_MAX_MESSAGE_BYTES
from cluster.proto.orchard.v1 import orchard_pb2 as pb

PROMPT_FILE = "orchard_prompt.json"
# The files of one tokenizer, in all: they travel in one gRPC message.
MAX_TOKENIZER_BYTES = GRPC_MAX_MESSAGE_BYTES - (1 << 20)
MAX_FILES = 64


class TokenizerFilesError(ValueError):
    """Files that are no tokenizer a router may load (the message says why)."""


def files_digest(files) -> str:
    """sha256 over each file's name and bytes, in name order (`pb.TokenizerFile`s)."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        name = f.name.encode()
        h.update(len(name).to_bytes(8, "little") + name + len(f.data).to_bytes(8, "little"))
        h.update(f.data)
    return h.hexdigest()


def tokenizer_files(tokenizer, renders_jinja: bool) -> pb.TokenizerFiles | None:
    """The worker's tokenizer as files with their digest; None for a tokenizer that cannot
    be saved (a test's bare tokenizer) or whose files pass MAX_TOKENIZER_BYTES."""
    if not hasattr(tokenizer, "save_pretrained"):  # (mlx-lm's TokenizerWrapper passes it to the HF one)
        return None
    prompt = {"renders_jinja": renders_jinja, "thinking_kwarg": getattr(tokenizer, "_thinking_kwarg", None),
              "has_thinking": bool(getattr(tokenizer, "has_thinking", False))}
    files = [pb.TokenizerFile(name=PROMPT_FILE, data=json.dumps(prompt, sort_keys=True).encode())]
    with tempfile.TemporaryDirectory(prefix="orchard-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        size = 0
        for path in sorted(Path(tmp).iterdir()):
            if not path.is_file():
                continue
            size += path.stat().st_size
            if size > MAX_TOKENIZER_BYTES or len(files) >= MAX_FILES:
                return None
            files.append(pb.TokenizerFile(name=path.name, data=path.read_bytes()))
    return pb.TokenizerFiles(digest=files_digest(files), files=files)


def check_files(answer: pb.TokenizerFiles, digest: str) -> None:
    """TokenizerFilesError unless `answer` holds plain file names within the limits, the
    prompt file, and the files' digest is `digest`."""
    names = [f.name for f in answer.files]
    if len(names) > MAX_FILES or sum(len(f.data) for f in answer.files) > MAX_TOKENIZER_BYTES:
        raise TokenizerFilesError(f"{len(names)} files: over the limits ({MAX_FILES} files, "
                                  f"{MAX_TOKENIZER_BYTES} bytes)")
    bad = [n for n in names if not n or n in (".", "..") or "/" in n or "\\" in n or "\0" in n]
    if bad or len(set(names)) != len(names):
        raise TokenizerFilesError(f"file name {bad[0] if bad else 'repeated'!r} is no plain file name")
    if PROMPT_FILE not in names:
        raise TokenizerFilesError(f"no {PROMPT_FILE}")
    got = files_digest(answer.files)
    if got != digest or answer.digest != digest:
        raise TokenizerFilesError(f"the files' digest is {got[:12]}, not {digest[:12]}")


def write_files(directory: Path, answer: pb.TokenizerFiles) -> None:
    """The files written into `directory` (checked files: `check_files`)."""
    for f in answer.files:
        (directory / f.name).write_bytes(f.data)


def read_files(directory: Path) -> pb.TokenizerFiles:
    """The files of a directory `write_files` wrote, with their digest (re-computed)."""
    files = [pb.TokenizerFile(name=p.name, data=p.read_bytes()) for p in sorted(directory.iterdir())
             if p.is_file() and not p.name.startswith(".")]
    return pb.TokenizerFiles(digest=files_digest(files), files=files)
