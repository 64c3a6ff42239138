"""What the router costs: the same load straight to a worker and through the router.

    python load/bench_router_overhead.py [--model DIR] [--rounds 8] [--concurrency 16]

One worker and one router (subprocesses on free ports, the built-in small model unless
--model), prefix caching off (both sides send the same prompts). Two loads, each run direct
and through the router, alternating over --rounds so that drift hits both sides alike:
  latency   : one request at a time (short prompt, 8 tokens), direct and routed requests
              interleaved one by one: TTFT p50 of each and the median of the paired
              differences, the router's added time to first token (target: at most 2 ms)
  throughput: --concurrency streams, --requests requests of --max-tokens tokens:
              generated tokens/s (target: at most 5% lost through the router)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.models_cache import resolve_model  # noqa: E402
import grpc  # noqa: E402

from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc  # noqa: E402
from cluster.bench.closed_loop import one_request, run_load, text_request  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402

WORDS = "apple pear plum cherry quince orchard branch root leaf blossom harvest basket ladder".split()


def prompts(n: int, seed: int, words: int = 24) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def paired_ttft(worker: str, router: str, texts: list[str]) -> tuple[list[float], list[float]]:
    """TTFT of each text direct and through the router, one request at a time, interleaved."""
    direct, routed = [], []
    async with grpc.aio.insecure_channel(worker) as wch, grpc.aio.insecure_channel(router) as rch:
        stubs = {"direct": pb_grpc.GenerationStub(wch), "router": pb_grpc.GenerationStub(rch)}
        for i, text in enumerate(texts):
            for name in (("direct", "router") if i % 2 == 0 else ("router", "direct")):
                r = await one_request(stubs[name], text_request(text, 8))
                (direct if name == "direct" else routed).append(r.ttft)
    return direct, routed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="mlx-lm model directory or name (default: small, random weights)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--latency-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()

    model = resolve_model(args.model)
    c = LocalCluster(model, workers=1, grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
                     metrics_address=None, worker_port_base=0, worker_metrics_port_base=0,
                     log_dir=tempfile.mkdtemp(prefix="orchard-bench-overhead-"),
                     worker_args=["--no-prefix-caching"])  # both sides send the same prompts
    print(f"model {model}; 1 worker; logs in {c.log_dir}", flush=True)
    with c:
        worker, router = c.worker_addresses[0], c.router_address
        # Warm up both paths (compilation, connections, allocator).
        for target in (worker, router):
            run_load(target, [text_request(t, 8) for t in prompts(8, 99)], 4)
        direct_ttft, router_ttft = [], []
        tokens = {"direct": 0, "router": 0}
        seconds = {"direct": 0.0, "router": 0.0}
        for r in range(args.rounds):
            d, rt = asyncio.run(paired_ttft(worker, router, prompts(args.latency_requests, r)))
            direct_ttft += d
            router_ttft += rt
            diffs = [b - a for a, b in zip(d, rt)]
            print(f"round {r} latency: TTFT p50 direct {statistics.median(d) * 1e3:.2f} ms, router "
                  f"{statistics.median(rt) * 1e3:.2f} ms, paired difference p50 "
                  f"{statistics.median(diffs) * 1e3:+.2f} ms", flush=True)
            for name in (("direct", "router") if r % 2 == 0 else ("router", "direct")):
                target = worker if name == "direct" else router
                load = run_load(target, [text_request(t, args.max_tokens) for t in prompts(args.requests, 100 + r)],
                                args.concurrency)
                tokens[name] += load.tokens
                seconds[name] += load.duration
                print(f"round {r} {name:6s}: {load.throughput:8.1f} tok/s at concurrency {args.concurrency} "
                      f"(TTFT p50 {load.ttft_p50 * 1e3:.1f} ms)", flush=True)
    d_ttft, r_ttft = statistics.median(direct_ttft), statistics.median(router_ttft)
    added = statistics.median(b - a for a, b in zip(direct_ttft, router_ttft)) * 1e3
    d_tput, r_tput = tokens["direct"] / seconds["direct"], tokens["router"] / seconds["router"]
    loss = 1 - r_tput / d_tput
    print()
    print(f"TTFT p50      direct {d_ttft * 1e3:.2f} ms   router {r_ttft * 1e3:.2f} ms   "
          f"added (paired p50) {added:+.2f} ms (target <= 2 ms: {'ok' if added <= 2 else 'MISSED'})")
    print(f"throughput    direct {d_tput:.1f} tok/s   router {r_tput:.1f} tok/s   ratio {r_tput / d_tput:.3f}  "
          f"loss {loss * 100:.1f}% (target <= 5%: {'ok' if loss <= 0.05 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
