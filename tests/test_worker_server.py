"""The worker over real sockets: `orchard worker serve` in a subprocess on a tiny model."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.sdk import AsyncClient, Client, InvalidRequest, NotFound, Overloaded, Unavailable
from cluster.sdk import OrchardError

MAX_MODEL_LEN = 512
VOCAB = 512


def scrape(address: str) -> dict[tuple, float]:
    """{(sample name, frozenset of labels other than model/worker): value}"""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model", "worker"))
            out[(s.name, labels)] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_until_idle(address: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(address)
        idle = (metric(m, "orchard_kv_cache_usage_ratio") == 0 and metric(m, "orchard_num_requests_running") == 0
                and metric(m, "orchard_num_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def offline_greedy(model_dir, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """The engine without any server: the oracle for what the worker streams."""
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    engine = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=512, max_model_len=MAX_MODEL_LEN))
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def test_32_concurrent_streams_match_the_offline_engine(tiny_worker, tiny_model_dir):
    prompts = random_prompts(32, seed=1)
    max_tokens = [random.Random(i).randrange(4, 28) for i in range(32)]
    expected = offline_greedy(tiny_model_dir, prompts, max_tokens)

    async def run():
        events: list[tuple[float, int, str]] = []  # (time, stream, "first"|"last")

        async def one(client: AsyncClient, i: int) -> tuple[list[int], object, int]:
            tokens, last, n_chunks = [], None, 0
            async for chunk in client.stream(prompts[i], max_tokens=max_tokens[i], temperature=0, ignore_eos=True):
                if n_chunks == 0:
                    events.append((time.monotonic(), i, "first"))
                tokens += chunk.token_ids
                last, n_chunks = chunk, n_chunks + 1
            events.append((time.monotonic(), i, "last"))
            return tokens, last, n_chunks

        async with AsyncClient(tiny_worker.grpc, timeout=120) as client:
            results = await asyncio.gather(*(one(client, i) for i in range(32)))
        return results, events

    results, events = asyncio.run(run())
    for i, (tokens, last, n_chunks) in enumerate(results):
        assert tokens == expected[i], f"stream {i} differs from the offline engine"
        assert last.finish_reason == "length"
        assert last.usage.prompt_tokens == len(prompts[i]) and last.usage.completion_tokens == max_tokens[i]
        assert n_chunks > 1 or max_tokens[i] == 1
    # Streams run side by side, not one after the other.
    live = peak = 0
    for _, _, kind in sorted(events):
        live += 1 if kind == "first" else -1
        peak = max(peak, live)
    assert peak >= 8, f"at most {peak} streams were live at once"


def test_cancel_mid_stream_frees_kv_and_the_next_request_is_served(tiny_worker):
    before = wait_until_idle(tiny_worker.metrics)
    with Client(tiny_worker.grpc, timeout=60) as client:
        it = client.stream([5, 6, 7, 8] * 10, max_tokens=400, temperature=0, ignore_eos=True)
        got = [next(it) for _ in range(3)]
        assert all(c.finish_reason is None for c in got)
        mid = scrape(tiny_worker.metrics)
        assert metric(mid, "orchard_kv_cache_usage_ratio") > 0
        it.close()  # cancels the call
        after = wait_until_idle(tiny_worker.metrics)
        assert metric(after, "orchard_kv_cache_usage_ratio") == 0
        assert metric(after, "orchard_num_requests_running") == 0
        aborted = metric(after, "orchard_request_success_total", finished_reason="abort")
        assert aborted == metric(before, "orchard_request_success_total", finished_reason="abort") + 1
        generated = metric(after, "orchard_generation_tokens_total") - metric(before, "orchard_generation_tokens_total")
        assert generated < 400, "the request kept running after the cancel"
        result = client.generate([9, 10, 11], max_tokens=5, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 5 and result.finish_reason == "length"

    # The same with a raw gRPC call cancelled from the client side.
    with grpc.insecure_channel(tiny_worker.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4, 5]),
                                 sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True))
        call = stub.Generate(req, timeout=60)
        next(call)
        call.cancel()
    assert metric(wait_until_idle(tiny_worker.metrics), "orchard_kv_cache_usage_ratio") == 0


BAD_INPUTS = [
    # (name, request kwargs, expected exception, words the message must contain)
    ("empty text prompt", dict(prompt=""), InvalidRequest, "empty"),
    ("empty token prompt", dict(prompt=[]), InvalidRequest, "empty"),
    ("prompt over max_model_len", dict(prompt=[7] * (MAX_MODEL_LEN + 1)), InvalidRequest, "max_model_len"),
    ("token id outside the vocabulary", dict(prompt=[1, VOCAB + 5]), InvalidRequest, "token ids"),
    ("max_tokens 0", dict(prompt="hi", max_tokens=0), InvalidRequest, "max_tokens"),
    ("negative temperature", dict(prompt="hi", temperature=-0.5), InvalidRequest, "temperature"),
    ("top_p 0", dict(prompt="hi", top_p=0.0), InvalidRequest, "top_p"),
    ("top_p above 1", dict(prompt="hi", top_p=1.5), InvalidRequest, "top_p"),
    ("unknown model", dict(prompt="hi", model="no-such-model"), NotFound, "no-such-model"),
    ("empty chat", dict(messages=[]), InvalidRequest, "messages"),
]


@pytest.mark.parametrize("name,kwargs,error,words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_its_status_and_the_worker_keeps_serving(tiny_worker, name, kwargs, error, words):
    with Client(tiny_worker.grpc, timeout=30) as client:
        with pytest.raises(error) as info:
            client.generate(**kwargs)
        assert info.value.code == error.code
        assert words in info.value.message, info.value.message
        assert client.generate("still serving", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


def test_request_without_a_prompt_is_invalid(tiny_worker):
    with grpc.insecure_channel(tiny_worker.grpc) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no prompt" in info.value.details()


def test_metrics_count_exactly_what_was_sent(tiny_worker):
    before = wait_until_idle(tiny_worker.metrics)
    prompts = random_prompts(6, seed=7)
    max_tokens = [3, 5, 8, 1, 13, 4]
    with Client(tiny_worker.grpc, timeout=60) as client:
        for p, n in zip(prompts, max_tokens):
            assert len(client.generate(p, max_tokens=n, temperature=0, ignore_eos=True).token_ids) == n
    after = wait_until_idle(tiny_worker.metrics)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    n = len(prompts)
    assert delta("orchard_prompt_tokens_total") == sum(map(len, prompts))
    assert delta("orchard_generation_tokens_total") == sum(max_tokens)
    assert delta("orchard_request_success_total", finished_reason="length") == n
    assert delta("orchard_request_success_total", finished_reason="stop") == 0
    assert delta("orchard_time_to_first_token_seconds_count") == n
    assert delta("orchard_e2e_request_latency_seconds_count") == n
    assert delta("orchard_request_queue_time_seconds_count") == n
    assert delta("orchard_inter_token_latency_seconds_count") == sum(k - 1 for k in max_tokens)
    assert delta("orchard_prefix_cache_queries_total") == sum(map(len, prompts))
    # Histograms have vLLM's bucket edges; gauges describe the pool.
    assert ("orchard_time_to_first_token_seconds_bucket", frozenset({("le", "0.001")})) in after
    assert ("orchard_inter_token_latency_seconds_bucket", frozenset({("le", "0.01")})) in after
    assert ("orchard_e2e_request_latency_seconds_bucket", frozenset({("le", "7680.0")})) in after
    assert metric(after, "orchard_kv_cache_blocks_total") == 512
    assert metric(after, "orchard_num_preemptions_total") == 0


def test_resume_continues_exactly_where_the_interrupted_run_stopped(tiny_worker):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    with Client(tiny_worker.grpc, timeout=60) as client:
        full = client.generate(prompt, max_tokens=20, temperature=0, ignore_eos=True).token_ids
        assert len(full) == 20
        for k in (1, 7, 19):
            resumed = client.generate(prompt, max_tokens=20, temperature=0, ignore_eos=True, resume_token_ids=full[:k])
            assert resumed.token_ids == full[k:], f"resumed after {k}"
            assert resumed.usage.prompt_tokens == len(prompt)
            assert resumed.usage.completion_tokens == 20
            assert resumed.finish_reason == "length"
        done = client.generate(prompt, max_tokens=20, temperature=0, resume_token_ids=full)
        assert done.token_ids == [] and done.finish_reason == "length" and done.usage.completion_tokens == 20
        # A text prompt resumes the same way.
        text_full = client.generate("The orchard", max_tokens=12, temperature=0, ignore_eos=True).token_ids
        text_rest = client.generate("The orchard", max_tokens=12, temperature=0, ignore_eos=True,
                                    resume_token_ids=text_full[:5]).token_ids
        assert text_rest == text_full[5:]


def test_list_models_load_report_and_health(tiny_worker, tiny_model_dir):
    with Client(tiny_worker.grpc, timeout=10) as client:
        (model,) = client.list_models()
        assert model.id == tiny_model_dir.name and model.max_model_len == MAX_MODEL_LEN
        load = client.get_load()
        assert load.model == model.id and load.kv_blocks_total == 512 and load.max_num_seqs == 64
        assert load.block_size == 16 and load.max_model_len == MAX_MODEL_LEN and not load.draining
        assert load.worker_id.endswith(tiny_worker.grpc.rpartition(":")[2])
        assert client.health() == "SERVING"
        assert client.health("orchard.v1.Generation") == "SERVING"
        last = list(client.stream("hello", max_tokens=2))[-1]
        assert last.worker_id == load.worker_id


def test_drain_refuses_new_requests_with_unavailable(tiny_worker):
    with Client(tiny_worker.grpc, timeout=30) as client:
        try:
            it = client.stream([3, 4, 5], max_tokens=30, temperature=0, ignore_eos=True)
            first = next(it)  # running before the drain: it finishes
            assert client.drain(True).draining
            assert client.get_load().draining
            assert client.health("orchard.v1.Generation") == "NOT_SERVING"
            with pytest.raises(Unavailable, match="draining"):
                client.generate("new", max_tokens=2)
            for path, body in (("/v1/completions", {"prompt": "new"}), ("/health", None)):
                req = urllib.request.Request(f"http://{tiny_worker.http}{path}",
                                             data=body and json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with pytest.raises(urllib.error.HTTPError) as http_info:
                    urllib.request.urlopen(req, timeout=10)
                assert http_info.value.code == 503
            rest = list(it)
            assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 30
            assert rest[-1].finish_reason == "length"
        finally:
            client.drain(False)
        assert client.health("orchard.v1.Generation") == "SERVING"
        assert client.generate("back", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_full_queue_answers_resource_exhausted_and_429(tiny_model_dir, worker_process):
    # A long context (32768 > the model's 2048 positions; fine for random weights) keeps the
    # one running request busy for tens of thousands of steps (well over a minute even on a
    # quiet machine) while the queue is checked; the test closes it.
    w = worker_process(tiny_model_dir, "--num-kv-blocks", "2100", "--max-model-len", "32768", "--max-num-seqs", "1",
                       "--max-waiting", "1")
    with Client(w.grpc, timeout=60) as client:
        running = client.stream([3, 4, 5], max_tokens=32000, ignore_eos=True)  # holds the only slot
        next(running)
        waiting = client.stream([6, 7, 8], max_tokens=5, ignore_eos=True)  # fills the queue
        started = _in_thread(lambda: list(waiting))
        deadline = time.monotonic() + 10
        while client.get_load().num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.get_load().num_waiting == 1
        with pytest.raises(Overloaded, match="queue is full") as info:
            client.generate("one too many", max_tokens=2)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        req = urllib.request.Request(f"http://{w.http}/v1/completions", data=json.dumps({"prompt": "x"}).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http_info:
            urllib.request.urlopen(req, timeout=10)
        assert http_info.value.code == 429
        assert "queue is full" in json.loads(http_info.value.read())["error"]["message"]
        running.close()  # frees the slot: the waiting one runs
        assert started.result(timeout=30)[-1].finish_reason == "length"
        assert client.generate("served again", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    assert w.stop() == 0, "the worker should exit cleanly on SIGTERM:\n" + "".join(w.log[-60:])


def _in_thread(fn):
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def test_chat_and_logprobs(tiny_worker):
    with Client(tiny_worker.grpc, timeout=30) as client:
        chat = client.chat([{"role": "user", "content": "hello there"}], max_tokens=6, temperature=0, ignore_eos=True)
        assert len(chat.token_ids) == 6 and chat.usage.prompt_tokens > 3
        same = client.generate(messages=[("user", "hello there")], max_tokens=6, temperature=0, ignore_eos=True)
        assert same.token_ids == chat.token_ids
        r = client.generate([20, 21, 22], max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
        assert len(r.logprobs) == 4
        for token, lp in zip(r.token_ids, r.logprobs):
            assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
            assert lp.top[0][0] == token, "greedy picks the most likely token"
            assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-5)
        assert client.generate([20, 21, 22], max_tokens=2).logprobs is None


def test_stop_strings_and_stop_reason(tiny_worker):
    with Client(tiny_worker.grpc, timeout=30) as client:
        base = client.generate([30, 31, 32], max_tokens=16, temperature=0, ignore_eos=True)
        stop_token = base.token_ids[3]
        r = client.generate([30, 31, 32], max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_token])
        assert r.finish_reason == "stop" and r.stop_reason == str(stop_token)
        assert r.token_ids == base.token_ids[: base.token_ids.index(stop_token) + 1]


def test_errors_are_orchard_errors(tiny_worker):
    with Client(tiny_worker.grpc, timeout=10) as client:
        with pytest.raises(OrchardError):
            client.generate("x", top_p=2.0)


def test_a_failed_start_leaves_nothing_running(tiny_model_dir, monkeypatch):
    """The metrics port is taken: start() raises, and the engine thread and the gRPC server
    it had already started are stopped (the gRPC port can be bound again)."""
    import socket
    import sys

    from cluster.worker.config import EngineConfig
    from cluster.worker.server import GIL_SWITCH_INTERVAL_S, WorkerOptions, WorkerServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        grpc_port = probe.getsockname()[1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        options = WorkerOptions(str(tiny_model_dir), EngineConfig(num_kv_blocks=64, max_model_len=256),
                                grpc_address=f"127.0.0.1:{grpc_port}",
                                metrics_address=f"127.0.0.1:{taken.getsockname()[1]}")
        server = WorkerServer(options)
        default, intervals = sys.getswitchinterval(), []
        real = sys.setswitchinterval
        monkeypatch.setattr(sys, "setswitchinterval", lambda s: intervals.append(s) or real(s))
        with pytest.raises(OSError, match="cannot listen"):
            asyncio.run(server.start())
    # the engine thread got the GIL back quickly from the streaming side while it ran
    # (server.py), and stop() gave the process its own interval back
    assert intervals == [GIL_SWITCH_INTERVAL_S, default] and sys.getswitchinterval() == default
    assert not server.engine_loop._thread.is_alive()
    with socket.socket() as again:
        again.bind(("127.0.0.1", grpc_port))


def test_a_model_that_cannot_load_is_one_clear_line_and_exit_78(tiny_model_dir, tmp_path):
    """No traceback for a supervisor's log to repeat every few seconds: one line that says
    which model and why, and EX_CONFIG (launchd's ThrottleInterval spaces the retries)."""
    import json
    import shutil
    import subprocess
    import sys

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "gemma3_text"  # an architecture whose weights these are not
    (broken / "config.json").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "cluster", "worker", "serve", "--model", str(broken), "--grpc",
                          "127.0.0.1:0", "--metrics", "off"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 78, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"orchard worker serve: cannot load the model at {broken}: ")
