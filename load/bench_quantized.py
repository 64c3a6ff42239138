"""Quantized models' decode against the float32 model's, same run.

    .venv/bin/python load/bench_quantized.py [--model DIR] [--batch 16] [--repeat 3]

The built-in `small` model (or --model) quantized with mlx-lm's own convert to 4-bit and
8-bit (group 64; made once under ~/.cache/orchard/models), each served by the engine as a
user's quantized model is: on a CPU dequantized to float32 at load (`--cpu-dequantize
auto`), and once kept quantized (`--cpu-dequantize no`, MLX's CPU quantized matmuls) for
comparison. Printed: the median decode step at the batch (every request decoding, none
prefilling) and its ratio to the float32 model's; runs alternate so the machine's drift
hits all alike. Target (issue 17): 4-bit and 8-bit within 1.2x of float32.
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
from cluster.models_cache import builtin_model, cache_dir  # noqa: E402
from cluster.worker.config import EngineConfig  # noqa: E402
from cluster.worker.engine import Engine  # noqa: E402
from cluster.worker.sampling_params import SamplingParams  # noqa: E402


def quantized(src: Path, bits: int) -> Path:
    dst = cache_dir() / f"{src.name}-{bits}bit-g64"
    if not (dst / "config.json").exists():
        from mlx_lm import convert

        convert(str(src), mlx_path=str(dst), quantize=True, q_bits=bits, q_group_size=64)
    return dst


def decode_step_ms(engine: Engine, batch: int, prompt_len: int, max_tokens: int) -> float:
    rng = random.Random(0)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{time.monotonic_ns()}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        decoding = not engine.scheduler.waiting and not any(s.is_prefilling for s in engine.scheduler.running)
        if decoding and len(outs) == batch:
            steps.append(dt)
    return 1000 * statistics.median(steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    src = (args.model or builtin_model()).resolve()
    models = {"float32": (src, "auto"), "8-bit": (quantized(src, 8), "auto"), "4-bit": (quantized(src, 4), "auto"),
              "4-bit kept quantized": (quantized(src, 4), "no")}
    engines = {name: Engine.from_pretrained(path, EngineConfig(cpu_dequantize=dq))
               for name, (path, dq) in models.items()}
    for engine in engines.values():  # warm up (first-step allocations, kernel loads)
        decode_step_ms(engine, 2, 8, 4)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeat):
        for name, engine in engines.items():
            if name.endswith("kept quantized") and r:  # slow, and one run says enough
                continue
            runs[name].append(decode_step_ms(engine, args.batch, args.prompt_len, args.max_tokens))
    med = {name: statistics.median(v) for name, v in runs.items()}
    print(f"model {src.name}; decode step at batch {args.batch} (median of {args.repeat} alternating runs)")
    for name, ms in med.items():
        print(f"  {name:22} {ms:8.1f} ms   {ms / med['float32']:5.2f}x float32")
    worst = max(med["4-bit"], med["8-bit"]) / med["float32"]
    print(f"target: 4-bit and 8-bit within 1.2x of float32 (worst {worst:.2f}x): {'MET' if worst <= 1.2 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
