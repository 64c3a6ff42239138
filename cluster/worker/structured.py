"""Structured outputs by constrained decoding, with llguidance.

A request's `StructuredOutput` (a JSON schema, any JSON object, a regex, a choice list, a
Lark grammar) compiles once per distinct spec into an llguidance grammar and a fresh
`LLMatcher`, kept in a small LRU cache (`GrammarCompiler`); every sequence gets a copy of
the cached matcher. Before each step the engine asks every constrained row's matcher for
its allowed-token bitmask (`fill_bitmasks`, one int32 array for all such rows, computed
while the forward runs); the sampler sets the other tokens to -inf; the sampled token is
then consumed by the matcher, and the sequence finishes (finish_reason "stop") as soon as
the matcher says nothing more can follow.

The matcher follows the sequence's output tokens, which preemption by recompute keeps:
it needs no rebuilding then. A request resumed on another worker (router failover)
rebuilds it from the resumed tokens (`matcher_for(..., tokens)`).

Why llguidance (measured with `load/bench_structured.py --only masks`, this machine's CPU,
2 shared cores, the built-in model's byte-level BPE of 8,192 tokens, 2026-11-24): per
token, llguidance's mask took 35-40 us, xgrammar 0.2.8's 1.9-2.6 us (about 15x less:
it precomputes per-state token masks when it compiles); but that compile took 586 ms
for a modest schema (an object with nested object, bounded string and number array)
against llguidance's 1.5 ms, and grows with the vocabulary. Agents send a new schema
(or tool set) with many requests, so xgrammar's compile lands on time to first token,
while llguidance's mask, 64 rows x 40 us = 2.5 ms a step, runs on the engine thread
while MLX computes the forward (a CPU decode step here is 80+ ms). llguidance also
takes Lark grammars, writes masks straight into a numpy bitmask with the GIL released,
and needs no torch (xgrammar's Python package imports it).
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import numpy as np

from cluster.worker.sampling_params import StructuredOutput

_CACHE_SIZE = 256
# OpenAI's layout, {"a": 1, "b": [2, 3]}, and no other whitespace: a model (a random one
# above all) given free whitespace can spend its whole budget on it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class InvalidGrammar(ValueError):
    """A structured-output spec that cannot be compiled: the message says why."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for `spec`; InvalidGrammar for a spec that
    is malformed before any compiling (a schema that is not JSON, ...)."""
    import llguidance

    M = llguidance.LLMatcher
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except ValueError as e:
            raise InvalidGrammar(f"the JSON schema is not valid JSON: {e}") from None
        if schema is False:
            raise InvalidGrammar("the JSON schema is `false`, which no output satisfies")
        if schema is True:
            schema = {}  # any JSON value
        if not isinstance(schema, dict):
            raise InvalidGrammar("the JSON schema must be a JSON object")
        try:
            return M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, RuntimeError) as e:  # llguidance's own complaint, as the request's fault
            raise InvalidGrammar(f"the JSON schema cannot be compiled: {e}") from None
    if spec.kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return M.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        if any(not c for c in spec.spec):
            raise InvalidGrammar("a choice list cannot hold an empty string")
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.spec))
    return M.grammar_from_lark(spec.spec)


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe (the worker's asyncio side checks
    a request's spec before queueing it, the engine thread takes matchers)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int] = ()):
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF one
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok = None
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses, for tests

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(_plain_added_tokens(self._hf), n_vocab=self.vocab_size,
                                                     eos_token=self._eos or None)
            return self._lltok

    def compile(self, spec: StructuredOutput):
        """The cached, untouched matcher for `spec`; InvalidGrammar naming the problem."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        import llguidance

        tok = self.lltokenizer
        grammar = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise InvalidGrammar(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {error.strip()}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {matcher.get_error()}")
        with self._lock:
            self.compiles += 1
            self._cache[spec] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher_for(self, spec: StructuredOutput, tokens: Sequence[int] = ()):
        """A fresh matcher for one sequence, advanced over `tokens` (already generated);
        InvalidGrammar when those tokens do not fit the grammar."""
        matcher = self.compile(spec).deep_copy()
        if tokens and not matcher.consume_tokens([int(t) for t in tokens]):
            raise InvalidGrammar(f"the tokens already generated do not fit the {spec.kind.replace('_', ' ')}: "
                                 f"{matcher.get_error()}")
        return matcher


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE: each byte as the printable character a vocabulary uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _plain_added_tokens(hf) -> str:
    """The tokenizer's JSON for llguidance, with added tokens that are not special (tool-
    call markers such as Qwen's <tool_call>) moved into a byte-level BPE vocabulary:
    llguidance takes every added token as special, so a grammar's literal "<tool_call>"
    would never match the marker token the model actually emits."""
    backend = copy.copy(hf.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    model = data.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(data.get("pre_tokenizer")) or "ByteLevel" in json.dumps(data.get("decoder"))
    if model.get("type") != "BPE" or not byte_level:
        return json.dumps(data)
    alphabet = _byte_level_alphabet()
    keep = []
    for added in data.get("added_tokens", []):
        if added.get("special", True):
            keep.append(added)
        else:
            model["vocab"]["".join(alphabet[b] for b in added["content"].encode())] = added["id"]
    data["added_tokens"] = keep
    return json.dumps(data)


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


_PARALLEL_ROWS = 8  # from this many constrained rows, llguidance's thread pool fills them
_executor = None


def fill_bitmasks(matchers: Sequence[Any], vocab_size: int) -> np.ndarray:
    """One allowed-token bitmask row per matcher (llguidance writes straight into it, with
    the GIL released, so this can run while MLX computes the forward)."""
    global _executor
    mask = allocate_bitmask(len(matchers), vocab_size)
    width = mask.shape[1] * 4
    if len(matchers) >= _PARALLEL_ROWS:
        import llguidance

        if _executor is None:
            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.ctypes.data, width,
                                          len(matchers))
        return mask
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(mask[i].ctypes.data, width)
    return mask


# -- tool calls ---------------------------------------------------------------------------
def closed_objects(schema):
    """`schema` with `additionalProperties: false` wherever an object lists its properties
    and says nothing about others (xgrammar's strict mode, vLLM's default for tool calls):
    arguments hold the declared parameters only, instead of whatever keys a model invents."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMA_KEYS = frozenset({"items", "prefixItems", "anyOf", "allOf", "oneOf", "not", "if", "then", "else",
                             "additionalProperties", "contains"})


def tool_call_constraint(tools: Sequence[dict], tool_choice: str | dict = "required",
                         family_format: tuple[str, str] | None = None) -> StructuredOutput:
    """A constraint that forces one tool call as JSON, {"name": ..., "arguments": {...}},
    the arguments following the function's `parameters` schema (its objects closed to
    undeclared keys: `closed_objects`): any of `tools` for
    `tool_choice="required"`, or the named one (`"name"`, or OpenAI's
    {"type": "function", "function": {"name": ...}}). `tools` are in OpenAI's shape
    ({"type": "function", "function": {"name", "parameters"}}) or bare functions.
    `family_format` = (opening, closing) text the family puts around a call (Hermes:
    ("<tool_call>\\n", "\\n</tool_call>")); None: the JSON alone (a json_schema spec).
    Markers are matched as text: right for the families whose markers are ordinary added
    tokens (Hermes/Qwen, see `_plain_added_tokens`); a marker that is a special token
    would need llguidance's `<|name|>` token syntax instead."""
    functions = [t.get("function", t) for t in tools]
    if not functions or any(not isinstance(f.get("name"), str) for f in functions):
        raise InvalidGrammar("tools must be a non-empty list of functions with a name")
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if tool_choice == "required":
        chosen = functions
    else:
        chosen = [f for f in functions if f["name"] == tool_choice]
        if not chosen:
            raise InvalidGrammar(f"tool_choice names {tool_choice!r}, which is not among the tools")
    variants = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       "arguments": closed_objects(f.get("parameters") or {"type": "object", "properties": {}})},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for f in chosen]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if family_format is None:
        return StructuredOutput("json_schema", json.dumps(schema))
    schema["x-guidance"] = JSON_OPTIONS  # a Lark %json block takes its options from the schema
    parts = [json.dumps(text) for text in (family_format[0], "") if text] + ["call"]
    parts += [json.dumps(family_format[1])] if family_format[1] else []
    return StructuredOutput("grammar", f"start: {' '.join(parts)}\ncall: %json {json.dumps(schema)}\n")
