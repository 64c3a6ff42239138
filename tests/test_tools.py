"""Tool calling: tools and tool history reach the chat template, calls are cut out of the
output with mlx-lm's parser for the model's family, and come back through the real
`openai` client and LangChain as OpenAI's `tool_calls`, streamed and not.

The output is scripted (tests/scripted_engine.py: random weights never call a tool);
the last test runs the real engine and checks the prompt it was given."""

from __future__ import annotations

import json

import pytest

from cluster.formats.calls import ToolCallStream
from scripted_engine import ScriptedEngine, ScriptedServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>'


def _feed_all(stream: ToolCallStream, text: str, step: int):
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = stream.feed(text[i:i + step])
        content, calls = content + c, calls + k
    c, k = stream.finish()
    return content + c, [(x.name, json.loads(x.arguments)) for x in calls + k]


@pytest.mark.parametrize("family, text, content, calls", [
    ("json_tools", "Sure. " + CALL + " " + CALL2, "Sure.  ", [("get_weather", {"city": "Oslo"}),
                                                             ("get_weather", {"city": "Bergen"})]),
    ("pythonic", 'Hi <|tool_call_start|>[get_weather(city="Oslo")]<|tool_call_end|>done', "Hi done",
     [("get_weather", {"city": "Oslo"})]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>', "",
     [("get_weather", {"city": "Oslo"})]),
    ("mistral", 'ok[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "ok", [("get_weather", {"city": "Oslo"})]),
    ("json_tools", "a < b and <tool_c is not a marker", "a < b and <tool_c is not a marker", []),
    ("json_tools", "cut short <tool_call>\n{\"name\": \"get_wea", "cut short <tool_call>\n{\"name\": \"get_wea", []),
])
def test_tool_call_stream_with_mlx_lm_parsers(family, text, content, calls):
    """Any chunking of the output gives the same content and calls as the whole text:
    markers never reach the content, a marker split across chunks is held back, a call cut
    short stays visible as text."""
    import importlib

    mod = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    for step in (len(text) or 1, 1, 3, 7):
        got = _feed_all(ToolCallStream(mod.tool_call_start, mod.tool_call_end, mod.parse_tool_call, [WEATHER]),
                        text, step)
        assert got == (content, calls), step


def test_parallel_tool_calls_false_keeps_the_first_call():
    import mlx_lm.tool_parsers.json_tools as jt

    s = ToolCallStream(jt.tool_call_start, jt.tool_call_end, jt.parse_tool_call, [WEATHER], parallel=False)
    assert _feed_all(s, CALL + CALL2, 5)[1] == [("get_weather", {"city": "Oslo"})]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = ScriptedEngine(tiny_model_dir, reply="Let me check." + CALL)
    srv = ScriptedServer(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "12 degrees and rain"},
]


def test_openai_client_gets_tool_calls(server, client):
    server.engine.reply = "Let me check." + CALL
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    prompt = server.engine.prompts[-1]
    assert "get_weather" in prompt and "<tool_call>" in prompt  # the tools reached the template


def test_openai_client_streams_tool_call_deltas(server, client):
    server.engine.reply = "Checking both." + CALL + CALL2
    chunks = list(client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Oslo and Bergen?"}], tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking both."
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0, 1]
    assert [json.loads(d.function.arguments) for d in deltas] == [{"city": "Oslo"}, {"city": "Bergen"}]
    assert all(d.id.startswith("call_") and d.function.name == "get_weather" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_history_with_tool_calls_reaches_the_template(server, client):
    server.engine.reply = "It is 12 degrees and raining in Oslo."
    r = client.chat.completions.create(model="", messages=HISTORY, tools=[WEATHER])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    prompt = server.engine.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\n12 degrees and rain\n</tool_response>" in prompt


def test_tool_choice_none_offers_no_tools_and_parses_nothing(server, client):
    server.engine.reply = "plain " + CALL
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                       tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "plain " + CALL
    assert "get_weather" not in server.engine.prompts[-1]


def test_parallel_tool_calls_false(server, client):
    server.engine.reply = CALL + CALL2
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                       parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Oslo"]
    assert r.choices[0].message.content is None


TRAVEL = {"type": "function", "function": {"name": "book_trip", "description": "Book a trip", "parameters": {
    "type": "object", "properties": {"to": {"type": "string", "maxLength": 12},
                                     "nights": {"type": "integer", "minimum": 1, "maximum": 14},
                                     "class": {"enum": ["economy", "business"]}},
    "required": ["to", "nights", "class"], "additionalProperties": False}}}
WEATHER_STRICT = {"type": "function", "function": {**WEATHER["function"], "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def long_worker(tiny_model_dir, worker_process):
    """The real engine with room for two tools' descriptions in the prompt (the tiny
    tokenizer spends ~200 tokens on each)."""
    return worker_process(tiny_model_dir, "--num-kv-blocks", "512", "--max-model-len", "2048")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book_trip"}}],
                         ids=["required", "named"])
def test_forced_tool_choice_makes_a_valid_call_on_the_real_engine(long_worker, choice):
    """tool_choice "required" or a named function, enforced by constrained decoding on
    random weights: every sample is one call, to an offered (or the named) function, with
    arguments valid against its parameters schema; finish_reason is tool_calls."""
    import jsonschema
    import openai

    c = openai.OpenAI(base_url=f"http://{long_worker.http}/v1", api_key="none", max_retries=0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_STRICT, TRAVEL)}
    for seed in range(3):
        r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Plan my week"}],
                                      tools=[WEATHER_STRICT, TRAVEL], tool_choice=choice, max_tokens=256,
                                      temperature=1.0, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        if isinstance(choice, dict):
            assert call.function.name == "book_trip"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_forced_tool_choice_streams_and_refuses_what_it_cannot_combine(long_worker):
    import openai

    c = openai.OpenAI(base_url=f"http://{long_worker.http}/v1", api_key="none", max_retries=0)
    chunks = list(c.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}],
                                            tools=[TRAVEL], tool_choice="required", max_tokens=256, stream=True))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "book_trip" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all("<tool_call>" not in (ch.choices[0].delta.content or "") for ch in chunks)
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        c.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], tools=[TRAVEL],
                                  tool_choice="required", response_format={"type": "json_object"})


def test_langchain_with_structured_output_by_function_calling(long_worker):
    """The issue's example: with_structured_output(method="function_calling") used to
    return None; the named tool choice now forces a valid call."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Trip(BaseModel):
        to: str = Field(max_length=12)
        nights: int = Field(ge=1, le=14)

    llm = ChatOpenAI(base_url=f"http://{long_worker.http}/v1", api_key="none", model="tiny-qwen3", max_tokens=256,
                     temperature=0, max_retries=0)
    trip = llm.with_structured_output(Trip, method="function_calling").invoke("Plan a trip")
    assert isinstance(trip, Trip) and 1 <= trip.nights <= 14


def test_a_model_without_tool_calling_refuses_tools(tmp_path):
    import openai

    from cluster.modelgen import create_model

    model = create_model(tmp_path / "tiny-gemma", "gemma3_text", "tiny", seed=0)  # Gemma 3's format has no tools
    srv = ScriptedServer(ScriptedEngine(model, reply="hi"))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no tool calling"):
            c.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
        r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "hi"
    finally:
        srv.stop()


def test_langchain_bind_tools_returns_tool_calls(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "12C"

    server.engine.reply = CALL
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="tiny-qwen3", max_retries=0)
    msg = llm.bind_tools([get_weather]).invoke("Weather in Oslo?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert msg.tool_calls[0]["id"].startswith("call_")
    chunks = list(llm.bind_tools([get_weather]).stream("Weather in Oslo?"))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("get_weather", {"city": "Oslo"})]


def test_real_engine_renders_tools_and_history(tiny_worker, tiny_model_dir):
    """The real worker: tools and a history with a call and its result go through the
    chat template; the prompt it counted is the one the tokenizer renders with them."""
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    c = openai.OpenAI(base_url=f"http://{tiny_worker.http}/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model="", messages=HISTORY, tools=[WEATHER], max_tokens=4, temperature=0)
    template_history = [dict(m) for m in HISTORY]
    template_history[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    text = tok.apply_chat_template(template_history, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "12 degrees and rain" in text and '"description": "The weather in a city"' in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    bare = c.chat.completions.create(model="", messages=HISTORY[:1], max_tokens=1)
    assert bare.usage.prompt_tokens < r.usage.prompt_tokens


def test_sdk_over_grpc_gets_tool_calls(server):
    """The gRPC contract: tools, tool_choice and history go in, `tool_calls` and
    FINISH_REASON_TOOL_CALLS come out, streamed or whole."""
    from cluster.sdk import Client, ToolCall

    server.engine.reply = "Sure." + CALL + CALL2
    with Client(server.grpc_address) as c:
        done = c.chat([{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="auto")
        assert done.finish_reason == "tool_calls" and done.text == "Sure."
        assert [(t.name, json.loads(t.arguments)) for t in done.tool_calls] == [
            ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]
        assert all(isinstance(t, ToolCall) and t.id.startswith("call_") for t in done.tool_calls)
        chunks = list(c.stream(messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                               parallel_tool_calls=False))
        assert [t.name for ch in chunks for t in ch.tool_calls] == ["get_weather"]
        assert "".join(ch.text for ch in chunks) == "Sure." and chunks[-1].finish_reason == "tool_calls"
        server.engine.reply = "fine"
        c.chat(HISTORY, tools=[WEATHER])
        assert "<tool_response>\n12 degrees and rain\n</tool_response>" in server.engine.prompts[-1]


def test_a_stream_resumed_mid_call_still_parses_it(server):
    """Router failover resumes a request on another worker after the tokens already sent:
    the new worker picks up the parser's state from them, so a call cut by the failover is
    still parsed, and what was sent is not sent again."""
    from cluster.sdk import Client, build_request

    server.engine.reply = "Sure." + CALL + " bye"
    ids = server.engine.tokenizer.encode(server.engine.reply, add_special_tokens=False)
    cut = next(i for i in range(len(ids)) if "Oslo" in server.engine.tokenizer.decode(ids[:i]))  # inside the call
    with Client(server.grpc_address) as c:
        req = build_request(messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                            resume_token_ids=ids[:cut])
        done = c.generate(req)
    assert [(t.name, json.loads(t.arguments)) for t in done.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert done.text == " bye" and done.finish_reason == "tool_calls"


@pytest.mark.parametrize("arch, call", [
    ("lfm2", '<|tool_call_start|>[get_weather(city="Oslo")]<|tool_call_end|>'),
    ("gemma4_text", '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
])
def test_other_families_through_the_openai_client(tmp_path, arch, call):
    """Each family's own markers and parser (mlx-lm's, picked from its chat template),
    from its tokenizer's tokens to the openai client's tool_calls."""
    import openai

    from cluster.modelgen import create_model

    model = create_model(tmp_path / arch, arch, "tiny", seed=0)
    srv = ScriptedServer(ScriptedEngine(model, reply="Checking. " + call))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER])
        (tc,) = r.choices[0].message.tool_calls
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Oslo"})
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content.strip() == "Checking."
        assert "get_weather" in srv.engine.prompts[-1]
    finally:
        srv.stop()


def test_special_token_markers_are_parsed_not_leaked(tmp_path):
    """Mistral's [TOOL_CALLS] and [ARGS] are special tokens (a detokenizer drops them): the
    worker decodes its output with them kept, so the call is parsed and neither marker
    reaches the content (tools used to be refused for such models)."""
    import openai

    from cluster.modelgen import create_model

    model = create_model(tmp_path / "magistral", "mistral", "tiny", seed=0, chat="mistral-small-3.2")
    srv = ScriptedServer(ScriptedEngine(model, reply='Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'))
    try:
        tok = srv.engine.tokenizer
        assert tok.decode(tok.encode("[TOOL_CALLS]", add_special_tokens=False), skip_special_tokens=True) == ""
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER])
        (tc,) = r.choices[0].message.tool_calls
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Oslo"})
        assert r.choices[0].message.content == "Checking." and len(tc.id) == 9 and tc.id.isalnum()
        plain = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather?"}])
        assert plain.choices[0].message.content == 'Checking.get_weather{"city": "Oslo"}'  # no tools: markers dropped
    finally:
        srv.stop()


def test_split_chunk_keeps_the_models_order():
    """A chunk is its text then its calls: text after a call moves to a chunk of its own,
    which takes the finish and usage; the token ids stay on the first."""
    import mlx_lm.tool_parsers.json_tools as jt

    from cluster.api.tools import split_chunk
    from cluster.proto.orchard.v1 import orchard_pb2 as pb

    s = ToolCallStream(jt.tool_call_start, jt.tool_call_end, jt.parse_tool_call, [WEATHER])
    chunk = pb.GenerateResponse(request_id="r", token_ids=[1, 2, 3], text="a" + CALL + "b",
                                finish_reason=pb.FINISH_REASON_STOP,
                                usage=pb.Usage(prompt_tokens=4, completion_tokens=3))
    first, second = split_chunk(s, chunk)
    assert (first.text, [c.name for c in first.tool_calls], list(first.token_ids)) == ("a", ["get_weather"], [1, 2, 3])
    assert not first.finish_reason and not first.HasField("usage")
    assert (second.text, second.finish_reason, second.usage.completion_tokens) == ("b", pb.FINISH_REASON_TOOL_CALLS, 3)
    plain = ToolCallStream(jt.tool_call_start, jt.tool_call_end, jt.parse_tool_call, [WEATHER])
    (only,) = split_chunk(plain, pb.GenerateResponse(text="hi", finish_reason=pb.FINISH_REASON_STOP))
    assert (only.text, only.finish_reason) == ("hi", pb.FINISH_REASON_STOP)


def test_through_the_router(tiny_model_dir):
    """The router checks the same tool fields, relays the calls, and serves the Responses
    and Messages APIs over its workers."""
    import anthropic
    import openai

    srv = ScriptedServer(ScriptedEngine(tiny_model_dir, reply="Sure." + CALL), router=True)
    try:
        c = openai.OpenAI(base_url=srv.router_url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="tiny-qwen3", messages=HISTORY[:1], tools=[WEATHER])
        assert r.choices[0].finish_reason == "tool_calls"
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
        deltas = [t for ch in c.chat.completions.create(model="tiny-qwen3", messages=HISTORY[:1], tools=[WEATHER],
                                                        stream=True) if ch.choices
                  for t in ch.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas] == ["get_weather"]
        with pytest.raises(openai.BadRequestError, match="which is not in tools"):
            c.chat.completions.create(model="tiny-qwen3", messages=HISTORY[:1], tools=[WEATHER],
                                      tool_choice={"type": "function", "function": {"name": "book_trip"}})
        resp = c.responses.create(model="tiny-qwen3", input="Weather?",
                                  tools=[{"type": "function", **WEATHER["function"]}])
        assert [o.type for o in resp.output] == ["message", "function_call"]
        msg = anthropic.Anthropic(base_url=srv.router_url, api_key="none", max_retries=0).messages.create(
            model="tiny-qwen3", max_tokens=400, messages=[{"role": "user", "content": "Weather?"}],
            tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
        assert msg.stop_reason == "tool_use" and msg.content[1].input == {"city": "Oslo"}
    finally:
        srv.stop()
