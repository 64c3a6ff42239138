"""What every format module shares: the thinking text type, the partial-marker rule, the
shapes of a call parser and of what mlx-lm finds. Nothing here imports MLX."""

from __future__ import annotations

from typing import Any, Callable

ToolParser = Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools): a call dict or a list of them
# what mlx-lm's tokenizer found: its tool_call_start, tool_call_end, parse_tool_call and the parser's module name
MlxLmCalls = tuple[str, str, ToolParser, str]


class Thought(str):
    """Thinking text among an output's segments (cluster/formats/split.py cuts it out);
    cluster/api/tools.py's `split_chunk` puts it in a chunk's `reasoning`."""


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
