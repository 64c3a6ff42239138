"""What open consoles cost the router: its CPU with no console open and with N open.

    python load/bench_console.py [--model tiny] [--consoles 10] [--seconds 20] [--request-every 1]

A router and two workers (subprocesses on free ports, the random-weight tiny model unless
--model). Each phase measures the router process's CPU time (Linux's /proc) over
--seconds while a request (8 tokens) goes through the router every --request-every
seconds, so that the state changes and the console has something to push (each request
is a new row in the requests view, and the workers' load moves): first with no console
open, then with --consoles pages' live streams (/console/events) open and read. It prints
the router's CPU % of one core for each, and the difference: what the consoles cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import grpc  # noqa: E402

from cluster.bench.closed_loop import one_request, text_request  # noqa: E402
from cluster.models_cache import resolve_model  # noqa: E402
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def read_events(url: str, counts: list[int], i: int, stop: asyncio.Event) -> None:
    """One open console's live stream, read until `stop`: counts its pushes."""
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=None)) as r:
        while not stop.is_set():
            try:
                line = await asyncio.wait_for(r.content.readline(), 0.5)
            except asyncio.TimeoutError:
                continue
            if line.startswith(b"data: "):
                counts[i] += 1


async def phase(c: LocalCluster, http: str, consoles: int, seconds: float, every: float) -> tuple[float, int]:
    """Router CPU % over `seconds` with `consoles` streams open, and the pushes they read."""
    stop = asyncio.Event()
    counts = [0] * consoles
    readers = [asyncio.create_task(read_events(f"http://{http}/console/events", counts, i, stop))
               for i in range(consoles)]
    await asyncio.sleep(2.0)  # connected, first state read
    pid = c.router.proc.pid
    pushed = sum(counts)
    async with grpc.aio.insecure_channel(c.router_address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t0, cpu0 = time.monotonic(), cpu_seconds(pid)
        n = 0
        while time.monotonic() - t0 < seconds:
            if every:  # else an idle cluster: nothing changes, so nothing is pushed
                await one_request(stub, text_request(f"console bench request {n}", 8))
            n += 1
            await asyncio.sleep(max(0.0, t0 + n * (every or seconds) - time.monotonic()))
        wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    stop.set()
    await asyncio.gather(*readers, return_exceptions=True)
    return 100.0 * cpu / wall, sum(counts) - pushed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="mlx-lm model directory or name (default: tiny, random weights)")
    p.add_argument("--consoles", type=int, default=10)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--request-every", type=float, default=1.0, help="seconds between requests (0: none)")
    args = p.parse_args()
    if not os.path.exists("/proc/self/stat"):
        print("bench_console: needs Linux's /proc to read the router's CPU time", file=sys.stderr)
        return 2

    model = resolve_model(args.model)
    http = f"127.0.0.1:{free_port()}"
    c = LocalCluster(model, workers=2, grpc_address=f"127.0.0.1:{free_port()}", http_address=http,
                     metrics_address=None, worker_port_base=0, worker_metrics_port_base=0,
                     log_dir=tempfile.mkdtemp(prefix="orchard-bench-console-"))
    print(f"model {model}; 2 workers; logs in {c.log_dir}", flush=True)
    with c:
        results = {}
        for consoles in (0, args.consoles):
            cpu, pushes = asyncio.run(phase(c, http, consoles, args.seconds, args.request_every))
            results[consoles] = cpu
            print(f"{consoles:3d} consoles: router CPU {cpu:5.2f}% of a core over {args.seconds:g} s"
                  + (f", {pushes} pushes read ({pushes / max(consoles, 1) / args.seconds:.2f} a second each)"
                     if consoles else ""), flush=True)
        print(f"{args.consoles} open consoles cost the router {results[args.consoles] - results[0]:+.2f}% of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
