"""POST /v1/completions: the legacy completions API, as evaluation harnesses use it.

Beyond a plain completion: `prompt` as a list (of strings or of token-id lists; the
choices are numbered prompt by prompt, `n` each: index = prompt * n + sample), `n` > 1
(the samples share the prompt's KV blocks on the worker), `echo` (the prompt before the
completion; with `logprobs`, the prompt tokens' logprobs in OpenAI's legacy shape, the
first token's None), `max_tokens=0` with `echo` (lm-eval's loglikelihood scores a prompt
without generating), and vLLM's `prompt_logprobs` extension (per choice, `[None, {id:
{logprob, rank, decoded_token}}, ...]`). `best_of` and `suffix` are refused by name.

Each prompt is one `GenerateRequest` (with `n`); the requests run at once and their
chunks are merged in arrival order (streaming) or assembled in index order.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field

from aiohttp import web

from cluster.api.errors import OrchardError
from cluster.api.bodies import CompletionBody, body_field, int_field, n_field
from cluster.api.http import (BACKEND, ERROR_TYPES, LIMITS, BadField, error_of, read_body,
                              request_timeout, served_model, sse)
from cluster.api.limits import COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_LOGPROBS, MAX_TOKENS_HIGH, RequestLimits
from cluster.api.openai import Exchange
from cluster.api.streams import generation
from cluster.api.wire import FINISH_REASON_NAMES, build_request, validate_request
from cluster.proto.orchard.v1 import orchard_pb2 as pb

MAX_PROMPTS = 64  # prompts in one request at most


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)


def _prompts(body: dict) -> list[str | list[int]]:
    if "prompt" not in body:
        raise BadField("prompt", "'prompt' is required")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(
                isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise BadField("prompt", f"{len(prompt)} prompts: at most {MAX_PROMPTS} per request are allowed")
            return list(prompt)
    raise BadField("prompt", "'prompt' must be a string, a list of token ids, or a non-empty list of either "
                              "(strings, or token-id lists)")


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


@dataclass
class _Params:
    """What this API adds to a plain completion's fields."""

    n: int
    echo: bool
    logprobs: int | None  # OpenAI's: top alternatives per token (completion and, with echo, prompt)
    prompt_logprobs: int | None  # vLLM's extension
    max_tokens: int

    @property
    def engine_prompt_logprobs(self) -> int | None:
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None


def _params(body: dict, limits: RequestLimits) -> _Params:
    """This API's fields, each checked (`n` against the server's max_n before anything is
    built for its samples)."""
    if body.get("best_of") not in (None, 1):
        raise BadField("best_of", "best_of is not supported: use n and pick among the choices")
    if body.get("suffix"):
        raise BadField("suffix", "suffix (insertion) is not supported")
    n = n_field(body, limits)
    echo = body_field(body, "echo", bool, False)
    logprobs = int_field(body, "logprobs", low=0, high=MAX_LOGPROBS)
    prompt_logprobs = int_field(body, "prompt_logprobs", low=0, high=MAX_LOGPROBS)
    max_tokens = int_field(body, "max_tokens", low=0, high=MAX_TOKENS_HIGH)  # 0: echo only (below)
    if max_tokens == 0 and not echo:
        raise BadField("max_tokens", "max_tokens=0 generates nothing: it is allowed only with echo=true")
    return _Params(n, echo, logprobs, prompt_logprobs,
                   COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)


def _requests(body: dict, p: _Params, request_id: str, limits: RequestLimits) -> list[pb.GenerateRequest]:
    rest = {k: v for k, v in body.items() if k not in ("n", "echo", "best_of", "suffix", "prompt_logprobs")}
    if p.max_tokens == 0:
        rest["max_tokens"] = 1  # the prompt's forward needs one sampled token: dropped here
    prompts = _prompts(body)
    plain = CompletionBody.parse({**rest, "prompt": prompts[0]}, limits)  # every plain field checked once
    out = [plain.request(request_id, limits)]
    for i, prompt in enumerate(prompts[1:], 1):
        out.append(build_request(prompt, model=plain.model, request_id=f"{request_id}-{i}",
                                 **plain.sampling.kwargs()))
    for r in out:
        r.sampling.n = p.n if p.n > 1 else 0
        r.sampling.echo = p.echo
        if p.engine_prompt_logprobs is not None:
            r.sampling.prompt_logprobs = p.engine_prompt_logprobs
        validate_request(r, limits, {"messages": "prompt"})
    return out


# -- one choice's content -----------------------------------------------------------------
@dataclass
class _Prompt:
    """What the first chunk of a prompt's stream says of the prompt (echo, prompt logprobs)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # with echo: the first token leads (NaN)

    def take(self, r: pb.GenerateResponse, echo: bool) -> None:
        if r.prompt_token_ids:
            self.text, self.token_ids = r.prompt_text, list(r.prompt_token_ids)
        if r.prompt_logprobs:
            lps = list(r.prompt_logprobs)
            self.logprobs = lps if echo else [pb.TokenLogprob(logprob=float("nan"))] + lps


def _logprob(v: float) -> float | None:
    return None if math.isnan(v) else v


def _legacy_logprobs(lps: list[pb.TokenLogprob], offset: int) -> dict:
    """OpenAI's legacy shape; a NaN logprob (the prompt's first token) is None."""
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        tokens.append(lp.token)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(lp.logprob) for lp in lps],
        "top_logprobs": [None if math.isnan(lp.logprob) else _top(lp) for lp in lps],
        "text_offset": offsets,
    }


def _top(lp: pb.TokenLogprob) -> dict[str, float]:
    """The alternatives by text, best first; two tokens with one text (pieces of a split
    character) keep the better logprob, so max(top) is the top token's (lm-eval's greedy test)."""
    top: dict[str, float] = {}
    for t in lp.top:
        top.setdefault(t.token, t.logprob)
    return top


def _vllm_prompt_logprobs(lps: list[pb.TokenLogprob], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank,
    decoded_token}} with the prompt's token and its top k."""
    out: list[dict | None] = [None]
    for lp in lps[1:]:
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
                 for rank, t in enumerate(lp.top[:k], 1)}
        if str(lp.token_id) not in entry:
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": None, "decoded_token": lp.token}, **entry}
        out.append(entry)
    return out


class _Choice:
    """One choice (a prompt's sample) as its chunks arrive."""

    def __init__(self, index: int, prompt: _Prompt, text_prompt: str | None, p: _Params):
        self.index, self.prompt, self.text_prompt, self.p = index, prompt, text_prompt, p
        self.started = False
        self.offset = 0  # text_offset of the next token

    def piece(self, r: pb.GenerateResponse) -> tuple[str, list[pb.TokenLogprob]]:
        """The text and logprobs this chunk adds (the echoed prompt first, once)."""
        text, lps = ("", []) if self.p.max_tokens == 0 else (r.text, list(r.logprobs))
        if not self.started:
            self.started = True
            if self.p.echo:
                prompt_text = self.text_prompt if self.text_prompt is not None else self.prompt.text
                text = prompt_text + text
                if self.p.logprobs is not None:
                    lps = self.prompt.logprobs + lps
        return text, lps

    def dump(self, text: str, lps: list[pb.TokenLogprob], finish: str | None, first: bool) -> dict:
        if finish and self.p.max_tokens == 0:
            finish = "length"  # the token sampled for the prompt's forward was dropped
        logprobs = None
        if self.p.logprobs is not None:
            logprobs = _legacy_logprobs(lps, self.offset)
            self.offset += sum(len(lp.token) for lp in lps)
        choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.p.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(self.prompt.logprobs, self.p.prompt_logprobs)
        return choice


def _usage(usages: list[pb.Usage], p: _Params) -> dict:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = 0 if p.max_tokens == 0 else sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)}}


# -- the handler ----------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    backend = request.app[BACKEND]
    try:
        body = await read_body(request)
        stream = body_field(body, "stream", bool, False)
        include_usage = bool(body_field(body, "stream_options", dict, {}).get("include_usage")) and stream
        p = _params(body, request.app[LIMITS])
        ex = Exchange(False, "", False)
        protos = _requests(body, p, ex.id, request.app[LIMITS])
        ex.model = await served_model(request.app, protos[0].model)
        timeout = request_timeout(request)
    except OrchardError as e:
        return error_of(e)
    texts = [r.text if r.WhichOneof("prompt") == "text" else None for r in protos]
    prompts = [_Prompt() for _ in protos]
    choices = {(i, j): _Choice(i * p.n + j, prompts[i], texts[i], p) for i in range(len(protos)) for j in range(p.n)}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, proto: pb.GenerateRequest) -> None:
        chunks = generation(backend, proto, timeout)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                await queue.put((i, chunk))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(protos)]
    done_tasks = asyncio.ensure_future(asyncio.gather(*tasks))
    done_tasks.add_done_callback(lambda f: queue.put_nowait(None))

    async def chunks():
        """(prompt index, chunk) as they come; the first error of any prompt's stream."""
        while (item := await queue.get()) is not None:
            yield item
        done_tasks.result()  # raises the first error

    try:
        if not stream:
            return web.json_response(await _full(ex, p, chunks(), choices, prompts, len(protos)))
        it = chunks()
        try:
            first = await it.__anext__()  # refusals before the headers keep their status
        except StopAsyncIteration:
            first = None
        except OrchardError as e:
            return error_of(e)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        usages: list[pb.Usage] = []
        try:
            item = first
            while item is not None:
                i, r = item
                prompts[i].take(r, p.echo)
                if r.HasField("usage"):
                    usages.append(r.usage)
                choice = choices[(i, r.index)]
                first_of_choice = not choice.started
                text, lps = choice.piece(r)
                finish = FINISH_REASON_NAMES.get(r.finish_reason)
                if text or lps or finish or first_of_choice:
                    await response.write(sse(ex._envelope([choice.dump(text, lps, finish, first_of_choice)], None,
                                                           stream=True)))
                item = await anext(it, None)
        except OrchardError as e:
            await response.write(sse({"error": {"message": e.message, "type": ERROR_TYPES.get(e.http_status,
                                                                                                  "server_error"),
                                                 "param": None, "code": e.http_status}}))
        if include_usage and len(usages) == len(protos):
            await response.write(sse(ex._envelope([], _usage(usages, p), stream=True)))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return response
    except OrchardError as e:
        return error_of(e)
    finally:
        for t in tasks:
            t.cancel()
        done_tasks.cancel()
        with contextlib.suppress(BaseException):
            await done_tasks


async def _full(ex: Exchange, p: _Params, chunks, choices: dict, prompts: list[_Prompt], num_prompts: int) -> dict:
    texts: dict = {key: [] for key in choices}
    lps: dict = {key: [] for key in choices}
    finish: dict = {}
    usages: list[pb.Usage] = []
    async for i, r in chunks:
        prompts[i].take(r, p.echo)
        if r.HasField("usage"):
            usages.append(r.usage)
        text, got = choices[(i, r.index)].piece(r)
        texts[(i, r.index)].append(text)
        lps[(i, r.index)] += got
        if r.finish_reason:
            finish[(i, r.index)] = FINISH_REASON_NAMES.get(r.finish_reason)
    out = []
    for key in sorted(choices, key=lambda k: choices[k].index):
        c = choices[key]
        if not c.started:  # a stream that ended without a chunk for this choice (cannot happen whole)
            c.piece(pb.GenerateResponse())
        out.append(c.dump("".join(texts[key]), lps[key], finish.get(key), True))
    return ex._envelope(out, _usage(usages, p), stream=False)
