"""`orchard bench` (and `load/bench_serve.py`): a serving benchmark against a router or a
worker, in the spirit of `vllm bench serve`.

    orchard bench --target 127.0.0.1:50051 --dataset random --random-input-len 128 \\
        --random-output-len 64 --num-prompts 200 --request-rate 8 --max-concurrency 32 \\
        --metrics-url 127.0.0.1:9101 --metrics-url 127.0.0.1:9102 \\
        --result-file run.json --plot run.png

Arrivals: `--request-rate` requests/s with gamma-distributed gaps (`--burstiness` 1 is a
Poisson process; below 1 burstier, above 1 more regular; `inf` sends all at once),
capped by `--max-concurrency` requests in flight. `--num-warmups` requests go first and
are not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_PERCENTILES = "90,99"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cluster.security import add_client_flags

    add_client_flags(p.add_argument_group("credentials"))
    t = p.add_argument_group("target")
    t.add_argument("--backend", choices=("grpc", "openai", "openai-chat"), default="grpc",
                   help="grpc: the SDK; openai: /v1/completions; openai-chat: /v1/chat/completions")
    t.add_argument("--target", default=None,
                   help="gRPC HOST:PORT (default 127.0.0.1:50051, the router) or HTTP base URL "
                        "(default http://127.0.0.1:8080)")
    t.add_argument("--model", default="", help="model name to ask for (default: whatever the target serves)")
    t.add_argument("--tokenizer", default=None,
                   help="model or tokenizer directory for building prompts (default: the built-in small model)")
    t.add_argument("--metrics-url", action="append", default=None, metavar="HOST:PORT|URL",
                   help="a /metrics endpoint to scrape before, during and after (repeatable: router and workers)")
    t.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between samples during the run")
    t.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")

    from cluster.bench.datasets import DATASETS

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random")
    d.add_argument("--dataset-path", default=None, help="text file (text-slices) or JSONL (custom)")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--random-input-len", type=int, default=128)
    d.add_argument("--random-output-len", type=int, default=64)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    d.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by every random prompt")
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=64)
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=8)
    d.add_argument("--prefix-repetition-output-len", type=int, default=64)
    d.add_argument("--text-input-len", type=int, default=256)
    d.add_argument("--text-output-len", type=int, default=64)
    d.add_argument("--text-prefix-len", type=int, default=0, help="the file's first N tokens start every prompt")
    d.add_argument("--custom-output-len", type=int, default=64, help="output tokens for lines without output_tokens")
    d.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="auto: token ids over gRPC, text over HTTP")

    a = p.add_argument_group("load")
    a.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    a.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    a.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not measured")
    a.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--top-p", type=float, default=None)
    a.add_argument("--top-k", type=int, default=None)

    r = p.add_argument_group("results")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="which latencies get percentiles")
    r.add_argument("--metric-percentiles", default=DEFAULT_PERCENTILES, help="comma-separated, e.g. 50,90,99")
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    r.add_argument("--result-file", default=None, help="write the results as JSON here")
    r.add_argument("--save-detailed", action="store_true", help="per-request times in the JSON too")
    r.add_argument("--plot", default=None, help="write a PNG here (TTFT distribution, tokens/s over time, KV usage)")
    r.add_argument("--label", default="", help="a name for this run in the JSON and the plot")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


# -- building the requests ---------------------------------------------------------------
def build_requests(args, tokenizer) -> list:
    from cluster.bench import datasets as ds

    n = args.num_prompts + args.num_warmups
    as_text = args.prompt_format == "text" or (args.prompt_format == "auto" and args.backend != "grpc")
    if args.dataset == "random":
        reqs = ds.random_requests(tokenizer, n, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, args.random_prefix_len, as_text, args.seed)
    elif args.dataset == "prefix-repetition":
        reqs = ds.prefix_repetition_requests(tokenizer, n, args.prefix_repetition_prefix_len,
                                             args.prefix_repetition_suffix_len,
                                             args.prefix_repetition_num_prefixes,
                                             args.prefix_repetition_output_len, as_text, args.seed)
    elif args.dataset == "text-slices":
        if not args.dataset_path:
            raise SystemExit("--dataset text-slices needs --dataset-path FILE.txt")
        reqs = ds.text_slice_requests(tokenizer, args.dataset_path, n, args.text_input_len, args.text_output_len,
                                      args.random_range_ratio, args.text_prefix_len, as_text, args.seed)
    else:
        if not args.dataset_path:
            raise SystemExit("--dataset custom needs --dataset-path FILE.jsonl")
        reqs = ds.custom_requests(args.dataset_path, n, args.custom_output_len, tokenizer)
    if args.backend == "openai-chat":
        reqs = ds.as_chat(reqs, tokenizer)
    return reqs


def load_tokenizer(args):
    from cluster.bench.datasets import Tokenizer

    if args.tokenizer:
        return Tokenizer(args.tokenizer)
    if args.dataset == "custom" and args.backend != "openai-chat":
        return None  # prompts are given; lengths come from the server's usage
    from cluster.models_cache import builtin_model

    print("note: prompts are built with the built-in model's tokenizer; for another model pass --tokenizer DIR",
          file=sys.stderr)
    return Tokenizer(builtin_model())


# -- the run -----------------------------------------------------------------------------------
def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate)."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


def _progress(total: int, disable: bool):
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)


async def run_benchmark(args, requests: list) -> dict:
    """Warm-ups, then the measured requests; returns the result dict (also printed/saved)."""
    from cluster.bench.backends import RequestOptions, make_backend
    from cluster.bench.metrics import compute, parse_goodput
    from cluster.bench.server_metrics import ServerMetricsSampler

    from cluster.router.config import RouterConfig

    default_target = RouterConfig.grpc_address if args.backend == "grpc" else f"http://{RouterConfig.http_address}"
    target = args.target or default_target
    slos = parse_goodput(args.goodput)
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    from cluster.security import client_from_args

    backend = make_backend(args.backend, target, client_from_args(args) if hasattr(args, "tls_ca") else None)
    opts = RequestOptions(model=args.model, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          ignore_eos=args.ignore_eos, timeout=args.timeout)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    warmups, measured = requests[: args.num_warmups], requests[args.num_warmups:]
    gaps = arrival_gaps(len(measured), args.request_rate, args.burstiness, args.seed)

    async def one(req, bar=None):
        if limit is None:
            out = await backend.send(req, opts)
        else:
            async with limit:
                out = await backend.send(req, opts)
        if bar is not None:
            bar.update(1)
        return out

    try:
        if warmups:
            print(f"warming up with {len(warmups)} request(s) ...", flush=True)
            failed = [o for o in await asyncio.gather(*(one(r) for r in warmups)) if not o.success]
            if len(failed) == len(warmups):
                raise SystemExit(f"every warm-up request failed, e.g. {failed[0].error}")
        sampler = ServerMetricsSampler(args.metrics_url or [], interval=args.metrics_interval)
        if args.metrics_url:
            await sampler.before()
            sampler.start()
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
        print(f"{args.backend} -> {target}: {len(measured)} requests, rate {rate}, burstiness {args.burstiness:g}, "
              f"max concurrency {args.max_concurrency or 'unlimited'}", flush=True)
        bar = _progress(len(measured), args.disable_tqdm)
        t0 = time.perf_counter()
        tasks = []
        for req, gap in zip(measured, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req, bar)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        server = await sampler.after() if args.metrics_url else None
    finally:
        await backend.close()

    metrics = compute(outputs, duration, percentiles, slos, t0)
    result = _result_dict(args, target, metrics, server, outputs, t0, slos)
    print(format_report(result, args), flush=True)
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(result, indent=2))
        print(f"results: {args.result_file}")
    if args.plot:
        from cluster.bench.plot import plot_run

        if server is not None:  # align the server's clock (it started at before()) with the run's
            shift = t0 - sampler._t0
            server.kv_series = {w: [(t - shift, v) for t, v in pts] for w, pts in server.kv_series.items()}
        title = (f"{args.label or 'orchard bench'}: {args.backend} {target}, {args.dataset}, "
                 f"{len(measured)} requests, rate {rate}")
        try:
            plot_run(args.plot, outputs, t0, metrics, server, title=title)
            print(f"plot: {args.plot}")
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install 'orchard[bench]')", file=sys.stderr)
    return result


def _result_dict(args, target, metrics, server, outputs, t0, slos) -> dict:
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "label": args.label,
        "backend": args.backend,
        "target": target,
        "model": args.model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "num_warmups": args.num_warmups,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "slos_ms": slos,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "duration_s": metrics.duration_s,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "cached_input_tokens": metrics.cached_input_tokens,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "request_goodput": metrics.goodput,
        "errors": sorted({o.error for o in outputs if not o.success})[:10],
    }
    for name, stats in metrics.latency.items():
        result[f"mean_{name}_ms"] = stats.mean_ms
        result[f"median_{name}_ms"] = stats.median_ms
        result[f"std_{name}_ms"] = stats.std_ms
        for p, v in stats.percentiles_ms.items():
            result[f"{p}_{name}_ms"] = v
    if server is not None:
        s = asdict(server)
        s.pop("kv_series")
        result["server"] = s
    if args.save_detailed:
        result["requests"] = [
            {"start_s": o.start - t0, "success": o.success, "error": o.error, "ttft_s": o.ttft, "latency_s": o.latency,
             "itl_s": o.itl, "prompt_tokens": o.prompt_tokens, "output_tokens": o.output_tokens,
             "cached_tokens": o.cached_tokens, "worker_id": o.worker_id}
            for o in outputs
        ]
    return result


def format_report(r: dict, args) -> str:
    from cluster.bench.metrics import LATENCY_NAMES

    width = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="=")]

    def row(name: str, value, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{name:<40}" + (fmt.format(value) if value is not None else "n/a"))

    row("Successful requests:", r["completed"], "{:<10}")
    row("Failed requests:", r["failed"], "{:<10}")
    row("Maximum request concurrency:", args.max_concurrency or "unlimited", "{:<10}")
    row("Benchmark duration (s):", r["duration_s"])
    row("Total input tokens:", r["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", r["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", r["request_throughput"])
    if r["request_goodput"] is not None:
        row("Request goodput (req/s):", r["request_goodput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"])
    row("Peak concurrent requests:", r["max_concurrent_requests"], "{:<10}")
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    chosen = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for m in chosen:
        if f"mean_{m}_ms" not in r:
            continue
        lines.append("{s:{c}^{n}}".format(s=titles[m], n=width, c="-"))
        name = LATENCY_NAMES[m]
        row(f"Mean {name} (ms):", r[f"mean_{m}_ms"])
        row(f"Median {name} (ms):", r[f"median_{m}_ms"])
        for key in sorted((k for k in r if k.startswith("p") and k.endswith(f"_{m}_ms") and k != f"p50_{m}_ms"),
                          key=lambda k: float(k[1:].split("_")[0])):  # p50 is the median, printed above
            row(f"P{key[1:].split('_')[0]} {name} (ms):", r[key])
    if r.get("server") is not None:
        lines.append("{s:{c}^{n}}".format(s="Server side (/metrics)", n=width, c="-"))
        _server_rows(r["server"], row, lines)
    if r["errors"]:
        lines.append("{s:{c}^{n}}".format(s="Errors", n=width, c="-"))
        lines += [f"  {e[:200]}" for e in r["errors"][:5]]
    lines.append("=" * width)
    return "\n".join(lines)


def _server_rows(s: dict, row, lines: list[str]) -> None:
    """The report's server-side section (what /metrics said), by `row`."""
    peak = s["kv_usage_peak"]
    row("Peak KV-cache usage (%):", None if peak is None else 100 * peak)
    for w, v in sorted(s["kv_usage_peak_by_worker"].items()):
        row(f"  {w} (%):", 100 * v)
    row("Peak running requests:", s["running_peak"], "{:<10}")
    row("Peak waiting requests:", s["waiting_peak"], "{:<10}")
    row("Preemptions:", s["preemptions"], "{:<10}")
    rate = s["prefix_cache_hit_rate"]
    row("Prefix-cache hit rate (%):", None if rate is None else 100 * rate)
    row("Prompt tokens (server):", s["prompt_tokens"], "{:<10}")
    row("Generated tokens (server):", s["generation_tokens"], "{:<10}")
    if s.get("spec_draft_tokens"):
        row("Spec-decode acceptance rate (%):", 100 * s["spec_acceptance_rate"])
        row("Spec-decode draft tokens:", s["spec_draft_tokens"], "{:<10}")
        row("Spec-decode accepted tokens:", s["spec_accepted_tokens"], "{:<10}")
        by_pos = ", ".join(f"{100 * v:.0f}" for v in s["spec_acceptance_by_position"])
        lines.append(f"{'Acceptance by draft position (%):':<40}{by_pos}")
    for outcome, n in sorted(s["router_requests_by_outcome"].items()):
        row(f"Router attempts, {outcome}:", n, "{:<10}")
    kinds = {"retry": "Router retries (before 1st token):", "resume": "Router resumes (mid-stream):"}
    for kind, n in sorted(s["router_retries_by_kind"].items()):
        row(kinds.get(kind, f"Router {kind}:"), n, "{:<10}")
    for tier, n in sorted(s.get("kv_hit_tokens_by_tier", {}).items()):
        row(f"Prefix-cache hit tokens, {tier}:", n, "{:<10}")
    if s.get("kv_disk_bytes_written") is not None:
        row("KV disk written (MiB):", s["kv_disk_bytes_written"] / 2**20)
        row("KV disk read (MiB):", s["kv_disk_bytes_read"] / 2**20)
        reads, seconds = s["kv_disk_reads"] or 0, s["kv_disk_read_seconds"] or 0.0
        row("KV disk reads:", reads, "{:<10}")
        row("KV disk mean read (ms):", 1000 * seconds / reads if reads else None)
        usage = s.get("kv_disk_usage_bytes")
        row("KV disk held at the end (MiB):", None if usage is None else usage / 2**20)
    if s.get("kv_events") is not None:
        row("KV events published:", s["kv_events"], "{:<10}")
        row("KV event snapshots sent:", s["kv_event_snapshots"], "{:<10}")
    for reason, n in sorted(s.get("router_kv_resyncs_by_reason", {}).items()):
        row(f"Router KV resyncs, {reason}:", n, "{:<10}")
    for e in s["errors"][:3]:
        lines.append(f"scrape error: {e}")


def main(args) -> int:
    """Entry point of `orchard bench` and `load/bench_serve.py`."""
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be >= 1")
    from cluster.bench.metrics import LATENCY_METRICS, parse_goodput

    unknown = {m.strip() for m in args.percentile_metrics.split(",") if m.strip()} - set(LATENCY_METRICS)
    if unknown:
        raise SystemExit(f"--percentile-metrics: unknown {', '.join(sorted(unknown))} ({', '.join(LATENCY_METRICS)})")
    try:
        arrival_gaps(1, args.request_rate, args.burstiness, 0)

        parse_goodput(args.goodput)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    tokenizer = load_tokenizer(args)
    requests = build_requests(args, tokenizer)
    result = asyncio.run(run_benchmark(args, requests))
    return 0 if result["completed"] > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p
