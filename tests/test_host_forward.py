"""The host path (`cluster/worker/host_forward.py`): a llama / qwen2 / qwen3 model's small
steps on the CPU with no MLX graph. Oracles: the MLX path on the same batch (the logits
and the pool rows it writes) and mlx-lm's own generation on the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

import cluster.worker  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
from cluster.modelgen import create_model
from cluster.worker import host_forward, kernels
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.kernels import cpu
from cluster.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(mx.metal.is_available() or not cpu.available(),
                                reason="the host path serves the CPU backend with the C kernels")


@pytest.fixture(autouse=True)
def _cpu_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "_forced", "cpu")


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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_a_step_on_the_host_is_the_mlx_steps_logits_and_rows(tmp_path, arch, kv):
    """A mixed step (decode rows beside a short prefill chunk) and then a decode-only step:
    the host path's logits and K/V rows are the MLX path's, to float32 rounding (the norm
    sums in another order); its argmax is the same token."""
    path = create_model(tmp_path / arch, arch, "tiny", seed=2)
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
def test_the_engine_on_the_host_path_generates_mlx_lms_tokens(tmp_path, arch, monkeypatch):
    """Greedy generation through the engine, every step on the host path (counted),
    against mlx-lm's own `generate_step` on the same weights, one prompt at a time."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    path = create_model(tmp_path / arch, arch, "tiny", seed=6)
    engine = _engine(path)
    calls = []
    real = host_forward.HostForward.forward
    monkeypatch.setattr(host_forward.HostForward, "forward", lambda self, b: calls.append(b.num_tokens) or real(self, b))
    prompts = [[(13 * i + 5 * j) % 500 + 3 for j in range(30 + 7 * i)] for i in range(3)]
    got = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert calls == [sum(map(len, prompts))] + [3] * 9  # every step: the prefill, then 3-row decodes
    model, _ = load(str(path))
    for prompt, tokens in zip(prompts, got):
        want = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=10), range(10))]
        assert tokens == want


def test_a_long_prefill_takes_blas_for_its_projections_and_c_for_a_decode_steps(tmp_path, monkeypatch):
    """On the host path a 40-token prefill step's projections go through MLX's matmul
    (BLAS) and a decode step's through the C linear; the tokens are mlx-lm's."""
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

    real_lib, host.lib = host.lib, Lib()
    monkeypatch.setattr(mx.array, "__matmul__", lambda a, b: blas_rows.append(a.shape[0]) or mx.matmul(a, b))
    prompt = [(3 * j) % 400 + 5 for j in range(40)]
    got = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert set(blas_rows) == {40} and 1 in c_rows and max(c_rows) < 32
    model, _ = load(str(path))
    assert got == [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=4), range(4))]


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
