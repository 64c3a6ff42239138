"""The one table of model families: `FAMILIES`, asked in order, finds a model's tool-call
format and thinking markers from its chat template and vocabulary. A family (or a format
several share) is one module of this package exporting a `FAMILY` (cluster/formats/family.py)
and one row here. Below it, the chat formats `orchard model create` writes, by model type
and by name (cluster/formats/chat.py)."""

from __future__ import annotations

from typing import Mapping

from cluster.formats import deepseek, granite, harmony, hermes, kimi, llama3, mistral, nemotron, plain, think
from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat
from cluster.formats.chat import ChatFormat
from cluster.formats.family import Family
from cluster.formats.thinking import ReasoningFormat

# first answer wins: formats a template names before mlx-lm's (hermes), Llama 3's guess from
# its vocabulary after it; Granite's plain-text thinking before the <think> tags
FAMILIES: tuple[Family, ...] = (harmony.FAMILY, mistral.FAMILY, deepseek.FAMILY, kimi.FAMILY, nemotron.FAMILY,
                                granite.FAMILY, hermes.FAMILY, llama3.FAMILY, think.FAMILY)


def call_format(chat_template: str | None, vocab: Mapping[str, int],
                mlx_lm: MlxLmCalls | None = None) -> CallFormat | None:
    """The model's call format from its chat template and vocabulary, else the one mlx-lm
    found (`mlx_lm`: its tool_call_start, tool_call_end, parse_tool_call and the parser's
    module name); None: the model has no tool calling."""
    template = chat_template if isinstance(chat_template, str) else ""
    for family in FAMILIES:
        found = family.calls(template, vocab, mlx_lm) if family.calls is not None else None
        if found is not None:
            return found
    return None


def reasoning_format(chat_template: str | None, vocab: Mapping[str, int]) -> ReasoningFormat | None:
    """The model's thinking markers, from its chat template and vocabulary."""
    template = chat_template if isinstance(chat_template, str) else ""
    for family in FAMILIES:
        found = family.reasoning(template, vocab) if family.reasoning is not None else None
        if found is not None:
            return found
    return None


# -- the chat formats `orchard model create` writes -----------------------------------------------
# each model type's chat format: ChatML (hermes.CHATML) unless its family has its own
CHAT_FORMAT = {
    "llama": llama3.LLAMA3, "gemma3_text": plain.GEMMA, "gemma2": plain.GEMMA, "gemma4_text": plain.GEMMA4,
    "ministral3": mistral.MISTRAL, "mistral": mistral.MISTRAL, "mixtral": mistral.MISTRAL,
    "gpt_oss": harmony.HARMONY_CHAT, "cohere2": plain.COHERE, "deepseek_v3": deepseek.DEEPSEEK, "phi3": plain.PHI3,
    "starcoder2": plain.STARCODER2, "olmo2": plain.TULU, "olmoe": plain.TULU, "granite": granite.GRANITE_CHAT,
    "granitemoehybrid": granite.GRANITE_CHAT, "exaone4": plain.EXAONE, "glm4": plain.GLM4, "ernie4_5": plain.ERNIE,
    "nemotron_h": nemotron.NEMOTRON, "lfm2": plain.LFM2,
}

# what a test checks in a rendered prompt of each format: the generation prompt's end
GENERATION_PROMPT = {
    "CHATML": "<|im_start|>assistant\n", "NEMOTRON": "<|im_start|>assistant\n", "LFM2": "<|im_start|>assistant\n",
    "LLAMA3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "GEMMA": "<start_of_turn>model\n",
    "GEMMA4": "<|turn>model\n", "MISTRAL": "[/INST]", "PHI3": "<|assistant|>\n",
    "DEEPSEEK": deepseek.MARKERS["assistant"], "COHERE": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "HARMONY": "<|start|>assistant",
    "GRANITE": "<|start_of_role|>assistant<|end_of_role|>", "EXAONE": "[|assistant|]", "GLM4": "<|assistant|>\n",
    "TULU": "<|assistant|>\n", "ERNIE": "Assistant: ", "STARCODER2": "### Response\n",
}
FORMATS = {
    "CHATML": hermes.CHATML, "NEMOTRON": nemotron.NEMOTRON, "LFM2": plain.LFM2, "LLAMA3": llama3.LLAMA3,
    "GEMMA": plain.GEMMA, "GEMMA4": plain.GEMMA4, "MISTRAL": mistral.MISTRAL, "PHI3": plain.PHI3,
    "DEEPSEEK": deepseek.DEEPSEEK, "COHERE": plain.COHERE, "HARMONY": harmony.HARMONY_CHAT,
    "GRANITE": granite.GRANITE_CHAT, "EXAONE": plain.EXAONE, "GLM4": plain.GLM4, "TULU": plain.TULU,
    "ERNIE": plain.ERNIE, "STARCODER2": plain.STARCODER2,
}
REAL_FORMATS: dict[str, ChatFormat] = {**hermes.REAL_FORMATS, **deepseek.REAL_FORMATS, **harmony.REAL_FORMATS,
                                       **kimi.REAL_FORMATS, **plain.REAL_FORMATS, **mistral.REAL_FORMATS,
                                       **llama3.REAL_FORMATS, **granite.REAL_FORMATS, **nemotron.REAL_FORMATS}
# the mlx-lm architecture each family's models have (what `orchard model create --chat` pairs it with)
REAL_FORMAT_ARCH = {
    "qwen3": "qwen3", "qwq": "qwen2", "qwen3-coder": "qwen3_moe", "deepseek-r1": "qwen2",
    "deepseek-v3.1": "deepseek_v3",
    "gpt-oss": "gpt_oss", "kimi-k2": "deepseek_v3", "kimi-k2-thinking": "deepseek_v3", "glm-4.5": "glm4",
    "magistral": "mistral", "mistral-nemo": "mistral", "mistral-small-3.2": "mistral", "llama-3.1": "llama",
    "granite-3.3": "granite", "nemotron-nano-2": "nemotron_h",
}
