"""The host path (`cluster/worker/host_forward.py`): a llama / qwen2 / qwen3 model's small
steps on the CPU with no MLX graph. Oracles: the MLX path on the same batch (the logits
and the pool rows it writes) and mlx-lm's own generation on the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlx.core as mx
from cluster.modelgen import create_model
from cluster.worker import host_forward, kernels
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.kernels import cpu
from cluster.worker.sampling_params import SamplingParams
from test_engine import collect

pytestmark = pytest.mark.skipif(mx.metal.is_available() or not cpu.available(),
                                reason="the host path serves the CPU backend with the C kernels")


@pytest.fixture(autouse=True)
def _cpu_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "_forced", "cpu")


def _model(tmp_path, arch: str, seed: int, monkeypatch=None, **overrides):
    """A tiny random model of `arch` (config `overrides` applied) whose norm weights and
    biases are random too: modelgen makes them ones and zeros, which would hide a norm or
    bias taken from the wrong place."""
    from cluster import modelgen

    if overrides:
        real = modelgen.model_config
        monkeypatch.setattr(modelgen, "model_config", lambda *a, **k: {**real(*a, **k), **overrides})
    path = create_model(tmp_path / arch, arch, "tiny", seed=seed)
    weights = mx.load(str(path / "model.safetensors"))
    for i, (name, w) in enumerate(sorted(weights.items())):
        noise = mx.random.normal(w.shape, key=mx.random.key(seed * 1000 + i))
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.2 * noise
        elif name.endswith(".bias"):
            weights[name] = 0.1 * noise
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def _engine(path, **config) -> Engine:
    return Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, block_size=8, **config))


def _step_both_ways(engine: Engine):
    """One engine step whose batch runs through the host path and the MLX path (the
    second rewrites the same pool rows: a step's K/V writes are idempotent): each one's
    logits and the rows it wrote. The step goes on with the host path's logits."""
    runner, out = engine.runner, {}
    host = runner.host

    def both(batch):
        slots = np.asarray(batch.slot_mapping)
        for name, path in (("mlx", None), ("host", host)):
            runner.host = path
            logits = type(runner).forward(runner, batch)
            out[name] = (np.asarray(logits), [np.asarray(p.astype(mx.float32))[slots] for p in runner.pool_arrays()])
        return logits

    runner.forward, runner.host = both, None
    try:
        engine.step()
    finally:
        del runner.forward
        runner.host = host
    return out


BIASES = {"llama": dict(attention_bias=True, mlp_bias=True)}  # (qwen2 has q/k/v biases of its own)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_a_step_on_the_host_is_the_mlx_steps_logits_and_rows(tmp_path, arch, kv, monkeypatch):
    """A mixed step (decode rows beside a short prefill chunk) and then a decode-only step:
    the host path's logits and K/V rows are the MLX path's, to float32 rounding (the norm
    sums in another order); its argmax is the same token."""
    path = _model(tmp_path, arch, 2, monkeypatch, **BIASES.get(arch, {}))
    engine = _engine(path, kv_cache_dtype=kv)
    assert engine.runner.host is not None
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"a{i}", [(11 * i + 7 * j) % 500 + 3 for j in range(20 + 9 * i)], params)
    for _ in range(3):  # prefill them, one decode step
        engine.step()
    engine.add_request("late", [(5 * j) % 400 + 9 for j in range(12)], params)  # a chunk beside the decode rows
    for step in ("mixed", "decode"):
        runs = _step_both_ways(engine)
        (lh, ph), (lm, pm) = runs["host"], runs["mlx"]
        assert lh.shape == lm.shape and lh.shape[0] >= 3
        # float16 pools: a K element a last bit apart in float32 may round to the next
        # float16 (1e-3 relative), and the step's attention reads it back
        tol = 1e-4 if kv == "float32" else 2e-2
        np.testing.assert_allclose(lh, lm, rtol=tol, atol=tol, err_msg=step)
        assert (lh.argmax(-1) == lm.argmax(-1)).all(), step
        tol = 1e-5 if kv == "float32" else 2e-3
        for a, b in zip(ph, pm):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=step)
    assert engine.runner.host is not None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("n", [3, 6])
def test_the_engine_on_the_host_path_generates_mlx_lms_tokens(tmp_path, arch, n, monkeypatch):
    """Greedy generation through the engine, every step on the host path (counted),
    against mlx-lm's own `generate_step` on the same weights, one prompt at a time."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    path = _model(tmp_path, arch, 6, monkeypatch, **BIASES.get(arch, {}))
    engine = _engine(path)
    calls = []
    real = host_forward.HostForward.forward
    monkeypatch.setattr(host_forward.HostForward, "forward",
                        lambda self, b: calls.append(b.num_tokens) or real(self, b))
    # 3 prompts: decode steps of 3 rows (the C linear's dot kernel); 6: of 6 (its broadcast kernel)
    prompts = [[(13 * i + 5 * j) % 500 + 3 for j in range(30 + 7 * i)] for i in range(n)]
    got = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert calls == [sum(map(len, prompts))] + [n] * 9  # every step: the prefill, then n-row decodes
    model, _ = load(str(path))
    for prompt, tokens in zip(prompts, got):
        want = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=10), range(10))]
        assert tokens == want


@pytest.mark.parametrize("blas", ["openblas", "mlx"])
def test_a_long_prefill_takes_blas_for_its_projections_and_c_for_a_decode_steps(tmp_path, monkeypatch, blas):
    """On the host path a 60-token prefill step's projections go through BLAS (OpenBLAS
    called from the step's thread; MLX's matmul where no OpenBLAS is loaded) and a decode
    step's through the C linear; the tokens are mlx-lm's."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    path = create_model(tmp_path / "m", "qwen3", "tiny", seed=1)
    engine = _engine(path)
    c_rows, blas_rows = [], []
    real_c = engine.runner.host.lib.orch_linear_f32
    host = engine.runner.host

    class Lib:  # the C library, its linear counted
        def __getattr__(self, name):
            return getattr(real_lib, name)

        def orch_linear_f32(self, x, M, *rest):
            c_rows.append(M)
            return real_c(x, M, *rest)

        def orch_sgemm_nt(self, gemm, x, M, *rest):
            blas_rows.append(M)
            return real_lib.orch_sgemm_nt(gemm, x, M, *rest)

    real_lib, host.lib = host.lib, Lib()
    if blas == "openblas":
        assert host.gemm is not None, "no OpenBLAS loaded on this Linux (see cluster/platform.py)"
    else:
        host.gemm = None
        monkeypatch.setattr(mx.array, "__matmul__", lambda a, b: blas_rows.append(a.shape[0]) or mx.matmul(a, b))
    prompt = [(3 * j) % 400 + 5 for j in range(60)]
    got = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert set(blas_rows) == {60} and 1 in c_rows and max(c_rows) < 48
    model, _ = load(str(path))
    assert got == [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=4), range(4))]


@pytest.mark.parametrize("rows, n, k", [(48, 96, 64), (61, 200, 72), (512, 64, 32), (112, 1536, 576),
                                         (96, 49152, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_host_paths_blas_product_is_mlxs_to_float32_rounding(rows, n, k, bias):
    """OpenBLAS on slices of the output columns, one per thread, gives nn.Linear's product
    through MLX (`x @ w.T`, or `mx.addmm` with a bias) to float32 rounding: both within the
    bound of a float32 dot product of k terms from the exact (float64) product."""
    gemm = host_forward.blas_gemm()
    assert gemm is not None, "no OpenBLAS loaded on this Linux (see cluster/platform.py)"
    keys = mx.random.split(mx.random.key(rows + n), 3)
    x = mx.random.normal((rows, k), key=keys[0])
    w = mx.random.normal((n, k), key=keys[1])
    b = mx.random.normal((n,), key=keys[2]) if bias else None
    mlx = np.array(mx.addmm(b, x, w.T) if bias else x @ w.T)
    xh, wh, bh = np.array(x), np.array(w), None if b is None else np.array(b)
    lin = host_forward._Weights(wh, bh, w, b)
    host = host_forward.HostForward.__new__(host_forward.HostForward)
    host.gemm, host.lib = gemm, cpu.load()
    got = host._blas(xh, lin)
    exact = xh.astype(np.float64) @ wh.T.astype(np.float64) + (0 if bh is None else bh)
    bound = (k + 1) * np.finfo(np.float32).eps * (np.abs(xh) @ np.abs(wh).T + (0 if bh is None else np.abs(bh)))
    assert got.shape == mlx.shape == (rows, n)
    assert (np.abs(got - exact) <= bound).all() and (np.abs(mlx - exact) <= bound).all()
    assert np.abs(got - mlx).max() < 1e-3 * np.abs(exact).max()


@pytest.mark.parametrize("arch, config, why", [
    ("gemma2", {}, "not one of mlx-lm's llama, qwen2, qwen3 models"),
    ("qwen3", {"kv_cache_dtype": "bfloat16"}, "KV pool mlx.core.bfloat16"),
])
def test_what_the_host_path_does_not_know_keeps_the_mlx_path(tmp_path, arch, config, why, caplog):
    """Another family, or a pool it does not write, is served by the MLX path, and the log
    says why."""
    with caplog.at_level("INFO", logger="cluster.worker.host_forward"):
        engine = _engine(create_model(tmp_path / arch, arch, "tiny", seed=1), **config)
    assert engine.runner.host is None
    assert why in caplog.text
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0]) == 3


def test_a_scaled_rope_keeps_the_mlx_path(tmp_path, caplog):
    """Llama 3's RoPE (a class of its own, not a plain RoPE) is not on the host path."""
    path = create_model(tmp_path / "l3", "llama", "tiny", seed=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 256}
    (path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("INFO", logger="cluster.worker.host_forward"):
        engine = _engine(path)
    assert engine.runner.host is None and "not a plain RoPE" in caplog.text


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_quantized_half_precision_model_on_the_host_path_is_the_mlx_paths(tmp_path, arch, dtype, monkeypatch):
    """The models people download: 4-bit, norms (and biases) kept in float16 or bfloat16 by
    the checkpoint. Dequantized on the CPU and served on the host path, its half-precision
    weights widened to float32 as MLX widens them: the MLX path's tokens and logprobs (that
    path is checked against mlx-lm on quantized models in test_engine.py; mlx-lm's own
    quantized matmul on half-precision scales rounds apart from any float32 computation)."""
    from mlx_lm import convert

    q = tmp_path / "q"
    convert(str(_model(tmp_path, arch, 4, monkeypatch, **BIASES.get(arch, {}))), mlx_path=str(q), quantize=True,
            q_bits=4, q_group_size=64, dtype=dtype)
    prompts = [[(13 * i + 5 * j) % 500 + 3 for j in range(30 + 7 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    runs = []
    for host in (True, False):
        engine = _engine(q)
        assert engine.runner.model.model.norm.weight.dtype == getattr(mx, dtype)  # what the widening is for
        assert engine.runner.host is not None
        if not host:
            engine.runner.host = None
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        runs.append(collect(engine))
    for i in range(len(prompts)):
        assert runs[0][str(i)][0] == runs[1][str(i)][0]
        np.testing.assert_allclose(runs[0][str(i)][1], runs[1][str(i)][1], rtol=1e-4, atol=1e-4)


def test_heads_beyond_the_c_attention_keep_the_mlx_path(tmp_path, monkeypatch, caplog):
    """64 query heads on one KV head is a group larger than the C attention takes: the model
    keeps the MLX path (whose dispatcher gives such a layer the reference attention) and is
    served, mlx-lm's tokens."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    path = _model(tmp_path, "llama", 3, monkeypatch, num_attention_heads=64, num_key_value_heads=1, head_dim=16)
    with caplog.at_level("INFO", logger="cluster.worker.host_forward"):
        engine = _engine(path)
    assert engine.runner.host is None and "beyond the C attention kernel" in caplog.text
    prompt = [(7 * j) % 300 + 4 for j in range(20)]
    got = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    model, _ = load(str(path))
    assert got == [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=5), range(5))]


def test_a_batch_outside_the_pool_is_an_error_and_writes_nothing(tmp_path):
    """The C kernels trust their indices; the host path checks a step's before it writes:
    a slot past the pool is a ValueError and the pools are as they were."""
    import dataclasses

    engine = _engine(create_model(tmp_path / "m", "qwen3", "tiny", seed=1))
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    runner = engine.runner
    batch = runner.prepare(engine.scheduler.schedule())
    before = [np.asarray(p).copy() for p in runner.pool_arrays()]
    bad = dataclasses.replace(batch, slot_mapping=mx.array([0, 1, 2, 3, runner.num_blocks * runner.block_size],
                                                           dtype=mx.int32))
    with pytest.raises(ValueError, match="slots outside the pool"):
        runner.forward(bad)
    for a, b in zip(before, runner.pool_arrays()):
        np.testing.assert_array_equal(a, np.asarray(b))
