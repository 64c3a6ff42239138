"""Test double: write an mlx-lm model directory as llama.cpp's converter (convert_hf_to_gguf.py)
would, with the gguf package's writer: its tensor names, the Q/K row permutation of the
llama family, Gemma's 1 + w norms, fused Phi-3 weights as they are, the byte-level BPE
vocabulary with token types, and chosen tensors quantized with the gguf package's own
quantizer (or given raw blocks). Stated here independently of cluster/gguf.py's reading."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "phi3": "phi3", "mistral": "llama"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def weights_of(model_dir: Path) -> dict:
    """Every tensor of an mlx-lm model directory (one model.safetensors, or shards)."""
    import mlx.core as mx

    return {k: v for f in sorted(Path(model_dir).glob("model*.safetensors")) for k, v in mx.load(str(f)).items()}


def gguf_name(name: str, arch: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, kind = name.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{kind}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    part = m.group(2)
    if part == "post_attention_layernorm":
        gg = "post_attention_norm" if arch.startswith("gemma") else "ffn_norm"
    else:
        gg = _LAYER[part]
    return f"blk.{m.group(1)}.{gg}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-halves rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export(model_dir: Path, out: Path, quantize: dict[str, str] | None = None, raw: dict[str, tuple] | None = None,
           pre: str = "gpt-2") -> Path:
    """`quantize`: regex over GGUF tensor names -> GGML type name (the gguf package quantizes);
    `raw`: GGUF tensor name -> (type name, blocks uint8) written as given."""
    import gguf
    import mlx.core as mx

    cfg = json.loads((model_dir / "config.json").read_text())
    mt = cfg["model_type"]
    arch = GGUF_ARCH[mt]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    p = arch + "."
    w.add_uint32(p + "context_length", cfg["max_position_embeddings"])
    w.add_uint32(p + "embedding_length", cfg["hidden_size"])
    w.add_uint32(p + "block_count", cfg["num_hidden_layers"])
    w.add_uint32(p + "feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(p + "attention.head_count", heads)
    w.add_uint32(p + "attention.head_count_kv", kv)
    w.add_uint32(p + "attention.key_length", head_dim)
    w.add_uint32(p + "attention.value_length", head_dim)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(p + "rope.freq_base", cfg.get("rope_theta", 10000.0))
    w.add_uint32(p + "rope.dimension_count", int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    if mt == "gemma2":
        w.add_float32(p + "attn_logit_softcapping", cfg["attn_logit_softcapping"])
        w.add_float32(p + "final_logit_softcapping", cfg["final_logit_softcapping"])
    if mt == "gemma3_text":
        w.add_uint32(p + "attention.sliding_window", cfg["sliding_window"])
        w.add_uint32(p + "attention.sliding_window_pattern", cfg["sliding_window_pattern"])
        w.add_float32(p + "rope.freq_base_swa", cfg.get("rope_local_base_freq", 10000.0))

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    ids = {t: i for i, t in enumerate(tokens)}
    if tcfg.get("bos_token"):
        w.add_bos_token_id(ids[tcfg["bos_token"]])
    w.add_eos_token_id(ids[tcfg["eos_token"]])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token")))
    w.add_chat_template(tcfg["chat_template"])

    weights = weights_of(model_dir)
    for name in sorted(weights):
        a = np.array(weights[name].astype(mx.float32))
        gname = gguf_name(name, mt)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            a = permute(a, heads)
        if arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            a = permute(a, kv)
        if arch in ("gemma2", "gemma3") and gname.endswith("norm.weight"):
            a = a + np.float32(1.0)
        if raw and gname in raw:
            qname, blocks = raw[gname]
            w.add_tensor(gname, blocks, raw_dtype=gguf.GGMLQuantizationType[qname])
            continue
        qname = next((q for pat, q in (quantize or {}).items() if re.fullmatch(pat, gname)), None)
        if qname and a.ndim == 2:
            qt = gguf.GGMLQuantizationType[qname]
            w.add_tensor(gname, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# -- raw files: any layout, for malformed-file tests and the model-file fuzzer -------------------

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
           BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


def gguf_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8", "surrogateescape") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype: int, value) -> bytes:
    """A value's bytes (after its type); an array's value is (item type, items)."""
    if vtype == STRING:
        return gguf_string(value)
    if vtype == ARRAY:
        itype, items = value
        return struct.pack("<IQ", itype, len(items)) + b"".join(gguf_value(itype, v) for v in items)
    return struct.pack(_SCALAR[vtype], value)


def nested_array(depth: int) -> bytes:
    """An array value nested `depth` deep (the innermost an empty uint8 array)."""
    return struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", UINT8, 0)


@dataclass
class RawGGUF:
    """A GGUF file as its parts, written back as they are (counts, offsets, lengths unchecked)."""

    kvs: list[list]  # [key, value type, value bytes]
    tensors: list[list]  # [name, dims (GGUF order, ne[0] first), ggml type, offset]
    data: bytes  # the data section
    version: int = 3
    alignment: int = 32
    tensor_count: int | None = None  # written instead of len(tensors)
    kv_count: int | None = None

    def kv(self, key: str) -> list:
        return next(kv for kv in self.kvs if kv[0] == key)

    def strings(self, key: str) -> list[str]:
        """A string array's items."""
        payload = self.kv(key)[2]
        (n,), pos, out = struct.unpack_from("<Q", payload, 4), 12, []
        for _ in range(n):
            (k,) = struct.unpack_from("<Q", payload, pos)
            out.append(payload[pos + 8:pos + 8 + k].decode("utf-8", "surrogateescape"))
            pos += 8 + k
        return out

    def set(self, key: str, vtype: int, value) -> RawGGUF:
        """Set `key` to a value (encoded by gguf_value), added if absent."""
        payload = gguf_value(vtype, value)
        for kv in self.kvs:
            if kv[0] == key:
                kv[1:] = [vtype, payload]
                return self
        self.kvs.append([key, vtype, payload])
        return self

    def to_bytes(self) -> bytes:
        out = [b"GGUF", struct.pack("<IQQ", self.version, len(self.tensors) if self.tensor_count is None
                                    else self.tensor_count, len(self.kvs) if self.kv_count is None else self.kv_count)]
        out += [gguf_string(k) + struct.pack("<I", t) + v for k, t, v in self.kvs]
        for name, dims, ggml_type, offset in self.tensors:
            out.append(gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset))
        head = b"".join(out)
        return head + b"\0" * (-len(head) % self.alignment) + self.data

    def write(self, path: Path) -> Path:
        path.write_bytes(self.to_bytes())
        return path


def parse_raw(blob: bytes) -> RawGGUF:
    """The parts of a well-formed GGUF file (v3, little-endian), values kept as their bytes
    (strings that are not UTF-8 kept with surrogate escapes, so that they are written back
    as they were). A malformed file raises (struct.error, IndexError, ...)."""
    pos = 24
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + n
        if pos > len(blob):
            raise IndexError(f"a string of {n} bytes past the end")
        return blob[pos - n:pos].decode("utf-8", "surrogateescape")

    def skip(vtype: int) -> None:
        nonlocal pos
        if vtype == STRING:
            string()
        elif vtype == ARRAY:
            itype, count = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            if itype in _SCALAR:
                pos += count * struct.calcsize(_SCALAR[itype])
            else:
                for _ in range(count):
                    skip(itype)
        else:
            pos += struct.calcsize(_SCALAR[vtype])

    kvs, alignment = [], 32
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        start = pos
        skip(vtype)
        kvs.append([key, vtype, blob[start:pos]])
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", blob, start)
    tensors = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = list(struct.unpack_from(f"<{n_dims}Q", blob, pos + 4))
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append([name, dims, ggml_type, offset])
    pos += -pos % alignment
    return RawGGUF(kvs, tensors, blob[pos:], version, alignment)
