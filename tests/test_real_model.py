"""A real trained model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI) served by Orchard from
its GGUF file: what only a real model can show. Answers through the chat API, the chat
template rendered as the model's own, the prompt's perplexity through echo logprobs against
mlx-lm (and far below chance), greedy tokens against mlx-lm on the imported directory, and
the real Q4_1 / Q8_0 blocks dequantized to llama.cpp's values."""

from __future__ import annotations

import json
import math

import gguf
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from cluster import gguf as og
from gguf_export import weights_of

PARAGRAPH = ("The city of Paris is the capital of France. It is known for its museums, its cafes and the Eiffel "
             "Tower, which was built for the World's Fair in 1889. Every year millions of people visit the city "
             "to walk along the river Seine, to see the paintings in the Louvre and to enjoy French food.")


@pytest.fixture(scope="module")
def oai(smollm2_worker):
    client = openai.OpenAI(base_url=f"http://{smollm2_worker.http}/v1", api_key="unused", max_retries=0,
                           timeout=180)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reader(smollm2_gguf):
    return gguf.GGUFReader(str(smollm2_gguf))  # (slow to open: a field per vocabulary entry)


@pytest.fixture(scope="module")
def quantized_reference(smollm2_dir):
    """mlx-lm on the imported directory, its quantized layers as they are (MLX's quantized
    matmuls are slow on a CPU: the slow tests)."""
    return load(str(smollm2_dir))


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """mlx-lm's model code on the imported directory with its quantized layers' weights
    dequantized to float32 (llama.cpp's values, `test_real_blocks_...`): fast on a CPU."""
    from cluster.worker.dequantize import maybe_dequantize

    model, tokenizer = load(str(smollm2_dir))
    assert maybe_dequantize(model, "yes") == 211
    return model, tokenizer


def chat(oai, question: str, max_tokens: int = 40) -> str:
    r = oai.chat.completions.create(model="", messages=[{"role": "user", "content": question}],
                                    max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def test_it_answers_questions_through_the_chat_api(oai):
    assert "Paris" in chat(oai, "What is the capital of France?")
    assert "4" in chat(oai, "What is 2+2?")


def test_the_chat_template_renders_as_the_models_own(smollm2_gguf, smollm2_dir, oai):
    """The template in the GGUF metadata, rendered by jinja, equals what the imported
    tokenizer renders; the worker's prompt is exactly its tokens."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    md = og.read_gguf(smollm2_gguf).metadata
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a fruit."}]
    tokens = md["tokenizer.ggml.tokens"]
    want = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        md["tokenizer.chat_template"]).render(messages=messages, add_generation_prompt=True,
                                              bos_token=tokens[md["tokenizer.ggml.bos_token_id"]],
                                              eos_token=tokens[md["tokenizer.ggml.eos_token_id"]])
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == want
    assert want.endswith("<|im_start|>assistant\n") and "<|im_start|>system\nBe brief.<|im_end|>" in want
    r = oai.chat.completions.create(model="", messages=messages, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))


def perplexity_against_mlx_lm(oai, reference) -> float:
    model, tokenizer = reference
    ids = tokenizer.encode(PARAGRAPH)
    r = oai.completions.create(model="", prompt=PARAGRAPH, max_tokens=0, echo=True, logprobs=1, temperature=0)
    got = np.array(r.choices[0].logprobs.token_logprobs[1:])
    logits = model(mx.array(ids)[None]).astype(mx.float32)[0]
    dense = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    want = dense[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert len(ids) > 50
    return math.exp(-got.mean())


def test_prompt_perplexity_matches_mlx_lm_and_is_far_below_chance(oai, reference):
    ppl = perplexity_against_mlx_lm(oai, reference)
    assert ppl < 30, ppl  # a random model scores about the vocabulary's size (49,152)


@pytest.mark.slow
def test_prompt_perplexity_matches_mlx_lm_on_the_quantized_layers(oai, quantized_reference):
    assert perplexity_against_mlx_lm(oai, quantized_reference) < 30


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]


def greedy_against_mlx_lm(worker, reference, prompts: list[str], max_tokens: int) -> None:
    from cluster.sdk import Client

    model, tokenizer = reference
    with Client(worker.grpc) as client:
        for prompt in prompts:
            ids = tokenizer.encode(prompt)
            want = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=max_tokens),
                                                 range(max_tokens))]
            got = client.generate(ids, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=180).token_ids
            assert got == want, prompt


def test_greedy_tokens_equal_mlx_lm_on_the_imported_directory(smollm2_worker, reference):
    """Orchard serving the GGUF file (dequantized to float32 on the CPU) gives mlx-lm's
    greedy tokens on the imported directory (and on its quantized layers as they are: slow)."""
    greedy_against_mlx_lm(smollm2_worker, reference, PROMPTS[::3], 16)


@pytest.mark.slow
def test_greedy_tokens_equal_mlx_lm_on_the_quantized_layers(smollm2_worker, quantized_reference):
    greedy_against_mlx_lm(smollm2_worker, quantized_reference, PROMPTS, 32)


def test_real_blocks_dequantize_to_llama_cpps_values(reader, smollm2_dir):
    weights = weights_of(smollm2_dir)
    picked = {"token_embd.weight", "blk.0.attn_q.weight", "blk.7.attn_k.weight", "blk.29.ffn_down.weight"}
    seen = set()
    for t in reader.tensors:
        if t.name not in picked:
            continue
        name = og.hf_name(t.name, og.ARCHS["llama"])[: -len(".weight")]
        rows = 4096 if t.name == "token_embd.weight" else t.shape[-1]  # (the embedding's first rows)
        want = og.dequantize(t.tensor_type.name, np.asarray(t.data)[:rows], (int(rows), int(t.shape[0])))
        if ".attn_q." in t.name or ".attn_k." in t.name:
            want = og.unpermute(want, 9 if ".attn_q." in t.name else 3)
        bits = og.EXACT[t.tensor_type.name].bits
        got = mx.dequantize(*(weights[f"{name}.{k}"][:rows] for k in ("weight", "scales", "biases")),
                            group_size=32, bits=bits)
        np.testing.assert_array_equal(np.array(got), want, err_msg=t.name)
        seen.add(t.tensor_type.name)
    assert seen == {"Q8_0", "Q4_1"}


@pytest.mark.slow
def test_orchard_model_create_real(smollm2_gguf, tmp_path, capsys):
    from cluster.cli import main

    assert main(["model", "create", str(tmp_path / "smol"), "--real", "smollm2-135m-instruct"]) == 0
    assert str(tmp_path / "smol") in capsys.readouterr().out
    cfg = json.loads((tmp_path / "smol" / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["vocab_size"]) == ("llama", 30, 49152)
