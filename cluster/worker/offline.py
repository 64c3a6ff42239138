"""`orchard run`: offline batched generation with the engine, on one machine."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.config import setting
from cluster.worker.config import GGUF_FILE_HELP, MODEL_HELP, EngineConfig

DEFAULT_PROMPTS = [
    "The orchard is quiet in the morning.",
    "Once upon a time a model answered questions about",
    "Workers pick apples from every tree, and the router",
    "Is it fast? Yes",
]


@dataclass(frozen=True)
class RunConfig:
    """`orchard run`. The engine's defaults are the library's: `Engine.generate` takes the
    whole batch at once, so the waiting queue is unbounded here (a worker bounds it)."""

    prompts: tuple[str, ...] = setting((), "prompts (default: a few built-in ones)", flag="prompts", nargs="*")
    model: str | None = setting(None, MODEL_HELP)
    gguf_file: str | None = setting(None, GGUF_FILE_HELP, metavar="NAME")
    max_tokens: int = setting(32, "tokens to generate per prompt at most")
    temperature: float = setting(0.0, "sampling temperature (0: greedy)")
    engine: EngineConfig = setting(default_factory=EngineConfig, group="engine")


def run_offline(config: RunConfig) -> int:
    from cluster.models_cache import resolve_model
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    path = resolve_model(config.model, config.gguf_file)
    engine = Engine.from_pretrained(path, config.engine)
    tok = engine.tokenizer
    prompts = list(config.prompts) or DEFAULT_PROMPTS
    params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature)
    t0 = time.perf_counter()
    outputs = engine.generate([tok.encode(p) for p in prompts], params)
    dt = time.perf_counter() - t0
    for prompt, ids in zip(prompts, outputs):
        print(f"--- {prompt!r}\n{tok.decode(ids)}")
    n = sum(map(len, outputs))
    print(f"\n{len(prompts)} prompts, {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s) on {path}")
    return 0
