"""Test double: write an mlx-lm model directory as llama.cpp's converter (convert_hf_to_gguf.py)
would, with the gguf package's writer: its tensor names, the Q/K row permutation of the
llama family, Gemma's 1 + w norms, fused Phi-3 weights as they are, the byte-level BPE
vocabulary with token types, and chosen tensors quantized with the gguf package's own
quantizer (or given raw blocks). Stated here independently of cluster/gguf.py's reading."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "phi3": "phi3", "mistral": "llama"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


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

    weights = mx.load(str(model_dir / "model.safetensors"))
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
