"""The router with real `orchard worker serve` processes on a tiny model.

One router + 2 workers for the module (`LocalCluster`, free ports, 0.2 s heartbeats),
once in the clear and once secured (`orchard up --secure`'s set-up: API and admin keys,
TLS, mutual TLS between router and workers): every test passes both ways.
Tests that kill or restart a process bring it back before they end.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import ssl
import urllib.request

import grpc
import pytest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.net import CHANNEL_OPTIONS
from cluster.security import channel as secure_channel
from cluster.up import LocalCluster, free_port
from conftest import run, wait_for
from strike import Striker, until_one_moves

HEARTBEAT = 0.2


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module", params=["plain", "secure"])
def cluster(request, model_dir, tmp_path_factory):
    global CLUSTER
    c = LocalCluster(
        model_dir, workers=2,
        grpc_address=f"127.0.0.1:{free_port()}", http_address=f"127.0.0.1:{free_port()}",
        metrics_address=f"127.0.0.1:{free_port()}", worker_port_base=0, worker_metrics_port_base=0,
        log_dir=tmp_path_factory.mktemp("router-logs"),
        router_args=["--heartbeat-interval", str(HEARTBEAT)],
        worker_args=["--num-kv-blocks", "1024", "--max-num-seqs", "64"],
        secure=request.param == "secure",
    )
    with c:
        CLUSTER = c
        yield c


CLUSTER: LocalCluster | None = None  # the module's cluster now: the helpers below present its credentials


def channel(target: str, admin: bool = False):
    """An asyncio channel to `target` with the cluster's credentials (none when plain)."""
    return secure_channel(target, CLUSTER.client_security(admin), options=CHANNEL_OPTIONS)


def client_env(admin: bool = True) -> dict:
    """The environment a CLI command needs to reach the cluster."""
    env = dict(os.environ)
    sec = CLUSTER.client_security(admin)
    if CLUSTER.secrets is not None:
        env.update(ORCHARD_ADMIN_KEY=CLUSTER.secrets.admin_key, ORCHARD_API_KEY=CLUSTER.secrets.api_key,
                   ORCHARD_TLS_CA=sec.tls_ca, ORCHARD_TLS_CERT=sec.tls_cert, ORCHARD_TLS_KEY=sec.tls_key)
    return env


def orchard(*args: str, timeout: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=client_env() if env is None else env)


def request(text: str, max_tokens: int = 16, model: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, model=model, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def collect(stub, req, on_chunk=None) -> tuple[list[int], str, list[pb.GenerateResponse]]:
    toks, text, chunks = [], "", []
    async for c in stub.Generate(req):
        toks += c.token_ids
        text += c.text
        chunks.append(c)
        if on_chunk is not None:
            on_chunk(c)
    return toks, text, chunks


def list_workers(c: LocalCluster) -> dict[str, pb.WorkerInfo]:
    with secure_channel(c.router_address, c.client_security(admin=True), aio=False) as ch:
        resp = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    return {w.worker_id: w for w in resp.workers}


def scrape(address: str) -> str:
    """/metrics, over TLS with a key when the cluster is secured."""
    if CLUSTER is None or CLUSTER.secrets is None:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            return r.read().decode()
    sec = CLUSTER.client_security()
    req = urllib.request.Request(f"https://{address}/metrics", headers={"Authorization": f"Bearer {sec.api_key}"})
    with urllib.request.urlopen(req, timeout=5, context=ssl.create_default_context(cafile=sec.tls_ca)) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples over all label sets."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def test_placement_follows_load(cluster):
    """Worker 0 saturated by direct clients, worker 1 idle: the router sends new work to 1."""

    async def main():
        async with channel(cluster.worker_addresses[0]) as wch, channel(cluster.router_address) as rch:
            direct, routed = pb_grpc.GenerationStub(wch), pb_grpc.GenerationStub(rch)
            hogs = [asyncio.create_task(collect(direct, request(f"hog {i}", 2000))) for i in range(24)]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while loop.time() < deadline:  # the router learns it from a heartbeat
                load = list_workers(cluster)["worker-0"].load
                if load.num_running + load.num_waiting >= 20:
                    break
                await asyncio.sleep(0.05)
            else:
                raise TimeoutError("worker-0 never reported its load")
            results = await asyncio.gather(*(collect(routed, request(f"light {i}", 4)) for i in range(6)))
            for h in hogs:
                h.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)
            return [{c.worker_id for c in chunks} for _, _, chunks in results]

    assert run(main()) == [{"worker-1"}] * 6


def test_prefix_affinity(cluster):
    """Requests sharing a long prefix land on one worker; its prefix cache shows the hits."""
    prefix = "You are the orchard's assistant. Answer about apples, pears and plums, briefly. " * 12

    async def main():
        async with channel(cluster.router_address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            before = [metric(scrape(m), "orchard_prefix_cache_hits_total") for m in cluster.worker_metrics]
            placed, cached = [], []
            for i in range(6):
                _, _, chunks = await collect(stub, request(prefix + f"Question {i}: which tree?", 4))
                placed.append(chunks[-1].worker_id)
                cached.append(chunks[-1].usage.cached_tokens)
            after = [metric(scrape(m), "orchard_prefix_cache_hits_total") for m in cluster.worker_metrics]
            return placed, cached, before, after

    placed, cached, before, after = run(main())
    assert len(set(placed)) == 1, placed
    home = int(placed[0].split("-")[1])
    assert all(n >= 16 * 10 for n in cached[1:]), cached  # most of the prefix came from the cache
    assert after[home] - before[home] >= 5
    assert after[1 - home] == before[1 - home]


@pytest.mark.parametrize("sampling,fault", [
    ("greedy", "kill"),
    pytest.param("seeded", "kill", marks=pytest.mark.slow),
    pytest.param("greedy", "stop", marks=pytest.mark.slow),
])
def test_failover_resumes_mid_stream(cluster, sampling, fault):
    """16 concurrent streams; kill -9 (or SIGSTOP: a Mac asleep, its connections open but
    silent) of a worker mid-stream; outputs unchanged, none cut short. Greedy by contract;
    seeded sampling too, since the engine replays a seed's stream on resume."""
    prompts = [f"Stream {i}: the router keeps every token of" for i in range(16)]
    max_tokens = 400  # the tiny model is fast: the streams must still be running at the kill

    def make(i: int, text: str) -> pb.GenerateRequest:
        req = request(text, max_tokens)
        if sampling == "seeded":
            req.sampling.temperature, req.sampling.seed = 0.9, 1000 + i
        return req

    async def streams(striker: Striker):
        async with channel(cluster.router_address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            return await asyncio.gather(*(collect(stub, make(i, p), striker.on_chunk(i))
                                          for i, p in enumerate(prompts)))

    def strike(worker_id: str) -> None:
        os.kill(cluster.workers[int(worker_id.split("-")[1])].proc.pid,
                signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

    def bring_back(victim: int) -> None:
        if fault == "stop":
            os.kill(cluster.workers[victim].proc.pid, signal.SIGCONT)
            wait_for(lambda: sum(w.state == pb.WORKER_STATE_HEALTHY for w in list_workers(cluster).values()) == 2,
                     30, "the stopped worker back")
        else:
            cluster.workers[victim].proc.wait(timeout=10)
            cluster.start_worker(victim)
            cluster.wait_ready(120)

    reference = run(streams(Striker(None, strike)))

    def attempt() -> bool:
        before = metric(scrape(cluster.metrics_address), 'orchard_router_retries_total{kind="resume"}')
        striker = Striker(16 * 16, strike)  # about 16 tokens into each stream
        try:
            faulty = run(streams(striker))
            assert striker.struck
            victim = int(striker.struck[0].split("-")[1])
            for (ref_toks, ref_text, _), (toks, text, chunks) in zip(reference, faulty):
                assert len(toks) == max_tokens
                assert toks == ref_toks
                assert text == ref_text
                assert chunks[-1].usage.completion_tokens == max_tokens
            moved = [i for i, (_, _, chunks) in enumerate(faulty)
                     if len({c.worker_id for c in chunks if c.token_ids}) > 1]
            if not moved:
                return False
            text = scrape(cluster.metrics_address)
            resumed = metric(text, 'orchard_router_retries_total{kind="resume"}') - before
            assert resumed >= len(moved), (victim, moved, [ln for ln in text.splitlines() if "retries_total" in ln])
            states = {k: w.state for k, w in list_workers(cluster).items()}
            if fault == "stop":  # silent long enough to be forgotten, or not yet
                assert states.get(f"worker-{victim}", pb.WORKER_STATE_UNHEALTHY) == pb.WORKER_STATE_UNHEALTHY
            else:
                assert states[f"worker-{victim}"] == pb.WORKER_STATE_UNHEALTHY
            assert states[f"worker-{1 - victim}"] == pb.WORKER_STATE_HEALTHY
            return True
        finally:  # brought back even when a run fails
            for worker_id in striker.struck:
                bring_back(int(worker_id.split("-")[1]))

    until_one_moves(attempt)


def test_router_restart_workers_come_back(cluster):
    """After a router crash and restart, the workers are listed again within 5 s of the new
    router answering (they re-register on their next heartbeat)."""
    router = cluster.router.proc
    router.send_signal(signal.SIGKILL)
    router.wait(timeout=10)
    t0 = time.monotonic()
    cluster.start_router()
    up_at = None

    def back():
        nonlocal up_at
        try:
            ws = list_workers(cluster)
        except grpc.RpcError:
            return None
        up_at = up_at or time.monotonic()
        return len([w for w in ws.values() if w.state == pb.WORKER_STATE_HEALTHY]) == 2

    wait_for(back, 30, "both workers registered again")
    done = time.monotonic()
    out = orchard("router", "workers", "--router", cluster.router_address)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["ID", "ADDRESS", "MODEL", "STATE"]
    assert {ln.split()[0] for ln in lines[1:] if "healthy" in ln} == {"worker-0", "worker-1"}
    assert done - up_at < 5.0, f"workers back {done - up_at:.1f} s after the router came up ({done - t0:.1f} s in all)"


def test_drain_no_worker_and_unavailable(cluster):
    async def main():
        async with channel(cluster.router_address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, request("x", model="no-such-model"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

            # A long stream on worker-0, then drain it: the stream finishes, new work goes to worker-1.
            long_req = request("a long one", 300)
            first = asyncio.get_running_loop().create_future()

            def note(c):
                if not first.done():
                    first.set_result(c.worker_id)

            task = asyncio.create_task(collect(stub, long_req, note))
            on = await first
            out = await asyncio.to_thread(orchard, "router", "drain", "--router", cluster.router_address, on)
            assert out.returncode == 0 and "draining" in out.stdout, out.stderr
            other = {"worker-0": "worker-1", "worker-1": "worker-0"}[on]
            for i in range(3):
                _, _, chunks = await collect(stub, request(f"after drain {i}", 2))
                assert chunks[-1].worker_id == other
            toks, _, chunks = await task
            assert len(toks) == 300 and {c.worker_id for c in chunks} == {on}

            # Both drained: no worker can take a request, so the router holds it (--resume-wait)
            # until one is undrained.
            await asyncio.to_thread(orchard, "router", "drain", "--router", cluster.router_address, other)
            held = asyncio.create_task(collect(stub, request("held until a worker is back", 2)))
            done, _ = await asyncio.wait({held}, timeout=1.0)
            assert not done, held.result()
            for w in (on, other):
                out = await asyncio.to_thread(orchard, "router", "drain", "--undo", "--router",
                                              cluster.router_address, w)
                assert out.returncode == 0, out.stderr
            _, _, chunks = await asyncio.wait_for(held, 30)
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH

    run(main())


def test_a_worker_whose_model_does_not_load_is_listed_as_failed_with_why(cluster, model_dir, tmp_path):
    """A worker whose model cannot load exits 78 and tells the router first: `orchard router
    workers` lists it as failed with the reason, and a request for its model gets the
    reason at once (UNAVAILABLE), not a wait for a worker that will not come."""
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    port = free_port()
    worker = cluster._spawn("worker-broken", [
        "worker", "serve", "--model", str(broken), "--grpc", f"127.0.0.1:{port}", "--metrics", "off",
        "--worker-id", "broken", "--router", cluster.router_address])
    try:
        assert worker.proc.wait(timeout=120) == 78, worker.log_path.read_text(errors="replace")[-2000:]
        info = list_workers(cluster)["broken"]
        assert info.state == pb.WORKER_STATE_FAILED and info.model == "broken-model"
        assert info.failure.permanent and info.failure.exit_code == 78 and "safetensors" in info.failure.reason
        out = orchard("router", "workers", "--router", cluster.router_address)
        assert out.returncode == 0 and "failed" in out.stdout, out.stderr
        assert "could not start" in out.stdout and "not started again until that is fixed" in out.stdout

        async def ask():
            async with channel(cluster.router_address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(pb_grpc.GenerationStub(ch), request("x", model="broken-model"))
                return e.value

        t0 = time.monotonic()
        error = run(ask())
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "worker broken could not start" in error.details()
        assert time.monotonic() - t0 < 10  # no hold
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait(timeout=30)
        orchard("router", "remove", "--router", cluster.router_address, "broken")
    assert "broken" not in list_workers(cluster)


def test_wrong_token_refused_then_static_registration(cluster, model_dir):
    port = free_port()
    extra = cluster._spawn("worker-extra", [
        "worker", "serve", "--model", str(model_dir), "--grpc", f"127.0.0.1:{port}", "--metrics", "off",
        "--worker-id", "extra", "--router", cluster.router_address, "--join-token", "not-the-token",
        "--num-kv-blocks", "256"])
    try:
        wait_for(lambda: "refused" in extra.log_path.read_text(errors="replace"), 60, "the router's refusal")
        assert "PERMISSION_DENIED" in extra.log_path.read_text() or "join token" in extra.log_path.read_text()
        assert "extra" not in list_workers(cluster)
        register = ("router", "register", "--router", cluster.router_address, "--worker", f"127.0.0.1:{port}")
        if cluster.secrets is not None:  # an admin operation: neither no key nor an API key will do
            env = client_env()
            env.pop("ORCHARD_ADMIN_KEY")
            no_key = orchard(*register, env={**env, "ORCHARD_API_KEY": ""})
            assert no_key.returncode == 1 and "UNAUTHENTICATED" in no_key.stderr, no_key.stderr
            api_key = orchard(*register, "--admin-key", cluster.secrets.api_key, env=env)
            assert api_key.returncode == 1 and "PERMISSION_DENIED" in api_key.stderr, api_key.stderr
            assert "extra" not in list_workers(cluster)
        out = orchard(*register)
        assert out.returncode == 0 and "extra" in out.stdout, out.stderr
        info = list_workers(cluster)["extra"]
        assert info.static and info.state == pb.WORKER_STATE_HEALTHY and info.model == model_dir.name
    finally:
        orchard("router", "remove", "--router", cluster.router_address, "extra")
        extra.proc.send_signal(signal.SIGTERM)
        extra.proc.wait(timeout=30)
    assert "extra" not in list_workers(cluster)


def test_openai_http_through_the_router(cluster):
    from openai import OpenAI

    if cluster.secrets is None:
        client = OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="none", timeout=30)
    else:  # TLS verified against the fleet CA, and the API key
        from openai import DefaultHttpxClient

        sec = cluster.client_security()
        client = OpenAI(base_url=f"https://{cluster.http_address}/v1", api_key=sec.api_key, timeout=30,
                        http_client=DefaultHttpxClient(verify=ssl.create_default_context(cafile=sec.tls_ca)))
    models = [m.id for m in client.models.list().data]
    assert models == [cluster.model.rsplit("/", 1)[-1]]
    out = client.completions.create(model=models[0], prompt="Hello orchard", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=models[0], prompt="Hello orchard", max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert text == out.choices[0].text
    router_metrics = scrape(cluster.metrics_address)
    for name in ("orchard_router_requests_total", "orchard_router_time_to_first_token_seconds_count",
                 "orchard_router_workers", "orchard_router_retries_total", "orchard_router_inflight_requests"):
        assert name in router_metrics


def test_n_and_prompt_logprobs_pass_through_the_router(cluster):
    """One request for 3 samples with prompt logprobs and echo: the router relays every
    sample to its finish (not just the first), and sample i is what a lone request with
    seed + i gives."""
    def sampled(n: int, seed: int) -> pb.GenerateRequest:
        req = pb.GenerateRequest(text="Pass it through the router", sampling=pb.SamplingParams(
            max_tokens=4, temperature=0.8, seed=seed, ignore_eos=True, n=n, echo=n > 1))
        if n > 1:
            req.sampling.prompt_logprobs = 1
        return req

    async def go():
        async with channel(cluster.router_address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            _, _, chunks = await collect(stub, sampled(3, 40))
            alone = [(await collect(stub, sampled(1, 40 + i)))[0] for i in range(3)]
            return chunks, alone

    chunks, alone = run(go())
    by_index: dict[int, list[int]] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).extend(c.token_ids)
    assert [by_index[i] for i in range(3)] == alone
    assert sum(1 for c in chunks if c.finish_reason) == 3
    assert chunks[-1].usage.completion_tokens == 12
    first = chunks[0]
    assert first.prompt_text == "Pass it through the router"
    n_prompt = len(first.prompt_token_ids)
    assert n_prompt == chunks[-1].usage.prompt_tokens and len(first.prompt_logprobs) == n_prompt
    assert [lp.token_id for lp in first.prompt_logprobs] == list(first.prompt_token_ids)
    assert all(lp.logprob < 0 and len(lp.top) == 1 for lp in first.prompt_logprobs[1:])
