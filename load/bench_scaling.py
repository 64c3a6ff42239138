"""Scaling out: 2 workers against 1 behind the router, each worker on one CPU core.

    python load/bench_scaling.py [--model DIR] [--per-worker-concurrency 16] [--rounds 3]

Worker i runs on CPU core i only (`os.sched_setaffinity`, one BLAS thread); the router
and the load generator are not pinned and share the machine with the workers. One
router and two workers stay up; a "1 worker" phase drains worker-1 through the router
(it then idles), a "2 workers" phase takes it back. Phases alternate over --rounds so
that whatever else runs on the machine weighs on both alike. Each phase gets the same
load per worker: --per-worker-concurrency streams per worker, 4 requests of
--max-tokens tokens per stream. Prints tokens/s, the CPU each process used, the ratio
per round and overall. Target: 2 workers at least 1.6x one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from cluster.models_cache import resolve_model  # noqa: E402
from cluster.proto.orchard.v1 import orchard_pb2 as pb  # noqa: E402
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc  # noqa: E402
from cluster.bench.closed_loop import run_load, text_request  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402

WORDS = "apple pear plum cherry quince orchard branch root leaf blossom harvest basket ladder".split()
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{seed}.{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 48))) for i in range(n)]


def set_workers(c: LocalCluster, n: int, timeout: float = 30) -> None:
    """Drain worker-1 (n=1) or take it back (n=2), and wait until the router agrees."""
    want = pb.WORKER_STATE_DRAINING if n == 1 else pb.WORKER_STATE_HEALTHY
    with grpc.insecure_channel(c.router_address) as ch:
        stub = pb_grpc.RouterStub(ch)
        stub.DrainWorker(pb.DrainWorkerRequest(worker_id="worker-1", drain=n == 1), timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = {w.worker_id: w.state for w in stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers}
            if states.get("worker-1") == want and states.get("worker-0") == pb.WORKER_STATE_HEALTHY:
                return
            time.sleep(0.1)
    raise TimeoutError(f"worker-1 did not reach state {want}")


def phase(c: LocalCluster, n: int, seed: int, args) -> tuple[float, dict[str, float]]:
    set_workers(c, n)
    concurrency = args.per_worker_concurrency * n
    reqs = [text_request(t, args.max_tokens) for t in prompts(4 * concurrency, seed)]
    pids = {"router": c.router.proc.pid, "load generator": os.getpid(),
            **{f"worker-{i}": w.proc.pid for i, w in enumerate(c.workers)}}
    before = {k: cpu_seconds(pid) for k, pid in pids.items()}
    load = run_load(c.router_address, reqs, concurrency)
    used = {k: (cpu_seconds(pid) - before[k]) / load.duration for k, pid in pids.items()}
    print(f"  {n} worker{'s' if n > 1 else ' '}: {load.throughput:6.1f} tok/s ({load.tokens} tokens in "
          f"{load.duration:.1f} s, {concurrency} streams, TTFT p50 {load.ttft_p50 * 1e3:.0f} ms); CPU cores used: "
          + ", ".join(f"{k} {v:.2f}" for k, v in used.items()), flush=True)
    return load.throughput, used


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="mlx-lm model directory or name (default: small, random weights)")
    p.add_argument("--per-worker-concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("needs at least 2 CPU cores", file=sys.stderr)
        return 1
    model = resolve_model(args.model)
    print(f"model {model.name}; worker i pinned to core {cores[:2]}[i], one BLAS thread each; "
          f"{args.per_worker_concurrency} streams per worker, {args.max_tokens} tokens each", flush=True)
    c = LocalCluster(model, workers=2, grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
                     metrics_address=None, worker_port_base=0, worker_metrics_port_base=0, policy="least_loaded",
                     log_dir=tempfile.mkdtemp(prefix="orchard-bench-scaling-"),
                     cpus=[[cores[0]], [cores[1]]], worker_env=ONE_THREAD)
    rates = {1: [], 2: []}
    worker_cpu = {1: [], 2: []}
    with c:
        for w in c.worker_addresses:  # warm up each worker directly
            run_load(w, [text_request(t, 8) for t in prompts(8, 99)], 8)
        for r in range(args.rounds):
            print(f"round {r}", flush=True)
            for n in ((1, 2) if r % 2 == 0 else (2, 1)):
                rate, used = phase(c, n, 100 * r + n, args)
                rates[n].append(rate)
                worker_cpu[n].append(sum(v for k, v in used.items() if k.startswith("worker")))
    ratios = [b / a for a, b in zip(rates[1], rates[2])]
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    cpu1, cpu2 = statistics.median(worker_cpu[1]), statistics.median(worker_cpu[2])
    ratio = statistics.median(ratios)
    print()
    print(f"1 worker  {one:7.1f} tok/s (median)   workers used {cpu1:.2f} CPU cores ({one / cpu1:.0f} tok/s per core)")
    print(f"2 workers {two:7.1f} tok/s (median)   workers used {cpu2:.2f} CPU cores ({two / cpu2:.0f} tok/s per core)")
    print(f"ratio per round {', '.join(f'{x:.2f}' for x in ratios)}; median {ratio:.2f}x "
          f"(target >= 1.6x: {'ok' if ratio >= 1.6 else 'MISSED'})")
    if cpu2 < 1.8:
        print(f"note: the two workers got {cpu2:.2f} of their 2 cores; the rest went to other processes on the machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
