"""The wire side of embeddings and scores: building `EmbedRequest` / `ScoreRequest` from
keyword arguments (the SDK's, the HTTP front's) and the one semantic check every backend
runs as it takes one (the worker, the router), as `wire.py` does for generation.

What needs the model (token counts against max_model_len, Matryoshka dimensions, which
tasks it serves) is the worker's; what needs nothing but the request is here.
"""

from __future__ import annotations

from typing import Sequence

from cluster.api.errors import BadField, InvalidRequest
from cluster.api.limits import quoted
from cluster.api.wire import CHARS_PER_TOKEN_BOUND, RequestLimits, check_id_and_model, checked_token_ids
from cluster.proto.orchard.v1 import orchard_pb2 as pb

# what a model serves, as ModelInfo.tasks / LoadReport.tasks name it
GENERATE, EMBED, SCORE = "generate", "embed", "score"
TASK_WORDS = {GENERATE: "generation (/v1/completions, /v1/chat/completions, Generate)",
              EMBED: "embeddings (/v1/embeddings, Embed)", SCORE: "reranking (/v1/rerank, /v1/score, Score)"}


def tasks_of(tasks: Sequence[str]) -> tuple[str, ...]:
    """A model's tasks as reported; a report without any (an older worker) is generation."""
    return tuple(tasks) or (GENERATE,)


def refuse_task(model: str, task: str, served: Sequence[str]) -> InvalidRequest:
    """The 400 for a request of a task the model does not serve, saying what it does serve."""
    served = tasks_of(served)
    kind = ("an embedding model" if EMBED in served and GENERATE not in served else
            "a reranker" if SCORE in served else "a generation model")
    return InvalidRequest(f"model {quoted(model)} is {kind}: it serves {' and '.join(TASK_WORDS[t] for t in served)}, "
                          f"not {TASK_WORDS[task].split(' (')[0]}")


def build_embed_request(inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *, model: str = "",
                        dimensions: int | None = None, normalize: bool | None = None,
                        request_id: str = "") -> pb.EmbedRequest:
    """An `EmbedRequest`: one text, a list of texts, one list of token ids, or a list of
    token-id lists (OpenAI's `input`). Values the wire cannot hold are InvalidRequest."""
    req = pb.EmbedRequest(request_id=request_id, model=model)
    if isinstance(inputs, str):
        inputs = [inputs]
    elif isinstance(inputs, Sequence) and inputs and all(_is_token(t) for t in inputs):
        inputs = [list(inputs)]
    try:
        for x in inputs:
            if isinstance(x, str):
                req.inputs.add(text=x)
            elif isinstance(x, Sequence) and all(_is_token(t) for t in x):
                item = req.inputs.add()
                item.token_ids.ids.extend(checked_token_ids("input", x))
                item.token_ids.SetInParent()
            else:
                raise InvalidRequest("each input must be a string or a list of token ids")
        if dimensions is not None:
            if not 0 <= dimensions < 2**32:
                raise BadField("dimensions", f"dimensions must be between 1 and {2**32 - 1}, got {dimensions}")
            req.dimensions = dimensions
        if normalize is not None:
            req.normalize = bool(normalize)
    except (ValueError, TypeError) as e:
        if isinstance(e, InvalidRequest):
            raise
        raise InvalidRequest(f"invalid embedding request: {e}") from None
    return req


def build_score_request(queries: str | Sequence[str], documents: str | Sequence[str], *, model: str = "",
                        instruction: str = "", request_id: str = "") -> pb.ScoreRequest:
    """A `ScoreRequest`: one query against each document, or queries and documents in pairs."""
    queries = [queries] if isinstance(queries, str) else list(queries)
    documents = [documents] if isinstance(documents, str) else list(documents)
    if not all(isinstance(x, str) for x in (*queries, *documents)):
        raise InvalidRequest("queries and documents must be strings")
    return pb.ScoreRequest(request_id=request_id, model=model, queries=queries, documents=documents,
                           instruction=instruction or "")


def validate_embed_request(request: pb.EmbedRequest, limits: RequestLimits = RequestLimits()) -> None:
    check_id_and_model(request)
    n = len(request.inputs)
    if n == 0:
        raise InvalidRequest("the input is empty: send at least one text or list of token ids")
    if n > limits.max_pooling_inputs:
        raise InvalidRequest(f"{n} inputs: at most {limits.max_pooling_inputs} per request are allowed "
                             "(--max-pooling-inputs)")
    for i, x in enumerate(request.inputs):
        which = x.WhichOneof("input")
        if which is None or (which == "text" and not x.text) or (which == "token_ids" and not x.token_ids.ids):
            raise InvalidRequest(f"input {i} is empty: every input needs some text or at least one token")
        if which == "token_ids" and any(t < 0 for t in x.token_ids.ids):
            raise InvalidRequest(f"input {i} has a negative token id")
    if request.HasField("dimensions") and request.dimensions < 1:
        raise InvalidRequest(f"dimensions must be >= 1, got {request.dimensions}")
    _check_total(sum(len(x.text) for x in request.inputs), sum(len(x.token_ids.ids) for x in request.inputs), limits)


def validate_score_request(request: pb.ScoreRequest, limits: RequestLimits = RequestLimits()) -> None:
    check_id_and_model(request)
    q, d = len(request.queries), len(request.documents)
    if q == 0 or d == 0:
        raise InvalidRequest("send a query and at least one document")
    if q != 1 and q != d:
        raise InvalidRequest(f"{q} queries and {d} documents: send one query, or as many queries as documents "
                             "(scored in pairs)")
    if d > limits.max_pooling_inputs:
        raise InvalidRequest(f"{d} documents: at most {limits.max_pooling_inputs} per request are allowed "
                             "(--max-pooling-inputs)")
    if not all(request.queries):
        raise InvalidRequest("a query is empty")
    if not all(request.documents):
        i = next(i for i, x in enumerate(request.documents) if not x)
        raise InvalidRequest(f"document {i} is empty")
    # each pair is prefilled whole: one query against d documents is d copies of it
    pairs = (len(request.queries[0]) * d if q == 1 else sum(len(x) for x in request.queries)) + sum(
        len(x) for x in request.documents)
    _check_total(pairs + d * len(request.instruction), 0, limits)


def _check_total(chars: int, token_ids: int, limits: RequestLimits) -> None:
    """A pooling request's inputs together within max_pooling_tokens, as far as can be told
    before tokenizing: its token ids, and a token for every CHARS_PER_TOKEN_BOUND characters
    of text at least (the worker counts the tokens themselves as it tokenizes)."""
    at_least = token_ids + chars // CHARS_PER_TOKEN_BOUND
    if at_least > limits.max_pooling_tokens:
        what = " and ".join(x for x in (f"{token_ids} token ids" if token_ids else "",
                                        f"{chars} characters" if chars else "") if x)
        raise InvalidRequest(f"the inputs hold at least {at_least} tokens together ({what}), more than "
                             f"max_pooling_tokens={limits.max_pooling_tokens} (--max-pooling-tokens): send fewer or "
                             "shorter inputs")


def score_pairs(request: pb.ScoreRequest) -> list[tuple[str, str]]:
    """(query, document) of each score asked for, in order."""
    queries = list(request.queries) * len(request.documents) if len(request.queries) == 1 else request.queries
    return list(zip(queries, request.documents))


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
