"""A generate request's engine events made into its response chunks.

`StreamAssembler` takes one request's events as the service reads them off its queue, a
batch at a time, and yields the `GenerateResponse` chunks the client sees: the tokens,
text and logprobs of each sample (`index`), the echoed prompt with its prompt logprobs
on the first chunk, usage summed over the samples on the last, and for a chat each
sample's output split into thinking, text and tool calls. An engine verdict on the
request (rejected, failed, a sample that ended for what it asked) is raised as the
`cluster.api.errors` exception the front ends map, after the chunks that came before it.
`TokenTexts` spells token ids for logprobs and thinking, each token decoded once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Iterator

from cluster.api.errors import InternalError, InvalidRequest, Overloaded
from cluster.api.tools import split_chunk
from cluster.api.wire import FINISH_REASON_TO_PROTO
from cluster.formats.split import OutputSplitter
from cluster.formats.thinking import ThinkingTracker
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.worker.detokenizer import decode_keeping, token_bytes
from cluster.worker.engine import QueueFullError, RequestOutput
from cluster.worker.engine_loop import Failed, Rejected
from cluster.worker.prompt import Prompt


@dataclass
class Stream:
    """Asyncio-side state of one request."""

    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_token_time: float | None = None


@dataclass
class Usage:
    """A request's usage, summed over its samples."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens_disk: int = 0  # of cached_tokens, read back from the disk tier

    def proto(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                        cached_tokens=self.cached_tokens, reasoning_tokens=self.reasoning_tokens,
                        cached_tokens_disk=self.cached_tokens_disk)


def engine_verdict(ev: Rejected | Failed) -> Exception:
    """The error a request the engine refused (`Rejected`) or lost (`Failed`) ends with."""
    if isinstance(ev, Failed):
        return InternalError(ev.message)
    return (Overloaded if isinstance(ev.error, QueueFullError) else InvalidRequest)(str(ev.error))


class TokenTexts:
    """Token ids -> their texts, each decoded once (at most the vocabulary): prompt
    logprobs with top k decode k + 1 texts per prompt token on the event loop."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._logprob_texts: dict[int, str] = {}
        self._pieces: dict[int, str] = {}  # special tokens spelled (thinking markers)

    def logprob_text(self, token_id: int) -> str:
        """The token's text; a token that is part of a multi-byte character is spelled as
        its own bytes, "bytes:\\xe2\\x80" (as OpenAI does), not as U+FFFD."""
        text = self._logprob_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            raw = token_bytes(self.tokenizer, token_id) if "\ufffd" in text else None
            if raw is not None and raw.decode("utf-8", "replace") == text:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._logprob_texts[token_id] = text
        return text

    def piece(self, token_id: int) -> str:
        """The token's text with special tokens spelled out."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class StreamAssembler:
    """One generate request's chunks, from its `prompt` (tokens, params, how a chat is
    read). `finished`: its stream has ended (every sample done, one aborted, or an engine
    verdict); `left`: its samples still running."""

    def __init__(self, request: pb.GenerateRequest, request_id: str, worker_id: str, prompt: Prompt,
                 texts: TokenTexts):
        self.request = request
        self.request_id = request_id
        self.worker_id = worker_id
        self.prompt = prompt.token_ids
        self.reading = reading = prompt.reading
        self.texts = texts
        self.finished = False
        self.left = prompt.params.n
        self.usage = Usage(len(prompt.token_ids))
        self._first = True
        resume = prompt.resume
        self._splitters: dict[int, OutputSplitter] | None = None
        if reading is not None and reading.splitter() is not None:
            self._splitters = {0: reading.splitter()}
            if resume:  # resumed after failover: where the thinking and calls were, not sent again
                self._splitters[0].segments(decode_keeping(texts.tokenizer, resume, reading.kept))
        # each sample's thinking followed over its tokens, here rather than in the engine's step
        # (which follows only a thinking with a budget)
        self._trackers: dict[int, ThinkingTracker] | None = None
        if reading is not None and reading.reasoning is not None:
            self._trackers = {0: reading.tracker(texts.piece)}
            for t in resume:  # the resumed tokens count, as completion_tokens counts them
                self._trackers[0].add(t)

    def chunks(self, events: list) -> Iterator[pb.GenerateResponse]:
        """The chunks one batch of the request's events makes, in order."""
        chunks: dict[int, pb.GenerateResponse] = {}  # by sample index, in the order they come
        gave_up = None  # the client's error a sample ended with: raised after what came before it
        for ev in events:
            if isinstance(ev, (Rejected, Failed)):
                self.finished = True
                raise engine_verdict(ev)
            if ev.error is not None:  # ended for what it asked: the client's error, not the worker's
                gave_up, self.left = InvalidRequest(ev.error), self.left - 1
                break
            chunk = chunks.get(ev.index)
            if chunk is None:
                chunk = chunks[ev.index] = pb.GenerateResponse(request_id=self.request_id, worker_id=self.worker_id,
                                                               index=ev.index)
            thinking = None
            if self._trackers is not None:
                thinking = self._trackers.get(ev.index) or self._trackers.setdefault(
                    ev.index, self.reading.tracker(self.texts.piece))
            if self._add_output(chunk, ev, thinking):
                self.left -= 1
                self.finished = self.left == 0 or ev.finish_reason == "abort"
        for index, chunk in chunks.items():
            if self._first and (chunk.token_ids or chunk.finish_reason):
                self._first = False
                if self.request.sampling.echo:
                    self._echo(chunk)
            if self.finished and chunk is list(chunks.values())[-1]:
                chunk.usage.CopyFrom(self.usage.proto())
            parts = [chunk]
            if self._splitters is not None:  # each sample's thinking and calls are its own
                if index not in self._splitters:
                    self._splitters[index] = self.reading.splitter()
                parts = split_chunk(self._splitters[index], chunk)
            for part in parts:
                if (part.token_ids or part.text or part.reasoning or part.tool_calls or part.finish_reason
                        or part.HasField("usage")):
                    yield part
        if gave_up is not None:
            self.finished = True
            raise gave_up

    def _echo(self, chunk: pb.GenerateResponse) -> None:
        """The prompt on the first chunk: its tokens, its text and, with prompt logprobs,
        the first token leading them without one."""
        prompt = self.prompt
        chunk.prompt_token_ids.extend(prompt)
        chunk.prompt_text = self.texts.tokenizer.decode(prompt)
        if self.request.sampling.HasField("prompt_logprobs"):
            rest = list(chunk.prompt_logprobs)
            del chunk.prompt_logprobs[:]
            chunk.prompt_logprobs.add(token_id=prompt[0], logprob=float("nan"),
                                      token=self.texts.logprob_text(prompt[0]))
            chunk.prompt_logprobs.extend(rest)

    def _add_output(self, chunk: pb.GenerateResponse, out: RequestOutput, thinking: ThinkingTracker | None) -> bool:
        """Append one engine output to `chunk` (and its tokens to its sample's `thinking`);
        True when it finished its sample."""
        text_of, usage = self.texts.logprob_text, self.usage
        chunk.token_ids.extend(out.new_token_ids)
        if thinking is not None:
            for t in out.new_token_ids:
                thinking.add(t)
        chunk.text += out.new_text
        if out.prompt_logprobs is not None:
            for token, lp, top in out.prompt_logprobs:
                chunk.prompt_logprobs.append(pb.TokenLogprob(
                    token_id=token, logprob=lp, token=text_of(token),
                    top=[pb.TopLogprob(token_id=t, logprob=v, token=text_of(t)) for t, v in top],
                ))
        if out.logprobs is not None:
            tops = out.top_logprobs or [[] for _ in out.logprobs]
            for token, lp, top in zip(out.new_token_ids, out.logprobs, tops):
                chunk.logprobs.append(pb.TokenLogprob(
                    token_id=token, logprob=lp, token=text_of(token),
                    top=[pb.TopLogprob(token_id=t, logprob=v, token=text_of(t)) for t, v in top],
                ))
        if not out.finished:
            return False
        chunk.finish_reason = FINISH_REASON_TO_PROTO.get(out.finish_reason, pb.FINISH_REASON_ABORT)
        if out.stop_reason is not None:
            chunk.stop_reason = str(out.stop_reason)
        usage.completion_tokens += out.num_output_tokens  # the resumed tokens included
        if thinking is not None:
            usage.reasoning_tokens += thinking.reasoning_tokens
        if out.index == 0 or out.finish_reason == "abort":
            usage.cached_tokens = min(out.num_cached_tokens, usage.prompt_tokens)
            usage.cached_tokens_disk = min(out.num_cached_tokens_disk, usage.cached_tokens)
        return True
