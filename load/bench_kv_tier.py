"""The disk KV tier and placement by where the cache is, on a multi-turn agent trace.

    python load/bench_kv_tier.py [--model small] [--sessions 24] [--turns 8] [--quick]
                                 [--parts tier restart routing]

The trace (`agent_trace`): --sessions agent sessions of --turns chat turns each. A session
opens with its own system prompt (--system-tokens) and every turn appends a user message
(--turn-tokens) after the previous turn's reply (--reply-tokens, fixed text), so each
turn resends its whole history and contexts grow to about system + turns x (turn + reply)
tokens (6k with the defaults), as coding agents do over the chat and Messages APIs. The
sessions run at once, each sending its next turn when the last one is answered, at most
--concurrency turns in flight. A turn after the first is "revisited": its history was
sent before.

The disk tier (`compare_tier`): the trace straight to one worker whose KV pool holds about
--kv-fraction of the final contexts, the disk tier off and on (a fresh directory): over
revisited turns, the hit rate, TTFT p50 / p99, the prompt tokens prefilled, the cached
tokens by tier and the tier's traffic (from the worker's /metrics). Target: revisited TTFT
p50 at least 3x lower with the tier.

A restart (`compare_restart`): one --restart-tokens prompt (token ids) on a freshly started
worker, --restart-rounds times each: with a disk tier that served it before the worker's
last graceful stop, and with none; the median TTFT of each. Target: at least 5x lower from
disk.

Routing (`compare_routing`): three workers through one router, each worker's KV pool
holding about --kv-fraction (a quarter) of the trace's final contexts, so caches evict
(with --disk, each worker also has a disk tier, so evicted blocks can be read back).
For each policy (`kv_aware`: placement by the workers' KV events; its baseline
`prefix_aware`: the router's approximate map) a fresh router and fresh workers serve the
same trace (kv_aware's router first loads the model's tokenizer); the script prints, over
revisited turns, the hit rate (prompt tokens served from cache / prompt tokens, from each
response's usage), TTFT p50 / p99, the prompt tokens prefilled, the turns placed on another
worker than their session's previous turn (sessions moved), the turns per worker, and
the router's predicted against actual cached tokens and the turns it placed by the
approximate map. Targets: kv_aware's hit rate above prefix_aware's with its TTFT p99 no
worse.

--quick scales the trace for a small machine (12 sessions x 4 turns, ~1.2k-token contexts,
concurrency 3).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_prompts, percentile  # noqa: E402

from cluster.bench.closed_loop import scrape  # noqa: E402
from cluster.bench.server_metrics import parse, total  # noqa: E402
from cluster.models_cache import resolve_model  # noqa: E402
from cluster.proto.orchard.v1 import orchard_pb2 as pb  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402

ROUTING_POLICIES = ("kv_aware", "prefix_aware")
PARTS = ("tier", "restart", "routing")
BLOCK_SIZE = 16  # the workers' default


@dataclass(frozen=True)
class TraceShape:
    sessions: int = 24
    turns: int = 8
    system_tokens: int = 1500
    turn_tokens: int = 500
    reply_tokens: int = 64

    @property
    def final_context(self) -> int:
        """Tokens of a session's last turn (its whole history), roughly."""
        return self.system_tokens + self.turns * self.turn_tokens + (self.turns - 1) * self.reply_tokens


QUICK = TraceShape(sessions=12, turns=4, system_tokens=400, turn_tokens=160, reply_tokens=32)


def agent_trace(model_dir: Path, shape: TraceShape) -> list[list[list[dict]]]:
    """Per session, per turn, the chat messages that turn sends (its whole history)."""
    systems = make_prompts(model_dir, shape.sessions, shape.system_tokens)
    users = make_prompts(model_dir, shape.sessions * shape.turns, shape.turn_tokens)
    replies = make_prompts(model_dir, shape.turns, shape.reply_tokens)
    trace = []
    for s in range(shape.sessions):
        history = [{"role": "system", "content": f"Agent session {s}. " + systems[s]}]
        turns = []
        for t in range(shape.turns):
            if t:
                history.append({"role": "assistant", "content": replies[t - 1]})
            history.append({"role": "user", "content": users[s * shape.turns + t]})
            turns.append(list(history))
        trace.append(turns)
    return trace


@dataclass
class TurnResult:
    session: int
    turn: int
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    worker_id: str


def chat_request(messages: list[dict], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def run_trace_async(target: str, trace: list[list[list[dict]]], concurrency: int,
                          max_tokens: int) -> tuple[list[TurnResult], float]:
    """Every session's turns in order (a turn after the last one's answer), `concurrency`
    turns in flight at most; the results and the wall time."""
    import grpc

    from cluster.bench.closed_loop import one_request
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

    results: list[TurnResult] = []
    slots = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await channel.channel_ready()

        async def session(s: int, turns: list[list[dict]]) -> None:
            for t, messages in enumerate(turns):
                async with slots:
                    r = await one_request(stub, chat_request(messages, max_tokens))
                results.append(TurnResult(s, t, r.ttft, r.prompt_tokens, r.cached_tokens, r.worker_id))

        t0 = time.perf_counter()
        await asyncio.gather(*(session(s, turns) for s, turns in enumerate(trace)))
        return results, time.perf_counter() - t0


def summarize_revisited(results: list[TurnResult]) -> dict:
    """Over the turns after each session's first: hit rate, TTFT p50 / p99, prefilled tokens."""
    revisited = [r for r in results if r.turn > 0]
    prompt = sum(r.prompt_tokens for r in revisited)
    cached = sum(r.cached_tokens for r in revisited)
    ttft = [r.ttft for r in revisited]
    per_worker: dict[str, int] = {}
    for r in results:
        per_worker[r.worker_id] = per_worker.get(r.worker_id, 0) + 1
    where = {(r.session, r.turn): r.worker_id for r in results}
    moved = sum(where[r.session, r.turn - 1] != r.worker_id for r in revisited)
    return dict(turns=len(revisited), hit_rate=cached / prompt if prompt else 0.0,
                ttft_p50=percentile(ttft, 0.5), ttft_p99=percentile(ttft, 0.99),
                ttft_mean=statistics.fmean(ttft) if ttft else math.nan,
                prefilled=sum(r.prompt_tokens - r.cached_tokens for r in results), moved=moved,
                per_worker=dict(sorted(per_worker.items())))


def pool_blocks(shape: TraceShape, fraction: float, concurrency: int) -> int:
    """KV blocks a worker gets to hold about `fraction` of the trace's final contexts, and
    never less than the turns in flight need."""
    held = shape.sessions * shape.final_context * fraction
    floor = concurrency * math.ceil((shape.final_context + 64) / BLOCK_SIZE) + 16
    return max(math.ceil(held / BLOCK_SIZE), floor)


def bench_cluster(model: Path, name: str, worker_args: list[str], kv_disk: tuple[str, int] | None,
                  **options) -> LocalCluster:
    """A router and workers (one by default) on free loopback ports, no HTTP, their logs in a
    fresh directory; `kv_disk`: (DIR, bytes) of each worker's disk tier, or None."""
    options.setdefault("metrics_address", f"127.0.0.1:{free_port()}")
    return LocalCluster(model, grpc_address=f"127.0.0.1:{free_port()}", http_address=None, worker_port_base=0,
                        worker_metrics_port_base=0, log_dir=tempfile.mkdtemp(prefix=f"orchard-bench-kv-{name}-"),
                        worker_args=worker_args, kv_disk=kv_disk, **options)


def pool_args(shape: TraceShape, blocks: int) -> list[str]:
    """A worker's flags for the trace: a KV pool of `blocks`, room for its longest context."""
    return ["--num-kv-blocks", str(blocks), "--max-model-len", str(shape.final_context + 512)]


def fresh_disk(args) -> tuple[str, int]:
    """A disk tier in a new directory, of --disk-bytes."""
    return tempfile.mkdtemp(prefix="orchard-bench-kv-disk-"), args.disk_bytes


def wait_tokenizer(router: str, metrics: str, timeout: float = 180) -> None:
    """Chats through the router until one is placed by its block hashes: the router has
    fetched and loaded the model's tokenizer (the first requests of a model are placed by
    the approximate map until then)."""
    chat = [[[{"role": "user", "content": "warm up the router"}]]]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = total(parse(scrape(metrics)), "orchard_router_tokenize_fallbacks_total")
        asyncio.run(run_trace_async(router, chat, 1, 2))
        if total(parse(scrape(metrics)), "orchard_router_tokenize_fallbacks_total") == before:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the router placed no chat by its block hashes within {timeout:g} s")


def run_routing(policy: str, model: Path, trace, shape: TraceShape, args) -> dict:
    """One policy on three fresh workers behind a fresh router: the trace's summary and the
    router's KV placement metrics."""
    blocks = pool_blocks(shape, args.kv_fraction, args.concurrency)
    metrics = f"127.0.0.1:{free_port()}"
    c = bench_cluster(model, policy, pool_args(shape, blocks), fresh_disk(args) if args.disk else None,
                      workers=args.workers, policy=policy, metrics_address=metrics,
                      router_args=["--router-tokenize-timeout", str(args.tokenize_timeout)])
    with c:
        # one turn each, straight to the workers: compiled and warm, nothing learnt by the router
        warm = [[[{"role": "user", "content": "warm up"}]]]
        for w in c.worker_addresses:
            asyncio.run(run_trace_async(w, warm, 1, 2))
        if policy == "kv_aware":
            wait_tokenizer(c.router_address, metrics)
        before = parse(scrape(metrics))
        results, wall = asyncio.run(run_trace_async(c.router_address, trace, args.concurrency, args.max_tokens))
        router = {k: v - before.get(k, 0.0) for k, v in parse(scrape(metrics)).items()}
    out = summarize_revisited(results)
    out.update(wall=wall, blocks=blocks,
               predicted_memory=total(router, "orchard_router_predicted_cached_tokens_total", tier="memory"),
               predicted_disk=total(router, "orchard_router_predicted_cached_tokens_total", tier="disk"),
               actual=total(router, "orchard_router_actual_cached_tokens_total"),
               fallbacks={reason: int(n) for (name, labels), n in router.items()
                          if name == "orchard_router_tokenize_fallbacks_total" and n
                          for reason in [dict(labels)["reason"]]})
    return out


def compare_routing(model: Path, shape: TraceShape, args) -> dict[str, dict]:
    """kv_aware against prefix_aware on the same trace; prints a line per policy and the targets."""
    trace = agent_trace(model, shape)
    blocks = pool_blocks(shape, args.kv_fraction, args.concurrency)
    print(f"routing: {args.workers} workers, {shape.sessions} sessions x {shape.turns} turns, contexts to "
          f"~{shape.final_context} tokens, KV pool {blocks} blocks a worker (~{args.kv_fraction:g} of the final "
          f"contexts each), concurrency {args.concurrency}",
          flush=True)
    results = {}
    for policy in args.policies:
        results[policy] = r = run_routing(policy, model, trace, shape, args)
        print(f"{policy:13s} revisited turns: hit rate {r['hit_rate'] * 100:5.1f}%  "
              f"TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms  p99 {r['ttft_p99'] * 1e3:7.1f} ms   "
              f"prompt tokens prefilled {r['prefilled']}   sessions moved {r['moved']}   turns per worker "
              f"{r['per_worker']}   router: predicted cached {r['predicted_memory']:.0f} memory + "
              f"{r['predicted_disk']:.0f} disk, actual {r['actual']:.0f}, placed by the approximate map "
              f"{r['fallbacks'] or 0}   {r['wall']:.1f} s", flush=True)
    if set(ROUTING_POLICIES) <= results.keys():
        kv, approx = results["kv_aware"], results["prefix_aware"]
        hits = kv["hit_rate"] > approx["hit_rate"]
        p99 = kv["ttft_p99"] <= approx["ttft_p99"]
        print(f"target kv_aware hit rate above prefix_aware's: {'ok' if hits else 'MISSED'} "
              f"({kv['hit_rate'] * 100:.1f}% vs {approx['hit_rate'] * 100:.1f}%); TTFT p99 no worse: "
              f"{'ok' if p99 else 'MISSED'} ({kv['ttft_p99'] * 1e3:.0f} ms vs {approx['ttft_p99'] * 1e3:.0f} ms)")
    return results


# -- one worker: the disk tier on against off ---------------------------------------------------
TIER_METRICS = ("orchard_kv_disk_bytes_written_total", "orchard_kv_disk_bytes_read_total",
                "orchard_kv_disk_blocks_written_total", "orchard_kv_disk_blocks_dropped_total",
                "orchard_kv_disk_errors_total")


def run_one_worker(model: Path, trace, shape: TraceShape, args, disk: bool) -> dict:
    """The trace straight to one fresh worker whose KV pool holds about --kv-fraction of the
    final contexts, with a fresh disk tier or none: the revisited turns' summary and the
    worker's KV metrics over the trace."""
    blocks = pool_blocks(shape, args.kv_fraction, args.concurrency)
    c = bench_cluster(model, "tier", pool_args(shape, blocks), fresh_disk(args) if disk else None)
    with c:
        worker, metrics = c.worker_addresses[0], c.worker_metrics[0]
        asyncio.run(run_trace_async(worker, [[[{"role": "user", "content": "warm up"}]]], 1, 2))
        if disk:
            wait_disk_tier(worker)
        before = parse(scrape(metrics))
        results, wall = asyncio.run(run_trace_async(worker, trace, args.concurrency, args.max_tokens))
        after = parse(scrape(metrics))
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out = summarize_revisited(results)
    out.update(wall=wall, blocks=blocks,
               hit_memory=total(delta, "orchard_kv_cache_hit_tokens_total", tier="memory"),
               hit_disk=total(delta, "orchard_kv_cache_hit_tokens_total", tier="disk"),
               disk_used=total(after, "orchard_kv_disk_usage_bytes"),
               read_seconds=total(delta, "orchard_kv_disk_read_seconds_sum"),
               **{name.removeprefix("orchard_kv_disk_").removesuffix("_total"): total(delta, name)
                  for name in TIER_METRICS})
    return out


def wait_disk_tier(address: str, timeout: float = 300) -> None:
    """Until the worker reports its disk tier serving (it hashes its weights first)."""
    from cluster.sdk import Client

    deadline = time.monotonic() + timeout
    with Client(address, timeout=30) as client:
        while not client.get_load().kv_disk.enabled:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address}: the disk tier did not start within {timeout:g} s")
            time.sleep(0.2)


def compare_tier(model: Path, shape: TraceShape, args) -> dict[str, dict]:
    """The trace on one worker, the disk tier off and on; prints a line each and the target."""
    trace = agent_trace(model, shape)
    blocks = pool_blocks(shape, args.kv_fraction, args.concurrency)
    print(f"disk tier: 1 worker, {shape.sessions} sessions x {shape.turns} turns, contexts to "
          f"~{shape.final_context} tokens, KV pool {blocks} blocks (~{args.kv_fraction:g} of the final contexts), "
          f"concurrency {args.concurrency}", flush=True)
    results = {}
    for name, disk in (("tier off", False), ("tier on", True)):
        results[name] = r = run_one_worker(model, trace, shape, args, disk)
        print(f"{name:9s} revisited turns: hit rate {r['hit_rate'] * 100:5.1f}%  TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms"
              f"  p99 {r['ttft_p99'] * 1e3:7.1f} ms   prompt tokens prefilled {r['prefilled']}   cached tokens "
              f"{r['hit_memory']:.0f} memory + {r['hit_disk']:.0f} disk   disk: {r['bytes_written'] / 2**20:.0f} MiB "
              f"written in {r['blocks_written']:.0f} blocks ({r['blocks_dropped']:.0f} dropped), "
              f"{r['bytes_read'] / 2**20:.0f} MiB read in {r['read_seconds']:.2f} s, {r['disk_used'] / 2**20:.0f} MiB "
              f"held, {r['errors']:.0f} errors   {r['wall']:.1f} s", flush=True)
    off, on = results["tier off"], results["tier on"]
    ratio = off["ttft_p50"] / on["ttft_p50"] if on["ttft_p50"] else math.inf
    print(f"target revisited TTFT p50 at least 3x lower with the disk tier: {'ok' if ratio >= 3 else 'MISSED'} "
          f"({ratio:.2f}x: {on['ttft_p50'] * 1e3:.0f} ms vs {off['ttft_p50'] * 1e3:.0f} ms); prompt tokens "
          f"prefilled {on['prefilled']} vs {off['prefilled']}")
    return results


# -- a long prompt across a restart --------------------------------------------------------------
def restart_ttft(model: Path, tokens: int, rounds: int, disk_bytes: int) -> dict[str, list[float]]:
    """TTFT of one `tokens`-token prompt on a freshly started worker, `rounds` times each: with a
    disk tier that served the prompt before the worker's last (graceful) stop, and with none
    (computed). Each start is warmed up by a short prompt first, so both time the prompt alone."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompt = [100 + (i * 7919) % (vocab - 100) for i in range(tokens)]
    disk_dir = tempfile.mkdtemp(prefix="orchard-bench-kv-restart-")
    out: dict[str, list[float]] = {"computed": [], "from disk": []}

    def one(kv_disk, key: str | None) -> None:
        c = bench_cluster(model, "restart", ["--max-model-len", str(tokens + 512)], kv_disk)
        with c:
            worker = c.worker_addresses[0]
            if kv_disk:
                wait_disk_tier(worker)
            asyncio.run(run_ids(worker, [1, 2, 3, 4], 2))
            ttft, cached = asyncio.run(run_ids(worker, prompt, 4))
        if key is not None:
            out[key].append(ttft)
            print(f"  {key}: TTFT {ttft:.3f} s, cached tokens {cached}", flush=True)

    one((disk_dir, disk_bytes), None)  # computed once, written to disk, flushed at the stop
    for _ in range(rounds):
        one((disk_dir, disk_bytes), "from disk")
        one(None, "computed")
    return out


async def run_ids(target: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT, cached tokens) of one greedy request of prompt token ids."""
    import grpc

    from cluster.bench.closed_loop import one_request
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
    async with grpc.aio.insecure_channel(target) as channel:
        await channel.channel_ready()
        r = await one_request(pb_grpc.GenerationStub(channel), request)
    return r.ttft, r.cached_tokens


def compare_restart(model: Path, args) -> dict[str, list[float]]:
    print(f"restart: a {args.restart_tokens}-token prompt on a freshly started worker, {args.restart_rounds} rounds",
          flush=True)
    times = restart_ttft(model, args.restart_tokens, args.restart_rounds, args.disk_bytes)
    computed, from_disk = statistics.median(times["computed"]), statistics.median(times["from disk"])
    ratio = computed / from_disk if from_disk else math.inf
    print(f"restart TTFT median: computed {computed:.3f} s, from disk {from_disk:.3f} s: {ratio:.1f}x lower "
          f"({'ok' if ratio >= 5 else 'MISSED'} against the 5x target)")
    return times



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="mlx-lm model directory or name (default: small, random weights)")
    p.add_argument("--quick", action="store_true", help="a small trace for a small machine")
    p.add_argument("--sessions", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--system-tokens", type=int)
    p.add_argument("--turn-tokens", type=int)
    p.add_argument("--reply-tokens", type=int)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated a turn")
    p.add_argument("--concurrency", type=int, help="turns in flight at most (default 4; --quick: 3)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--kv-fraction", type=float, default=0.25, help="of the final contexts the KV pools hold")
    p.add_argument("--tokenize-timeout", type=float, default=0.05, help="the router's --router-tokenize-timeout")
    p.add_argument("--policies", nargs="+", default=list(ROUTING_POLICIES), choices=ROUTING_POLICIES)
    p.add_argument("--disk", action="store_true", help="routing: each worker with a disk KV tier (a fresh directory)")
    p.add_argument("--disk-bytes", type=int, default=4 << 30, help="each worker's disk tier at most")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                   help="tier: one worker, disk tier off vs on; restart: a long prompt across a restart; "
                        "routing: three workers, kv_aware vs prefix_aware")
    p.add_argument("--restart-tokens", type=int, default=4000, help="restart: the prompt's tokens")
    p.add_argument("--restart-rounds", type=int, default=3, help="restart: starts of each kind (the median is printed)")
    args = p.parse_args()
    base = QUICK if args.quick else TraceShape()
    if args.concurrency is None:
        args.concurrency = 3 if args.quick else 4
    shape = TraceShape(*(getattr(args, f) if getattr(args, f) is not None else getattr(base, f)
                         for f in ("sessions", "turns", "system_tokens", "turn_tokens", "reply_tokens")))
    model = resolve_model(args.model)
    if "tier" in args.parts:
        compare_tier(model, shape, args)
    if "restart" in args.parts:
        compare_restart(model, args)
    if "routing" in args.parts:
        compare_routing(model, shape, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
