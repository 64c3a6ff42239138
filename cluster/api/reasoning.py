"""Reasoning on the wire: which families think, how their thinking is marked, and the
thinking cut out of a model's output. Nothing here imports MLX.

Contract
--------
- `reasoning_format(chat_template, vocab)` names how a model marks its thinking, or None
  (it does not think, or marks nothing a server can find): `THINK_TAGS`, <think>...</think>
  (Qwen3, QwQ, DeepSeek-R1 and V3.1, Kimi K2 Thinking, GLM-4.5, Nemotron); `MAGISTRAL`,
  [THINK]...[/THINK]; `GRANITE`, <think>...</think> then <response>...</response> as plain
  text; `HARMONY`, gpt-oss's channels (analysis is the thinking, final the answer,
  commentary to=functions.NAME a call). Markers may be special tokens: the worker decodes
  the output with the family's markers kept (`ReasoningFormat.markers`).
- `prompt_state(fmt, prompt_tail)`: "open" when the rendered prompt leaves a thinking block
  open (QwQ, DeepSeek-R1, V3.1 with thinking, Nemotron: the output starts inside it),
  "closed" when it closed one (Qwen3 with enable_thinking=False: no thinking follows),
  else "free" (the model opens one or not).
- `OutputSplitter` (one per sample) takes the output text chunk by chunk and returns
  segments in the model's order: `Thought` (thinking text), content text (str) and tool
  calls (pb.ToolCall). Thinking never reaches the content, calls are parsed only outside
  it, markers appear in neither; text that could be the start of a marker is held back
  until it is known. `rest()` at the end: a thinking block never closed (max_tokens inside
  the thinking, a model that never closes it) is all thinking; a call cut short is text.
  Whitespace around markers is trimmed (the thinking's ends, the answer's start after it).
- `ThinkingTracker` follows the same markers over token ids: how many tokens the thinking
  took (usage's reasoning_tokens: the worker's service counts them, off the engine's step)
  and, in the engine, for a request with a thinking budget only, when the budget is spent
  (then the engine forces the end marker's tokens, and the answer follows).
- `ThinkingGrammar`: what the worker needs to let a structured output or a forced tool call
  apply to the answer after the thinking, not to the thinking (cluster/worker/structured.py
  composes the grammar: the thinking block as free text up to its end marker, then the
  answer's grammar).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Mapping

from cluster.api.tools import CallFormat, Thought, ToolCallStream, partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    """How a family marks its thinking: `start` ... `end`, as text (a special token's text
    when the marker is one); `strip`: markers dropped from the answer."""

    name: str
    start: str
    end: str
    strip: tuple[str, ...] = ()
    harmony: bool = False

    @property
    def markers(self) -> tuple[str, ...]:
        """Token texts that must survive decoding for the parser to see them."""
        if self.harmony:
            return HARMONY_TOKENS
        return (self.start, self.end, *self.strip)


THINK_TAGS = ReasoningFormat("think", "<think>", "</think>")
MAGISTRAL = ReasoningFormat("magistral", "[THINK]", "[/THINK]")
GRANITE = ReasoningFormat("granite", "<think>", "</think>", strip=("<response>", "</response>"))
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")
HARMONY = ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>", harmony=True)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


def reasoning_format(chat_template: str | None, vocab: Mapping[str, int]) -> ReasoningFormat | None:
    """The model's thinking markers, from its chat template and vocabulary."""
    t = chat_template if isinstance(chat_template, str) else ""
    if "<|channel|>" in vocab and "<|message|>" in vocab and "analysis" in t:
        return HARMONY
    if "[THINK]" in vocab and "[/THINK]" in vocab and "[THINK]" in t:
        return MAGISTRAL
    if "<think></think>" in t and "<response></response>" in t:  # Granite: asked for in plain text
        return GRANITE
    if "<think>" in vocab and "</think>" in vocab and ("</think>" in t or "<think>" in t):
        return THINK_TAGS
    return None


def prompt_state(fmt: ReasoningFormat, prompt_tail: str) -> str:
    """"open", "closed" or "free": how the rendered prompt (its last characters, special
    tokens kept) leaves the thinking."""
    tail = prompt_tail.rstrip()
    if tail.endswith(fmt.start):
        return "open"
    if not fmt.harmony and tail.endswith(fmt.end):
        return "closed"
    return "free"


# -- the output, split -----------------------------------------------------------------------------
class ThinkStream:
    """Thinking between a start and an end marker, the rest content; segments are
    `Thought` or str."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool = False):
        self.fmt = fmt
        self.thinking = thinking
        self.buffer = ""
        self.trim = thinking  # drop whitespace until the next text (just after a marker)
        self.held = ""  # trailing whitespace of the thinking, sent only if more thinking follows

    def _markers(self) -> tuple[str, ...]:
        f = self.fmt
        if self.thinking:
            return (f.end, f.start)  # a nested start marker is a marker too: dropped
        return (f.start, f.end, *f.strip)  # a stray end marker in the answer is dropped

    def segments(self, text: str) -> list:
        self.buffer += text
        out: list = []
        while self.buffer:
            found = min(((i, m) for m in self._markers() if (i := self.buffer.find(m)) >= 0), default=None)
            if found is None:
                keep = max(partial_suffix(self.buffer, m) for m in self._markers())
                self._emit(out, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            i, marker = found
            self._emit(out, self.buffer[:i])
            self.buffer = self.buffer[i + len(marker):]
            if marker == self.fmt.start and not self.thinking:
                self.thinking, self.trim, self.held = True, True, ""
            elif marker == self.fmt.end and self.thinking:
                self.thinking, self.trim, self.held = False, True, ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if self.trim:
            text = text.lstrip()
            if not text:
                return
            self.trim = False
        if not self.thinking:
            if text:
                out.append(text)
            return
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if body:
            out.append(Thought(body))

    def rest(self) -> list:
        out: list = []
        rest, self.buffer = self.buffer, ""
        self._emit(out, rest)
        self.held = ""
        return out


class HarmonyStream:
    """gpt-oss's harmony messages: [<|start|>ROLE] HEADER <|message|> BODY <|end|> (or
    <|call|>, <|return|>, the end of the output). The analysis channel is thinking, final
    the answer, commentary to=functions.NAME a call (its body the JSON arguments),
    commentary without a recipient a preamble (answer text). Segments as OutputSplitter's."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self, calls: CallFormat | None, tools: list[dict], parallel: bool = True, thinking: bool = False):
        self.calls, self.tools, self.parallel = calls, tools, parallel
        self.buffer = ""
        self.in_body = thinking
        self.route = "reasoning" if thinking else None  # "reasoning" | "content" | "call:NAME"
        self.body = ""  # a call's arguments so far
        self.header = ""
        self.started = False  # some message has been seen
        self.num_calls = 0
        self.trim = thinking

    def segments(self, text: str) -> list:
        self.buffer += text
        out: list = []
        while self.buffer:
            marks = self.ENDS if self.in_body else ("<|message|>",)
            found = min(((i, m) for m in marks if (i := self.buffer.find(m)) >= 0), default=None)
            if found is None:
                keep = max(partial_suffix(self.buffer, m) for m in HARMONY_TOKENS)
                self._take(out, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            i, mark = found
            self._take(out, self.buffer[:i])
            self.buffer = self.buffer[i + len(mark):]
            if self.in_body:
                self._close(out)
            else:
                self._open()
        return out

    def _take(self, out: list, text: str) -> None:
        if not text:
            return
        if not self.in_body:
            self.header += text
            return
        if self.route.startswith("call:"):
            self.body += text
            return
        if self.trim:
            text = text.lstrip()
            if not text:
                return
            self.trim = False
        out.append(Thought(text) if self.route == "reasoning" else text)

    def _open(self) -> None:
        """A header is complete: where its body goes."""
        header, self.header = self.header, ""
        self.started, self.in_body, self.trim, self.body = True, True, True, ""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith("functions.") and self.calls is not None:
            self.route = "call:" + recipient.group(1)[len("functions."):]
        elif channel is not None and channel.group(1) == "analysis":
            self.route = "reasoning"
        else:
            self.route = "content"

    def _close(self, out: list, closed: bool = True) -> None:
        route, self.in_body = self.route, False
        if not route.startswith("call:"):
            return
        body, self.body = self.body, ""
        try:
            args = json.loads(body) if body.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("the arguments are not an object")
        except (ValueError, RecursionError):  # nested deeper than Python parses, too
            if body:
                out.append(body)  # a malformed call stays visible as text
            return
        if self.parallel or self.num_calls == 0:
            out.append(self.calls.tool_call(route[len("call:"):], json.dumps(args, ensure_ascii=False), self.num_calls))
            self.num_calls += 1

    def rest(self) -> list:
        out: list = []
        rest, self.buffer = self.buffer, ""
        self._take(out, rest)
        if self.in_body:
            self._close(out, closed=False)
        elif self.header and not self.started and "<|" not in self.header:
            out.append(self.header)  # no channel at all: the model answered plainly
        self.header = ""
        return out


class OutputSplitter:
    """A sample's output as `Thought`, content text and tool calls, in the model's order
    (see the module docstring). `reasoning` splits the thinking off, `tools` cuts calls out
    of the rest; harmony does both."""

    def __init__(self, reasoning: ThinkStream | HarmonyStream | None, tools: ToolCallStream | None):
        self.reasoning, self.tools = reasoning, tools

    @property
    def num_calls(self) -> int:
        if isinstance(self.reasoning, HarmonyStream):
            return self.reasoning.num_calls
        return self.tools.num_calls if self.tools is not None else 0

    def segments(self, text: str) -> list:
        parts = self.reasoning.segments(text) if self.reasoning is not None else [text]
        return self._calls(parts, final=False)

    def rest(self) -> list:
        parts = self.reasoning.rest() if self.reasoning is not None else []
        return self._calls(parts, final=True)

    def _calls(self, parts: list, final: bool) -> list:
        if self.tools is None or isinstance(self.reasoning, HarmonyStream):
            out = [p for p in parts if p != ""]
            return out
        out: list = []
        for p in parts:
            if isinstance(p, str) and not isinstance(p, Thought):
                out += self.tools.segments(p)
            else:
                out.append(p)
        if final:
            out += self.tools.rest()
        return [p for p in out if p != ""]


def make_splitter(fmt: ReasoningFormat | None, state: str, calls: CallFormat | None, tools: list[dict],
                  parallel: bool = True, hidden: tuple[str, ...] = ()) -> OutputSplitter | None:
    """The splitter for one sample of a request (None: nothing to split); `hidden`: the call
    markers that are special tokens (see ToolCallStream)."""
    if fmt is not None and fmt.harmony:
        return OutputSplitter(HarmonyStream(calls, tools, parallel, thinking=state == "open"), None)
    think = ThinkStream(fmt, thinking=state == "open") if fmt is not None else None
    stream = calls.stream(tools, parallel, hidden) if calls is not None else None
    if think is None and stream is None:
        return None
    return OutputSplitter(think, stream)


# -- the thinking, on tokens --------------------------------------------------------------------
@dataclass(frozen=True)
class ThinkingSpec:
    """What the engine follows of a request's thinking: the markers' texts, whether the
    prompt left the thinking open, the budget (thinking tokens before `end_ids` is forced;
    None: no budget) and the end marker's token ids."""

    start: str
    end: str
    open: bool = False
    budget: int | None = None
    end_ids: tuple[int, ...] = ()


class ThinkingTracker:
    """The thinking of one sample, token by token (`add`): `reasoning_tokens` counts the
    tokens after an opening marker through its closing one (the markers are matched as
    text, however they were tokenized); `must_end` is true once the budget's worth of
    thinking tokens has passed (the engine then forces `end_ids`).
    `token_text(id)` is a token's text with special tokens spelled out."""

    def __init__(self, spec: ThinkingSpec, token_text: Callable[[int], str]):
        self.spec, self.token_text = spec, token_text
        self.thinking = spec.open
        self.count = 0  # tokens of the current thinking block
        self.reasoning_tokens = 0
        self.tail = ""
        self._keep = max(len(spec.start), len(spec.end))

    def add(self, token: int) -> None:
        self.tail = (self.tail + self.token_text(token))[-self._keep:]
        if self.thinking:
            self.reasoning_tokens += 1
            self.count += 1
            if self.tail.endswith(self.spec.end):
                self.thinking, self.tail, self.count = False, "", 0
        elif self.tail.endswith(self.spec.start):
            self.thinking, self.tail, self.count = True, "", 0

    @property
    def must_end(self) -> bool:
        b = self.spec.budget
        return self.thinking and b is not None and self.count >= b


@dataclass(frozen=True)
class ThinkingGrammar:
    """A thinking block as a grammar sees it: its markers as grammar atoms (a quoted string,
    or <[id]> for a special token), whether it is already open (it must come and close),
    or may come first (`optional`); `space`: a little whitespace may follow it (the
    "\n\n" after </think>; harmony has none)."""

    start: str
    end: str
    open: bool
    optional: bool
    space: bool = True
