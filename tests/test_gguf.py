"""GGUF import (cluster/gguf.py): exact dequantization against the gguf package (llama.cpp's
own), each architecture written as llama.cpp's converter writes it and read back to the same
weights and logits, tokenizers against their originals, Ollama's blob layout, refusals."""

from __future__ import annotations

import io
import math
import json
import random

import mlx.core as mx
import numpy as np
import pytest

import gguf
from cluster import gguf as og
from cluster.modelgen import create_model, synthetic_corpus
from gguf_export import export, weights_of

QT = gguf.GGMLQuantizationType


def random_blocks(type_name: str, n: int, seed: int) -> np.ndarray:
    """Random valid blocks: random bytes with every float16 field a finite, moderate value."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[QT[type_name]][1]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    halves = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0], "IQ4_XS": [0], "TQ2_0": [64],
              "Q8_1": [0, 2]}
    for off in halves.get(type_name, []):
        vals = (rng.standard_normal(n) * 0.02).astype(np.float16)
        vals[::7] = np.float16(6.1e-6)  # a subnormal now and then
        b[:, off:off + 2] = vals.view(np.uint8).reshape(n, 2)
    if type_name == "MXFP4":
        b[:, 0] = rng.integers(100, 150, size=n)  # e8m0 exponents of real weights
    return b


def mlx_dequantize(parts: dict, spec: og.Affine) -> np.ndarray:
    return np.array(mx.dequantize(mx.array(parts["weight"]), mx.array(parts["scales"]),
                                  mx.array(parts["biases"]) if "biases" in parts else None,
                                  group_size=og.GROUP, bits=spec.bits, mode=spec.mode).astype(mx.float32))


@pytest.mark.parametrize("type_name", sorted(og.EXACT))
def test_exact_types_dequantize_to_the_gguf_packages_values(type_name):
    """MLX's dequantization of the converted layout equals llama.cpp's (the gguf package's)
    value for value, on random blocks and on blocks the gguf package's quantizer made."""
    block, _ = gguf.GGML_QUANT_SIZES[QT[type_name]]
    rows, cols = 6, 2 * max(block, 64)
    sources = [random_blocks(type_name, rows * cols // block, seed=1)]
    try:
        w = np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32) * 0.05
        sources.append(gguf.quants.quantize(w, QT[type_name]).reshape(-1, sources[0].shape[1]))
    except NotImplementedError:  # the K-quants: the package dequantizes them only
        pass
    for blocks in sources:
        data = blocks.reshape(rows, -1)
        want = og.dequantize(type_name, data, (rows, cols))
        parts = og.to_mlx_quantized(type_name, data, cols)
        if og.EXACT[type_name].mode == "affine":
            assert parts["scales"].dtype == parts["biases"].dtype == np.float32  # so MLX computes in float32
        got = mlx_dequantize(parts, og.EXACT[type_name])
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(got, want)  # exact (+0 and -0 compare equal)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_pack_is_mlx_layout(bits):
    q = np.random.default_rng(bits).integers(0, 2**bits, size=(3, 64)).astype(np.uint8)
    got = mx.dequantize(mx.array(og.pack(q, bits)), mx.ones((3, 2)), mx.zeros((3, 2)), group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(got), q)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-src")
    return {arch: create_model(root / arch, arch, "tiny", seed=3) for arch in og_archs()}


def og_archs():
    return ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]


def _logits(path, ids):
    from mlx_lm.utils import load

    model, _ = load(str(path))
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_an_import_is_sharded_by_layer_with_an_index_so_a_pipeline_rank_reads_only_its_layers(tmp_path):
    """Shards as Hugging Face names them, the index mapping every tensor to the one that
    holds it: the embedding's, one for each layer holding exactly that layer's tensors, the
    final norm's and head's; a pipeline stage's files are its layers' (stage.py)."""
    from cluster.worker.group.stage import local_weight_files
    from cluster.worker.model_runner import Stage

    src = create_model(tmp_path / "src", "llama", "tiny", seed=3, layers=4)
    dst = og.import_gguf(export(src, tmp_path / "m.gguf", quantize={"blk.0.attn_q.weight": "Q8_0"}), tmp_path / "i")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    files = sorted({f for f in weight_map.values()})
    num_layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    assert files == [f"model-{i:05d}-of-{num_layers + 2:05d}.safetensors" for i in range(1, num_layers + 3)]
    assert sorted(p.name for p in dst.glob("*.safetensors")) == files
    for f in files:  # each shard holds what the index says, nothing else
        assert set(mx.load(str(dst / f))) == {name for name, g in weight_map.items() if g == f}
    assert index["metadata"]["total_size"] == sum((dst / f).stat().st_size for f in files) - sum(
        8 + int.from_bytes((dst / f).read_bytes()[:8], "little") for f in files)
    assert weight_map["model.embed_tokens.weight"] == files[0]
    assert {weight_map[n] for n in weight_map if "layers." not in n and "embed" not in n} == {files[-1]}
    for layer in range(num_layers):
        mine = {f for n, f in weight_map.items() if og.layer_of(n) == layer}
        assert mine == {files[1 + layer]}, layer
    assert weight_map["model.layers.0.self_attn.q_proj.scales"] == files[1]  # a quantized layer's parts together
    assert num_layers == 4
    assert local_weight_files(dst, Stage(range(0, 2), embeds=True, heads=False)) == files[:3]
    assert local_weight_files(dst, Stage(range(2, 3), embeds=False, heads=False)) == [files[3]]


@pytest.mark.parametrize("arch", og_archs())
def test_each_architecture_reads_back_to_the_same_model(arch, tiny_models, tmp_path):
    """An mlx-lm model written as llama.cpp's converter does (names, Q/K permutation, Gemma's
    norms) imports to the same weights, so mlx-lm computes the same logits; the tokenizer
    encodes as the original and the chat template renders the same."""
    from transformers import AutoTokenizer

    src = tiny_models[arch]
    dst = og.import_gguf(export(src, tmp_path / "m.gguf"), tmp_path / "imported")
    want, got = weights_of(src), weights_of(dst)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(np.array(got[name]), np.array(want[name].astype(mx.float32)), err_msg=name)
    ids = list(range(3, 40))
    np.testing.assert_array_equal(_logits(dst, ids), _logits(src, ids))
    t0, t1 = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(str(dst))
    text = "The orchard is quiet, numbers 1234 and 3.14! Caf\u00e9 \u4f60\u597d \U0001f34e\n\n  spaces"
    assert t1.encode(text) == t0.encode(text)
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "2+2?"}]
    assert (t1.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            == t0.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    def ids_of(v):
        return {v} if isinstance(v, int) else set(v)

    assert ids_of(json.loads((src / "config.json").read_text())["eos_token_id"]) <= ids_of(
        json.loads((dst / "generation_config.json").read_text())["eos_token_id"])


@pytest.mark.parametrize("k_types", [("Q4_K", "Q5_K"), ("Q6_K", "Q4_K")])
def test_quantized_tensors_stay_quantized_and_equal_llama_cpps_values(tiny_models, tmp_path, k_types):
    """Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 (quantized by the gguf package) and Q4_K / Q5_K
    (random blocks) load as MLX quantized layers whose weights are llama.cpp's values; a Q6_K
    tensor (16-weight groups) is dequantized to float32, also to llama.cpp's values."""
    from mlx_lm.utils import load

    src = tiny_models["llama"]
    rows = 128  # ffn_down: 256 inputs, one K-quant super-block per row
    raw = {f"blk.{i}.ffn_down.weight": (k, random_blocks(k, rows, 5 + i).reshape(rows, -1))
           for i, k in enumerate(k_types)}
    quant = {r"blk\.0\.attn_q\.weight": "Q8_0", r"blk\.0\.attn_k\.weight": "Q4_0", r"blk\.0\.ffn_gate\.weight": "Q4_1",
             r"blk\.1\.attn_v\.weight": "Q5_0", r"blk\.1\.attn_output\.weight": "Q5_1", "token_embd.weight": "Q8_0"}
    path = export(src, tmp_path / "q.gguf", quantize=quant, raw=raw)
    dst = og.import_gguf(path, tmp_path / "imported")
    reader = gguf.GGUFReader(str(path))
    model, _ = load(str(dst))
    modules = dict(model.named_modules())
    heads = {"attn_q": 4, "attn_k": 2}
    checked = set()
    for t in reader.tensors:
        if t.tensor_type.name in ("F32",):
            continue
        name = og.hf_name(t.name, og.ARCHS["llama"])[: -len(".weight")]
        m = modules[name]
        shape = tuple(reversed(t.shape.tolist()))
        want = og.dequantize(t.tensor_type.name, np.asarray(t.data), shape)
        kind = t.name.split(".")[-2]
        if kind in heads:
            want = og.unpermute(want, heads[kind])
        if t.tensor_type.name == "Q6_K":
            assert not hasattr(m, "scales") and m.weight.dtype == mx.float32
            got = np.array(m.weight)
        else:
            assert m.bits == og.EXACT[t.tensor_type.name].bits and m.group_size == 32, name
            got = np.array(mx.dequantize(m.weight, m.scales, m.biases, group_size=32, bits=m.bits))
        np.testing.assert_array_equal(got, want, err_msg=t.name)
        checked.add(t.tensor_type.name)
    assert checked == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *k_types}
    summary = json.loads((dst / "gguf_import.json").read_text())["types"]
    assert summary["Q4_K"]["as"] == "quantized"
    assert summary.get("Q6_K", {"as": "dequantized"})["as"] == "dequantized"


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "TQ2_0"])
def test_types_mlx_cannot_hold_are_dequantized_to_llama_cpps_values(tiny_models, tmp_path, type_name):
    from mlx_lm.utils import load

    block = gguf.GGML_QUANT_SIZES[QT[type_name]][0]
    blocks = random_blocks(type_name, 128 * 256 // block, 8).reshape(128, -1)
    path = export(tiny_models["llama"], tmp_path / "q.gguf", raw={"blk.0.ffn_down.weight": (type_name, blocks)})
    dst = og.import_gguf(path, tmp_path / "imported")
    want = og.dequantize(type_name, blocks, (128, 256))
    assert np.isfinite(want).all()
    model, _ = load(str(dst))
    np.testing.assert_array_equal(np.array(model.model.layers[0].mlp.down_proj.weight), want)
    assert json.loads((dst / "gguf_import.json").read_text())["types"][type_name]["as"] == "dequantized"


def test_a_type_the_gguf_package_cannot_read_is_refused_by_name(tiny_models, tmp_path):
    blocks = random_blocks("Q8_1", 128 * 256 // 32, 9).reshape(128, -1)
    path = export(tiny_models["llama"], tmp_path / "q.gguf", raw={"blk.0.ffn_down.weight": ("Q8_1", blocks)})
    with pytest.raises(og.GGUFError, match="Q8_1"):
        og.import_gguf(path, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_cpu_dequantization_equals_llama_cpps(tiny_models, tmp_path):
    """On the CPU the worker dequantizes quantized layers at load: the float32 weights it
    serves are llama.cpp's dequantized values."""
    from cluster.worker.model_runner import load_model

    src = tiny_models["qwen3"]
    path = export(src, tmp_path / "q.gguf", quantize={r"blk\.\d+\.ffn_(up|gate)\.weight": "Q4_1",
                                                      r"blk\.\d+\.attn_v\.weight": "Q8_0"})
    model, _ = load_model(og.import_gguf(path, tmp_path / "imported"), cpu_dequantize="yes")
    modules = dict(model.named_modules())
    n = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type.name in ("Q4_1", "Q8_0"):
            m = modules[og.hf_name(t.name, og.ARCHS["qwen3"])[: -len(".weight")]]
            assert not hasattr(m, "scales")
            want = og.dequantize(t.tensor_type.name, np.asarray(t.data), tuple(reversed(t.shape.tolist())))
            np.testing.assert_array_equal(np.array(m.weight), want)
            n += 1
    assert n == 3 * 2


def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path):
    """A SentencePiece BPE vocabulary (tokens, scores, types, byte fallback) as llama.cpp's
    converter stores it becomes a tokenizer that encodes as sentencepiece itself does."""
    import sentencepiece as spm

    model = io.BytesIO()
    lines = synthetic_corpus(4, num_words=20_000)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, model_type="bpe",
                                   vocab_size=700, byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, character_coverage=0.9995, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i)
             else 1 for i in range(sp.vocab_size())]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.vocab_size())],
          "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.vocab_size())],
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": sp.bos_id(),
          "tokenizer.ggml.eos_token_id": sp.eos_id(), "tokenizer.ggml.unknown_token_id": sp.unk_id()}
    vocab = og.vocab_of(md)
    assert vocab.add_bos  # llama.cpp's default for SentencePiece
    tok = og.build_tokenizer(md, vocab)
    rng = random.Random(0)
    texts = [rng.choice(lines).strip() for _ in range(30)] + [
        "Hello  world", " leading space", "tabs\tand\nnewlines", "Caf\u00e9 \u4f60\u597d \U0001f34e", "1234567", ""]
    for text in texts:
        assert tok.encode(text).ids == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text, text


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(og.GGUFError, match="'falcon' is not supported"):
        og.import_gguf(tmp_path / "f.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(og.GGUFError, match="not a GGUF"):
        (tmp_path / "junk.gguf").write_bytes(b"nope" * 10)
        og.import_gguf(tmp_path / "junk.gguf", tmp_path / "out")


def test_unknown_pre_tokenizer_is_refused_by_name(tiny_models, tmp_path):
    path = export(tiny_models["qwen3"], tmp_path / "m.gguf", pre="made-up-pre")
    with pytest.raises(og.GGUFError, match="'made-up-pre'"):
        og.import_gguf(path, tmp_path / "out")


def test_resolve_finds_files_directories_and_ollama_blobs(tiny_models, tmp_path, monkeypatch):
    from cluster.models_cache import resolve_model

    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "home"))
    path = export(tiny_models["qwen3"], tmp_path / "q.gguf")
    imported = resolve_model(str(path))
    assert (imported / "config.json").exists() and imported.parents[2] == tmp_path / "home" / "models"
    assert imported.name == "q"  # the name the worker serves it as
    assert resolve_model(str(path)) == imported  # cached: the same directory, not imported again
    # a directory holding one GGUF file; two need --gguf-file
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.gguf").write_bytes(path.read_bytes())
    assert (resolve_model(str(d)) / "config.json").exists()
    (d / "b.gguf").write_bytes(path.read_bytes())
    with pytest.raises(SystemExit, match="--gguf-file"):
        resolve_model(str(d))
    assert (resolve_model(str(d), gguf_file="b.gguf") / "config.json").exists()
    # Ollama: manifests/registry.ollama.ai/library/NAME/TAG names the model layer's blob
    models = tmp_path / "ollama"
    digest = "sha256:" + "ab" * 32
    (models / "blobs").mkdir(parents=True)
    (models / "blobs" / digest.replace(":", "-")).write_bytes(path.read_bytes())
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q4"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    from_ollama = resolve_model("ollama:tiny:q4")
    assert (from_ollama / "config.json").exists() and from_ollama.name == "tiny:q4"
    with pytest.raises(SystemExit, match="ollama pull tiny:latest"):
        resolve_model("ollama:tiny")


def test_orchard_model_import(tiny_models, tmp_path, capsys):
    from cluster.cli import main

    path = export(tiny_models["gemma2"], tmp_path / "g.gguf")
    assert main(["model", "import", str(path), str(tmp_path / "out")]) == 0
    assert "gemma2" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gemma2"


@pytest.mark.parametrize("factor,dim,old", [(8.0, 128, 8192), (32.0, 64, 8192), (16.0, 128, 4096)])
def test_llama3_rope_parameters_are_recovered_from_llama_cpps_factors(factor, dim, old):
    """llama.cpp's converter writes Llama 3.x's RoPE scaling as per-frequency factors
    (convert_hf_to_gguf.py's rope_freqs): the parameters come back from them."""
    base, low, high = 500000.0, 1.0, 4.0
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    got = og.llama3_rope_scaling(np.array(factors, np.float32).astype(np.float64), base, dim)
    assert got == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": old}
    with pytest.raises(og.GGUFError, match="rope_freqs"):
        og.llama3_rope_scaling(np.linspace(1, factor, dim // 2), base, dim)
