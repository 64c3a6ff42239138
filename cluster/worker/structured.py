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

Why llguidance (`load/bench_structured.py --only masks`; MEASUREMENTS.md): xgrammar's
per-token mask is much cheaper (it precomputes per-state token masks when it compiles),
but that compile is hundreds of times longer than llguidance's for a modest schema and
grows with the vocabulary. Agents send a new schema (or tool set) with many requests, so
xgrammar's compile lands on time to first token, while llguidance's masks run on the
engine thread while MLX computes the forward, a small part of a step. llguidance also
takes Lark grammars, writes masks straight into a numpy bitmask with the GIL released,
and needs no torch (xgrammar's Python package imports it).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from cluster.formats.calls import CallGrammar
from cluster.formats.grammar import JSON_OPTIONS, call_schema
from cluster.formats.thinking import ThinkingGrammar
from cluster.worker.sampling_params import StructuredOutput
from cluster.worker.vocabulary import lltokenizer

_CACHE_SIZE = 256
# A grammar whose compile took this long holds a large lexer (a regex such as a{100000}: tens
# of MB); at most _COSTLY_ENTRIES of those stay cached, so the cache's memory is bounded too.
_COSTLY_SECONDS = 0.1
_COSTLY_ENTRIES = 4
# llguidance builds a grammar's regexes within this much "fuel" (its default, 1,000,000, lets
# one regex take a second and tens of MB; 400,000 still compiles an enum of 20,000 strings).
_LEXER_FUEL = 400_000
_PROBE_TOKENS = 256  # forced tokens a new grammar's first walk follows at most


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
    if spec.kind == "llguidance":
        return spec.spec
    if spec.kind == "regex":
        return M.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        if any(not c for c in spec.spec):
            raise InvalidGrammar("a choice list cannot hold an empty string")
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.spec))
    return M.grammar_from_lark(spec.spec)


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe (the worker's asyncio side checks
    a request's spec before queueing it, the engine thread takes matchers).

    A spec is compiled, then walked a first step on a copy (`_first_steps`): a grammar no
    output can match (a schema that only refers to itself, a regex of no string), one that
    matches only the empty string, and one past llguidance's limits on its first tokens
    (a{1000000}) are refused here, as the request's fault, before any engine work. Refusals
    are cached too (their message), so a client repeating one pays nothing again. The
    cache is bounded in memory as well as in entries: of the grammars that were costly to
    compile (large lexers), only the last few stay."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int] = ()):
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF one
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok = None
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()  # a matcher, or a refusal's message
        self._costly: OrderedDict[StructuredOutput, None] = OrderedDict()  # cached specs that took long
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses, for tests

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                try:
                    self._lltok = lltokenizer(self._hf, self.vocab_size, self._eos)
                except ValueError as e:  # what this model's tokenizer cannot give the grammar engine
                    raise InvalidGrammar(str(e)) from None
            return self._lltok

    def compile(self, spec: StructuredOutput):
        """The cached, untouched matcher for `spec`; InvalidGrammar naming the problem."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if isinstance(hit, str):
            raise InvalidGrammar(hit)
        if hit is not None:
            return hit
        start = time.perf_counter()
        try:
            matcher = self._compile(spec)
        except InvalidGrammar as e:
            refusal = str(e)
        else:
            self._remember(spec, matcher, costly=time.perf_counter() - start >= _COSTLY_SECONDS)
            return matcher
        # a new exception, raised here: the refusal's own traceback holds the frames that built
        # and walked the matcher, and so the matcher and its copy (tens of MB), for as
        # long as the exception lives; the worker's error path leaves exceptions in reference
        # cycles that only Python's next full collection frees
        self._remember(spec, refusal)
        raise InvalidGrammar(refusal)

    def forget(self, spec: StructuredOutput) -> None:
        """Drop `spec`'s matcher: a sequence found it past llguidance's limits (their budget,
        the lexer's, is shared by every copy), so the next request compiles it afresh."""
        with self._lock:
            self._cache.pop(spec, None)
            self._costly.pop(spec, None)

    def _remember(self, spec: StructuredOutput, entry, costly: bool = False) -> None:
        with self._lock:
            self.compiles += 1
            self._cache[spec] = entry
            if costly:
                self._costly[spec] = None
                while len(self._costly) > _COSTLY_ENTRIES:
                    self._cache.pop(self._costly.popitem(last=False)[0], None)
            while len(self._cache) > _CACHE_SIZE:
                self._costly.pop(self._cache.popitem(last=False)[0], None)

    def _compile(self, spec: StructuredOutput):
        import llguidance

        tok = self.lltokenizer
        grammar = grammar_text(spec)
        what = spec.kind.replace("_", " ")
        error = llguidance.LLMatcher.validate_grammar(grammar, tok, limits=_limits())
        if error:
            raise InvalidGrammar(f"the {what} cannot be compiled: {_first_line(error)}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise InvalidGrammar(f"the {what} cannot be compiled: {_first_line(matcher.get_error())}")
        self._first_steps(matcher, what)
        return matcher

    def _first_steps(self, matcher, what: str) -> None:
        """Walk a copy of `matcher` through its first mask, the text it forces (a tool call's
        opening, at most _PROBE_TOKENS tokens) or else one allowed token, and the next mask;
        InvalidGrammar when that shows no output can follow it (see the class)."""
        probe = matcher.deep_copy()
        mask = allocate_bitmask(1, self.vocab_size)
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if probe.is_error():
            raise InvalidGrammar(f"the {what} matches no output: {_first_line(probe.get_error())}")
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:self.vocab_size])
        text = [int(t) for t in allowed if int(t) not in self._eos]
        if not text:
            raise InvalidGrammar(f"the {what} matches only the empty string: there is nothing to generate")
        forced = probe.compute_ff_tokens()[:_PROBE_TOKENS]
        if probe.is_error() or not probe.consume_tokens(forced or text[:1]) or probe.is_error():
            raise InvalidGrammar(f"the {what} cannot be followed past its first tokens: "
                                 f"{_first_line(probe.get_error())}")
        if not probe.is_stopped():
            probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if probe.is_error():
                raise InvalidGrammar(f"the {what} matches no output past its first tokens: "
                                     f"{_first_line(probe.get_error())}")

    def matcher_for(self, spec: StructuredOutput, tokens: Sequence[int] = ()):
        """A fresh matcher for one sequence, advanced over `tokens` (already generated);
        InvalidGrammar when those tokens do not fit the grammar."""
        matcher = self.compile(spec).deep_copy()
        if tokens and not matcher.consume_tokens([int(t) for t in tokens]):
            raise InvalidGrammar(f"the tokens already generated do not fit the {spec.kind.replace('_', ' ')}: "
                                 f"{_first_line(matcher.get_error())}")
        return matcher


def grammar_error(spec: StructuredOutput, matcher, num_tokens: int) -> str:
    """What to tell a client whose sequence's matcher gave up after `num_tokens` tokens."""
    return (f"the structured output's {spec.kind.replace('_', ' ')} could not be followed after {num_tokens} "
            f"tokens (it runs past the constrained decoder's limits: simplify it): "
            f"{_first_line(matcher.get_error())}")


def _first_line(error: str) -> str:
    """An llguidance error on one line, without the parser state it may append."""
    text = " ".join((error or "").split("<state>", 1)[0].replace("<non-verbose/>", "").split())
    if text == "NoExtensionBias":  # llguidance's word for a grammar with no string in it
        text = "no finite text satisfies it (NoExtensionBias)"
    return text if len(text) <= 300 else text[:300] + "..."


_LIMITS = None


def _limits():
    """llguidance's limits: its defaults but the lexer's fuel (_LEXER_FUEL), with short
    errors (no parser state in messages or logs)."""
    global _LIMITS
    if _LIMITS is None:
        import llguidance

        _LIMITS = llguidance.LLParserLimits(verbose_errors=False, initial_lexer_fuel=_LEXER_FUEL)
    return _LIMITS


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


_PARALLEL_ROWS = 8  # from this many constrained rows, llguidance's thread pool fills them
_executor = None


def fill_bitmasks(matchers: Sequence[Any], vocab_size: int,
                  drafts: Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """One allowed-token bitmask row per matcher (llguidance writes straight into it, with
    the GIL released, so this can run while MLX computes the forward). With `drafts`
    (speculative decoding), matcher i gets 1 + len(drafts[i]) rows: row j is its mask
    after its first j drafts (consumed, then rolled back: the matcher is left as it was;
    the drafts are a prefix the grammar accepts, `validate_tokens`)."""
    global _executor
    if drafts is not None and any(drafts):
        mask = allocate_bitmask(sum(1 + len(d) for d in drafts), vocab_size)
        width = mask.shape[1] * 4
        row = 0
        for m, d in zip(matchers, drafts):
            for j in range(len(d) + 1):
                m.unsafe_compute_mask_ptr(mask[row].ctypes.data, width)
                row += 1
                if j < len(d) and not m.consume_token(d[j]):
                    raise RuntimeError(f"a draft token the grammar accepted ({d[j]}) was refused: {m.get_error()}")
            if d:
                m.rollback(len(d))
        return mask
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
def tool_call_constraint(tools: Sequence[dict], tool_choice: str | dict = "required",
                         family_format: tuple[str, str] | None = None) -> StructuredOutput:
    """A constraint that forces one tool call as JSON, {"name": ..., "arguments": {...}},
    the arguments following the function's `parameters` schema (its objects closed to
    undeclared keys: cluster/formats/grammar.py's `closed_objects`; a schema with local references, such as pydantic's
    `$defs` and "#/$defs/Loc", moved under the wrapper's `$defs` with them rebased): any of
    `tools` for
    `tool_choice="required"`, or the named one (`"name"`, or OpenAI's
    {"type": "function", "function": {"name": ...}}). `tools` are in OpenAI's shape
    ({"type": "function", "function": {"name", "parameters"}}) or bare functions.
    `family_format` = (opening, closing) text the family puts around a call (Hermes:
    ("<tool_call>\\n", "\\n</tool_call>")); None: the JSON alone (a json_schema spec).
    Markers are matched as text: right for the families whose markers are ordinary added
    tokens (Hermes/Qwen, see `cluster/worker/vocabulary.py`); a marker that is a special token
    would need llguidance's token syntax instead (`call_constraint` writes it so)."""
    chosen = _chosen(tools, tool_choice)
    schema = call_schema(chosen)
    if family_format is None:
        return StructuredOutput("json_schema", json.dumps(schema))
    schema["x-guidance"] = JSON_OPTIONS  # a Lark %json block takes its options from the schema
    parts = [json.dumps(text) for text in (family_format[0], "") if text] + ["call"]
    parts += [json.dumps(family_format[1])] if family_format[1] else []
    return StructuredOutput("grammar", f"start: {' '.join(parts)}\ncall: %json {json.dumps(schema)}\n")


def _chosen(tools: Sequence[dict], tool_choice: str | dict) -> list[dict]:
    functions = [t.get("function", t) for t in tools]
    if not functions or any(not isinstance(f.get("name"), str) for f in functions):
        raise InvalidGrammar("tools must be a non-empty list of functions with a name")
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if tool_choice == "required":
        return functions
    chosen = [f for f in functions if f["name"] == tool_choice]
    if not chosen:
        raise InvalidGrammar(f"tool_choice names {tool_choice!r}, which is not among the tools")
    return chosen


def call_constraint(grammar: CallGrammar, tools: Sequence[dict], tool_choice: str | dict, atom: Callable[[str], str],
                    start: str = "", end: str = "") -> StructuredOutput:
    """One tool call in a family's own format (`grammar`: its `CallFormat.grammar`, given
    the format's `start` and `end` markers; cluster/formats/), to any of `tools`
    (tool_choice "required") or the named one, its arguments following the function's
    schema (closed to undeclared keys). `atom(text)` is how the grammar names a marker:
    <[id]> for a special token, the quoted text for one that decodes as text."""
    return StructuredOutput("grammar", grammar(_chosen(tools, tool_choice), atom, start, end))


def with_thinking(spec: StructuredOutput, thinking: ThinkingGrammar | None,
                  answer_prefix: str = "") -> StructuredOutput:
    """`spec` applied to the answer after a thinking block (free text up to the end marker:
    the thinking itself is never constrained), as one llguidance grammar: the block comes
    first when the prompt left it open, may come first when `thinking.optional`.
    `answer_prefix`: grammar atoms the answer starts with (harmony's final channel)."""
    text = grammar_text(spec)
    if text.lstrip().startswith("{"):
        grammars = json.loads(text)["grammars"]
    else:
        grammars = [{"name": "answer", "lark_grammar": text}]
    grammars = [dict(grammars[0], name="answer")] + grammars[1:]
    top = f"start: {'' if thinking is None else 'think? ' if thinking.optional else 'think '}answer\n"
    top += f"answer: {answer_prefix} @answer\n"
    if thinking is not None:
        opening = "" if thinking.open else thinking.start
        space = " WS" if thinking.space else ""
        if thinking.end.startswith("<["):  # a special token: text lexemes never match it
            top += f"think: {opening} TEXT {thinking.end}{space}\n"
        else:
            top += f"think: {opening} body{space}\nbody[lazy]: TEXT {thinking.end}\n"
        top += "TEXT: /(.|\\n)*/\n"
        if thinking.space:
            top += "WS: /[ \\t\\r\\n]{0,4}/\n"  # the "\\n\\n" after </think>, bounded
    return StructuredOutput("llguidance", json.dumps({"grammars": [{"name": "main", "lark_grammar": top}] + grammars}))
