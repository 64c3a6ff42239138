"""What the SDK hands back; a call's arguments become a `GenerateRequest` through
`cluster.api.wire.build_request`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cluster.api.wire import FINISH_REASON_NAMES
from cluster.proto.orchard.v1 import orchard_pb2 as pb


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, a thinking model's thinking
    cached_tokens_disk: int = 0  # of cached_tokens, read back from the worker's disk tier

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_proto(cls, u: pb.Usage) -> "Usage":
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens, u.cached_tokens_disk)


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
class ToolCall:
    """A function call the model made: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str

    @classmethod
    def from_proto(cls, c: pb.ToolCall) -> "ToolCall":
        return cls(c.id, c.name, c.arguments)


@dataclass(frozen=True)
class Chunk:
    """One streamed piece: the tokens and text of a step; the last one has finish_reason and usage."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "tool_calls" on the last chunk
    stop_reason: str = ""
    usage: Usage | None = None
    worker_id: str = ""
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of the request's n samples
    prompt_logprobs: list[TokenLogprob] | None = None  # first chunk: each prompt token's after the first
    prompt_token_ids: list[int] | None = None  # first chunk, with echo=True
    prompt_text: str = ""  # first chunk, with echo=True
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed in this chunk
    reasoning: str = ""  # a thinking model's thinking in this chunk (text holds the answer)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_proto(cls, r: pb.GenerateResponse) -> "Chunk":
        finish = FINISH_REASON_NAMES.get(r.finish_reason)
        return cls(
            request_id=r.request_id,
            text=r.text,
            token_ids=list(r.token_ids),
            finish_reason=finish,
            stop_reason=r.stop_reason,
            usage=Usage.from_proto(r.usage) if r.HasField("usage") else None,
            worker_id=r.worker_id,
            logprobs=[TokenLogprob.from_proto(lp) for lp in r.logprobs] or None,
            index=r.index,
            prompt_logprobs=[TokenLogprob.from_proto(lp) for lp in r.prompt_logprobs] or None,
            prompt_token_ids=list(r.prompt_token_ids) or None,
            prompt_text=r.prompt_text,
            tool_calls=[ToolCall.from_proto(c) for c in r.tool_calls],
            reasoning=r.reasoning,
        )


@dataclass
class Completion:
    """A whole generation: what `generate` and `chat` return. With n > 1 it is sample 0,
    and `choices` holds all n (each a Completion, in index order); `usage` counts them all."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""
    usage: Usage = field(default_factory=Usage)
    worker_id: str = ""
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""  # a thinking model's thinking, apart from its answer (`text`)
    index: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str = ""
    _others: dict = field(default_factory=dict, repr=False)

    @property
    def choices(self) -> list["Completion"]:
        return [self] + [self._others[i] for i in sorted(self._others)]

    def add(self, chunk: Chunk) -> None:
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.prompt_token_ids:
            self.prompt_token_ids, self.prompt_text = chunk.prompt_token_ids, chunk.prompt_text
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.index != self.index:
            other = self._others.setdefault(chunk.index, Completion(index=chunk.index))
            other.add(replace(chunk, usage=None))
            return
        self.request_id = chunk.request_id or self.request_id
        self.text += chunk.text
        self.reasoning += chunk.reasoning
        self.token_ids += chunk.token_ids
        self.worker_id = chunk.worker_id or self.worker_id
        self.tool_calls += chunk.tool_calls
        if chunk.logprobs:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason
        if chunk.usage is not None:
            self.usage = chunk.usage


@dataclass(frozen=True)
class Embeddings:
    """`client.embed(...)`: one float32 vector (as Python floats) per input, in input order."""

    vectors: tuple[tuple[float, ...], ...]
    model: str = ""
    usage: Usage = field(default_factory=Usage)

    def __len__(self) -> int:
        return len(self.vectors)

    def __getitem__(self, i: int) -> tuple[float, ...]:
        return self.vectors[i]

    @classmethod
    def from_proto(cls, r: pb.EmbedResponse) -> "Embeddings":
        by_index = sorted(r.data, key=lambda e: e.index)
        return cls(tuple(tuple(e.values) for e in by_index), r.model, Usage.from_proto(r.usage))


@dataclass(frozen=True)
class Ranked:
    """One document of `client.rerank(...)`: its index in the documents given, its score, its text."""

    index: int
    score: float
    document: str


def ranked(documents, scores, top_n: int | None = None) -> list[Ranked]:
    """Documents best first (ties keep their order), the first `top_n` of them."""
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    return [Ranked(i, float(scores[i]), documents[i]) for i in order[: top_n or None]]
