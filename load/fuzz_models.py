"""Hostile model files (issue 37): mutated GGUF files and Ollama manifests, each imported by
`orchard model import` in a process of its own with a time and a memory limit.

    python load/fuzz_models.py [--gguf 2000] [--manifests 200] [--seed 0] [--jobs 2]
                               [--timeout 10] [--wall-timeout 60] [--memory-mb 1024] [--keep DIR]

It writes a small valid GGUF (the tiny random llama of `orchard model create`, some tensors
quantized, as llama.cpp's converter writes it: tests/gguf_export.py) and a valid Ollama
models directory holding it (a manifest naming its blob). Then:

  1. GGUF files: --gguf mutations of the valid file, drawn from a seeded generator: flipped
     bytes, truncations, counts, lengths, dimensions and offsets set to boundary and huge
     values, offsets shuffled, wrapped and overlapping, duplicate keys and tensors, nested
     arrays, values of the wrong type, odd metadata (block_count, head counts, epsilon,
     vocabulary, merges, scores, alignment, version, architecture, tokenizer model);
  2. manifests: --manifests mutations: not JSON, nested JSON, wrong types, layers without a
     digest, digests that are not sha256 or that climb out of blobs/ (towards a valid GGUF
     left outside the models directory as bait), names that climb out of manifests/;
  3. each one imported into a fresh target (`python -m cluster model import SOURCE DIR`,
     RLIMIT_AS --memory-mb, RLIMIT_CPU --timeout CPU seconds: the work an import does,
     whatever else the machine runs; killed after --wall-timeout s, for a hang that spends
     no CPU); the directory around the target (the file, the Ollama tree, the bait) is listed
     before and after.

The verdict, which is the exit status: 0 tracebacks (in any output), 0 runs over the time or
memory limit or killed by a signal, every refusal a single line on a non-zero exit, 0
imports of a file whose tensor table (read again here, independently) has a tensor outside
the file or overlapping the one before, 0 imports of a blob outside blobs/, nothing written
or changed outside the target directory, every import a complete model directory, and the
valid file and the valid manifest (the first of each) imported.

The figures are printed as `name: value` lines (tests/test_fuzz_models.py reads them), then
the commonest refusals, and every failure with its mutation (the files kept under --keep).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gguf_export import (ARRAY, BOOL, FLOAT32, FLOAT64, INT32, STRING, UINT8, UINT32, UINT64,  # noqa: E402
                         RawGGUF, nested_array, parse_raw)

BOUNDARY = [0, 1, 2, 3, 7, 31, 32, 33, 255, 256, 4095, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
            2**62, 2**63 - 1, 2**63, 2**64 - 1]
MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass
class Case:
    kind: str  # "gguf" | "manifest"
    label: str  # the mutation
    blob: bytes = b""  # the GGUF file (gguf) or the manifest's bytes (manifest)
    name: str = "tiny:q8"  # the ollama: name imported (manifest)
    blob_name: str | None = None  # where the GGUF blob lies under blobs/ (manifest)


@dataclass
class Outcome:
    case: Case
    code: int | str  # the exit code, "timeout" (wall), "cpu limit" or "signal N"
    seconds: float
    cpu_seconds: float
    rss_mb: float
    output: str
    imported: bool = False
    failures: tuple[str, ...] = ()


# -- the valid files --------------------------------------------------------------------------------
def valid_gguf(work: Path) -> bytes:
    """The tiny random llama as llama.cpp writes it, its 2-D weights of layer 0 Q8_0 and of
    layer 1 Q4_0 (so that the quantized paths are fuzzed too)."""
    from cluster.modelgen import create_model
    from gguf_export import export

    model = create_model(work / "tiny-llama", "llama", "tiny", seed=0)
    quant = {r"blk\.0\..*": "Q8_0", r"blk\.1\..*": "Q4_0", "token_embd.weight": "Q8_0"}
    return export(model, work / "valid.gguf", quantize=quant).read_bytes()


def ollama_tree(root: Path, gguf: bytes, manifest: bytes | None = None, name: str = "tiny:q8",
                blob_name: str | None = None) -> Path:
    """An Ollama models directory holding `gguf` as a blob, named by a manifest (`manifest`
    written as given where there is one)."""
    digest = "sha256:" + hashlib.sha256(gguf).hexdigest()
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / (blob_name or digest.replace(":", "-"))).write_bytes(gguf)
    model, _, tag = name.partition(":")
    path = root / "manifests" / "registry.ollama.ai" / "library" / model / (tag or "latest")
    path.parent.mkdir(parents=True)
    path.write_bytes(manifest if manifest is not None else valid_manifest(digest))
    return root


def valid_manifest(digest: str) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                       "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                  "digest": "sha256:" + "0" * 64, "size": 10},
                       "layers": [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64,
                                   "size": 10},
                                  {"mediaType": MODEL_LAYER, "digest": digest, "size": 1}]}).encode()


# -- GGUF mutations ---------------------------------------------------------------------------------
def _huge(rng: random.Random) -> int:
    return rng.choice(BOUNDARY)


def _kv_positions(r: RawGGUF) -> list[int]:
    """Where each key's length field is in the file r.to_bytes() writes."""
    pos, out = 24, []
    for k, _, v in r.kvs:
        out.append(pos)
        pos += 8 + len(k.encode("utf-8", "surrogateescape")) + 4 + len(v)
    return out


def _put_u64(blob: bytes, pos: int, value: int) -> bytes:
    return blob[:pos] + struct.pack("<Q", value) + blob[pos + 8:]


def _wrong_value(rng: random.Random) -> tuple[int, object]:
    return rng.choice([(STRING, "x" * rng.choice([0, 1, 5000])), (UINT32, rng.choice([0, 1, 2**32 - 1])),
                       (INT32, -1), (FLOAT32, float("nan")), (FLOAT64, float("inf")), (BOOL, True),
                       (UINT64, 2**64 - 1), (ARRAY, (UINT32, [1, 2, 3])), (ARRAY, (STRING, ["a", "b"])),
                       (ARRAY, (UINT8, [])), (ARRAY, (FLOAT32, [float("nan")] * 4))])


def mutate_gguf(valid: bytes, rng: random.Random) -> Case:
    r = parse_raw(valid)
    blob = r.to_bytes()
    head = len(blob) - len(r.data)
    kind = rng.choice(["flip", "flip", "truncate", "count", "length", "offset", "offset", "offsets", "dims", "type",
                       "duplicate", "nested", "wrong type", "wrong type", "metadata", "metadata", "vocabulary",
                       "alignment", "version", "architecture", "tokenizer model", "data"])
    label = kind
    if kind == "flip":
        n = rng.choice([1, 1, 2, 4, 16])
        b = bytearray(blob)
        where = [rng.randrange(head) for _ in range(n)]
        for i in where:
            b[i] ^= 1 << rng.randrange(8)
        return Case("gguf", f"flip {n} header bit(s) at {where[:4]}", bytes(b))
    if kind == "data":
        b = bytearray(blob)
        for _ in range(8):
            b[rng.randrange(head, len(b))] = rng.randrange(256)
        return Case("gguf", "random bytes in the tensor data", bytes(b))
    if kind == "truncate":
        cut = rng.choice([rng.randrange(head), rng.randrange(head, len(blob)), rng.randrange(24), head])
        return Case("gguf", f"truncated at {cut} of {len(blob)}", blob[:cut])
    if kind == "count":
        which = rng.choice(["tensor_count", "kv_count"])
        value = rng.choice([_huge(rng), len(r.tensors) + rng.choice([-1, 1]), 0])
        setattr(r, which, value)
        label = f"{which} = {value}"
    elif kind == "length":
        pos = rng.choice(_kv_positions(r))
        value = _huge(rng)
        return Case("gguf", f"a key length = {value}", _put_u64(blob, pos, value))
    elif kind == "offset":
        t = rng.choice(r.tensors)
        value = rng.choice([_huge(rng), t[3] + rng.choice([-32, -1, 1, 32]), len(r.data), len(r.data) - 32])
        value %= 2**64
        t[3] = value
        label = f"tensor {t[0]} offset = {value}"
    elif kind == "offsets":
        how = rng.choice(["shuffled", "all zero", "reversed", "one copied", "order swapped"])
        offsets = [t[3] for t in r.tensors]
        if how == "shuffled":
            rng.shuffle(offsets)
        elif how == "all zero":
            offsets = [0] * len(offsets)
        elif how == "reversed":
            offsets.reverse()
        elif how == "one copied":
            i = rng.randrange(1, len(offsets))
            offsets[i] = offsets[i - 1]
        else:
            i = rng.randrange(1, len(r.tensors))
            r.tensors[i - 1], r.tensors[i] = r.tensors[i], r.tensors[i - 1]
            offsets = [t[3] for t in r.tensors]
        for t, o in zip(r.tensors, offsets):
            t[3] = o
        label = f"offsets {how}"
    elif kind == "dims":
        t = rng.choice(r.tensors)
        how = rng.choice(["huge", "zero", "five", "none", "swapped", "doubled"])
        if how == "huge":
            t[1][rng.randrange(len(t[1]))] = _huge(rng)
        elif how == "zero":
            t[1][0] = 0
        elif how == "five":
            t[1] = t[1] + [1] * (5 - len(t[1]))
        elif how == "none":
            t[1] = []
        elif how == "swapped":
            t[1] = t[1][::-1]
        else:
            t[1][-1] *= 2
        label = f"tensor {t[0]} dims {how}: {t[1]}"
    elif kind == "type":
        t = rng.choice(r.tensors)
        t[2] = rng.choice([rng.randrange(64), 2**31, 1, 8, 14, 2, 12])
        label = f"tensor {t[0]} ggml type {t[2]}"
    elif kind == "duplicate":
        if rng.random() < 0.5:
            kv = rng.choice(r.kvs)
            r.kvs.insert(rng.randrange(len(r.kvs) + 1), list(kv))
            label = f"key {kv[0]} twice"
        else:
            t = rng.choice(r.tensors)
            r.tensors.append([t[0], list(t[1]), t[2], t[3]])
            label = f"tensor {t[0]} twice"
    elif kind == "nested":
        depth = rng.choice([2, 3, 5, 100, 5000])
        r.kvs.insert(rng.randrange(len(r.kvs) + 1), ["x.nested", ARRAY, nested_array(depth)])
        label = f"arrays nested {depth} deep"
    elif kind == "wrong type":
        kv = rng.choice(r.kvs)
        vtype, value = _wrong_value(rng)
        r.set(kv[0], vtype, value)
        label = f"{kv[0]} = {str(value)[:40]} (type {vtype})"
    elif kind == "metadata":
        key = rng.choice(["llama.block_count", "llama.attention.head_count", "llama.attention.head_count_kv",
                          "llama.embedding_length", "llama.feed_forward_length", "llama.context_length",
                          "llama.attention.key_length", "llama.rope.dimension_count", "tokenizer.ggml.bos_token_id"])
        value = rng.choice([_huge(rng) % 2**32, 0, 1, 3, 1_000_000])
        r.set(key, UINT32, value)
        label = f"{key} = {value}"
    elif kind == "vocabulary":
        tokens = r.strings("tokenizer.ggml.tokens")
        how = rng.choice(["empty", "shorter", "duplicated", "huge piece", "merges malformed", "merges integer",
                          "types short", "no merges"])
        if how == "empty":
            tokens = []
        elif how == "shorter":
            tokens = tokens[:-1]
        elif how == "duplicated":
            tokens[5] = tokens[6]
        elif how == "huge piece":
            tokens[300] = "a" * rng.choice([1000, 100_000])
        if how == "merges malformed":
            r.set("tokenizer.ggml.merges", ARRAY, (STRING, ["nospace", " x", "a  b", ""]))
        elif how == "merges integer":
            r.set("tokenizer.ggml.merges", ARRAY, (INT32, [1, 2]))
        elif how == "types short":
            r.set("tokenizer.ggml.token_type", ARRAY, (INT32, [1] * 10))
        elif how == "no merges":
            r.kvs = [kv for kv in r.kvs if kv[0] != "tokenizer.ggml.merges"]
        else:
            r.set("tokenizer.ggml.tokens", ARRAY, (STRING, tokens))
        label = f"vocabulary {how}"
    elif kind == "alignment":
        value = rng.choice([0, 1, 3, 48, 64, 2**31, 2**32 - 1])
        r.set("general.alignment", UINT32, value)
        label = f"general.alignment = {value}"
    elif kind == "version":
        r.version = rng.choice([0, 1, 2, 4, 3 << 24, 2**32 - 1])
        label = f"version {r.version}"
    elif kind == "architecture":
        value = rng.choice(["qwen2", "qwen3", "gemma2", "gemma3", "phi3", "falcon", "", "llama\0"])
        r.set("general.architecture", STRING, value)
        label = f"general.architecture = {value!r}"
    elif kind == "tokenizer model":
        value = rng.choice(["llama", "bert", "", "gpt2"])
        r.set("tokenizer.ggml.model", STRING, value)
        if value == "llama" and rng.random() < 0.7:
            n = len(r.strings("tokenizer.ggml.tokens"))
            r.set("tokenizer.ggml.scores", ARRAY, (FLOAT32, [-float(i) for i in range(rng.choice([n, n - 1]))]))
        label = f"tokenizer.ggml.model = {value!r}"
    return Case("gguf", label, r.to_bytes())


# -- manifest mutations -----------------------------------------------------------------------------
def mutate_manifest(digest: str, rng: random.Random) -> Case:
    doc = json.loads(valid_manifest(digest))
    layer = doc["layers"][1]
    kind = rng.choice(["not json", "truncated", "nested", "layers", "layer", "digest", "digest", "media", "name",
                       "name", "huge", "valid"])
    label = kind
    if kind == "not json":
        return Case("manifest", "not JSON", rng.choice([b"", b"\xff\xfe", b"{", b"null", b"[1,2]", b"\"x\""]))
    if kind == "truncated":
        raw = json.dumps(doc).encode()
        cut = rng.randrange(len(raw))
        return Case("manifest", f"truncated at {cut}", raw[:cut])
    if kind == "nested":
        depth = rng.choice([100, 5000, 100_000])
        return Case("manifest", f"JSON nested {depth} deep", b'{"layers": ' + b"[" * depth + b"]" * depth + b"}")
    if kind == "huge":
        doc["padding"] = "x" * (2 << 20)
        label = "a 2 MB manifest"
    elif kind == "layers":
        doc["layers"] = rng.choice([None, {}, "layers", 7, [], [[]], [None]])
        label = f"layers = {str(doc['layers'])[:40]}"
    elif kind == "layer":
        what = rng.choice(["no digest", "no mediaType", "a string", "digest null", "digest number"])
        if what == "no digest":
            del layer["digest"]
        elif what == "no mediaType":
            del layer["mediaType"]
        elif what == "a string":
            doc["layers"][1] = "sha256:" + "a" * 64
        elif what == "digest null":
            layer["digest"] = None
        else:
            layer["digest"] = 12
        label = f"model layer {what}"
    elif kind == "digest":
        layer["digest"] = rng.choice([
            "/etc/passwd", "../../outside/bait.gguf", "sha256:../../../outside/bait.gguf", "sha256-" + "a" * 64,
            "sha256:" + "a" * 63, "sha256:" + "g" * 64, "sha256:" + "A" * 64, "sha512:" + "a" * 128,
            "sha256:" + "b" * 64, digest + "/", digest.upper(), "sha256:" + digest[7:] + "\n", digest[:-1] + "\0"])
        label = f"digest {layer['digest'][:50]!r}"
    elif kind == "media":
        layer["mediaType"] = rng.choice([None, 7, "", "application/vnd.ollama.image.MODEL"])
        label = f"mediaType {layer['mediaType']!r}"
    elif kind == "name":
        name = rng.choice(["../../../outside/x", "..", ".", "../tiny:q8", "tiny/../../x:q8", "tiny:../q8", "a" * 200,
                           "tiny:q8:q8", "/etc/passwd", "TINY:q8", "tiny:", ":q8", "ti ny:q8", "tiny\t:q8",
                           "x/y/z/w:q8", "registry.ollama.ai/library/tiny:q8"])
        return Case("manifest", f"name {name!r}", json.dumps(doc).encode(), name=name)
    else:
        return Case("manifest", "valid", json.dumps(doc).encode(), blob_name=None)
    return Case("manifest", label, json.dumps(doc).encode())


# -- running one ------------------------------------------------------------------------------------
def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root`: its type, and a file's size and modification time (a
    directory's change with its entries, which are listed themselves)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            kind = st.st_mode >> 12
            out[os.path.relpath(p, root)] = (kind,) if name in dirnames else (kind, st.st_size, st.st_mtime_ns)
    return out


def tensor_table_problem(blob: bytes) -> str | None:
    """Read the tensor table again, independently of the importer: a tensor outside the data,
    or overlapping the one before (what llama.cpp refuses), or a table that cannot be read."""
    import gguf

    try:
        r = parse_raw(blob)
    except Exception as e:  # noqa: BLE001 - any way of failing is "cannot be read"
        return f"the independent parser cannot read it ({type(e).__name__})"
    end = 0
    for name, dims, ggml_type, offset in r.tensors:
        try:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            return f"tensor {name}: unknown type {ggml_type}"
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * size
        if offset < end or offset + nbytes > len(r.data) or offset % r.alignment:
            return f"tensor {name}: offset {offset} + {nbytes} bytes, previous end {end}, data {len(r.data)} bytes"
        end = offset + nbytes
    return None


def run_one(case: Case, index: int, work: Path, args, valid: bytes) -> Outcome:
    root = work / f"case{index:05d}"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ORCHARD_HOME": str(root / "home"),
           "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if case.kind == "gguf":
        source = root / "model.gguf"
        source.write_bytes(case.blob)
    else:
        (root / "outside").mkdir()
        (root / "outside" / "bait.gguf").write_bytes(valid)  # a valid GGUF outside the models directory
        models = ollama_tree(root / "ollama", valid, case.blob, blob_name=case.blob_name)
        env["OLLAMA_MODELS"] = str(models)
        source = f"ollama:{case.name}"
    (root / "out").mkdir()
    target = root / "out" / "model"
    before = snapshot(root)
    # the limits set by a shell that then execs the import: no preexec_fn, so the child is
    # spawned without a copy of this process (whose peak memory a forked child's would report)
    limits = ["sh", "-c", 'ulimit -v "$1" && ulimit -t "$2" && shift 2 && exec "$@"', "sh",
              str(args.memory_mb << 10), str(math.ceil(args.timeout))]
    with open(root / "output.txt", "w+b") as log:
        started = time.perf_counter()
        proc = subprocess.Popen([*limits, sys.executable, "-m", "cluster", "model", "import", str(source),
                                 str(target)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
        killed = threading.Event()
        timer = threading.Timer(args.wall_timeout, lambda: (killed.set(), proc.kill()))
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        seconds = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read().decode("utf-8", "replace")
    code: int | str = proc.returncode
    if killed.is_set():
        code = "timeout"
    elif proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        code = "cpu limit"
    elif proc.returncode < 0:
        code = f"signal {-proc.returncode}"
    out = Outcome(case, code, seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, output.strip())
    out.imported = code == 0
    out.failures = tuple(judge(out, root, target, before))
    case.blob = b""  # (kept on disk where it failed)
    if not out.failures and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return out


def judge(out: Outcome, root: Path, target: Path, before: dict) -> list[str]:
    bad = []
    if "Traceback" in out.output:
        bad.append("a traceback")
    if not isinstance(out.code, int):
        bad.append(f"ended by {out.code}")
    elif out.code != 0 and len(out.output.splitlines()) != 1:
        bad.append(f"a refusal of {len(out.output.splitlines())} lines")
    after = snapshot(root)
    inside = os.path.relpath(target, root) + os.sep
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    changed.discard("output.txt")
    outside = sorted(p for p in changed if not (p + os.sep).startswith(inside))
    if outside:
        bad.append(f"written outside the target: {outside[:5]}")
    if out.imported:
        done = {p.name for p in target.iterdir()} if target.is_dir() else set()
        missing = {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} - done
        if missing:
            bad.append(f"an import without {sorted(missing)}")
        if out.case.kind == "gguf" and (problem := tensor_table_problem(out.case.blob)):
            bad.append(f"imported a bad tensor table: {problem}")
        if out.case.kind == "manifest":
            source = json.loads((target / "gguf_import.json").read_text())["source"] if "gguf_import.json" in done \
                else ""
            if not Path(source).is_relative_to((root / "ollama" / "blobs").resolve()):
                bad.append(f"imported {source}, outside the models directory's blobs/")
    return bad


# -- the run ----------------------------------------------------------------------------------------
def summary(outcomes: list[Outcome]) -> list[str]:
    lines = []
    for kind in ("gguf", "manifest"):
        outs = [o for o in outcomes if o.case.kind == kind]
        lines.append(f"{kind} runs: {len(outs)}")
        lines.append(f"{kind} imported: {sum(o.imported for o in outs)}")
        lines.append(f"{kind} refused: {sum(isinstance(o.code, int) and o.code != 0 for o in outs)}")
    outside = sum(any("outside the target" in f for f in o.failures) for o in outcomes)
    lines += [f"tracebacks: {sum('Traceback' in o.output for o in outcomes)}",
              f"timeouts: {sum(o.code in ('timeout', 'cpu limit') for o in outcomes)}",
              f"killed by a signal: {sum(str(o.code).startswith('signal') for o in outcomes)}",
              f"bad imports: {sum(any('imported' in f for f in o.failures) for o in outcomes)}",
              f"written outside the target: {outside}",
              f"failures: {sum(bool(o.failures) for o in outcomes)}",
              f"median cpu seconds: {statistics.median(o.cpu_seconds for o in outcomes) if outcomes else 0:.2f}",
              f"max cpu seconds: {max((o.cpu_seconds for o in outcomes), default=0):.2f}",
              f"max wall seconds: {max((o.seconds for o in outcomes), default=0):.2f}",
              f"max rss mb: {max((o.rss_mb for o in outcomes), default=0):.0f}"]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=int, default=2000, help="mutated GGUF files")
    parser.add_argument("--manifests", type=int, default=200, help="mutated Ollama manifests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="imports at a time")
    parser.add_argument("--timeout", type=float, default=10.0, help="CPU seconds an import may take (RLIMIT_CPU)")
    parser.add_argument("--wall-timeout", type=float, default=60.0,
                        help="seconds after which an import is killed as hung (a loaded machine runs it slower)")
    parser.add_argument("--memory-mb", type=int, default=1024, help="each import's address-space limit (RLIMIT_AS)")
    parser.add_argument("--keep", help="keep every case's files under this directory (failures are always kept)")
    args = parser.parse_args(argv)

    work = Path(args.keep or tempfile.mkdtemp(prefix="orchard-fuzz-models-"))
    work.mkdir(parents=True, exist_ok=True)
    valid = valid_gguf(work)
    digest = "sha256:" + hashlib.sha256(valid).hexdigest()

    def case(i: int) -> Case:  # made when it runs, from its own seed: the cases are not all held
        rng = random.Random(f"{args.seed}:{i}")
        if i == 0:
            return Case("gguf", "valid", valid)
        if i == args.gguf + 1:
            return Case("manifest", "valid", valid_manifest(digest))
        return mutate_gguf(valid, rng) if i <= args.gguf else mutate_manifest(digest, rng)

    total = 1 + args.gguf + args.manifests  # (the first file and the first manifest: the valid ones)
    print(f"orchard fuzz models: {total} imports ({args.gguf} GGUF + {args.manifests} manifests and the valid "
          f"file), {args.jobs} at a time, {args.timeout:g} CPU s and {args.memory_mb} MB each, seed {args.seed}; "
          f"files in {work}", flush=True)
    started = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(lambda i: run_one(case(i), i, work, args, valid), range(total)))
    print(f"fuzz seconds: {time.perf_counter() - started:.1f}")
    for line in summary(outcomes):
        print(line)
    refusals = Counter(" ".join(o.output.split(": ", 2)[-1].split()[:5]) for o in outcomes
                       if isinstance(o.code, int) and o.code != 0)
    print("\ncommonest refusals:")
    for text, n in refusals.most_common(15):
        print(f"  {n:5d}  {text}")
    failed = [o for o in outcomes if o.failures]
    valid_ones = [o for o in outcomes if o.case.label == "valid"]
    for o in valid_ones:
        if not o.imported:
            print(f"FAILURE: the valid {o.case.kind} did not import: {o.output[-500:]}")
    for o in failed[:30]:
        print(f"FAILURE [{o.case.kind}: {o.case.label}] exit {o.code} after {o.seconds:.1f} s "
              f"({o.cpu_seconds:.1f} s CPU): "
              f"{'; '.join(o.failures)}\n  {o.output[-600:]}")
    ok = not failed and all(o.imported for o in valid_ones)
    if not args.keep and ok:
        shutil.rmtree(work, ignore_errors=True)
    print("PASS" if ok else f"FAIL: {len(failed)} failures (files under {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
