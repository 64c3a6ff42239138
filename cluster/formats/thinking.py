"""Thinking: how a family marks it (`ReasoningFormat`), where a rendered prompt leaves it,
the thinking cut out of an output's text (`ThinkStream`), followed over token ids
(`ThinkingTracker`), and what a grammar needs to leave it free (`ThinkingGrammar`).
Nothing here imports MLX.

Contract
--------
- A family's module names its markers (cluster/formats/think.py: <think>...</think>, shared
  by Qwen3, QwQ, DeepSeek-R1 and V3.1, Kimi K2 Thinking, GLM-4.5, Nemotron; mistral.py:
  [THINK]...[/THINK]; granite.py: <think>...</think> then <response>...</response> as
  plain text; harmony.py: gpt-oss's channels); the registry finds a model's
  (`reasoning_format`). Markers may be special tokens: the worker decodes the output with
  the family's markers kept (`ReasoningFormat.markers`).
- `prompt_state(fmt, prompt_tail)`: "open" when the rendered prompt leaves a thinking block
  open (QwQ, DeepSeek-R1, V3.1 with thinking, Nemotron: the output starts inside it),
  "closed" when it closed one (Qwen3 with enable_thinking=False: no thinking follows),
  else "free" (the model opens one or not).
- The splitter (cluster/formats/split.py, one per sample) takes the output text chunk by
  chunk and returns segments in the model's order: `Thought` (thinking text), content text
  (str) and tool calls (pb.ToolCall). Thinking never reaches the content, calls are parsed
  only outside it, markers appear in neither; text that could be the start of a marker is
  held back until it is known. At the end a thinking block never closed (max_tokens inside
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

from dataclasses import dataclass, field
from typing import Callable

from cluster.formats.base import Thought, partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    """How a family marks its thinking: `start` ... `end`, as text (a special token's text
    when the marker is one); `strip`: markers dropped from the answer; `kept`: the token
    texts to keep when decoding, where they are more than these markers; `splitter`: a
    stream of the family's own that splits the thinking and the calls together
    (`splitter(calls, tools, parallel, thinking=...)`; harmony), else the thinking is split
    by `ThinkStream` and calls by the call format's stream. `grammar_start`, `grammar_end`
    and `answer_start`: the thinking block's opening and closing and the answer's opening
    as a grammar writes them, token texts each named by the grammar's `atom` (by default
    `start`, `end` and nothing)."""

    name: str
    start: str
    end: str
    strip: tuple[str, ...] = ()
    harmony: bool = False
    kept: tuple[str, ...] = ()
    splitter: Callable | None = field(default=None, compare=False)
    grammar_start: tuple[str, ...] = ()
    grammar_end: tuple[str, ...] = ()
    answer_start: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        """Token texts that must survive decoding for the parser to see them."""
        return self.kept or (self.start, self.end, *self.strip)

    def thinking_grammar(self, atom: Callable[[str], str], open: bool, optional: bool) -> ThinkingGrammar:
        """The thinking block as the grammar of the answer after it sees it (see ThinkingGrammar)."""
        start = " ".join(atom(t) for t in self.grammar_start or (self.start,))
        end = " ".join(atom(t) for t in self.grammar_end or (self.end,))
        return ThinkingGrammar(start, end, open=open, optional=optional, space=not self.harmony)

    def answer_prefix(self, atom: Callable[[str], str]) -> str:
        """The grammar atoms a structured answer starts with (harmony's final channel)."""
        return " ".join(atom(t) for t in self.answer_start)


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
