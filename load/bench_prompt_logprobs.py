"""What prompt logprobs cost: the same requests with and without them, in one run.

    python load/bench_prompt_logprobs.py [--model DIR] [--requests 8] [--prompt-len 512] [--max-tokens 8]

Each way runs the same prompts on a fresh engine (no prefix cache to tell them apart),
interleaved over the repeats:
  plain            no prompt logprobs (only each sequence's last row reaches the LM head)
  prompt_logprobs=0  every prompt row reaches the LM head; the chosen token's logprob
  prompt_logprobs=5  and the top 5 alternatives of every prompt position
  echo-style       max_tokens=1 with prompt_logprobs=1 (lm-eval's loglikelihood request)
Prints wall time, prefill tokens/s and the ratio against plain.
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


def run(model, tokenizer, prompts: list[list[int]], params: SamplingParams) -> float:
    blocks = len(prompts) * -(-(max(map(len, prompts)) + params.max_tokens) // 16) + 16
    engine = Engine(model, tokenizer, EngineConfig(enable_prefix_caching=False, num_kv_blocks=blocks))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    t0 = time.perf_counter()
    got = 0
    while engine.has_unfinished():
        for o in engine.step():
            got += o.prompt_logprobs is not None
    seconds = time.perf_counter() - t0
    assert got == (len(prompts) if params.prompt_logprobs is not None else 0)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="mlx-lm model dir or name (default: small, random weights)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = resolve_model(args.model)
    print(f"model {path}; OpenBLAS {platform.blas_path() or 'NOT loaded'}; Metal {platform.has_metal()}")
    model, tokenizer = load_model(path)
    vocab = int(model.args.vocab_size)
    base = dict(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ways = {
        "plain": SamplingParams(**base),
        "prompt_logprobs=0": SamplingParams(**base, prompt_logprobs=0),
        "prompt_logprobs=5": SamplingParams(**base, prompt_logprobs=5),
        "echo-style": SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=1),
    }
    run(model, tokenizer, [[5] * 64], ways["prompt_logprobs=5"])  # warm up
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.repeats):
        rng = random.Random(r)
        prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        for w, params in ways.items():
            times[w].append(run(model, tokenizer, prompts, params))
    med = {w: sorted(t)[args.repeats // 2] for w, t in times.items()}
    total = args.requests * args.prompt_len
    print(f"{args.requests} prompts x {args.prompt_len} tokens, vocab {vocab}; median of {args.repeats}")
    print(f"{'way':<20} {'seconds':>8} {'prompt tok/s':>13} {'vs plain':>9}")
    for w in ways:
        print(f"{w:<20} {med[w]:8.2f} {total / med[w]:13.0f} {med[w] / med['plain']:8.2f}x")
    print("(echo-style also generates fewer tokens than plain: its ratio is of the whole request)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
