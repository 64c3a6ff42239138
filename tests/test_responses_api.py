"""/v1/responses through the real `openai` client: text and message input, instructions,
limits, streaming events as the package's types read them, function tools both ways,
previous_response_id and store. Outputs are scripted (tests/scripted_engine.py); the
prompt each turn rendered is the oracle for what reached the model."""

from __future__ import annotations

import json

import pytest

from scripted_engine import ScriptedEngine, ScriptedServer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ScriptedServer(ScriptedEngine(tiny_model_dir, reply="Hello there."))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_text_input_and_instructions(server, client):
    server.engine.reply = "Hello there."
    r = client.responses.create(model="tiny-qwen3", input="Say hi", instructions="Be brief.", max_output_tokens=50,
                                temperature=0.5, top_p=0.9)
    assert r.status == "completed" and r.output_text == "Hello there."
    assert r.output[0].type == "message" and r.output[0].content[0].text == "Hello there."
    assert r.usage.output_tokens == len(server.engine.tokenizer.encode("Hello there.", add_special_tokens=False))
    assert r.usage.input_tokens > 0
    prompt = server.engine.prompts[-1]
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt and "<|im_start|>user\nSay hi<|im_end|>" in prompt
    params = server.engine.params[-1]
    assert (params.max_tokens, round(params.temperature, 3), round(params.top_p, 3)) == (50, 0.5, 0.9)


def test_max_output_tokens_makes_it_incomplete(server, client):
    server.engine.reply = "one two three four five six seven"
    r = client.responses.create(model="tiny-qwen3", input="count", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


def test_message_list_input(server, client):
    server.engine.reply = "Paris."
    r = client.responses.create(model="tiny-qwen3", input=[
        {"role": "developer", "content": "You answer geography."},
        {"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]}])
    assert r.output_text == "Paris."
    prompt = server.engine.prompts[-1]
    assert "system\nYou answer geography." in prompt and "user\nCapital of France?" in prompt


def test_streaming_events(server, client):
    server.engine.reply = "Streaming works fine."
    events = list(client.responses.create(model="tiny-qwen3", input="go", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types.index("response.output_item.added") < types.index("response.output_text.delta") \
        < types.index("response.output_text.done") < types.index("response.output_item.done")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Streaming works fine."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == "Streaming works fine." and done.usage.output_tokens > 0


def test_function_tools_round_trip_and_previous_response_id(server, client):
    server.engine.reply = CALL
    r1 = client.responses.create(model="tiny-qwen3", input="Weather in Oslo?", tools=[TOOL])
    (call,) = [o for o in r1.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.call_id.startswith("call_")
    assert "get_weather" in server.engine.prompts[-1]  # the tool reached the template
    server.engine.reply = "It is 12 degrees in Oslo."
    r2 = client.responses.create(model="tiny-qwen3", previous_response_id=r1.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees"}])
    assert r2.output_text == "It is 12 degrees in Oslo." and r2.previous_response_id == r1.id
    prompt = server.engine.prompts[-1]
    assert "user\nWeather in Oslo?" in prompt  # the stored turn came back
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\n12 degrees\n</tool_response>" in prompt
    assert client.responses.retrieve(r2.id).output_text == "It is 12 degrees in Oslo."


def test_function_call_streamed(server, client):
    server.engine.reply = "Let me look." + CALL
    events = list(client.responses.create(model="tiny-qwen3", input="Weather?", tools=[TOOL], stream=True))
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and json.loads(args[0].arguments) == {"city": "Oslo"}
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output_text == "Let me look."


def test_store_false_and_unknown_previous_id(server, client):
    import openai

    server.engine.reply = "x"
    r = client.responses.create(model="tiny-qwen3", input="hi", store=False)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="tiny-qwen3", input="again", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_unknown_fields_are_refused_by_name(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="'frobnicate'"):
        client.responses.create(model="tiny-qwen3", input="hi", extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="verbosity"):
        client.responses.create(model="tiny-qwen3", input="hi", text={"verbosity": "low"})
    with pytest.raises(openai.BadRequestError, match="'tool_calls'"):
        client.responses.create(model="tiny-qwen3", input=[{"role": "user", "content": "x", "tool_calls": []}])
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model="tiny-qwen3", input="hi", tools=[{"type": "web_search"}])


@pytest.mark.parametrize("stream", [False, True])
def test_output_items_keep_the_models_order(server, client, stream):
    """Text after a call is a message of its own, after the call, streamed or not: the
    streamed items are the final response's items."""
    server.engine.reply = "First." + CALL + "Then."
    if stream:
        events = list(client.responses.create(model="tiny-qwen3", input="go", tools=[TOOL], stream=True))
        final = events[-1].response
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [(e.output_index, e.item.id) for e in events if e.type == "response.output_item.added"] == [
            (i, o.id) for i, o in enumerate(final.output)]
        assert [d.model_dump() for d in done] == [o.model_dump() for o in final.output]
    else:
        final = client.responses.create(model="tiny-qwen3", input="go", tools=[TOOL])
    assert [o.type for o in final.output] == ["message", "function_call", "message"]
    assert [final.output[0].content[0].text, final.output[2].content[0].text] == ["First.", "Then."]
    assert final.output[0].id != final.output[2].id and final.output_text == "First.Then."


def test_openai_agents_sdk_runs_a_tool_loop(server):
    """The OpenAI Agents SDK (its default model is the Responses API): the agent calls a
    function tool, the SDK runs it and sends the result back, the model answers."""
    import asyncio

    import openai
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no export to OpenAI from a test
    ran = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return "12 degrees"

    server.engine.reply = lambda prompt: "It is 12 degrees in Oslo." if "<tool_response>" in prompt else CALL
    model = OpenAIResponsesModel("tiny-qwen3", openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                                                  max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model)

    async def both():  # one event loop: the client's connections belong to it
        result = await Runner.run(agent, "Weather in Oslo?")
        assert ran == ["Oslo"] and result.final_output == "It is 12 degrees in Oslo."
        prompt = server.engine.prompts[-1]
        assert "system\nAnswer with the weather." in prompt
        assert "<tool_response>\n12 degrees\n</tool_response>" in prompt
        run = Runner.run_streamed(agent, "Weather in Oslo?")  # streamed: the Responses events
        kinds = [e.type async for e in run.stream_events()]
        assert run.final_output == "It is 12 degrees in Oslo." and ran == ["Oslo", "Oslo"]
        assert "raw_response_event" in kinds

    asyncio.run(both())
