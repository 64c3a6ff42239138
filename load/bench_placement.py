"""Placement policies on a shared-prefix workload: mean TTFT and prefix-cache hit rate.

    python load/bench_placement.py [--model DIR] [--groups 8] [--per-group 16] [--prefix-words 200]

--groups groups of --per-group requests; the requests of a group share a long prefix
(about 2.5 tokens a word) and differ in a short question. They arrive in one shuffled
order (the same for every policy), --concurrency at a time, through a router over 2
workers. Each worker's KV cache holds about --kv-prefixes prefixes: more than half of the
groups' prefixes, fewer than all of them, as on a busy real fleet. For each policy
(prefix_aware, least_loaded, round_robin) a fresh router and fresh workers serve the same
workload; the script prints mean and p50 TTFT, the prefix-cache hit rate (prompt tokens
served from the workers' caches, from their /metrics) and TTFT ratios to round_robin.
Target: prefix_aware's mean TTFT at most 0.67x round_robin's.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.models_cache import resolve_model  # noqa: E402
from cluster.bench.closed_loop import metric_sum, run_load, scrape, text_request  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402

WORDS = ("apple pear plum cherry quince orchard branch root leaf blossom harvest basket ladder "
         "soil rain sun frost graft prune bee hive cider press barn fence gate path").split()
POLICIES = ("prefix_aware", "least_loaded", "round_robin")


def workload(groups: int, per_group: int, prefix_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prefixes = [f"Group {g}. " + " ".join(rng.choice(WORDS) for _ in range(prefix_words)) for g in range(groups)]
    texts = [f"{prefixes[g]}\nQuestion {i}: " + " ".join(rng.choice(WORDS) for _ in range(8)) + "?"
             for g in range(groups) for i in range(per_group)]
    rng.shuffle(texts)
    return texts


def count_tokens(model: Path, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(model)).encode(text))


def run_policy(policy: str, model: Path, texts: list[str], args, kv_blocks: int) -> dict:
    c = LocalCluster(model, workers=2, policy=policy, grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
                     metrics_address=f"127.0.0.1:{free_port()}", worker_port_base=0, worker_metrics_port_base=0,
                     log_dir=tempfile.mkdtemp(prefix=f"orchard-bench-placement-{policy}-"),
                     worker_args=["--num-kv-blocks", str(kv_blocks)])
    with c:
        for w in c.worker_addresses:  # warm up each worker directly: the router learns nothing
            run_load(w, [text_request("warm up " * 40, 4)] * 2, 1)
        before = [scrape(m) for m in c.worker_metrics]
        load = run_load(c.router_address, [text_request(t, args.max_tokens) for t in texts], args.concurrency)
        after = [scrape(m) for m in c.worker_metrics]
    hits = sum(metric_sum(a, "orchard_prefix_cache_hits_total") - metric_sum(b, "orchard_prefix_cache_hits_total")
               for a, b in zip(after, before))
    queries = sum(metric_sum(a, "orchard_prefix_cache_queries_total")
                  - metric_sum(b, "orchard_prefix_cache_queries_total") for a, b in zip(after, before))
    per_worker = {}
    for r in load.results:
        per_worker[r.worker_id] = per_worker.get(r.worker_id, 0) + 1
    return dict(mean=load.ttft_mean, p50=load.ttft_p50, p90=load.ttft_percentile(0.9),
                hit_rate=hits / queries if queries else 0.0,
                cached=sum(r.cached_tokens for r in load.results) / max(1, sum(r.prompt_tokens for r in load.results)),
                per_worker=dict(sorted(per_worker.items())), duration=load.duration)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="mlx-lm model directory or name (default: small, random weights)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix-words", type=int, default=200)
    p.add_argument("--kv-prefixes", type=float, default=5.0, help="KV cache per worker, in prefixes")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = p.parse_args()

    model = resolve_model(args.model)
    texts = workload(args.groups, args.per_group, args.prefix_words)
    prefix_tokens = count_tokens(model, texts[0].split("\nQuestion")[0])
    prefix_blocks = math.ceil(prefix_tokens / 16)
    kv_blocks = int(args.kv_prefixes * prefix_blocks) + 4 * args.concurrency
    print(f"model {model.name}: {args.groups} groups x {args.per_group} requests, prefixes of ~{prefix_tokens} tokens "
          f"({prefix_blocks} blocks), {args.max_tokens} output tokens, concurrency {args.concurrency}; "
          f"2 workers of {kv_blocks} KV blocks (~{args.kv_prefixes:g} prefixes each)", flush=True)
    results = {}
    for policy in args.policies:
        results[policy] = r = run_policy(policy, model, texts, args, kv_blocks)
        print(f"{policy:13s} TTFT mean {r['mean'] * 1e3:7.1f} ms  p50 {r['p50'] * 1e3:7.1f} ms  "
              f"p90 {r['p90'] * 1e3:7.1f} ms   prefix-cache hit rate {r['hit_rate'] * 100:5.1f}% "
              f"(cached prompt tokens {r['cached'] * 100:5.1f}%)   requests per worker {r['per_worker']}   "
              f"{r['duration']:.1f} s", flush=True)
    if "round_robin" in results:
        base = results["round_robin"]["mean"]
        print()
        for policy, r in results.items():
            print(f"{policy:13s} mean TTFT / round_robin's = {r['mean'] / base:.2f}")
        if "prefix_aware" in results:
            ratio = results["prefix_aware"]["mean"] / base
            print(f"target prefix_aware <= 0.67x round_robin: {'ok' if ratio <= 0.67 else 'MISSED'} ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
