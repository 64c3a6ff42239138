"""NVIDIA Nemotron (Nemotron-H, Nemotron Nano 2): calls as a JSON list in
<TOOLCALL>[...]</TOOLCALL>. Nano 2's thinking is think.py's <think>, opened in the prompt."""

from __future__ import annotations

from typing import Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, parse_json_calls
from cluster.formats.family import Family
from cluster.formats.grammar import json_list

NEMOTRON_CALLS = CallFormat("nemotron", "<TOOLCALL>", "</TOOLCALL>", parse_json_calls, ("<TOOLCALL>", "</TOOLCALL>"),
                            grammar=json_list)


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    return NEMOTRON_CALLS if "<TOOLCALL>" in template else None


FAMILY = Family("nemotron", calls=call_format)
