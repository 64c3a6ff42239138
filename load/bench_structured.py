"""What structured outputs, penalties and bias cost, each against its baseline in one run.

    python load/bench_structured.py [--model DIR] [--quick] [--only engine|masks|sampler]

engine : the same decode load (greedy, 16 requests x 96 new tokens, short prompts) plain,
         under a JSON schema (an array of objects that never closes within max_tokens, so
         both runs produce the same number of tokens), and under a forced tool call
         (`tool_call_constraint`, tool_choice=required); output tokens/s, mean ITL, the
         ratios to plain, and the time the engine spent filling grammar masks per step
         (a figure the shared machine's noise does not blur).
masks  : per-token mask cost of llguidance against xgrammar (when it can be imported:
         `pip install --target DIR xgrammar apache-tvm-ffi torch`, then PYTHONPATH=DIR;
         it needs torch) on the model's tokenizer: a valid document per schema is
         tokenized and walked token by token, mask then consume; schema compile time too.
sampler: the sampler on a [32, vocab] batch: plain greedy rows, then with every row
         carrying presence/frequency/repetition penalties and a 300-entry logit_bias, then
         one such row among 31 plain ones; best-of ms per call and the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import platform  # noqa: E402

platform.preload_blas()  # before MLX is imported
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from cluster.models_cache import resolve_model  # noqa: E402
from cluster.worker.config import EngineConfig  # noqa: E402
from cluster.worker.engine import Engine  # noqa: E402
from cluster.worker.sampler import Sampler  # noqa: E402
from cluster.worker.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from cluster.worker.structured import GrammarCompiler, fill_bitmasks, tool_call_constraint  # noqa: E402

ITEM = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["id", "name", "tags"], "additionalProperties": False}
LONG_ARRAY = {"type": "array", "items": ITEM}
ENDLESS_ARRAY = {"type": "array", "items": ITEM, "minItems": 1000}  # never closes within max_tokens
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "array", "items": ITEM}},
    "required": ["query", "filters"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]

# Mask-cost documents: (schema, a valid instance).
DOCS = [
    (LONG_ARRAY, [{"id": i, "name": f"item number {i}", "tags": ["a", "c"][: i % 3]} for i in range(12)]),
    ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10**6},
                                                  "email": {"type": "string", "maxLength": 64},
                                                  "role": {"enum": ["admin", "guest", "dev"]}},
                 "required": ["id", "email", "role"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 50},
        "note": {"type": "string"}},
      "required": ["user", "scores", "note"]},
     {"user": {"id": 4242, "email": "someone@example.org", "role": "dev"}, "scores": [0.5, 12.25, -3.0] * 6,
      "note": "A longer free-text note, with punctuation; and some numbers 1, 2, 3. " * 3}),
]


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3  # the least disturbed run: the machine is shared


# -- engine ----------------------------------------------------------------------------------
def run_load(engine: Engine, prompts, params: SamplingParams) -> tuple[float, int, float]:
    s0, t0 = engine.stats.num_steps, time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    n = 0
    while engine.has_unfinished():
        n += len(engine.step())
    dt = time.perf_counter() - t0
    steps = engine.stats.num_steps - s0
    return n / dt, n, dt / max(1, steps) * 1e3


def bench_engine(model: Path, quick: bool) -> None:
    import cluster.worker.engine as engine_module

    mask_seconds = [0.0]
    fill = engine_module.fill_bitmasks

    def timed_fill(*args):  # the grammar's own share, which the machine's noise cannot hide
        t0 = time.perf_counter()
        try:
            return fill(*args)
        finally:
            mask_seconds[0] += time.perf_counter() - t0

    engine_module.fill_bitmasks = timed_fill
    engine = Engine.from_pretrained(model, EngineConfig(num_kv_blocks=1024, max_model_len=2048))
    engine.warm_up()
    n, new = (8, 48) if quick else (16, 96)
    prompts = [engine.tokenizer.encode(f"Request {i}: list the items as JSON.") for i in range(n)]
    loads = {
        "plain": SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=new, temperature=0, ignore_eos=True,
                                      structured=StructuredOutput("json_schema", json.dumps(ENDLESS_ARRAY))),
        "tool_choice=required": SamplingParams(max_tokens=new, temperature=0, ignore_eos=True,
                                               structured=tool_call_constraint(TOOLS, "required")),
    }
    run_load(engine, prompts[:2], loads["json_schema"])  # compile + first use outside the timing
    run_load(engine, prompts[:2], loads["tool_choice=required"])
    results = {name: [] for name in loads}
    masks = {name: 0.0 for name in loads}
    steps = {name: 0 for name in loads}
    for _ in range(3 if quick else 5):  # alternate, keep the best of each: the machine is shared
        for name, p in loads.items():
            mask_seconds[0], s0 = 0.0, engine.stats.num_steps
            results[name].append(run_load(engine, prompts, p))
            masks[name] += mask_seconds[0]
            steps[name] += engine.stats.num_steps - s0
    base = max(results["plain"])
    print(f"engine decode, {n} requests x {new} tokens, greedy ({model.name}):")
    for name, runs in results.items():
        tps, tokens, itl = max(runs)
        print(f"  {name:22s} {tps:8.1f} tok/s  {tokens:5d} tokens  ITL {itl:6.2f} ms  "
              f"throughput ratio {tps / base[0]:.3f}  ITL ratio {itl / base[2]:.3f}  "
              f"masks {masks[name] / max(1, steps[name]) * 1e3:.2f} ms/step")


# -- masks -------------------------------------------------------------------------------------
def bench_masks(model: Path, quick: bool) -> None:
    from mlx_lm.utils import load

    _, tok = load(str(model))
    vocab = len(tok._tokenizer)
    g = GrammarCompiler(tok, vocab, tok.eos_token_ids)
    t0 = time.perf_counter()
    _ = g.lltokenizer  # built on first use, once per worker
    print(f"mask cost per token ({model.name}, vocabulary {vocab}; llguidance's tokenizer built once in "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms):")
    xgr = None
    try:
        import torch  # noqa: F401  (xgrammar needs it)
        import xgrammar as xgr
    except ImportError as e:
        print(f"  xgrammar not importable ({e}): llguidance alone")
    for schema, doc in DOCS[: 1 if quick else None]:
        tokens = tok.encode(json.dumps(doc), add_special_tokens=False)
        spec = StructuredOutput("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        g.compile(spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        times = []
        for _ in range(3):
            m = g.matcher_for(spec)
            t0 = time.perf_counter()
            for t in tokens:
                fill_bitmasks([m], vocab)
                assert m.consume_token(t)
            times.append((time.perf_counter() - t0) / len(tokens) * 1e6)
        llg = min(times)
        line = f"  doc of {len(tokens):4d} tokens: llguidance {llg:7.1f} us/token (compile {compile_ms:6.1f} ms)"
        if xgr is not None:
            info = xgr.TokenizerInfo.from_huggingface(tok._tokenizer, vocab_size=vocab)
            compiler = xgr.GrammarCompiler(info, max_threads=1)
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            xc_ms = (time.perf_counter() - t0) * 1e3
            mask = xgr.allocate_token_bitmask(1, vocab)
            xtimes = []
            for _ in range(3):
                m = xgr.GrammarMatcher(compiled)
                t0 = time.perf_counter()
                for t in tokens:
                    m.fill_next_token_bitmask(mask)
                    assert m.accept_token(t)
                xtimes.append((time.perf_counter() - t0) / len(tokens) * 1e6)
            xg = min(xtimes)
            line += f"; xgrammar {xg:7.1f} us/token (compile {xc_ms:6.1f} ms); llguidance/xgrammar {llg / xg:.2f}"
        print(line)


# -- sampler -----------------------------------------------------------------------------------
def bench_sampler(model: Path, quick: bool) -> None:
    import json as _json

    vocab = _json.loads((model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    N = 32
    logits = mx.array(rng.standard_normal((N, vocab)).astype(np.float32))
    histories = [(rng.integers(0, vocab, 600).tolist(), 500) for _ in range(N)]
    plain = [SamplingParams(temperature=0)] * N
    heavy = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                           logit_bias={int(t): 1.0 for t in rng.choice(vocab, 300, replace=False)})
    sampler = Sampler()
    reps = 10 if quick else 30
    a = median_ms(lambda: sampler(logits, plain, [0] * N, histories), reps)
    b = median_ms(lambda: sampler(logits, [heavy] * N, [0] * N, histories), reps)
    c = median_ms(lambda: sampler(logits, [heavy] + plain[1:], [0] * N, histories), reps)
    print(f"sampler, {N} greedy rows x vocabulary {vocab}, 600-token histories:")
    print(f"  plain {a:.3f} ms; every row penalised + 300 biases {b:.3f} ms (x{b / a:.2f}); "
          f"one such row {c:.3f} ms (x{c / a:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="mlx-lm model directory or name (default: small, random weights)")
    ap.add_argument("--quick", action="store_true", help="smaller loads")
    ap.add_argument("--only", choices=("engine", "masks", "sampler"))
    args = ap.parse_args()
    model = resolve_model(args.model)
    for name, fn in (("sampler", bench_sampler), ("masks", bench_masks), ("engine", bench_engine)):
        if args.only in (None, name):
            fn(model, args.quick)


if __name__ == "__main__":
    main()
