"""The OpenAI-compatible HTTP API: the official `openai` package against a worker's
--http, raw HTTP for errors, and the app in front of fake and gRPC backends."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from cluster.api.app import create_app
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.sdk import Client, GrpcBackend, InvalidRequest, Overloaded, Unavailable

IGNORE_EOS = {"ignore_eos": True}


def post(address: str, path: str, body: bytes | dict, timeout: float = 30):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{address}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_completions(oai, tiny_worker, tiny_tokenizer):
    prompt = "The orchard is quiet in the morning."
    r = oai.completions.create(model="", prompt=prompt, max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    n_prompt = len(tiny_tokenizer.encode(prompt).ids)
    assert r.object == "text_completion" and r.model and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)
    with Client(tiny_worker.grpc, timeout=30) as client:
        assert r.choices[0].text == client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True).text

    stream = oai.completions.create(model=r.model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(c.usage is None for c in chunks[:-1])

    ids = tiny_tokenizer.encode(prompt).ids
    by_ids = oai.completions.create(model="", prompt=ids, max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    assert by_ids.choices[0].text == r.choices[0].text


def test_chat_completions(oai, tiny_worker):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about apples."}]
    r = oai.chat.completions.create(model="", messages=messages, max_tokens=10, temperature=0, extra_body=IGNORE_EOS)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    with Client(tiny_worker.grpc, timeout=30) as client:
        ref = client.chat(messages, max_tokens=10, temperature=0, ignore_eos=True)
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert r.usage.total_tokens == ref.usage.prompt_tokens + 10

    stream = oai.chat.completions.create(model="", messages=messages, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.text
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 10

    # Without include_usage there is no usage chunk.
    plain = list(oai.chat.completions.create(model="", messages=messages, max_tokens=3, stream=True))
    assert all(c.choices for c in plain) and plain[-1].choices[0].finish_reason in ("stop", "length")


def test_seed_stop_and_logprobs(oai):
    kw = dict(model="", prompt="Once upon a time", max_tokens=8, temperature=1.0, extra_body=IGNORE_EOS)
    a, b = oai.completions.create(seed=42, **kw), oai.completions.create(seed=42, **kw)
    assert a.choices[0].text == b.choices[0].text

    greedy = oai.completions.create(model="", prompt="Once upon a time", max_tokens=16, temperature=0,
                                    extra_body=IGNORE_EOS).choices[0].text
    word = greedy.strip()[:2]
    if word:
        stopped = oai.completions.create(model="", prompt="Once upon a time", max_tokens=16, temperature=0,
                                         stop=[word], extra_body=IGNORE_EOS).choices[0]
        assert stopped.finish_reason == "stop" and word not in stopped.text
        assert greedy.startswith(stopped.text)

    r = oai.completions.create(model="", prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2,
                               extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-5)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))

    c = oai.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                    temperature=0, logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_models_and_health(oai, tiny_worker, tiny_model_dir):
    models = oai.models.list()
    assert [m.id for m in models.data] == [tiny_model_dir.name]
    with urllib.request.urlopen(f"http://{tiny_worker.http}/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [7] * 600}, 400, "max_model_len"),
    ({"prompt": "x", "n": 0}, 400, "n must be >= 1"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "no-such-model"),
])
def test_completions_errors(tiny_worker, body, status, words):
    code, raw = post(tiny_worker.http, "/v1/completions", body)
    assert code == status
    err = json.loads(raw)["error"]
    assert words in err["message"] and err["code"] == status and err["type"]
    assert post(tiny_worker.http, "/v1/completions", {"prompt": "ok", "max_tokens": 2})[0] == 200


def test_chat_errors(oai, tiny_worker):
    assert post(tiny_worker.http, "/v1/chat/completions", {"messages": []})[0] == 400
    assert post(tiny_worker.http, "/v1/chat/completions", {"messages": [{"content": "no role"}]})[0] == 400
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model="", messages=[{"role": "user", "content": "x"}], temperature=-2)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):  # streaming refusals get their status too
        list(oai.completions.create(model="", prompt="x", temperature=-2, stream=True))


def test_chat_n_samples(oai):
    """n > 1 in chat: n choices (index 0..n-1) forked from one prompt, sample i equal to a
    lone request seeded seed + i; streamed chunks carry their choice's index, each choice
    opens with the role, and the usage counts every sample."""
    messages = [{"role": "user", "content": "Name three fruits."}]
    kw = dict(model="", messages=messages, max_tokens=8, temperature=1.0, extra_body=IGNORE_EOS)
    r = oai.chat.completions.create(n=3, seed=5, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 24
    for i, choice in enumerate(r.choices):
        alone = oai.chat.completions.create(seed=5 + i, **kw).choices[0].message.content
        assert choice.message.content == alone, f"choice {i}"
    assert len({c.message.content for c in r.choices}) > 1
    text, roles, finished = {}, {}, {}
    for chunk in oai.chat.completions.create(n=3, seed=5, stream=True, **kw):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            roles.setdefault(c.index, c.delta.role)
            finished[c.index] = c.finish_reason or finished.get(c.index)
    assert text == {c.index: c.message.content for c in r.choices}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"} and set(finished.values()) == {"length"}


def test_disconnect_mid_stream_frees_kv(tiny_worker):
    stream = openai.OpenAI(base_url=f"http://{tiny_worker.http}/v1", api_key="x", max_retries=0).completions.create(
        model="", prompt="Keep going", max_tokens=500, stream=True, extra_body=IGNORE_EOS)
    it = iter(stream)
    next(it), next(it)
    with Client(tiny_worker.grpc, timeout=10) as client:
        assert client.get_load().num_running == 1
        stream.close()
        deadline = time.monotonic() + 10
        while (client.get_load().num_running or client.get_load().kv_blocks_used) and time.monotonic() < deadline:
            time.sleep(0.02)
        load = client.get_load()
        assert load.num_running == 0 and load.kv_blocks_used == 0


# -- the app in front of other backends -----------------------------------------------------
class FakeBackend:
    """A Generation backend that fails in a chosen way."""

    def __init__(self, error=None, after: int = 0, finish: bool = True):
        self.error, self.after, self.finish = error, after, finish

    async def list_models(self):
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="fake", max_model_len=64)])

    async def generate(self, request, timeout=None):
        for i in range(self.after):
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[i], text=f"t{i} ")
        if self.error is not None:
            raise self.error
        if not self.finish:
            return  # ends short: no finish reason
        yield pb.GenerateResponse(request_id=request.request_id, finish_reason=pb.FINISH_REASON_STOP,
                                  usage=pb.Usage(prompt_tokens=1, completion_tokens=self.after))


def _with_app(backend, fn):
    """`fn(client)` against the app over `backend` (or over what `backend()` makes inside
    the event loop, for a backend that needs one, such as a grpc.aio channel's)."""
    async def run():
        async with TestClient(TestServer(create_app(backend() if callable(backend) else backend))) as client:
            return await fn(client)

    return asyncio.run(run())


@pytest.mark.parametrize("error,status", [(Overloaded("queue full"), 429), (Unavailable("draining"), 503),
                                          (InvalidRequest("bad"), 400)])
def test_backend_errors_map_to_http_status(error, status):
    async def fn(client):
        out = []
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            out.append((r.status, (await r.json())["error"]))
        return out

    for got, err in _with_app(FakeBackend(error), fn):
        assert got == status and err["code"] == status and err["message"] == error.message


def test_error_after_the_first_chunk_ends_the_stream_with_an_error_event():
    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "stream": True})
        return r.status, await r.text()

    status, text = _with_app(FakeBackend(Unavailable("worker went away"), after=2), fn)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "worker went away"
    assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": "t0 "}


def test_a_stream_that_ends_short_is_an_error_never_a_short_answer():
    """A backend stream that stops without a finish reason (its server went away) is a 503,
    or an error event on a started SSE stream: never a completion that looks finished."""
    async def fn(client):
        plain = await client.post("/v1/completions", json={"prompt": "x"})
        streamed = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        return plain.status, await plain.json(), await streamed.text()

    status, body, text = _with_app(FakeBackend(after=2, finish=False), fn)
    assert status == 503 and "ended before the request finished" in body["error"]["message"]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "ended before the request finished" in json.loads(events[-2])["error"]["message"]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0 ", "t1 "]


def test_a_request_past_its_timeout_is_504_and_cancelled():
    """`X-Request-Timeout` (or the server's request_timeout): 504, or an error event on a
    started stream; the backend's stream is closed (the request cancelled) either way."""
    closed = []

    class Slow(FakeBackend):
        async def generate(self, request, timeout=None):
            try:
                for i in range(100):
                    yield pb.GenerateResponse(token_ids=[i], text=f"t{i} ")
                    await asyncio.sleep(0.05)
            finally:
                closed.append(timeout)

    async def fn(client):
        headers = {"X-Request-Timeout": "0.3"}
        plain = await client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
        streamed = await client.post("/v1/completions", json={"prompt": "x", "stream": True}, headers=headers)
        bad = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Timeout": "soon"})
        return plain.status, await plain.json(), await streamed.text(), bad.status

    status, body, text, bad = _with_app(Slow(), fn)
    assert status == 504 and "0.3 s timeout" in body["error"]["message"] and body["error"]["code"] == 504
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[0].startswith("{") and json.loads(events[-2])["error"]["code"] == 504
    assert bad == 400
    assert closed == [0.3, 0.3]  # the deadline reached the backend, and its stream was closed

    async def server_limit(client):
        r = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Timeout": "60"})
        return r.status, await r.json()

    async def run():
        async with TestClient(TestServer(create_app(Slow(), request_timeout=0.2))) as client:
            return await server_limit(client)

    status, body = asyncio.run(run())
    assert status == 504 and "0.2 s timeout" in body["error"]["message"]


def test_app_over_a_grpc_target(tiny_worker):
    """The router's way in: the app in front of a remote Generation service."""
    async def fn(client):
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                       "ignore_eos": True})
        bad = await client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
        models = await client.get("/v1/models")
        return await r.json(), bad.status, await models.json()

    body, bad_status, models = _with_app(lambda: GrpcBackend(grpc.aio.insecure_channel(tiny_worker.grpc)), fn)
    assert body["usage"]["completion_tokens"] == 4 and bad_status == 404
    with Client(tiny_worker.grpc, timeout=30) as client:
        assert body["choices"][0]["text"] == client.generate("Hello", max_tokens=4, temperature=0, ignore_eos=True).text
    assert models["data"][0]["max_model_len"] == 512
