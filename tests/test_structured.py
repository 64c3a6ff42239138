"""Structured outputs by constrained decoding, in the engine: with random weights every
constrained output must be valid (jsonschema, re.fullmatch, choice membership); rows
without a constraint are token-identical beside constrained ones; preemption and resume
keep the grammar in step; bad specs are refused naming the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from cluster.formats.grammar import closed_objects
from cluster.modelgen import create_model
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.sampling_params import SamplingParams, StructuredOutput
from cluster.worker.structured import GrammarCompiler, InvalidGrammar, tool_call_constraint

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5},
                                                  "role": {"enum": ["admin", "guest", "dev"]}},
                 "required": ["id", "role"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}},
     "required": ["user", "tags", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, "three", None]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "label": {"const": "x"}},
     "required": ["score", "label"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_model(tmp_path_factory.mktemp("structured") / "qwen3", "qwen3", "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=256, max_model_len=1024))


def run(engine, prompts, params) -> list[tuple[str, list[int], str]]:
    """(text, tokens, finish reason) per prompt; `params` one per prompt or shared."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    text = {rid: "" for rid in ids}
    tokens = {rid: [] for rid in ids}
    reason = {}
    while engine.has_unfinished():
        for o in engine.step():
            text[o.request_id] += o.new_text
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reason[o.request_id] = o.finish_reason
    return [(text[r], tokens[r], reason[r]) for r in ids]


def prompts(engine, n):
    return [engine.tokenizer.encode(f"Request {i}: answer in JSON about item {i * 7}.") for i in range(n)]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "array-enum", "number-range"])
def test_every_json_schema_output_is_valid(engine, schema):
    spec = StructuredOutput("json_schema", json.dumps(schema))
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured=spec) for s in range(5)]
    params.append(SamplingParams(max_tokens=120, temperature=0.0, structured=spec))
    for text, _, reason in run(engine, prompts(engine, len(params)), params):
        if reason == "length" and "score" in schema["properties"]:
            # a number's digits are unbounded: cut inside them, the rest must complete it
            assert re.fullmatch(r'\{"score": (0|1)\.?[0-9]*', text), text
            text += ', "label": "x"}'
        else:
            assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(engine):
    regex = r"(INV|ORD)-[0-9]{3,5}(\.[a-z]{1,3})?"
    choices = ("red", "green", "dark blue", "é")
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=StructuredOutput("regex", regex))
              for s in range(4)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured=StructuredOutput("choice", choices))
               for s in range(4)]
    params += [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured=StructuredOutput("json_object"))
               for s in range(3)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=9,
                              structured=StructuredOutput("grammar", 'start: "yes" | "no" | "n/a"'))]
    outs = run(engine, prompts(engine, len(params)), params)
    for (text, _, reason), p in zip(outs, params):
        kind = p.structured.kind
        if kind == "regex":
            assert reason == "stop" and re.fullmatch(regex, text), text
        elif kind == "choice":
            assert reason == "stop" and text in choices, text
        elif kind == "grammar":
            assert reason == "stop" and text in ("yes", "no", "n/a"), text
        elif reason == "stop":  # json_object: keys and values are free, so it may run out of tokens
            assert isinstance(json.loads(text), dict), text
        else:
            assert reason == "length" and text.startswith("{"), text
    assert any(p.structured.kind == "json_object" and r == "stop" for (_, _, r), p in zip(outs, params))


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(engine):
    ps = prompts(engine, 6)
    plain = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=16, temperature=0.9, seed=4, ignore_eos=True, logprobs=2)]
    alone = run(engine, ps[:2], plain)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[1]))
    mixed = run(engine, ps, plain + [SamplingParams(max_tokens=150, temperature=1.0, seed=s, structured=spec)
                                     for s in range(4)])
    assert [t for _, t, _ in mixed[:2]] == [t for _, t, _ in alone]
    for text, _, reason in mixed[2:]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_preemption_mid_output_keeps_the_grammar(model_dir):
    """A pool too small for everyone preempts structured sequences mid-output: each
    output is the one it makes alone, and valid."""
    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "minItems": 4, "maxItems": 6}},
              "required": ["words"], "additionalProperties": False}
    spec = StructuredOutput("json_schema", json.dumps(schema))
    small = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=14, block_size=16, max_model_len=224))
    big = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=256, max_model_len=1024))
    ps = [[(7 * i + j) % 500 + 3 for j in range(40)] for i in range(5)]
    params = [SamplingParams(max_tokens=150, temperature=1.0, seed=s, structured=spec) for s in range(5)]
    expected = [run(big, [p], [sp])[0] for p, sp in zip(ps, params)]
    got = run(small, ps, params)
    assert small.stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert got == expected
    for text, _, reason in got:
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
    small.check_integrity()


def test_resumed_tokens_rebuild_the_matcher(engine):
    """Router failover: the tokens already sent are consumed by a new matcher, and the
    rest of the output is what the first worker would have produced."""
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[0]))
    p = SamplingParams(max_tokens=80, temperature=0.8, seed=11, structured=spec)
    prompt = prompts(engine, 1)[0]
    (text, tokens, _), = run(engine, [prompt], p)
    engine.add_request("resumed", prompt, p, resume_token_ids=tokens[:5])
    rest = []
    while engine.has_unfinished():
        rest += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens[:5] + rest == tokens
    with pytest.raises(ValueError, match="do not fit"):
        engine.add_request("bad-resume", prompt, p, resume_token_ids=engine.tokenizer.encode("nope"))


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput("json_schema", '{"type": "objekt"}'), "objekt"),
    (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "string", "format": '
                                     '"no-such-format"}}}'), "no-such-format"),
    (StructuredOutput("regex", "a(b"), "unclosed group"),
    (StructuredOutput("grammar", "start: foo"), "foo"),
    (StructuredOutput("json_schema", "false"), "no output satisfies"),
])
def test_bad_specs_are_refused_naming_the_problem(engine, spec, words):
    with pytest.raises(InvalidGrammar, match=words):
        engine.grammars.compile(spec)
    with pytest.raises(ValueError, match=words):
        engine.add_request("bad", [5, 6], SamplingParams(structured=spec))
    assert not engine.has_unfinished()


def test_compiles_are_cached_by_spec_text(engine):
    g = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[2]))
    a, b = g.matcher_for(spec), g.matcher_for(StructuredOutput("json_schema", json.dumps(SCHEMAS[2])))
    assert g.compiles == 1 and a is not b
    g.matcher_for(StructuredOutput("regex", "x+"))
    assert g.compiles == 2


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("choice, family", [("required", None), ("add", None),
                                            ({"type": "function", "function": {"name": "get_weather"}}, None),
                                            ("required", ("<tool_call>\n", "\n</tool_call>"))])
def test_tool_call_constraint_forces_a_valid_call(engine, choice, family):
    spec = tool_call_constraint(TOOLS, choice, family)
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured=spec) for s in range(4)]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for text, _, reason in run(engine, prompts(engine, 4), params):
        assert reason == "stop", text
        if family:
            assert text.startswith(family[0]) and text.endswith(family[1])
            text = text[len(family[0]):-len(family[1])]
        call = json.loads(text)
        assert set(call) == {"name", "arguments"}
        wanted = choice if isinstance(choice, str) else choice["function"]["name"]
        assert call["name"] in by_name and (wanted == "required" or call["name"] == wanted)
        jsonschema.validate(call["arguments"], by_name[call["name"]])
    with pytest.raises(InvalidGrammar, match="not among the tools"):
        tool_call_constraint(TOOLS, "nope")


def test_every_sample_of_n_walks_its_own_grammar(engine):
    """n > 1 forks samples after the prompt: each sample is constrained, not only the first."""
    schema = SCHEMAS[0]
    spec = StructuredOutput("json_schema", json.dumps(schema))
    engine.add_request("n4", prompts(engine, 1)[0],
                       SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=4, structured=spec))
    text: dict[int, str] = {}
    reason: dict[int, str] = {}
    while engine.has_unfinished():
        for o in engine.step():
            text[o.index] = text.get(o.index, "") + o.new_text
            if o.finished:
                reason[o.index] = o.finish_reason
    assert sorted(reason) == [0, 1, 2, 3] and set(reason.values()) == {"stop"}, reason
    for i in range(4):
        jsonschema.validate(json.loads(text[i]), schema)
    assert len(set(text.values())) > 1  # four samples, not one copied


def test_tool_arguments_are_closed_to_undeclared_keys():
    """An object schema that lists properties and says nothing of others gets
    additionalProperties false (xgrammar's strict mode), at every depth; explicit choices stay."""
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {"y": {"type": "string"}}}},
        "c": {"anyOf": [{"type": "object", "properties": {"z": {}}}, {"type": "null"}]},
        "d": {"type": "object", "properties": {}, "additionalProperties": True}},
        "$defs": {"T": {"type": "object", "properties": {"t": {}}}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["items"]["additionalProperties"] is False
    assert out["properties"]["c"]["anyOf"][0]["additionalProperties"] is False
    assert out["properties"]["d"]["additionalProperties"] is True
    assert out["$defs"]["T"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


def test_parallel_mask_filling_equals_one_by_one(engine):
    """From _PARALLEL_ROWS rows on, llguidance's thread pool fills the masks: the same bits."""
    from cluster.worker import structured

    specs = [StructuredOutput("json_schema", json.dumps(s)) for s in SCHEMAS] + [StructuredOutput("regex", "[a-c]+x")]
    matchers = [engine.grammars.matcher_for(specs[i % len(specs)]) for i in range(12)]
    starts = ['{"', '{"', "[", '{"', "ab"]
    for i, m in enumerate(matchers[:6]):  # some advanced a little
        assert m.consume_tokens(engine.tokenizer.encode(starts[i % len(specs)]))
    together = structured.fill_bitmasks(matchers, engine.vocab_size)
    alone = np.concatenate([structured.fill_bitmasks([m], engine.vocab_size) for m in matchers])
    assert len(matchers) >= structured._PARALLEL_ROWS and np.array_equal(together, alone)
    assert (together != -1).any()  # the grammars do forbid something


def test_a_true_schema_is_any_json_value(engine):
    """`true` as a JSON schema (valid JSON Schema: anything goes) is any JSON value, not a 500."""
    (text, _, reason), = run(engine, prompts(engine, 1), SamplingParams(
        max_tokens=60, temperature=0.0, structured=StructuredOutput("json_schema", "true")))
    if reason == "stop":
        json.loads(text)
    assert reason in ("stop", "length")
