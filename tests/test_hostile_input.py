"""Hostile input (issue 27): no request may stall, crash or disable the cluster, and every
bad one gets a clear 4xx that names the field, the limit and the value.

Three rings: the HTTP and gRPC fronts in process over a backend that records what reaches
it (refusals before any work, statuses, messages, slow clients); the router in process
over fake workers (gRPC message limits, deadlines, the circuit shown); and a real router
and worker (impossible constraints are 400s that never touch the worker's breaker, the
pydantic tool schema, ids past their limit). The fuzz harness (load/fuzz_api.py,
tests/test_fuzz_api.py) throws the rest at them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import grpc
import jsonschema
import pytest

from cluster.api.errors import InvalidRequest
from cluster.api.limits import GRPC_MAX_MESSAGE_BYTES, MAX_ID_CHARS, RequestLimits
from cluster.api.serving import GRPC_OPTIONS, Endpoints
from cluster.api.servicer import GenerationServicer
from cluster.api.wire import build_request, validate_request
from cluster.net import CHANNEL_OPTIONS
from cluster.platform import can_give_back_freed_memory
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.breaker import CLOSED
from conftest import run

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# -- the fronts in process, over a backend that records what reaches it ------------------------
class RecordingBackend:
    """Answers every request with one finished chunk per sample; keeps what reached it."""

    def __init__(self, limits: RequestLimits):
        self.limits = limits
        self.requests: list[pb.GenerateRequest] = []
        self.timeouts: list[float | None] = []

    async def list_models(self) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="m", max_model_len=4096)])

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None):
        self.requests.append(request)
        self.timeouts.append(timeout)
        for i in range(max(1, request.sampling.n)):
            yield pb.GenerateResponse(request_id=request.request_id, index=i, token_ids=[5], text="ok",
                                      finish_reason=pb.FINISH_REASON_LENGTH,
                                      usage=pb.Usage(prompt_tokens=1, completion_tokens=1))


@pytest.fixture(scope="module")
def served():
    """gRPC + HTTP (`Endpoints`, as the worker and router start them) over a RecordingBackend
    whose clients have 1 s for their headers and 1 s for their body."""
    backend = RecordingBackend(RequestLimits(http_header_timeout=1.0, http_body_timeout=1.0))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    endpoints = Endpoints()

    async def start():
        endpoints.bind_grpc("127.0.0.1:0")
        await endpoints.start(lambda s: pb_grpc.add_GenerationServicer_to_server(GenerationServicer(backend), s),
                              backend=backend, http_address="127.0.0.1:0")

    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield SimpleNamespace(backend=backend, http=endpoints.addresses["http"], grpc=endpoints.addresses["grpc"])
    asyncio.run_coroutine_threadsafe(endpoints.stop(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def post(address: str, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, dict | str]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{address}{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def message(out) -> str:
    """An error body's message (OpenAI's and Anthropic's shapes alike)."""
    assert isinstance(out, dict) and isinstance(out.get("error"), dict), out
    return out["error"]["message"]


def test_n_is_refused_before_anything_is_built_for_it(served):
    """`n: 3000000` on /v1/completions built 3 million choices before the check (9-12 s in
    which nothing else was served); n >= 2^32 was a 500."""
    before = len(served.backend.requests)
    for path, body in (("/v1/completions", {"prompt": "hi", "n": 3_000_000}),
                       ("/v1/chat/completions", {**CHAT, "n": 3_000_000}),
                       ("/v1/completions", {"prompt": "hi", "n": 2**32}),
                       ("/v1/completions", {"prompt": ["a", "b"], "n": 10**30})):
        start = time.perf_counter()
        status, out = post(served.http, path, body)
        took = time.perf_counter() - start
        assert status == 400 and out["error"]["param"] == "n", out
        assert f"n={body['n']}" in message(out) and "at most 16" in message(out)
        assert took < 2.0, f"{path} n={body['n']} refused after {took:.1f} s"
    assert len(served.backend.requests) == before  # refused before the backend saw anything
    status, out = post(served.http, "/v1/completions", {"prompt": "hi", "n": 16, "max_tokens": 1})
    assert status == 200 and len(out["choices"]) == 16


def test_a_body_its_content_encoding_does_not_decode_is_a_400(served):
    for encoding in ("gzip", "deflate", "br"):
        status, out = post(served.http, "/v1/chat/completions", CHAT, headers={"Content-Encoding": encoding})
        assert status == 400, (encoding, out)
        assert "content-encoding" in message(out).lower() and encoding in message(out), out
    # and the connection, whose body was not read whole, is closed: a keep-alive client never
    # writes its next request onto it (that was a reset)
    body = json.dumps(CHAT).encode()
    _, out = raw_http(served.http, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                   b"Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
                                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
    head = out.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 400") and b"connection: close" in head, out[:300]


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                                 b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
                                 b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}'])
def test_json_is_strict(served, raw):
    """NaN / Infinity were accepted, and /v1/responses echoed a bare NaN back (not JSON)."""
    for path, body in (("/v1/chat/completions", raw),
                       ("/v1/responses", raw.replace(b'"messages": [{"role": "user", "content": "hi"}]',
                                                     b'"input": "hi"'))):
        status, out = post(served.http, path, raw=body)
        assert status == 400 and "not valid JSON" in message(out) and "finite" in message(out), out


def deep(levels: int) -> str:
    """JSON text of `levels` arrays within each other."""
    return "[" * levels + "]" * levels


def with_deep(body: dict, levels: int) -> bytes:
    """`body` as JSON with each "DEEP" value nested `levels` deep (past what json.dumps in
    this process could write)."""
    return json.dumps(body).replace('"DEEP"', deep(levels)).encode()


USER = {"role": "user", "content": "hi"}
# JSON nested past MAX_JSON_DEPTH wherever a client can put it: inside strings parsed later
# (5,000 deep: past Python's recursion limit), and in the body itself just under the depth
# the body's parser holds (then walked again, deeper in the stack). Each was a 500 (and a
# logged RecursionError) on the router or a worker: (path, body, param, the field named).
NESTED = {
    "history arguments": ("/v1/chat/completions", json.dumps(
        {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep(5000)}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}).encode(),
        "messages", "'messages[1].tool_calls[0].function.arguments'"),
    "responses function_call": ("/v1/responses", json.dumps(
        {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep(5000)},
                   {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
         "max_output_tokens": 2}).encode(),
        "input", "'input[0].arguments'"),
    "tools": ("/v1/chat/completions", with_deep(
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "default": "DEEP"}}}]}, 900), "tools", "'tools'"),
    "chat_template_kwargs": ("/v1/chat/completions", with_deep({**CHAT, "chat_template_kwargs": {"x": "DEEP"}}, 900),
                             "chat_template_kwargs", "'chat_template_kwargs'"),
    "response_format": ("/v1/chat/completions", with_deep(
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "default": "DEEP"}}}}, 900), "response_format", "'response_format'"),
}


def check_nested_refused(http: str) -> None:
    for what, (path, raw, param, field) in NESTED.items():
        status, out = post(http, path, raw=raw)
        assert status == 400, (what, out)
        assert out["error"]["param"] == param and field in message(out), (what, out)
        assert "nested more than 64 levels deep" in message(out), (what, out)


def nested_grpc_requests() -> dict[str, pb.GenerateRequest]:
    """The same over gRPC, where these fields are JSON text (and NaN, which HTTP refuses)."""
    out = {"tools": build_request(messages=[USER], tools=deep(5000)),
           "json_schema": build_request(messages=[USER], structured={"json_schema": deep(5000)}),
           "history arguments": build_request(messages=[USER, {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "function": {"name": "f", "arguments": deep(5000)}}]}])}
    for what, kwargs in (("chat_template_kwargs", deep(5000)), ("NaN chat_template_kwargs", '{"x": NaN}'),
                         ("Infinity chat_template_kwargs", '{"enable_thinking": -Infinity}')):
        out[what] = build_request(messages=[USER], max_tokens=2)
        out[what].chat_template_kwargs = kwargs
    return out


def check_nested_grpc_refused(address: str) -> None:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for what, request in nested_grpc_requests().items():
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, e.value)
            words = "not valid JSON" if "NaN" in what or "Infinity" in what else "nested more than 64 levels deep"
            assert words in e.value.details(), (what, e.value.details())
        assert list(stub.Generate(build_request(messages=[USER], max_tokens=1), timeout=60))[-1].finish_reason


def test_json_nested_anywhere_is_a_400_naming_the_field(served):
    check_nested_refused(served.http)
    status, out = post(served.http, "/v1/chat/completions", raw=with_deep({**CHAT, "chat_template_kwargs": {
        "x": "DEEP"}}, 63))  # at the limit: served
    assert status == 200, out


def test_json_over_grpc_is_checked_as_http_checks_it():
    """NaN in chat_template_kwargs was accepted over gRPC (HTTP refuses it); nested JSON in
    tools, json_schema or chat_template_kwargs was UNKNOWN (a RecursionError)."""
    for what, request in nested_grpc_requests().items():
        with pytest.raises(InvalidRequest) as e:
            validate_request(request)
        assert "finite" in e.value.message if "NaN" in what or "Infinity" in what else "64" in e.value.message


def test_a_lone_surrogate_is_a_400_not_a_500(served):
    status, out = post(served.http, "/v1/chat/completions",
                       raw=b'{"messages": [{"role": "user", "content": "a\\udc80b"}], "max_tokens": 2}')
    assert status == 400 and "surrogate" in message(out)
    status, out = post(served.http, "/v1/chat/completions",  # a proper pair is text
                       raw=b'{"messages": [{"role": "user", "content": "\\ud83c\\udf4e"}], "max_tokens": 2}')
    assert status == 200, out


def test_x_request_timeout_must_be_a_finite_number_of_seconds(served):
    """`inf` (or 1e308) on the router overflowed the gRPC deadline: an instant 504."""
    for value in ("inf", "-inf", "nan", "0", "-1", "soon", "1e309"):
        status, out = post(served.http, "/v1/chat/completions", CHAT, headers={"X-Request-Timeout": value})
        assert status == 400 and out["error"]["param"] == "X-Request-Timeout" and "finite" in message(out), out
    status, out = post(served.http, "/v1/chat/completions", CHAT, headers={"X-Request-Timeout": "1e308"})
    assert status == 200 and served.backend.timeouts[-1] is None  # past any deadline gRPC holds: none
    status, out = post(served.http, "/v1/chat/completions", CHAT, headers={"X-Request-Timeout": "30"})
    assert status == 200 and served.backend.timeouts[-1] == 30.0


ANTHROPIC = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, param, words", [
    # the field, the limit and the value, in the client's own field names
    ("/v1/chat/completions", {**CHAT, "max_tokens": "x"}, "max_tokens", ["'max_tokens' must be an integer", '"x"']),
    ("/v1/chat/completions", {**CHAT, "stream_options": "x"}, "stream_options", ["must be an object"]),
    ("/v1/chat/completions", {**CHAT, "tools": {}}, "tools", ["must be an array"]),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1099511627776": 1}}, "logit_bias",
     ["1099511627776", "out of range", "2147483647"]),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs",
     ["'top_logprobs' must be between 0 and 20, got 50"]),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**31}, "top_k", ["between 0 and 2147483647", "2147483648"]),
    ("/v1/chat/completions", {**CHAT, "seed": 2**70}, "seed", ["'seed'", str(2**70)]),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     ["'max_completion_tokens' must be between 1"]),
    # max_tokens' range (api/limits.py), one past the wire's uint32, in each API's words
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**32}, "max_tokens",
     ["'max_tokens' must be between 1 and 4294967295", "4294967296"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**32}, "max_tokens",
     ["'max_tokens' must be between 0 and 4294967295", "4294967296"]),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2**32}, "max_output_tokens",
     ["'max_output_tokens' must be between 1 and 4294967295", "4294967296"]),
    ("/v1/messages", {**ANTHROPIC, "max_tokens": 2**32}, None, ["max_tokens: Input should be", "4294967296"]),
    ("/v1/chat/completions", {**CHAT, "stop": ["x" * 300]}, "stop", ["300 characters", "at most 256", "'stop'"]),
    ("/v1/chat/completions", {**CHAT, "model": "m" * 300}, "model", ["300 characters", "256"]),
    ("/v1/completions", {"prompt": [1, 2**31]}, "prompt", ["prompt token id 2147483648", "out of range"]),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(65))}, "stop_token_ids",
     ["65 stop token ids", "at most 64", "'stop_token_ids'"]),
    ("/v1/responses", {"input": "hi", "max_output_tokens": -1}, "max_output_tokens",
     ["'max_output_tokens' must be between 1", "-1"]),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens", ["'max_output_tokens'"]),
    ("/v1/responses", {"input": "hi", "metadata": {"k": "v" * 600}}, "metadata", ["at most 512"]),
    ("/v1/responses", {"input": [{"type": {"a": 1}}]}, "input", ["input[0].type must be a string"]),
    ("/v1/messages", {**ANTHROPIC, "stop_sequences": [""]}, None, ["stop_sequences", "empty stop string"]),
    ("/v1/messages", {**ANTHROPIC, "stop_sequences": ["s"] * 17}, None, ["stop_sequences", "17", "at most 16"]),
    ("/v1/messages", {**ANTHROPIC, "max_tokens": "x"}, None, ["max_tokens: Input should be an integer"]),
    ("/v1/messages", {**ANTHROPIC, "tool_choice": {"type": ["x"]}}, None, ["tool_choice.type"]),
    ("/v1/messages", {**ANTHROPIC, "tools": [{"name": "f", "input_schema": "x"}]}, None, ["tools.0.input_schema"]),
])
def test_messages_name_the_field_the_limit_and_the_value(served, path, body, param, words):
    status, out = post(served.http, path, body)
    assert status == 400, out
    text = message(out)
    for w in words:
        assert w in text, (w, text)
    for wrong in ("INVALID_ARGUMENT", "a int", "a dict", "a list", "a str ", "Value out of range", "must be >= 0"):
        assert wrong not in text, (wrong, text)
    if path == "/v1/messages":
        assert out["type"] == "error" and "'stop'" not in text and "stop strings in 'stop'" not in text
    else:
        assert out["error"]["param"] == param, out
    if path == "/v1/responses":
        assert "max_tokens" not in text.replace("max_output_tokens", "")


def test_no_error_echoes_a_clients_megabytes(served):
    """Values quoted back in a message are cut: an error is never an amplifier."""
    huge = "z" * 1_000_000
    for path, body in (("/v1/chat/completions", {**CHAT, huge: 1}),
                       ("/v1/chat/completions", {**CHAT, "max_tokens": huge}),
                       ("/v1/chat/completions", {"messages": [{"role": huge, "content": "x"}]}),
                       ("/v1/chat/completions", {**CHAT, "response_format": {"type": huge}}),
                       ("/v1/responses", {"input": "hi", "previous_response_id": huge}),
                       ("/v1/messages", {**ANTHROPIC, huge: 1})):
        status, out = post(served.http, path, body)
        assert status in (400, 404) and len(json.dumps(out)) < 2000, (path, len(json.dumps(out)))


def test_the_responses_store_is_bounded_in_text_as_well_as_in_count():
    """1,024 responses, each with its whole conversation (up to a context of text): by count
    alone a 32k-token model's could hold a gigabyte."""
    from cluster.api.responses import ResponseStore

    store = ResponseStore(max_entries=100, max_chars=50_000)
    for i in range(30):
        store.put(f"r{i}", [{"role": "user", "content": "x" * 10_000}], {"id": f"r{i}"})
    assert store.chars <= 50_000 and len(store) == 4  # the newest that fit
    assert store.get("r29")[1] == {"id": "r29"} and store.get("r25") is None
    store.put("big", [{"role": "user", "content": "y" * 80_000}], {})  # one alone past the bound is kept
    assert len(store) == 1 and store.get("big") is not None
    for i in range(150):
        store.put(f"s{i}", [], {})
    assert len(store) == 100 and store.get("s49") is None and store.get("s50") is not None


def raw_http(address: str, data: bytes, wait: float = 30.0) -> tuple[float, bytes]:
    """Send `data` on a fresh connection; (seconds until the server closed it, what came back)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        start = time.monotonic()
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except socket.timeout:
            out += b"<still open>"
        return time.monotonic() - start, out


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + b"a" * 10_000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)) + b"\r\n\r\n",  # TLS to a plain port
])
def test_what_aiohttp_itself_refuses_is_a_json_error(served, data):
    _, out = raw_http(served.http, data)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400" and b"application/json" in head, out[:300]
    assert "the HTTP request could not be read" in json.loads(body)["error"]["message"]


def test_a_slow_client_is_dropped(served):
    """Half the headers, or a body shorter than its Content-Length, held a connection for
    ever; now the header timeout (1 s here) closes it, the body timeout answers 408."""
    took, out = raw_http(served.http, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert out == b"" and 0.5 < took < 10, (took, out)
    took, out = raw_http(served.http, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and "http_body_timeout" in json.loads(body)["error"]["message"]
    assert 0.5 < took < 10, took  # and closed, not left lingering
    status, _ = post(served.http, "/v1/chat/completions", CHAT)  # a client on time is served
    assert status == 200


def test_an_idle_keep_alive_connection_outlives_the_header_timeout(served):
    """The header timeout (1 s here, 30 s by default) was aiohttp's keep-alive timer, which
    also closed idle keep-alive connections that soon: before the proxies and client pools
    that keep one longer (nginx 60 s, Go 90 s), whose next request written on it as it
    closed failed. Idle keep-alive is now aiohttp's own (an hour); a request begun on an
    idle connection still has the header timeout for its headers."""
    body = json.dumps(CHAT).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    host, port = served.http.rsplit(":", 1)

    def answer(s: socket.socket) -> bytes:
        out = b""
        while b"\r\n\r\n" not in out:
            out += s.recv(65536) or b"<closed>"
            assert not out.endswith(b"<closed>"), out
        head, _, rest = out.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += s.recv(65536)
        return head

    with socket.create_connection((host, int(port)), timeout=30) as s:
        for _ in range(2):
            s.sendall(request)
            assert answer(s).startswith(b"HTTP/1.1 200"), "a request on a kept-alive connection was refused"
            time.sleep(2.5)  # idle, longer than the header timeout
        s.sendall(request[:40])  # a request begun, its headers never finished: dropped at the header timeout
        start = time.monotonic()
        assert s.recv(65536) == b""
        assert 0.5 < time.monotonic() - start < 10


def test_bytes_that_are_not_a_protobuf_are_invalid_argument(served):
    with grpc.insecure_channel(served.grpc) as ch:
        for method, call in (("Generate", ch.unary_stream), ("ListModels", ch.unary_unary)):
            rpc = call(f"/orchard.v1.Generation/{method}", request_serializer=lambda b: b,
                       response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as e:
                result = rpc(b"\xff\xff\xff\xff not a protobuf", timeout=30)
                list(result) if method == "Generate" else None
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert "not a valid protobuf message" in e.value.details()
        stub = pb_grpc.GenerationStub(ch)  # a well-formed request after them is served
        chunks = list(stub.Generate(build_request("hi", max_tokens=1), timeout=30))
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


def _large_objects_referenced(min_bytes: int) -> list[str]:
    """What the objects the cyclic collector tracks hold that is `min_bytes` or more: byte
    strings, strings and protobuf messages, whether reachable or garbage awaiting collection."""
    import gc

    from google.protobuf.message import Message

    found = []
    for holder in gc.get_objects():
        for o in gc.get_referents(holder):
            size = o.ByteSize() if isinstance(o, Message) else len(o) if isinstance(o, (bytes, str)) else 0
            if size >= min_bytes:
                found.append(f"{type(o).__name__} of {size} bytes in a {type(holder).__name__}")
    return found


def test_a_refused_grpc_request_is_not_kept_until_the_next_full_collection():
    """grpc.aio keeps an aborted call's exception in a reference cycle (its RPCState holds it),
    and with it the frames it was raised through: each refused request's bytes and decoded
    message lived until Python's next full collection, thousands of requests later (a router
    grew by 110 MB with 8 refused 16 MB requests). Only grpc's own small objects stay."""
    import gc

    from cluster.router.server import RouterConfig, RouterServer

    big = 4 << 20
    bodies = (lambda: pb.GenerateRequest(text="x" * big,
                                         sampling=pb.SamplingParams(temperature=-1)).SerializeToString(),
              lambda: b"\xff" * big)  # a bad field; not a protobuf

    async def refuse_each() -> list[str]:
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None))
        await router.start()
        try:
            async with grpc.aio.insecure_channel(router.grpc_address, options=CHANNEL_OPTIONS) as ch:
                generate = ch.unary_stream("/orchard.v1.Generation/Generate")
                for body in bodies:
                    code = None
                    try:
                        async for _ in generate(body()):
                            pass
                    except grpc.aio.AioRpcError as e:
                        code = e.code()
                    assert code == grpc.StatusCode.INVALID_ARGUMENT
            return _large_objects_referenced(big)
        finally:
            await router.stop(0)

    # what earlier tests in this process left (a fake hub's files, a download's buffer) is
    # theirs: only what these requests add counts
    gc.collect()
    before = Counter(_large_objects_referenced(big))
    gc.disable()  # no collection may free the cycles by chance before they are looked for
    try:
        held = asyncio.run(asyncio.wait_for(refuse_each(), 60))
    finally:
        gc.enable()
    assert list((Counter(held) - before).elements()) == []


def test_ids_and_names_are_bounded():
    validate_request(build_request("hi", request_id="r" * MAX_ID_CHARS))
    for kwargs, words in ((dict(request_id="r" * (MAX_ID_CHARS + 1)), "request_id has 257 characters: at most 256"),
                          (dict(model="m" * 300), "model has 300 characters"),
                          (dict(messages=[{"role": "user", "content": "x", "name": "n" * 300}]), "name has 300"),
                          (dict(messages=[{"role": "u" * 300, "content": "x"}]), "role has 300"),
                          (dict(messages=[{"role": "user", "content": "x"}],
                                tools=[{"type": "function", "function": {"name": "f" * 300}}]), "300 characters")):
        prompt = None if "messages" in kwargs else "hi"
        with pytest.raises(InvalidRequest, match=words):
            validate_request(build_request(prompt, **kwargs))


LARGE_BLOCKS_ON_A_THREAD = """
import ctypes, sys, threading
from cluster import platform
if sys.argv[1] == "given back":
    platform.give_back_large_blocks_when_freed()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

def receive():  # as grpc's threads receive large messages, one after another
    for _ in range(3):
        block = libc.malloc(16 << 20)
        ctypes.memset(block, 1, 16 << 20)
        libc.free(block)

before = platform.resident_bytes()
thread = threading.Thread(target=receive)
thread.start()
thread.join()
platform.give_back_freed_memory()
print(platform.resident_bytes() - before)
"""


@pytest.mark.skipif(not can_give_back_freed_memory(), reason="glibc's allocator")
def test_large_blocks_freed_on_a_thread_are_given_back():
    """glibc moves its mmap threshold up to the largest block freed: the next 16 MiB block
    came from the thread's arena, whose free top malloc_trim does not give back (the router
    kept every large message grpc's threads had received)."""
    def growth(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", LARGE_BLOCKS_ON_A_THREAD, mode], capture_output=True, text=True,
                             timeout=120, check=True)
        return int(out.stdout)

    assert growth("default") >= 8 << 20  # what glibc does by itself: the case this guards against
    assert growth("given back") < 4 << 20


def test_a_router_given_large_refused_requests_shrinks_back(tmp_path):
    """A router refused three 16 MiB requests (a bad field; not a protobuf): it held them
    all (reference cycles, then glibc's thread arenas) and stayed 100 MB larger. It goes
    back to its size before them, within one such request, once idle."""
    from cluster.platform import resident_bytes
    from cluster.up import free_port

    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "cluster", "router", "serve", "--grpc", f"127.0.0.1:{port}",
                               "--http", "", "--metrics", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            generate = ch.unary_stream("/orchard.v1.Generation/Generate")
            before = resident_bytes(router.pid)
            size = 16 << 20
            for body in (pb.GenerateRequest(text="x" * size, sampling=pb.SamplingParams(temperature=-1)),
                         b"\xff" * size, pb.GenerateRequest(text="x" * size, model="m" * 300)):
                with pytest.raises(grpc.RpcError) as e:
                    list(generate(body if isinstance(body, bytes) else body.SerializeToString(), timeout=60))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        deadline = time.monotonic() + 60  # its trimmer gives freed memory back every 5 s while busy, and once after
        while resident_bytes(router.pid) > before + size and time.monotonic() < deadline:
            time.sleep(0.5)
        assert resident_bytes(router.pid) <= before + size, (before, resident_bytes(router.pid))
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_freed_memory_is_given_back_once_the_process_has_grown(monkeypatch):
    """glibc kept what a burst of grammar compiles or large bodies freed: the fuzz's worker
    stayed 27% larger after it (10% with the trim)."""
    from cluster.api import serving

    class Done(Exception):
        pass

    readings = [100, 104, 120, 90, 95, 110, 101, 105, 200, 150]

    def rss():
        if not readings:
            raise Done
        return readings.pop(0)

    trims = []
    monkeypatch.setattr(serving, "resident_bytes", rss)
    monkeypatch.setattr(serving, "give_back_freed_memory", lambda: trims.append(0))
    monkeypatch.setattr(serving, "_cpu_seconds", lambda: 0.0)  # never busy: only its size counts
    monkeypatch.setattr(serving, "TRIM_EVERY_SECONDS", 0.0)
    monkeypatch.setattr(serving, "TRIM_GROWTH_BYTES", 8)

    async def main():
        with pytest.raises(Done):  # the readings run out
            await serving._trim_freed_memory()

    asyncio.run(main())
    # floor 100: 104 stays, 120 trims (90 after), 95 stays, 110 trims (101 after), 105 stays, 200 trims
    assert trims == [0, 0, 0]
    # the router kept 7-9 MB freed after the fuzz: it had shrunk since its last trim, then grown
    # back by less than 8 MB over that trim's size. The growth counts from its smallest size
    readings[:] = [100, 120, 100, 80, 86, 89, 87, 95, 90]
    trims.clear()
    asyncio.run(main())
    # floor 100: 120 trims (100 after), 80 lowers it, 86 stays, 89 trims (87 after), 95 trims
    assert trims == [0, 0, 0]
    # what a burst freed as it ended, after the last trim, changed no size: kept for good. Now
    # the trims go on while the process is busy (CPU time), and once after
    readings[:] = [100] * 12
    cpu = iter([0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.01, 2.02])
    monkeypatch.setattr(serving, "_cpu_seconds", lambda: next(cpu))
    trims.clear()
    asyncio.run(main())
    # busy, after, idle, idle, busy, after, idle, idle (10 ms: heartbeats)
    assert len(trims) == 4


# -- the router in process, over fake workers ----------------------------------------------------
def test_grpc_message_limits_agree_end_to_end():
    """Servers took 64 MB while the router's channels to workers (and the SDK's) kept gRPC's
    4 MB default: a 5 MB chunk failed the worker (RESOURCE_EXHAUSTED, counted against it)."""
    from cluster.sdk import AsyncClient
    from test_router_fake import Cluster

    for options in (GRPC_OPTIONS, CHANNEL_OPTIONS):
        assert dict(options)["grpc.max_receive_message_length"] == GRPC_MAX_MESSAGE_BYTES
        assert dict(options)["grpc.max_send_message_length"] == GRPC_MAX_MESSAGE_BYTES

    async def main():
        async with Cluster(n_workers=1) as c:
            c.workers[0].padding = 5 << 20
            async with AsyncClient(c.router.grpc_address) as client:
                out = await client.generate("hello", max_tokens=2, temperature=0)
            assert len(out.text) > 10 << 20 and out.finish_reason == "length"
            breaker = c.router.registry.workers["w0"].breaker
            assert breaker.state == CLOSED and breaker.failures == 0

    run(main())


def test_a_message_past_grpcs_limit_is_the_clients_error_not_the_workers():
    """RESOURCE_EXHAUSTED "larger than max" is the size of what was asked for: INVALID_ARGUMENT
    to the client, no retry elsewhere, nothing against the worker."""
    from test_router_fake import Cluster

    async def main():
        async with Cluster(n_workers=2) as c:
            for w in c.workers:
                w.padding = GRPC_MAX_MESSAGE_BYTES + 1024
            # the workers' health is theirs to report: not marked failed for the request's size (their
            # heartbeats, in this process, may come late behind 64 MB answers on a loaded machine)
            marked = []
            c.router.registry.mark_failed = lambda worker_id, why: marked.append((worker_id, why))
            for _ in range(4):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.generate("hello", max_tokens=1)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "larger than" in e.value.details()
            assert sum(len(w.requests) for w in c.workers) == 4  # each tried once: not retried elsewhere
            assert marked == []
            for record in c.router.registry.snapshot():
                assert record.breaker.state == CLOSED and record.breaker.failures == 0
            assert 'outcome="failed"' not in await c.metrics()

    run(main())


def test_client_errors_are_no_verdict_on_a_worker_either_way():
    """A request's own error (INVALID_ARGUMENT) counted as a success: bad requests between
    a worker's failures reset its count, and its circuit never opened."""
    from test_router_fake import Cluster

    async def main():
        async with Cluster(n_workers=1, circuit_cooldown=30.0) as c:
            c.workers[0].fail_with = grpc.StatusCode.INTERNAL  # every request but the fake's "invalid" one
            for i in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.generate("invalid")
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError):
                    await c.generate(f"q{i}")
            assert c.router.registry.workers["w0"].breaker.state != CLOSED

    run(main())


def test_the_router_serves_a_deadline_too_far_for_grpc():
    from test_router_fake import Cluster

    async def main():
        async with Cluster(n_workers=1) as c:
            for timeout in (1e308, float("inf")):
                chunks = [ch async for ch in c.router.backend.generate(build_request("hi", max_tokens=2), timeout)]
                assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH

    run(main())


def test_a_request_no_worker_can_serve_is_its_error_even_past_its_deadline():
    """A rerank on a generation model with a 1 ns deadline was a 504 "the deadline passed
    while waiting for a worker": waiting could not have helped, the 400 is the answer."""
    from cluster.api.pooling import build_score_request
    from test_router_fake import Cluster

    async def main():
        async with Cluster(n_workers=1) as c:
            with pytest.raises(InvalidRequest, match="is a generation model"):
                await c.router.backend.score(build_score_request("q", ["d"]), timeout=1e-9)
            chunks = [ch async for ch in c.router.backend.generate(build_request("hi", max_tokens=2), 30.0)]
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH

    run(main())


def test_router_workers_shows_a_circuit_that_is_open():
    """The breaker held a worker off while `orchard router workers` said healthy."""
    from cluster.router.admin import format_workers
    from test_router_fake import Cluster

    async def main():
        async with Cluster(n_workers=1, circuit_cooldown=30.0) as c:
            listed = (await c.ctl.ListWorkers(pb.ListWorkersRequest())).workers
            assert listed[0].circuit == "closed" and "circuit" not in format_workers(listed)
            c.workers[0].fail_with = grpc.StatusCode.INTERNAL
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError):
                    await c.generate("hello")
            listed = (await c.ctl.ListWorkers(pb.ListWorkersRequest())).workers
            assert listed[0].circuit == "open" and "healthy, circuit open" in format_workers(listed)

    run(main())


# -- the worker's side: grammars that cannot go on ---------------------------------------------
@pytest.fixture(scope="module")
def grammars(tiny_model_dir):
    from mlx_lm.tokenizer_utils import load

    from cluster.worker.structured import GrammarCompiler

    tok = load(tiny_model_dir)
    return GrammarCompiler(tok, len(tok.get_vocab()), tok.eos_token_ids)


LOC = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
       "additionalProperties": False}
PYDANTIC = {"$defs": {"Loc": LOC}, "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}},
            "required": ["where"], "title": "Args"}
IMPOSSIBLE = {  # what was an empty 200 "stop" (or broke the worker), and the refusal's words
    "schema that is only itself": ("json_schema", {"$ref": "#"}, "matches no output"),
    "defs that point at each other": ("json_schema", {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
                                                      "$ref": "#/$defs/A"}, "matches no output"),
    "object that must hold itself": ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#"}},
                                                     "required": ["a"]}, "cannot be followed"),
    "regex of no string": ("regex", "[^\\x00-\\U0010FFFF]", "matches no output"),
    "regex past the decoder's limits": ("regex", "a{1000000}", "cannot be followed"),
    "regex past the lexer's fuel": ("regex", "a{200000}", "cannot be followed"),  # compiled: 1 s, 90 MB kept
    "grammar with no finite string": ("grammar", 'start: a\na: "x" a', "cannot be followed"),
    "only the empty string": ("regex", "(a){0}", "only the empty string"),
}


@pytest.mark.parametrize("what", sorted(IMPOSSIBLE))
def test_a_grammar_no_output_can_follow_is_refused_before_any_engine_work(grammars, what):
    from cluster.worker.sampling_params import StructuredOutput
    from cluster.worker.structured import InvalidGrammar

    kind, spec, words = IMPOSSIBLE[what]
    spec = StructuredOutput(kind, spec if isinstance(spec, str) else json.dumps(spec))
    with pytest.raises(InvalidGrammar, match=words):
        grammars.compile(spec)
    compiles = grammars.compiles
    start = time.perf_counter()
    with pytest.raises(InvalidGrammar, match=words):  # a repeat costs nothing: the refusal is cached
        grammars.compile(spec)
    assert grammars.compiles == compiles and time.perf_counter() - start < 0.1


@pytest.mark.parametrize("what", ["regex of no string", "object that must hold itself",
                                  "grammar with no finite string", "only the empty string"])
def test_a_refused_grammar_keeps_nothing_of_its_matcher(tiny_model_dir, what):
    """The refusal's traceback held the frames that built and walked the matcher, so the
    matcher and its copy lived as long as the exception (37 MB for a{120000}), which the
    worker's error path leaves in a reference cycle until Python's next full collection: the
    fuzz's worker stayed 10-26% larger, by how many such refusals awaited one."""
    from mlx_lm.tokenizer_utils import load

    from cluster.worker.sampling_params import StructuredOutput
    from cluster.worker.structured import GrammarCompiler, InvalidGrammar

    tok = load(tiny_model_dir)
    grammars = GrammarCompiler(tok, len(tok.get_vocab()), tok.eos_token_ids)  # its own: nothing cached yet
    kind, spec, _ = IMPOSSIBLE[what]
    with pytest.raises(InvalidGrammar) as e:
        grammars.compile(StructuredOutput(kind, spec if isinstance(spec, str) else json.dumps(spec)))
    assert e.value.__context__ is None and e.value.__cause__ is None
    tb, held = e.value.__traceback__, []
    while tb is not None:
        held += [f"{tb.tb_frame.f_code.co_name}: {name}" for name, value in tb.tb_frame.f_locals.items()
                 if type(value).__name__ == "LLMatcher"]
        tb = tb.tb_next
    assert not held, held


def test_grammars_that_were_costly_to_compile_are_few_in_the_cache(grammars, monkeypatch):
    """Each held its large lexer for as long as it stayed cached (256 of them: gigabytes)."""
    from cluster.worker import structured
    from cluster.worker.sampling_params import StructuredOutput

    monkeypatch.setattr(structured, "_COSTLY_SECONDS", 0.0)  # every compile counts as costly here
    specs = [StructuredOutput("regex", f"[a-z]{{{n}}}costly") for n in range(1, 7)]
    for spec in specs:
        grammars.compile(spec)
    compiles = grammars.compiles
    for spec in specs[-structured._COSTLY_ENTRIES:]:  # the last few are kept
        grammars.compile(spec)
    assert grammars.compiles == compiles
    grammars.compile(specs[0])  # the first was dropped: compiled again
    assert grammars.compiles == compiles + 1


def test_a_pydantic_tool_schema_keeps_its_defs_under_a_forced_call(grammars):
    """Embedded in the call's wrapper, "#/$defs/Loc" pointed nowhere: a 400 for a valid schema."""
    from cluster.worker.structured import InvalidGrammar, tool_call_constraint

    tools = [{"type": "function", "function": {"name": "where", "parameters": PYDANTIC}},
             {"type": "function", "function": {"name": "again", "parameters": {
                 "$defs": {"Loc": {"type": "integer"}}, "type": "object",
                 "properties": {"n": {"$ref": "#/$defs/Loc"}, "more": {"$ref": "#"}}}}}]
    for choice in ("required", "where", "again"):
        for family in (None, ("<tool_call>\n", "\n</tool_call>")):
            grammars.compile(tool_call_constraint(tools, choice, family))
    spec = tool_call_constraint([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
                                "required", ("<tool_call>\n", "\n</tool_call>"))
    with pytest.raises(InvalidGrammar, match="matches no output"):
        grammars.compile(spec)


class GivesUp:
    """A real matcher that gives up (as llguidance does past its limits) at its n-th token."""

    def __init__(self, inner, n: int):
        self.inner, self.n, self.seen = inner, n, 0

    def consume_token(self, token: int) -> bool:
        self.seen += 1
        return self.seen < self.n and self.inner.consume_token(token)

    def is_error(self) -> bool:
        return self.seen >= self.n

    def get_error(self) -> str:
        return "parser error: Too many items (limit 50000)\n<state>...</state>" if self.is_error() else ""

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_grammar_that_gives_up_mid_output_ends_with_its_reason(tiny_model_dir, monkeypatch):
    """Its mask then allows only EOS: the sequence ended "stop" with what it had, a valid-
    looking answer. Now it ends "abort" with an error that says why."""
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams, StructuredOutput

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=64, max_model_len=256))
    matcher_for = engine.grammars.matcher_for
    monkeypatch.setattr(engine.grammars, "matcher_for", lambda spec, tokens=(): GivesUp(matcher_for(spec, tokens), 3))
    spec = StructuredOutput("regex", "[a-z]{40}")
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0, structured=spec))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    last = outputs[-1]
    assert len(outputs) == 3 and last.finished and last.finish_reason == "abort"
    assert "could not be followed after 2 tokens" in last.error and "Too many items" in last.error
    assert "<state>" not in last.error
    compiles = engine.grammars.compiles
    engine.grammars.compile(spec)  # forgotten: compiled afresh
    assert engine.grammars.compiles == compiles + 1


def test_the_worker_answers_a_grammar_that_gave_up_as_the_clients_error():
    """INVALID_ARGUMENT, which the router relays and never counts against the worker; not an
    "abort" finish, which it takes for the worker failing."""
    from cluster.worker.engine import RequestOutput
    from scripted_engine import FakeEngine
    from test_worker_service import collect, run_with_service

    class GivesUpEngine(FakeEngine):
        """Its "gives-up" requests end at their second token for what they asked."""

        def step(self):
            outs = super().step()
            for i, o in enumerate(outs):
                if o.request_id.startswith("gives-up") and o.num_output_tokens == 2:
                    self.seqs.pop(o.request_id, None)
                    outs[i] = RequestOutput(o.request_id, [], "", True, "abort", num_prompt_tokens=1,
                                            error="the structured output's regex could not be followed after 2 tokens")
            return outs

    async def check(svc, engine):
        got = []
        with pytest.raises(InvalidRequest, match="could not be followed after 2 tokens"):
            async for chunk in svc.generate(build_request("hi", max_tokens=8, request_id="gives-up")):
                got.append(chunk)
        assert [t for c in got for t in c.token_ids] == [100]  # what came before, then the error
        assert not engine.seqs
        assert (await collect(svc, build_request("hi", max_tokens=1)))[-1].finish_reason  # still serving

    run_with_service(check, GivesUpEngine())


# -- a real router and worker ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    from cluster.up import LocalCluster, free_port

    c = LocalCluster(tiny_model_dir, workers=1, grpc_address=f"127.0.0.1:{free_port()}",
                     http_address=f"127.0.0.1:{free_port()}", metrics_address=f"127.0.0.1:{free_port()}",
                     worker_port_base=0, worker_metrics_port_base=0, log_dir=tmp_path_factory.mktemp("hostile-logs"),
                     router_args=["--heartbeat-interval", "0.2"],
                     worker_args=["--num-kv-blocks", "256", "--max-model-len", "512"])
    with c:
        yield c


def router_state(c) -> tuple[str, str]:
    """(`orchard router workers`' output, the router's /metrics)."""
    listed = subprocess.run([sys.executable, "-m", "cluster.cli", "router", "workers", "--router", c.router_address],
                            capture_output=True, text=True, timeout=60)
    with urllib.request.urlopen(f"http://{c.metrics_address}/metrics", timeout=30) as r:
        return listed.stdout, r.read().decode()


def tool(params: dict, name: str = "f") -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": params}}]


def test_impossible_constraints_are_400s_that_leave_the_worker_alone(cluster):
    """Each was an empty 200 "stop", or a 503 "worker failed (ABORTED)" counted against a
    healthy worker: three of those opened its circuit for every client."""
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": spec}}}
              if kind == "json_schema" else {f"guided_{kind}": spec}
              for kind, spec, _ in IMPOSSIBLE.values()]
    bodies += [{"tools": tool({"$ref": "#"}), "tool_choice": "required"},
               {"tools": tool({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
                "tool_choice": {"type": "function", "function": {"name": "f"}}}]
    for body in bodies * 2:
        status, out = post(cluster.http_address, "/v1/chat/completions", {**CHAT, "max_tokens": 64, **body})
        assert status == 400, (body, out)
        assert any(w in message(out) for w in ("matches no output", "cannot be followed", "only the empty")), out
    workers, metrics = router_state(cluster)
    assert "healthy" in workers and "circuit" not in workers, workers
    assert 'orchard_router_circuit_open{worker="worker-0"} 0.0' in metrics
    assert 'outcome="failed"' not in metrics
    status, out = post(cluster.http_address, "/v1/chat/completions", CHAT)
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"


def test_a_pydantic_tool_schema_is_served_under_tool_choice_required_and_named(cluster):
    for choice in ("required", {"type": "function", "function": {"name": "locate"}}):
        status, out = post(cluster.http_address, "/v1/chat/completions",
                           {**CHAT, "max_tokens": 96, "temperature": 0, "tools": tool(PYDANTIC, "locate"),
                            "tool_choice": choice})
        assert status == 200, out
        call = out["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "locate"
        jsonschema.validate(json.loads(call["arguments"]), PYDANTIC)


def test_a_request_id_past_its_limit_is_refused_and_never_counted_against_the_worker(cluster):
    """A 5 MB request_id came back in every chunk: past the router's 4 MB channel it "failed"
    the worker with RESOURCE_EXHAUSTED; 1 MB x 100 tokens was 105 MB sent back."""
    for target in (cluster.router_address, cluster.worker_addresses[0]):
        with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            for size in (MAX_ID_CHARS + 1, 5 << 20):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(build_request("hi", max_tokens=2, request_id="r" * size), timeout=60))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"request_id has {size} characters: at most {MAX_ID_CHARS}" in e.value.details()
    workers, metrics = router_state(cluster)
    assert "circuit" not in workers and 'outcome="failed"' not in metrics


def test_json_nested_anywhere_is_refused_by_the_router_and_its_worker(cluster):
    """Over the router's HTTP and gRPC and the worker's gRPC: 400 / INVALID_ARGUMENT naming
    the field and the depth limit, nothing logged as a traceback, both still serving."""
    check_nested_refused(cluster.http_address)
    for address in (cluster.router_address, cluster.worker_addresses[0]):
        check_nested_grpc_refused(address)
    for log in cluster.log_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "RecursionError" not in text, (log.name, text[-3000:])


def test_x_request_timeout_on_the_router(cluster):
    status, out = post(cluster.http_address, "/v1/chat/completions", CHAT, headers={"X-Request-Timeout": "inf"})
    assert status == 400 and "finite" in message(out)
    status, out = post(cluster.http_address, "/v1/chat/completions", CHAT, headers={"X-Request-Timeout": "1e308"})
    assert status == 200, out
