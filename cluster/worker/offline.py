"""`orchard run`: offline batched generation with the engine, on one machine."""

from __future__ import annotations

import time

DEFAULT_PROMPTS = [
    "The orchard is quiet in the morning.",
    "Once upon a time a model answered questions about",
    "Workers pick apples from every tree, and the router",
    "Is it fast? Yes",
]


def run_offline(args) -> int:
    from cluster.cli import engine_config_from_args
    from cluster.models_cache import resolve_model
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    path = resolve_model(args.model)
    engine = Engine.from_pretrained(path, engine_config_from_args(args))
    tok = engine.tokenizer
    prompts = args.prompts or DEFAULT_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    t0 = time.perf_counter()
    outputs = engine.generate([tok.encode(p) for p in prompts], params)
    dt = time.perf_counter() - t0
    for prompt, ids in zip(prompts, outputs):
        print(f"--- {prompt!r}\n{tok.decode(ids)}")
    n = sum(map(len, outputs))
    print(f"\n{len(prompts)} prompts, {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s) on {path}")
    return 0
