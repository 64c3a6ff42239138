"""Malformed and hostile GGUF files (issue 37): each is a one-line error naming the field, the
value and the limit, and a non-zero exit from `orchard model import`, never a traceback; the
ones that are well-formed but large (a 10^6-element array, a 600 KB SentencePiece piece)
import within bounded time and memory; tensors that wrap or overlap are refused (llama.cpp
refuses them); the memory and disk an import needs are checked before it starts."""

from __future__ import annotations

import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from cluster import gguf as og
from cluster.gguf_file import read_gguf
from gguf_export import ARRAY, FLOAT32, STRING, UINT8, UINT32, RawGGUF, export, nested_array, parse_raw

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory) -> bytes:
    """A valid tiny llama GGUF (2 layers, 512 tokens, float32 weights), as llama.cpp writes it."""
    from cluster.modelgen import create_model

    root = tmp_path_factory.mktemp("hostile-src")
    return export(create_model(root / "llama", "llama", "tiny", seed=3), root / "m.gguf").read_bytes()


def _metadata_end(r: RawGGUF) -> int:
    return 24 + sum(8 + len(k.encode()) + 4 + len(v) for k, _, v in r.kvs)


def _key_length(blob: bytes, n: int) -> bytes:
    return blob[:24] + struct.pack("<Q", n) + blob[32:]


def _spm(r: RawGGUF, piece: str) -> RawGGUF:
    """The vocabulary as SentencePiece's (scores, byte fallback), one piece replaced by `piece`."""
    tokens = r.strings("tokenizer.ggml.tokens")
    tokens[300] = piece
    r.set("tokenizer.ggml.model", STRING, "llama")
    r.set("tokenizer.ggml.tokens", ARRAY, (STRING, tokens))
    r.set("tokenizer.ggml.scores", ARRAY, (FLOAT32, [-float(i) for i in range(len(tokens))]))
    return r


def _big_q6k_last(r: RawGGUF) -> tuple[RawGGUF, int]:
    """blk.0.ffn_down.weight as one Q6_K tensor of 2^31 weights, the last in the file (the file
    is sparse: its data are a hole)."""
    i = next(i for i, t in enumerate(r.tensors) if t[0] == "blk.0.ffn_down.weight")
    t = r.tensors.pop(i)
    end = len(r.data) + (-len(r.data) % 32)
    r.tensors.append([t[0], [1 << 24, 128], 14, end])  # ggml type 14: Q6_K (256 weights in 210 bytes)
    return r, len(r.to_bytes()) - len(r.data) + end + (1 << 31) // 256 * 210


# name -> (make the file from the valid one's parts, what the error must name; None: it imports)
CASES = {
    "truncated in the metadata": (lambda r: r.to_bytes()[:_metadata_end(r) // 2], "tokenizer.ggml.token_type"),
    "truncated in the tensor infos": (lambda r: r.to_bytes()[:_metadata_end(r) + 200], "truncated"),
    "tensor count 2^63": (lambda r: setattr(r, "tensor_count", 1 << 63) or r, "tensor count 9223372036854775808"),
    "key count 2^63": (lambda r: setattr(r, "kv_count", 1 << 63) or r, "key count 9223372036854775808"),
    "key length 2^63": (lambda r: _key_length(r.to_bytes(), 1 << 63), "length 9223372036854775808"),
    "duplicate key": (lambda r: r.kvs.append(list(r.kv("llama.block_count"))) or r,
                      "'llama.block_count' appears twice"),
    "arrays nested 5,000 deep": (lambda r: r.kvs.append(["x.nested", ARRAY, nested_array(5000)]) or r, "nested"),
    "head count a string": (lambda r: r.set("llama.attention.head_count", STRING, "four"),
                            "llama.attention.head_count"),
    "epsilon a string": (lambda r: r.set("llama.attention.layer_norm_rms_epsilon", STRING, "tiny"),
                         "llama.attention.layer_norm_rms_epsilon"),
    "architecture an array": (lambda r: r.set("general.architecture", ARRAY, (STRING, ["llama"])),
                              "general.architecture"),
    "pre-tokenizer an array": (lambda r: r.set("tokenizer.ggml.pre", ARRAY, (STRING, ["gpt-2"])),
                               "tokenizer.ggml.pre"),
    "malformed merges": (lambda r: r.set("tokenizer.ggml.merges", ARRAY, (STRING, ["nospace", "a b"])),
                         "tokenizer.ggml.merges[0]"),
    "merges of tokens not in the vocabulary": (lambda r: r.set("tokenizer.ggml.merges", ARRAY, (STRING, ["zq xj"])),
                                               "tokenizer.ggml.merges[0]"),
    "integer merges": (lambda r: r.set("tokenizer.ggml.merges", ARRAY, (UINT32, [1, 2, 3])), "tokenizer.ggml.merges"),
    "empty vocabulary": (lambda r: r.set("tokenizer.ggml.tokens", ARRAY, (STRING, [])), "tokenizer.ggml.tokens"),
    "block_count 1000000, 2 layers of tensors": (lambda r: r.set("llama.block_count", UINT32, 1_000_000),
                                                 "llama.block_count 1000000"),
    "offset 2^64-1": (lambda r: r.tensors[1].__setitem__(3, (1 << 64) - 1) or r, "offset 18446744073709551615"),
    "all tensors overlapping": (lambda r: [t.__setitem__(3, 0) for t in r.tensors] and r, "overlaps"),
    "one Q6_K tensor of 2^31 weights (sparse)": (None, "blk.0.ffn_down.weight"),
    "10^6-element metadata array": (
        lambda r: r.kvs.append(["x.big", ARRAY, struct.pack("<IQ", UINT8, 10**6) + bytes(10**6)]) or r, None),
    "600 KB SentencePiece piece": (lambda r: _spm(r, "a" * 600_000), None),
}


def write_case(name: str, base: bytes, path: Path) -> Path:
    make, _ = CASES[name]
    r = parse_raw(base)
    if make is None:  # the sparse file
        r, size = _big_q6k_last(r)
        r.write(path)
        with open(path, "r+b") as f:
            f.truncate(size)
        return path
    out = make(r)
    path.write_bytes(out if isinstance(out, bytes) else out.to_bytes())
    return path


def import_cli(path: Path, out: Path, capsys) -> tuple[int, str]:
    from cluster.cli import main

    code = main(["model", "import", str(path), str(out)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("name", [n for n, (_, want) in CASES.items() if want is not None and "600 KB" not in n])
def test_a_malformed_file_is_a_one_line_error_naming_the_field(name, base_gguf, tmp_path, capsys):
    path = write_case(name, base_gguf, tmp_path / "bad.gguf")
    code, text = import_cli(path, tmp_path / "out", capsys)
    assert code != 0, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert CASES[name][1] in text, text
    assert not (tmp_path / "out").exists()


def test_a_valid_file_still_imports(base_gguf, tmp_path, capsys):
    path = tmp_path / "ok.gguf"
    path.write_bytes(parse_raw(base_gguf).to_bytes())
    code, text = import_cli(path, tmp_path / "out", capsys)
    assert code == 0 and (tmp_path / "out" / "model.safetensors.index.json").exists(), text


def test_a_million_element_array_is_read_without_an_object_per_element(base_gguf, tmp_path, capsys):
    """The gguf package made a Python object per element (hundreds of MB for 10^6); the
    bounded reader keeps a numeric array as a view of the file."""
    path = write_case("10^6-element metadata array", base_gguf, tmp_path / "big.gguf")
    tracemalloc.start()
    try:
        md = read_gguf(path).metadata
        big = md["x.big"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(big, np.ndarray) and big.shape == (10**6,)
    assert peak < 16 << 20, peak
    code, text = import_cli(path, tmp_path / "out", capsys)
    assert code == 0, text


def test_a_600_kb_sentencepiece_piece_imports_in_linear_time(base_gguf, tmp_path):
    """The merges of a SentencePiece vocabulary were found by slicing every piece at every
    position (quadratic in a piece's length: about a minute for 600 KB); now linear. Run in a
    subprocess so that the old code's minute is a timeout, not a stuck test run."""
    path = write_case("600 KB SentencePiece piece", base_gguf, tmp_path / "spm.gguf")
    out = subprocess.run([sys.executable, "-m", "cluster", "model", "import", str(path), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=45, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "out" / "tokenizer.json").exists()


def _tensor(r: RawGGUF, name: str) -> list:
    return next(t for t in r.tensors if t[0] == name)


# more ways to be malformed, each refused by name (GGUFError matching the pattern)
MORE = {
    "not GGUF": (lambda r: b"GGML" + r.to_bytes()[4:], "not a GGUF file"),
    "big-endian": (lambda r: setattr(r, "version", 3 << 24) or r, "big-endian"),
    "version 1": (lambda r: setattr(r, "version", 1) or r, "GGUF version 1"),
    "unknown value type": (lambda r: r.kvs.append(["x.odd", 13, b"\0" * 8]) or r, "unknown value type 13"),
    "unknown array item type": (lambda r: r.kvs.append(["x.odd", ARRAY, struct.pack("<IQ", 99, 0)]) or r,
                                "item type 99"),
    "string longer than the file": (lambda r: r.kvs.append(["x.s", STRING, struct.pack("<Q", 1 << 40)]) or r,
                                    "truncated"),
    "key not UTF-8": (lambda r: r.kvs.append([b"\xff\xfe".decode("latin-1"), UINT8, b"\0"]) or r, None),
    "key with a newline": (lambda r: r.kvs.append(["x.a\nb", UINT8, b"\0"]) or r, r"'x.a\\nb' holds control"),
    "alignment not a power of two": (lambda r: r.set("general.alignment", UINT32, 48), "general.alignment 48"),
    "unknown ggml type": (lambda r: _tensor(r, "output_norm.weight").__setitem__(2, 200) or r, "ggml type 200"),
    "five dimensions": (lambda r: _tensor(r, "output_norm.weight").__setitem__(1, [128, 1, 1, 1, 1]) or r,
                        "n_dims 5"),
    "a zero dimension": (lambda r: _tensor(r, "output_norm.weight").__setitem__(1, [0]) or r, "positive"),
    "misaligned offset": (lambda r: r.tensors[1].__setitem__(3, r.tensors[1][3] + 4) or r, "alignment 32"),
    "data past the end": (lambda r: r.to_bytes()[:-100], "outside the data section"),
    "duplicate tensor": (lambda r: r.tensors.append(list(r.tensors[0])) or r, "appears twice"),
    "token types of another length": (lambda r: r.set("tokenizer.ggml.token_type", ARRAY, (UINT32, [1] * 3)),
                                      "3 items, one per token"),
    "head count 0": (lambda r: r.set("llama.attention.head_count", UINT32, 0), "head_count 0"),
    "a layer missing a tensor": (lambda r: r.tensors.remove(_tensor(r, "blk.1.attn_q.weight")) or r, "attn_q.weight"),
    "vocabulary unlike the embeddings": (lambda r: r.set("tokenizer.ggml.tokens", ARRAY, (
        STRING, r.strings("tokenizer.ggml.tokens")[:-1])).set("tokenizer.ggml.token_type", ARRAY, (UINT32, [1] * 511)),
                                         "tensor output.weight: shape \\(512, 128\\)"),
    "embedding_length unlike the tensors": (lambda r: r.set("llama.embedding_length", UINT32, 64), "shape"),
    "chat template an integer": (lambda r: r.set("tokenizer.chat_template", UINT32, 7), "tokenizer.chat_template"),
    "scores of another type": (lambda r: r.set("tokenizer.ggml.model", STRING, "llama").set(
        "tokenizer.ggml.scores", ARRAY, (STRING, ["a"] * 512)), "tokenizer.ggml.scores"),
}


@pytest.mark.parametrize("name", list(MORE))
def test_more_malformed_files_are_refused_by_name(name, base_gguf, tmp_path):
    make, pattern = MORE[name]
    r = parse_raw(base_gguf)
    if name == "key not UTF-8":  # the raw key bytes, not a str
        blob = r.to_bytes()
        blob = blob[:32] + b"\xff" + blob[33:]  # the first key's first byte
        pattern = "not UTF-8"
    else:
        out = make(r)
        blob = out if isinstance(out, bytes) else out.to_bytes()
    (tmp_path / "bad.gguf").write_bytes(blob)
    with pytest.raises(og.GGUFError, match=pattern):
        og.import_gguf(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_import_that_needs_more_memory_or_disk_than_is_free_is_refused_with_the_numbers(
        base_gguf, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    path = tmp_path / "ok.gguf"
    path.write_bytes(base_gguf)
    monkeypatch.setattr(og, "memory_free", lambda: 100_000)
    with pytest.raises(og.GGUFError, match=r"converting tensor output.weight \(F32, 512x128\) needs 0\.5 MiB of "
                                           r"memory; 0\.1 MiB is free"):
        og.import_gguf(path, tmp_path / "out")
    monkeypatch.undo()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 << 20))
    with pytest.raises(og.GGUFError, match=r"the import writes [\d.]+ MiB and .* has 1\.0 MiB free"):
        og.import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_token_id_of_minus_one_is_no_token(base_gguf, tmp_path):
    """Some converters write an absent special token as -1 (int32): no token, not a refusal."""
    from gguf_export import INT32

    path = parse_raw(base_gguf).set("tokenizer.ggml.bos_token_id", INT32, -1).write(tmp_path / "m.gguf")
    dst = og.import_gguf(path, tmp_path / "out")
    assert "bos_token_id" not in (dst / "generation_config.json").read_text()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -2.0])
def test_rope_factors_that_are_not_numbers_or_below_one_are_refused(bad):
    factors = np.ones(32)
    factors[5] = bad
    with pytest.raises(og.GGUFError, match="rope_freqs: factors"):
        og.llama3_rope_scaling(factors, 500000.0, 64)
