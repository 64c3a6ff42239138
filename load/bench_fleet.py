"""Models loaded on demand by the fleet against a static layout, on the same seeded trace.

    python load/bench_fleet.py [--rounds 4] [--concurrency 4] [--max-tokens 16] [--quick]
    python load/bench_fleet.py --hot [--hot-requests 1200] [--hot-concurrency 12] [--quick]

Five models (`cluster/fleet/local.py`'s FIVE_MODELS: two dense of different sizes, a MoE, a
4-bit quantized one, an embedding model; made once under ~/.cache/orchard/models/fleet) and
one seeded trace (`mixed_trace`: --rounds rounds, each naming every model in a seeded order,
one to three requests a turn), served two ways:

- on demand: a router with the five in its catalog and three node agents (`LocalFleet`)
  whose budgets hold one model each at once (--budget: another size), nothing loaded at the
  start: models load when the trace names them and unload when another needs the room;
- static: a router and five `orchard worker serve` workers, one model each (a one-model-
  per-node layout with room for all five), started and warmed before the trace.

The trace goes through each router's HTTP API, --concurrency requests at once in trace
order (completions streamed, greedy, all --max-tokens; embeddings). Printed for each: the
requests served and failed, TTFT p50 / p99 (an embedding's latency counts as its TTFT),
the wall time and the memory set aside for models; on demand also the loads, the unloads by
reason, the time requests waited for loads and the footprint estimate's error for the
models loaded at the end (the router's metrics); then on demand / static ratios. --quick:
one round, two at a time, a smoke run.

--hot instead serves one hot model: --hot-requests completions (--hot-max-tokens each) of "chat",
--hot-concurrency at once, on three nodes with room for one replica each, its workers at
--max-num-seqs HOT_SLOTS (so requests queue), loaded before the trace. Twice, on the same
trace: without replicas (--max-replicas 1) and with them (--max-replicas 3; the router's
--scale-up-wait / --scale-window / --scale-down-idle shortened to fit a bench). Printed for
each: TTFT p50 / p99, the replicas added while the trace ran and how long they took to come
back to one after it; then the TTFT p99 ratio. --hot --quick: a shorter trace and window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import Server, one_request, percentile, start_orchard  # noqa: E402

from cluster.bench.server_metrics import parse, total  # noqa: E402
from cluster.fleet.local import FIVE_MODELS, LocalFleet, TraceRequest, make_model, mixed_trace  # noqa: E402
from cluster.models_cache import cache_dir  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402

MiB = 1 << 20
CONTEXT = 512  # every model's --max-model-len: small KV pools, the weights and the process decide what fits
REQUEST_TIMEOUT = 900.0  # a request held for a load on a busy machine
HOT = FIVE_MODELS[0]  # --hot's model
HOT_SLOTS = 2  # its workers' --max-num-seqs: more requests at once than a replica runs


def footprints(models: dict[str, Path]) -> dict[str, int]:
    """Each model's footprint as the controller estimates it (context CONTEXT, the router's
    default concurrency, this machine's platform)."""
    from cluster import platform
    from cluster.fleet import facts, footprint
    from cluster.fleet.config import DEFAULT_CONCURRENCY

    kind = "metal" if platform.has_metal() else "cpu"
    return {name: footprint.estimate(facts.disk_model(path, kind), CONTEXT, DEFAULT_CONCURRENCY, kind).total
            for name, path in models.items()}


# -- the trace over HTTP ---------------------------------------------------------------------------
async def _one(session: aiohttp.ClientSession, url: str, r: TraceRequest) -> dict:
    """{"ttft": seconds} or {"error": text}."""
    try:
        if r.task == "embed":
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/embeddings", json={"model": r.model, "input": r.prompt}) as resp:
                if resp.status != 200:
                    return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
                await resp.read()
            return {"ttft": time.perf_counter() - t0}
        payload = {"model": r.model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0,
                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        result = await one_request(session, f"{url}/v1/completions", payload)
        if not result.chunk_times:
            return {"error": "no text"}
        return {"ttft": result.chunk_times[0] - result.start}
    except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"error": str(e)[:200]}


async def _run_trace(url: str, trace: list[TraceRequest], concurrency: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency * 2)) as s:
        async def limited(r: TraceRequest) -> dict:
            async with sem:
                return await _one(s, url, r)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(r) for r in trace))
        return results, time.perf_counter() - t0


def summary(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results if "ttft" in r]
    errors = [r["error"] for r in results if "error" in r]
    return {"served": len(ttft), "failed": len(errors), "first_error": errors[0] if errors else "",
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99), "wall_s": wall}


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return parse(r.read().decode())


# -- the two layouts --------------------------------------------------------------------------
def run_on_demand(models: dict[str, Path], trace: list[TraceRequest], budget: int, concurrency: int) -> dict:
    fleet = LocalFleet([budget] * 3, tempfile.mkdtemp(prefix="orchard-bench-fleet-"))
    for name, path in models.items():
        fleet.add_model(name, path)
    with fleet:
        from cluster.cli import main

        for name in models:
            if main(["models", "add", name, "--source", name, "--context", str(CONTEXT),
                     "--router", fleet.router_address]) != 0:
                raise RuntimeError(f"orchard models add {name} failed")
        results, wall = asyncio.run(_run_trace(fleet.http_url, trace, concurrency))
        m = scrape(fleet.metrics_url)
    out = summary(results, wall)
    waits = total(m, "orchard_fleet_load_wait_seconds_count")
    out.update(loads=total(m, "orchard_fleet_loads_total", outcome="loaded"),
               unloads={reason: total(m, "orchard_fleet_unloads_total", reason=reason)
                        for reason in ("evicted", "keep_alive", "operator")},
               waited_s=total(m, "orchard_fleet_load_wait_seconds_sum"), waits=waits,
               memory=3 * budget, logs=str(fleet.log_dir),
               footprint_error={dict(labels)["model"]: v for (n, labels), v in m.items()
                                if n == "orchard_fleet_footprint_error_ratio"})
    return out


def run_static(models: dict[str, Path], trace: list[TraceRequest], concurrency: int, sizes: dict[str, int]) -> dict:
    router = LocalCluster("", workers=0, grpc_address=f"127.0.0.1:{free_port()}",
                          http_address=f"127.0.0.1:{free_port()}", metrics_address=f"127.0.0.1:{free_port()}",
                          log_dir=tempfile.mkdtemp(prefix="orchard-bench-fleet-static-"))
    workers: list[Server] = []
    try:
        router.start_router(0)
        os.environ["ORCHARD_JOIN_TOKEN"] = router.join_token  # what the workers present when they register
        with ThreadPoolExecutor(len(models)) as pool:  # started together, as a fleet's Macs would be
            list(pool.map(lambda item: start_orchard(item[1], [
                "--router", router.router_address, "--served-model-name", item[0], "--worker-id", item[0],
                "--max-model-len", str(CONTEXT)], started=workers), models.items()))
        warm = [TraceRequest(r.name, r.task, "warm up", 2) for r in FIVE_MODELS]
        deadline = time.monotonic() + 120
        while True:  # every model registered and answering through the router
            results, _ = asyncio.run(_run_trace(f"http://{router.http_address}", warm, len(warm)))
            if all("ttft" in r for r in results):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"static workers not serving through the router: {results}")
            time.sleep(1)
        results, wall = asyncio.run(_run_trace(f"http://{router.http_address}", trace, concurrency))
    finally:
        for w in workers:
            w.stop()
        router.stop()
    out = summary(results, wall)
    out.update(loads=0, unloads={}, waited_s=0.0, waits=0, memory=sum(sizes.values()))
    return out


def run_hot(path: Path, trace: list[TraceRequest], budget: int, concurrency: int, max_replicas: int,
            scale: dict[str, float]) -> dict:
    """The hot trace on three nodes, `max_replicas` allowed; then, with replicas, until they
    are back to one (at most a few --scale-down-idle)."""
    router_args = [a for flag, value in scale.items() for a in (f"--{flag.replace('_', '-')}", str(value))]
    fleet = LocalFleet([budget] * 3, tempfile.mkdtemp(prefix="orchard-bench-fleet-hot-"), router_args=router_args)
    fleet.add_model(HOT.name, path)
    with fleet:
        from cluster.cli import main

        common = ["--router", fleet.router_address]
        if main(["models", "add", HOT.name, "--source", HOT.name, "--context", str(CONTEXT), "--keep-alive", "-1",
                 "--max-replicas", str(max_replicas), f"--engine-arg=--max-num-seqs {HOT_SLOTS}", *common]) != 0:
            raise RuntimeError(f"orchard models add {HOT.name} failed")
        if main(["models", "load", HOT.name, *common]) != 0:  # the trace measures serving, not the first load
            raise RuntimeError(f"orchard models load {HOT.name} failed")
        results, wall = asyncio.run(_run_trace(fleet.http_url, trace, concurrency))
        ups = fleet.metric("orchard_fleet_scale_events_total", model=HOT.name, direction="up")
        t0, back = time.monotonic(), None
        deadline = t0 + (scale["scale_down_idle"] + scale["scale_window"]) * (ups + 1) + 60
        while ups and time.monotonic() < deadline:
            if fleet.metric("orchard_fleet_replicas", model=HOT.name) <= 1:
                back = time.monotonic() - t0
                break
            time.sleep(1)
        downs = fleet.metric("orchard_fleet_scale_events_total", model=HOT.name, direction="down")
        ups_in_all = fleet.metric("orchard_fleet_scale_events_total", model=HOT.name, direction="up")
    out = summary(results, wall)
    out.update(ups=ups, ups_in_all=ups_in_all, downs=downs, back_to_one_s=back, logs=str(fleet.log_dir))
    return out


def report_hot(name: str, r: dict) -> str:
    line = (f"{name}: {r['served']} served, {r['failed']} failed; TTFT p50 {r['ttft_p50']:.3f} s, "
            f"p99 {r['ttft_p99']:.3f} s; wall {r['wall_s']:.1f} s; replicas added {r['ups']:.0f} while it ran")
    if r["ups"]:
        line += (f" ({r['ups_in_all']:.0f} in all: one under way at its end counts after), removed {r['downs']:.0f}, "
                 "back to one " + (f"{r['back_to_one_s']:.0f} s after the trace" if r["back_to_one_s"] is not None
                                   else "not yet"))
    if r["failed"]:
        line += f"\n  first failure: {r['first_error']}"
    return line


def main_hot(args) -> int:
    path = make_model(HOT, cache_dir() / "fleet")
    size = footprints({HOT.name: path})[HOT.name]
    budget = args.budget * MiB if args.budget else size + size // 2  # one replica a node
    n, concurrency = (args.hot_requests or (400 if args.quick else 1200)), args.hot_concurrency
    trace = mixed_trace((HOT,), 1, args.seed, args.hot_max_tokens, per_turn=(n, n))
    scale = {"scale_up_wait": 0.25, "scale_window": 3.0 if args.quick else 5.0,
             "scale_down_idle": 6.0 if args.quick else 10.0}
    print(f"hot trace: {len(trace)} requests for {HOT.name}, {concurrency} at once, {args.hot_max_tokens} tokens each; "
          f"3 nodes of {budget / MiB:.0f} MiB (one replica each), --max-num-seqs {HOT_SLOTS}; "
          + ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in scale.items())
          + f"; load average {os.getloadavg()[0]:.1f}", flush=True)
    without = run_hot(path, trace, budget, concurrency, 1, scale)
    print(report_hot("without replicas (--max-replicas 1)", without), flush=True)
    with_replicas = run_hot(path, trace, budget, concurrency, 3, scale)
    print(report_hot("with replicas (--max-replicas 3)", with_replicas), flush=True)
    print(f"with / without replicas: TTFT p99 {with_replicas['ttft_p99'] / without['ttft_p99']:.2f}x, "
          f"p50 {with_replicas['ttft_p50'] / without['ttft_p50']:.2f}x, "
          f"wall {with_replicas['wall_s'] / without['wall_s']:.2f}x; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps({"without_replicas": without, "with_replicas": with_replicas}, indent=2))
    return 0 if without["failed"] == with_replicas["failed"] == 0 else 1


def report(name: str, r: dict) -> str:
    lines = [f"{name}: {r['served']} served, {r['failed']} failed; TTFT p50 {r['ttft_p50']:.3f} s, "
             f"p99 {r['ttft_p99']:.3f} s; wall {r['wall_s']:.1f} s; memory for models {r['memory'] / MiB:.0f} MiB"]
    if r["waits"]:
        lines.append(f"  loads {r['loads']:.0f}, unloads " + ", ".join(f"{k} {v:.0f}" for k, v in r["unloads"].items())
                     + f"; requests held for a load {r['waits']:.0f}, waited {r['waited_s']:.1f} s in all "
                     f"({r['waited_s'] / r['waits']:.2f} s each)")
    if r.get("footprint_error"):
        lines.append("  footprint estimate error (measured / estimate - 1) of the models loaded at the end: "
                     + ", ".join(f"{k} {v:+.1%}" for k, v in sorted(r["footprint_error"].items())))
    if r["failed"]:
        lines.append(f"  first failure: {r['first_error']}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=40)
    p.add_argument("--budget", type=int, default=0, metavar="MiB",
                   help="each node's --memory-budget (default: room for the largest model, not for two)")
    p.add_argument("--quick", action="store_true", help="one round, two at a time")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    p.add_argument("--hot", action="store_true", help="one hot model, with replicas and without (the module's "
                                                      "docstring)")
    p.add_argument("--hot-requests", type=int, default=0, metavar="N",
                   help="--hot's trace (default 1200; 400 quick): long enough for replicas to start and serve")
    p.add_argument("--hot-max-tokens", type=int, default=32, metavar="N", help="--hot's tokens a request")
    p.add_argument("--hot-concurrency", type=int, default=12, metavar="N", help="--hot's requests at once")
    args = p.parse_args()
    if args.hot:
        return main_hot(args)
    if args.quick:
        args.rounds, args.concurrency = 1, 2

    root = cache_dir() / "fleet"
    models = {r.name: make_model(r, root) for r in FIVE_MODELS}
    sizes = footprints(models)
    budget = args.budget * MiB if args.budget else max(sizes.values()) + 8 * MiB
    trace = mixed_trace(FIVE_MODELS, args.rounds, args.seed, args.max_tokens)
    print(f"trace: {len(trace)} requests over {len(models)} models, seed {args.seed}, {args.concurrency} at once; "
          f"footprints " + ", ".join(f"{k} {v / MiB:.0f}" for k, v in sizes.items())
          + f" MiB; on demand: 3 nodes of {budget / MiB:.0f} MiB; load average {os.getloadavg()[0]:.1f}", flush=True)

    static = run_static(models, trace, args.concurrency, sizes)
    print(report("static (5 workers, one model each)", static), flush=True)
    on_demand = run_on_demand(models, trace, budget, args.concurrency)
    print(report("on demand (3 nodes)", on_demand), flush=True)
    print(f"on demand / static: TTFT p50 {on_demand['ttft_p50'] / static['ttft_p50']:.2f}x, "
          f"p99 {on_demand['ttft_p99'] / static['ttft_p99']:.2f}x, wall {on_demand['wall_s'] / static['wall_s']:.2f}x, "
          f"memory {on_demand['memory'] / static['memory']:.2f}x; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps({"static": static, "on_demand": on_demand}, indent=2))
    return 0 if static["failed"] == on_demand["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
