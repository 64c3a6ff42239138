"""Embed and score requests on the worker: their inputs checked and tokenized, one
prefill-only request per input (pooling.py; the engine's side of them:
pooling_requests.py), the results in input order.

`EmbedScoreRequests` does what the service's `embed` and `score` ask once the service has
found that it serves the model and the task; `run` (the service's) queues the prompts
in the engine and waits for their outputs. Errors are `cluster.api.errors` exceptions.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from cluster.api.errors import InvalidRequest
from cluster.api.limits import RequestLimits
from cluster.api.pooling import EMBED, SCORE, score_pairs, validate_embed_request, validate_score_request
from cluster.api.wire import CHARS_PER_TOKEN_BOUND
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.worker.engine import RequestOutput
from cluster.worker.pooling import PoolingParams, yes_no_prompt
from cluster.worker.prompt import INLINE_TOKENIZE_CHARS
from cluster.worker.sampling_params import SamplingParams

# (request id, prompts, params, arrival) -> the outputs, in order
RunPooled = Callable[[str, list[list[int]], SamplingParams, float], Awaitable[list[RequestOutput]]]


class EmbedScoreRequests:
    """The pooling requests of one loaded model (`pooler`: how it pools)."""

    def __init__(self, model_name: str, worker_id: str, pooler, tokenizer, vocab_size: int, config,
                 limits: RequestLimits, tokenize_pool: ThreadPoolExecutor, run: RunPooled):
        self.model_name = model_name
        self.worker_id = worker_id
        self.pooler = pooler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self.limits = limits
        self._tokenize_pool = tokenize_pool
        self._run = run

    async def embed(self, request: pb.EmbedRequest, arrival: float) -> pb.EmbedResponse:
        """Each input is a prefill-only request in the engine; the embeddings come back in
        input order."""
        validate_embed_request(request, self.limits)
        self._check_queue_holds(len(request.inputs))
        params = PoolingParams(EMBED, request.dimensions if request.HasField("dimensions") else None,
                               request.normalize if request.HasField("normalize") else None)
        try:
            self.pooler.check(params)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        inputs = []
        for i, x in enumerate(request.inputs):
            if x.WhichOneof("input") == "text":
                inputs.append((f"input {i}", len(x.text), lambda text=x.text: self.tokenizer.encode(text)))
            else:
                ids = list(x.token_ids.ids)
                bad = [t for t in ids if t >= self.vocab_size]
                if bad:
                    raise InvalidRequest(f"input {i}: token id {bad[0]} is outside the vocabulary "
                                         f"(0 .. {self.vocab_size - 1})")
                inputs.append((f"input {i}", None, ids))
        prompts = await self._prompts(inputs)
        outs = await self._run(request.request_id, prompts, SamplingParams(max_tokens=1, pooling=params), arrival)
        response = pb.EmbedResponse(model=self.model_name, worker_id=self.worker_id, usage=pooled_usage(outs))
        for i, out in enumerate(outs):
            response.data.add(index=i, values=out.pooled.tolist())
        return response

    async def score(self, request: pb.ScoreRequest, arrival: float) -> pb.ScoreResponse:
        """Each (query, document) pair is a prefill-only request scored by the reranker
        (pooling.py); the scores come back in document order."""
        validate_score_request(request, self.limits)
        self._check_queue_holds(len(request.documents))
        inputs = []
        for i, (query, document) in enumerate(score_pairs(request)):
            if self.pooler.score_format == "pair":  # a cross-encoder: the tokenizer's own pair encoding
                chars = len(query) + len(document)
                encode = lambda q=query, d=document: self.tokenizer.encode(q, text_pair=d)  # noqa: E731
            else:  # Qwen3-Reranker's prompt, built when it is tokenized
                chars = len(yes_no_prompt("", "", request.instruction or None)) + len(query) + len(document)
                encode = lambda q=query, d=document: self.tokenizer.encode(  # noqa: E731
                    yes_no_prompt(q, d, request.instruction or None))
            inputs.append((f"document {i} with its query", chars, encode))
        prompts = await self._prompts(inputs)
        outs = await self._run(request.request_id, prompts,
                               SamplingParams(max_tokens=1, pooling=PoolingParams(SCORE)), arrival)
        return pb.ScoreResponse(model=self.model_name, worker_id=self.worker_id, usage=pooled_usage(outs),
                                scores=[float(out.pooled[0]) for out in outs])

    def _check_queue_holds(self, num_inputs: int) -> None:
        """Each input of a pooling request is queued as a request: more than the waiting
        queue holds could never be taken (it would come back as a full queue, a verdict on
        the worker, from every worker the router tries)."""
        cap = getattr(self.config, "max_waiting", 0)
        if cap and num_inputs > cap:
            raise InvalidRequest(f"{num_inputs} inputs: more than this worker's waiting queue holds at once "
                                 f"(max_waiting={cap}); send at most {cap} a request")

    async def _prompts(self, inputs: list[tuple[str, int | None, Callable | list[int]]]) -> list[list[int]]:
        """The token ids of a pooling request's inputs, in order: (what it is called in a
        message, its characters and a function that tokenizes it, or None and its token
        ids). Every bound that characters can tell is checked before anything is tokenized
        (each input within max_model_len here, all together within max_pooling_tokens by
        the request's validation), then each input's tokens as it is tokenized: a refused
        request costs at most one input's tokenization past the limits."""
        max_len, limit = self.config.max_model_len, self.limits.max_pooling_tokens
        bound = CHARS_PER_TOKEN_BOUND * max_len
        for what, chars, _ in inputs:  # (their total: validate_embed_request / validate_score_request)
            if chars is not None and chars > bound:
                raise InvalidRequest(f"{what} has {chars} characters, more than max_model_len={max_len} tokens can "
                                     f"hold (at most {bound} characters are read): shorten it")
        prompts: list[list[int]] = []
        total = 0
        for what, chars, ids in inputs:
            if chars is not None:
                ids = list(ids() if chars <= INLINE_TOKENIZE_CHARS else
                           await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, ids))
            if len(ids) > max_len:
                raise InvalidRequest(f"{what} has {len(ids)} tokens, more than max_model_len={max_len}: shorten it")
            total += len(ids)
            if total > limit:
                raise InvalidRequest(f"the inputs have at least {total} tokens together (up to {what}), more than "
                                     f"max_pooling_tokens={limit} (--max-pooling-tokens): send fewer or shorter "
                                     "inputs")
            prompts.append(ids)
        return prompts


def pooled_usage(outs: list[RequestOutput]) -> pb.Usage:
    return pb.Usage(prompt_tokens=sum(o.num_prompt_tokens for o in outs),
                    cached_tokens=sum(o.num_cached_tokens for o in outs))
