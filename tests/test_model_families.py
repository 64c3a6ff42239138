"""Every family `orchard model create` knows builds a tiny model that mlx-lm loads, with a
chat template in the family's style; and load/model_coverage.py's per-family check gives
the row it should (the engine-vs-mlx-lm parity itself is tests/test_engine.py's)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from mlx_lm.utils import load

from cluster.formats.hermes import CHATML
from cluster.formats.registry import CHAT_FORMAT, FORMATS, GENERATION_PROMPT
from cluster.modelgen import ARCHS, create_model, num_parameters

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
]
WITH_A_TOOL_CALL = CONVERSATION + [
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "sunny"},
]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_builds_loads_and_chats_in_its_own_format(tmp_path, arch):
    path = create_model(tmp_path / arch, arch, "tiny", seed=0)
    config = json.loads((path / "config.json").read_text())
    assert num_parameters(path) < 2_000_000
    model, tok = load(str(path))
    chat = CHAT_FORMAT.get(arch, CHATML)
    name = next(n for n, f in FORMATS.items() if f is chat)
    assert len(tok.get_vocab()) == config["vocab_size"] == 512

    # every token the format uses is one token: control tokens special, markers not
    for t in chat.control + chat.markers:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert tok.decode(tok.encode(chat.control[-1], add_special_tokens=False), skip_special_tokens=True) == ""
    for t in chat.markers:
        assert tok.decode(tok.encode(t, add_special_tokens=False), skip_special_tokens=True) == t
    # the end-of-turn token ends generation
    assert tok.eos_token == chat.eos
    assert set(tok.eos_token_ids) == {tok.convert_tokens_to_ids(t) for t in chat.eos_tokens}

    prompt = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(GENERATION_PROMPT[name]) and "Be brief." in prompt and "Weather in Paris?" in prompt
    if chat.bos:
        assert prompt.startswith(chat.bos)
    ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert tok.decode(ids) == prompt  # the markers are single tokens that decode to themselves
    if chat.tools:
        prompt = tok.apply_chat_template(WITH_A_TOOL_CALL, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert "get_weather" in prompt and "The weather in a city" in prompt and "sunny" in prompt
        call = prompt.index(chat.call_marker)
        assert "get_weather" in prompt[call:] and "Paris" in prompt[call:]


def _coverage():
    spec = importlib.util.spec_from_file_location(
        "model_coverage", Path(__file__).resolve().parents[1] / "load" / "model_coverage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family, want", [
    ("qwen3", "exact"),
    ("lfm2", "exact"),  # a hybrid: short convolutions on state slots beside attention
    ("falcon_h1", "exact"),  # a Mamba-2 mixer and an attention in every layer: a state slot and a K/V pool
])
def test_model_coverage_row(tmp_path, family, want):
    coverage = _coverage()
    row = coverage.check(create_model(tmp_path / family, family, "tiny", seed=0), family, coverage.KIND[family])
    assert row.result.startswith(want) and not row.failed
    assert (row.family, row.kind) == (family, {"qwen3": "dense", "lfm2": "hybrid", "falcon_h1": "hybrid"}[family])
