"""Speculative decoding, off against on, in the same command, on a real trained model.

    .venv/bin/python load/bench_spec.py                          # n-gram, both loads, 1/4/16/32 streams
    .venv/bin/python load/bench_spec.py --method draft --streams 1,4 --loads editing
    .venv/bin/python load/bench_spec.py --vs-mlx                 # + single stream against mlx_lm.server --draft-model

The model: SmolLM2-135M-Instruct (its Q4_1 GGUF from PyPI, imported once; dequantized
to float32 on a CPU as the worker does). Two loads, through its chat template, greedy:

- editing: a 25-45-line slice of a module of Python's standard library in a code block,
  and one change to make ("Rename `x` to `x_new` in the code above. Output the whole
  code in a code block."); the answer repeats most of the prompt, as far as this small
  model manages (what agents and coding tools send).
- chat: short open questions; answers repeat little of anything.

Each (load, streams) runs a closed loop in the engine (every stream sends its next
request when the last finishes; as many requests as streams, at least 3), first without
speculation, then with it, on two engines over the same weights that were warmed up
(the speculating one measures its step costs then, for its policy). Printed per row:
output tok/s (all generated tokens / wall time, prefills included), mean time per output
token after the first, on/off of the tok/s and of the process's CPU time per output token
(steadier than wall time on a machine others share), the draft tokens' acceptance rate,
and where the policy's wall-clock trial stands for that batch size (tokens per wall
second with drafts / without, and whether it keeps them).
`--repeat N` alternates off and on N times and prints medians, and the range of on/off
over the N pairs (`--json` keeps the ranges of tok/s and acceptance too). Greedy outputs must be
identical with and without speculation: a mismatch is printed (and the exit status is 1).

The draft-model method needs a smaller model of the same tokenizer; SmolLM2-135M is the
only real model here, so `--method draft` drafts with the first `--draft-layers` of its
30 layers (its embedding, final norm and head kept: `modelgen.truncated_copy`), or with
the model itself (`--draft-layers 30`): a weak draft, or a free one that costs as much as
the target. `--vs-mlx` runs single-stream editing requests through Orchard's worker and
through `mlx_lm.server --draft-model` on the same pair of float32 directories, each with
and without its draft.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import platform  # noqa: E402

platform.preload_blas()  # before MLX is imported

# Python's own standard library: real code that stays the same from run to run
SOURCES = ["textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "colorsys.py", "shlex.py", "sched.py", "queue.py"]
CHANGES = ["Rename `{a}` to `{b}` in the code above.", "Rename the function `{f}` to `{f}_v2` in the code above.",
           "Add a comment above `{f}` saying what it does.", "Rename `{a}` to `{b}` in the code above."]
QUESTIONS = [
    "What is the capital of Australia, and why was it chosen?", "Give me three tips for learning to cook.",
    "Explain how a bicycle stays upright.", "Write a short poem about autumn leaves.",
    "What causes the seasons on Earth?", "How do I make a good cup of tea?",
    "Summarise the plot of Romeo and Juliet.", "Why is the sky blue?",
    "What are the benefits of regular exercise?", "Describe a day in the life of a honeybee.",
    "How does a refrigerator work?", "What should I pack for a weekend hiking trip?",
    "Explain photosynthesis to a ten-year-old.", "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot and explain it.", "How do volcanoes form?",
    "What makes a good friend?", "Tell me about the history of the printing press.",
    "How can I sleep better at night?", "What is a black hole?",
    "Give me a recipe for a simple pasta dish.", "Why do cats purr?",
    "What is the tallest mountain in the world?", "How do airplanes fly?",
    "What are some fun things to do on a rainy day?", "Explain what a computer program is.",
    "Why do leaves change colour in autumn?", "How do bees make honey?",
    "What is the water cycle?", "Describe the ocean to someone who has never seen it.",
    "What is the Moon made of?", "How do I start learning to play the guitar?",
]


def editing_prompts(tokenizer, n: int, lines: tuple[int, int] = (25, 45)) -> list[list[int]]:
    import random
    import re
    import sysconfig

    rng = random.Random(7)
    out = []
    for i in range(n):
        text = (Path(sysconfig.get_paths()["stdlib"]) / SOURCES[i % len(SOURCES)]).read_text().splitlines()
        length = rng.randrange(*lines)
        start = rng.randrange(0, max(1, len(text) - length))
        code = "\n".join(text[start : start + length])
        names = re.findall(r"\b([a-z_][a-z0-9_]{3,})\s*=", code) or ["value"]
        funcs = re.findall(r"def ([a-z_][a-z0-9_]*)", code) or ["main"]
        a = rng.choice(names)
        change = CHANGES[i % len(CHANGES)].format(a=a, b=a + "_new", f=rng.choice(funcs))
        msg = f"```python\n{code}\n```\n\n{change} Output the whole code in a code block."
        out.append(chat_ids(tokenizer, msg))
    return out


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [chat_ids(tokenizer, QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]


def chat_ids(tokenizer, content: str) -> list[int]:
    """One user message through the chat template, as token ids (transformers' own
    tokenizer returns a BatchEncoding where mlx-lm's wrapper returns the ids)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def closed_loop(engine, prompts: list[list[int]], streams: int, max_tokens: int) -> dict:
    """`streams` requests in flight until `prompts` are done; tok/s over the wall time."""
    from cluster.worker.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    queue = list(enumerate(prompts))
    live: dict[str, tuple[int, list[int], list[float]]] = {}
    done: dict[int, list[int]] = {}
    tpot: list[float] = []
    spec = engine.speculator.stats if engine.speculator is not None else None
    drafts0, accepted0 = (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)

    def submit() -> None:
        i, prompt = queue.pop(0)
        rid = f"b{i}-{time.monotonic_ns()}"
        engine.add_request(rid, prompt, params)
        live[rid] = (i, [], [])

    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(min(streams, len(queue))):
        submit()
    while live:
        for out in engine.step():
            i, tokens, times = live[out.request_id]
            tokens += out.new_token_ids
            times.append(time.perf_counter())
            if out.finished:
                del live[out.request_id]
                done[i] = tokens
                if len(tokens) > 1:
                    tpot.append((times[-1] - times[0]) / (len(tokens) - 1))
                if queue:
                    submit()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    generated = sum(len(t) for t in done.values())
    result = {"tok_s": generated / wall, "wall_s": wall, "tokens": generated,
              "cpu_ms_per_token": 1000 * cpu / generated,
              "tpot_ms": 1000 * statistics.mean(tpot) if tpot else float("nan"), "outputs": done}
    if spec:
        d, a = spec.num_draft_tokens - drafts0, spec.num_accepted_tokens - accepted0
        result["drafts"], result["acceptance"] = d, (a / d if d else 0.0)
    return result


def wall_trial(engine, streams: int) -> str:
    """The policy's wall-clock trial for batches of `streams` decodes, at the end of the
    row: tokens per wall second with drafts / without, and its verdict ("-": the table's
    gain was large enough that it never asked, or too few steps yet)."""
    check = engine.speculator.policy.check
    bucket = check.bucket(streams)
    ratio = check.ratio(bucket)
    return "-" if ratio is None else f"{ratio:.2f}x {'kept' if check.verdict(bucket) else 'dropped'}"


def draft_dir(model: Path, layers: int) -> Path:
    from cluster.modelgen import truncated_copy
    from cluster.models_cache import cache_dir

    if layers >= json.loads((model / "config.json").read_text())["num_hidden_layers"]:
        return model  # the model itself (a draft as costly as the target: exactness, not speed)
    target = cache_dir() / "bench" / f"{model.name}-first{layers}"
    if not (target / "config.json").exists():
        truncated_copy(model, target, layers)
    return target


def spec_config(args, model: Path) -> str:
    if args.method == "draft":
        return json.dumps({"method": "draft_model", "model": str(draft_dir(model, args.draft_layers)),
                           "num_speculative_tokens": args.k})
    return json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
                       "prompt_lookup_max": args.lookup_max})


def engine_rows(args, model: Path) -> list[dict]:
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine

    common = dict(num_kv_blocks=args.kv_blocks, max_num_seqs=max(32, max(args.streams)))
    t = time.perf_counter()
    off = Engine.from_pretrained(model, EngineConfig(**common))
    on = Engine.from_pretrained(model, EngineConfig(speculative_config=spec_config(args, model), **common))
    print(f"loaded in {time.perf_counter() - t:.1f} s; warm-up (with the policy's step times) "
          f"{off.warm_up() + on.warm_up():.1f} s; speculation: {spec_config(args, model)}", flush=True)
    times = on.speculator.policy.times.seconds
    print(f"measured step costs (ms of {on.speculator.clock.__name__}, by rows): "
          + ", ".join(f"{r}: {1000 * s:.0f}" for r, s in sorted(times.items())), flush=True)
    rows = []
    header = (f"{'load':<8} {'streams':>7} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'range':>11} "
              f"{'off TPOT':>9} {'on TPOT':>8} {'CPU on/off':>10} {'accept':>7} {'drafts':>7} {'wall trial':>11}  same")
    print(header, flush=True)
    for load in args.loads:
        for streams in args.streams:
            n = max(streams, args.min_requests)
            make = editing_prompts if load == "editing" else chat_prompts
            prompts = make(on.tokenizer, n)
            runs = []
            for _ in range(args.repeat):  # off and on alternate: a busy machine's drift falls on both
                runs.append((closed_loop(off, prompts, streams, args.max_tokens),
                             closed_loop(on, prompts, streams, args.max_tokens)))
            a = {k: statistics.median(r[0][k] for r in runs) for k in ("tok_s", "tpot_ms", "cpu_ms_per_token")}
            b = {k: statistics.median(r[1][k] for r in runs) for k in ("tok_s", "tpot_ms", "cpu_ms_per_token")}
            same = all(r[0]["outputs"] == r[1]["outputs"] for r in runs)
            ratios = [r[1]["tok_s"] / r[0]["tok_s"] for r in runs]
            row = {"load": load, "streams": streams, "off": a["tok_s"], "on": b["tok_s"],
                   "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                   "off_range": [min(r[0]["tok_s"] for r in runs), max(r[0]["tok_s"] for r in runs)],
                   "on_range": [min(r[1]["tok_s"] for r in runs), max(r[1]["tok_s"] for r in runs)],
                   "acceptance_range": [min(r[1].get("acceptance", 0.0) for r in runs),
                                        max(r[1].get("acceptance", 0.0) for r in runs)],
                   "cpu_ratio": statistics.median(r[0]["cpu_ms_per_token"] / r[1]["cpu_ms_per_token"] for r in runs),
                   "off_tpot_ms": a["tpot_ms"], "on_tpot_ms": b["tpot_ms"],
                   "acceptance": statistics.median(r[1].get("acceptance", 0.0) for r in runs),
                   "drafts": sum(r[1].get("drafts", 0) for r in runs), "same": same, "tokens": runs[0][0]["tokens"],
                   "wall_trial": wall_trial(on, streams)}
            rows.append(row)
            span = f"{row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f}x"
            print(f"{load:<8} {streams:>7} {row['off']:>10.1f} {row['on']:>10.1f} {row['ratio']:>6.2f}x {span:>11} "
                  f"{row['off_tpot_ms']:>7.1f}ms {row['on_tpot_ms']:>6.1f}ms {row['cpu_ratio']:>9.2f}x "
                  f"{100 * row['acceptance']:>6.0f}% {row['drafts']:>7} {row['wall_trial']:>11}  "
                  f"{'yes' if same else 'NO: outputs differ'}",
                  flush=True)
    return rows


def vs_mlx(args, model: Path) -> None:
    """Single-stream editing requests: Orchard's worker and mlx_lm.server, each with and
    without the same draft model, over HTTP (float32 directories for both)."""
    import subprocess

    from _common import run_load, start_mlx, start_orchard, summarize, wait_http
    from cluster.models_cache import cache_dir
    from transformers import AutoTokenizer

    f32 = cache_dir() / "bench" / f"{model.name}-float32"
    if not (f32 / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(model), "--mlx-path", str(f32),
                        "--dequantize", "--dtype", "float32"], check=True)
    draft = draft_dir(f32, args.draft_layers)
    tok = AutoTokenizer.from_pretrained(str(f32))
    prompts = [tok.decode(p) for p in editing_prompts(tok, args.min_requests)]
    k = args.k
    runs = {
        "orchard": (["--num-kv-blocks", str(args.kv_blocks)], {}),
        "orchard draft": (["--num-kv-blocks", str(args.kv_blocks), "--speculative-config",
                           json.dumps({"method": "draft_model", "model": str(draft),
                                       "num_speculative_tokens": k})], {}),
        "orchard ngram": (["--num-kv-blocks", str(args.kv_blocks), "--speculative-config",
                           json.dumps({"method": "ngram", "num_speculative_tokens": k})], {}),
        "mlx_lm.server": ([], {}),
        "mlx_lm.server draft": (["--draft-model", str(draft), "--num-draft-tokens", str(k)], {}),
    }
    results = {}
    for name, (extra_args, body) in runs.items():
        start = start_orchard if name.startswith("orchard") else lambda m, a: start_mlx(m, a, name)
        server, url, _ = start(f32, extra_args)
        try:
            asyncio.run(wait_http(url, body))
            res, wall = asyncio.run(run_load(f"{url}/v1/completions", prompts, body, args.max_tokens, 1))
            results[name] = summarize(res, wall, args.max_tokens)
        finally:
            server.stop()
        r = results[name]
        print(f"{name:<22} {r['output_tok_s']:>7.1f} tok/s  TPOT {1000 * r['tpot_mean']:>6.1f} ms  "
              f"({r['completion_tokens']} tokens)", flush=True)
    o, m = results["orchard draft"], results["mlx_lm.server draft"]
    print(f"single stream, draft model ({args.draft_layers} of 30 layers, k={k}): Orchard / mlx_lm.server = "
          f"{o['output_tok_s'] / m['output_tok_s']:.2f}x; each against itself without the draft: Orchard "
          f"{o['output_tok_s'] / results['orchard']['output_tok_s']:.2f}x, mlx_lm.server "
          f"{m['output_tok_s'] / results['mlx_lm.server']['output_tok_s']:.2f}x", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", type=lambda s: s.split(","), default=["editing", "chat"])
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 32])
    p.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    p.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=8, help="the draft model: the first N of SmolLM2's 30 layers")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--min-requests", type=int, default=3, help="requests per (load, streams) at least")
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=1, help="alternate off and on this many times; medians")
    p.add_argument("--vs-mlx", action="store_true", help="also single stream against mlx_lm.server --draft-model")
    p.add_argument("--only-vs-mlx", action="store_true")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    from cluster.models_cache import real_model

    model = real_model("smollm2-135m-instruct")
    rows = [] if args.only_vs_mlx else engine_rows(args, model)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.vs_mlx or args.only_vs_mlx:
        vs_mlx(args, model)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
