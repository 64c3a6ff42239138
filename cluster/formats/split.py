"""One sample's output split into thinking, content and tool calls, in the model's order:
a family's thinking stream (cluster/formats/thinking.py, or the family's own splitter)
and its call stream (cluster/formats/calls.py) one after the other. Nothing here imports
MLX."""

from __future__ import annotations

from cluster.formats.base import Thought
from cluster.formats.calls import CallFormat, ToolCallStream
from cluster.formats.thinking import ReasoningFormat, ThinkStream


class OutputSplitter:
    """A sample's output as `Thought`, content text and tool calls, in the model's order
    (see cluster/formats/thinking.py). `reasoning` splits the thinking off, `tools` cuts
    calls out of the rest; a family's own splitter (harmony's) does both, with no `tools`."""

    def __init__(self, reasoning, tools: ToolCallStream | None):
        self.reasoning, self.tools = reasoning, tools

    @property
    def num_calls(self) -> int:
        if self.tools is not None:
            return self.tools.num_calls
        return getattr(self.reasoning, "num_calls", 0)

    def segments(self, text: str) -> list:
        parts = self.reasoning.segments(text) if self.reasoning is not None else [text]
        return self._calls(parts, final=False)

    def rest(self) -> list:
        parts = self.reasoning.rest() if self.reasoning is not None else []
        return self._calls(parts, final=True)

    def _calls(self, parts: list, final: bool) -> list:
        if self.tools is None:
            return [p for p in parts if p != ""]
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
    if fmt is not None and fmt.splitter is not None:
        return OutputSplitter(fmt.splitter(calls, tools, parallel, thinking=state == "open"), None)
    think = ThinkStream(fmt, thinking=state == "open") if fmt is not None else None
    stream = calls.stream(tools, parallel, hidden) if calls is not None else None
    if think is None and stream is None:
        return None
    return OutputSplitter(think, stream)

