"""The SDK against a real worker, its error mapping, and `orchard generate`."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import grpc
import pytest

from cluster.api.errors import from_status
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.sdk import (
    AsyncClient,
    Cancelled,
    Client,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    OrchardError,
    Overloaded,
    Unavailable,
    build_request,
)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sync_and_async_clients_agree(tiny_worker):
    kwargs = dict(max_tokens=10, temperature=0, ignore_eos=True)
    with Client(tiny_worker.grpc, timeout=30) as client:
        sync_result = client.generate("An apple a day", **kwargs)
        sync_chunks = list(client.stream("An apple a day", **kwargs))

    async def run():
        async with AsyncClient(tiny_worker.grpc, timeout=30) as client:
            result = await client.generate("An apple a day", **kwargs)
            chunks = [c async for c in client.stream("An apple a day", **kwargs)]
            chat = await client.chat([{"role": "user", "content": "An apple a day"}], **kwargs)
            models = await client.list_models()
            return result, chunks, chat, models

    result, chunks, chat, models = asyncio.run(run())
    assert result.token_ids == sync_result.token_ids and result.text == sync_result.text
    assert len(result.token_ids) == 10 and result.finish_reason == "length"
    assert result.usage.total_tokens == result.usage.prompt_tokens + 10
    for got in (chunks, sync_chunks):
        assert [t for c in got for t in c.token_ids] == result.token_ids
        assert "".join(c.text for c in got) == result.text
        assert got[-1].finished and all(not c.finished for c in got[:-1])
        assert got[-1].usage == result.usage
    assert len(chat.token_ids) == 10 and chat.usage.prompt_tokens > result.usage.prompt_tokens
    assert models[0].max_model_len == 512


def test_closing_a_stream_cancels_the_request(tiny_worker):
    with Client(tiny_worker.grpc, timeout=30) as client:
        it = client.stream([4, 5, 6], max_tokens=500, ignore_eos=True)
        next(it)
        assert client.get_load().num_running == 1
        it.close()
        assert wait_for(lambda: client.get_load().num_running == 0 and client.get_load().kv_blocks_used == 0)

        for _ in client.stream([4, 5, 6], max_tokens=500, ignore_eos=True):
            break  # leaving the loop early cancels too
        assert wait_for(lambda: client.get_load().num_running == 0)

    async def run():
        async with AsyncClient(tiny_worker.grpc, timeout=30) as client:
            it = client.stream([4, 5, 6], max_tokens=500, ignore_eos=True)
            await it.__anext__()
            assert (await client.get_load()).num_running == 1
            await it.aclose()
            for _ in range(500):
                load = await client.get_load()
                if load.num_running == 0 and load.kv_blocks_used == 0:
                    return True
                await asyncio.sleep(0.02)
            return False

    assert asyncio.run(run()), "the async stream's request kept running after aclose()"


def test_timeout_raises_deadline_exceeded_and_frees_the_worker(tiny_worker):
    with Client(tiny_worker.grpc) as client:
        with pytest.raises(DeadlineExceeded):
            client.generate([7, 8, 9], max_tokens=500, ignore_eos=True, timeout=0.05)
        assert wait_for(lambda: client.get_load().num_running == 0)

    async def run():
        async with AsyncClient(tiny_worker.grpc, timeout=0.05) as client:
            with pytest.raises(DeadlineExceeded):
                await client.generate([7, 8, 9], max_tokens=500, ignore_eos=True)

    asyncio.run(run())


def test_unreachable_target_is_unavailable():
    with Client(f"127.0.0.1:{closed_port()}", timeout=5) as client:
        with pytest.raises(Unavailable):
            client.generate("hello")

    async def run():
        async with AsyncClient(f"127.0.0.1:{closed_port()}", timeout=5) as client:
            with pytest.raises(Unavailable):
                await client.generate("hello")

    asyncio.run(run())


def test_async_errors_are_typed(tiny_worker):
    async def run():
        async with AsyncClient(tiny_worker.grpc, timeout=10) as client:
            with pytest.raises(InvalidRequest, match="temperature"):
                await client.generate("x", temperature=-1)
            with pytest.raises(NotFound):
                await client.generate("x", model="nope")
            with pytest.raises(InvalidRequest, match="empty"):
                async for _ in client.stream(""):
                    pass

    asyncio.run(run())


def test_status_codes_map_to_typed_errors():
    cases = {
        grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
        grpc.StatusCode.UNAVAILABLE: Unavailable,
        grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
        grpc.StatusCode.CANCELLED: Cancelled,
    }
    for code, cls in cases.items():
        err = from_status(code, "why")
        assert type(err) is cls and err.code == code and err.message == "why" and isinstance(err, OrchardError)
    assert type(from_status(grpc.StatusCode.PERMISSION_DENIED, "no")) is OrchardError
    assert isinstance(InvalidRequest("x"), ValueError)
    assert (InvalidRequest.http_status, NotFound.http_status, Overloaded.http_status, Unavailable.http_status) == (
        400, 404, 429, 503)


def test_build_request():
    r = build_request("hi", max_tokens=3, temperature=0, stop="x", seed=5, logprobs=2, resume_token_ids=[1, 2])
    assert r.WhichOneof("prompt") == "text" and r.sampling.max_tokens == 3 and list(r.sampling.stop) == ["x"]
    assert r.sampling.HasField("temperature") and not r.sampling.HasField("top_p")
    assert list(r.resume_token_ids) == [1, 2] and r.sampling.logprobs == 2
    assert build_request([1, 2, 3]).token_ids.ids == [1, 2, 3]
    assert build_request([]).WhichOneof("prompt") == "token_ids"  # an empty prompt is the server's to refuse
    chat = build_request(messages=[("system", "be brief"), {"role": "user", "content": "hi"}])
    assert [m.role for m in chat.chat.messages] == ["system", "user"]
    with pytest.raises(InvalidRequest):
        build_request("hi", messages=[("user", "hi")])
    with pytest.raises(InvalidRequest):
        build_request("hi", max_tokens=-1)
    assert isinstance(r, pb.GenerateRequest)


def test_orchard_generate_cli(tiny_worker):
    cmd = [sys.executable, "-m", "cluster.cli", "generate", "--target", tiny_worker.grpc, "--max-tokens", "5",
           "--ignore-eos", "Hello"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "length; " in out.stderr and "5 completion tokens" in out.stderr
    streamed = subprocess.run(cmd[:-1] + ["--stream", "Hello"], capture_output=True, text=True, timeout=60)
    assert streamed.returncode == 0 and streamed.stdout == out.stdout
    bad = subprocess.run(cmd[:-1] + ["--temperature", "-1", "Hello"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr


def test_a_stream_that_ends_short_raises_in_both_clients():
    """A server that ends a stream without a finish reason (not Orchard's: its servers
    never do) still cannot hand the SDK's caller a cut-off answer as a whole one."""
    from concurrent import futures

    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

    class Short(pb_grpc.GenerationServicer):
        def Generate(self, request, context):
            yield pb.GenerateResponse(token_ids=[1], text="a")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_GenerationServicer_to_server(Short(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout=10) as c:
            with pytest.raises(Unavailable, match="ended before the request finished"):
                c.generate("x")

        async def main():
            async with AsyncClient(f"127.0.0.1:{port}", timeout=10) as c:
                with pytest.raises(Unavailable, match="ended before the request finished"):
                    await c.generate("x")

        asyncio.run(main())
    finally:
        server.stop(0)
