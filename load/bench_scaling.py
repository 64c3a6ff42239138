"""Scaling out: 2 workers against 1 behind the router, each worker on one CPU core.

    python load/bench_scaling.py [--model DIR] [--per-worker-concurrency 16] [--rounds 2]

Worker i runs on CPU core i only (`os.sched_setaffinity`, one BLAS thread); the router
and the load generator are not pinned and share the machine with the workers. Each
configuration gets the same load per worker (--per-worker-concurrency streams of
--max-tokens tokens each, 4 requests per stream), so a worker is equally busy in both.
Prints generated tokens/s of each and the ratio. Target: at least 1.6x.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cluster  # noqa: E402,F401
from cluster.models_cache import resolve_model  # noqa: E402
from cluster.router.loadgen import run_load, text_request  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402

WORDS = "apple pear plum cherry quince orchard branch root leaf blossom harvest basket ladder".split()
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 48))) for i in range(n)]


def measure(model: Path, workers: int, cores: list[int], args) -> tuple[float, float]:
    """(best tokens/s over the rounds, CPU cores the workers used in that round)"""
    c = LocalCluster(model, workers=workers, grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
                     metrics_address=None, worker_port_base=0, worker_metrics_port_base=0, policy="least_loaded",
                     log_dir=tempfile.mkdtemp(prefix=f"orchard-bench-scaling-{workers}-"),
                     cpus=[[cores[i]] for i in range(workers)], worker_env=ONE_THREAD)
    concurrency = args.per_worker_concurrency * workers
    with c:
        run_load(c.router_address, [text_request(t, 8) for t in prompts(concurrency, 99)], concurrency)  # warm up
        rates, worker_cores = [], []
        for r in range(args.rounds):
            reqs = [text_request(t, args.max_tokens) for t in prompts(4 * concurrency, r)]
            pids = {"router": c.router.proc.pid, "load generator": os.getpid(),
                    **{f"worker-{i}": w.proc.pid for i, w in enumerate(c.workers)}}
            before = {k: cpu_seconds(pid) for k, pid in pids.items()}
            load = run_load(c.router_address, reqs, concurrency)
            used = {k: (cpu_seconds(pid) - before[k]) / load.duration for k, pid in pids.items()}
            rates.append(load.throughput)
            worker_cores.append(sum(v for k, v in used.items() if k.startswith("worker")))
            print(f"  {workers} worker(s) round {r}: {load.throughput:.1f} tok/s "
                  f"({load.tokens} tokens in {load.duration:.1f} s, concurrency {concurrency}, "
                  f"TTFT p50 {load.ttft_p50 * 1e3:.0f} ms); CPU cores used: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in used.items()), flush=True)
    best = max(range(len(rates)), key=rates.__getitem__)
    return rates[best], worker_cores[best]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--per-worker-concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("needs at least 2 CPU cores", file=sys.stderr)
        return 1
    model = resolve_model(args.model)
    print(f"model {model.name}; workers pinned to cores {cores[:2]}, one BLAS thread each; "
          f"{args.per_worker_concurrency} streams per worker, {args.max_tokens} tokens each", flush=True)
    one, one_cpu = measure(model, 1, cores, args)
    two, two_cpu = measure(model, 2, cores, args)
    ratio = two / one
    print()
    print(f"1 worker  {one:8.1f} tok/s   workers used {one_cpu:.2f} CPU cores ({one / one_cpu:.0f} tok/s per core)")
    print(f"2 workers {two:8.1f} tok/s   workers used {two_cpu:.2f} CPU cores ({two / two_cpu:.0f} tok/s per core)")
    print(f"ratio {ratio:.2f}x (target >= 1.6x: {'ok' if ratio >= 1.6 else 'MISSED'}); "
          f"per worker CPU second {(two / two_cpu) / (one / one_cpu):.2f}x. Workers short of one full core "
          f"each lost it to other processes on the machine.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
