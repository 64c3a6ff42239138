"""cluster/fleet/facts.py: a model's facts from its files alone, checked against what the
worker holds once `model_runner.load_model` loaded it (the oracle: MLX's parameters, and
the KV pools and state slots a `ModelRunner` allocates)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import platform
from cluster.fleet import facts

BLOCK = 16


def held_by_worker(path: Path) -> tuple[int, int, int]:
    """(weight bytes, KV bytes per token, recurrent state bytes per request) of the model as
    the worker loads it here."""
    from mlx.utils import tree_flatten

    from cluster.worker.model_runner import ModelRunner, load_model

    model, _ = load_model(path, cpu_dequantize="yes")
    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    runner = ModelRunner(model, num_blocks=2, block_size=BLOCK, num_state_slots=1)
    pools = {id(a): a for a in runner.k_pool + runner.v_pool if a is not None}  # an MLA layer's K and V are one
    kv_per_token = sum(a.nbytes for a in pools.values()) // (runner.num_blocks * BLOCK)
    return weights, kv_per_token, runner.state_bytes_per_slot


def here() -> str:
    return "metal" if platform.has_metal() else "cpu"


def assert_facts_are_the_workers(path: Path) -> facts.pb.DiskModel:
    disk = facts.disk_model(path, here())
    assert not disk.error
    assert (disk.weight_bytes, disk.kv_bytes_per_token, disk.state_bytes_per_seq) == held_by_worker(path)
    return disk


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Tiny models made once for this module: name -> directory."""
    from cluster.modelgen import create_model

    root = tmp_path_factory.mktemp("facts")
    return {name: create_model(root / name, arch, "tiny", kind=kind) for name, arch, kind in
            [("llama", "llama", "generate"), ("moe", "qwen3_moe", "generate"), ("emb", "qwen3", "embedding"),
             ("gemma4", "gemma4_text", "generate"), ("mla", "deepseek_v3", "generate"),
             ("hybrid", "qwen3_next", "generate"), ("helium", "helium", "generate")]}


@pytest.mark.parametrize("name", ["llama", "moe", "gemma4", "mla", "hybrid", "helium"])
def test_weights_and_kv_per_token_are_what_the_worker_holds(made, name):
    """Dense, MoE, shared K/V (Gemma 4), latent K/V (MLA), a hybrid's recurrent layers
    without K/V, and a family whose head size is not its config's head_dim (helium)."""
    disk = assert_facts_are_the_workers(made[name])
    assert disk.name == name and disk.tasks == ["generate"]
    config = json.loads((made[name] / "config.json").read_text())
    assert disk.num_layers == config["num_hidden_layers"] and disk.max_context == config["max_position_embeddings"]
    assert disk.file_bytes >= sum(f.stat().st_size for f in made[name].glob("*.safetensors"))


def test_an_embedding_model_serves_embed(made):
    assert list(assert_facts_are_the_workers(made["emb"]).tasks) == ["embed"]


def test_a_quantized_model_is_held_dequantized_on_a_cpu_and_as_stored_on_metal(made, tmp_path):
    from mlx_lm import convert

    q = tmp_path / "q4"
    convert(str(made["moe"]), mlx_path=str(q), quantize=True, q_bits=4, q_group_size=32)
    assert_facts_are_the_workers(q)
    stored = sum(t.nbytes for t in facts.checkpoint_tensors(q).values())
    assert facts.disk_model(q, "metal").weight_bytes == stored
    assert facts.disk_model(q, "cpu").weight_bytes > 4 * stored  # 4-bit -> float32


def test_mixed_bits_read_each_layers_own_group_size(made, tmp_path):
    from mlx_lm import convert

    q = tmp_path / "mixed"
    convert(str(made["llama"]), mlx_path=str(q), quantize=True, quant_predicate="mixed_3_6", q_group_size=64)
    assert facts.disk_model(q, "cpu").weight_bytes == facts.disk_model(made["llama"], "cpu").weight_bytes


def test_a_gguf_file_is_what_its_import_holds(made, tmp_path):
    from tests.gguf_export import export

    from cluster import gguf

    path = export(made["llama"], tmp_path / "m.gguf", quantize={r"blk\.0\.attn_q\.weight": "Q8_0",
                                                                 r"blk\.1\.ffn_down\.weight": "Q4_0"})
    disk = facts.disk_model(path, here())
    assert disk.name == "m.gguf" and not disk.error and disk.file_bytes == path.stat().st_size
    imported = gguf.import_gguf(path, tmp_path / "imported")
    assert (disk.weight_bytes, disk.kv_bytes_per_token, disk.state_bytes_per_seq) == held_by_worker(imported)
    assert disk.num_layers == 2 and list(disk.tasks) == ["generate"]


def test_unreadable_models_say_why_and_scan_finds_the_rest(made, tmp_path):
    import shutil

    shutil.copytree(made["llama"], tmp_path / "good")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 30)
    (tmp_path / "headerless").mkdir()
    (tmp_path / "headerless" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "headerless" / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little"))
    (tmp_path / "negative").mkdir()
    (tmp_path / "negative" / "config.json").write_text('{"model_type": "llama"}')
    header = b'{"w": {"dtype": "F32", "shape": [-4, 2], "data_offsets": [0, 0]}}'
    (tmp_path / "negative" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    found = {m.name: m for m in facts.scan(tmp_path, "cpu")}
    assert sorted(found) == ["bad.gguf", "broken", "good", "headerless", "negative"]
    assert not found["good"].error and found["good"].weight_bytes
    assert "config.json" in found["broken"].error
    assert found["bad.gguf"].error
    assert "header of 1099511627776 bytes" in found["headerless"].error
    assert "tensor w has a negative dimension (-4, 2)" in found["negative"].error
    assert facts.scan(tmp_path / "absent", "cpu") == []


def test_scan_reads_a_model_again_only_when_its_files_change(made, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(made["llama"], tmp_path / "m")
    reads = []
    real = facts.disk_model
    monkeypatch.setattr(facts, "disk_model", lambda path, p: reads.append(path) or real(path, p))
    first = facts.scan(tmp_path, "cpu")
    assert facts.scan(tmp_path, "cpu") == first and len(reads) == 1
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert facts.scan(tmp_path, "cpu")[0].max_context == 4096 and len(reads) == 2
    shutil.rmtree(tmp_path / "m")
    assert facts.scan(tmp_path, "cpu") == [] and facts._cache[(str(tmp_path), "cpu")] == {}


def test_facts_import_no_mlx(made):
    """The node agent runs without MLX: reading facts must not import it."""
    code = ("import sys; sys.modules['mlx'] = None; from cluster.fleet import facts, footprint; "
            f"m = facts.disk_model(__import__('pathlib').Path({str(made['llama'])!r}), 'cpu'); "
            "assert not m.error, m.error; print(m.weight_bytes)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == facts.disk_model(made["llama"], "cpu").weight_bytes


@pytest.mark.slow
def test_every_family_modelgen_makes_is_read_as_the_worker_holds_it(tmp_path):
    from cluster.modelgen import ARCHS, create_model

    wrong = {}
    for arch in ARCHS:
        path = create_model(tmp_path / arch, arch, "tiny")
        disk = facts.disk_model(path, here())
        got = (disk.weight_bytes, disk.kv_bytes_per_token, disk.state_bytes_per_seq)
        if disk.error or got != held_by_worker(path):
            wrong[arch] = disk.error or (got, held_by_worker(path))
    assert not wrong


def write_checkpoint(path: Path, config: dict, tensors: dict[str, tuple[str, list[int]]]) -> Path:
    """A model directory whose safetensors file is its header alone: all facts.py reads."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}
                         for name, (dtype, shape) in tensors.items()}).encode()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return path


def test_tensors_mlx_lm_drops_at_load_are_not_counted(tmp_path):
    """A tied model's stray lm_head, multi-token-prediction heads, a multimodal checkpoint's
    towers: mlx-lm's sanitize drops them, so the worker never holds them."""
    config = {"model_type": "qwen3", "tie_word_embeddings": True, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "hidden_size": 16}
    kept = {"model.embed_tokens.weight": ("BF16", [32, 16]),
            "model.layers.0.self_attn.k_proj.weight": ("BF16", [8, 16])}
    dropped = {"lm_head.weight": ("BF16", [32, 16]), "mtp.layers.0.mlp.weight": ("BF16", [16, 16]),
               "model.visual.blocks.0.attn.qkv.weight": ("BF16", [48, 16]),
               "vision_tower.encoder.layers.0.weight": ("F32", [16, 16]),
               "model.layers.0.self_attn.rotary_emb.inv_freq": ("F32", [4])}
    path = write_checkpoint(tmp_path / "m", config, {**kept, **dropped})
    assert not facts.disk_model(path, "metal").error
    assert facts.disk_model(path, "metal").weight_bytes == 2 * (32 * 16 + 8 * 16)
    assert facts.disk_model(path, "cpu").weight_bytes == 4 * (32 * 16 + 8 * 16)


def test_a_config_without_a_key_its_family_needs_says_which(tmp_path):
    config = {"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "hidden_size": 16}
    path = write_checkpoint(tmp_path / "m", config, {"model.embed_tokens.weight": ("F32", [32, 16])})
    assert facts.disk_model(path, "cpu").error == (
        "config.json has no 'linear_num_key_heads', which a qwen3_next model needs")
