"""Structured outputs, penalties and logit bias over the wire: the real `openai` client
and langchain-openai against a worker's HTTP server, the SDK over gRPC, and the router
passing the fields through unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from cluster.sdk import Client, InvalidRequest

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


def test_response_format_json_schema_and_json_object(oai):
    for seed in range(3):
        r = oai.chat.completions.create(
            model="", messages=CHAT, max_tokens=150, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    stream = oai.chat.completions.create(
        model="", messages=CHAT, max_tokens=150, temperature=0.7, seed=5, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    chunks = list(stream)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = oai.chat.completions.create(model="", messages=CHAT, max_tokens=60, temperature=0,
                                    response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = oai.chat.completions.create(model="", messages=CHAT, max_tokens=4, temperature=0,
                                    response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")


class Pet(BaseModel):
    kind: str = Field(max_length=6)
    legs: int = Field(ge=0, le=8)


class Owner(BaseModel):
    name: str = Field(max_length=8)
    pets: list[Pet] = Field(max_length=2)


def test_openai_parse_returns_the_pydantic_object(oai):
    r = oai.chat.completions.parse(model="", messages=CHAT, max_tokens=200, temperature=0.5, seed=1,
                                   response_format=Owner)
    owner = r.choices[0].message.parsed
    assert isinstance(owner, Owner) and len(owner.pets) <= 2


def test_langchain_with_structured_output(tiny_worker):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"http://{tiny_worker.http}/v1", api_key="unused", model="tiny-qwen3", temperature=0.3,
                     max_tokens=200, max_retries=0, timeout=60, seed=2)
    owner = llm.with_structured_output(Owner, method="json_schema").invoke("Who owns which pets?")
    assert isinstance(owner, Owner)


def test_langchain_json_mode_and_function_calling(tiny_worker):
    """with_structured_output's other two methods: json_mode (response_format json_object:
    any JSON object, here parsed into a model that takes any keys) and function_calling (a
    named tool_choice, enforced by constrained decoding)."""
    from langchain_openai import ChatOpenAI
    from pydantic import ConfigDict

    class Anything(BaseModel):
        model_config = ConfigDict(extra="allow")

    # any JSON object: a random model's keys are unbounded, so a seed whose object closes
    closing = ChatOpenAI(base_url=f"http://{tiny_worker.http}/v1", api_key="unused", model="tiny-qwen3",
                         temperature=0.3, max_tokens=200, max_retries=0, timeout=60, seed=3)
    json_mode = closing.with_structured_output(Anything, method="json_mode", include_raw=True)
    out = json_mode.invoke("A JSON object, please.")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Anything)
    assert isinstance(json.loads(out["raw"].content), dict)
    short = ChatOpenAI(base_url=f"http://{tiny_worker.http}/v1", api_key="unused", model="tiny-qwen3",
                       temperature=0.3, max_tokens=160, max_retries=0, timeout=60, seed=2)  # the tool fills the context
    pet = short.with_structured_output(Pet, method="function_calling").invoke("Describe a pet.")
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


def test_vllm_guided_extensions(oai):
    regex = r"[A-Z]{2}-[0-9]{2,4}"
    r = oai.completions.create(model="", prompt="Code:", max_tokens=20, temperature=1.0, seed=3,
                               extra_body={"guided_regex": regex})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(regex, r.choices[0].text)
    choices = ["alpha", "beta", "gamma delta"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = oai.completions.create(model="", prompt="Pick:", max_tokens=10, temperature=1.0, seed=4, extra_body=body)
        assert r.choices[0].text in choices
    r = oai.chat.completions.create(model="", messages=CHAT, max_tokens=150, temperature=1.0, seed=6,
                                    extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = oai.completions.create(model="", prompt="Answer:", max_tokens=10, temperature=1.0, seed=7,
                               extra_body={"guided_grammar": 'start: "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")
    r = oai.chat.completions.create(model="", messages=CHAT, max_tokens=150, temperature=1.0, seed=8,
                                    extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     None, "objekt"),
    (dict(extra_body={"guided_regex": "a(b"}), None, "unclosed group"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
    (dict(response_format={"type": "yaml"}), "response_format", "yaml"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex",
     "more than one"),
    (dict(presence_penalty=5), "presence_penalty", "between -2 and 2"),
    (dict(frequency_penalty=-3), "frequency_penalty", "between -2 and 2"),
    (dict(temperature=3), "temperature", "between 0 and 2"),
    (dict(logit_bias={"5": 150}), "logit_bias", "between -100 and 100"),
    (dict(logit_bias={"100000": 1}), None, "outside the vocabulary"),
    (dict(logit_bias={"x": 1}), "logit_bias", "not a token id"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", "repetition_penalty"),
])
def test_bad_requests_are_400_naming_the_problem(oai, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="", messages=CHAT, max_tokens=5, **kwargs)
    assert e.value.status_code == 400 and re.search(words, e.value.message), e.value.message
    if param is not None:
        assert e.value.param == param


def test_logit_bias_and_penalties_change_greedy_output(oai, tiny_tokenizer):
    prompt = "The orchard is quiet in the morning."
    forced = oai.completions.create(model="", prompt=prompt, max_tokens=3, temperature=0, logit_bias={"321": 100},
                                    extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tiny_tokenizer.decode([321] * 3)
    base = oai.completions.create(model="", prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    first = tiny_tokenizer.encode(prompt + base.choices[0].text).ids[len(tiny_tokenizer.encode(prompt).ids):][:1]
    banned = oai.completions.create(model="", prompt=prompt, max_tokens=1, temperature=0,
                                    logit_bias={str(first[0]): -100}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text != base.choices[0].text
    plain = oai.completions.create(model="", prompt=prompt, max_tokens=40, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
    penalised = oai.completions.create(model="", prompt=prompt, max_tokens=40, temperature=0, presence_penalty=2,
                                       frequency_penalty=2, extra_body={"ignore_eos": True}).choices[0].text
    ids = lambda t: tiny_tokenizer.encode(t).ids  # noqa: E731
    assert len(set(ids(penalised))) > len(set(ids(plain)))


def test_sdk_takes_structured_and_sampling_kwargs(tiny_worker):
    with Client(tiny_worker.grpc, timeout=60) as c:
        r = c.generate("Code:", max_tokens=20, temperature=1.0, seed=1, structured={"regex": r"[a-z]{3}[0-9]"})
        assert r.finish_reason == "stop" and re.fullmatch(r"[a-z]{3}[0-9]", r.text)
        r = c.generate("JSON:", max_tokens=150, temperature=1.0, seed=2, structured={"json_schema": PERSON})
        jsonschema.validate(json.loads(r.text), PERSON)
        r = c.generate("x", max_tokens=2, temperature=0, logit_bias={7: 100.0}, presence_penalty=-1.0,
                       repetition_penalty=1.2, ignore_eos=True)
        assert r.token_ids == [7, 7]
        with pytest.raises(InvalidRequest, match="cannot be compiled"):
            c.generate("x", structured={"json_schema": {"type": "objekt"}})


def test_router_passes_the_fields_through_unchanged():
    from conftest import run
    from test_router_fake import Cluster

    async def go():
        async with Cluster(n_workers=1) as c:
            from cluster.api.wire import build_request

            req = build_request("hi", max_tokens=3, presence_penalty=0.5, frequency_penalty=-0.5,
                                repetition_penalty=1.1, logit_bias={4: -3.0}, structured={"choice": ["a", "b"]})
            async for _ in c.gen.Generate(req):
                pass
            got = c.workers[0].requests[-1]
            assert got.sampling == req.sampling
            bad = build_request("hi", structured={"json_schema": "{"})
            with pytest.raises(Exception, match="not valid JSON"):
                async for _ in c.gen.Generate(bad):
                    pass
            assert len(c.workers[0].requests) == 1  # refused by the router before placement

    run(go())


def test_orchard_generate_takes_constraints(tiny_worker, tmp_path):
    import subprocess
    import sys

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    base = [sys.executable, "-m", "cluster.cli", "generate", "--target", tiny_worker.grpc, "--temperature", "0.8",
            "--seed", "3", "--max-tokens", "150"]
    out = subprocess.run(base + ["--json-schema", f"@{schema}", "A person:"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), PERSON)
    out = subprocess.run(base + ["--choice", "left", "--choice", "right", "--presence-penalty", "0.5",
                                 "--logit-bias", "7=-100", "Go:"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() in ("left", "right"), out.stderr
    bad = subprocess.run(base + ["--regex", "a(b", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "unclosed group" in bad.stderr
