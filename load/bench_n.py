"""n > 1: one request for n samples (forked after the prompt's prefill, sharing its KV
blocks) against n separate requests for the same prompt, in one run.

    python load/bench_n.py [--model DIR] [--n 4] [--prompt-lens 96,1024] [--max-tokens 32] [--repeats 3]

Four ways to get n samples of one prompt, each on a fresh engine (nothing cached from
before), all submitted at once as a server would get them:
  fork          one request with n (the engine forks it after the prompt's prefill)
  fork/nocache  the same with prefix caching off (the fork shares blocks by reference)
  separate      n requests, prefix caching on (when n prompts fit one step's token budget
                they are admitted together, before any block is cached, and each prefills
                the whole prompt; a longer prompt fills the step alone and the others
                hit its blocks a step later)
  separate/nocache  n requests, no prefix cache (the baseline)
  staggered     n requests, the n-1 others sent once the first has its first token
                (what relying on the prefix cache needs: they hit its cached blocks)
For each: tokens forwarded (prompt rows recomputed included), wall time, and ratios
against the baseline.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import platform  # noqa: E402

platform.preload_blas()  # before MLX is imported

from cluster.models_cache import resolve_model  # noqa: E402
from cluster.worker.config import EngineConfig  # noqa: E402
from cluster.worker.engine import Engine  # noqa: E402
from cluster.worker.model_runner import load_model  # noqa: E402
from cluster.worker.sampling_params import SamplingParams  # noqa: E402


def run(model, tokenizer, how: str, prompt: list[int], n: int, max_tokens: int) -> tuple[int, float, int]:
    """(tokens forwarded, seconds, tokens generated)."""
    blocks = n * -(-(len(prompt) + max_tokens) // 16) + 16  # room for n whole copies: no preemption
    engine = Engine(model, tokenizer, EngineConfig(enable_prefix_caching="nocache" not in how, num_kv_blocks=blocks))
    forwarded = 0
    forward = engine.runner.forward

    def counting(batch):
        nonlocal forwarded
        forwarded += batch.num_tokens
        return forward(batch)

    engine.runner.forward = counting
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    t0 = time.perf_counter()
    if how.startswith("fork"):
        engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True,
                                                       n=n))
        pending = []
    elif how == "staggered":
        engine.add_request("r0", prompt, params)
        pending = [f"r{i}" for i in range(1, n)]
    else:
        for i in range(n):
            engine.add_request(f"r{i}", prompt, params)
        pending = []
    generated = 0
    while engine.has_unfinished():
        outs = engine.step()
        generated += sum(len(o.new_token_ids) for o in outs)
        if pending and outs:
            for rid in pending:
                engine.add_request(rid, prompt, params)
            pending = []
    return forwarded, time.perf_counter() - t0, generated


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="mlx-lm model dir or name (default: small, random weights)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-lens", default="96,1024", help="comma-separated prompt lengths")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = resolve_model(args.model)
    print(f"model {path}; OpenBLAS {platform.blas_path() or 'NOT loaded'}; Metal {platform.has_metal()}")
    model, tokenizer = load_model(path)
    vocab = int(model.args.vocab_size)
    ways = ("separate/nocache", "separate", "staggered", "fork", "fork/nocache")
    run(model, tokenizer, "fork", [5] * 64, 2, 2)  # warm up (kernels, allocator)
    for prompt_len in (int(x) for x in args.prompt_lens.split(",")):
        results: dict[str, list[tuple[int, float, int]]] = {w: [] for w in ways}
        for r in range(args.repeats):
            rng = random.Random(r)
            prompt = [rng.randrange(10, vocab - 10) for _ in range(prompt_len)]
            for w in ways:  # interleaved, so drift on a shared machine hits every way alike
                results[w].append(run(model, tokenizer, w, prompt, args.n, args.max_tokens))
        base_tokens, base_s = results[ways[0]][0][0], sorted(x[1] for x in results[ways[0]])[args.repeats // 2]
        print(f"\nn={args.n}, prompt {prompt_len} tokens, {args.max_tokens} new tokens each; median of {args.repeats}")
        print(f"{'way':<18} {'forwarded':>10} {'vs base':>8} {'seconds':>8} {'vs base':>8} {'generated':>10}")
        for w in ways:
            tokens, _, generated = results[w][0]
            seconds = sorted(x[1] for x in results[w])[args.repeats // 2]
            print(f"{w:<18} {tokens:10d} {tokens / base_tokens:7.2f}x {seconds:8.2f} {seconds / base_s:7.2f}x "
                  f"{generated:10d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
