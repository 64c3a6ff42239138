"""Which model families the engine serves exactly: a tiny random-weight model of every
family `orchard model create` knows, served by the engine and compared with mlx-lm's own
greedy generation, plus quantized variants made with `mlx_lm.convert`.

    python load/model_coverage.py [--families qwen3,lfm2] [--out DIR]

For each model: prompts longer than every sliding window (32 tokens in tiny models),
chunked prefill (a 48-token step budget), preemption (a pool too small for the load: the
engine must have preempted) and prefix caching (one prompt reuses a 64-token prefix of an
earlier one: the engine must report the hit; hybrid models turn prefix caching off, and
run with recurrent-state slots, one per running request). Tokens must equal mlx-lm's and the chosen
tokens' logprobs agree within 1e-4. A model the engine refuses at load is a row
`refused: <reason>` (the message's first sentence), not a failure; a mismatch or any other error is, and the script
exits non-zero. Prints a Markdown table (the README's model-support section).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import platform  # noqa: E402

platform.preload_blas()  # before MLX is imported
import mlx.core as mx  # noqa: E402

from cluster.modelgen import ARCHS, create_model  # noqa: E402
from cluster.worker.attention import UnsupportedModel  # noqa: E402
from cluster.worker.config import EngineConfig  # noqa: E402
from cluster.worker.engine import Engine  # noqa: E402
from cluster.worker.model_runner import text_args  # noqa: E402
from cluster.worker.sampling_params import SamplingParams  # noqa: E402

DENSE, MOE, SLIDING, SOFTCAP, SINKS, MLA, HYBRID = ("dense", "MoE", "sliding window", "soft-cap", "sinks", "MLA",
                                                    "hybrid")
KIND = {
    "qwen3": DENSE, "llama": DENSE, "qwen2": DENSE, "phi3": DENSE, "mistral": DENSE, "starcoder2": DENSE,
    "olmo2": DENSE, "internlm3": DENSE, "granite": DENSE, "smollm3": DENSE, "glm4": DENSE, "helium": DENSE,
    "ernie4_5": DENSE,
    "gemma3_text": SLIDING, "ministral3": SLIDING, "olmo3": SLIDING, "cohere2": SLIDING, "exaone4": SLIDING,
    "gemma4_text": f"{SLIDING}, shared K/V", "gemma2": SOFTCAP, "gpt_oss": f"{SINKS}, {SLIDING}, {MOE}",
    "deepseek_v3": f"{MLA}, {MOE}",
    "qwen3_moe": MOE, "mixtral": MOE, "qwen2_moe": MOE, "olmoe": MOE,
    "qwen3_next": f"{HYBRID}, {MOE}", "qwen3_5": HYBRID, "nemotron_h": HYBRID, "lfm2": HYBRID, "falcon_h1": HYBRID,
    "granitemoehybrid": f"{HYBRID}, {MOE}",
}
# (family, label, mlx_lm.convert arguments)
QUANTIZED = [
    ("qwen3", "4-bit g64", dict(q_bits=4, q_group_size=64)),
    ("gemma3_text", "8-bit g32", dict(q_bits=8, q_group_size=32)),
    ("deepseek_v3", "4-bit g64", dict(q_bits=4, q_group_size=64)),
    ("llama", "mixed_3_6", dict(quant_predicate="mixed_3_6", q_group_size=64)),
]
# a 48-token step budget chunks every prompt; 20 blocks of 16 (320 tokens) for ~900 tokens
# of demand preempts
ENGINE = EngineConfig(num_kv_blocks=20, block_size=16, max_num_batched_tokens=48, max_num_seqs=8,
                      max_num_partial_prefills=2, enable_prefix_caching=True)
LENGTHS = (40, 100, 33, 150, 70, 47)
SHARED = 64  # tokens (4 blocks) the prefix-hit prompt shares with the first prompt


@dataclass(frozen=True)
class Row:
    family: str
    kind: str
    result: str  # "exact", "refused: ...", or what went wrong

    @property
    def failed(self) -> bool:
        return self.result != "exact" and not self.result.startswith("refused: ")


def prompts_for(seed: int, vocab: int) -> list[list[int]]:
    """The first prompt, then one sharing its first SHARED tokens, then the rest."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    first = draw(LENGTHS[0] + SHARED)
    return [first, first[:SHARED] + draw(11)] + [draw(n) for n in LENGTHS[1:]]


def oracle(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy generation: tokens and their logprobs."""
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for (tok, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        tokens.append(int(tok))
        logprobs.append(lp[int(tok)].item())
    return tokens, logprobs


def serve(engine: Engine, prompts: list[list[int]], max_tokens: list[int]):
    """The first prompt alone (its blocks then cached), then the prefix-sharing one and the
    rest together, one new request every other step."""
    params = lambda i: SamplingParams(max_tokens=max_tokens[i], temperature=0, ignore_eos=True, logprobs=0)  # noqa: E731
    tokens = {i: [] for i in range(len(prompts))}
    logprobs = {i: [] for i in range(len(prompts))}
    pending, step = list(range(len(prompts))), 0
    engine.add_request("0", prompts[pending.pop(0)], params(0))
    while engine.has_unfinished() or pending:
        if pending and not engine.seqs.get("0") and step % 2 == 0:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params(i))
        for out in engine.step():
            tokens[int(out.request_id)] += out.new_token_ids
            logprobs[int(out.request_id)] += out.logprobs or []
        engine.check_integrity()
        step += 1
        if step > 5_000:
            raise RuntimeError("the engine did not finish")
    return [tokens[i] for i in range(len(prompts))], [logprobs[i] for i in range(len(prompts))]


def check(path: Path, family: str, kind: str, seed: int = 0) -> Row:
    """Serve the model at `path` with the engine and compare with mlx-lm: one table row."""
    from mlx_lm.utils import load

    try:
        try:
            engine = Engine.from_pretrained(path, ENGINE)
        except UnsupportedModel as e:
            return Row(family, kind, "refused: " + str(e).splitlines()[0].split(". ")[0])
        model, _ = load(str(path))
        prompts = prompts_for(seed, text_args(model).vocab_size)
        max_tokens = [6 + (3 * i) % 7 for i in range(len(prompts))]
        got, got_lp = serve(engine, prompts, max_tokens)
        problems = []
        if engine.stats.num_preemptions == 0:
            problems.append("no preemption (the pool was meant to be too small)")
        if engine.state_slots is not None:  # a hybrid: prefix caching off, every prompt computed whole
            if engine.stats.prefix_hits:
                problems.append(f"a prefix hit of {engine.stats.prefix_hits} tokens with recurrent layers")
        elif engine.stats.prefix_hits < SHARED:
            problems.append(f"prefix hit of {engine.stats.prefix_hits} tokens, not {SHARED}")
        for i, prompt in enumerate(prompts):
            want, want_lp = oracle(model, prompt, max_tokens[i])
            if got[i] != want:
                at = next(j for j, (a, b) in enumerate(zip(got[i] + [None] * len(want), want)) if a != b)
                problems.append(f"prompt {i} ({len(prompt)} tokens): token {at} is {got[i][at:at + 1]}, mlx-lm "
                                f"{want[at]} (engine {got[i]}, mlx-lm {want})")
                break
            err = max(abs(a - b) for a, b in zip(got_lp[i], want_lp))
            if err >= 1e-4:
                problems.append(f"prompt {i}: logprobs differ by {err:.2e}")
                break
        return Row(family, kind, "exact" if not problems else "MISMATCH: " + "; ".join(problems))
    except Exception as e:  # a failure of this row; the others still run
        return Row(family, kind, f"ERROR: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def quantize(src: Path, dst: Path, args: dict) -> Path:
    from mlx_lm import convert

    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout is the table
        convert(str(src), mlx_path=str(dst), quantize=True, **args)
    return dst


def run(families: list[str], root: Path, out=print) -> list[Row]:
    rows = []
    out("| family | kind | engine vs mlx-lm |")
    out("| --- | --- | --- |")
    for family in families:
        path = root / family
        if not (path / "model.safetensors").exists():
            create_model(path, family, "tiny", seed=0)
        rows.append(check(path, family, KIND.get(family, "")))
        out(f"| {rows[-1].family} | {rows[-1].kind} | {rows[-1].result} |")
    for family, label, args in QUANTIZED:
        if family not in families:
            continue
        name = f"{family} {label}"
        path = root / name.replace(" ", "-")
        try:
            if not (path / "model.safetensors").exists():
                quantize(root / family, path, args)
            rows.append(check(path, name, "quantized"))
        except Exception as e:
            rows.append(Row(name, "quantized", f"ERROR: {type(e).__name__}: {e}"))
        out(f"| {rows[-1].family} | {rows[-1].kind} | {rows[-1].result} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", help="comma-separated families (default: all of " + ", ".join(ARCHS) + ")")
    ap.add_argument("--out", help="keep the models here (default: a temporary directory)")
    args = ap.parse_args(argv)
    families = args.families.split(",") if args.families else list(ARCHS)
    unknown = [f for f in families if f not in ARCHS]
    if unknown:
        ap.error(f"unknown families {unknown}: choose from {', '.join(ARCHS)}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        rows = run(families, root, out=lambda line: print(line, flush=True))
    failed = [r.family for r in rows if r.failed]
    exact = sum(r.result == "exact" for r in rows)
    print(f"\n{exact} exact, {sum(r.result.startswith('refused') for r in rows)} refused, {len(failed)} failed "
          f"({time.perf_counter() - start:.0f} s)" + (f": {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
