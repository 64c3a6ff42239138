"""A model with a layer the paged engine cannot serve exactly is refused when it loads,
with a message that names the model type and the feature: never served wrong. The
sliding-window families it serves get their windows, layer by layer.

Tiny models of real mlx-lm architectures, built in memory from their own ModelArgs."""

from __future__ import annotations

import importlib

import pytest

from cluster.modelgen import create_model
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.model_runner import UnsupportedModel, check_served

BASE = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=100, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512)
REFUSED = {
    # a sliding-window family not yet checked against mlx-lm
    "plamo3": (dict(sliding_window=8, sliding_window_pattern=2),
               "layers 0, 2 use RotatingKVCache (sliding-window attention)"),
    # recurrent layers in a family not checked against mlx-lm (the hybrids that are: tests/test_hybrid.py)
    "mamba2": (dict(num_heads=8, head_dim=16, state_size=16, conv_kernel=4, n_groups=1, use_bias=False,
                    use_conv_bias=True, time_step_limit=(0.0, float("inf")), time_step_rank="auto",
                    layer_norm_epsilon=1e-5, tie_word_embeddings=True),
               "layers 0-3 keep a recurrent state (ArraysCache), which the engine serves, with state slots, only for "
               "the hybrid families"),
    # a CacheList per layer (a convolution over K/V beside the attention's cache) in a family that is not a hybrid
    "baichuan_m1": (dict(sliding_window=8, sliding_window_layers=[0, 2], conv_window=2),
                    "layers 0, 2 use CacheList(ArraysCache, RotatingKVCache) (several caches per layer: the engine "
                    "serves a CacheList only as one recurrent state beside one KVCache, in the hybrid families"),
    # multi-head latent attention in a family whose MLA is not checked against mlx-lm
    "deepseek_v2": (dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                         n_routed_experts=None, moe_intermediate_size=64, n_shared_experts=None,
                         first_k_dense_replace=4, rope_scaling={"type": "yarn", "factor": 1.0,
                                                                "original_max_position_embeddings": 512}),
                    "multi-head latent attention (MLA, kv_lora_rank)"),
}


def build(model_type: str, extra: dict):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model(module.ModelArgs.from_dict({"model_type": model_type, **BASE, **extra}))


FALCON_H1 = dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                 mamba_chunk_size=16)
SERVED = {  # what each layer gets (tests/test_engine.py checks these families against mlx-lm)
    "gemma3_text": (dict(sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16),
                    dict(window=[8, -1, 8, -1])),
    "ministral3": (dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                        rope_parameters={"rope_theta": 10000.0, "llama_4_scaling_beta": 0.0,
                                         "original_max_position_embeddings": 512}), dict(window=[8, -1, 8, -1])),
    "gpt_oss": (dict(sliding_window=8, num_local_experts=2, num_experts_per_tok=1,
                     layer_types=["sliding_attention", "full_attention"] * 2),
                dict(window=[8, -1, 8, -1], sinks=[True] * 4)),
    "exaone4": (dict(sliding_window=8, sliding_window_pattern="LLLG", tie_word_embeddings=True, rope_scaling=None),
                dict(window=[8, 8, 8, -1])),
    "gemma2": (dict(attn_logit_softcapping=20.0, query_pre_attn_scalar=16), dict(softcap=[20.0] * 4)),
    # the last two layers reuse layers 0 and 1's K/V; full layers: head 32, 1 KV head
    "gemma4_text": (dict(sliding_window=8, sliding_window_pattern=2, num_kv_shared_layers=2, global_head_dim=32,
                         attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=100, layer_types=["sliding_attention", "full_attention"] * 2),
                    dict(window=[8, -1, 8, -1], kv_layer=[0, 1, 0, 1], head_dim=[16, 32, 16, 32],
                         num_kv_heads=[2, 1, 2, 1])),
    # a hybrid: gated delta nets (state slots, no K/V pool) beside full attention
    "qwen3_next": (dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=0,
                        num_experts_per_tok=0, decoder_sparse_step=1, shared_expert_intermediate_size=0,
                        mlp_only_layers=[], moe_intermediate_size=0, norm_topk_prob=True, partial_rotary_factor=0.5),
                   dict(recurrent=[True, False, True, False], owns_kv=[False, True, False, True])),
    # a Mamba-2 mixer beside the attention in every layer: a state slot and a K/V pool each
    "falcon_h1": (FALCON_H1, dict(recurrent=[True] * 4, owns_kv=[True] * 4, num_kv_heads=[2] * 4,
                                  cache_list=[("recurrent", "kv")] * 4)),
    # one pool row: latent 16 + rope key 8, one KV head
    "deepseek_v3": (dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                         n_routed_experts=None, moe_intermediate_size=64, n_shared_experts=None,
                         first_k_dense_replace=4),
                    dict(latent=[True] * 4, head_dim=[24] * 4, num_kv_heads=[1] * 4)),
}


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_each_layer_gets_what_its_attention_needs(model_type):
    extra, want = SERVED[model_type]
    specs = check_served(build(model_type, extra))
    for field, values in want.items():
        assert [getattr(s, field) for s in specs] == values, field


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
    with pytest.raises(UnsupportedModel,
                       match=r"layers 3 use TelepathicCache \(an attention the engine does not know\)"):
        check_served(model)
    model.make_cache = lambda: [__import__("mlx_lm").models.cache.KVCache() for _ in range(3)]
    with pytest.raises(UnsupportedModel, match="4 layers but 3 caches"):
        check_served(model)


@pytest.mark.parametrize("attr, meaning", [("attn_logit_softcapping", "soft-capped attention logits"),
                                           ("sinks", "attention sinks"), ("alibi_slopes", "ALiBi position biases")])
def test_a_planted_attention_feature_is_refused_by_name(attr, meaning):
    """An attention module of a family the engine serves, given a feature it does not have
    in mlx-lm's code for that family: refused, naming the layer, the feature and the type."""
    model = build("llama", dict(tie_word_embeddings=True))
    check_served(model)
    setattr(model.layers[2].self_attn, attr, 0.5)
    with pytest.raises(UnsupportedModel, match=rf"model type 'llama' is not served: layer 2's attention \(Attention\) "
                                               rf"has {meaning}"):
        check_served(model)


def test_an_attention_computed_in_the_model_s_own_code_is_refused():
    """A layer whose attention never calls mlx-lm's scaled_dot_product_attention (the paged
    kernels would never see it) and that the engine has no family call for."""
    import mlx.core as mx
    import mlx.nn as nn

    class ManualAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def __call__(self, x, mask=None, cache=None):
            k, v = cache.update_and_fetch(x, x)
            return mx.softmax(x @ k.T) @ v

    model = build("llama", dict(tie_word_embeddings=True))
    model.layers[1].self_attn = ManualAttention()
    with pytest.raises(UnsupportedModel,
                       match=r"layer 1's attention \(ManualAttention\) computes attention in its own code"):
        check_served(model)


def test_the_refusal_comes_when_the_model_loads(tmp_path, monkeypatch):
    """Through the loading path a real model directory takes: Engine.from_pretrained."""
    path = create_model(tmp_path / "m", "qwen3", "tiny", seed=3)
    from mlx_lm.models import qwen3

    monkeypatch.setattr(qwen3.Model, "make_cache", lambda self: [object() for _ in self.layers], raising=False)
    with pytest.raises(UnsupportedModel, match="model type 'qwen3' is not served"):
        Engine.from_pretrained(path, EngineConfig(num_kv_blocks=16))


def test_kv_memory_per_token_follows_each_layer():
    """MLA keeps one row of latent + rope key per token and layer (mlx-lm's cache, MLA-small);
    Gemma 4's shared layers keep nothing and its global layers their own width."""
    import mlx.core as mx

    from cluster.worker.model_runner import kv_bytes_per_block

    mla = build("deepseek_v3", SERVED["deepseek_v3"][0])
    assert kv_bytes_per_block(mla, 16, mx.float32) == 4 * (16 + 8) * 16 * 4  # layers x row x tokens x bytes
    gemma4 = build("gemma4_text", SERVED["gemma4_text"][0])
    # layer 0: 2 KV heads x 16, layer 1: 1 x 32; K and V each; layers 2 and 3 share them
    assert kv_bytes_per_block(gemma4, 16, mx.float32) == 2 * (2 * 16 + 1 * 32) * 16 * 4
    # Falcon-H1: every layer attends beside its mixer (whose state is a slot, not K/V)
    falcon = build("falcon_h1", FALCON_H1)
    assert kv_bytes_per_block(falcon, 16, mx.float32) == 4 * 2 * (2 * 16) * 16 * 4


def test_a_cache_list_the_engine_does_not_serve_is_refused_naming_its_entries():
    """In a hybrid family whose CacheList(ArraysCache, KVCache) layers are served (falcon_h1),
    any other CacheList shape is refused, and the message names its entries."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    model = build("falcon_h1", FALCON_H1)
    check_served(model)
    for entries, name in [(lambda: (ArraysCache(2), RotatingKVCache(8)), "CacheList(ArraysCache, RotatingKVCache)"),
                          (lambda: (KVCache(), KVCache()), "CacheList(KVCache, KVCache)"),
                          (lambda: (ArraysCache(2), KVCache(), KVCache()), "CacheList(ArraysCache, KVCache, KVCache)")]:
        model.make_cache = lambda: [CacheList(*entries()) if i >= 2 else CacheList(ArraysCache(2), KVCache())
                                    for i in range(4)]
        with pytest.raises(UnsupportedModel) as e:
            check_served(model)
        assert (f"model type 'falcon_h1' is not served: layers 2-3 use {name} (several caches per layer: the engine "
                "serves a CacheList only as one recurrent state beside one KVCache") in str(e.value)


def test_a_hybrid_whose_caches_do_not_match_its_layers_is_refused():
    """A recurrent module handed a K/V cache (or the reverse) would be served wrong: refused."""
    from mlx_lm.models.cache import KVCache

    model = build("qwen3_next", SERVED["qwen3_next"][0])
    check_served(model)
    model.make_cache = lambda: [KVCache() for _ in range(4)]
    with pytest.raises(UnsupportedModel, match="attention and recurrent modules do not match the caches"):
        check_served(model)
    # a layer with a mixer beside its attention, handed a recurrent cache alone
    from mlx_lm.models.cache import ArraysCache

    model = build("falcon_h1", FALCON_H1)
    model.make_cache = lambda: [ArraysCache(2) for _ in range(4)]
    with pytest.raises(UnsupportedModel, match="attention and recurrent modules do not match the caches"):
        check_served(model)
