"""`Family`, one row of the registry (cluster/formats/registry.py): how a model of a
family is recognised, and the formats it then has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat
from cluster.formats.thinking import ReasoningFormat


@dataclass(frozen=True)
class Family:
    """One row of the registry: a model family, or a format several families share, and how
    a model of it is recognised from its chat template (`template`, "" when it has none)
    and vocabulary. `calls(template, vocab, mlx_lm)` is its tool-call format or None (not
    this family's model; `mlx_lm`: what mlx-lm's tokenizer found, or None);
    `reasoning(template, vocab)` its thinking markers or None. The registry asks its rows
    in order and takes the first answer."""

    name: str
    calls: Callable[[str, Mapping[str, int], MlxLmCalls | None], CallFormat | None] | None = None
    reasoning: Callable[[str, Mapping[str, int]], ReasoningFormat | None] | None = None
