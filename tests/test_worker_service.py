"""The worker's asyncio side and engine thread against a fake engine (no MLX, no sockets):
routing, cancellation, refusals and engine failures. The fake is the tests' shared one
(`scripted_engine.FakeEngine`)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.sdk import InternalError, InvalidRequest, Overloaded, Unavailable, build_request
from cluster.worker.engine import RequestOutput
from cluster.worker.service import WorkerService
from cluster.worker.engine_loop import EngineLoop
from scripted_engine import BOOM, FakeEngine


def run_with_service(fn, engine: FakeEngine | None = None, **service_kwargs):
    engine = engine or FakeEngine()

    async def main():
        svc = WorkerService("w1", lambda: engine, **service_kwargs)
        await svc.start(timeout=5)
        try:
            return await asyncio.wait_for(fn(svc, engine), 10)
        finally:
            await svc.stop()

    return asyncio.run(main())


async def collect(svc, request):
    return [c async for c in svc.generate(request)]


def test_streams_are_routed_and_the_engine_runs_on_its_own_thread():
    async def fn(svc, engine):
        a, b = await asyncio.gather(collect(svc, build_request([1, 2], max_tokens=3)),
                                    collect(svc, build_request("hey", max_tokens=5, request_id="mine")))
        return a, b, engine.thread

    a, b, thread = run_with_service(fn)
    assert [t for c in a for t in c.token_ids] == [100, 101, 102]
    assert b[0].request_id == "mine" and sum(len(c.token_ids) for c in b) == 5
    assert b[-1].finish_reason == pb.FINISH_REASON_LENGTH and b[-1].usage.prompt_tokens == 3
    assert b[-1].usage.completion_tokens == 5 and b[-1].worker_id == "w1"
    assert thread == "orchard-engine"


def test_closing_the_stream_aborts_in_the_engine():
    async def fn(svc, engine):
        gen = svc.generate(build_request([1], max_tokens=1000, request_id="r"))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        return engine.aborted, svc.num_streams

    aborted, streams = run_with_service(fn)
    assert len(aborted) == 1 and aborted[0].startswith("r@") and streams == 0


def test_a_reused_request_id_never_gets_the_cancelled_requests_events():
    """Events of a cancelled request still in flight to the event loop (the engine emitted
    them before it saw the abort) must not reach a new stream that reuses its id."""

    async def fn(svc, engine):
        first = svc.generate(build_request([1], max_tokens=1000, request_id="same"))
        await first.__anext__()
        old_engine_id = next(iter(engine.seqs))
        await first.aclose()
        second = svc.generate(build_request([2, 3], max_tokens=3, request_id="same"))
        chunks = [await second.__anext__()]
        # a late event of the first request, as the engine thread could still deliver it
        svc._dispatch(0.0, [RequestOutput(old_engine_id, [777], "<777>", True, "stop",
                                          num_prompt_tokens=1, num_output_tokens=9)])
        chunks += [c async for c in second]
        return old_engine_id, chunks

    old_engine_id, chunks = run_with_service(fn)
    assert old_engine_id.startswith("same@")
    assert [t for c in chunks for t in c.token_ids] == [100, 101, 102]
    assert all(c.request_id == "same" for c in chunks)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and chunks[-1].usage.prompt_tokens == 2


def test_refusals_from_the_engine_thread_become_typed_errors():
    async def fn(svc, engine):
        with pytest.raises(InvalidRequest, match=r"\[0, 500\)"):
            await collect(svc, build_request([1, 600]))
        held = [svc.generate(build_request([1], max_tokens=1000)) for _ in range(3)]
        engine.step = lambda: []  # nothing advances: the three stay waiting
        await asyncio.sleep(0)
        tasks = [asyncio.ensure_future(g.__anext__()) for g in held]
        await asyncio.sleep(0.2)
        with pytest.raises(Overloaded, match="queue is full"):
            await collect(svc, build_request([1]))
        for t in tasks:
            t.cancel()
        return True

    assert run_with_service(fn)


def test_an_engine_failure_fails_the_live_requests_and_the_worker_goes_on():
    async def fn(svc, engine):
        with pytest.raises(InternalError, match="boom"):
            await collect(svc, build_request([BOOM], max_tokens=3))
        return await collect(svc, build_request([1], max_tokens=2))

    after = run_with_service(fn)
    assert [t for c in after for t in c.token_ids] == [100, 101]


def test_a_failed_step_fails_only_its_cause_and_the_batch_continues_exactly():
    """A step that raises with a poison request batched beside others: the others come
    back one at a time, resumed after what they had sent, and finish with exactly the
    tokens they would have had; the poison fails alone, and the worker goes on."""
    async def fn(svc, engine):
        engine.unwedged.clear()  # hold the first step until all four are in
        tasks = [asyncio.create_task(collect(svc, build_request([i + 1], max_tokens=5, request_id=f"ok{i}")))
                 for i in range(2)]
        await asyncio.sleep(0.05)
        tasks.insert(1, asyncio.create_task(collect(svc, build_request([BOOM], max_tokens=5, request_id="bad"))))
        tasks.append(asyncio.create_task(collect(svc, build_request([7], max_tokens=5, request_id="ok2"))))
        await asyncio.sleep(0.05)
        engine.unwedged.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        after = await collect(svc, build_request([1], max_tokens=2))
        return results, after

    engine = FakeEngine()
    results, after = run_with_service(fn, engine)
    good = [r for i, r in enumerate(results) if i != 1]
    assert isinstance(results[1], InternalError) and "boom" in str(results[1])
    for chunks in good:
        assert [t for c in chunks for t in c.token_ids] == [100, 101, 102, 103, 104]
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [t for c in after for t in c.token_ids] == [100, 101]
    readded = [rid for rid, _ in engine.added if rid != "bad"]
    assert len(readded) > 4  # the innocent ones came back (resumed) after the failed step


def test_validation_before_the_engine():
    async def fn(svc, engine):
        for req, err, words in [
            (build_request([1] * 2049), InvalidRequest, "max_model_len"),
            (build_request("hi", max_tokens=0), InvalidRequest, "max_tokens"),
            (build_request([1], resume_token_ids=[2] * 2048), InvalidRequest, "resumed"),
            (pb.GenerateRequest(), InvalidRequest, "no prompt"),
        ]:
            with pytest.raises(err, match=words):
                await collect(svc, req)
        svc.set_draining(True)
        with pytest.raises(Unavailable, match="draining"):
            await collect(svc, build_request([1]))
        svc.set_draining(False)
        return engine.seqs

    assert run_with_service(fn) == {}


def test_metrics_render_from_engine_stats():
    async def fn(svc, engine):
        await collect(svc, build_request([1, 2], max_tokens=4))
        return svc.metrics.render().decode()

    text = run_with_service(fn)
    assert 'orchard_time_to_first_token_seconds_count{model="fake",worker="w1"} 1.0' in text
    assert 'orchard_inter_token_latency_seconds_count{model="fake",worker="w1"} 3.0' in text
    assert 'orchard_kv_cache_blocks_total{model="fake",worker="w1"} 8.0' in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_stop_returns_once_the_engine_os_thread_is_gone():
    # MLX's per-thread compile cache is torn down after join() returns; stop() waits for
    # the OS thread itself, so a process can exit right after it without aborting.
    import mlx.core as mx

    def factory():
        mx.eval(mx.compile(lambda x: mx.exp(x) * 2)(mx.ones(4)))  # fills this thread's compile cache
        return FakeEngine()

    loop = EngineLoop(factory, lambda now, events: None)
    loop.start(timeout=30)
    native_id = loop._thread.native_id
    assert os.path.exists(f"/proc/self/task/{native_id}")
    loop.stop(5)
    assert not loop.alive
    assert not os.path.exists(f"/proc/self/task/{native_id}")


def test_an_idle_engine_gives_mlxs_buffer_cache_back(monkeypatch):
    """Every buffer a step freed stayed in MLX's cache for good: after the fuzz the worker
    held 10 MB more of it (a long prompt's prefill: its whole activations)."""
    import mlx.core as mx

    from cluster.worker import engine_loop
    from cluster.worker.engine_loop import AddRequest
    from cluster.worker.sampling_params import SamplingParams

    monkeypatch.setattr(engine_loop, "IDLE_RELEASE_SECONDS", 0.5)
    trims = []
    monkeypatch.setattr(engine_loop, "give_back_freed_memory", lambda: trims.append(mx.get_cache_memory()))

    class Computes(FakeEngine):
        def step(self):
            mx.eval(mx.exp(mx.ones((1 << 20,)) * 2) + 1)  # temporaries: freed into MLX's cache
            return super().step()

    cached, done = [], threading.Event()

    def on_events(now, events):  # on the engine thread, right after the step
        if any(isinstance(e, RequestOutput) and e.finished for e in events):
            cached.append(mx.get_cache_memory())
            done.set()

    loop = EngineLoop(Computes, on_events)
    loop.start(timeout=30)
    try:
        for i in range(2):  # busy, idle (released), busy again: the cache fills and empties each time
            done.clear()
            loop.submit(AddRequest(f"r{i}", [1], SamplingParams(max_tokens=3), 0.0))
            assert done.wait(30)
            assert cached[-1] > 0  # the step's buffers, kept while requests come
            deadline = time.monotonic() + 30
            while (mx.get_cache_memory() > 0 or not trims) and time.monotonic() < deadline:
                time.sleep(0.05)  # the cache empties, then (a moment later, on the engine thread) the trim
            assert mx.get_cache_memory() == 0, "the idle engine kept MLX's buffer cache"
            assert trims[-1:] == [0]  # and what it held went back to the system (after the cache emptied)
            trims.clear()
    finally:
        loop.stop(5)


@pytest.mark.parametrize("wait_ms", [0.0, 2000.0])
def test_a_request_sent_right_after_a_finish_joins_the_next_step(wait_ms):
    """A closed-loop client sends its next request a few ms after its last token. With
    `finish_wait_ms` the loop holds the next step for it; without, the engine goes on
    stepping the other running request meanwhile."""
    from cluster.worker.sampling_params import SamplingParams
    from cluster.worker.engine_loop import AddRequest

    engine = FakeEngine()
    engine.config.finish_wait_ms = wait_ms
    seen = {}
    done = threading.Event()

    def on_events(now, events):
        for e in events:
            if isinstance(e, RequestOutput) and e.request_id == "A" and e.finished:
                seen["finish_step"] = engine.stats.num_steps
                later = AddRequest("B", [1], SamplingParams(max_tokens=1), 0.0)
                threading.Timer(0.05, lambda: loop.submit(later)).start()
            if isinstance(e, RequestOutput) and e.request_id == "B":
                seen["b_step"] = engine.stats.num_steps
                done.set()

    loop = EngineLoop(lambda: engine, on_events)
    loop.start(timeout=5)
    try:
        loop.submit(AddRequest("C", [1], SamplingParams(max_tokens=10**9), 0.0))  # keeps the engine stepping
        loop.submit(AddRequest("A", [1], SamplingParams(max_tokens=3), 0.0))
        assert done.wait(10), "B was never served"
    finally:
        loop.stop(5)
    steps_between = seen["b_step"] - seen["finish_step"]
    if wait_ms:
        assert steps_between == 1  # B's first token came from the very next step
    else:
        assert steps_between > 1  # the fake engine stepped C many times in those 50 ms


def test_the_loop_learns_whether_clients_come_back():
    from cluster.worker.sampling_params import SamplingParams
    from cluster.worker.engine_loop import AddRequest, ClosedLoopClients

    def add(at):
        return AddRequest(f"r{at}", [1], SamplingParams(), at)

    c = ClosedLoopClients(0.010)
    assert not c.worth_waiting()  # nothing finished yet
    for t in range(5):  # closed loop: both finished clients are back within 10 ms
        c.finished(float(t), 2)
        assert c.worth_waiting() and c.deadline == t + 0.010
        c.observe([add(t + 0.003), add(t + 0.008)], t + 0.5)
    assert c.rate == 1.0
    for t in range(5, 7):  # open loop: nobody comes back (a late arrival does not count)
        c.finished(float(t), 2)
        c.observe([add(t + 0.2)], t + 0.5)
    assert c.rate < 0.5
    c.finished(7.0, 2)
    assert not c.worth_waiting()
    c.observe([add(7.001), add(7.002)], 7.5)  # measured even without waiting
    assert c.rate >= 0.5


def test_a_shutdown_ends_the_wait_for_comebacks():
    import time

    from cluster.worker.sampling_params import SamplingParams
    from cluster.worker.engine_loop import AddRequest

    engine = FakeEngine()
    engine.config.finish_wait_ms = 1000.0
    finished = threading.Event()
    loop = EngineLoop(lambda: engine, lambda now, events: any(
        e.request_id == "A" and e.finished for e in events if isinstance(e, RequestOutput)) and finished.set())
    loop.start(timeout=5)
    loop.submit(AddRequest("C", [1], SamplingParams(max_tokens=10**9), 0.0))
    loop.submit(AddRequest("A", [1], SamplingParams(max_tokens=2), 0.0))
    assert finished.wait(5)
    t = time.monotonic()
    loop.stop(5)  # the loop is waiting up to 1 s for A's client to come back
    assert not loop.alive and time.monotonic() - t < 0.5


def test_a_wedged_engine_is_reported_stalled_and_refuses_new_requests():
    """The watchdog's input: one engine step longer than stall_report makes the service
    stalled (load report, new requests refused); a step that finishes clears it, and the
    requests that waited through the wedge complete."""
    async def fn(svc, engine):
        assert not svc.stalled and not svc.load_report().stalled
        engine.unwedged.clear()
        task = asyncio.create_task(collect(svc, build_request([1, 2], max_tokens=3)))
        await asyncio.sleep(0.5)
        stalled = (svc.stalled, svc.load_report().stalled)
        with pytest.raises(Unavailable, match="stalled"):
            await collect(svc, build_request([3], max_tokens=1))
        engine.unwedged.set()
        chunks = await task
        return stalled, svc.stalled, [t for c in chunks for t in c.token_ids]

    stalled, after, toks = run_with_service(fn, stall_report=0.2)
    assert stalled == (True, True) and not after
    assert toks == [100, 101, 102]


def test_the_stall_threshold_follows_the_models_slowest_steps_but_not_a_stall():
    """`stall_report`, or 5x the slowest recent round or the warm-up's full prefill step:
    a slow model gets room; a round that was itself a stall does not raise the bar."""
    loop = EngineLoop(lambda: None, lambda now, events: None, stall_report=3.0)
    assert loop.stall_after == 3.0
    loop._round_done(0.1)
    assert loop.stall_after == 3.0
    loop._round_done(2.0)  # a big model's legitimately slow step
    assert loop.stall_after == 10.0
    loop._round_done(20.0)  # a wedge that ended: not a step time
    assert loop.stall_after == 10.0
    loop.full_step = 4.0
    assert loop.stall_after == 20.0


def test_a_suspect_that_cannot_come_back_does_not_stall_the_isolation():
    """After a failed step, a suspect whose re-add is refused is failed, and the next
    suspect and the requests held meanwhile still go on (nothing waits for ever)."""
    async def fn(svc, engine):
        real_add = engine.add_request

        def add(rid, prompt, params, arrival_time=None, resume_token_ids=()):
            if resume_token_ids and rid.startswith("victim@"):  # the engine id: the client id + "@n"
                raise ValueError("cannot come back")
            return real_add(rid, prompt, params, arrival_time, resume_token_ids)

        engine.add_request = add
        engine.unwedged.clear()  # the first step blocks until all four are sent
        victim = asyncio.create_task(collect(svc, build_request([1], max_tokens=4, request_id="victim")))
        other = asyncio.create_task(collect(svc, build_request([2], max_tokens=4, request_id="other")))
        await asyncio.sleep(0.05)
        bad = asyncio.create_task(collect(svc, build_request([BOOM], max_tokens=4, request_id="bad")))
        late = asyncio.create_task(collect(svc, build_request([3], max_tokens=2, request_id="late")))
        await asyncio.sleep(0.05)
        engine.unwedged.set()  # step 1: victim and other emit a token; step 2 (with bad) fails
        return await asyncio.gather(victim, other, bad, late, return_exceptions=True)

    victim, other, bad, late = run_with_service(fn)
    assert isinstance(bad, InternalError)
    assert [t for c in other for t in c.token_ids] == [100, 101, 102, 103]
    assert [t for c in late for t in c.token_ids] == [100, 101]
    assert isinstance(victim, InternalError) and "cannot come back" in str(victim)



def test_a_pooling_request_over_its_limits_is_refused_before_its_inputs_are_tokenized():
    """Embedding inputs: one over max_model_len's characters is refused before any input is
    tokenized; all of them over max_pooling_tokens together, by their characters before
    any is tokenized, by their tokens as soon as the running count passes it (not after
    the last input); token ids by their count at once."""
    from cluster.api.limits import RequestLimits
    from cluster.api.pooling import build_embed_request, build_score_request
    from cluster.api.wire import CHARS_PER_TOKEN_BOUND
    from cluster.worker.pooling import Pooler

    engine = FakeEngine()
    engine.pooler = Pooler(hidden_size=8, tasks=("embed", "score"), score_kind="yes_no", yes_no_ids=(1, 2))
    encoded = []

    def encode(text, **_):
        encoded.append(len(text))
        return [ord(c) % 50 + 1 for c in text]  # a token a character

    engine.tokenizer = SimpleNamespace(encode=encode, decode=lambda ids: "")
    too_long = CHARS_PER_TOKEN_BOUND * engine.config.max_model_len + 1

    async def fn(svc, engine):
        errors = []
        for request in (build_embed_request(["short"] * 7 + ["x" * too_long]),
                        build_embed_request(["x" * 10_000] * 10),  # 100,000 characters: >= 3125 tokens
                        build_embed_request(["x" * 1000] * 5),  # 5000 tokens, found at the fourth input
                        build_embed_request([[1] * 700] * 5),
                        build_score_request("q" * 15_000, ["a document"] * 8)):  # the query counts 8 times
            before = len(encoded)
            with pytest.raises(InvalidRequest) as e:
                await (svc.score if request.DESCRIPTOR.name == "ScoreRequest" else svc.embed)(request)
            errors.append((str(e.value), len(encoded) - before))
        return errors

    errors = run_with_service(fn, engine, limits=RequestLimits(max_pooling_tokens=3000))
    (long, n0), (chars, n1), (tokens, n2), (ids, n3), (pairs, n4) = errors
    assert f"input 7 has {too_long} characters" in long and n0 == 0
    assert "at least 3125 tokens together (100000 characters)" in chars and "max_pooling_tokens=3000" in chars
    assert n1 == 0
    assert "at least 4000 tokens together (up to input 3)" in tokens and n2 == 4
    assert "at least 3500 tokens together (3500 token ids)" in ids and n3 == 0
    assert "max_pooling_tokens=3000" in pairs and n4 == 0


def test_a_pooling_request_with_more_inputs_than_the_queue_holds_is_the_clients_error():
    """--max-pooling-inputs above --max-waiting: a request of more inputs than the waiting
    queue holds could never be queued; it is a 400 naming both numbers (a full queue,
    RESOURCE_EXHAUSTED, would count against every worker the router tried), and nothing
    reaches the engine."""
    from cluster.api.pooling import build_embed_request, build_score_request
    from cluster.worker.pooling import Pooler

    engine = FakeEngine()
    engine.pooler = Pooler(hidden_size=8, tasks=("embed", "score"), score_kind="yes_no", yes_no_ids=(1, 2))
    engine.config.max_waiting = 4

    async def fn(svc, engine):
        for request in (build_embed_request(["a"] * 5), build_score_request("q", ["d"] * 5)):
            with pytest.raises(InvalidRequest, match=r"5 inputs: more than this worker's waiting queue holds at once "
                                                     r"\(max_waiting=4\)"):
                await (svc.score if request.DESCRIPTOR.name == "ScoreRequest" else svc.embed)(request)
        return list(engine.added)

    assert run_with_service(fn, engine) == []


def test_every_engine_implements_the_engine_protocol():
    """The engine, the pipelined group's and the tests' fakes each define every member of
    the protocol the service and the engine loop use (a class that declares the protocol
    but misses a method would inherit its empty stub)."""
    from cluster.worker.engine import Engine
    from cluster.worker.engine_protocol import EngineProtocol
    from cluster.worker.group.pipelined import PipelinedEngine
    from scripted_engine import ScriptedEngine

    methods = [name for name, v in vars(EngineProtocol).items()
               if not name.startswith("_") and (callable(v) or isinstance(v, property))]
    assert {"add_request", "abort", "step", "has_unfinished", "num_waiting", "request_state"} <= set(methods)
    for cls in (Engine, PipelinedEngine, FakeEngine, ScriptedEngine):
        assert EngineProtocol in cls.__mro__, cls  # (issubclass: not for a protocol with data members)
        inherited = [name for name in methods if getattr(cls, name) is getattr(EngineProtocol, name)]
        assert not inherited, f"{cls.__name__} does not define {inherited}"
    assert isinstance(FakeEngine(), EngineProtocol)


def test_a_stop_waits_for_the_disk_tiers_flush_beside_the_engine_thread(monkeypatch):
    """A graceful stop gives the engine thread its usual time plus --kv-disk-flush-timeout:
    a shorter wait would cut the disk tier's queued writes off."""
    waits = []
    real = EngineLoop.stop
    monkeypatch.setattr(EngineLoop, "stop", lambda self, timeout=30.0: (waits.append(timeout), real(self, timeout)))
    engine = FakeEngine()
    engine.config.kv_disk_dir, engine.config.kv_disk_flush_timeout = "/nonexistent", 120.0

    async def fn(svc, engine):
        return None

    run_with_service(fn, engine)
    from cluster.worker.service import ENGINE_STOP_SECONDS

    assert waits == [ENGINE_STOP_SECONDS + 120.0]
