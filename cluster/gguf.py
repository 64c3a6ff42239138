"""GGUF files (llama.cpp's, LM Studio's, Ollama's blobs) as ordinary mlx-lm model directories.

Contract:
- `import_gguf(src, dst)` reads a GGUF file within bounds (cluster/gguf_file.py: every
  count, length and offset checked before it is used), checks the metadata's types, the
  tensors against the metadata (block_count, shapes, the vocabulary) and the memory and disk
  the import needs against what is free, all before it writes anything; then it writes an
  mlx-lm directory: config.json, the weights as safetensors shards with the index Hugging
  Face and mlx-lm write (model-00001-of-000NN.safetensors ..., model.safetensors.index.json:
  the embedding, then one shard per layer, then the rest, so that a pipeline rank reads only
  its layers' files), tokenizer.json + tokenizer_config.json (the chat template from the
  metadata), special_tokens_map.json, generation_config.json and gguf_import.json (what was
  done to each tensor type). `mlx_lm.load` and everything in
  Orchard load that directory like any other; there is no second model path.
- Architectures (`ARCHS`): llama (and Mistral, which llama.cpp files as llama), qwen2,
  qwen3, gemma2, gemma3, phi3. Any other is refused by name (`GGUFError`).
- llama.cpp's converter permutes the Q and K rows of a llama-family model for its
  interleaved RoPE ("NORM"); mlx-lm rotates halves, as Hugging Face does, so the rows are
  permuted back. The other families here use the halves layout in llama.cpp too (NEOX).
  Gemma's converter stores its norms as 1 + w; mlx-lm adds the 1 itself, so 1 is taken off.
- Weights: F32, F16 and BF16 pass through. Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K are
  affine per 32 weights (w = d * q + m), which is MLX's affine quantization with group size
  32: they stay quantized (MLX layers with float32 scales and biases), and `mx.dequantize`
  gives exactly the gguf package's (llama.cpp's) dequantized values. MXFP4 maps onto MLX's
  mxfp4 exactly. Every other type (Q6_K's 16-weight groups, Q2_K, Q3_K, the I-quants, ...)
  is dequantized to float32 with the gguf package, and the log and gguf_import.json say so.
- Tokenizer from the metadata: byte-level BPE (`tokenizer.ggml.model == "gpt2"`: tokens,
  merges, llama.cpp's pre-tokenizer regexes for `tokenizer.ggml.pre`) and SentencePiece
  (`llama`: tokens, scores, token types, byte fallback; its merges found in time linear in the
  vocabulary's text), built with `tokenizers` so that
  transformers and mlx-lm load it as a fast tokenizer; control tokens special, BOS/EOS
  handling and the end-of-generation tokens as llama.cpp has them.
- `resolve(spec, gguf_file)` turns what a user names (a .gguf path, a directory holding
  one, `ollama:NAME[:TAG]`, a hub repo) into an imported directory, cached under the models
  cache (keyed by the file's path, size and modification time and this importer's version;
  the directory is named as the worker serves the model: the file's name, or Ollama's NAME:TAG).
- Writes: cluster/owned_dir.py's rule (never over what Orchard did not write, renamed into
  place). Ollama names and manifest digests are checked as Ollama checks them (`ollama_name`,
  `ollama_model_digest`), so a name or digest never reaches outside the models directory.

Imports no MLX: the conversion is numpy, and the router-side `orchard up` may resolve.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster import owned_dir
from cluster.gguf_file import GGUFError, read_gguf, shown  # noqa: F401  (GGUFError: this module's error too)

log = logging.getLogger(__name__)

IMPORTER_VERSION = 3  # part of the cache key: a changed importer imports again
GROUP = 32  # MLX's affine group size that holds llama.cpp's 32-weight blocks
IMPORT_KIND = "gguf-import"  # what owned_dir's marker says an import directory is


# -- architectures ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    model_type: str  # mlx-lm's
    hf_class: str
    permuted_qk: bool = False  # llama.cpp's converter interleaved the Q/K rows for NORM RoPE
    norm_plus_one: bool = False  # stored norms are 1 + w (Gemma)
    ffn_norm: str = "post_attention_layernorm"  # what llama.cpp's ffn_norm is
    fused_up: bool = False  # ffn_up holds gate and up (Phi-3)


ARCHS = {
    "llama": Arch("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM"),
    "gemma2": Arch("gemma2", "Gemma2ForCausalLM", norm_plus_one=True, ffn_norm="pre_feedforward_layernorm"),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", norm_plus_one=True, ffn_norm="pre_feedforward_layernorm"),
    "phi3": Arch("phi3", "Phi3ForCausalLM", fused_up=True),
}

_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_norm": "post_attention_layernorm",  # (Arch.ffn_norm)
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONSUMED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def hf_name(name: str, arch: Arch) -> str:
    """mlx-lm's parameter name for a GGUF tensor name (GGUFError for one it does not know)."""
    stem, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias") or not stem:
        raise GGUFError(f"tensor {name!r}: not a weight or bias")
    if stem in _TOP_TENSORS:
        return f"{_TOP_TENSORS[stem]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if not m or m.group(2) not in _BLOCK_TENSORS:
        raise GGUFError(f"tensor {name!r} is not one Orchard knows for this architecture")
    part = _BLOCK_TENSORS[m.group(2)]
    if m.group(2) == "ffn_norm":
        part = arch.ffn_norm
    if m.group(2) == "ffn_up" and arch.fused_up:
        part = "mlp.gate_up_proj"
    return f"model.layers.{m.group(1)}.{part}.{kind}"


# -- reading ---------------------------------------------------------------------------------

def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise GGUFError("reading GGUF files needs the `gguf` package (pip install gguf)") from e
    return gguf


_ABSENT = object()
_KINDS = {"str": "a string", "bool": "a bool", "id": "an integer", "int": "an integer >= 0",
          "count": "an integer >= 1", "float": "a finite number"}


def _fits(v, kind: str) -> bool:
    if kind == "str":
        return isinstance(v, str)
    if kind == "bool":
        return isinstance(v, (bool, np.bool_))
    if kind in ("id", "int", "count"):
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and (kind == "id" or v >= (kind == "count"))
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def _what(md, key: str, v) -> str:
    """How a bad value is shown: its GGUF type where the metadata knows it, and a short repr."""
    kind = md.type_of(key) if hasattr(md, "type_of") else type(v).__name__
    return f"{shown(v.tolist() if isinstance(v, np.ndarray) else v, 60)} ({kind})"


def meta(md, key: str, kind: str, default=_ABSENT):
    """md[key], which must be of `kind` (see _KINDS); `default` when absent (GGUFError when
    absent without one, or of another kind)."""
    v = md.get(key, _ABSENT)
    if v is _ABSENT:
        if default is _ABSENT:
            raise GGUFError(f"the GGUF metadata has no {key!r}")
        return default
    if not _fits(v, kind):
        raise GGUFError(f"{key} {_what(md, key, v)}: must be {_KINDS[kind]}")
    return v.item() if isinstance(v, np.generic) else v


def meta_list(md, key: str, kind: str, length: int | None = None, default=_ABSENT) -> list:
    """md[key] as a list, which must be an array of `kind` (of `length` items when given)."""
    v = md.get(key, _ABSENT)
    if v is _ABSENT:
        if default is _ABSENT:
            raise GGUFError(f"the GGUF metadata has no {key!r}")
        return default
    items = v.tolist() if isinstance(v, np.ndarray) else v
    if not isinstance(items, list) or (kind == "str" and isinstance(v, np.ndarray)):
        raise GGUFError(f"{key} {_what(md, key, v)}: must be an array of {_KINDS[kind].split(' ', 1)[1]}s")
    bad = next((i for i, x in enumerate(items) if not _fits(x, kind)), None)
    if bad is not None:
        raise GGUFError(f"{key}[{bad}] {_what(md, key, items[bad])}: must be {_KINDS[kind]}")
    if length is not None and len(items) != length:
        raise GGUFError(f"{key}: {len(items)} items, one per token ({length}) expected")
    return items


# -- weights: llama.cpp blocks -> MLX affine quantization ----------------------------------

def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row (little-endian float16) -> float32 column."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 16-byte nibble layout: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit minimums."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(b):
    d = _f16(b[:, 0:2])
    q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128.0 * d


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8.0 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    high = (np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return _nibbles(qs) | (high.astype(np.uint8) << 4)


def _q5_0(b):
    d = _f16(b[:, 0:2])
    return _q5(b[:, 2:6], b[:, 6:22]), d, -16.0 * d


def _q5_1(b):
    return _q5(b[:, 4:8], b[:, 8:24]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _k_low(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 8 sub-blocks of 32: each 32-byte run's low nibbles, then its high ones."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return _k_low(b[:, 16:144]).reshape(-1, 256), d * sc, -(dmin * mn)


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _k_low(b[:, 48:176]) | (high << 4)
    return q.reshape(-1, 256), d * sc, -(dmin * mn)


def _mxfp4(b):
    return _nibbles(b[:, 1:17]), b[:, 0:1].copy(), None


@dataclass(frozen=True)
class Affine:
    bits: int
    split: object  # blocks (n, type_size) uint8 -> q (n, block) uint8, scales (n, groups), biases or None
    mode: str = "affine"


# The types MLX holds exactly. Scales and biases are float32: d * q + m in float32 is
# then the same float32 the gguf package computes (the products are exact, one rounding
# in the sum), on every backend.
EXACT = {"Q8_0": Affine(8, _q8_0), "Q4_0": Affine(4, _q4_0), "Q4_1": Affine(4, _q4_1), "Q5_0": Affine(5, _q5_0),
         "Q5_1": Affine(5, _q5_1), "Q4_K": Affine(4, _q4_k), "Q5_K": Affine(5, _q5_k),
         "MXFP4": Affine(4, _mxfp4, mode="mxfp4")}
PASS_THROUGH = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Values < 2**bits along the last axis -> MLX's packed uint32 (a little-endian bit stream)."""
    rows, cols = q.shape
    if bits == 8:
        by = q.astype(np.uint8)
    elif bits == 4:
        q = q.reshape(rows, cols // 2, 2).astype(np.uint8)
        by = q[..., 0] | (q[..., 1] << 4)
    else:
        words = (q.reshape(rows, -1, 8).astype(np.uint64) << (bits * np.arange(8, dtype=np.uint64))).sum(axis=-1)
        by = words.view(np.uint8).reshape(rows, -1, 8)[..., :bits].reshape(rows, -1)
    return np.ascontiguousarray(by).view(np.uint32)


def to_mlx_quantized(type_name: str, data: np.ndarray, cols: int) -> dict[str, np.ndarray]:
    """A quantized GGUF tensor (rows of raw blocks) -> MLX's weight, scales and biases arrays."""
    spec = EXACT[type_name]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, _type_size(type_name))
    q, scales, biases = spec.split(blocks)
    out = {"weight": pack(q.reshape(rows, cols), spec.bits), "scales": scales.reshape(rows, cols // GROUP)}
    if biases is not None:
        out["biases"] = biases.reshape(rows, cols // GROUP).astype(np.float32)
    out["scales"] = out["scales"].astype(np.uint8 if spec.mode == "mxfp4" else np.float32)
    return out


def _type_size(type_name: str) -> int:
    gguf = _gguf()
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]


def dequantize(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The gguf package's (llama.cpp's) float32 values of a tensor of any type it reads."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        out = gguf.quants.dequantize(np.ascontiguousarray(data), qtype)
    except NotImplementedError as e:
        raise GGUFError(f"tensor type {type_name}: the gguf package cannot dequantize it ({e})") from e
    return np.asarray(out, dtype=np.float32).reshape(shape)


# -- safetensors, written one tensor at a time ---------------------------------------------

_ST_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint32): "U32",
             np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32"}
_ST_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "U8": 1, "I32": 4}


@dataclass
class _Planned:
    name: str
    dtype: str
    shape: tuple[int, ...]


def write_safetensors(path: Path, planned: list[_Planned], produce) -> None:
    """Write tensors planned up front (name, dtype, shape) whose bytes `produce()` yields in
    order, as (name, ndarray or raw bytes); the header is written first, so that no more than
    one tensor is in memory at a time."""
    header, offset = {}, 0
    for p in planned:
        n = _ST_SIZE[p.dtype] * int(np.prod(p.shape, dtype=np.int64))
        header[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "mlx"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for p, (name, arr) in zip(planned, produce(), strict=True):
            want = header[p.name]["data_offsets"]
            raw = memoryview(arr if isinstance(arr, (bytes, memoryview)) else np.ascontiguousarray(arr)).cast("B")
            if name != p.name or raw.nbytes != want[1] - want[0]:
                raise RuntimeError(f"safetensors writer: {name} is {raw.nbytes} bytes, planned {p.name} "
                                   f"{want[1] - want[0]}")
            f.write(raw)


def layer_of(name: str) -> int | None:
    """The layer an mlx-lm tensor name belongs to (None: the embedding, the final norm,
    the head)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return None if m is None else int(m.group(1))


def shard_plan(names: list[str]) -> list[list[str]]:
    """The tensors of each shard, in file order: the embedding (and whatever else precedes
    the layers), each layer's, then the rest (final norm, head)."""
    shards: dict[tuple, list[str]] = {}
    for name in names:
        layer = layer_of(name)
        key = (1, layer) if layer is not None else (0, 0) if "embed" in name else (2, 0)
        shards.setdefault(key, []).append(name)
    return [shards[k] for k in sorted(shards)]


def write_shards(dst: Path, planned: list[_Planned], convert) -> None:
    """The planned tensors as safetensors shards (`shard_plan`, named as Hugging Face names
    them) and model.safetensors.index.json; `convert(name)` yields (name, bytes-like) for
    the planned outputs of the source tensor `name`, each converted once, one at a time.
    `planned` maps each output to its source: (source name, _Planned) pairs."""
    by_source: dict[str, list[_Planned]] = {}
    for source, p in planned:
        by_source.setdefault(source, []).append(p)
    shards = shard_plan(list(by_source))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, sources in zip(names, shards):
        outputs = [p for s in sources for p in by_source[s]]
        write_safetensors(dst / file, outputs, lambda sources=sources: (out for s in sources for out in convert(s)))
        for p in outputs:
            weight_map[p.name] = file
            total += _ST_SIZE[p.dtype] * math.prod(p.shape)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# -- config ----------------------------------------------------------------------------------

def llama3_rope_scaling(factors: np.ndarray, base: float, dim: int) -> dict:
    """mlx-lm's llama3 rope_scaling whose per-frequency factors are llama.cpp's rope_freqs
    tensor (its converter writes the factors, not the parameters): Llama 3.x's low and high
    frequency factors (1, 4), the rest solved from the factors and checked against them."""
    if not (np.isfinite(factors).all() and (factors >= 1.0).all()):
        raise GGUFError(f"rope_freqs: factors from {factors.min()} to {factors.max()}; Llama 3's are finite and >= 1")
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * np.pi / freqs
    factor, low, high = float(factors.max()), 1.0, 4.0
    mid = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    old = 8192.0
    if mid.any():  # 1/f = (1 - s)/factor + s with s = (old/wavelen - low)/(high - low)
        s = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        old = float(np.median((s * (high - low) + low) * wavelen[mid]))
    cfg = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
           "original_max_position_embeddings": int(round(old))}
    if not np.allclose(_llama3_factors(cfg, freqs), factors, rtol=1e-5, atol=1e-6):
        raise GGUFError("rope_freqs: per-frequency RoPE factors that are not Llama 3's scheme")
    return cfg


def _llama3_factors(cfg: dict, freqs: np.ndarray) -> np.ndarray:
    factor, low, high, old = (cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"],
                              cfg["original_max_position_embeddings"])
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out)


def _one(md, key: str, kind: str, what: str, default=_ABSENT):
    """A value that may be given per layer (an array): the same for every layer."""
    v = md.get(key)
    if isinstance(v, (list, np.ndarray)):
        values = set(meta_list(md, key, kind))
        if len(values) != 1:
            shown = sorted(values)[:8]
            raise GGUFError(f"{key}: a different {what} per layer ({shown}) is not supported")
        return values.pop()
    return meta(md, key, kind, default)


def model_config(md, tensors: dict[str, tuple[tuple[int, ...], str]]) -> dict:
    """config.json for mlx-lm from the metadata (and which tensors exist), each value checked
    to be of its type."""
    name = meta(md, "general.architecture", "str")
    if name not in ARCHS:
        raise GGUFError(f"GGUF architecture {shown(name)} is not supported (supported: {', '.join(ARCHS)})")
    arch = ARCHS[name]
    p = f"{name}."
    hidden = meta(md, p + "embedding_length", "count")
    heads = _one(md, p + "attention.head_count", "count", "head count")
    kv = _one(md, p + "attention.head_count_kv", "int", "KV head count", 0) or heads
    head_dim = meta(md, p + "attention.key_length", "int", 0) or hidden // heads
    rope_dim = meta(md, p + "rope.dimension_count", "int", 0) or head_dim
    if head_dim < 2 or head_dim % 2:
        raise GGUFError(f"{p}attention.key_length {head_dim}: RoPE needs an even head size")
    vocab = tensors["token_embd.weight"][0][0]
    cfg = {
        "model_type": arch.model_type, "architectures": [arch.hf_class],
        "hidden_size": hidden, "num_hidden_layers": meta(md, p + "block_count", "count"),
        "intermediate_size": _one(md, p + "feed_forward_length", "count", "MLP width"),
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": float(meta(md, p + "attention.layer_norm_rms_epsilon", "float", 1e-5)),
        "rope_theta": float(meta(md, p + "rope.freq_base", "float", 10000.0)), "vocab_size": int(vocab),
        "max_position_embeddings": meta(md, p + "context_length", "count", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if (meta(md, p + "attention.value_length", "int", 0) or head_dim) != head_dim:
        raise GGUFError(f"{name}: a value head size unlike the key's is not supported")
    scaling = meta(md, p + "rope.scaling.type", "str", None)
    factor = float(meta(md, p + "rope.scaling.factor", "float", 1.0) or 1.0)
    if scaling in ("linear",) and factor != 1.0:
        cfg["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling == "yarn":
        cfg["rope_scaling"] = {"type": "yarn", "factor": factor, "original_max_position_embeddings":
                               meta(md, p + "rope.scaling.original_context_length", "count",
                                    cfg["max_position_embeddings"])}
    elif scaling not in (None, "none", "linear"):
        raise GGUFError(f"{name}: RoPE scaling {shown(scaling)} is not supported")
    if name in ("llama", "qwen2", "qwen3", "gemma2", "gemma3") and rope_dim != head_dim:
        raise GGUFError(f"{name}: RoPE on {rope_dim} of {head_dim} head dimensions is not supported")
    if name == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        cfg["mlp_bias"] = "blk.0.ffn_down.bias" in tensors
    elif name == "qwen2":
        if head_dim != hidden // heads:
            raise GGUFError(f"qwen2: head size {head_dim} is not hidden / heads ({hidden // heads})")
        del cfg["head_dim"]
    elif name in ("gemma2", "gemma3"):
        layers = cfg["num_hidden_layers"]
        big = layers == (46 if name == "gemma2" else 62)  # llama.cpp's 27B rule for the query scale
        cfg["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        if name == "gemma2":
            cfg["attn_logit_softcapping"] = float(meta(md, p + "attn_logit_softcapping", "float", 50.0))
            cfg["final_logit_softcapping"] = float(meta(md, p + "final_logit_softcapping", "float", 30.0))
        else:
            cfg.pop("tie_word_embeddings")  # mlx-lm's gemma3 ties when lm_head is absent
            if meta(md, p + "final_logit_softcapping", "float", 0.0):
                raise GGUFError("gemma3 with a final logit soft-cap is not supported (mlx-lm has none)")
            window = meta(md, p + "attention.sliding_window", "int", 0)
            key = p + "attention.sliding_window_pattern"
            pattern = md.get(key, 6)
            if isinstance(pattern, (list, np.ndarray)):  # per layer: True where the layer is windowed
                pattern = meta_list(md, key, "bool")
                period = pattern.index(False) + 1 if False in pattern else len(pattern)
                if [bool(x) for x in pattern] != [(i % period) != period - 1 for i in range(len(pattern))]:
                    raise GGUFError(f"gemma3: sliding-window layers {shown(pattern)} are not every n-th global")
                pattern = period
            pattern = meta({key: pattern}, key, "count")
            cfg.update(sliding_window=window or cfg["max_position_embeddings"],
                       sliding_window_pattern=int(pattern) if window else 1,
                       rope_local_base_freq=float(meta(md, p + "rope.freq_base_swa", "float", 10000.0)))
    elif name == "phi3":
        cfg.pop("head_dim")
        if head_dim != hidden // heads:
            raise GGUFError(f"phi3: head size {head_dim} is not hidden / heads ({hidden // heads})")
        cfg["partial_rotary_factor"] = rope_dim / head_dim
        orig = meta(md, p + "rope.scaling.original_context_length", "count", cfg["max_position_embeddings"])
        cfg["original_max_position_embeddings"] = orig
    return cfg


# -- tokenizer -------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
           r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
          r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])"
           r"([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|"
          r"'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|"
          r"'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizer for each `tokenizer.ggml.pre` (src/llama-vocab.cpp): regexes
# applied in turn, each splitting the pieces the previous left; its BPE then skips the
# merges for a piece that is a whole token ("ignore_merges") where it says so.
PRE_TOKENIZERS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "lfm2"), ([_LLAMA3], True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), ([_QWEN2], False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    ([r"\p{N}", _GPT2], False)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion"), ([_GPT2], False)),
    "tekken": ([_TEKKEN], True),
    **dict.fromkeys(("gpt-4o", "llama4"), ([_GPT4O], False)),
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False),
}
# control tokens llama.cpp ends a generation on, by their text (src/llama-vocab.cpp)
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
              "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>", "<eos>", "</s>",
              "<end_of_utterance>"}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # GGUF token types (5 unused, 6 byte: not read)


@dataclass
class Vocab:
    """What the tokenizer files need, from the metadata."""

    tokens: list[str]
    types: list[int]
    model: str
    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    add_bos: bool
    add_eos: bool
    eog: list[int] = field(default_factory=list)


def vocab_of(md) -> Vocab:
    """The vocabulary from the metadata, each value checked to be of its type and length."""
    tokens = meta_list(md, "tokenizer.ggml.tokens", "str")
    if not tokens:
        raise GGUFError("tokenizer.ggml.tokens is empty: a vocabulary needs at least one token")
    model = meta(md, "tokenizer.ggml.model", "str")
    types = meta_list(md, "tokenizer.ggml.token_type", "int", len(tokens), [NORMAL] * len(tokens))

    def tid(key):
        v = meta(md, f"tokenizer.ggml.{key}_token_id", "id", None)  # (-1 and out of range: none)
        return v if v is not None and 0 <= v < len(tokens) else None

    add_bos = meta(md, "tokenizer.ggml.add_bos_token", "bool", None)
    if add_bos is None:  # llama.cpp's defaults: SentencePiece adds BOS; BPE only for Llama 3's
        add_bos = model == "llama" or PRE_TOKENIZERS.get(meta(md, "tokenizer.ggml.pre", "str", ""), (0, False))[1]
    v = Vocab(tokens, types, model, tid("bos"), tid("eos"), tid("unknown"), tid("padding"), bool(add_bos),
              bool(meta(md, "tokenizer.ggml.add_eos_token", "bool", False)))
    eog = [v.eos, tid("eot"), tid("eom")]
    eog += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in _EOG_TEXTS]
    v.eog = list(dict.fromkeys(i for i in eog if i is not None))
    return v


def bpe_merges(md, vocab: Vocab) -> list[tuple[str, str]]:
    """The merges as (left, right), split where llama.cpp splits them (the first space after
    the first character); each half and their concatenation must be tokens, as the
    `tokenizers` BPE model requires."""
    known = set(vocab.tokens)
    out = []
    for i, m in enumerate(meta_list(md, "tokenizer.ggml.merges", "str")):
        cut = m.find(" ", 1)
        left, right = m[:cut], m[cut + 1:]
        if cut < 0 or left not in known or right not in known or left + right not in known:
            raise GGUFError(f"tokenizer.ggml.merges[{i}] {shown(m, 40)}: must be two tokens separated by a space, "
                            "both in the vocabulary, as is the token they make")
        out.append((left, right))
    return out


def _bpe_tokenizer(md, vocab: Vocab):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta(md, "tokenizer.ggml.pre", "str", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer.ggml.pre {shown(pre)}: a pre-tokenizer Orchard does not know "
                        f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
    regexes, ignore_merges = PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=bpe_merges(md, vocab),
                               ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


_HASH_PRIMES = (2147483647, 2147483629)  # below 2**31: a product of two residues fits in uint64


def _powers(base: int, n: int, p: int) -> np.ndarray:
    """base**i % p for i < n (doubling: each step extends the run by the run's own length)."""
    out, m, step = np.ones(max(n, 1), np.uint64), 1, base % p
    while m < n:
        k = min(m, n - m)
        out[m:m + k] = out[:k] * np.uint64(step) % np.uint64(p)
        step, m = step * step % p, m + k
    return out


def spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Hugging Face's SentencePiece merges: every split of a normal or user-defined piece into
    two pieces of the vocabulary, ranked by the piece's score (ties: vocabulary order, then the
    halves' ids). Linear in the vocabulary's characters: every prefix and suffix of every piece
    is hashed at once (two polynomial hashes of all the text, random bases) and looked up among
    the pieces' own hashes, where slicing each piece at each position was quadratic; each
    match is then checked on the strings, so a hash collision cannot make a merge."""
    import secrets

    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    first = np.fromiter((ids[t] for t in tokens), np.int64, len(tokens))
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    text = "".join(tokens).encode("utf-32-le", "surrogatepass")
    codes = np.frombuffer(text, np.uint32).astype(np.uint64) + np.uint64(1)
    merged = np.flatnonzero((first == np.arange(len(tokens))) & (lengths >= 2)
                            & np.isin(np.asarray(types), (NORMAL, USER_DEFINED)))
    splits = lengths[merged] - 1  # each merged piece's split points, all at once
    piece = np.repeat(merged, splits)
    cut = starts[piece] + 1 + np.arange(int(splits.sum())) - np.repeat(np.cumsum(splits) - splits, splits)
    whole_key = left_key = right_key = np.uint64(0)
    for p in _HASH_PRIMES:
        base = 2 + secrets.randbelow(p - 3)
        pw, inv = _powers(base, len(codes) + 1, p), _powers(pow(base, -1, p), len(codes) + 1, p)
        prefix = np.zeros(len(codes) + 1, np.uint64)
        prefix[1:] = np.cumsum(codes * pw[:len(codes)] % np.uint64(p)) % np.uint64(p)

        def span(a, b, p=p, prefix=prefix, inv=inv):  # hash of text[a:b], comparable wherever it is
            return (prefix[b] + np.uint64(p) - prefix[a]) % np.uint64(p) * inv[a] % np.uint64(p)

        whole_key = (whole_key << np.uint64(31)) | span(starts[:-1], starts[1:])
        left_key = (left_key << np.uint64(31)) | span(starts[piece], cut)
        right_key = (right_key << np.uint64(31)) | span(cut, starts[piece + 1])
    own = np.flatnonzero(first == np.arange(len(tokens)))
    order = own[np.argsort(whole_key[own], kind="stable")]
    sorted_keys = whole_key[order]

    def find(keys, size):  # the id of the piece of this hash and length, or -1
        at = np.minimum(np.searchsorted(sorted_keys, keys), len(order) - 1)
        hit = order[at]
        return np.where((sorted_keys[at] == keys) & (lengths[hit] == size), hit, -1)

    left = find(left_key, cut - starts[piece])
    right = find(right_key, starts[piece + 1] - cut)
    ok = (left >= 0) & (right >= 0)
    piece, left, right = piece[ok], left[ok], right[ok]
    rank = np.lexsort((right, left, piece, -np.asarray(scores, np.float64)[piece]))
    # a hash match is a candidate: only the halves that spell the piece are a merge
    return [(tokens[a], tokens[b]) for w, a, b in zip(piece[rank].tolist(), left[rank].tolist(), right[rank].tolist())
            if tokens[a] + tokens[b] == tokens[w]]


def _spm_tokenizer(md, vocab: Vocab):
    """SentencePiece BPE as Hugging Face's converter writes it: merges ranked by the merged
    piece's score (llama.cpp's SPM tokenizer merges the best-scoring pair first), byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    n = len(vocab.tokens)
    scores = meta_list(md, "tokenizer.ggml.scores", "float", n, [-float(i) for i in range(n)])
    ids = {}
    for i, t in enumerate(vocab.tokens):
        ids.setdefault(t, i)
    unk = vocab.tokens[vocab.unk] if vocab.unk is not None else None
    bpe = models.BPE(vocab=ids, merges=spm_merges(vocab.tokens, vocab.types, scores), unk_token=unk,
                     byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    prefix = meta(md, "tokenizer.ggml.add_space_prefix", "bool", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def build_tokenizer(md: dict, vocab: Vocab):
    """A `tokenizers.Tokenizer` equal to llama.cpp's for this vocabulary."""
    from tokenizers import AddedToken, processors

    if vocab.model == "gpt2":
        tok = _bpe_tokenizer(md, vocab)
    elif vocab.model == "llama":
        tok = _spm_tokenizer(md, vocab)
    else:
        raise GGUFError(f"tokenizer.ggml.model {shown(vocab.model)} is not supported (gpt2: byte-level BPE, "
                        "llama: SentencePiece)")
    special = [i for i, ty in enumerate(vocab.types) if ty in (CONTROL, UNKNOWN)]
    user = [i for i, ty in enumerate(vocab.types) if ty == USER_DEFINED]
    tok.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False) for i in special])
    tok.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False) for i in user])
    first = [vocab.tokens[vocab.bos]] if vocab.add_bos and vocab.bos is not None else []
    last = [vocab.tokens[vocab.eos]] if vocab.add_eos and vocab.eos is not None else []
    if first or last:
        pairs = [(t, vocab.tokens.index(t)) for t in dict.fromkeys(first + last)]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(first + ["$A"] + last), pair=" ".join(first + ["$A"] + last + first + ["$B:1"] + last),
            special_tokens=pairs)
    return tok


def check_chat_template(md: dict) -> None:
    """GGUFError for a chat template that is not text (every chat with it would fail)."""
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        value = f" {template!r}" if isinstance(template, (int, float)) else ""
        raise GGUFError(f"metadata tokenizer.chat_template must be a string (a Jinja template), got "
                        f"{type(template).__name__}{value}")


def write_tokenizer(md, dst: Path, max_len: int, vocab: Vocab | None = None, tokenizer=None) -> Vocab:
    """The tokenizer files (from `vocab` and `tokenizer` where they are built already)."""
    vocab = vocab or vocab_of(md)
    (tokenizer or build_tokenizer(md, vocab)).save(str(dst / "tokenizer.json"))
    name = lambda i: vocab.tokens[i] if i is not None else None  # noqa: E731
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(vocab.bos), "eos_token": name(vocab.eos),
           "unk_token": name(vocab.unk), "pad_token": name(vocab.pad if vocab.pad is not None else vocab.eos),
           "add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos, "clean_up_tokenization_spaces": False,
           "model_max_length": max_len}
    if (template := meta(md, "tokenizer.chat_template", "str", None)) is not None:
        cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    specials = {k: v for k, v in (("bos_token", cfg["bos_token"]), ("eos_token", cfg["eos_token"]),
                                   ("unk_token", cfg["unk_token"]), ("pad_token", cfg["pad_token"])) if v}
    (dst / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
    gen = {"eos_token_id": vocab.eog if len(vocab.eog) > 1 else (vocab.eog[0] if vocab.eog else None)}
    if vocab.bos is not None:
        gen["bos_token_id"] = vocab.bos
    (dst / "generation_config.json").write_text(json.dumps(gen) + "\n")
    return vocab


# -- import ----------------------------------------------------------------------------------

def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (HF's rotate-halves -> interleaved pairs)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass
class _Tensor:
    gguf_name: str
    name: str  # mlx-lm's
    type_name: str
    shape: tuple[int, ...]  # numpy order (rows first)
    data: object  # the reader's raw array
    how: str = ""  # "quantized" (MLX's layout) | "float" (as it is) | "dequantized" (to float32)
    shift: bool = False  # a Gemma norm stored as 1 + w: written as float32 w


def _plan(gf, arch: Arch) -> list[_Tensor]:
    """What becomes of each tensor (GGUFError, before any work, for one Orchard cannot take)."""
    out = []
    for t in gf.tensors:
        if t.name in _CONSUMED:
            continue
        tt = _Tensor(t.name, hf_name(t.name, arch), t.type_name, t.shape, t.data,
                     shift=arch.norm_plus_one and t.name.endswith("norm.weight"))
        if tt.type_name in PASS_THROUGH:
            tt.how = "float"
        elif tt.type_name in EXACT and len(t.shape) == 2 and t.shape[1] % GROUP == 0 and t.name.endswith(".weight"):
            tt.how = "quantized"
        elif _can_dequantize(tt.type_name):
            tt.how = "dequantized"
        else:
            raise GGUFError(f"tensor {t.name}: type {tt.type_name} is one the gguf package cannot dequantize, "
                            "and MLX has no layout for it")
        out.append(tt)
    return out


def _can_dequantize(type_name: str) -> bool:
    """Whether the gguf package dequantizes this type (tried on one zero block)."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def _outputs(t: _Tensor) -> list[_Planned]:
    rows, cols = t.shape[0], t.shape[-1]
    if t.how == "quantized":
        spec = EXACT[t.type_name]
        base = t.name[: -len(".weight")]
        out = [_Planned(base + ".weight", "U32", (rows, cols * spec.bits // 32)),
               _Planned(base + ".scales", "U8" if spec.mode == "mxfp4" else "F32", (rows, cols // GROUP))]
        if spec.mode == "affine":
            out.append(_Planned(base + ".biases", "F32", (rows, cols // GROUP)))
        return out
    dtype = PASS_THROUGH[t.type_name] if t.how == "float" and not t.shift else "F32"
    return [_Planned(t.name, dtype, t.shape)]


def _convert(t: _Tensor, arch: Arch, cfg: dict):
    """Yield (name, bytes-like) for each planned output of `t`."""
    data = np.asarray(t.data)
    if arch.permuted_qk and t.gguf_name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
        heads = cfg["num_attention_heads"] if ".attn_q." in t.gguf_name else cfg["num_key_value_heads"]
        data = unpermute(data, heads)
    if t.how == "quantized":
        parts = to_mlx_quantized(t.type_name, data.reshape(t.shape[0], -1), t.shape[-1])
        for p in _outputs(t):
            yield p.name, parts[p.name.rpartition(".")[2]]
        return
    (p,) = _outputs(t)
    if p.dtype == "BF16":
        yield p.name, np.ascontiguousarray(data).view(np.uint16).reshape(t.shape)
    elif p.dtype == "F16":
        yield p.name, np.ascontiguousarray(data).view(np.float16).reshape(t.shape)
    else:
        w = dequantize(t.type_name, data, t.shape)
        if t.shift:
            w = w - np.float32(1.0)
        yield p.name, w.astype(np.float32, copy=False)


def quantization_config(plan: list[_Tensor]) -> dict:
    """config.json's quantization entries for the tensors that stay quantized (none: {})."""
    quantized = {t.name[: -len(".weight")]: {"group_size": GROUP, "bits": EXACT[t.type_name].bits,
                                              **({"mode": "mxfp4"} if EXACT[t.type_name].mode == "mxfp4" else {})}
                 for t in plan if t.how == "quantized"}
    if not quantized:
        return {}
    first = next(iter(quantized.values()))
    entry = {"group_size": GROUP, "bits": first["bits"], **quantized}
    return {"quantization": entry, "quantization_config": entry}


def imported_tensors(src: str | Path) -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """What `import_gguf` makes of `src`, from its metadata and tensor table alone (no
    tensor's data is read): config.json's model fields with its quantization entries, and
    each safetensors tensor it writes as (name, safetensors dtype, shape). GGUFError for a
    file it would refuse."""
    gf = read_gguf(src)
    tensors = {t.name: (t.shape, t.type_name) for t in gf.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{Path(src).name}: no token_embd.weight tensor")
    cfg = model_config(gf.metadata, tensors)
    plan = _plan(gf, ARCHS[gf.metadata["general.architecture"]])
    cfg.update(quantization_config(plan))
    return cfg, [(p.name, p.dtype, tuple(p.shape)) for t in plan for p in _outputs(t)]


def expected_shapes(cfg: dict, arch: Arch, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """The shape (rows first) the metadata implies for each kind of weight (a bias: its rows)."""
    h, ff, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    q, k = heads * hd, cfg["num_key_value_heads"] * hd
    rope = int(hd * cfg.get("partial_rotary_factor", 1.0)) // 2
    return {"token_embd": (n_vocab, h), "output": (n_vocab, h), "output_norm": (h,), "attn_norm": (h,),
            "attn_q": (q, h), "attn_k": (k, h), "attn_v": (k, h), "attn_output": (h, q), "attn_qkv": (q + 2 * k, h),
            "attn_q_norm": (hd,), "attn_k_norm": (hd,), "ffn_gate": (ff, h), "ffn_up": ((1 + arch.fused_up) * ff, h),
            "ffn_down": (h, ff), "ffn_norm": (h,), "post_attention_norm": (h,), "post_ffw_norm": (h,),
            "rope_freqs": (rope,), "rope_factors_long": (rope,), "rope_factors_short": (rope,)}


def check_tensors(name: str, cfg: dict, arch: Arch, tensors: dict[str, tuple[tuple[int, ...], str]],
                  n_vocab: int) -> None:
    """The tensors against the metadata: a layer's tensors for every layer below block_count and
    none beyond, the same kinds in every layer, each shape the one the metadata implies."""
    layers = cfg["num_hidden_layers"]
    per_layer: dict[int, set[str]] = {}
    for t in tensors:
        if m := re.fullmatch(r"blk\.(\d+)\.(.+)", t):
            per_layer.setdefault(int(m.group(1)), set()).add(m.group(2))
    beyond = sorted(i for i in per_layer if i >= layers)
    if beyond or len(per_layer) < layers:
        have = f"layers {min(per_layer)}-{max(per_layer)}" if per_layer else "no layers"
        raise GGUFError(f"{name}.block_count {layers}: the file has tensors for {len(per_layer)} layers ({have})")
    for i, kinds in per_layer.items():
        if kinds != per_layer[0]:
            odd = sorted(kinds ^ per_layer[0])[0]
            raise GGUFError(f"blk.{i} and blk.0 differ: {odd} is in one and not the other")
    shapes = expected_shapes(cfg, arch, n_vocab)
    for t, (shape, _) in tensors.items():
        stem, _, kind = t.rpartition(".")
        want = shapes.get(stem.rpartition(".")[2] if stem.startswith("blk.") else stem)
        if want is not None and kind == "bias":
            want = want[:1]
        if want is not None and shape != want:
            raise GGUFError(f"tensor {t}: shape {shape} (rows first), where the metadata implies {want} "
                            f"(embedding_length {cfg['hidden_size']}, {n_vocab} tokens, "
                            f"feed_forward_length {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads)")


# bytes held while a tensor is converted, per byte it writes: the gguf package's dequantizing
# intermediates, the split blocks of an exact type, a float32 copy of a shifted norm
CONVERT_PEAK = {"dequantized": 2.5, "quantized": 4.0, "float": 2.0}


def check_room(plan: list[_Tensor], dst: Path, extra: int) -> None:
    """Refuse, with the numbers, an import that needs more disk under `dst` (every tensor
    written, and `extra`) or more memory (the costliest tensor converted) than is free."""
    sizes = [sum(_ST_SIZE[p.dtype] * math.prod(p.shape) for p in _outputs(t)) for t in plan]
    peaks = [int(CONVERT_PEAK[t.how] * n) for t, n in zip(plan, sizes)]
    disk, memory = sum(sizes) + extra, max(peaks, default=0)
    where = next(p for p in (dst, *dst.absolute().parents) if p.exists())
    free_disk = shutil.disk_usage(where).free
    if disk > free_disk:
        raise GGUFError(f"the import writes {_size(disk)} and {where} has {_size(free_disk)} free")
    free_memory = memory_free()
    if free_memory and memory > free_memory:
        big = plan[peaks.index(memory)]
        raise GGUFError(f"converting tensor {big.gguf_name} ({big.type_name}, {'x'.join(map(str, big.shape))}) "
                        f"needs {_size(memory)} of memory; {_size(free_memory)} is free")


def memory_free() -> int:
    """Bytes this process can still allocate: the machine's available memory, within this
    process's address-space limit where one is set (0: unknown)."""
    import resource

    from cluster.platform import available_memory

    free = available_memory()
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            used = 0
        free = min(free or limit, max(limit - used, 0))
    return free


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def import_gguf(src: str | Path, dst: str | Path, replace: bool = True) -> Path:
    """Write the GGUF file `src` as an mlx-lm model directory `dst` (see the module's contract)
    as cluster/owned_dir.py writes one: `dst` absent, empty or an earlier import (TargetError
    otherwise, before any work), the new one renamed into place; an earlier import is
    replaced, or with `replace=False` kept (another process imported the same file first)."""
    src, dst = Path(src), Path(dst)
    owned_dir.check_target(dst, IMPORT_KIND)
    if src.resolve().is_relative_to(dst.resolve()):
        raise GGUFError(f"{src} is inside {dst}, which the import would replace: write the import elsewhere")
    gf = read_gguf(src)
    md = gf.metadata
    check_chat_template(md)
    tensors = {t.name: (t.shape, t.type_name) for t in gf.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{src}: no token_embd.weight tensor")
    cfg = model_config(md, tensors)
    arch = ARCHS[md["general.architecture"]]
    vocab = vocab_of(md)
    check_tensors(md["general.architecture"], cfg, arch, tensors, len(vocab.tokens))
    meta(md, "general.name", "str", None)
    tokenizer = build_tokenizer(md, vocab)
    data = {t.name: t.data for t in gf.tensors}
    if "rope_freqs.weight" in tensors:
        factors = dequantize(tensors["rope_freqs.weight"][1], np.asarray(data["rope_freqs.weight"]), (-1,))
        if not np.all(factors == 1.0):
            cfg["rope_scaling"] = llama3_rope_scaling(factors.astype(np.float64), cfg["rope_theta"],
                                               cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if "rope_factors_long.weight" in tensors:  # Phi-3's LongRoPE
        factors = {name: dequantize(tensors[name][1], np.asarray(data[name]), (-1,)) for name in
                   ("rope_factors_long.weight", "rope_factors_short.weight") if name in tensors}
        if not all(np.isfinite(f).all() and (f > 0).all() for f in factors.values()):
            raise GGUFError("rope_factors_long / rope_factors_short: LongRoPE factors must be finite and positive")
        factors = {name: f.tolist() for name, f in factors.items()}
        cfg["rope_scaling"] = {"type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                               "short_factor": factors.get("rope_factors_short.weight",
                                                           factors["rope_factors_long.weight"])}
    plan = _plan(gf, arch)
    cfg.update(quantization_config(plan))
    cfg["torch_dtype"] = "float32"
    summary: dict[str, dict] = {}
    for t in plan:
        s = summary.setdefault(t.type_name, {"tensors": 0, "parameters": 0, "as": t.how})
        if t.how not in s["as"].split(" and "):  # (a vector of an exact type is dequantized)
            s["as"] += " and " + t.how
        s["tensors"] += 1
        s["parameters"] += int(np.prod(t.shape))
    for type_name, s in summary.items():
        if "dequantized" in s["as"]:
            log.warning("%s: %d %s tensors (%d parameters) dequantized to float32: MLX holds no %s layout exactly",
                        src.name, s["tensors"], type_name, s["parameters"], type_name)
    check_room(plan, dst, 3 * gf.data_start)  # (the header holds the vocabulary: the tokenizer files)

    def fill(tmp: Path) -> None:
        by_name = {t.name: t for t in plan}
        write_shards(tmp, [(t.name, p) for t in plan for p in _outputs(t)],
                     lambda name: _convert(by_name[name], arch, cfg))
        write_tokenizer(md, tmp, cfg["max_position_embeddings"], vocab, tokenizer)
        eos = vocab.eog if len(vocab.eog) > 1 else (vocab.eog[0] if vocab.eog else None)
        cfg.update(eos_token_id=eos, bos_token_id=vocab.bos, pad_token_id=vocab.pad)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "gguf_import.json").write_text(json.dumps({
            "source": str(src.resolve()), "size": src.stat().st_size, "architecture": md["general.architecture"],
            "name": md.get("general.name"), "importer_version": IMPORTER_VERSION, "types": summary}, indent=2) + "\n")

    dst = owned_dir.write_dir(dst, IMPORT_KIND, str(src.resolve()), fill, replace=replace)
    log.info("imported %s (%s, %s) into %s: %s", src.name, md["general.architecture"], md.get("general.name", ""),
             dst, ", ".join(f"{k} {v['as']}" for k, v in summary.items()))
    return dst


# -- finding the file ------------------------------------------------------------------------

def ollama_models_dir() -> Path:
    """Where Ollama keeps models: $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


# Ollama's own name rules (types/model/name.go): each part starts with a letter, digit or _
# and goes on in letters, digits, _ - and . (no . in a namespace; a host may carry :PORT),
# 80 characters at most (a host 350). Digests are sha256 (server/images.go's blob paths).
_OLLAMA_PARTS = {"host": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,349}"),
                 "namespace": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,79}"),
                 "model": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}"),
                 "tag": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")}
OLLAMA_DIGEST = re.compile(r"sha256:[0-9a-fA-F]{64}")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
MAX_MANIFEST_BYTES = 1 << 20  # Ollama's are a few hundred bytes


def ollama_name(name: str) -> tuple[str, str, str, str]:
    """`[HOST/][NAMESPACE/]MODEL[:TAG]` -> (host, namespace, model, tag), with Ollama's
    defaults (registry.ollama.ai, library, latest); GGUFError naming a part that is not a name."""
    model, colon, tag = name.rpartition(":")
    if not colon or "/" in tag:  # no tag (the colon, if any, is a host's :PORT)
        model, tag = name, "latest"
    parts = model.split("/")
    if len(parts) > 3:
        raise GGUFError(f"{len(parts)} parts separated by / is not an Ollama name ([HOST/][NAMESPACE/]MODEL[:TAG])")
    host, namespace, model = ["registry.ollama.ai", "library"][: 3 - len(parts)] + parts
    for part, value in (("host", host), ("namespace", namespace), ("model", model), ("tag", tag)):
        if not _OLLAMA_PARTS[part].fullmatch(value):
            limit = 350 if part == "host" else 80
            chars = "letters, digits, _ -" + ("" if part == "namespace" else " .") + (" :" if part == "host" else "")
            raise GGUFError(f"the {part} {shown(value)} is not an Ollama name (1-{limit} {chars}, "
                            "the first a letter, digit or _)")
    return host, namespace, model, tag


def ollama_model_digest(manifest: Path) -> str:
    """The digest of the model layer `manifest` names; GGUFError naming the field and value
    for a manifest that is not Ollama's (not JSON, wrong types, a digest that is not sha256)."""
    try:
        size = manifest.stat().st_size
        text = manifest.read_bytes() if size <= MAX_MANIFEST_BYTES else b""
    except OSError as e:
        raise GGUFError(f"the manifest {manifest} cannot be read ({e})") from e
    if size > MAX_MANIFEST_BYTES:
        raise GGUFError(f"the manifest {manifest} is {size} bytes, over the {MAX_MANIFEST_BYTES} a manifest may be")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise GGUFError(f"the manifest {manifest} is not JSON ({str(e)[:200]})") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list):
        what = f"its layers are {shown(layers)}" if isinstance(doc, dict) else f"it is {type(doc).__name__}"
        raise GGUFError(f"the manifest {manifest} is not an Ollama manifest: layers must be a list ({what})")
    model = None
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise GGUFError(f"the manifest {manifest}: layers[{i}] must be an object, got {shown(layer)}")
        media, digest = layer.get("mediaType"), layer.get("digest")
        if not isinstance(media, str):
            raise GGUFError(f"the manifest {manifest}: layers[{i}].mediaType must be a string, got {shown(media)}")
        if not isinstance(digest, str) or not OLLAMA_DIGEST.fullmatch(digest):
            raise GGUFError(f"the manifest {manifest}: layers[{i}].digest must be sha256:<64 hex digits>, got "
                            f"{shown(digest)}")
        if media == OLLAMA_MODEL_LAYER and model is None:
            model = digest
    if model is None:
        raise GGUFError(f"the manifest {manifest} names no model layer (mediaType {OLLAMA_MODEL_LAYER})")
    return model


def ollama_blob(name: str) -> Path:
    """`NAME[:TAG]` (TAG latest by default; NAME may be `user/model` or `host/user/model`) ->
    the GGUF blob its manifest names as the model layer, in the models directory's blobs/."""
    host, namespace, model, tag = ollama_name(name)
    root = ollama_models_dir()
    manifest = root / "manifests" / host / namespace / model / tag
    if not manifest.is_file():
        untagged = name[: -len(tag) - 1] if name.endswith(":" + tag) else name
        raise GGUFError(f"no manifest at {manifest} (is it pulled? `ollama pull {untagged}:{tag}`)")
    digest = ollama_model_digest(manifest)
    blob = root / "blobs" / digest.replace(":", "-")  # a checked digest: a name inside blobs/
    if not blob.is_file():
        raise GGUFError(f"the model layer {blob} is missing")
    return blob


def find_gguf(spec: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file `spec` names, or None when `spec` is not about one (an mlx-lm directory)."""
    if spec.startswith("ollama:"):
        return ollama_blob(spec[len("ollama:"):])
    path = Path(spec).expanduser()
    if path.is_file():
        return path if is_gguf(path) else None
    if path.is_dir():
        if gguf_file:
            chosen = path / gguf_file
            if not chosen.is_file():
                raise GGUFError(f"--gguf-file {gguf_file}: not found in {path}")
            return chosen
        if (path / "config.json").exists():
            return None
        found = sorted(path.glob("*.gguf"))
        found = [f for f in found if not f.name.startswith("mmproj")]
        if len(found) > 1:
            raise GGUFError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): "
                            "pick one with --gguf-file")
        return found[0] if found else None
    if not path.exists() and is_hub_repo_id(spec):
        return hub_gguf(spec, gguf_file)
    return None


def is_hub_repo_id(spec: str) -> bool:
    """Whether `spec` can only be a hub repo: OWNER/NAME as the hub spells one (no `..`, no
    leading `.`, `/` or `~`), whose OWNER is no directory here (then it is a path)."""
    return (re.fullmatch(r"\w[\w.-]*/[\w.-]*\w", spec) is not None and ".." not in spec and "--" not in spec
            and len(spec) <= 96 and not Path(spec.partition("/")[0]).is_dir())


def hub_gguf(repo: str, gguf_file: str | None) -> Path:
    """A GGUF file of a Hugging Face hub repo, downloaded once into the hub's cache. The repo
    is looked up with one request first (the hub's client retries for seconds), so a missing
    repo or an unreachable hub is said at once."""
    try:
        from huggingface_hub import HfApi, hf_hub_download
    except ImportError as e:  # pragma: no cover
        raise GGUFError(f"{repo}: downloading from the hub needs huggingface_hub") from e
    if gguf_file is not None:
        try:
            return Path(hf_hub_download(repo, gguf_file, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the hub's cache
            pass
    try:
        info = HfApi().model_info(repo, timeout=10)
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: one message
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise GGUFError(f"no such file or directory, and no hub repo of that name could be found "
                        f"({type(e).__name__}: {reason})") from None
    files = [f.rfilename for f in info.siblings or () if f.rfilename.endswith(".gguf") and "mmproj" not in f.rfilename]
    if gguf_file is None:
        if not files:
            raise GGUFError(f"the hub repo {repo} holds no GGUF file; an mlx-lm model is loaded from a local "
                            f"directory (download it first: `hf download {repo} --local-dir DIR`)")
        if len(files) > 1:
            raise GGUFError(f"{repo} holds {len(files)} GGUF files ({', '.join(files[:8])}): pick one with --gguf-file")
        gguf_file = files[0]
    try:
        return Path(hf_hub_download(repo, gguf_file))
    except Exception as e:  # noqa: BLE001
        raise GGUFError(f"{repo}/{gguf_file}: download failed ({e})") from e


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{IMPORTER_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def cached_import(path: Path, cache: Path, name: str | None = None) -> Path:
    """`path` imported once into `cache`/KEY/NAME (KEY: the file's identity; NAME, which the
    worker serves the model as: `name`, else the file's name less .gguf)."""
    name = name or (path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name)
    dst = cache / cache_key(path) / (re.sub(r"[^\w.:+-]", "_", name)[:80] or "model")
    if (dst / "config.json").exists():
        return dst
    log.info("importing %s into %s (once)", path, dst)
    return import_gguf(path, dst, replace=False)
