"""Engine vs mlx-lm's `batch_generate` on the same model and prompts, in one run.

    python load/bench_engine.py [--model DIR | --arch ARCH] [--quick]

`--arch qwen3_5` (or qwen3_next, nemotron_h, lfm2, granitemoehybrid) runs the same loads on
a `small` hybrid model of that architecture (recurrent layers on state slots beside paged
attention), built once like the built-in model.

Two loads (EOS ignored, greedy):
  decode-heavy : 32 prompts x 128 tokens, 128 new tokens
  prefill-heavy: 16 prompts x 1,024 tokens, 16 new tokens
For each: output tokens/s of both and the ratio; the engine's host time per step
outside the forward; and for decode, the share of the matmul roofline: the time of the
same step's matmuls alone (every Linear of the engine's model at the step's batch, in the
C linear or BLAS as the engine runs them) over the engine's measured decode step time.
For a model on the host path (`cluster/worker/host_forward.py`: llama / qwen2 / qwen3 on
a CPU) it also prints the decode step at batch 16 on that path and through mlx-lm's
module code, alternating, against that step's matmuls alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import platform  # noqa: E402

platform.preload_blas()  # before MLX is imported
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from cluster.models_cache import builtin_model, resolve_model  # noqa: E402
from cluster.worker import cpu_layers  # noqa: E402
from cluster.worker.config import EngineConfig  # noqa: E402
from cluster.worker.engine import Engine  # noqa: E402
from cluster.worker.model_runner import text_args  # noqa: E402
from cluster.worker.sampling_params import SamplingParams  # noqa: E402


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def run_mlx_lm(model, prompts, max_tokens) -> tuple[float, int]:
    from mlx_lm.generate import batch_generate

    class NoEos:  # batch_generate stops on tokenizer.eos_token_ids: suppress EOS
        eos_token_ids: list[int] = []

        def decode(self, ids):
            return ""

    t0 = time.perf_counter()
    res = batch_generate(model, NoEos(), prompts, max_tokens=max_tokens, return_token_ids=True)
    dt = time.perf_counter() - t0
    n = sum(len(t) for t in res.token_ids)
    return dt, n


def run_engine(engine: Engine, prompts, max_tokens) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    s0 = (engine.stats.num_steps, engine.stats.step_seconds, engine.stats.forward_seconds)
    decode_steps: list[float] = []
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    n = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        ts = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - ts
        if outs and all(not e for e in [engine.scheduler.waiting]) and len(outs) == len(engine.scheduler.running):
            decode_steps.append(dt)
        n += sum(len(o.new_token_ids) for o in outs)
    total = time.perf_counter() - t0
    steps = engine.stats.num_steps - s0[0]
    host = (engine.stats.step_seconds - s0[1]) - (engine.stats.forward_seconds - s0[2])
    return dict(seconds=total, tokens=n, steps=steps, host_ms_per_step=1000 * host / max(1, steps),
                decode_step_ms=1000 * sorted(decode_steps)[len(decode_steps) // 2] if decode_steps else float("nan"))


def mlx_lm_model(path, dtype) -> nn.Module:
    """The model as mlx-lm loads it (none of Orchard's changes), in the engine's dtype."""
    from mlx_lm.utils import load

    model, _ = load(str(path))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def matmul_roofline_ms(weights: list[mx.array], rows: int, repeats: int = 10) -> float:
    """Time of one step's matmuls alone: each weight at `rows` rows, as the engine runs it
    (the C linear where `cpu_layers.c_linear` says so: few float32 rows on a CPU; else
    BLAS)."""
    from cluster.worker.kernels import cpu

    xs = {w.shape[1]: mx.random.normal((rows, w.shape[1])).astype(w.dtype) for w in weights}
    mx.eval(list(xs.values()))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([cpu.linear(x, w) if cpu_layers.c_linear(x) else x @ w.T
                 for w in weights for x in (xs[w.shape[1]],)])
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def linear_weights(model: nn.Module) -> list[mx.array]:
    """Every Linear's weight, and a tied LM head's (the embedding) once."""
    return [p for name, p in tree_flatten(model.parameters()) if name.endswith(".weight") and p.ndim == 2]


def host_path_decode_ms(engine: Engine, vocab: int, rows: int = 16, context: int = 300) -> tuple[float, float, float]:
    """The decode step at `rows` sequences of ~`context` tokens on the host path and through
    mlx-lm's module code (the MLX path), alternating in blocks of 10 steps (medians), and
    that step's matmuls alone as the engine runs them (the C linear at these rows)."""
    runner, host = engine.runner, engine.runner.host
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for i, p in enumerate(make_prompts(rows, context, vocab, seed=7)):
        engine.add_request(f"ab-{i}", p, params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(5):
            for on in (True, False):
                runner.host = host if on else None
                t0 = time.perf_counter()
                for _ in range(10):
                    engine.step()
                times[on].append((time.perf_counter() - t0) * 100)
    finally:
        runner.host = host
        engine.abort_all()
        while engine.has_unfinished():
            engine.step()
    mm = matmul_roofline_ms(linear_weights(runner.model), rows)
    return statistics.median(times[True]), statistics.median(times[False]), mm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="mlx-lm model dir or name (default: small, random weights)")
    ap.add_argument("--arch", default=None,
                    help="a `small` model of this architecture instead (e.g. qwen3_5, a hybrid)")
    ap.add_argument("--quick", action="store_true", help="a quarter of the load, for a smoke run")
    args = ap.parse_args()
    if args.model and args.arch:
        ap.error("--model or --arch, not both")
    path = builtin_model(args.arch, "small") if args.arch else resolve_model(args.model)
    print(f"model {path}; OpenBLAS {platform.blas_path() or 'NOT loaded'}; Metal {platform.has_metal()}")

    engine = Engine.from_pretrained(path, EngineConfig())
    model = mlx_lm_model(path, engine.runner.dtype)  # mlx-lm's own model, same weights and dtype
    vocab = int(text_args(model).vocab_size)
    q = 4 if args.quick else 1
    loads = [("decode-heavy", 32 // q, 128, 128 // q), ("prefill-heavy", 16 // q, 1024, 16)]

    # warm up both paths once (kernels, allocator)
    engine.generate(make_prompts(2, 64, vocab, 0), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    run_mlx_lm(model, make_prompts(2, 64, vocab, 0), 4)

    if engine.state_slots is not None:
        print(f"hybrid: {engine.state_slots.num_slots} recurrent-state slots of "
              f"{engine.runner.state_bytes_per_slot / 1024:.0f} KiB; prefix caching off")
    print(f"{'load':<14} {'mlx-lm tok/s':>13} {'orchard tok/s':>14} {'ratio':>7} {'host ms/step':>13} {'steps':>6}")
    for name, n, length, new in loads:
        prompts = make_prompts(n, length, vocab, seed=hash(name) % 1000)
        ml_s, ml_n = run_mlx_lm(model, prompts, new)
        r = run_engine(engine, prompts, new)
        ml_tps, or_tps = ml_n / ml_s, r["tokens"] / r["seconds"]
        print(f"{name:<14} {ml_tps:13.1f} {or_tps:14.1f} {or_tps / ml_tps:6.2f}x {r['host_ms_per_step']:13.2f} "
              f"{r['steps']:6d}")
        if name == "decode-heavy":
            roof = matmul_roofline_ms(linear_weights(engine.runner.model), n)
            print(f"  decode step (median) {r['decode_step_ms']:.2f} ms at batch {n}; matmuls alone {roof:.2f} ms "
                  f"-> {100 * roof / r['decode_step_ms']:.0f}% of the matmul roofline")
    if engine.runner.host is not None:
        on, off, mm = host_path_decode_ms(engine, vocab)
        print(f"decode step at batch 16 (~300 tokens of context): host path {on:.2f} ms, through mlx-lm's modules "
              f"{off:.2f} ms ({off / on:.2f}x); matmuls alone {mm:.2f} ms -> {100 * mm / on:.0f}% of the host step")
    print("targets: decode-heavy >= 1.3x, prefill-heavy >= 1.0x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
