"""No request costs a server without bound: what one request may ask for is limited and
refused before any work (INVALID_ARGUMENT / HTTP 400, the message says the limit), and
what is allowed costs the engine O(the limits) per token, never O(the text so far)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import urllib.error
import urllib.request

import grpc
import pytest

from cluster.api.errors import InvalidRequest
from cluster.api.wire import RequestLimits, build_request, check_fits, validate_request
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.prefix_index import MAX_CHUNKS, TEXT_CHUNK, prompt_keys
from cluster.worker.detokenizer import IncrementalDetokenizer

MAX_MODEL_LEN = 512  # the tiny_worker fixture's


# -- the rules ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words, configurable", [
    (dict(stop=[f"s{i}" for i in range(17)]), "17 stop strings: at most 16", True),
    (dict(stop=["x" * 257]), "a stop string of 257 characters: at most 256", True),
    (dict(stop_token_ids=list(range(65))), "65 stop token ids: at most 64", True),
    (dict(stop=["ok", ""]), "an empty stop string", False),
    (dict(stop_token_ids=[-1]), "stop token ids must be >= 0", False),
])
def test_limits_are_refused_with_the_limit_named(kwargs, words, configurable):
    with pytest.raises(InvalidRequest, match=words):
        validate_request(build_request("hi", **kwargs))
    if configurable:  # an operator's higher limits let it through
        validate_request(build_request("hi", **kwargs), RequestLimits(100, 1000, 100))


def test_prompt_plus_max_tokens_must_fit_as_in_vllm():
    with pytest.raises(InvalidRequest, match=r"maximum context length is 512 tokens\. However, you requested 612 "
                                             r"tokens \(500 in the prompt, 112 for the completion\)"):
        check_fits(build_request("x", max_tokens=112), 500, 512)
    assert check_fits(build_request("x", max_tokens=12), 500, 512) == 12
    assert check_fits(build_request("x"), 500, 512) == 12  # the default is cut to the room left
    assert check_fits(build_request("x"), 10, 512) == 256
    with pytest.raises(InvalidRequest, match="no room for a completion"):
        check_fits(build_request("x"), 512, 512)


def test_the_router_hashes_a_bounded_prefix():
    huge = build_request("a" * (50 * TEXT_CHUNK * MAX_CHUNKS))
    start = time.perf_counter()
    keys = prompt_keys(huge)
    assert len(keys) == MAX_CHUNKS and time.perf_counter() - start < 0.5
    assert prompt_keys(build_request("a" * (TEXT_CHUNK * MAX_CHUNKS)))[:10] == keys[:10]
    chat = build_request(messages=[{"role": "user", "content": "b" * 10_000_000}] * 3)
    assert len(prompt_keys(chat)) == MAX_CHUNKS


# -- the detokenizer: stop strings at a bounded cost ------------------------------------------

class CharTokenizer:
    """One token per character (ids are code points): decode is a join."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def naive_stream(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The whole text cut at the earliest stop string: what must be streamed."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    i, s = min(hits)
    return text[:i], s


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_match_a_naive_search(seed):
    rng = random.Random(seed)
    alphabet = "ab c"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 300)))
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6)))
                   for _ in range(rng.randrange(1, 4))})
    d = IncrementalDetokenizer(CharTokenizer(), [], stops)
    streamed, hit = "", None
    for ch in text:
        hit = d.add(ord(ch))
        streamed += d.take_delta(final=hit is not None)
        if hit:
            break
    else:
        streamed += d.take_delta(final=True)
    want, want_hit = naive_stream(text, stops)
    assert (streamed, hit) == (want, want_hit if want_hit is None else hit)
    if want_hit is not None:  # the earliest stop string wins (any of those ending there)
        assert text[len(want):].startswith(hit)


def test_per_token_work_stays_flat_as_the_text_grows():
    """16 stop strings of 256 characters (the limits) that never match: what each token
    costs (the token ids decoded, the text kept and searched for a stop string) is the
    same at 32k characters of output as at 1k; counted, not timed, so a loaded machine
    cannot make it flaky."""
    rng = random.Random(0)
    stops = tuple("".join(rng.choice("xyz") for _ in range(255)) + "!" for _ in range(16))
    decoded: list[int] = []  # ids decoded, per decode call

    class Counting(CharTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    d = IncrementalDetokenizer(Counting(), [], stops)
    text = "".join(rng.choice("abcdefgh xyz") for _ in range(33_000))

    def worst(lo: int, hi: int) -> tuple[int, int]:
        """The most ids one decode took and the most text kept, over text[lo:hi]."""
        decoded.clear()
        kept = 0
        for ch in text[lo:hi]:
            d.add(ord(ch))
            d.take_delta()
            kept = max(kept, len(d.unsent) + len(d.tail))
        return max(decoded), kept

    early = worst(0, 1_000)
    for ch in text[1_000:32_000]:
        d.add(ord(ch))
        d.take_delta()
    late = worst(32_000, 33_000)
    assert late[0] <= early[0] and late[1] <= 2 * 256, \
        f"per token at 1k characters {early}, at 32k {late} (ids decoded, characters kept)"
    # the held-back text and the tail: bounded by the longest stop string, at 1k as at 32k


# -- through the servers ------------------------------------------------------------------------

ABUSE = {  # a request at each limit + 1, and what the refusal says
    "stop strings": (dict(stop=[f"stop{i}" for i in range(17)]), "at most 16"),
    "stop length": (dict(stop=["y" * 20_000]), "at most 256"),
    "stop token ids": (dict(stop_token_ids=list(range(65))), "at most 64"),
    "stop token id outside the vocabulary": (dict(stop_token_ids=[10**6]), "outside the vocabulary"),
    "prompt + max_tokens": (dict(max_tokens=MAX_MODEL_LEN), "maximum context length is 512"),
    "prompt text": (dict(prompt="word " * 20_000), "characters, more than max_model_len=512"),
}


def _request(kw: dict) -> pb.GenerateRequest:
    kw = dict(kw)
    return build_request(kw.pop("prompt", "hello there"), **kw)


@pytest.mark.parametrize("what", sorted(ABUSE))
def test_each_limit_is_refused_at_once_over_grpc_and_http(tiny_worker, what):
    kw, words = ABUSE[what]
    with grpc.insecure_channel(tiny_worker.grpc) as ch:
        stub = pb_grpc.GenerationStub(ch)
        before = _prompt_tokens(tiny_worker)
        list(stub.Generate(_request(dict(max_tokens=1)), timeout=30))  # connected and warm
        received = _prompt_tokens(tiny_worker)
        assert received > before  # the count sees a request the engine takes
        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request(kw), timeout=30))
        took = time.perf_counter() - start
    print(f"{what}: refused over gRPC in {took * 1000:.1f} ms")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    # refused before the engine took any of it (how fast is load/fuzz_api.py's to say)
    assert _prompt_tokens(tiny_worker) == received
    body = {"model": "", "prompt": kw.get("prompt", "hello there"), "max_tokens": kw.get("max_tokens", 4),
            **{k: v for k, v in kw.items() if k in ("stop", "stop_token_ids")}}
    req = urllib.request.Request(f"http://{tiny_worker.http}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and words in json.loads(e.value.read())["error"]["message"]
    assert _prompt_tokens(tiny_worker) == received


def _prompt_tokens(worker) -> float:
    """The worker's count of prompt tokens its engine has received."""
    with urllib.request.urlopen(f"http://{worker.metrics}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("orchard_prompt_tokens_total"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no orchard_prompt_tokens_total on the worker's /metrics")


def test_json_nested_too_deep_is_a_bad_request(tiny_worker):
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    req = urllib.request.Request(f"http://{tiny_worker.http}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400


def test_json_nested_in_strings_is_a_bad_request_on_a_worker(tiny_worker):
    """History tool call arguments and Responses function_call arguments 5,000 deep were a
    500 with a RecursionError traceback in the worker's log; over gRPC, UNKNOWN."""
    from test_hostile_input import check_nested_grpc_refused, check_nested_refused

    check_nested_refused(tiny_worker.http)
    check_nested_grpc_refused(tiny_worker.grpc)
    assert not any("RecursionError" in line for line in tiny_worker.log)


def test_the_router_refuses_what_it_can_check_itself():
    from cluster.router.proxy import ProxyConfig, RouterBackend
    from cluster.router.metrics import RouterMetrics
    from cluster.router.policy import make_policy
    from cluster.router.registry import Registry

    async def main():
        registry = Registry(connect=False)
        backend = RouterBackend(registry, make_policy("least_loaded"), RouterMetrics(registry),
                                ProxyConfig(limits=RequestLimits(max_stop_strings=2)))
        for kw, words in ((dict(stop=["a", "b", "c"]), "at most 2"), (dict(stop=["z" * 300]), "at most 256"),
                          (dict(stop_token_ids=list(range(65))), "at most 64")):
            with pytest.raises(InvalidRequest, match=words):
                async for _ in backend.generate(_request(kw)):
                    pass

    asyncio.run(main())


@pytest.mark.bench  # a timing comparison: a loaded machine's noise is larger than the bound (-m bench runs it)
def test_an_abusive_neighbour_does_not_slow_a_stream(tiny_worker):
    """A stream's inter-token latency with neighbours at every limit (16 stop strings of 256
    characters each, generating as long as they may) and refused abuse beside it, against
    the same stream with ordinary neighbours: same p99 within a generous bound."""

    async def victim_itl(stub, neighbours: list[pb.GenerateRequest], spam: bool) -> list[float]:
        async def drain(req):
            try:
                async for _ in stub.Generate(req):
                    pass
            except grpc.aio.AioRpcError:
                pass

        async def refused_spam(stop):
            while not stop.is_set():
                await drain(_request(ABUSE["stop length"][0]))
                await drain(_request(ABUSE["prompt text"][0]))

        tasks = [asyncio.create_task(drain(r)) for r in neighbours]
        stop = asyncio.Event()
        spammer = asyncio.create_task(refused_spam(stop)) if spam else None
        await asyncio.sleep(0.2)
        times = []
        async for chunk in stub.Generate(_request(dict(max_tokens=200, ignore_eos=True))):
            times.append(time.perf_counter())
        stop.set()
        await asyncio.gather(*tasks, *([spammer] if spammer else []))
        return [b - a for a, b in zip(times, times[1:])]

    rng = random.Random(1)
    at_limits = [_request(dict(max_tokens=400, ignore_eos=True,
                               stop=["".join(rng.choice("qz") for _ in range(255)) + "#" for _ in range(16)]))
                 for _ in range(3)]
    ordinary = [_request(dict(max_tokens=400, ignore_eos=True)) for _ in range(3)]

    async def main():
        async with grpc.aio.insecure_channel(tiny_worker.grpc) as ch:
            stub = pb_grpc.GenerationStub(ch)
            base = await victim_itl(stub, ordinary, spam=False)
            abused = await victim_itl(stub, at_limits, spam=True)
        return base, abused

    base, abused = asyncio.run(asyncio.wait_for(main(), 120))
    p99 = lambda xs: statistics.quantiles(xs, n=100)[98]  # noqa: E731
    print(f"p99 ITL {p99(base) * 1000:.1f} ms with ordinary neighbours, {p99(abused) * 1000:.1f} ms beside the abuse")
    assert p99(abused) < 3 * p99(base) + 0.05, (f"p99 ITL {p99(base) * 1000:.1f} ms with ordinary neighbours, "
                                                f"{p99(abused) * 1000:.1f} ms beside the abuse")
