"""Embeddings and reranking over HTTP, on any `Backend` (a worker, the router).

- POST /v1/embeddings, OpenAI's shape: `input` a string, a list of strings, a list of
  token ids or a list of token-id lists; `encoding_format` "float" (default) or "base64"
  (little-endian float32, what the openai package asks for by default); `dimensions`
  (Matryoshka truncation, where the model allows it); vLLM's `normalize`. `usage` counts
  the inputs' tokens.
- POST /v1/rerank (also /rerank and /v2/rerank), the Jina / Cohere shape vLLM and
  llama.cpp serve: `query`, `documents` (strings or {"text"}), `top_n`,
  `return_documents`; results sorted by `relevance_score`, best first.
- POST /v1/score, vLLM's: `text_1` (a query, or a list) and `text_2` (a document or a
  list): one query against each document, or lists in pairs; `data` in input order.

Both rerank endpoints take Qwen3-Reranker's `instruction` (its <Instruct>) as an extension.
Unknown parameters are a 400 naming them, as on every endpoint.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid

from aiohttp import web

from cluster.api.errors import DeadlineExceeded, NotFound, OrchardError
from cluster.api.bodies import ACCEPTED_NO_EFFECT, body_field, check_params
from cluster.api.limits import shown
from cluster.api.http import BACKEND, BadField, error_response, read_body, request_timeout, served_model
from cluster.api.pooling import build_embed_request, build_score_request

EMBEDDING_PARAMS = frozenset({"model", "input", "encoding_format", "dimensions", "normalize"}) | ACCEPTED_NO_EFFECT
RERANK_PARAMS = frozenset({"model", "query", "documents", "top_n", "return_documents", "instruction"}
                          ) | ACCEPTED_NO_EFFECT
SCORE_PARAMS = frozenset({"model", "text_1", "text_2", "instruction"}) | ACCEPTED_NO_EFFECT


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    app.router.add_post("/v1/score", score)


async def _call(request: web.Request, method, proto):
    """`backend.<method>(proto)` within the request's time limit (cancelled past it)."""
    timeout = request_timeout(request)
    handler = getattr(request.app[BACKEND], method, None)
    if handler is None:  # a backend without pooling (a test double)
        raise NotFound(f"this server does not serve {method} requests")
    call = handler(proto, timeout=timeout)
    if timeout is None:
        return await call
    try:
        return await asyncio.wait_for(call, timeout)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(f"the request took longer than its {timeout:g} s timeout") from None


def _embedding_input(body: dict):
    if "input" not in body:
        raise BadField("input", "'input' is required")
    x = body["input"]
    token = lambda t: isinstance(t, int) and not isinstance(t, bool)  # noqa: E731
    if isinstance(x, str):
        if not x:
            raise BadField("input", "'input' is empty: send some text")
        return x
    if isinstance(x, list) and x:
        if all(token(t) for t in x) or all(isinstance(s, str) for s in x):
            return x
        if all(isinstance(s, list) and all(token(t) for t in s) for s in x):
            return x
    if isinstance(x, list) and not x:
        raise BadField("input", "'input' is an empty list: send at least one input")
    raise BadField("input", "'input' must be a string, a list of strings, a list of token ids, or a list of "
                            "token-id lists")


async def embeddings(request: web.Request) -> web.Response:
    try:
        body = await read_body(request)
        check_params(body, EMBEDDING_PARAMS)
        fmt = body_field(body, "encoding_format", str, "float")
        if fmt not in ("float", "base64"):
            raise BadField("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {shown(fmt)}")
        dimensions = body_field(body, "dimensions", int)
        if dimensions is not None and dimensions < 1:
            raise BadField("dimensions", f"'dimensions' must be >= 1, got {dimensions}")
        proto = build_embed_request(_embedding_input(body), model=body_field(body, "model", str, ""),
                                    dimensions=dimensions, normalize=body_field(body, "normalize", bool),
                                    request_id=f"embd-{uuid.uuid4().hex}")
        model = await served_model(request.app, proto.model)
        result = await _call(request, "embed", proto)
    except OrchardError as e:
        return error_response(e.http_status, e.message, getattr(e, "param", None))
    data = []
    for e in result.data:
        if fmt == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(e.values)}f", *e.values)).decode()
        else:
            vector = list(e.values)
        data.append({"object": "embedding", "index": e.index, "embedding": vector})
    tokens = result.usage.prompt_tokens
    return web.json_response({"object": "list", "data": data, "model": result.model or model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _documents(body: dict) -> list[str]:
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs:
        raise BadField("documents", "'documents' must be a non-empty list of strings (or {\"text\": ...} objects)")
    out = []
    for i, d in enumerate(docs):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise BadField("documents", f"documents[{i}] must be a string or {{\"text\": string}}")
        out.append(d)
    return out


async def rerank(request: web.Request) -> web.Response:
    try:
        body = await read_body(request)
        check_params(body, RERANK_PARAMS)
        query = body_field(body, "query", str)
        if not query:
            raise BadField("query", "'query' is required: a non-empty string")
        documents = _documents(body)
        top_n = body_field(body, "top_n", int)
        if top_n is not None and top_n < 0:
            raise BadField("top_n", f"'top_n' must be >= 0 (0: all), got {top_n}")
        return_documents = body_field(body, "return_documents", bool, True)
        proto, model, result = await _scored(request, body, query, documents, "rerank")
    except OrchardError as e:
        return error_response(e.http_status, e.message, getattr(e, "param", None))
    order = sorted(range(len(documents)), key=lambda i: -result.scores[i])  # stable: ties keep input order
    if top_n:
        order = order[:top_n]
    results = []
    for i in order:
        item = {"index": i, "relevance_score": result.scores[i]}
        if return_documents:
            item["document"] = {"text": documents[i]}
        results.append(item)
    tokens = result.usage.prompt_tokens
    return web.json_response({"id": proto.request_id, "model": result.model or model, "results": results,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _scored(request: web.Request, body: dict, queries, documents: list[str], kind: str):
    """(the ScoreRequest, the model that serves it, the worker's answer) for a rerank or a
    score request's queries against its documents."""
    proto = build_score_request(queries, documents, model=body_field(body, "model", str, ""),
                                instruction=body_field(body, "instruction", str, ""),
                                request_id=f"{kind}-{uuid.uuid4().hex}")
    model = await served_model(request.app, proto.model)
    return proto, model, await _call(request, "score", proto)


def _texts(body: dict, name: str) -> list[str]:
    x = body.get(name)
    if isinstance(x, str) and x:
        return [x]
    if isinstance(x, list) and x and all(isinstance(s, str) and s for s in x):
        return x
    raise BadField(name, f"'{name}' must be a non-empty string or a non-empty list of non-empty strings")


async def score(request: web.Request) -> web.Response:
    try:
        body = await read_body(request)
        check_params(body, SCORE_PARAMS)
        queries, documents = _texts(body, "text_1"), _texts(body, "text_2")
        if len(queries) not in (1, len(documents)):
            raise BadField("text_1", f"{len(queries)} text_1 and {len(documents)} text_2: send one text_1, or as "
                                     "many as text_2 (scored in pairs)")
        proto, model, result = await _scored(request, body, queries, documents, "score")
    except OrchardError as e:
        return error_response(e.http_status, e.message, getattr(e, "param", None))
    tokens = result.usage.prompt_tokens
    return web.json_response({
        "id": proto.request_id, "object": "list", "created": int(time.time()), "model": result.model or model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(result.scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
