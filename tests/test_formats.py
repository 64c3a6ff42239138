"""One home per model family (cluster/formats/): a made-up family registered as the
built-in ones are (one module, tests/made_up_family.py, and one row in the registry's
table) is found from a model's chat template, its calls are parsed and split from a
streamed output at any chunking, and through the real `openai` client a worker on a
random-weight model returns its calls, scripted and forced by its grammar."""

from __future__ import annotations

import json

import pytest

import made_up_family
from cluster.formats import registry
from cluster.formats.base import Thought
from cluster.formats.split import make_splitter
from cluster.formats.think import THINK_TAGS
from scripted_engine import ScriptedEngine, ScriptedServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                   "additionalProperties": False}}}
OSLO = '<<call>>{"name": "get_weather", "arguments": {"city": "Oslo"}}<</call>>'
BERGEN = '<<call>>{"name": "get_weather", "arguments": {"city": "Bergen"}}<</call>>'


@pytest.fixture(scope="module")
def registered():
    """The made-up family's row in the registry's table, for this module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "FAMILIES", (made_up_family.FAMILY, *registry.FAMILIES))
        yield


def test_a_registered_family_is_found_from_the_template():
    template = "{{ '<<call>>' + tool_call.name }}"
    assert registry.call_format(template, {}) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "FAMILIES", (made_up_family.FAMILY, *registry.FAMILIES))
        assert registry.call_format(template, {}) is made_up_family.CALLS
        assert registry.call_format("<tool_call>", {}) is None  # the others still answer for their own


@pytest.mark.parametrize("thinking", [None, THINK_TAGS])
def test_its_calls_split_the_same_at_any_chunking(thinking):
    """Content, thinking and calls whatever the chunking; no marker reaches the content; a
    call cut short stays text."""
    text = ("<think>hm</think>" if thinking else "") + "Checking. " + OSLO + " and " + BERGEN + " <<call>>{\"na"
    for step in (len(text), 1, 2, 3, 7):
        splitter = make_splitter(thinking, "free", made_up_family.CALLS, [WEATHER])
        segments = []
        for i in range(0, len(text), step):
            segments += splitter.segments(text[i:i + step])
        segments += splitter.rest()
        content = "".join(s for s in segments if isinstance(s, str) and not isinstance(s, Thought))
        calls = [(c.name, json.loads(c.arguments)) for c in segments if not isinstance(c, str)]
        assert content == 'Checking.  and  <<call>>{"na', step
        assert calls == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})], step
        assert splitter.num_calls == 2
        assert "".join(s for s in segments if isinstance(s, Thought)) == ("hm" if thinking else "")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-weight model whose chat template writes tool calls in the made-up format."""
    from cluster.modelgen import create_model

    path = create_model(tmp_path_factory.mktemp("made-up") / "made-up", "qwen3", "tiny", seed=0)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<tool_call>", "<<call>>").replace("</tool_call>",
                                                                                                 "<</call>>")
    assert "<<call>>" in config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_its_calls_come_back_through_the_openai_client(registered, model_dir):
    """A scripted output in the made-up format: the openai client's tool_calls, whole and
    streamed, and the template rendered the offered tool."""
    srv = ScriptedServer(ScriptedEngine(model_dir, reply="Checking. " + OSLO))
    try:
        c = _client(srv.url)
        r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER])
        (tc,) = r.choices[0].message.tool_calls
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Oslo"})
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content.strip() == "Checking."
        assert "get_weather" in srv.engine.prompts[-1]
        chunks = [ch for ch in c.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather?"}],
                                                         tools=[WEATHER], stream=True) if ch.choices]
        deltas = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
        assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather",
                                                                                            {"city": "Oslo"})]
        assert "<<call>>" not in "".join(ch.choices[0].delta.content or "" for ch in chunks)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        srv.stop()


def test_its_grammar_forces_a_call_on_the_real_engine(registered, model_dir):
    """tool_choice "required" on random weights: the family's grammar makes the output one
    call in its format, which its parser reads back, valid against the tool's schema."""
    import jsonschema

    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine

    srv = ScriptedServer(lambda: Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=256, max_model_len=2048)))
    try:
        c = _client(srv.url)
        for seed, stream in ((0, False), (1, True)):
            request = dict(model="", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                           tool_choice="required", max_tokens=128, temperature=1.0, seed=seed)
            if stream:
                chunks = [ch for ch in c.chat.completions.create(stream=True, **request) if ch.choices]
                calls = [(d.function.name, d.function.arguments) for ch in chunks
                         for d in ch.choices[0].delta.tool_calls or []]
                finish = chunks[-1].choices[0].finish_reason
            else:
                r = c.chat.completions.create(**request)
                calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]
                finish = r.choices[0].finish_reason
            ((name, arguments),) = calls
            assert name == "get_weather" and finish == "tool_calls"
            jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    finally:
        srv.stop()
