"""/v1/embeddings, /v1/rerank, /v1/score, gRPC Embed / Score and the SDK, on real worker
processes and through a router, with real clients (the openai package, LangChain's
OpenAIEmbeddings), against mlx-lm's own forward on the same weights.

One embedding worker (Qwen3-Embedding's shape: last-token pooling, normalized,
Matryoshka) and one reranker worker (Qwen3-Reranker's yes/no scoring), registered with one
router; the slow tests add a llama cross-encoder worker and a generation worker serving
embeddings too (--embeddings).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.utils import load

from cluster.sdk import Client, InvalidRequest
from cluster.up import free_port
from cluster.worker.pooling import yes_no_prompt

TEXTS = ["The orchard is quiet in the morning.", "Workers pick apples from every tree",
         "and the router sends each basket to the nearest cart. " * 12, "42"]


@pytest.fixture(scope="module")
def dirs(embedding_model_dir, reranker_model_dir):
    return {"emb": embedding_model_dir, "rr": reranker_model_dir}


@pytest.fixture(scope="module")
def cls_dir(tmp_path_factory):
    from cluster.modelgen import create_model

    return create_model(tmp_path_factory.mktemp("cls") / "tiny-llama-cls", "llama", "tiny", seed=7, kind="classifier")


@pytest.fixture(scope="module")
def router():
    grpc_port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "router", "serve", "--grpc",
                             f"127.0.0.1:{grpc_port}", "--http", f"127.0.0.1:{http_port}", "--metrics", "off",
                             "--heartbeat-interval", "0.2"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    yield {"grpc": f"127.0.0.1:{grpc_port}", "http": f"127.0.0.1:{http_port}"}
    proc.terminate()
    proc.wait(20)


COMMON = ("--num-kv-blocks", "256", "--max-model-len", "512", "--max-pooling-inputs", "8",
          "--max-pooling-tokens", "3000", "--heartbeat-interval", "0.2")


def start_workers(worker_process, router, dirs: dict) -> dict:
    """Workers for `dirs` (name -> model directory and extra flags) started side by side,
    registered with the router; stopped when the caller is done with them."""
    with ThreadPoolExecutor(len(dirs)) as pool:
        futures = {k: pool.submit(worker_process, d, *COMMON, "--router", router["grpc"], *extra)
                   for k, (d, *extra) in dirs.items()}
        out = {k: f.result() for k, f in futures.items()}
    deadline = time.monotonic() + 60
    names = {d.name for d, *_ in dirs.values()}
    while time.monotonic() < deadline:  # all registered with the router
        try:
            if names <= {m["id"] for m in get(router["http"], "/v1/models")["data"]}:
                break
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    return out


@pytest.fixture(scope="module")
def workers(dirs, router, worker_process):
    """An embedding worker and a Qwen3-Reranker worker (the default run's); stopped with the
    module (idle workers heartbeating at 0.2 s would slow every later test)."""
    out = start_workers(worker_process, router, {"emb": (dirs["emb"],), "rr": (dirs["rr"],)})
    yield out
    for w in out.values():
        w.stop()


@pytest.fixture(scope="module")
def more_workers(cls_dir, router, worker_process, tiny_model_dir, workers):
    """A llama cross-encoder worker and a generation worker serving embeddings too (slow tests)."""
    out = start_workers(worker_process, router, {"cls": (cls_dir,), "gen": (tiny_model_dir, "--embeddings")})
    yield out
    for w in out.values():
        w.stop()


def get(address: str, path: str) -> dict:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as r:
        return json.loads(r.read())


def post(address: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{address}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


_models: dict = {}


def reference(path, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    """mlx-lm's forward on one input, its last token's final hidden state, truncated, normalized."""
    if path not in _models:
        _models[path] = load(str(path))
    model, _ = _models[path]
    v = np.array(model.model(mx.array([ids]))[0, -1].astype(mx.float32))[:dimensions]
    return v / np.linalg.norm(v)


def reference_score(path, query: str, document: str) -> float:
    if path not in _models:
        _models[path] = load(str(path))
    model, tok = _models[path]
    logits = np.array(model(mx.array([tok.encode(yes_no_prompt(query, document))]))[0, -1].astype(mx.float32))
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    return float(1 / (1 + np.exp(-(float(logits[yes]) - float(logits[no])))))


def tokens(path, text: str) -> list[int]:
    if path not in _models:
        _models[path] = load(str(path))
    return _models[path][1].encode(text)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("where", ["worker", "router"])
def test_openai_and_langchain_clients_get_mlx_lms_embeddings(dirs, workers, router, where):
    address = workers["emb"].http if where == "worker" else router["http"]
    model = dirs["emb"].name
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="none", max_retries=0)
    r = client.embeddings.create(model=model, input=TEXTS)  # the package asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2, 3] and r.model == model
    for d, text in zip(r.data, TEXTS):
        assert len(d.embedding) == 128
        assert cosine(d.embedding, reference(dirs["emb"], tokens(dirs["emb"], text))) > 0.9999
    assert r.usage.prompt_tokens == sum(len(tokens(dirs["emb"], t)) for t in TEXTS) == r.usage.total_tokens
    floats = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float", dimensions=32)
    assert len(floats.data) == 1 and len(floats.data[0].embedding) == 32
    assert cosine(floats.data[0].embedding, reference(dirs["emb"], tokens(dirs["emb"], TEXTS[0]), 32)) > 0.9999
    ids = [[5, 6, 7, 8], [9] * 40]
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    for d, x in zip(by_ids.data, ids):
        assert cosine(d.embedding, reference(dirs["emb"], x)) > 0.9999
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(model=model, base_url=f"http://{address}/v1", api_key="none",
                          check_embedding_ctx_length=False)  # it would tokenize with OpenAI's tiktoken otherwise
    docs = lc.embed_documents(TEXTS[:2])
    query = lc.embed_query(TEXTS[3])
    for v, text in zip([*docs, query], [*TEXTS[:2], TEXTS[3]]):
        assert cosine(v, reference(dirs["emb"], tokens(dirs["emb"], text))) > 0.9999


def test_base64_is_little_endian_float32(dirs, workers):
    status, body = post(workers["emb"].http, "/v1/embeddings", {"input": ["hello", "world"],
                                                               "encoding_format": "base64"})
    assert status == 200
    status, floats = post(workers["emb"].http, "/v1/embeddings", {"input": ["hello", "world"]})
    for b, f in zip(body["data"], floats["data"]):
        assert np.frombuffer(base64.b64decode(b["embedding"]), "<f4").tolist() == f["embedding"]


@pytest.mark.parametrize("where", ["worker", "router"])
def test_rerank_and_score_order_and_top_n(dirs, workers, router, where):
    address = workers["rr"].http if where == "worker" else router["http"]
    query = "where do apples grow?"
    docs = ["apples grow on trees in the orchard", "the router sends each basket", "42", "morning workers"]
    want = [reference_score(dirs["rr"], query, d) for d in docs]
    status, body = post(address, "/v1/rerank", {"model": dirs["rr"].name, "query": query, "documents": docs,
                                                "top_n": 3})
    assert status == 200, body
    order = sorted(range(4), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-5 and r["document"]["text"] == docs[r["index"]]
    assert body["usage"]["total_tokens"] == sum(len(tokens(dirs["rr"], yes_no_prompt(query, d))) for d in docs)
    model = dirs["rr"].name  # (the router may have two rerankers: the model says which)
    status, body = post(address, "/v1/rerank", {"model": model, "query": query,
                                                "documents": [{"text": d} for d in docs], "return_documents": False})
    assert [r["index"] for r in body["results"]] == sorted(range(4), key=lambda i: -want[i])
    assert all("document" not in r for r in body["results"])
    status, body = post(address, "/v1/score", {"model": model, "text_1": query, "text_2": docs})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert np.allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    status, body = post(address, "/v1/score", {"model": model, "text_1": [query, "x"], "text_2": docs[:2]})
    assert np.allclose([d["score"] for d in body["data"]],
                       [want[0], reference_score(dirs["rr"], "x", docs[1])], atol=1e-5)


@pytest.mark.parametrize("where", ["worker", "router"])
def test_sdk_embed_and_rerank_over_grpc(dirs, workers, router, where):
    with Client(workers["emb"].grpc if where == "worker" else router["grpc"], timeout=60) as c:
        out = c.embed(TEXTS[:2], model=dirs["emb"].name if where == "router" else "")
        assert len(out) == 2 and out.model == dirs["emb"].name
        for v, text in zip(out.vectors, TEXTS):
            assert cosine(v, reference(dirs["emb"], tokens(dirs["emb"], text))) > 0.9999
        assert out.usage.prompt_tokens == sum(len(tokens(dirs["emb"], t)) for t in TEXTS[:2])
    with Client(workers["rr"].grpc if where == "worker" else router["grpc"], timeout=60) as c:
        docs = ["apples on trees", "a basket", "numbers"]
        best = c.rerank("apples?", docs, top_n=2, model=dirs["rr"].name if where == "router" else "")
        want = [reference_score(dirs["rr"], "apples?", d) for d in docs]
        assert [b.index for b in best] == sorted(range(3), key=lambda i: -want[i])[:2]
        assert all(abs(b.score - want[b.index]) < 1e-5 and b.document == docs[b.index] for b in best)


@pytest.mark.slow
def test_a_generation_model_serves_embeddings_beside_generation(more_workers, tiny_model_dir):
    w = more_workers["gen"]
    client = openai.OpenAI(base_url=f"http://{w.http}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("length", "stop")
    r = client.embeddings.create(model=tiny_model_dir.name, input="Hello there", encoding_format="float")
    assert cosine(r.data[0].embedding, reference(tiny_model_dir, tokens(tiny_model_dir, "Hello there"))) > 0.9999
    assert get(w.http, "/v1/models")["data"][0]["tasks"] == ["generate", "embed"]


@pytest.mark.parametrize("where", ["worker", "router"])
def test_bad_input_is_a_400_that_says_why(dirs, workers, router, where):
    emb = workers["emb"].http if where == "worker" else router["http"]
    rr = workers["rr"].http if where == "worker" else router["http"]
    model, reranker = dirs["emb"].name, dirs["rr"].name
    cases = [
        (emb, "/v1/embeddings", {"model": model, "input": ""}, "empty"),
        (emb, "/v1/embeddings", {"model": model, "input": []}, "empty"),
        (emb, "/v1/embeddings", {"model": model, "input": ["a", ""]}, "input 1 is empty"),
        (emb, "/v1/embeddings", {"model": model, "input": ["a"] * 9}, "at most 8"),
        (emb, "/v1/embeddings", {"model": model, "input": [[1] * 513]}, "max_model_len=512"),
        (emb, "/v1/embeddings", {"model": model, "input": [[600]]}, "outside the vocabulary"),
        (emb, "/v1/embeddings", {"model": model, "input": [[5] * 400] * 8}, "max_pooling_tokens=3000"),
        (emb, "/v1/embeddings", {"model": model, "input": "a", "dimensions": 129}, "more than the model's 128"),
        (emb, "/v1/embeddings", {"model": model, "input": "a", "encoding_format": "int8"}, "encoding_format"),
        (emb, "/v1/embeddings", {"model": model, "input": "a", "temperature": 1}, "temperature"),
        (emb, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]},
         "is an embedding model"),
        (emb, "/v1/rerank", {"model": model, "query": "q", "documents": ["d"]}, "is an embedding model"),
        (rr, "/v1/embeddings", {"model": reranker, "input": "a"}, "is a reranker"),
        (rr, "/v1/completions", {"model": reranker, "prompt": "a"}, "is a reranker"),
        (rr, "/v1/rerank", {"model": reranker, "query": "q", "documents": []}, "documents"),
        (rr, "/v1/rerank", {"model": reranker, "query": "q", "documents": ["d"] * 9}, "at most 8"),
        (rr, "/v1/rerank", {"model": reranker, "query": "", "documents": ["d"]}, "query"),
        (rr, "/v1/score", {"model": reranker, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "pairs"),
    ]
    if where == "worker":
        cases.append((emb, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                      "is an embedding model"))
    for address, path, body, words in cases:
        status, answer = post(address, path, body)
        assert status == 400, (path, body, answer)
        assert words in answer["error"]["message"], (path, body, answer)
    with Client(workers["emb"].grpc) as c, pytest.raises(InvalidRequest, match="at most 8"):
        c.embed(["x"] * 9)
    # the worker keeps serving
    assert post(emb, "/v1/embeddings", {"model": model, "input": "still here"})[0] == 200


@pytest.mark.slow
def test_models_are_listed_with_what_they_serve(dirs, cls_dir, workers, more_workers, router, tiny_model_dir):
    assert get(workers["emb"].http, "/v1/models")["data"][0]["tasks"] == ["embed"]
    assert get(workers["rr"].http, "/v1/models")["data"][0]["tasks"] == ["score"]
    listed = {m["id"]: m["tasks"] for m in get(router["http"], "/v1/models")["data"]}
    assert listed == {dirs["emb"].name: ["embed"], dirs["rr"].name: ["score"], cls_dir.name: ["score"],
                      tiny_model_dir.name: ["generate", "embed"]}


@pytest.mark.slow
def test_a_cross_encoder_reranks_its_tokenizers_pairs(cls_dir, more_workers, router):
    """A llama *ForSequenceClassification cross-encoder: (query, document) as its tokenizer
    pairs them, scored by sigmoid of its head on mlx-lm's last hidden state."""
    from mlx_lm.utils import load_model, load_tokenizer

    path = cls_dir
    backbone, _ = load_model(path, strict=False)
    tok = load_tokenizer(path)
    head = np.array(mx.load(str(path / "model.safetensors"))["score.weight"])[0]
    query, docs = "where do apples grow?", ["on trees in the orchard", "in the sea", "42 baskets"]
    want = []
    for d in docs:
        h = np.array(backbone.model(mx.array([tok.encode(query, text_pair=d)]))[0, -1].astype(mx.float32))
        want.append(float(1 / (1 + np.exp(-float(h @ head)))))
    status, body = post(router["http"], "/v1/rerank", {"model": path.name, "query": query, "documents": docs})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -want[i])
    assert all(abs(r["relevance_score"] - want[r["index"]]) < 1e-5 for r in body["results"])
