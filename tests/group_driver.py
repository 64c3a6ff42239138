"""A worker group's rank 0 outside a server, for tests: `python tests/group_driver.py ARGS`
loads the group engine (the members are other processes), runs `run_workload` on it and
prints the results as one JSON line. The tests run the same workload on a single-process
engine and compare.

The workload (staggered arrivals) has long prompts under a small step budget (chunked
prefill, two partial prefills at once), a pool small enough to preempt, a prompt that
reuses a finished one's prefix (a prefix-cache hit), a request aborted mid-output, n = 3
seeded samples, and a structured (regex) output; every request asks for logprobs.

`--poison` runs `run_beside_poison` instead: a few greedy streams on the engine thread
(`EngineLoop`, as a worker serves them) and, once they are under way, a request whose
prompt holds POISON_RUN, which a member's fault file makes fail (cluster/worker/faults.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

from cluster import platform

platform.preload_blas()  # this script is a process of its own: before MLX
from cluster.worker.config import EngineConfig  # noqa: E402
from cluster.worker.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

CONFIG = dict(num_kv_blocks=24, max_num_batched_tokens=64, max_num_seqs=8, max_num_partial_prefills=2)
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def config(speculative: bool = False) -> dict:
    return dict(CONFIG, speculative_config=SPECULATIVE) if speculative else dict(CONFIG)


def draft_config(path: str) -> str:
    return json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": 3})


def every_draft() -> None:
    """Speculate at every step it can: the policy weighs drafts against this machine's
    measured step times, so the rows of a step (and the last bits of a logprob) would vary
    between two runs; bit-for-bit needs the same steps on both sides."""
    from cluster.worker.spec_decode.policy import SpecPolicy

    SpecPolicy.limits = lambda self, decodes, proposed, rows, decode_rows=None: list(proposed)


def requests(seed: int, vocab: int = 500):
    """(request id, prompt, params, arrival (a step, or the id of a request whose first
    token it follows), abort step or None)."""
    rng = random.Random(seed)
    lengths = (1, 3, 16, 17, 40, 64, 100, 150, 200, 33)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    out = []
    for i, p in enumerate(prompts):
        out.append((f"r{i}", p, SamplingParams(max_tokens=24 if i == 6 else 4 + (i * 7) % 13, temperature=0,
                                               ignore_eos=True, logprobs=2), i // 2, None))
    # a prefix hit: the 100-token prompt's first 64 tokens again, once its prefill is done
    out.append(("prefix", prompts[6][:64] + [7, 8, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                                       logprobs=0), "r6", None))
    # aborted mid-output
    out.append(("aborted", [rng.randrange(3, vocab) for _ in range(20)],
                SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0), 1, 12))
    # n = 3 seeded samples
    out.append(("n3", [rng.randrange(3, vocab) for _ in range(30)],
                SamplingParams(max_tokens=8, temperature=1.0, seed=1234, n=3, ignore_eos=True, logprobs=1), 3, None))
    # a structured output, sampled
    out.append(("regex", [rng.randrange(3, vocab) for _ in range(12)],
                SamplingParams(max_tokens=16, temperature=0.9, seed=7, logprobs=0,
                               structured=StructuredOutput("regex", "[a-z]{2,6}( [a-z]{2,6}){1,3}")), 5, None))
    return out


def run_workload(engine, seed: int = 0, steps_limit: int = 5000) -> dict:
    """Every request's (and sample's) tokens, logprobs and finish reason; the engine's
    preemption and prefix-hit counts."""
    pending = list(requests(seed, min(500, engine.vocab_size)))
    results: dict[str, dict] = {}
    aborts = {}
    step = 0
    while pending or engine.has_unfinished():
        for r in list(pending):
            rid, prompt, params, arrival, abort_at = r
            due = arrival <= step if isinstance(arrival, int) else (
                bool(results.get(f"{arrival}/0", {}).get("tokens")))
            if due:
                pending.remove(r)
                engine.add_request(rid, prompt, params)
                if abort_at is not None:
                    aborts[rid] = abort_at
        for rid, at in list(aborts.items()):
            if step >= at:
                if engine.abort(rid):
                    results.setdefault(f"{rid}/0", {"tokens": [], "logprobs": [], "top": [], "finish": None})[
                        "finish"] = "abort"
                del aborts[rid]
        for out in engine.step():
            r = results.setdefault(f"{out.request_id}/{out.index}", {"tokens": [], "logprobs": [], "top": [],
                                                                      "finish": None})
            r["tokens"] += out.new_token_ids
            r["logprobs"] += out.logprobs or []
            r["top"] += [[list(t) for t in tl] for tl in (out.top_logprobs or [])]
            if out.finished:
                r["finish"] = out.finish_reason
        engine.check_integrity()
        step += 1
        if step > steps_limit:
            raise RuntimeError("the workload did not finish")
    s = engine.stats
    return {"results": results, "preemptions": s.num_preemptions, "prefix_hits": s.prefix_hits, "steps": step}


KV_CONFIG = dict(num_kv_blocks=64)
KV_PARAMS = dict(max_tokens=12, ignore_eos=True, logprobs=5)


def kv_prompts(seed: int = 11) -> dict[str, list[int]]:
    """A prompt (`first`) and one sharing its 80-token prefix (`second`); `short` shares
    only its first 64 tokens (the reference for a prefix 4 blocks long)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(80)]
    tail = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    return {"first": prefix + tail(21), "second": prefix + tail(21), "short": prefix[:64] + tail(21)}


def kv_request(engine, rid: str, prompt: list[int], params: SamplingParams) -> dict:
    """One request to its end, the engine stepped as a worker's loop steps it (waiting for
    the disk tier's reads when nothing else runs): tokens, logprobs, top, cached tokens."""
    engine.add_request(rid, prompt, params)
    out = {"tokens": [], "logprobs": [], "top": [], "cached": 0, "disk": 0}
    deadline = time.monotonic() + 300
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the request did not finish"
        if not engine.has_runnable():
            engine.kv_tier.wait(0.1)
        for o in engine.step():
            if o.request_id != rid:
                continue
            out["tokens"] += o.new_token_ids
            out["logprobs"] += o.logprobs or []
            out["top"] += [[list(t) for t in tl] for tl in (o.top_logprobs or [])]
            out["cached"], out["disk"] = o.num_cached_tokens, o.num_cached_tokens_disk
        engine.check_integrity()
    return out


def run_kv(engine, phase: str, virtual: int = 1) -> dict:
    """The disk tier's workload: "warm" serves `first` (its blocks written through to disk,
    flushed); "again" (after a restart) serves `second` greedy and seeded, its prefix from
    disk ("memory": after `first`, from memory; "evict": after `first`, evicted from memory
    by longer prompts, from disk); "short" serves `short` then `second` (a
    64-token prefix from memory). With virtual engines, a short request goes first, so the
    prompts land in the second engine (its blocks offset into the pool)."""
    tier = engine.kv_tier
    if tier is not None:
        assert tier.wait_ready(120), "the disk tier did not open"
    p = kv_prompts()
    if virtual > 1:
        engine.add_request("filler", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    greedy = SamplingParams(temperature=0, **KV_PARAMS)
    seeded = SamplingParams(temperature=0.8, seed=1234, **KV_PARAMS)
    out = {}
    if phase == "warm":
        out["first"] = kv_request(engine, "first", p["first"], greedy)
    elif phase in ("again", "memory", "evict"):
        if phase != "again":  # memory: `first` then `second`, its prefix from memory; evict: from disk
            kv_request(engine, "first", p["first"], greedy)
        if phase == "evict":  # written through, then pushed out of memory by longer prompts
            assert tier.flush(60), "the disk writes did not finish"
            for i in range(4):
                kv_request(engine, f"long{i}", [3 + (i * 37 + j) % 400 for j in range(400)],
                           SamplingParams(max_tokens=1))
        out["second"] = kv_request(engine, "second", p["second"], greedy)
        out["seeded"] = kv_request(engine, "seeded", p["second"], seeded)
    else:
        kv_request(engine, "short", p[phase], greedy)
        out["second"] = kv_request(engine, "second", p["second"], greedy)
    while engine.has_unfinished():  # (the filler)
        engine.step()
    if tier is not None:
        assert tier.flush(60), "the disk writes did not finish"
        out["hit_tokens"] = tier.stats.hit_tokens
    return out


POISON_RUN = [497, 498, 499]  # token ids: a step that holds them raises on the rank whose fault file names them


def run_beside_poison(engine_factory, seed: int = 0, poison: bool = True, timeout: float = 300) -> dict:
    """Greedy streams on an engine thread (`engine_factory` runs there) and, once each has
    tokens, a request whose prompt holds POISON_RUN (`poison`). Each stream's tokens, the
    failures' messages, and the engine."""
    from cluster.worker.engine import RequestOutput
    from cluster.worker.engine_loop import AddRequest, EngineLoop, Failed

    rng = random.Random(seed)
    streams = {f"r{i}": [rng.randrange(3, 490) for _ in range(n)] for i, n in enumerate((20, 45, 9, 30))}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {rid: [] for rid in streams}
    failed: dict[str, str] = {}
    finished: set[str] = set()
    under_way, done = threading.Event(), threading.Event()

    def sink(now, events) -> None:
        for ev in events:
            if isinstance(ev, Failed):
                failed[ev.request_id] = ev.message
            elif isinstance(ev, RequestOutput):
                tokens.setdefault(ev.request_id, []).extend(ev.new_token_ids)
                if ev.finished:
                    finished.add(ev.request_id)
        if all(len(tokens[rid]) >= 2 for rid in streams):
            under_way.set()
        if finished | failed.keys() >= streams.keys() | ({"poison"} if poison else set()):
            done.set()

    loop = EngineLoop(engine_factory, sink)
    loop.start(timeout=timeout)
    try:
        for rid, prompt in streams.items():
            loop.submit(AddRequest(rid, prompt, params, time.monotonic()))
        if poison:
            assert under_way.wait(timeout), "the streams did not start"
            loop.submit(AddRequest("poison", [rng.randrange(3, 490) for _ in range(10)] + POISON_RUN,
                                   SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), time.monotonic()))
        assert done.wait(timeout), f"the streams did not finish: {tokens}, failed: {failed}"
    finally:
        loop.stop(60)
    return {"results": {rid: tokens[rid] for rid in sorted(tokens)}, "failed": failed, "engine": loop.engine}


def main() -> int:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s rank0 %(name)s: %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--hosts", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--parallel", default="pipeline")
    ap.add_argument("--shares", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="check every step (default: --group-check's sampling)")
    ap.add_argument("--random-steps", type=int, default=0, help="run the randomized mirrored-state load instead")
    ap.add_argument("--speculative", action="store_true", help="n-gram speculative decoding on")
    ap.add_argument("--draft", default=None, help="speculative decoding with this draft model")
    ap.add_argument("--inflight", type=int, default=1, help="batches in flight (1: the single process's batches)")
    ap.add_argument("--poison", action="store_true", help="run_beside_poison instead of the workload")
    ap.add_argument("--kv-disk-dir", default=None, help="the disk KV tier here: run_kv instead of the workload")
    ap.add_argument("--kv-phase", default="warm", help="run_kv's phase")
    args = ap.parse_args()
    from cluster.worker.group.config import GroupOptions
    from cluster.worker.group.leader import load_group_engine

    size = len(args.hosts.split(","))
    options = GroupOptions(size=size, rank=0, hosts=args.hosts, port=args.port, parallel=args.parallel,
                           shares=args.shares, check_every=1 if args.check else GroupOptions.check_every, timeout=60,
                           join_timeout=120, inflight=args.inflight)
    cfg = config(args.speculative)
    if args.draft:
        cfg["speculative_config"] = draft_config(args.draft)
    if args.speculative or args.draft:
        every_draft()
    if args.kv_disk_dir:
        cfg = dict(KV_CONFIG, kv_disk_dir=args.kv_disk_dir)
    cfg["num_kv_blocks"] *= args.inflight  # each batch in flight (virtual engine) gets the single process's pool
    def load():
        engine = load_group_engine(args.model, EngineConfig(**cfg), options, "test-token")
        engine.warm_up()
        return engine

    if args.poison:  # the engine is built on the engine thread, as a worker builds it
        out = run_beside_poison(load, args.seed)
        engine = out.pop("engine")
        out["group"] = {"failed_steps": engine.group.stats.failed_steps, "lost": engine.group.leader.lost}
        engine.group.close()
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    engine = load()
    if args.kv_disk_dir:
        out = run_kv(engine, args.kv_phase, args.inflight)
    elif args.random_steps:
        from group_random import run_random

        out = run_random(engine, args.random_steps, args.seed)
    else:
        out = run_workload(engine, args.seed)
    stats = engine.group.stats
    out["group"] = {"members": stats.members, "steps": stats.steps, "mismatches": stats.mismatches,
                    "checked_steps": stats.checked_steps, "plan_bytes": stats.plan_bytes,
                    "hidden_bytes": stats.hidden_bytes,
                    "draft_models": len({id(e.speculator.proposer.model) for e in getattr(engine, "engines", [engine])
                                         if e.speculator is not None and hasattr(e.speculator.proposer, "model")})}
    engine.group.close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
