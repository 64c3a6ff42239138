"""vLLM's `POST /tokenize` and the gRPC `Generation.Tokenize` under it: the ids are the
prompt generation prefills. Oracles: the model's tokenizer for a text prompt, and the
real `openai` client's chat usage (`prompt_tokens`) for the same messages and tools."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from scripted_engine import ScriptedEngine, ScriptedServer

KEY = "sk-tok"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": CITY}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from cluster.security import Keys

    srv = ScriptedServer(ScriptedEngine(tiny_model_dir, reply="ok"), keys=Keys(inference=(KEY,)))
    yield srv
    srv.stop()


def tokenize(server, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(server.url + "/tokenize", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_text_prompt_is_the_tokenizers_ids(server):
    status, body = tokenize(server, {"model": "tiny-qwen3", "prompt": "orchard pear apple"})
    assert status == 200, body
    want = server.engine.tokenizer.encode("orchard pear apple")
    assert body == {"count": len(want), "max_model_len": server.engine.config.max_model_len, "tokens": want,
                    "token_strs": None}
    status, body = tokenize(server, {"prompt": [5, 6, 7]})  # ids are the prompt as they are
    assert status == 200 and body["tokens"] == [5, 6, 7]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["chat", "tools"])
def test_a_chat_is_the_prompt_its_completion_prefills(server, tools):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    extra = {"tools": tools} if tools else {}
    status, body = tokenize(server, {"model": "tiny-qwen3", "messages": CHAT, **extra})
    assert status == 200, body
    r = client.chat.completions.create(model="tiny-qwen3", messages=CHAT, max_tokens=1, **extra)
    assert body["count"] == r.usage.prompt_tokens == len(body["tokens"])
    assert body["tokens"] == server.engine.tokenizer.encode(server.engine.prompts[-1], add_special_tokens=False)


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "messages": CHAT}, "prompt"),
    ({}, "prompt"),
    ({"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ({"prompt": "x", "return_token_strs": True}, "return_token_strs"),
    ({"prompt": "x", "tools": TOOLS}, "tools"),
    ({"prompt": "x", "temperature": 0.5}, "temperature"),
    ({"prompt": 5}, "prompt"),
])
def test_what_it_cannot_honour_is_a_400_naming_it(server, body, field):
    status, answer = tokenize(server, {"model": "tiny-qwen3", **body})
    assert status == 400 and answer["error"]["param"] == field, answer
    assert field in answer["error"]["message"]


def test_it_needs_the_api_key_as_the_apis_do(server):
    assert tokenize(server, {"prompt": "x"}, key=None)[0] == 401
    assert tokenize(server, {"prompt": "x"}, key="sk-wrong")[0] == 401
    status, body = tokenize(server, {"model": "no-such-model", "prompt": "x"})
    assert status == 404, body


def test_grpc_tokenize_is_refused_past_the_prompt_bound(server):
    """Counting a prompt no context can hold costs no tokenizing: refused by its size first."""
    from cluster.api.errors import InvalidRequest
    from cluster.sdk import Client

    with Client(server.grpc_address, timeout=30, api_key=KEY) as client:
        with pytest.raises(InvalidRequest, match="max_model_len"):
            client.tokenize("pear " * (40 * server.engine.config.max_model_len))
        long = client.tokenize("pear " * (server.engine.config.max_model_len + 10))  # counted, not refused
        assert len(long) > server.engine.config.max_model_len


IMPOSSIBLE = [{"type": "function", "function": {"name": "impossible", "parameters": {
    "type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["s"]}}}]


def test_a_count_refuses_what_generation_refuses(server):
    """A count is of a request generation would take: what generation refuses before it
    tokenizes (a forced call no output can make, ids outside the vocabulary) is refused the
    same way; a prompt longer than the context is counted, for the caller to compare."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    forced = {"type": "function", "function": {"name": "impossible"}}
    status, body = tokenize(server, {"messages": CHAT, "tools": IMPOSSIBLE, "tool_choice": forced})
    with pytest.raises(openai.BadRequestError) as refused:  # the oracle: generation's own refusal
        client.chat.completions.create(model="tiny-qwen3", messages=CHAT, tools=IMPOSSIBLE, tool_choice=forced)
    assert status == 400 and body["error"]["message"] == refused.value.body["message"], body
    vocab = len(server.engine.tokenizer)
    for bad in ([1, -1], [1, vocab + 5]):
        status, body = tokenize(server, {"prompt": bad})
        assert status == 400 and body["error"]["param"] == "prompt", body
        assert "prompt token ids must be in [0, " in body["error"]["message"]
    n = server.engine.config.max_model_len + 3
    status, body = tokenize(server, {"prompt": [5] * n})
    assert status == 200 and body["count"] == n > body["max_model_len"]
