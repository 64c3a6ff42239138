"""One GGUF file, served by llama.cpp natively and by Orchard through its import: do they agree?

    .venv/bin/python load/gguf_vs_llamacpp.py                       # SmolLM2-135M-Instruct (Q4_1), 20 prompts
    .venv/bin/python load/gguf_vs_llamacpp.py --gguf FILE.gguf --max-tokens 64
    .venv/bin/python load/gguf_vs_llamacpp.py --float32-twin        # + the same weights dequantized, f32 KV
    .venv/bin/python load/gguf_vs_llamacpp.py --quantize            # llama-quantize's types, loaded exactly?

Tokens (default): llama-server (built by bench_vs_llamacpp.py's machinery, once) and an
`orchard worker serve --model FILE.gguf` run side by side. For each of 20 prompts (chat
questions rendered with the model's template, and plain text), the prompt is tokenized by
both (llama-server's /tokenize against Orchard's tokenizer: they must agree), then both
generate greedily from llama.cpp's token ids until an end-of-generation token or the
limit (EOS is not ignored: llama.cpp ignores it by masking those tokens out, which changes
its choices and its top logprobs, while Orchard only keeps going). Printed per prompt: the
tokens that match before the first divergence, and there llama.cpp's margin between its
top two logprobs. llama.cpp multiplies Q4_1 weights by activations quantized to 8 bits
(Orchard computes in float32 on the dequantized weights), so a divergence at a near-tie
is expected; one at a margin above 0.1 would be a bug.

--float32-twin separates llama.cpp's arithmetic from the import: llama.cpp dequantizes the
file itself (`llama-quantize --allow-requantize FILE TWIN F32`), every tensor of that twin
is checked equal to the weights Orchard's import serves (mx.dequantize of its MLX layers),
and llama-server serves the twin with a float32 KV cache and no flash attention: no
activation is quantized on either side, so the tokens should agree to the end but for
float32 ties.

--quantize: an `orchard model create` model (llama, small) written as a float32 GGUF
(the same layout llama.cpp's converter writes: tests/gguf_export.py), then `llama-quantize
--pure` to Q8_0, Q4_0, Q4_1, Q4_K and Q5_K. Each file is imported and every quantized
tensor's MLX dequantization compared with the gguf package's (llama.cpp's) values, exactly;
then the tokens comparison above runs on each file with a few prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests")]

from bench_vs_llamacpp import CACHE, LLAMA_CPP_PYTHON, CannotBuild, llama_server, start_llama  # noqa: E402
from _common import start_orchard  # noqa: E402

QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Name three colors of the rainbow.",
             "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "How many legs does a spider have?",
             "Give me a synonym for happy.", "What is the boiling point of water in Celsius?",
             "Translate 'good morning' into Spanish.", "What is the largest planet in our solar system?"]
TEXTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
         "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "The three laws of thermodynamics are", "In 1969, the first humans landed on",
         "Photosynthesis is the process by which", "A recipe for pancakes: first, mix",
         "The quick brown fox jumps over the lazy dog. Then", "import numpy as np\n\nx = np.arange(10)\n",
         "Dear Sir or Madam, I am writing to"]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_tokens(url: str, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy tokens from `ids`, and at each its margin between the top two logprobs."""
    r = post(f"{url}/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "n_probs": 2,
                                   "cache_prompt": False, "post_sampling_probs": False})
    probs = r["completion_probabilities"]
    toks = [p["id"] for p in probs]
    margins = [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"] for p in probs]
    return toks, margins


def compare(gguf: Path, prompts: int, max_tokens: int, binary: Path, llama_args: list[str] = ()) -> list[tuple]:
    from transformers import AutoTokenizer

    from cluster.models_cache import resolve_model
    from cluster.sdk import Client

    model_dir = resolve_model(str(gguf))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             if tok.chat_template else q for q in QUESTIONS] + TEXTS
    texts = (texts * (prompts // len(texts) + 1))[:prompts]
    llama, url = start_llama(binary, gguf, 1, 4096, list(llama_args))
    orchard, _, info = start_orchard(gguf, ["--max-model-len", "4096"])
    rows = []
    eog = set(json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id") or [])
    try:
        with Client(info["grpc"]) as client:
            for text in texts:
                ids = post(f"{url}/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
                ours = tok.encode(text, add_special_tokens=not text.startswith(tok.bos_token or "\0"))
                want, margins = llama_tokens(url, ids, max_tokens)
                got = client.generate(ids, max_tokens=max_tokens, temperature=0, timeout=600).token_ids
                # an end-of-generation token ends both (llama.cpp may leave it out of its list)
                want = want[: next((i + 1 for i, t in enumerate(want) if t in eog), len(want))]
                got, want = [t for t in got if t not in eog], [t for t in want if t not in eog]
                same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                margin = margins[same] if got != want and same < len(margins) else None
                rows.append((text, ours == ids, same, len(want), margin, tok.decode(want[same:same + 1]) or "(end)",
                             tok.decode(got[same:same + 1]) or "(end)", got == want))
    finally:
        orchard.stop()
        llama.stop()
    print(f"\n{gguf.name}: {len(rows)} prompts, greedy to the end or {max_tokens} tokens; llama-server "
          f"{' '.join(llama_args) or 'defaults (f16 KV cache, flash attention)'}")
    print(f"{'prompt':44} {'tokenized alike':>15} {'matched':>8} {'llama.cpp top-2 margin there':>30}")
    for text, alike, same, n, margin, a, b, equal in rows:
        where = "-" if equal else "?" if margin is None else f"{margin:.4f} ({a!r} vs ours {b!r})"
        print(f"{text.replace(chr(10), ' ')[-44:]:44} {str(alike):>15} {same:>4}/{n:<3} {where:>30}")
    full = sum(r[-1] for r in rows)
    worst = max((r[4] for r in rows if r[4] is not None), default=None)
    print(f"identical: {full}/{len(rows)}; tokenized alike: {sum(r[1] for r in rows)}/{len(rows)}; "
          f"largest margin at a divergence: {worst if worst is None else round(worst, 4)}"
          f"{'  (above 0.1: look for a bug)' if worst and worst > 0.1 else ''}")
    return rows


def float32_twin(gguf: Path, binary: Path) -> Path:
    """llama.cpp's own dequantization of the file (`llama-quantize --allow-requantize ... F32`),
    checked tensor by tensor against the weights Orchard's import serves: exactly equal."""
    import gguf as gg
    import mlx.core as mx
    import numpy as np

    from cluster import gguf as og
    from cluster.models_cache import resolve_model
    from gguf_export import weights_of

    out = CACHE / "gguf" / f"{gguf.stem}-llama.cpp-F32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(binary.parent / "llama-quantize"), "--allow-requantize", str(gguf), str(out), "F32"],
                       check=True, capture_output=True)
    src = resolve_model(str(gguf))
    cfg = json.loads((src / "config.json").read_text())
    arch = og.ARCHS[gg.GGUFReader(str(gguf)).fields["general.architecture"].contents()]
    weights = weights_of(src)
    n = bad = 0
    for t in gg.GGUFReader(str(out)).tensors:
        if t.name in ("rope_freqs.weight",):
            continue
        name = og.hf_name(t.name, arch)
        theirs = np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if arch.permuted_qk and (".attn_q." in t.name or ".attn_k." in t.name):
            theirs = og.unpermute(theirs, cfg["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"])
        base = name[: -len(".weight")]
        if base + ".scales" in weights:
            q = json.loads((src / "config.json").read_text())["quantization"][base]
            ours = mx.dequantize(weights[name], weights[base + ".scales"], weights.get(base + ".biases"),
                                 group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"))
        else:
            ours = weights[name]
        ours = np.array(ours.astype(mx.float32))
        if arch.norm_plus_one and t.name.endswith("norm.weight"):
            ours = ours + np.float32(1.0)
        n += 1
        bad += not np.array_equal(ours, theirs)
    print(f"\n{out.name}: llama.cpp's own float32 of all {n} tensors against Orchard's import: "
          f"{'all equal' if not bad else f'{bad} DIFFER'}", flush=True)
    return out


def quantize(binary: Path, tokens: int) -> int:
    import gguf
    import mlx.core as mx
    import numpy as np

    from cluster import gguf as og
    from cluster.models_cache import builtin_model
    from gguf_export import export, weights_of

    quantizer = binary.parent / "llama-quantize"
    if not quantizer.exists():
        raise CannotBuild(f"{quantizer} is missing: build it with `cmake --build {binary.parent.parent} "
                          "--target llama-quantize`")
    out = CACHE / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    src = builtin_model("llama", "small")
    f32 = export(src, out / "llama-small-seed0-f32.gguf")
    bad = 0
    for kind in ("Q8_0", "Q4_0", "Q4_1", "Q4_K_S", "Q5_K_S"):
        path = out / f"llama-small-seed0-{kind}.gguf"
        subprocess.run([str(quantizer), "--pure", str(f32), str(path), kind], check=True, capture_output=True)
        dst = og.import_gguf(path, out / f"llama-small-seed0-{kind}.mlx")
        weights = weights_of(dst)
        counts: dict[str, int] = {}
        for t in gguf.GGUFReader(str(path)).tensors:
            name = t.tensor_type.name
            if name not in og.EXACT:
                continue
            base = og.hf_name(t.name, og.ARCHS["llama"])[: -len(".weight")]
            want = og.dequantize(name, np.asarray(t.data), tuple(reversed(t.shape.tolist())))
            if ".attn_q." in t.name or ".attn_k." in t.name:
                cfg = json.loads((dst / "config.json").read_text())
                want = og.unpermute(want, cfg["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"])
            got = np.array(mx.dequantize(weights[base + ".weight"], weights[base + ".scales"],
                                         weights[base + ".biases"], group_size=32, bits=og.EXACT[name].bits))
            ok = np.array_equal(got, want)
            bad += not ok
            counts[name] = counts.get(name, 0) + 1
        summary = json.loads((dst / "gguf_import.json").read_text())["types"]
        compared = ", ".join(f"{k} x{v}" for k, v in counts.items())
        imported = ", ".join(f"{k} {v['as']}" for k, v in summary.items())
        print(f"{path.name}: {compared} compared exactly; import: {imported}", flush=True)
        compare(path, 4, tokens, binary)
    print(f"\n{'every quantized tensor equals llama.cpp dequantization' if not bad else f'{bad} tensors DIFFER'}")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quantize", action="store_true", help="llama-quantize's types on a created model instead")
    p.add_argument("--float32-twin", action="store_true",
                   help="also compare on the weights dequantized into a float32 GGUF, f32 KV cache on both")
    p.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON, help="whose vendored llama.cpp to build")
    args = p.parse_args()
    try:
        binary = llama_server(args.llama_cpp_python)
    except CannotBuild as e:
        print(f"cannot run llama-server here: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    if args.quantize:
        code = quantize(binary, args.max_tokens)
    else:
        from cluster.models_cache import real_gguf

        gguf = args.gguf or real_gguf("smollm2-135m-instruct")
        compare(gguf, args.prompts, args.max_tokens, binary)
        if args.float32_twin:
            compare(float32_twin(gguf, binary), args.prompts, args.max_tokens, binary,
                    ["--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off"])
        code = 0
    print(f"({time.monotonic() - t0:.0f} s; llama.cpp from llama-cpp-python {args.llama_cpp_python}, "
          f"{os.cpu_count()} cores)")
    return code


if __name__ == "__main__":
    sys.exit(main())
