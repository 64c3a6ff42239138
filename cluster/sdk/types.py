"""What the SDK hands back, and how a call's arguments become a `GenerateRequest`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.sdk.errors import InvalidRequest

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_proto(cls, u: pb.Usage) -> "Usage":
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str = ""
    top: tuple[tuple[int, float, str], ...] = ()  # (token_id, logprob, token), best first

    @classmethod
    def from_proto(cls, lp: pb.TokenLogprob) -> "TokenLogprob":
        return cls(lp.token_id, lp.logprob, lp.token, tuple((t.token_id, t.logprob, t.token) for t in lp.top))


@dataclass(frozen=True)
class Chunk:
    """One streamed piece: the tokens and text of a step; the last one has finish_reason and usage."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk
    stop_reason: str = ""
    usage: Usage | None = None
    worker_id: str = ""
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_proto(cls, r: pb.GenerateResponse) -> "Chunk":
        finish = FINISH_REASONS.get(r.finish_reason)
        return cls(
            request_id=r.request_id,
            text=r.text,
            token_ids=list(r.token_ids),
            finish_reason=finish,
            stop_reason=r.stop_reason,
            usage=Usage.from_proto(r.usage) if r.HasField("usage") else None,
            worker_id=r.worker_id,
            logprobs=[TokenLogprob.from_proto(lp) for lp in r.logprobs] or None,
        )


@dataclass
class Completion:
    """A whole generation: what `generate` and `chat` return."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""
    usage: Usage = field(default_factory=Usage)
    worker_id: str = ""
    logprobs: list[TokenLogprob] | None = None

    def add(self, chunk: Chunk) -> None:
        self.request_id = chunk.request_id or self.request_id
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.worker_id = chunk.worker_id or self.worker_id
        if chunk.logprobs:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason
        if chunk.usage is not None:
            self.usage = chunk.usage


Message = Mapping[str, str] | tuple[str, str]


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Iterable[Message] | None = None,
    model: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    request_id: str = "",
    resume_token_ids: Sequence[int] | None = None,
) -> pb.GenerateRequest:
    """A `GenerateRequest` from keyword arguments: exactly one of a text prompt, a list of
    token ids, or chat `messages` ({"role", "content"} dicts or (role, content) pairs)."""
    if (prompt is None) == (messages is None):
        raise InvalidRequest("pass exactly one of a prompt (text or token ids) or messages")
    req = pb.GenerateRequest(request_id=request_id, model=model)
    if messages is not None:
        chat = req.chat
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
            chat.messages.add(role=role, content=content)
        req.chat.SetInParent()
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
        req.token_ids.SetInParent()
    s = req.sampling
    if max_tokens is not None:
        if max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
        s.max_tokens = max_tokens
    if temperature is not None:
        s.temperature = temperature
    if top_p is not None:
        s.top_p = top_p
    if top_k is not None:
        s.top_k = top_k
    if min_p is not None:
        s.min_p = min_p
    if seed is not None:
        s.seed = seed
    if stop:
        s.stop.extend([stop] if isinstance(stop, str) else list(stop))
    if stop_token_ids:
        s.stop_token_ids.extend(int(t) for t in stop_token_ids)
    s.ignore_eos = bool(ignore_eos)
    if logprobs is not None:
        s.logprobs = logprobs
    if resume_token_ids:
        req.resume_token_ids.extend(int(t) for t in resume_token_ids)
    return req
