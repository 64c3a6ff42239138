"""/v1/messages through the real `anthropic` package: system, content blocks, max_tokens,
stop_sequences, streaming events, tools (tool_use out, tool_result in), Anthropic's error
shape and the x-api-key header. Outputs are scripted (tests/scripted_engine.py); the
rendered prompt is the oracle for what reached the model."""

from __future__ import annotations

import pytest

from scripted_engine import ScriptedEngine, ScriptedServer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from cluster.security import Keys

    srv = ScriptedServer(ScriptedEngine(tiny_model_dir, reply="Hello there."), keys=Keys(inference=("sk-test",)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0)


def test_text_with_system_and_blocks(server, client):
    server.engine.reply = "Hello there."
    m = client.messages.create(model="tiny-qwen3", max_tokens=40, system="Be brief.",
                               extra_body={"temperature": 0.3, "top_k": 5},  # older clients' keyword arguments
                               messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Hello there."
    assert m.usage.output_tokens == len(server.engine.tokenizer.encode("Hello there.", add_special_tokens=False))
    prompt = server.engine.prompts[-1]
    assert "system\nBe brief.<|im_end|>" in prompt and "user\nSay hi<|im_end|>" in prompt
    p = server.engine.params[-1]
    assert (p.max_tokens, round(p.temperature, 3), p.top_k) == (40, 0.3, 5)


def test_stop_sequences_and_max_tokens(server, client):
    server.engine.reply = "alpha beta gamma delta"
    m = client.messages.create(model="tiny-qwen3", max_tokens=100, stop_sequences=["gamma"],
                               messages=[{"role": "user", "content": "go"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "gamma" and m.content[0].text == "alpha beta "
    m = client.messages.create(model="tiny-qwen3", max_tokens=2, messages=[{"role": "user", "content": "go"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_streaming_events(server, client):
    server.engine.reply = "Streaming works fine."
    with client.messages.stream(model="tiny-qwen3", max_tokens=50, messages=[{"role": "user", "content": "go"}]) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)
    assert final.content[0].text == "Streaming works fine." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_tools_round_trip(server, client):
    server.engine.reply = "Let me check." + CALL
    m = client.messages.create(model="tiny-qwen3", max_tokens=100, tools=[TOOL],
                               messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.content[0].text == "Let me check."
    use = m.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Oslo"} and use.id.startswith("toolu_")
    assert "get_weather" in server.engine.prompts[-1]
    server.engine.reply = "12 degrees."
    m2 = client.messages.create(model="tiny-qwen3", max_tokens=100, tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12 degrees"}]}])
    assert m2.content[0].text == "12 degrees."
    prompt = server.engine.prompts[-1]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\n12 degrees\n</tool_response>" in prompt


def test_tool_use_streamed(server, client):
    server.engine.reply = CALL
    with client.messages.stream(model="tiny-qwen3", max_tokens=100, tools=[TOOL],
                                messages=[{"role": "user", "content": "Weather?"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Oslo"})]


def test_errors_in_anthropic_shape(server, client):
    import anthropic
    import requests

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny-qwen3", max_tokens=10, messages=[{"role": "user", "content": "x"}],
                               extra_body={"frobnicate": 1})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "frobnicate" in e.value.body["error"]["message"]
    r = requests.post(server.url + "/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                      headers={"x-api-key": "sk-test"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny-qwen3", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = requests.post(server.url + "/v1/messages", json={}, headers={"Authorization": "Bearer sk-test"})
    assert r.status_code == 400  # Bearer works too


def test_blocks_keep_the_models_order(server, client):
    server.engine.reply = "First." + CALL + "Then."
    m = client.messages.create(model="tiny-qwen3", max_tokens=100, tools=[TOOL],
                               messages=[{"role": "user", "content": "go"}])
    assert [b.type for b in m.content] == ["text", "tool_use", "text"]
    assert (m.content[0].text, m.content[2].text) == ("First.", "Then.")
    with client.messages.stream(model="tiny-qwen3", max_tokens=100, tools=[TOOL],
                                messages=[{"role": "user", "content": "go"}]) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["text", "tool_use", "text"]


def test_usage_counts_a_prompts_cached_tokens_once():
    """A prompt of 100 tokens, 64 of them read from the prefix cache: Anthropic's usage says
    input 36 + cache read 64, which the real client's type reads back and which add up to the
    prompt (input_tokens counted them twice before)."""
    import anthropic.types

    from cluster.api.messages import _usage
    from cluster.proto.orchard.v1 import orchard_pb2 as pb

    usage = anthropic.types.Usage(**_usage(pb.Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=64)))
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (36, 64, 7)
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == 100


def test_cache_control_breakpoints_are_accepted(server, client):
    """Agents mark their long, stable prefix with `cache_control` (on system blocks, content
    blocks and tools); the prefix cache reuses any shared prefix anyway, so the marks are taken
    and the request served as without them."""
    server.engine.reply = "Hello there."
    mark = {"type": "ephemeral"}
    m = client.messages.create(
        model="tiny-qwen3", max_tokens=20,
        system=[{"type": "text", "text": "Be brief.", "cache_control": mark}],
        tools=[{**TOOL, "cache_control": mark}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi", "cache_control": mark}]}])
    assert m.content[0].text == "Hello there."
    prompt = server.engine.prompts[-1]
    assert "Be brief." in prompt and "Say hi" in prompt and "get_weather" in prompt
    m = client.messages.create(model="tiny-qwen3", max_tokens=20, cache_control={"type": "ephemeral", "ttl": "1h"},
                               messages=[{"role": "user", "content": "Say hi"}])
    assert m.content[0].text == "Hello there."


@pytest.mark.parametrize("where, mark, field", [
    ("top", {"type": "persistent"}, "cache_control"),
    ("system", {"type": "ephemeral", "ttl": "2h"}, "system.0.cache_control"),
    ("content", "ephemeral", "messages.0.content.0.cache_control"),
    ("tool", {"type": "ephemeral", "scope": "org"}, "tools.0.cache_control"),
])
def test_a_malformed_cache_control_is_a_400_naming_it(server, client, where, mark, field):
    import anthropic

    body = {"model": "tiny-qwen3", "max_tokens": 20, "messages": [{"role": "user", "content": "Say hi"}]}
    if where == "top":
        body["extra_body"] = {"cache_control": mark}
    elif where == "system":
        body["system"] = [{"type": "text", "text": "Be brief.", "cache_control": mark}]
    elif where == "content":
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Say hi", "cache_control": mark}]}]
    else:
        body["tools"] = [{**TOOL, "cache_control": mark}]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(**body)
    assert field in str(err.value) and "ephemeral" in str(err.value)


# -- count_tokens: the prompt /v1/messages would prefill, counted without running it ---------

COUNTED = [
    {"messages": [{"role": "user", "content": "Say hi"}]},
    {"system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]},
    {"tools": [TOOL], "tool_choice": {"type": "auto"}, "messages": [{"role": "user", "content": "Weather in Oslo?"}]},
    {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Think less"}]},
    {"tools": [TOOL], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 degrees"}]}]},
]


@pytest.mark.parametrize("body", COUNTED, ids=["text", "system", "tools", "thinking", "tool-history"])
def test_count_tokens_is_the_prompt_a_message_prefills(server, client, body):
    """The oracle: the same body on /v1/messages, whose usage counts the prompt the engine
    was given (input + cache read)."""
    server.engine.reply = "ok"
    counted = client.messages.count_tokens(model="tiny-qwen3", **body)
    m = client.messages.create(model="tiny-qwen3", max_tokens=1, **body)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    assert counted.input_tokens == len(server.engine.tokenizer.encode(server.engine.prompts[-1],
                                                                      add_special_tokens=False))


def test_count_tokens_refuses_what_it_cannot_count(server, client):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as err:  # a generation's field: not a count's
        client.messages.count_tokens(model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}],
                                     extra_body={"max_tokens": 5})
    assert "max_tokens" in str(err.value) and "Extra inputs" in str(err.value)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.count_tokens(model="tiny-qwen3", messages=[])
    assert "messages" in str(err.value)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    stranger = client.with_options(api_key="sk-wrong")
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.count_tokens(model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}])


def test_count_tokens_and_tokenize_through_the_router(tiny_model_dir):
    """The router places a count on a worker of the model (HTTP), and `Client.tokenize` over
    gRPC gives the same ids from the router as from the worker, as the worker would prefill."""
    import anthropic

    from cluster.sdk import Client

    srv = ScriptedServer(ScriptedEngine(tiny_model_dir, reply="ok"), router=True)
    try:
        body = COUNTED[2]
        via_router = anthropic.Anthropic(base_url=srv.router_url, api_key="x", max_retries=0)
        counted = via_router.messages.count_tokens(model="tiny-qwen3", **body)
        m = via_router.messages.create(model="tiny-qwen3", max_tokens=1, **body)
        assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
        chat = [{"role": "user", "content": "Weather in Oslo?"}]
        with Client(srv.router_grpc, timeout=30) as router, Client(srv.grpc_address, timeout=30) as worker:
            ids = router.tokenize(messages=chat, model="tiny-qwen3")
            assert ids == worker.tokenize(messages=chat) and len(ids) > 0
            assert router.tokenize("hello world") == srv.engine.tokenizer.encode("hello world")
            assert router.generate(messages=chat, max_tokens=1).usage.prompt_tokens == len(ids)
    finally:
        srv.stop()
