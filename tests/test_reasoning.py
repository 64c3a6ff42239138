"""Reasoning models and tool calls whose markers are special tokens (issue 29).

Splitting: each family's output, cut at every chunking, gives the same thinking, answer and
calls, with no marker in any of them. Real formats: `orchard model create --chat NAME`
writes the family's real template and tokens, and the worker finds its thinking and call
formats in them. Forced outputs: on a random-weight model of each family, logit bias keeps
the markers and end-of-turn tokens out, the thinking budget ends the thinking after exactly
N tokens, and a grammar (applied to the answer after the thinking) writes a call and an
answer; the split is checked against the token ids (the oracle), non-streamed, streamed
(the deltas concatenated) and through the router. Controls: chat_template_kwargs,
reasoning_effort and the budget change what they should.
"""

from __future__ import annotations

import json

import pytest

from cluster.api.tools import template_messages
from cluster.formats.base import Thought
from cluster.formats.calls import parse_json_object
from cluster.formats.deepseek import DEEPSEEK_CALLS
from cluster.formats.granite import GRANITE, GRANITE_CALLS
from cluster.formats.harmony import HARMONY, HARMONY_CALLS, HARMONY_TOKENS
from cluster.formats.kimi import KIMI_CALLS
from cluster.formats.llama3 import LLAMA3_CALLS
from cluster.formats.mistral import MAGISTRAL, MISTRAL_CALLS, MISTRAL_V3_CALLS
from cluster.formats.nemotron import NEMOTRON_CALLS
from cluster.formats.registry import REAL_FORMAT_ARCH, REAL_FORMATS, call_format, reasoning_format
from cluster.formats.split import make_splitter
from cluster.formats.think import THINK_TAGS
from cluster.formats.thinking import ThinkingSpec, ThinkingTracker, prompt_state
from cluster.api.wire import build_request
from scripted_engine import ScriptedEngine, ScriptedServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                   "additionalProperties": False}}}
OSLO = {"city": "Oslo"}
HERMES = call_format("<tool_call> tool_call.name", {}, ("<tool_call>", "</tool_call>", parse_json_object,
                                                        "mlx_lm.tool_parsers.json_tools"))
DS = {k: "<\uff5c" + v.replace(" ", "\u2581") + "\uff5c>" for k, v in dict(
    calls="tool calls begin", calls_end="tool calls end", call="tool call begin", call_end="tool call end",
    sep="tool sep").items()}

# family: (thinking format, prompt state, call format, the output as text (special tokens spelled),
#          the thinking, the answer, the calls)
SAMPLES = {
    "qwen3": (THINK_TAGS, "free", HERMES,
              '<think>\nI should call.\n</think>\n\nSure.<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Oslo"}}\n</tool_call>', "I should call.", "Sure.", [OSLO]),
    "deepseek-r1": (THINK_TAGS, "open", DEEPSEEK_CALLS,
                    f"Let me see.\n</think>\n\nChecking.{DS['calls']}{DS['call']}function{DS['sep']}get_weather\n"
                    f"```json\n{{\"city\": \"Oslo\"}}\n```{DS['call_end']}{DS['calls_end']}", "Let me see.",
                    "Checking.", [OSLO]),
    "deepseek-v3.1": (THINK_TAGS, "open", DEEPSEEK_CALLS,
                      f"hmm</think>ok{DS['calls']}{DS['call']}get_weather{DS['sep']}{{\"city\": \"Oslo\"}}"
                      f"{DS['call_end']}{DS['calls_end']}", "hmm", "ok", [OSLO]),
    "gpt-oss": (HARMONY, "free", HARMONY_CALLS,
                "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}', "Need the weather.", "",
                [OSLO]),
    "gpt-oss-final": (HARMONY, "free", HARMONY_CALLS,
                      "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
                      "Easy.", "Sunny.", []),
    "kimi-k2-thinking": (THINK_TAGS, "free", KIMI_CALLS,
                         "<think>x</think>y<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                         '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>',
                         "x", "y", [OSLO]),
    "magistral": (MAGISTRAL, "free", MISTRAL_CALLS,
                  '[THINK]plan[/THINK]Ok.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "plan", "Ok.", [OSLO]),
    "mistral-nemo": (None, "free", MISTRAL_V3_CALLS,
                     'Ok.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "", "Ok.", [OSLO]),
    "mistral-small-3.2": (None, "free", MISTRAL_CALLS,
                          '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}get_weather[ARGS]{"city": '
                          '"Bergen"}', "", "", [OSLO, {"city": "Bergen"}]),
    "llama-3.1": (None, "free", LLAMA3_CALLS, ' {"name": "get_weather", "parameters": {"city": "Oslo"}}', "", "",
                  [OSLO]),
    "llama-3.1-python-tag": (None, "free", LLAMA3_CALLS,
                             'Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", "Sure.",
                             [OSLO]),
    "llama-3.1-text": (None, "free", LLAMA3_CALLS, 'It is {"a": 1}', "", 'It is {"a": 1}', []),
    "llama-3.1-json-answer": (None, "free", LLAMA3_CALLS, '{"name": "Bob", "age": 3}', "", '{"name": "Bob", "age": 3}',
                              []),
    "granite-3.3": (GRANITE, "free", GRANITE_CALLS,
                    '<think>hm</think><response>Sure.</response><|tool_call|>[{"name": "get_weather", "arguments": '
                    '{"city": "Oslo"}}]', "hm", "Sure.", [OSLO]),
    "nemotron-nano-2": (THINK_TAGS, "open", NEMOTRON_CALLS,
                        'thought\n</think>\nanswer<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
                        "</TOOLCALL>", "thought", "answer", [OSLO]),
    "never-closed": (THINK_TAGS, "open", None, "still thinking when max_tokens came ",
                     "still thinking when max_tokens came", "", []),
    "stray-marker": (THINK_TAGS, "closed", None, "answer</think> more", "", "answer more", []),
}


def _split(splitter, text: str, step: int):
    segments = []
    for i in range(0, len(text), step):
        segments += splitter.segments(text[i:i + step])
    segments += splitter.rest()
    thinking = "".join(s for s in segments if isinstance(s, Thought))
    content = "".join(s for s in segments if isinstance(s, str) and not isinstance(s, Thought))
    calls = [json.loads(c.arguments) for c in segments if not isinstance(c, str)]
    names = {c.name for c in segments if not isinstance(c, str)}
    return thinking, content, calls, names


@pytest.mark.parametrize("family", SAMPLES)
def test_each_familys_output_splits_the_same_at_any_chunking(family):
    """Thinking, answer and calls, whatever the chunking (a marker split across chunks is
    held back until it is known); no marker survives in any of them."""
    fmt, state, calls, text, thinking, content, want = SAMPLES[family]
    markers = set(HARMONY_TOKENS) | {"<think>", "</think>", "[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]",
                                     "<tool_call>", "<|python_tag|>", "<response>", "<TOOLCALL>", DS["calls"],
                                     DS["call"]}
    for step in (len(text), 1, 2, 3, 5, 7, 11):
        got = _split(make_splitter(fmt, state, calls, [WEATHER]), text, step)
        assert got[:3] == (thinking, content, want), step
        assert got[3] <= {"get_weather"}
        assert not any(m in got[0] or m in got[1] for m in markers), step


@pytest.mark.parametrize("family", ["qwen3", "deepseek-v3.1", "gpt-oss", "magistral", "mistral-small-3.2",
                                    "llama-3.1", "granite-3.3", "nemotron-nano-2"])
def test_a_stream_aborted_and_resumed_elsewhere_sends_each_part_once(family):
    """A worker that stops mid-request ends its stream with finish_reason abort, and the
    router resumes the request on another worker from the tokens already sent (whose
    splitter reads them first and sends nothing). Wherever the cut falls (inside a marker,
    a call's arguments, the thinking's trailing whitespace), the client gets the
    uninterrupted split: what the first worker held back is the second one's to send."""
    from cluster.api.tools import split_chunk
    from cluster.proto.orchard.v1 import orchard_pb2 as pb

    fmt, state, calls, text, thinking, content, want = SAMPLES[family]
    for cut in range(1, len(text)):
        first = make_splitter(fmt, state, calls, [WEATHER])
        parts = split_chunk(first, pb.GenerateResponse(text=text[:cut]))
        parts += split_chunk(first, pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ABORT))
        second = make_splitter(fmt, state, calls, [WEATHER])
        second.segments(text[:cut])
        parts += split_chunk(second, pb.GenerateResponse(text=text[cut:], finish_reason=pb.FINISH_REASON_STOP))
        got = ("".join(p.reasoning for p in parts), "".join(p.text for p in parts),
               [json.loads(c.arguments) for p in parts for c in p.tool_calls])
        assert got == (thinking, content, want), (cut, text[:cut])


def test_calls_in_the_thinking_are_not_calls_and_parallel_false_keeps_one():
    text = '<think>maybe <tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call></think>' \
           + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' * 2
    thinking, content, calls, _ = _split(make_splitter(THINK_TAGS, "free", HERMES, [WEATHER], parallel=False), text, 4)
    assert '"city": "X"' in thinking and content == "" and calls == [OSLO]


def test_the_tracker_counts_the_thinking_and_spends_the_budget():
    texts = {1: "<think>", 2: "</think>", 3: "a", 4: "<", 5: "/think", 6: ">"}
    spec = ThinkingSpec("<think>", "</think>", open=False, budget=3, end_ids=(2,))
    t = ThinkingTracker(spec, texts.__getitem__)
    for tok in (3, 1, 3, 3):
        t.add(tok)
        assert not t.must_end
    t.add(3)
    assert t.thinking and t.must_end and t.count == 3
    t.add(2)
    assert not t.thinking and t.reasoning_tokens == 4  # the three, and the end marker
    # an end marker spelled in pieces ends it as well; an open prompt starts inside it
    t = ThinkingTracker(ThinkingSpec("<think>", "</think>", open=True), texts.__getitem__)
    for tok in (3, 4, 5, 6, 3):
        t.add(tok)
    assert not t.thinking and t.reasoning_tokens == 4


def test_a_template_naming_its_call_markers_wins_over_llama3s_vocabulary():
    """A Llama 3 fine-tune with Hermes' template (<|python_tag|> in its vocabulary, the tools
    rendered as {"name", "parameters"} JSON): its calls are Hermes' <tool_call> JSON, as
    mlx-lm finds from the template, not Llama 3's."""
    template = ("{%- for tool in tools %}{{- '{\"name\": \"' + tool.function.name + '\", \"parameters\": ' + "
                "(tool.function.parameters | tojson) + '}' }}{%- endfor %}{%- for message in messages %}"
                "{%- for tool_call in message.tool_calls or [] %}{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + "
                "'\"}\\n</tool_call>' }}{%- endfor %}{%- endfor %}")
    vocab = {"<|python_tag|>": 128010, "<tool_call>": 128011, "</tool_call>": 128012}
    hermes = call_format(template, vocab, ("<tool_call>", "</tool_call>", parse_json_object,
                                           "mlx_lm.tool_parsers.json_tools"))
    assert hermes.name == "json_tools" and hermes.start == "<tool_call>"
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _split(make_splitter(None, "free", hermes, [WEATHER]), text, 3)[1:3] == ("Sure.", [OSLO])
    assert call_format(template, vocab, None) is LLAMA3_CALLS  # no format named: Llama 3's, from the vocabulary


@pytest.mark.parametrize("tail, state", [("<|im_start|>assistant\n<think>\n", "open"),
                                         ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),
                                         ("<|im_start|>assistant\n", "free")])
def test_prompt_state(tail, state):
    assert prompt_state(THINK_TAGS, tail) == state


# -- the real formats -----------------------------------------------------------------------------------
# family: (its thinking format, its call format's name, template kwargs, the prompt's state)
EXPECTED = {
    "qwen3": (THINK_TAGS, "json_tools", {}, "free"),
    "qwq": (THINK_TAGS, "json_tools", {}, "open"),
    "qwen3-coder": (None, "qwen3_coder", {}, "free"),
    "deepseek-r1": (THINK_TAGS, "deepseek", {}, "open"),
    "deepseek-v3.1": (THINK_TAGS, "deepseek", {"thinking": True}, "open"),
    "gpt-oss": (HARMONY, "harmony", {}, "free"),
    "kimi-k2": (None, "kimi_k2", {}, "free"),
    "kimi-k2-thinking": (THINK_TAGS, "kimi_k2", {}, "free"),
    "glm-4.5": (THINK_TAGS, "glm47", {}, "free"),
    "magistral": (MAGISTRAL, "mistral", {}, "free"),
    "mistral-nemo": (None, "mistral_v3", {}, "free"),
    "mistral-small-3.2": (None, "mistral", {}, "free"),
    "llama-3.1": (None, "llama3", {}, "free"),
    "granite-3.3": (GRANITE, "granite", {"thinking": True}, "free"),
    "nemotron-nano-2": (THINK_TAGS, "nemotron", {}, "open"),
}
_MODELS: dict = {}


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """family -> a tiny random-weight model with that family's real chat format (made once)."""
    from cluster.modelgen import create_model

    def make(family: str):
        if family not in _MODELS:
            _MODELS[family] = create_model(tmp_path_factory.mktemp(family) / family, REAL_FORMAT_ARCH[family], "tiny",
                                           seed=0, chat=family)
        return _MODELS[family]

    return make


def test_every_real_format_is_checked_here():
    assert set(EXPECTED) == set(REAL_FORMATS)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(EXPECTED))
def test_real_formats_render_and_are_recognized(family_model, family):
    """The family's template renders tools, a call and its result with its own tokens (each
    one token, special where the family's tokenizer has it special), and the worker finds the
    family's thinking and call formats in it."""
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load

    fmt, calls, kwargs, state = EXPECTED[family]
    chat = REAL_FORMATS[family]
    tok = load(Path(family_model(family)))
    for t in chat.control + chat.markers:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    assert set(chat.control) <= special and not set(chat.markers) & special
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": OSLO}}]},
               {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": "sunny"},
               {"role": "assistant", "content": "It is sunny."},
               {"role": "user", "content": "And tomorrow?"}]
    messages = template_messages(build_request(messages=history).chat.messages)  # as the worker hands them over
    try:
        text = tok.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False, **kwargs)
    except TypeError:  # DeepSeek's templates concatenate the arguments: the worker's second try
        messages = template_messages(build_request(messages=history).chat.messages, arguments_as_text=True)
        text = tok.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False, **kwargs)
    assert "sunny" in text and "And tomorrow?" in text
    # (DeepSeek-R1's template renders no tools, and a call only from a message whose content is None)
    assert ("get_weather" in text) == (family != "deepseek-r1")
    mlx = (tok.tool_call_start, tok.tool_call_end, tok.tool_parser, tok.tool_parser.__module__) \
        if tok.has_tool_calling else None
    assert reasoning_format(tok.chat_template, tok.get_vocab()) is fmt
    assert call_format(tok.chat_template, tok.get_vocab(), mlx).name == calls
    if fmt is not None:
        prompt = tok.apply_chat_template(history[:1], add_generation_prompt=True, tokenize=False, **kwargs)
        assert prompt_state(fmt, prompt) == state


# -- forced outputs on the real engine ---------------------------------------------------------------------
ANSWER = "Sunny."
BUDGET = 8
# family: (chat_template_kwargs, the markers to keep out (besides the end-of-turn tokens), and the call
# as the grammar writes it when its format has no grammar of its own: XML)
FORCED = {
    "qwen3": ({}, ("<think>", "</think>", "<tool_call>", "</tool_call>")),
    "qwq": ({}, ("<think>", "</think>", "<tool_call>", "</tool_call>")),
    "deepseek-r1": ({}, ("<think>", "</think>", DS["calls"], DS["call"], DS["sep"], DS["call_end"], DS["calls_end"])),
    "deepseek-v3.1": ({"thinking": True}, ("<think>", "</think>", DS["calls"], DS["call"], DS["sep"], DS["call_end"],
                                            DS["calls_end"])),
    "gpt-oss": ({}, HARMONY_TOKENS),
    "kimi-k2": ({}, KIMI_CALLS.markers),
    "kimi-k2-thinking": ({}, ("<think>", "</think>") + KIMI_CALLS.markers),
    "glm-4.5": ({}, ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                     "</arg_value>")),
    "qwen3-coder": ({}, ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")),
    "magistral": ({}, ("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
    "mistral-nemo": ({}, ("[TOOL_CALLS]",)),
    "mistral-small-3.2": ({}, ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
    "llama-3.1": ({}, ("<|python_tag|>", "{")),
    "granite-3.3": ({"thinking": True}, ("<think>", "</think>", "<response>", "</response>", "<|tool_call|>")),
    "nemotron-nano-2": ({}, ("<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>")),
}
XML_CALLS = {
    "glm-4.5": '"<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>" /[a-z]{1,8}/ '
               '"</arg_value>\\n</tool_call>"',
    "qwen3-coder": '"<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n" /[a-z]{1,8}/ '
                   '"\\n</parameter>\\n</function>\\n</tool_call>"',
}
FAST = ("qwen3", "gpt-oss", "magistral")


def _bias(tok, markers, eos_ids) -> dict[int, float]:
    """-100 for the end-of-turn tokens and for every token whose text begins one of the
    markers: only the budget (the end of the thinking) and the grammar (the call) write them.
    And for the tokens that are part of a character's bytes: a grammar takes the end marker
    only after a whole character (the thinking would then run a token or two over)."""
    out = {int(i): -100.0 for i in eos_ids}
    for i in range(len(tok.get_vocab())):
        piece = tok.decode([i], skip_special_tokens=False)
        if piece and any(m.startswith(piece) for m in markers) or "\ufffd" in piece:
            out[i] = -100.0
    assert len(out) <= 300  # OpenAI's limit on logit_bias entries
    return out


def _grammar(family: str, tok, calls) -> str:
    """A call, then the answer (or the answer first where a call runs to the end of the
    output), as a Lark grammar for the answer after the thinking."""
    from cluster.worker.structured import call_constraint

    special = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}

    def atom(text):
        return f"<[{special[text]}]>" if text in special else json.dumps(text)

    if family in XML_CALLS:
        call = f"toolcall: {XML_CALLS[family]}\n"
    else:
        call = call_constraint(calls.grammar, [WEATHER], "get_weather", atom, calls.start, calls.end).spec
        call = call.replace("start:", "toolcall:", 1)
    if family == "llama-3.1":  # a bare JSON call is the whole answer
        return call + "start: toolcall\n"
    answer = json.dumps(ANSWER)
    return call + (f"start: {answer} toolcall\n" if not calls.end else f"start: toolcall {answer}\n")


def _expected(tok, ids, fmt, state):
    """The oracle, from the token ids: the thinking's text and how many tokens it took (up
    to its end marker), found by matching the markers in the decoded pieces."""
    text, first, last = "", 0 if state == "open" else None, None
    for k, i in enumerate(ids):
        text += tok.decode([i], skip_special_tokens=False)
        if first is None and text.endswith(fmt.start):
            first = k + 1
        elif first is not None and text.endswith(fmt.end):
            last = k + 1 - len(tok.encode(fmt.end, add_special_tokens=False))  # the budget forced it whole
            break
    assert first is not None and last is not None, text
    return tok.decode(ids[first:last], skip_special_tokens=False).strip(), last - first


def _check_forced(family, model_dir):
    """One family's forced output, split as the oracle says, the same streamed and through
    the router; the budget ends the thinking after exactly BUDGET tokens."""
    import jsonschema
    import openai

    from cluster.sdk import Client
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine

    kwargs, markers = FORCED[family]
    fmt, _, _, state = EXPECTED[family]
    srv = ScriptedServer(lambda: Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=256, max_model_len=2048)),
                         router=True)
    try:
        tok = srv.engine.tokenizer
        calls = call_format(tok.chat_template, tok.get_vocab(), (tok.tool_call_start, tok.tool_call_end,
                                                                  tok.tool_parser, tok.tool_parser.__module__)
                            if tok.has_tool_calling else None)
        bias = _bias(tok, markers, tok.eos_token_ids)
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        if fmt is not None:
            extra["thinking_token_budget"] = BUDGET
        harmony = fmt is HARMONY
        if harmony:  # a harmony call ends the turn: the call, then (another request) the answer
            forcing = {"tool_choice": "required"}
        else:
            forcing = {"extra_body": {"guided_grammar": _grammar(family, tok, calls), **extra}}
        if harmony:
            forcing["extra_body"] = extra
        with Client(srv.grpc_address) as c:
            done = c.chat(messages, tools=[WEATHER], temperature=0, max_tokens=200, logit_bias=bias,
                          structured=None if harmony else {"grammar": forcing["extra_body"]["guided_grammar"]},
                          tool_choice="required" if harmony else None, **extra)
        assert done.finish_reason == "tool_calls", (done, [tok.decode([i], skip_special_tokens=False)
                                                            for i in done.token_ids])
        if fmt is not None:
            thinking, inner = _expected(tok, done.token_ids, fmt, state)
            assert done.reasoning == thinking and inner == BUDGET
            assert 0 < done.usage.reasoning_tokens <= BUDGET + 1 + len(tok.encode(fmt.start, add_special_tokens=False))
        else:
            assert done.reasoning == "" and done.usage.reasoning_tokens == 0
        assert done.text == ("" if harmony or family == "llama-3.1" else ANSWER)
        ((name, args),) = [(t.name, json.loads(t.arguments)) for t in done.tool_calls]
        assert name == "get_weather"
        jsonschema.validate(args, WEATHER["function"]["parameters"])
        for url in (srv.url, srv.router_url):
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            request = dict(model="", messages=messages, tools=[WEATHER], temperature=0, max_tokens=200,
                           logit_bias={str(k): v for k, v in bias.items()}, **forcing)
            r = client.chat.completions.create(**request)
            m = r.choices[0].message
            assert ((getattr(m, "reasoning_content", None) or "") == done.reasoning
                    == (getattr(m, "reasoning", None) or ""))
            assert (m.content or "") == done.text and r.choices[0].finish_reason == "tool_calls"
            assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [(name, args)]
            assert r.usage.completion_tokens_details.reasoning_tokens == done.usage.reasoning_tokens
            chunks = [ch for ch in client.chat.completions.create(stream=True, **request) if ch.choices]
            delta = [ch.choices[0].delta for ch in chunks]
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in delta) == done.reasoning
            assert "".join(getattr(d, "reasoning", None) or "" for d in delta) == done.reasoning
            assert "".join(d.content or "" for d in delta) == done.text
            assert [(t.function.name, json.loads(t.function.arguments)) for d in delta for t in d.tool_calls or []] \
                == [(name, args)]
        if harmony:  # the answer: the final channel after the thinking
            r = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0).chat.completions.create(
                model="", messages=messages, temperature=0, max_tokens=200,
                logit_bias={str(k): v for k, v in bias.items()}, extra_body={"guided_choice": [ANSWER], **extra})
            m = r.choices[0].message
            assert m.content == ANSWER and len(m.reasoning_content) > 0 and r.choices[0].finish_reason == "stop"
    finally:
        srv.stop()


@pytest.mark.parametrize("family", FAST)
def test_forced_thinking_call_and_answer_come_back_split(family_model, family):
    _check_forced(family, family_model(family))


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FORCED if f not in FAST])
def test_forced_thinking_call_and_answer_come_back_split_every_family(family_model, family):
    _check_forced(family, family_model(family))


# -- controls ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(family_model):
    """family -> a real engine's server on that family's model (started once a module)."""
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine

    servers = {}

    def start(family):
        if family not in servers:
            path = family_model(family)
            servers[family] = ScriptedServer(
                lambda: Engine.from_pretrained(path, EngineConfig(num_kv_blocks=256, max_model_len=2048)))
        return servers[family]

    yield start
    for srv in servers.values():
        srv.stop()


def test_enable_thinking_false_renders_qwen3_without_thinking(engines):
    """chat_template_kwargs reach the template: the prompt's tokens are the template's own
    rendering with enable_thinking=False (an empty thinking block closed in the prompt), and
    what follows is the answer, none of it thinking."""
    from cluster.sdk import Client

    srv = engines("qwen3")
    tok = srv.engine.tokenizer
    messages = [{"role": "user", "content": "Hi"}]
    with Client(srv.grpc_address) as c:
        off = c.chat(messages, max_tokens=4, temperature=0, echo=True, chat_template_kwargs={"enable_thinking": False})
        on = c.chat(messages, max_tokens=4, temperature=0, echo=True)
    assert off.prompt_token_ids == list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                enable_thinking=False))
    assert on.prompt_token_ids == list(tok.apply_chat_template(messages, add_generation_prompt=True))
    assert off.prompt_text.endswith("<think>\n\n</think>\n\n") and not on.prompt_text.endswith("</think>\n\n")
    assert off.reasoning == "" and off.usage.reasoning_tokens == 0


@pytest.mark.parametrize("kwargs", [{"truncation": True, "max_length": 4},
                                    {"padding": "max_length", "max_length": 3000}, {"return_tensors": "np"},
                                    {"tokenizer_kwargs": {"truncation": True}},
                                    {"tools": []}])
def test_chat_template_kwargs_cannot_set_how_the_template_is_applied(qwen3_scripted, kwargs):
    """Only template variables get through: apply_chat_template's own parameters would cut
    the prompt (truncation), fill it with pad tokens (padding) or fail in the worker
    (return_tensors). Each is a 400 naming the field and the key, over HTTP and gRPC, and
    no prompt is rendered."""
    import openai

    from cluster.api.errors import InvalidRequest
    from cluster.sdk import Client

    srv = qwen3_scripted
    rendered = len(srv.engine.prompts)
    key = sorted(kwargs)[-1] if "max_length" in kwargs else next(iter(kwargs))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi there"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": kwargs})
    assert e.value.body["param"] == "chat_template_kwargs" and repr(key) in e.value.body["message"]
    with Client(srv.grpc_address) as c, pytest.raises(InvalidRequest, match="chat_template_kwargs cannot set"):
        c.chat([{"role": "user", "content": "Hi there"}], max_tokens=2, chat_template_kwargs=kwargs)
    assert len(srv.engine.prompts) == rendered


def test_reasoning_controls_out_of_range_name_the_clients_field_and_limit(qwen3_scripted):
    import anthropic
    import openai

    url = qwen3_scripted.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:  # the Responses API's name for it, not the wire's
        client.responses.create(model="", input="Hi", reasoning={"effort": "max"})
    assert e.value.body["param"] == "reasoning.effort" and "reasoning.effort must be one of" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"thinking_token_budget": 2**40})
    assert e.value.body["param"] == "thinking_token_budget" and "4294967295" in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens.*4294967295"):
        anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(
            model="", max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
            thinking={"type": "enabled", "budget_tokens": 2**40})


def test_every_parameter_of_apply_chat_template_is_reserved():
    """transformers' apply_chat_template parameters are not template variables: a new one
    in a transformers release must be added to the reserved names."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    from cluster.api.wire import RESERVED_TEMPLATE_KWARGS

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    named = {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    assert named and named <= RESERVED_TEMPLATE_KWARGS, named - RESERVED_TEMPLATE_KWARGS


def test_reasoning_effort_changes_gpt_oss_system_message(engines):
    import openai

    from cluster.sdk import Client

    srv = engines("gpt-oss")
    with Client(srv.grpc_address) as c:
        prompts = {effort: c.chat([{"role": "user", "content": "Hi"}], max_tokens=1, echo=True,
                                  reasoning_effort=effort).prompt_text for effort in ("low", "high", None)}
    assert "Reasoning: low\n" in prompts["low"] and "Reasoning: high\n" in prompts["high"]
    assert "Reasoning: medium\n" in prompts[None]  # the template's default
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort must be one of"):
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], reasoning_effort="max")


@pytest.mark.parametrize("budget", [0, 3])
def test_a_thinking_budget_ends_the_thinking(engines, budget):
    """QwQ opens the thinking in its prompt; with the end marker kept out by logit bias the
    model would think to max_tokens: a budget of N ends it after N tokens, then the answer
    follows (usage counts the thinking and its end marker)."""
    import openai

    srv = engines("qwq")
    tok = srv.engine.tokenizer
    bias = _bias(tok, ("</think>",), ())
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    request = dict(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=24, temperature=0,
                   logit_bias={str(k): v for k, v in bias.items()})
    free = client.chat.completions.create(**request)
    assert free.choices[0].message.content is None or free.choices[0].message.content == ""
    assert free.usage.completion_tokens_details.reasoning_tokens == 24  # no end: all of it thinking
    r = client.chat.completions.create(**request, extra_body={"thinking_token_budget": budget})
    assert r.usage.completion_tokens_details.reasoning_tokens == budget + 1  # N, and </think>
    assert len(r.choices[0].message.content or "") > 0 and "</think>" not in r.choices[0].message.content
    thinking = getattr(r.choices[0].message, "reasoning_content", None) or ""
    assert len(tok.encode(thinking, add_special_tokens=False)) <= budget + 1
    # n samples: each thinks within the budget and answers, split on its own
    r = client.chat.completions.create(**dict(request, temperature=1.0, seed=7), n=2,
                                       extra_body={"thinking_token_budget": budget})
    assert r.usage.completion_tokens_details.reasoning_tokens == 2 * (budget + 1)
    assert all(c.message.content and "</think>" not in c.message.content for c in r.choices)


def test_thinking_is_followed_the_same_with_speculative_decoding(family_model):
    """n-gram drafts kept several tokens a step: the thinking's tokens (what usage counts)
    are those of one token a step; a thinking with a budget does not speculate (its end is
    forced a token a step), so it ends where it does without drafts: after 5 tokens."""
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    path = family_model("qwq")
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    plain, spec = (Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, speculative_config=c))
                   for c in (None, ngram))
    tok = plain.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    bias = _bias(tok, ("</think>",), tok.eos_token_ids)
    runs = {}
    for budget in (None, 5):
        thinking = (None if budget is None
                    else ThinkingSpec("<think>", "</think>", open=True, budget=budget, end_ids=end))
        params = SamplingParams(max_tokens=40, temperature=0, logit_bias=bias, thinking=thinking)
        for name, engine in (("plain", plain), ("spec", spec)):
            engine.add_request(f"{name}-{budget}", list(prompt), params)
            ids = []
            while engine.has_unfinished():
                for out in engine.step():
                    ids += out.new_token_ids
            counted = ThinkingTracker(ThinkingSpec("<think>", "</think>", open=True),  # as the worker counts them
                                      lambda t: tok.decode([t], skip_special_tokens=False))
            for t in ids:
                counted.add(t)
            runs[name, budget] = (ids, counted.reasoning_tokens)
    assert runs["plain", None] == runs["spec", None] and runs["plain", None][1] == 40  # never closed
    assert runs["plain", 5] == runs["spec", 5] and runs["plain", 5][1] == 6  # 5, then </think>
    assert tuple(runs["plain", 5][0][5:5 + len(end)]) == end
    assert spec.stats.spec_decode.num_accepted_tokens > 0  # the drafts were kept somewhere


# -- client packages ------------------------------------------------------------------------------------------
THINK_CALL = ('<think>\nI need the weather.\n</think>\n\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
THINK_ANSWER = "<think>\nThe tool said sunny.\n</think>\n\nIt is sunny in Oslo."


@pytest.fixture(scope="module")
def qwen3_scripted(family_model):
    srv = ScriptedServer(ScriptedEngine(family_model("qwen3"), reply="hi"))
    yield srv
    srv.stop()


def test_openai_agents_sdk_runs_a_tool_loop_with_a_thinking_model(qwen3_scripted):
    """The Agents SDK over the Responses API: the thinking comes back as a reasoning item,
    the SDK runs the tool and sends the reasoning back with the call (the template renders
    it), the model answers."""
    import asyncio

    import openai
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    srv, ran = qwen3_scripted, []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return "sunny"

    srv.engine.reply = lambda prompt: THINK_ANSWER if "<tool_response>" in prompt else THINK_CALL
    model = OpenAIResponsesModel("qwen3", openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model)

    async def run():
        result = await Runner.run(agent, "Weather in Oslo?")
        assert ran == ["Oslo"] and result.final_output == "It is sunny in Oslo."
        kinds = [type(i).__name__ for i in result.new_items]
        assert kinds[:2] == ["ReasoningItem", "ToolCallItem"] and "ReasoningItem" in kinds[3:]
        assert "<think>\nI need the weather.\n</think>" in srv.engine.prompts[-1]  # sent back, rendered
        streamed = Runner.run_streamed(agent, "Weather in Oslo?")
        events = [e async for e in streamed.stream_events()]
        assert streamed.final_output == "It is sunny in Oslo."
        deltas = [e.data.delta for e in events if e.type == "raw_response_event"
                  and e.data.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == "I need the weather." + "The tool said sunny."  # both turns' thinking

    asyncio.run(run())


def test_resumed_mid_thinking_samples_and_include_reasoning(qwen3_scripted):
    """A stream resumed after failover inside the thinking (resume_token_ids: the router's
    resume) goes on as thinking and does not send again what was sent; include_reasoning
    false drops the thinking (vLLM's flag)."""
    import openai

    from cluster.sdk import Client, build_request

    srv = qwen3_scripted
    srv.engine.reply = THINK_CALL
    tok = srv.engine.tokenizer
    ids = tok.encode(THINK_CALL, add_special_tokens=False)
    cut = next(i for i in range(len(ids)) if "need" in tok.decode(ids[:i]))  # inside the thinking
    with Client(srv.grpc_address) as c:
        req = build_request(messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                            resume_token_ids=ids[:cut])
        done = c.generate(req)
        sent = tok.decode(ids[:cut]).removeprefix("<think>\n")
        assert sent + done.reasoning == "I need the weather." and done.text == ""
        assert [json.loads(t.arguments) for t in done.tool_calls] == [OSLO] and done.finish_reason == "tool_calls"
        assert done.usage.reasoning_tokens == len(tok.encode("\nI need the weather.\n</think>",
                                                             add_special_tokens=False))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    assert srv.engine.params[-1].thinking is None  # no budget: the engine's step follows nothing
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                                       extra_body={"include_reasoning": False})
    assert getattr(r.choices[0].message, "reasoning_content", None) is None and r.choices[0].message.tool_calls


def test_anthropic_client_gets_thinking_and_tool_use_blocks(qwen3_scripted):
    import anthropic

    srv = qwen3_scripted
    srv.engine.reply = "<think>\nChecking.\n</think>\n\nLet me look." + THINK_CALL[THINK_CALL.index("<tool_call>"):]
    claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
    request = dict(model="qwen3", max_tokens=400, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                   tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                   thinking={"type": "enabled", "budget_tokens": 1024})
    msg = claude.messages.create(**request)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Checking." and msg.content[1].text == "Let me look."
    assert msg.content[2].input == OSLO and msg.stop_reason == "tool_use"
    with claude.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Checking." and final.content[2].input == OSLO
    assert srv.engine.params[-1].thinking.budget == 1024
    # the thinking of an earlier turn goes back to the template with its assistant message
    claude.messages.create(model="qwen3", max_tokens=64, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Earlier thought.", "signature": ""},
                                          {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks"}])
    assert "Earlier thought." not in srv.engine.prompts[-1]  # Qwen3 drops the thinking of past turns
    assert "Sunny." in srv.engine.prompts[-1]
    # ... and the template renders it where it keeps it: a turn after the last user query (a tool loop)
    claude.messages.create(model="qwen3", max_tokens=64, tools=request["tools"], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Earlier thought.", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": OSLO}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}])
    assert "<think>\nEarlier thought.\n</think>" in srv.engine.prompts[-1]


@pytest.mark.parametrize("family, reply", [
    ("mistral-small-3.2", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
    ("gpt-oss", "<|channel|>analysis<|message|>Weather needed.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'),
])
def test_langchain_gets_tool_calls_from_special_token_formats(family_model, family, reply):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    srv = ScriptedServer(ScriptedEngine(family_model(family), reply=reply))
    try:
        llm = ChatOpenAI(base_url=srv.url + "/v1", api_key="none", model=family,
                         max_retries=0).bind_tools([get_weather])
        msg = llm.invoke("Weather in Oslo?")
        assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", OSLO)]
        assert not any(m in msg.content for m in ("[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|message|>"))
        chunks = list(llm.stream("Weather in Oslo?"))
        full = chunks[0]
        for c in chunks[1:]:
            full = full + c
        assert [(c["name"], c["args"]) for c in full.tool_calls] == [("get_weather", OSLO)]
    finally:
        srv.stop()


@pytest.mark.parametrize("family, reply, markers", [
    ("mistral-small-3.2", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo, Norway"}',
     ("[TOOL_CALLS]", "[ARGS]")),
    ("mistral-nemo", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo, Norway"}}]',
     ("[TOOL_CALLS]",)),
    ("qwen3", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo, Norway"}}\n</tool_call>',
     ()),
])
def test_a_call_cut_by_max_tokens_and_a_held_back_call_stream_cleanly(family_model, family, reply, markers):
    """A call cut short by max_tokens comes back as text, with no special-token marker in it
    (an ordinary one, Hermes' <tool_call>, stays as the model wrote it); while a call is
    held back the stream sends nothing, not empty deltas."""
    import openai

    srv = ScriptedServer(ScriptedEngine(family_model(family), reply=reply, step_seconds=0.02))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        ids = srv.engine.tokenizer.encode(reply, add_special_tokens=False)
        request = dict(model="", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], temperature=0)
        cut = c.chat.completions.create(max_tokens=len(ids) - 4, **request).choices[0]
        assert cut.finish_reason == "length" and not cut.message.tool_calls
        assert cut.message.content.startswith("Let me check.") and "Oslo" in cut.message.content
        assert not any(m in cut.message.content for m in markers), cut.message.content
        chunks = list(c.chat.completions.create(max_tokens=len(ids) - 4, stream=True, **request))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == cut.message.content
        whole = list(c.chat.completions.create(max_tokens=len(ids) + 8, stream=True, **request))
        calls = [tc for ch in whole for tc in ch.choices[0].delta.tool_calls or []]
        assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
            ("get_weather", {"city": "Oslo, Norway"})]
        for ch in (chunks + whole)[1:]:
            d = ch.choices[0]
            assert d.delta.content or d.delta.tool_calls or d.finish_reason or ch is whole[0], ch
    finally:
        srv.stop()
