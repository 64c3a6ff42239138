"""Nothing silently ignored: unknown routes and parameters answer in OpenAI's error
shape, /v1/models/{id}, chat's default max_tokens is the rest of the context, chat
logprobs carry each token's own bytes, gRPC reflection lists the services (as grpcurl
does), and the router's health follows whether any worker can take a request."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fake_worker import FakeWorker
from scripted_engine import ScriptedEngine, ScriptedServer


def call(url: str, body: dict | None = None, method: str | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ScriptedServer(ScriptedEngine(tiny_model_dir, reply="ok"))
    yield srv
    srv.stop()


def _is_openai_error(body: dict, status: int) -> bool:
    e = body.get("error", {})
    return set(e) == {"message", "type", "param", "code"} and e["code"] == status and bool(e["message"])


def test_unknown_routes_and_methods_answer_in_openai_shape(server):
    status, body = call(server.url + "/v1/audio/speech", {"input": "x"})
    assert status == 404 and _is_openai_error(body, 404) and "/v1/audio/speech" in body["error"]["message"]
    status, body = call(server.url + "/v1/chat/completions", method="GET")
    assert status == 405 and _is_openai_error(body, 405)
    status, body = call(server.url + "/nope")
    assert status == 404 and _is_openai_error(body, 404)


def test_model_by_id(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    m = client.models.retrieve("tiny-qwen3")
    assert m.id == "tiny-qwen3" and m.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")


@pytest.mark.parametrize("path, body, name", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 5},
     "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
     "response_format"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 3}, "min_tokens"),
])
def test_unknown_or_unserved_parameters_are_refused_by_name(server, path, body, name):
    status, out = call(server.url + path, body)
    assert status == 400 and _is_openai_error(out, 400) and name in out["error"]["message"]
    assert out["error"]["param"] == name


def test_what_clients_send_by_default_is_accepted(server):
    """The parameters real clients send (with no effect on output, or honoured) pass."""
    status, out = call(server.url + "/v1/chat/completions", {
        "model": "tiny-qwen3", "messages": [{"role": "user", "content": "x"}], "user": "u1", "metadata": {"a": "b"},
        "store": False, "seed": 3, "stream": False, "stream_options": None, "n": 1, "presence_penalty": 0,
        "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}, "parallel_tool_calls": True,
        "service_tier": "auto"})
    assert status == 200, out
    status, out = call(server.url + "/v1/completions", {"model": "tiny-qwen3", "prompt": "x", "user": "u",
                                                        "echo": False, "best_of": 1, "logprobs": None, "suffix": None})
    assert status == 200, out


def test_chat_runs_to_the_context_limit_completions_default_to_16(server):
    engine = server.engine
    status, out = call(server.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]})
    assert status == 200
    n_prompt = out["usage"]["prompt_tokens"]
    assert engine.params[-1].max_tokens == engine.config.max_model_len - n_prompt
    status, out = call(server.url + "/v1/completions", {"prompt": "hello"})
    assert status == 200 and engine.params[-1].max_tokens == 16


def test_chat_logprob_bytes_are_the_tokens_own(tiny_model_dir):
    """A token that is part of a multi-byte character is spelled "bytes:\\xNN" and its
    bytes are its own: the bytes of a text's tokens, joined, are the text's UTF-8."""
    from mlx_lm.tokenizer_utils import load

    from cluster.api.openai import token_bytes
    from cluster.worker.stream import TokenTexts

    texts = TokenTexts(load(Path(tiny_model_dir)))
    text = "€ héllo 日本語 ✓"
    tokens = [texts.logprob_text(t) for t in texts.tokenizer.encode(text)]
    assert any(t.startswith("bytes:") for t in tokens) and not any("\ufffd" in t for t in tokens)
    assert bytes(b for t in tokens for b in token_bytes(t)) == text.encode()


def test_chat_logprob_bytes_from_the_real_worker(tiny_worker):
    import openai

    c = openai.OpenAI(base_url=f"http://{tiny_worker.http}/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "日本語"}], max_tokens=8,
                                  logprobs=True, top_logprobs=20, temperature=0)
    entries = [e for lp in r.choices[0].logprobs.content for e in (lp, *lp.top_logprobs)]
    assert entries and not any("\ufffd" in e.token for e in entries)
    for e in entries:
        if e.token.startswith("bytes:"):
            raw = bytes(e.bytes)
            assert e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            assert bytes(e.bytes) == e.token.encode()


async def _services(address: str) -> list[str]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        names = []
        async for r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services=""),
                                                       reflection_pb2.ServerReflectionRequest(
                                                           file_containing_symbol="orchard.v1.Generation")])):
            if r.HasField("list_services_response"):
                names = [s.name for s in r.list_services_response.service]
            else:
                assert r.file_descriptor_response.file_descriptor_proto  # describe works too
        return sorted(names)


def test_worker_reflection_lists_its_services(tiny_worker):
    assert asyncio.run(_services(tiny_worker.grpc)) == [
        "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "orchard.v1.Generation",
        "orchard.v1.WorkerAdmin"]


def test_router_reflection_and_health_follow_its_workers():
    from cluster.router.config import RouterConfig
    from cluster.router.server import RouterServer
    from cluster.worker.registration import Registration

    async def main():
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0",
                                           metrics_address="127.0.0.1:0", join_token="tok", heartbeat_interval=0.2,
                                           remove_after=0.6))
        await router.start()
        worker = reg = None
        try:
            assert await _services(router.grpc_address) == [
                "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "orchard.v1.Fleet",
                "orchard.v1.Generation", "orchard.v1.Router"]
            async with grpc.aio.insecure_channel(router.grpc_address) as ch:
                health = health_pb2_grpc.HealthStub(ch)

                async def status(service: str) -> str:
                    r = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

                async def http_health() -> int:
                    return (await asyncio.to_thread(call, f"http://{router.http_address}/health"))[0]

                async def until(service: str, want: str):
                    for _ in range(200):
                        if await status(service) == want:
                            return
                        await asyncio.sleep(0.05)
                    raise AssertionError(f"{service!r} never became {want}")

                assert await status("") == "NOT_SERVING" and await status("orchard.v1.Generation") == "NOT_SERVING"
                assert await http_health() == 503
                worker = await FakeWorker("w0").start()
                reg = Registration(router.grpc_address, worker.address, worker.load_report, join_token="tok",
                                   worker_id="w0", interval=0.2)
                reg.start()
                await until("orchard.v1.Generation", "SERVING")
                assert await status("") == "SERVING" and await http_health() == 200
                await reg.stop()
                reg = None
                await worker.server.stop(0)
                await until("orchard.v1.Generation", "NOT_SERVING")
                assert await http_health() == 503
        finally:
            if reg is not None:
                await reg.stop()
            if worker is not None:
                await worker.server.stop(0)
            await router.stop(grace=0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_cors_for_the_listed_origins_only(tiny_model_dir):
    """--cors-origins: a listed origin's preflight is answered and its responses (streams
    too) are marked; another origin gets no CORS headers."""
    import requests

    srv = ScriptedServer(ScriptedEngine(tiny_model_dir, reply="hi"), cors_origins=("https://app.example",))
    try:
        url = srv.url + "/v1/chat/completions"
        pre = requests.options(url, headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                             "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "POST" in pre.headers["Access-Control-Allow-Methods"]
        body = {"messages": [{"role": "user", "content": "x"}]}
        for stream in (False, True):
            r = requests.post(url, json={**body, "stream": stream}, headers={"Origin": "https://app.example"})
            assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
        other = requests.post(url, json=body, headers={"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in other.headers
        assert requests.options(url, headers={"Origin": "https://evil.example",
                                              "Access-Control-Request-Method": "POST"}).status_code == 405
    finally:
        srv.stop()
