"""Hostile-input fuzzing of a live router and worker (issue 27): random and malformed
requests over every HTTP route and the gRPC service, while a probe request is timed.

    python load/fuzz_api.py [--model DIR] [--requests 10000] [--concurrency 4] [--seed 0]
                            [--refusal-p99-ms 100] [--probe-ratio 2.0] [--memory-slack 0.10]

It starts a router and one worker (its HTTP on too) on free ports, on the tiny random
model unless --model names one, with 2 s header and body timeouts so that slow clients are
settled quickly. Then:

  1. warm-up: ordinary requests on every route, then --warm-up requests of the fuzz's own
     mix (another seed), so that every path (errors, grammars, pooling) has run once; a
     probe (a greedy 8-token chat completion through the router) is timed while nothing
     else runs; once both servers have been idle --settle seconds, their memory (RSS) is
     noted: the baseline, where a served process settles;
  2. the fuzz: --requests requests, --concurrency at a time, drawn from a seeded generator:
     HTTP bodies with fields of the wrong type, out of range, huge, deeply nested, unknown,
     missing; NaN, lone surrogates, invalid JSON, wrong Content-Encoding, bad
     X-Request-Timeout; impossible and costly constraints, hostile tool schemas; raw bytes
     that are not HTTP (malformed request lines, oversize or too many headers, bad
     Content-Length, a TLS hello, half a request that never ends); gRPC requests with every
     field mutated within its wire type, bytes that are not a protobuf, flipped bits of
     valid messages; to the router and to the worker alike. The probe keeps running;
  3. the verdict, which is the exit status:
       0 responses >= 500 (HTTP status, an SSE error event of 5xx, gRPC UNKNOWN / INTERNAL /
         UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED / DATA_LOSS / CANCELLED; a 504 after the
         request's own X-Request-Timeout, such as 1e-9 s, is its answer, counted as a refusal),
       0 hangs (no answer within 60 s; a slow client not dropped within its timeout),
       the p99 time to a refusal (4xx, or a gRPC client-error status) under --refusal-p99-ms,
       the probe's median latency during the fuzz within --probe-ratio of its idle median,
       both processes' RSS, read again after --settle seconds idle, within --memory-slack
         of the baseline,
       `orchard router workers` showing the worker healthy, no circuit opened (the router's
       orchard_router_circuit_open 0 and no request outcome "failed").

The figures are printed as `name: value` lines (tests/test_fuzz_api.py reads them), then a
table of refusal times by kind, and every failure with the request that caused it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import grpc  # noqa: E402

from cluster.net import CHANNEL_OPTIONS  # noqa: E402
from cluster.platform import resident_bytes  # noqa: E402
from cluster.proto.orchard.v1 import orchard_pb2 as pb  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402

HANG_SECONDS = 60.0
SLOW_CLIENT_TIMEOUT = 2.0  # the cluster's --http-header-timeout and --http-body-timeout here
SERVER_ERROR_CODES = {"UNKNOWN", "INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "DATA_LOSS", "CANCELLED"}
PROBE = {"messages": [{"role": "user", "content": "Say something about orchards."}], "max_tokens": 8,
         "temperature": 0}


# -- what one request did ------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str  # "http router /v1/chat/completions", "grpc worker Generate", "raw router", ...
    label: str  # the mutation
    status: str  # "200", "400", "INVALID_ARGUMENT", "closed", "hang", ...
    seconds: float
    refused: bool = False
    server_error: bool = False
    hang: bool = False
    detail: str = ""


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    warm_outcomes: list[Outcome] = field(default_factory=list)  # the warm-up's: judged as the rest
    probe_idle: list[float] = field(default_factory=list)
    probe_busy: list[float] = field(default_factory=list)
    probe_errors: list[str] = field(default_factory=list)
    memory_before: dict[str, float] = field(default_factory=dict)  # RSS MB by process
    memory_after: dict[str, float] = field(default_factory=dict)
    fuzz_seconds: float = 0.0


# -- the generator ------------------------------------------------------------------------------
NAN = object()  # written as bare NaN / Infinity in the JSON text
DEEP_TEXT = "[" * 3000 + "]" * 3000  # past Python's recursion limit when parsed
SURROGATE = object()  # written as a lone \udc80 escape
HOSTILE = [None, True, False, 0, -1, 1, 7, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, 10**30, -(10**30), 1e308, -1e308,
           0.5, -0.0, 3.7, "", "x", "auto", "a" * 5000, "\u00e9\u4e2d\U0001f34e", [], [1], ["a", "b"], [[[]]], {},
           {"a": 1}, {"type": "text"}, NAN, SURROGATE,
           # JSON text in a string, parsed later (tool call arguments, tools, schemas, template kwargs)
           DEEP_TEXT, '{"x": NaN}']
FIELDS = ["model", "messages", "prompt", "input", "max_tokens", "max_completion_tokens", "max_output_tokens",
          "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_sequences", "stop_token_ids",
          "logprobs", "top_logprobs", "prompt_logprobs", "echo", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "response_format", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls", "stream",
          "stream_options", "ignore_eos", "best_of", "suffix", "user", "metadata", "store", "instructions",
          "previous_response_id", "text", "system", "thinking", "encoding_format", "dimensions", "query",
          "documents", "top_n", "text_1", "text_2", "return_documents", "normalize", "include", "reasoning"]
LOC = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
SCHEMAS = [{"type": "object"}, {"$ref": "#"}, {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
                                               "$ref": "#/$defs/A"},
           {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
           {"$defs": {"Loc": LOC}, "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}}},
           {"type": "string", "maxLength": 3}, {"enum": [1, "a", None]}, False, True, {"type": "nope"},
           {"$ref": "https://example.com/schema.json"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
           {"anyOf": []}, {"type": "integer", "minimum": 5, "maximum": 1}, {"pattern": "(?!x)"}]
REGEXES = ["[a-z]{1,5}", "(a|b)+c", "", "(?!)", "[^\\x00-\\U0010FFFF]", "(a){0}", "\\", "a{2,1}", "(((((a)))))",
           "[a-z]{0,40}@[a-z]{1,9}\\.com", "x{99999999999}"]
GRAMMARS = ['start: "yes" | "no"', 'start: a\na: "x" a', "start:", "start: /[0-9]+/", 'start: "a"*', "%%%",
            'start: b\nb: "(" b ")" | ""']


class Generator:
    """Seeded: the same seed makes the same requests in the same order."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.bombs = 0  # grammars that cost the worker a second to refuse: kept rare

    def value(self):
        r = self.rng
        roll = r.random()
        if roll < 0.65:
            return r.choice(HOSTILE)
        if roll < 0.75:
            return r.randint(-2**70, 2**70)
        if roll < 0.85:
            return "".join(r.choice("ab{}[]\"\\:,\u00e9\x00\n") for _ in range(r.randint(0, 40)))
        if roll < 0.95:
            depth = r.randint(2, 40) if r.random() < 0.8 else r.randint(60, 200)  # past MAX_JSON_DEPTH too
            return json.loads("[" * depth + "]" * depth)
        return {self.name(): self.value() for _ in range(r.randint(1, 4))}

    def name(self) -> str:
        r = self.rng
        return r.choice(FIELDS) if r.random() < 0.7 else r.choice(["", "x" * r.randint(1, 3000), "$ref", "__proto__",
                                                                    "n ", "MAX_TOKENS", "\u00e9"])

    def constraint(self) -> dict:
        r = self.rng
        roll = r.random()
        if roll < 0.4:
            schema = {"name": "x", "schema": r.choice(SCHEMAS)}
            return {"response_format": {"type": "json_schema", "json_schema": schema}}
        if roll < 0.6:
            regex = r.choice(REGEXES)
            if r.random() < 0.04 and self.bombs < 40:  # a regex past llguidance's limits: ~1 s to refuse
                self.bombs += 1
                regex = f"a{{{r.randint(200_000, 2_000_000)}}}"
            return {"guided_regex": regex}
        if roll < 0.75:
            return {"guided_grammar": r.choice(GRAMMARS)}
        if roll < 0.85:
            return {"guided_choice": r.choice([["yes", "no"], [], [""], ["a"] * 50, "yes", [1, 2]])}
        params = r.choice(SCHEMAS)
        choice = r.choice(["required", "auto", "none", {"type": "function", "function": {"name": "f"}},
                           {"type": "function", "function": {"name": "g"}}, "f", 5])
        return {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
                "tool_choice": choice}

    # bodies of each route, valid, then mutated
    def base(self, path: str) -> dict:
        r = self.rng
        text = r.choice(["hi", "Tell me a story", "x" * r.randint(1, 2000), "\u4e2d\u6587 \U0001f34e"])
        small = r.randint(1, 8)
        if path == "/v1/chat/completions":
            return {"messages": [{"role": "user", "content": text}], "max_tokens": small}
        if path == "/v1/completions":
            return {"prompt": r.choice([text, [1, 2, 3], [text, text]]), "max_tokens": small}
        if path == "/v1/responses":
            return {"input": text, "max_output_tokens": small}
        if path == "/v1/messages":
            return {"model": "tiny-qwen3", "max_tokens": small, "messages": [{"role": "user", "content": text}]}
        if path == "/v1/embeddings":
            return {"input": text}
        if path == "/v1/rerank":
            return {"query": text, "documents": ["a", "b"]}
        if path == "/v1/score":
            return {"text_1": text, "text_2": ["a"]}
        return {}

    def http(self) -> tuple[str, str, dict, bytes, str]:
        """(method, path, headers, body, label)."""
        r = self.rng
        paths = (["/v1/chat/completions"] * 5 + ["/v1/completions"] * 3 + ["/v1/responses"] * 2
                 + ["/v1/messages"] * 2 + ["/v1/embeddings", "/v1/rerank", "/v1/score"])
        roll = r.random()
        if roll < 0.05:
            path = r.choice(["/v1/models", f"/v1/models/{r.choice(['tiny-qwen3', 'x' * 2000, '..%2f..', ''])}",
                             "/health", f"/v1/responses/resp_{r.randint(0, 9)}", "/nope", "/v1/", "/v1/chat"])
            return r.choice(["GET", "GET", "POST", "DELETE", "PUT"]), path, {}, b"", "get"
        path = r.choice(paths)
        body, label = self.base(path), "valid"
        headers = {"Content-Type": "application/json"}
        roll = r.random()
        if roll < 0.45:  # one to three fields set to something hostile
            for _ in range(r.randint(1, 3)):
                body[self.name()] = self.value()
            label = "field"
        elif roll < 0.6:
            body.update(self.constraint())
            body["max_tokens" if path != "/v1/responses" else "max_output_tokens"] = r.randint(1, 24)
            label = "constraint"
        elif roll < 0.65:
            for key in list(body):
                if r.random() < 0.5:
                    del body[key]
            label = "missing"
        elif roll < 0.72:
            body[r.choice(["messages", "input", "prompt", "documents"])] = r.choice([
                [{"role": r.choice(["user", "assistant", "tool", "system", "developer", "x", 5]),
                  "content": self.value()} for _ in range(r.randint(1, 4))],
                [{"role": "user", "content": [{"type": r.choice(["text", "image_url", "tool_use"]), "text": "hi"}]}],
                [{"type": "function_call", "name": "f", "arguments": self.value(), "call_id": self.value()}],
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": self.value()}}]}],
                [[1, 2], [3, -4]], [2**31, 5], [], "x" * r.randint(10_000, 400_000)])
            label = "messages"
        elif roll < 0.75:
            body["n"] = r.choice([17, 1000, 3_000_000, 2**32, 2**64, 10**40, -5])
            label = "n"
        if r.random() < 0.15:
            body["stream"] = True
        raw = _dumps(body, r)
        roll = r.random()
        if roll < 0.04:
            raw, label = r.choice([b"", b"{", b"[]", b"null", b"\xff\xfe\x00", b'{"a": 1}' * 3, b'"x"',
                                   b"[" * 100_000 + b"]" * 100_000]), "not json"
        elif roll < 0.07:
            headers["Content-Encoding"] = r.choice(["gzip", "deflate", "br", "x-nope"])
            label = "content-encoding"
        elif roll < 0.10:
            headers["X-Request-Timeout"] = r.choice(["inf", "nan", "-1", "0", "1e308", "1e-9", "abc", "30", ""])
            label = "timeout-header"
        elif roll < 0.12:
            headers["Content-Type"] = r.choice(["text/plain", "application/x-www-form-urlencoded", ""])
            label = "content-type"
        elif roll < 0.13:
            headers["Authorization"] = "Bearer " + "k" * r.randint(1, 6000)
            label = "authorization"
        return "POST", path, headers, raw, label

    def raw(self) -> tuple[bytes, str, bool]:
        """(bytes on a fresh connection, label, whether it is a slow client the server must drop)."""
        r = self.rng
        host = b"Host: 127.0.0.1\r\n"
        cases = [
            (b"GARBAGE\r\n\r\n", "bad method", False),
            (b"GET /health HTTP/1.1\r\n" + host + b"X-A: " + b"a" * r.randint(9000, 70000) + b"\r\n\r\n", "long header",
             False),
            (b"GET /health HTTP/1.1\r\n" + host + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
             "many headers", False),
            (b"POST /v1/completions HTTP/1.1\r\n" + host + b"Content-Length: -5\r\n\r\n", "bad length", False),
            (b"POST /v1/completions HTTP/1.1\r\n" + host + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n\r\n", "bad chunk",
             False),
            (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(r.randrange(256) for _ in range(200)), "tls hello",
             False),
            (b"GET / HTTP/9.9\r\n\r\n", "bad version", False),
            (bytes(r.randrange(256) for _ in range(r.randint(1, 3000))) + b"\r\n\r\n", "random bytes", False),
            (b"POST /v1/completions HTTP/1.1\r\n" + host, "half headers", True),
            (b"POST /v1/completions HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n"
             b"Content-Length: 1000\r\n\r\n{\"prompt\": ", "short body", True),
        ]
        weights = [3, 2, 1, 2, 2, 2, 1, 4, 0.5, 0.5]
        return r.choices(cases, weights)[0]

    def grpc(self) -> tuple[str, bytes, str]:
        """(method, request bytes, label)."""
        r = self.rng
        roll = r.random()
        if roll < 0.08:
            return r.choice(["Generate", "ListModels", "Embed", "Score"]), bytes(
                r.randrange(256) for _ in range(r.randint(0, 400))), "random bytes"
        if roll < 0.14:
            method = r.choice(["Embed", "Score"])
            req = (pb.EmbedRequest(inputs=[pb.EmbedInput(text="hi")]) if method == "Embed" else
                   pb.ScoreRequest(queries=["q"], documents=["d"]))
            self._mutate(req, 2)
            return method, req.SerializeToString(), "pooling"
        req = pb.GenerateRequest(text=r.choice(["hi", "a story", "x" * r.randint(1, 3000)]),
                                 sampling=pb.SamplingParams(max_tokens=r.randint(1, 8)))
        label = "valid"
        if roll < 0.7:
            self._mutate(req, r.randint(1, 3))
            label = "mutated"
            if req.sampling.max_tokens > 64 and not req.sampling.HasField("structured") and r.random() < 0.9:
                req.sampling.max_tokens = r.randint(1, 64)  # served requests stay cheap; some stay long
        data = req.SerializeToString()
        if 0.7 <= roll < 0.8 and data:
            data = bytearray(data)
            for _ in range(r.randint(1, 4)):
                data[r.randrange(len(data))] ^= 1 << r.randrange(8)
            data, label = bytes(data), "flipped bits"
        return "Generate", data, label

    def _mutate(self, msg, times: int) -> None:
        r = self.rng
        for _ in range(times):
            target = msg.sampling if isinstance(msg, pb.GenerateRequest) and r.random() < 0.6 else msg
            fd = r.choice(target.DESCRIPTOR.fields)
            try:
                if fd.is_repeated:
                    container = getattr(target, fd.name)
                    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                        for _ in range(r.randint(1, 400)):
                            container[r.randint(-2**31, 2**31 - 1)] = r.uniform(-1e3, 1e3)
                    elif fd.message_type is None:
                        for _ in range(r.randint(1, 300)):
                            container.append(self._scalar(fd))
                    else:
                        for _ in range(r.randint(1, 5)):
                            container.add()
                elif fd.message_type is not None:
                    sub = getattr(target, fd.name)
                    if fd.message_type.name == "StructuredOutput":
                        which = r.choice(["json_schema", "regex", "grammar", "json_object", "choice"])
                        if which == "json_object":
                            sub.json_object = True
                        elif which == "choice":
                            sub.choice.choices.extend(r.choice([[], [""], ["a", "b"]]))
                        else:
                            spec = self.constraint()
                            setattr(sub, which, json.dumps(r.choice(SCHEMAS)) if which == "json_schema" else
                                    spec.get("guided_regex") or r.choice(GRAMMARS))
                    else:
                        sub.SetInParent()
                else:
                    setattr(target, fd.name, self._scalar(fd))
            except (ValueError, TypeError):
                pass

    def _scalar(self, fd):
        r = self.rng
        t = fd.type
        if t in (fd.TYPE_STRING, fd.TYPE_BYTES):
            s = r.choice(["", "x", "auto", "required", "user", "[]", "{}", '[{"type": "function"}]', "tiny-qwen3",
                          "\u00e9", "r" * r.choice([10, 300, 70_000]), DEEP_TEXT, '{"x": NaN}'])
            return s.encode() if t == fd.TYPE_BYTES else s
        if t == fd.TYPE_BOOL:
            return r.random() < 0.5
        if t in (fd.TYPE_FLOAT, fd.TYPE_DOUBLE):
            return r.choice([0.0, -1.0, 0.5, 2.5, 1e30, -1e30, float("nan"), float("inf"), r.uniform(-5, 5)])
        if t == fd.TYPE_ENUM:
            return r.choice([v.number for v in fd.enum_type.values])
        bits = 64 if t in (fd.TYPE_INT64, fd.TYPE_UINT64, fd.TYPE_SINT64) else 32
        unsigned = t in (fd.TYPE_UINT32, fd.TYPE_UINT64)
        low, high = (0, 2**bits - 1) if unsigned else (-2**(bits - 1), 2**(bits - 1) - 1)
        return r.choice([low, high, 0, 1, 2, 17, 20, 21, 255, 511, 512, r.randint(low, high)])


def _dumps(body: dict, rng: random.Random) -> bytes:
    """JSON text, with NaN / Infinity and lone surrogates written as a hostile client would."""
    def walk(x):
        if x is NAN:
            return "__NAN__"
        if x is SURROGATE:
            return "__SURROGATE__"
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    text = json.dumps(walk(body), allow_nan=True)
    return text.replace('"__NAN__"', rng.choice(["NaN", "Infinity", "-Infinity"])).replace(
        '"__SURROGATE__"', '"a\\udc80b"').encode()


# -- sending ------------------------------------------------------------------------------------
async def send_http(session: aiohttp.ClientSession, base: str, where: str, case) -> Outcome:
    method, path, headers, body, label = case
    kind = f"http {where} {path.split('?')[0] if len(path) < 40 else path[:40]}"
    start = time.perf_counter()
    try:
        async with session.request(method, base + path, data=body or None, headers=headers) as resp:
            status = resp.status
            refused_at = time.perf_counter() - start
            text = await resp.text(errors="replace")
    except asyncio.TimeoutError:
        return Outcome(kind, label, "hang", time.perf_counter() - start, hang=True, detail=_short(case))
    except aiohttp.ClientError as e:
        return Outcome(kind, label, f"connection: {type(e).__name__}", time.perf_counter() - start,
                       server_error=True, detail=f"{e}; {_short(case)}")
    took = time.perf_counter() - start
    sse_error = _sse_server_error(text) if status == 200 and "text/event-stream" in resp.headers.get(
        "Content-Type", "") else None
    if (status == 504 or sse_error and "timeout" in sse_error) and _own_deadline(headers, took):
        # the client's own X-Request-Timeout passed (1e-9 s, say): its answer, not the server failing
        return Outcome(kind, label, f"{status} (own deadline)", refused_at, refused=True, detail=text[:200])
    if status >= 500 or sse_error:
        return Outcome(kind, label, str(status), took, server_error=True,
                       detail=f"{(sse_error or text)[:300]}; {_short(case)}")
    if status >= 400:
        if not _is_json_error(text):
            return Outcome(kind, label, str(status), refused_at, refused=True, server_error=True,
                           detail=f"not a JSON error: {text[:200]}; {_short(case)}")
        return Outcome(kind, label, str(status), refused_at, refused=True, detail=text[:200])
    return Outcome(kind, label, str(status), took)


def _own_deadline(headers: dict, took: float) -> bool:
    """Whether the request's own X-Request-Timeout had passed when it was answered."""
    try:
        return float(headers.get("X-Request-Timeout", "inf")) <= took
    except ValueError:
        return False


def _is_json_error(text: str) -> bool:
    try:
        body = json.loads(text)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and isinstance(
        body["error"].get("message"), str)


def _sse_server_error(text: str) -> str | None:
    """An SSE stream's error event with a 5xx (or Anthropic's api_error / overloaded_error)."""
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        try:
            data = json.loads(line[6:])
        except ValueError:
            return f"an SSE line that is not JSON: {line[:200]}"
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and (isinstance(err.get("code"), int) and err["code"] >= 500 or
                                      err.get("type") in ("api_error", "overloaded_error", "server_error")):
            return line[:300]
        if (isinstance(data, dict) and data.get("type") == "error"
                and str(data.get("code", "")).endswith("server_error")):
            return line[:300]
    return None


async def send_grpc(channel: grpc.aio.Channel, where: str, case) -> Outcome:
    method, data, label = case
    kind = f"grpc {where} {method}"
    path = f"/orchard.v1.Generation/{method}"
    start = time.perf_counter()
    try:
        if method == "Generate":
            call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)(
                data, timeout=HANG_SECONDS)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(path, request_serializer=None, response_deserializer=None)(
                data, timeout=HANG_SECONDS)
    except grpc.aio.AioRpcError as e:
        took = time.perf_counter() - start
        code = e.code().name
        if code == "DEADLINE_EXCEEDED" and took >= HANG_SECONDS - 1:
            return Outcome(kind, label, "hang", took, hang=True, detail=_short(case))
        detail = f"{(e.details() or '')[:300]}; {_short(case)}"
        if code in SERVER_ERROR_CODES:
            return Outcome(kind, label, code, took, server_error=True, detail=detail)
        return Outcome(kind, label, code, took, refused=True, detail=detail)
    return Outcome(kind, label, "OK", time.perf_counter() - start)


async def send_raw(address: str, where: str, case) -> Outcome:
    data, label, slow = case
    kind = f"raw {where}"
    host, port = address.rsplit(":", 1)
    start = time.perf_counter()
    limit = SLOW_CLIENT_TIMEOUT * 3 + 10 if slow else 20.0  # dropped by then, or it hangs
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError as e:
        return Outcome(kind, label, f"connect: {e}", 0.0, server_error=True)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.read(65536), limit)
        first = time.perf_counter() - start
        rest = head
        while head:  # until the server closes (a malformed request always closes the connection)
            head = await asyncio.wait_for(reader.read(65536), limit)
            rest += head
    except asyncio.TimeoutError:
        return Outcome(kind, label, "hang", time.perf_counter() - start, hang=True, detail=label)
    except (ConnectionError, OSError):
        return Outcome(kind, label, "reset", time.perf_counter() - start, refused=True)
    finally:
        writer.close()
    took = time.perf_counter() - start
    if not rest:
        return Outcome(kind, label, "closed", took, refused=not slow, detail=label)  # dropped, no answer
    status_line = rest.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split(" ")
    status = parts[1] if len(parts) > 1 and parts[1].isdigit() else "?"
    body = rest.partition(b"\r\n\r\n")[2].decode("utf-8", "replace")
    if status.startswith("5") or status == "?":
        return Outcome(kind, label, status, took, server_error=True, detail=rest[:200].decode("latin-1"))
    if status.startswith("4") and not _is_json_error(body):
        return Outcome(kind, label, status, first, refused=True, server_error=True,
                       detail=f"not a JSON error: {body[:200]}")
    return Outcome(kind, label, status, first if not slow else took, refused=status.startswith("4") and not slow)


def _short(case) -> str:
    text = repr(case)
    return text if len(text) < 400 else text[:400] + f"... ({len(text)} characters)"


# -- the probe, processes, verdict ------------------------------------------------------------------
async def probe_once(session: aiohttp.ClientSession, base: str) -> float:
    start = time.perf_counter()
    async with session.post(base + "/v1/chat/completions", json=PROBE) as resp:
        body = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"probe: {resp.status} {body}")
    return time.perf_counter() - start


def rss_mb(pid: int) -> float:
    return resident_bytes(pid) / 2**20


def router_workers(address: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "router", "workers", "--router", address],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    return out.stdout + out.stderr


def scrape(address: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
        return r.read().decode()


def p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


async def warm_up(session, targets, rounds: int = 3) -> None:
    gen = Generator(12345)
    for _ in range(rounds):
        for where, base in targets["http"].items():
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
                async with session.post(base + path, json=gen.base(path)) as resp:
                    await resp.read()
            async with session.get(base + "/v1/models") as resp:
                await resp.read()


def draw(gen: Generator) -> tuple[str, str, tuple]:
    """(what, where, case): HTTP bodies, raw bytes or gRPC, to the router or the worker."""
    roll = gen.rng.random()
    where = "router" if gen.rng.random() < 0.6 else "worker"
    if roll < 0.55:
        return "http", where, gen.http()
    if roll < 0.62:
        return "raw", where, gen.raw()
    return "grpc", where, gen.grpc()


async def send(session, targets, channels, what: str, where: str, case) -> Outcome:
    if what == "http":
        return await send_http(session, targets["http"][where], where, case)
    if what == "raw":
        return await send_raw(targets["http"][where].removeprefix("http://"), where, case)
    return await send_grpc(channels[where], where, case)


async def run_all(session, targets, channels, cases: list, concurrency: int, progress: dict | None = None
                  ) -> list[Outcome]:
    """Send `cases`, `concurrency` at a time; their outcomes in the order they ended."""
    queue: asyncio.Queue = asyncio.Queue()
    for case in cases:
        queue.put_nowait(case)
    outcomes: list[Outcome] = []

    async def worker():
        while not queue.empty():
            outcomes.append(await send(session, targets, channels, *queue.get_nowait()))
            if progress and len(outcomes) % 1000 == 0:  # progress: the pids whose memory to show
                rss = ", ".join(f"{name} {rss_mb(pid):.0f} MB" for name, pid in progress.items())
                print(f"  {len(outcomes)} requests, {sum(o.server_error for o in outcomes)} server errors, "
                      f"{sum(o.hang for o in outcomes)} hangs; {rss}", flush=True)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def fuzz(args, targets, pids) -> Report:
    report = Report()
    gen = Generator(args.seed)
    timeout = aiohttp.ClientTimeout(total=HANG_SECONDS)
    channels = {where: grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
                for where, address in targets["grpc"].items()}
    # aiohttp's own pool (idle connections kept 15 s): the servers' idle keep-alive is longer,
    # whatever their header timeout (2 s here), so no request is written on a closing connection
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await warm_up(session, targets)
        # then the fuzz's own mix under another seed: every path (errors, grammars, pooling)
        # has run once, so the memory read next is where a served process settles
        warm = Generator(args.seed + 10_000)
        report.warm_outcomes = await run_all(session, targets, channels, [draw(warm) for _ in range(args.warm_up)],
                                             args.concurrency)
        router = targets["http"]["router"]
        for _ in range(3):
            await probe_once(session, router)
        for _ in range(args.probes):
            report.probe_idle.append(await probe_once(session, router))
        await asyncio.sleep(args.settle)  # idle as long as before the reading after the fuzz
        report.memory_before = {name: rss_mb(pid) for name, pid in pids.items()}

        cases = [draw(gen) for _ in range(args.requests)]
        done = asyncio.Event()

        async def prober():
            while not done.is_set():
                try:
                    report.probe_busy.append(await probe_once(session, router))
                except Exception as e:  # a failed probe is a finding, not a crash of the harness
                    report.probe_errors.append(repr(e)[:300])
                try:
                    await asyncio.wait_for(done.wait(), args.probe_interval)
                except asyncio.TimeoutError:
                    pass

        probe_task = asyncio.create_task(prober())
        started = time.perf_counter()
        report.outcomes = await run_all(session, targets, channels, cases, args.concurrency,
                                        pids if args.progress else None)
        report.fuzz_seconds = time.perf_counter() - started
        done.set()
        await probe_task
    for ch in channels.values():
        await ch.close()
    await asyncio.sleep(args.settle)  # let freed memory and the breaker state settle
    report.memory_after = {name: rss_mb(pid) for name, pid in pids.items()}
    return report


def verdict(args, report: Report, cluster: LocalCluster) -> int:
    outs = report.outcomes
    errors = [o for o in outs + report.warm_outcomes if o.server_error]
    hangs = [o for o in outs + report.warm_outcomes if o.hang]
    refusals = [o.seconds for o in outs if o.refused]
    idle = statistics.median(report.probe_idle)
    busy = statistics.median(report.probe_busy) if report.probe_busy else float("inf")
    ratio = busy / idle
    workers = router_workers(cluster.router_address)
    metrics = scrape(cluster.metrics_address)
    circuit_open = [line for line in metrics.splitlines()
                    if line.startswith("orchard_router_circuit_open{") and not line.endswith(" 0.0")]
    failed = [line for line in metrics.splitlines()
              if line.startswith("orchard_router_requests_total{") and 'outcome="failed"' in line
              and not line.endswith(" 0.0")]
    healthy = "healthy" in workers and "circuit" not in workers and "unhealthy" not in workers
    growth = {name: report.memory_after[name] / report.memory_before[name] - 1 for name in report.memory_before}

    print(f"requests: {len(outs)}")
    print(f"fuzz seconds: {report.fuzz_seconds:.1f}")
    print(f"served: {sum(1 for o in outs if not o.refused and not o.server_error and not o.hang)}")
    print(f"refused: {len(refusals)}")
    print(f"server errors (5xx): {len(errors)}")
    print(f"hangs: {len(hangs)}")
    print(f"refusal p50 ms: {1000 * statistics.median(refusals) if refusals else 0:.1f}")
    print(f"refusal p99 ms: {1000 * p99(refusals):.1f}")
    print(f"refusal max ms: {1000 * max(refusals, default=0):.1f}")
    print(f"refusals over 100 ms: {sum(1 for s in refusals if s > 0.1)}")
    print(f"probe idle median ms: {1000 * idle:.1f}")
    print(f"probe during fuzz median ms: {1000 * busy:.1f} ({len(report.probe_busy)} probes, "
          f"{len(report.probe_errors)} failed)")
    print(f"probe ratio: {ratio:.2f}")
    for name in report.memory_before:
        print(f"{name} rss mb: {report.memory_before[name]:.0f} -> {report.memory_after[name]:.0f} "
              f"({100 * growth[name]:+.1f}%)")
    print(f"breaker: {'opened ' + '; '.join(circuit_open) if circuit_open else 'never opened'}"
          f"{'; failed outcomes: ' + '; '.join(failed) if failed else ''}")
    print("router workers:\n  " + workers.strip().replace("\n", "\n  "))

    by_kind: dict[str, list[float]] = defaultdict(list)
    for o in outs:
        if o.refused:
            by_kind[f"{o.kind} [{o.label}]"].append(o.seconds)
    print("\nrefusals by kind (count, p50 ms, p99 ms, max ms):")
    for kind in sorted(by_kind, key=lambda k: -max(by_kind[k])):
        xs = by_kind[kind]
        print(f"  {kind:58s} {len(xs):6d} {1000 * statistics.median(xs):8.1f} {1000 * p99(xs):8.1f} "
              f"{1000 * max(xs):8.1f}")
    statuses = Counter(f"{o.kind.split(' ')[0]} {o.status}" for o in outs)
    print("statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))

    failures = []
    if errors:
        failures.append(f"{len(errors)} server errors")
    if hangs:
        failures.append(f"{len(hangs)} hangs")
    if 1000 * p99(refusals) > args.refusal_p99_ms:
        failures.append(f"refusal p99 {1000 * p99(refusals):.0f} ms > {args.refusal_p99_ms:g} ms")
    if ratio > args.probe_ratio or report.probe_errors:
        failures.append(f"probe ratio {ratio:.2f} > {args.probe_ratio:g}" if ratio > args.probe_ratio else
                        f"{len(report.probe_errors)} probes failed: {report.probe_errors[:3]}")
    for name, g in growth.items():
        if g > args.memory_slack:
            failures.append(f"{name} memory +{100 * g:.1f}% > {100 * args.memory_slack:g}%")
    if circuit_open or failed or not healthy:
        failures.append("the worker's breaker opened or it is not healthy")
    for o in (errors + hangs)[:20]:
        print(f"FAILURE {o.kind} [{o.label}] {o.status} after {o.seconds:.2f} s: {o.detail}")
    for o in sorted((o for o in outs if o.refused), key=lambda o: -o.seconds)[:args.show_slowest]:
        print(f"slow refusal {1000 * o.seconds:.0f} ms {o.kind} [{o.label}] {o.status}: {o.detail[:300]}")
    print(("FAIL: " + "; ".join(failures)) if failures else "PASS")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: the tiny random qwen3, made once)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probes", type=int, default=10, help="idle probes (the baseline)")
    parser.add_argument("--warm-up", type=int, default=1000,
                        help="fuzz requests of another seed sent before memory and the idle probe are measured")
    parser.add_argument("--probe-interval", type=float, default=0.5, help="seconds between probes during the fuzz")
    parser.add_argument("--refusal-p99-ms", type=float, default=100.0)
    parser.add_argument("--probe-ratio", type=float, default=2.0)
    parser.add_argument("--memory-slack", type=float, default=0.10)
    parser.add_argument("--settle", type=float, default=8.0,
                        help="seconds idle before memory is read, after the warm-up and after the fuzz (an idle "
                             "worker gives MLX's buffer cache back after 1 s; the servers trim freed memory every 5 s)")
    parser.add_argument("--policy", default="prefix_aware",
                        help="the router's placement policy (prefix_aware keeps a bounded prefix index that grows)")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--show-slowest", type=int, default=10, help="refusals to print with their requests")
    args = parser.parse_args(argv)

    model = args.model
    if model is None:
        from cluster.modelgen import create_model

        path = Path(tempfile.gettempdir()) / "orchard-fuzz-model" / "tiny-qwen3"
        model = str(path if (path / "config.json").exists() else create_model(path, "qwen3", "tiny", seed=0))
    log_dir = tempfile.mkdtemp(prefix="orchard-fuzz-")
    worker_http = f"127.0.0.1:{free_port()}"
    slow = ["--http-header-timeout", str(SLOW_CLIENT_TIMEOUT), "--http-body-timeout", str(SLOW_CLIENT_TIMEOUT)]
    cluster = LocalCluster(model, workers=1, grpc_address=f"127.0.0.1:{free_port()}", policy=args.policy,
                           http_address=f"127.0.0.1:{free_port()}", metrics_address=f"127.0.0.1:{free_port()}",
                           worker_port_base=0, worker_metrics_port_base=0, log_dir=log_dir,
                           router_args=["--heartbeat-interval", "0.5", *slow],
                           worker_args=["--num-kv-blocks", "512", "--max-model-len", "512", "--http", worker_http,
                                        *slow])
    print(f"orchard fuzz: {args.requests} requests, concurrency {args.concurrency}, seed {args.seed}; "
          f"logs in {log_dir}", flush=True)
    with cluster:
        targets = {"http": {"router": f"http://{cluster.http_address}", "worker": f"http://{worker_http}"},
                   "grpc": {"router": cluster.router_address, "worker": cluster.worker_addresses[0]}}
        pids = {"router": cluster.router.proc.pid, "worker": cluster.workers[0].proc.pid}
        report = asyncio.run(fuzz(args, targets, pids))
        status = verdict(args, report, cluster)
        dead = cluster.dead_children()
        if dead:
            print(f"FAIL: {', '.join(c.name for c in dead)} exited")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
