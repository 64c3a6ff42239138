"""The API layer both servers and the SDK share (cluster/api), and the package's structure:
who may import whom, and what importing the SDK costs."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.api.errors import InvalidRequest
from cluster.api.limits import DEFAULT_MAX_TOKENS
from cluster.api.tools import tool_choice_mode
from cluster.api.wire import (
    FINISH_REASON_NAMES,
    FINISH_REASON_TO_PROTO,
    build_request,
    max_tokens,
    validate_request,
)
from cluster.proto.orchard.v1 import orchard_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent


def test_generation_servicer_closes_the_backend_stream_at_once():
    """Closing the RPC's generator closes the backend's stream right then (the engine abort
    on a worker, the worker's stream on the router), not later by garbage collection."""
    from cluster.api.servicer import GenerationServicer

    closed = []

    class Backend:
        async def generate(self, request, timeout=None):
            try:
                yield pb.GenerateResponse()
                await asyncio.Event().wait()
            finally:
                closed.append(True)

    class Context:
        def time_remaining(self):
            return None

    async def main():
        rpc = GenerationServicer(Backend()).Generate(pb.GenerateRequest(), Context())
        await rpc.__anext__()
        await rpc.aclose()
        return list(closed)

    assert asyncio.run(main()) == [True]


def test_finished_refuses_a_stream_that_ends_short_and_closes_it():
    from cluster.api.errors import Unavailable
    from cluster.api.servicer import finished

    closed = []

    async def short():
        try:
            yield pb.GenerateResponse(token_ids=[1])
        finally:
            closed.append("short")

    async def whole():
        yield pb.GenerateResponse(token_ids=[1])
        yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP)
        closed.append("read past the finish")  # never reached: it stops at the finish chunk

    async def main():
        with pytest.raises(Unavailable, match="ended before the request finished"):
            [c async for c in finished(short())]
        return [c.finish_reason for c in [c async for c in finished(whole())]]

    assert asyncio.run(main()) == [0, pb.FINISH_REASON_STOP]
    assert closed == ["short"]


def test_the_servicer_passes_the_deadline_and_maps_errors_to_statuses():
    from cluster.api.servicer import GenerationServicer

    seen = {}

    class Backend:
        async def generate(self, request, timeout=None):
            seen["timeout"] = timeout
            raise InvalidRequest("bad")
            yield  # an async generator

    class Aborted(Exception):
        pass

    class Context:
        def time_remaining(self):
            return 7.5

        async def abort(self, code, message):
            seen["status"] = (code, message)
            raise Aborted

    async def main():
        with pytest.raises(Aborted):
            async for _ in GenerationServicer(Backend()).Generate(pb.GenerateRequest(), Context()):
                pass

    asyncio.run(main())
    import grpc

    assert seen == {"timeout": 7.5, "status": (grpc.StatusCode.INVALID_ARGUMENT, "bad")}


@pytest.mark.parametrize("request_, words", [
    (pb.GenerateRequest(), "no prompt"),
    (build_request(""), "empty"),
    (build_request([]), "empty"),
    (build_request(messages=[]), "messages"),
    (build_request("hi", max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
])
def test_validate_request_refuses_what_no_server_can_serve(request_, words):
    with pytest.raises(InvalidRequest, match=words):
        validate_request(request_)


def _with(**fields):
    """A valid request with the contract's fields set (sampling.X or X on the request)."""
    r = build_request(messages=[{"role": "user", "content": "hi"}])
    for name, value in fields.items():
        target = r.sampling if hasattr(r.sampling, name) else r
        if name == "logit_bias":
            r.sampling.logit_bias[3] = value
        elif name == "structured":
            r.sampling.structured.json_object = True
        elif name == "tool_choice":
            r.tool_choice.mode = value
        elif name == "history":
            r.chat.messages.add(role="tool", content="42", tool_call_id="call_1")
        else:
            setattr(target, name, value)
    return r


# Penalties, logit bias and structured outputs are served: validated to OpenAI's ranges.
@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=2.5), "temperature must be between 0 and 2"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(presence_penalty=5.0), "presence_penalty must be between -2 and 2"),
    (dict(frequency_penalty=-2.5), "frequency_penalty must be between -2 and 2"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be in \(0, 2\]"),
    (dict(repetition_penalty=3.0), r"repetition_penalty must be in \(0, 2\]"),
    (dict(logit_bias={5: 101.0}), "logit_bias values must be between -100 and 100"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id -1"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
    (dict(structured={"json_schema": "{not json"}), "not valid JSON"),
    (dict(structured={"choice": []}), "at least one choice"),
    (dict(structured={"regex": " "}), "regex is empty"),
])
def test_sampling_ranges_are_refused_by_name(kwargs, words):
    with pytest.raises(InvalidRequest, match=words):
        validate_request(build_request("hi", **kwargs))


def test_sampling_extensions_in_range_are_accepted():
    for kwargs in (dict(temperature=2.0, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=2.0,
                        logit_bias={i: (-100.0 if i % 2 else 100.0) for i in range(300)}),
                   dict(structured={"json_schema": {"type": "object"}}), dict(structured={"json_object": True}),
                   dict(structured={"regex": "a+"}), dict(structured={"choice": ["a", "b"]}),
                   dict(structured={"grammar": 'start: "x"'})):
        validate_request(build_request("hi", **kwargs))
    with pytest.raises(InvalidRequest, match="structured"):
        build_request("hi", structured={"yaml": "x"})


def test_n_and_prompt_logprobs_are_served_within_bounds():
    validate_request(_with(n=4, prompt_logprobs=0))
    with pytest.raises(InvalidRequest, match="n=17: at most 16"):
        validate_request(_with(n=17))
    with pytest.raises(InvalidRequest, match="prompt_logprobs must be between 0 and 20"):
        validate_request(_with(prompt_logprobs=21))
    resumed = _with(n=2)
    resumed.resume_token_ids.append(5)
    with pytest.raises(InvalidRequest, match="n > 1 cannot be resumed"):
        validate_request(resumed)


_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_round_trip_through_the_wire_and_are_validated():
    """Tools, tool_choice, parallel_tool_calls and history with tool calls go onto the
    wire; what is malformed is refused saying what to fix."""
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": "12C", "tool_call_id": "call_1", "name": "get_weather"}]
    r = build_request(messages=history, tools=[_WEATHER], tool_choice="auto", parallel_tool_calls=False)
    validate_request(r)
    assert json.loads(r.tools) == [_WEATHER] and r.tool_choice.mode == "auto" and r.parallel_tool_calls is False
    call = r.chat.messages[1].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("call_1", "get_weather", {"city": "Oslo"})
    assert (r.chat.messages[2].tool_call_id, r.chat.messages[2].name) == ("call_1", "get_weather")
    assert tool_choice_mode(build_request(messages=history, tools=[_WEATHER])) == "auto"
    assert tool_choice_mode(build_request(messages=history)) == "none"
    named = build_request(messages=history, tools=[_WEATHER], tool_choice={"type": "function",
                                                                           "function": {"name": "get_weather"}})
    assert named.tool_choice.function == "get_weather"
    validate_request(named)  # enforced by the worker's constrained decoding
    validate_request(build_request(messages=history, tools=[_WEATHER], tool_choice="required"))
    for bad, words in [
        (dict(tools=[_WEATHER], tool_choice="nope"), "not in tools"),
        (dict(tool_choice="required"), "needs tools"),
        (dict(tools=[{"type": "function", "function": {}}]), r"tools\[0\].function.name is required"),
        (dict(tools=[{"type": "code_interpreter"}]), "only tools of type 'function'"),
        (dict(tools=[_WEATHER, _WEATHER]), "a second function named 'get_weather'"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            validate_request(build_request(messages=history, **bad))
    r = build_request(messages=history)
    r.chat.messages[1].tool_calls[0].arguments = "{not json"
    with pytest.raises(InvalidRequest, match=r"messages\[1\].tool_calls\[0\].function.arguments. is not valid JSON"):
        validate_request(r)
    with pytest.raises(InvalidRequest, match="need a chat prompt"):
        validate_request(build_request("hi", tools=[_WEATHER]))


def test_build_request_and_validate_agree_on_max_tokens():
    """The wire cannot hold a negative max_tokens: build_request refuses it in the same
    words as the server refuses 0."""
    with pytest.raises(InvalidRequest, match="max_tokens must be an integer >= 1, got -1"):
        build_request("hi", max_tokens=-1)
    with pytest.raises(InvalidRequest, match="seed"):
        build_request("hi", seed=2**64)
    validate_request(build_request("hi", max_tokens=1))
    assert max_tokens(build_request("hi")) == DEFAULT_MAX_TOKENS
    assert max_tokens(build_request("hi", max_tokens=3)) == 3


def test_chat_without_max_tokens_runs_to_the_end_of_the_context():
    """As OpenAI's and vLLM's chat do; a text prompt keeps the wire's default."""
    from cluster.api.wire import check_fits

    assert check_fits(build_request(messages=[{"role": "user", "content": "hi"}]), 100, 4096) == 3996
    assert check_fits(build_request("hi"), 100, 4096) == DEFAULT_MAX_TOKENS
    assert check_fits(build_request(messages=[{"role": "user", "content": "hi"}], max_tokens=7), 100, 4096) == 7


def test_finish_reasons_round_trip():
    for name, value in FINISH_REASON_TO_PROTO.items():
        assert FINISH_REASON_NAMES[value] == name
    assert FINISH_REASON_NAMES[pb.FINISH_REASON_UNSPECIFIED] is None


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_layering():
    """Servers and the API layer never import the SDK (the SDK is a client of cluster.api,
    never the other way round), and the API layer imports no server and no MLX."""
    for path in sorted((ROOT / "cluster").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        names = _imports(path)
        if rel.startswith(("cluster/router/", "cluster/worker/", "cluster/api/")):
            assert not any(n == "cluster.sdk" or n.startswith("cluster.sdk.") for n in names), rel
        if rel.startswith("cluster/api/"):
            assert not any(n.startswith(("cluster.worker", "cluster.router", "mlx")) for n in names), rel


def _module_graph() -> tuple[dict[str, set[str]], list[str]]:
    """cluster's modules -> the cluster modules each imports (at the top or inside a
    function: a lazy import still ties the two), and every private name one module takes
    from another (`from m import _x`, or `m._x` on an imported module)."""
    files = {}
    for path in (ROOT / "cluster").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph, private = {}, []
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges, aliases = set(), {}
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if owner(a.name):
                        edges.add(owner(a.name))
                        if a.asname and a.name in files:
                            aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in files:
                        edges.add(full)
                        aliases[a.asname or a.name] = full
                    elif owner(base):
                        edges.add(owner(base))
                        if a.name.startswith("_"):
                            private.append(f"{module} imports {a.name} from {base}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.append(f"{module} reads {aliases[node.value.id]}.{node.attr}")
        edges.discard(module)
        edges.discard(package)  # a package's __init__ runs first anyway: not a circle of its own making
        graph[module] = edges
    return graph, private


def test_no_import_circles_and_no_private_names_across_modules():
    graph, private = _module_graph()
    assert private == []
    circles, seen = [], set()
    for start in sorted(graph):  # a path back to `start` through its imports is a circle
        stack, visited = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        circles.append(" -> ".join(path + (start,)))
                elif nxt not in visited:
                    visited.add(nxt)
                    stack.append((nxt, path + (nxt,)))
    assert circles == []


def test_importing_the_sdk_loads_neither_mlx_nor_openblas():
    code = ("import sys, cluster.sdk; maps = open('/proc/self/maps').read() if sys.platform.startswith('linux') "
            "else ''; print('mlx' in sys.modules, 'openblas' in maps, 'cluster.platform' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]
