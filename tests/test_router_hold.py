"""The router's hold with real processes: a model's sole `orchard worker serve` killed
(kill -9) mid-stream and restarted. Its streams are held and resume token-exact on the
new process; a request sent during the outage waits for it (cluster/router/proxy.py).

One router + ONE worker of the tiny model for the module (`LocalCluster`, free ports,
0.2 s heartbeats, the default --resume-wait).
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.up import LocalCluster, free_port
from conftest import run
from test_router_procs import channel, collect, list_workers, metric, request, scrape, wait_for

HEARTBEAT = 0.2


@pytest.fixture(scope="module")
def sole(tiny_model_dir, tmp_path_factory):
    import test_router_procs

    c = LocalCluster(
        tiny_model_dir, workers=1,
        grpc_address=f"127.0.0.1:{free_port()}", http_address=f"127.0.0.1:{free_port()}",
        metrics_address=f"127.0.0.1:{free_port()}", worker_port_base=0, worker_metrics_port_base=0,
        log_dir=tmp_path_factory.mktemp("hold-logs"),
        router_args=["--heartbeat-interval", str(HEARTBEAT)],
        worker_args=["--num-kv-blocks", "1024", "--max-num-seqs", "64"],
    )
    with c:
        test_router_procs.CLUSTER = c  # the helpers present its (no) credentials
        yield c
        test_router_procs.CLUSTER = None


@pytest.mark.slow
def test_a_sole_worker_killed_and_restarted_loses_no_stream(sole):
    """8 greedy streams of 200 tokens; kill -9 of the only worker mid-stream, then its
    restart: every stream completes identical to the run without the fault, no client sees
    an error, and a request sent while the worker was down is served once it is back."""
    prompts = [f"Held {i}: the router keeps every token of" for i in range(8)]
    late_prompt = "Sent while the worker was down"
    max_tokens = 200

    async def streams(strike_after: int | None):
        """The 8 streams (and, with `strike_after`, the late request); once `strike_after`
        tokens have arrived in all, kill -9 the worker, then restart it."""
        killed = asyncio.Event()
        async with channel(sole.router_address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            seen = {"tokens": 0}

            def on_chunk(c):
                seen["tokens"] += len(c.token_ids)
                if strike_after and not killed.is_set() and seen["tokens"] >= strike_after:
                    os.kill(sole.workers[0].proc.pid, signal.SIGKILL)
                    killed.set()

            async def outage():
                """Once the worker is dead and the router knows it: the late request, then
                the restart."""
                await killed.wait()
                await asyncio.to_thread(sole.workers[0].proc.wait, 10)
                await asyncio.to_thread(wait_for, lambda: list_workers(sole)["worker-0"].state
                                        != pb.WORKER_STATE_HEALTHY, 30, "the router seeing the worker down")
                late = asyncio.create_task(collect(stub, request(late_prompt, 50)))
                await asyncio.to_thread(sole.start_worker, 0)
                await asyncio.to_thread(sole.wait_ready, 120)
                return await late

            runs = [collect(stub, request(p, max_tokens), on_chunk) for p in prompts]
            if not strike_after:
                return await asyncio.gather(*runs, collect(stub, request(late_prompt, 50)))
            return await asyncio.gather(*runs, outage())

    reference = run(streams(None), timeout=240)
    # The fault must land while the worker still owes tokens: a client lagging behind a
    # fast worker (a loaded machine) may read its tokens after the worker sent them all,
    # and then nothing is resumed. Such a try proves nothing, so it is run again.
    for _ in range(3):
        before = metric(scrape(sole.metrics_address), 'orchard_router_retries_total{kind="resume"}')
        try:
            faulty = run(streams(8 * 16), timeout=300)  # about 16 tokens into each stream
        finally:
            if sole.workers[0].proc.poll() is not None:  # a failed try leaves the worker up for the next
                sole.start_worker(0)
                sole.wait_ready(120)
        for (ref_toks, ref_text, _), (toks, text, chunks) in zip(reference, faulty):
            assert toks == ref_toks
            assert text == ref_text
            assert chunks[-1].finish_reason
        assert len(faulty[0][0]) == max_tokens and faulty[0][2][-1].usage.completion_tokens == max_tokens
        resumed = metric(scrape(sole.metrics_address), 'orchard_router_retries_total{kind="resume"}') - before
        if resumed:
            break
    else:
        pytest.fail("in 3 tries the kill never struck while the worker still owed tokens")
