"""A model with a layer the paged engine cannot serve exactly is refused when it loads,
with a message that names the model type and the feature: never served wrong. The
sliding-window families it serves get their windows, layer by layer.

Tiny models of real mlx-lm architectures, built in memory from their own ModelArgs."""

from __future__ import annotations

import importlib

import cluster.worker  # noqa: F401  (OpenBLAS before MLX)
import pytest

from cluster.modelgen import create_model
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.model_runner import UnsupportedModel, check_served, layer_windows

BASE = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=100, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512)
REFUSED = {
    # a sliding-window family not yet checked against mlx-lm (olmo3: 3 sliding layers of 4)
    "olmo3": (dict(sliding_window=8), "layers 0-2 use RotatingKVCache (sliding-window attention)"),
    # attention sinks (and sliding windows)
    "gpt_oss": (dict(sliding_window=8, num_local_experts=2, num_experts_per_tok=1,
                     layer_types=["sliding_attention", "full_attention"] * 2),
                "its attention has sinks"),
    # recurrent layers beside full attention
    "qwen3_next": (dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=0,
                        num_experts_per_tok=0, decoder_sparse_step=1, shared_expert_intermediate_size=0,
                        mlp_only_layers=[], moe_intermediate_size=0, norm_topk_prob=True, partial_rotary_factor=0.5),
                   "layers 0, 2 use ArraysCache (a recurrent state"),
    # multi-head latent attention
    "deepseek_v3": (dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                         n_routed_experts=None, moe_intermediate_size=64, n_shared_experts=None,
                         first_k_dense_replace=4),
                    "multi-head latent attention (MLA, kv_lora_rank)"),
}


def build(model_type: str, extra: dict):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model(module.ModelArgs.from_dict({"model_type": model_type, **BASE, **extra}))


SERVED = {  # the sliding-window families served exactly (tests/test_engine.py checks them against mlx-lm)
    "gemma3_text": (dict(sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16), [8, -1, 8, -1]),
    "ministral3": (dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                        rope_parameters={"rope_theta": 10000.0, "llama_4_scaling_beta": 0.0,
                                         "original_max_position_embeddings": 512}), [8, -1, 8, -1]),
}


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_sliding_window_families_are_served_with_their_windows(model_type):
    extra, windows = SERVED[model_type]
    assert layer_windows(build(model_type, extra)) == windows


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_model_with_attention_the_engine_does_not_honour_is_refused(model_type):
    extra, words = REFUSED[model_type]
    try:
        model = build(model_type, extra)
    except Exception as e:  # this mlx-lm's version of the family takes other arguments
        pytest.fail(f"cannot build a tiny {model_type}: {type(e).__name__}: {e}")
    with pytest.raises(UnsupportedModel) as e:
        check_served(model)
    assert f"model type {model_type!r} is not served" in str(e.value) and words in str(e.value)


def test_an_unknown_cache_kind_is_refused_by_name():
    """A layer needing a cache the engine has never heard of: refused, naming it."""
    model = build("qwen3", dict(tie_word_embeddings=True))
    check_served(model)  # a plain qwen3 is served

    class TelepathicCache:
        pass

    model.make_cache = lambda: [TelepathicCache() if i == 3 else __import__("mlx_lm").models.cache.KVCache()
                                for i in range(4)]
    with pytest.raises(UnsupportedModel, match=r"layers 3 use TelepathicCache \(an attention the engine does not know\)"):
        check_served(model)
    model.make_cache = lambda: [__import__("mlx_lm").models.cache.KVCache() for _ in range(3)]
    with pytest.raises(UnsupportedModel, match="4 layers but 3 caches"):
        check_served(model)


def test_the_refusal_comes_when_the_model_loads(tmp_path, monkeypatch):
    """Through the loading path a real model directory takes: Engine.from_pretrained."""
    path = create_model(tmp_path / "m", "qwen3", "tiny", seed=3)
    from mlx_lm.models import qwen3

    monkeypatch.setattr(qwen3.Model, "make_cache", lambda self: [object() for _ in self.layers], raising=False)
    with pytest.raises(UnsupportedModel, match="model type 'qwen3' is not served"):
        Engine.from_pretrained(path, EngineConfig(num_kv_blocks=16))
