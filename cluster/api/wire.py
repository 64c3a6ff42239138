"""The wire contract beyond the .proto: finish-reason names, defaults, and one way to
build and to check a `GenerateRequest`.

`build_request` turns keyword arguments (the SDK's, the OpenAI front's) into a request
and refuses only what the wire types cannot hold. `validate_request` is the one semantic
check of a request, run by every backend as it takes one (the worker, the router), so a
bad request gets the same INVALID_ARGUMENT / HTTP 400 whichever way it came in. What
needs the tokenizer (the prompt's length against `max_model_len`) is the worker's; the
engine keeps only the checks that protect its own invariants.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Sequence

from cluster.api.constraints import check_sampling, structured_proto
from cluster.api.errors import BadField, InvalidRequest
from cluster.api.limits import (DEFAULT_MAX_TOKENS, MAX_ID_CHARS, MAX_INT32, MAX_LOGPROBS, MAX_NAME_CHARS,
                                MAX_TOKENS_HIGH, MAX_TOKENS_LOW, RequestLimits, check_json_depth, parse_json, quoted,
                                shown)
from cluster.api.tools import validate_tools
from cluster.proto.orchard.v1 import orchard_pb2 as pb


# The engine's finish reasons and the wire's, both ways.
FINISH_REASON_TO_PROTO = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASON_TO_PROTO.items()} | {pb.FINISH_REASON_UNSPECIFIED: None}

_MAX_TOKENS_MESSAGE = "{} must be an integer >= 1, got {}"
# The range of each integer field of SamplingParams on the wire.
_INT_RANGES = {"max_tokens": (0, MAX_TOKENS_HIGH), "top_k": (-2**31, MAX_INT32), "seed": (0, 2**64 - 1),
               "logprobs": (0, 2**32 - 1), "prompt_logprobs": (0, 2**32 - 1), "n": (0, 2**32 - 1)}

Message = Mapping[str, str] | tuple[str, str]


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Iterable[Message] | None = None,
    model: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    structured: Any = None,
    prompt_logprobs: int | None = None,
    n: int = 1,
    echo: bool = False,
    request_id: str = "",
    resume_token_ids: Sequence[int] | None = None,
    tools: Sequence[Mapping] | str | None = None,
    tool_choice: str | Mapping | None = None,
    parallel_tool_calls: bool | None = None,
    speculative: bool | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    reasoning_effort: str | None = None,
    thinking_token_budget: int | None = None,
    keep_alive: float | None = None,
) -> pb.GenerateRequest:
    """A `GenerateRequest` from keyword arguments: exactly one of a text prompt, a list of
    token ids, or chat `messages` ({"role", "content"} dicts or (role, content) pairs; a
    dict may hold OpenAI's `tool_calls`, `tool_call_id` and `name`). `tools` are OpenAI's
    function tools, `tool_choice` "none" | "auto" | "required" | a function's name or
    {"type": "function", "function": {"name": ...}}. `n` samples share the prompt (chunks
    carry their `index`); `prompt_logprobs` asks for each prompt token's logprob (+ that
    many alternatives) in the first chunk; `echo` for the prompt's ids and text there.
    `speculative` False opts out of the worker's speculative decoding (True asks for it).
    A chat's `chat_template_kwargs` reach its chat template (Qwen3: {"enable_thinking":
    False}), as does `reasoning_effort` (gpt-oss's system message); a thinking model's
    thinking ends after `thinking_token_budget` tokens. An assistant message dict may hold
    its thinking as `reasoning_content` (or `reasoning`). `keep_alive` (seconds, Ollama's
    meaning) is how long a router's fleet keeps a catalog model loaded after the request.
    Values the wire types cannot hold (a negative max_tokens, a seed past 64 bits) are
    InvalidRequest; everything else is the server's to judge (`validate_request`)."""
    if (prompt is None) == (messages is None):
        raise InvalidRequest("pass exactly one of a prompt (text or token ids) or messages")
    try:
        req = pb.GenerateRequest(request_id=request_id, model=model)
        _set_prompt(req, prompt, messages)
        _set_sampling_numbers(req.sampling, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              min_p=min_p, seed=seed, logprobs=logprobs, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                              prompt_logprobs=prompt_logprobs, n=None if n == 1 else n)
        _set_sampling_options(req.sampling, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                              logit_bias=logit_bias, structured=structured, echo=echo, speculative=speculative)
        if resume_token_ids:
            req.resume_token_ids.extend(checked_token_ids("resume_token_ids", resume_token_ids))
        _set_tools(req, tools, tool_choice, parallel_tool_calls)
        _set_template_options(req, chat_template_kwargs, reasoning_effort, thinking_token_budget)
        if keep_alive is not None:
            req.keep_alive_seconds = keep_alive
    except InvalidRequest:
        raise
    except (ValueError, TypeError) as e:  # out of the wire types' range
        raise InvalidRequest(f"invalid request: {e}") from None
    return req


def _set_prompt(req: pb.GenerateRequest, prompt: str | Sequence[int] | None,
                messages: Iterable[Message] | None) -> None:
    """The request's one prompt: chat messages, a text, or token ids."""
    if messages is not None:
        for m in messages:
            if isinstance(m, Mapping):
                _add_message(req.chat.messages, m)
            else:
                role, content = m
                req.chat.messages.add(role=role, content=content)
        req.chat.SetInParent()
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(checked_token_ids("prompt", prompt))
        req.token_ids.SetInParent()


def _set_sampling_numbers(s: pb.SamplingParams, **numbers: int | float | None) -> None:
    """Each given number onto `s`, in order, or BadField naming the first the wire cannot hold."""
    for name, value in numbers.items():
        if value is None:
            continue
        if name == "max_tokens" and isinstance(value, int) and value < 0:
            raise BadField(name, _MAX_TOKENS_MESSAGE.format(name, value))
        low, high = _INT_RANGES.get(name, (None, None))
        if low is not None and isinstance(value, int) and not low <= value <= high:
            raise BadField(name, f"{name} must be an integer between {low} and {high}, got {value}")
        try:
            setattr(s, name, value)
        except (ValueError, TypeError):
            raise BadField(name, f"{name} must be a number, got {shown(value)}") from None


def _set_sampling_options(s: pb.SamplingParams, *, stop, stop_token_ids, ignore_eos, logit_bias, structured, echo,
                          speculative) -> None:
    """The sampling fields beyond the numbers: stops, biases, a structured-output constraint, flags."""
    if stop:
        s.stop.extend([stop] if isinstance(stop, str) else list(stop))
    if stop_token_ids:
        s.stop_token_ids.extend(checked_token_ids("stop_token_ids", stop_token_ids))
    s.ignore_eos = bool(ignore_eos)
    for token, bias in (logit_bias or {}).items():
        s.logit_bias[checked_token_ids("logit_bias", [token])[0]] = float(bias)
    if structured is not None:
        s.structured.CopyFrom(structured_proto(structured))
    s.echo = bool(echo)
    if speculative is not None:
        s.speculative = bool(speculative)


def _set_tools(req: pb.GenerateRequest, tools: Sequence[Mapping] | str | None, tool_choice: str | Mapping | None,
               parallel_tool_calls: bool | None) -> None:
    """The function tools (as JSON text) and how the model may call them."""
    if tools:
        if not isinstance(tools, str):
            check_json_depth(list(tools), "tools")
        req.tools = tools if isinstance(tools, str) else json.dumps(list(tools), ensure_ascii=False)
    if tool_choice is not None:
        _set_tool_choice(req.tool_choice, tool_choice)
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = bool(parallel_tool_calls)


def _set_template_options(req: pb.GenerateRequest, chat_template_kwargs: Mapping[str, Any] | None,
                          reasoning_effort: str | None, thinking_token_budget: int | None) -> None:
    """What reaches the chat template (its variables, a reasoning effort) and the thinking budget."""
    if chat_template_kwargs:
        if not isinstance(chat_template_kwargs, Mapping):
            raise BadField("chat_template_kwargs", "chat_template_kwargs must be an object of template variables, "
                                                   f"got {shown(chat_template_kwargs)}")
        check_json_depth(dict(chat_template_kwargs), "chat_template_kwargs")
        req.chat_template_kwargs = json.dumps(dict(chat_template_kwargs), ensure_ascii=False)
    if reasoning_effort is not None:
        req.reasoning_effort = reasoning_effort
    if thinking_token_budget is not None:
        if isinstance(thinking_token_budget, bool) or not isinstance(thinking_token_budget, int) \
                or not 0 <= thinking_token_budget <= 2**32 - 1:
            raise BadField("thinking_token_budget", f"thinking_token_budget must be an integer between 0 and "
                                                    f"{2**32 - 1}, got {shown(thinking_token_budget)}")
        req.thinking_token_budget = thinking_token_budget


def checked_token_ids(name: str, ids: Iterable) -> list[int]:
    """Token ids as the wire's int32s, or BadField naming `name`, the range and the value
    (ids past int32 cannot be sent; the server refuses a negative one, or one past its
    vocabulary, in its own words)."""
    out = []
    for t in ids:
        try:
            t = int(t)
        except (TypeError, ValueError):
            raise BadField(name, f"{name} token ids are integers, got {shown(t)}") from None
        if not -MAX_INT32 - 1 <= t <= MAX_INT32:  # the wire's int32 (a negative one is refused by its check)
            raise BadField(name, f"{name} token id {t} is out of range: token ids are 0 .. {MAX_INT32}")
        out.append(t)
    return out


def _add_message(messages, m: Mapping) -> None:
    """One chat message dict (OpenAI's shape) onto the wire."""
    content = m.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidRequest(f"a {shown(m.get('role'))} message's content must be text")
    reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
    if not isinstance(reasoning, str):
        raise InvalidRequest(f"a {shown(m.get('role'))} message's reasoning_content must be text")
    msg = messages.add(role=m["role"], content=content, tool_call_id=m.get("tool_call_id") or "",
                       name=m.get("name") or "", reasoning=reasoning)
    for call in m.get("tool_calls") or ():
        fn = call.get("function", call)
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            check_json_depth(args, "arguments", param="messages")
        msg.tool_calls.add(id=call.get("id") or "", name=fn.get("name") or "",
                           arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _set_tool_choice(choice: pb.ToolChoice, value: str | Mapping) -> None:
    if isinstance(value, str):
        if value in ("none", "auto", "required"):
            choice.mode = value
        else:
            choice.function = value
        return
    fn = value.get("function") if isinstance(value, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else (value.get("name") if isinstance(value, Mapping) else None)
    if not isinstance(name, str) or not name:
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": ...}}')
    choice.function = name


# Per-request features that only some workers of a model may have (LoadReport.features),
# each with the request field that asks for it and what it is: a request that asks for
# one is placed only on a worker that has it.
SPECULATIVE = "speculative"
FEATURES = {SPECULATIVE: ("speculative", "speculative decoding")}


def features_asked(request: pb.GenerateRequest) -> frozenset[str]:
    """The per-request features `request` needs its worker to have."""
    s = request.sampling
    return frozenset({SPECULATIVE}) if s.HasField("speculative") and s.speculative else frozenset()


def refuse_features(model: str, missing: Iterable[str]) -> BadField:
    """The 400 for a request that asks for a feature no worker of `model` has (the same
    from the router, which saw every worker of it, and from a worker on its own)."""
    field, what = FEATURES[sorted(missing)[0]]
    return BadField(field, f"{field}: true asks for {what}, and no worker of model {quoted(model)} runs {what}: "
                           f"leave {field} unset (or false) to be served without it")


# A prompt's text longer than this many characters per token of max_model_len cannot fit
# and is refused before it is tokenized (a byte-level BPE token is rarely more than ~16
# characters even of code's indentation; 32 leaves room for any real text).
CHARS_PER_TOKEN_BOUND = 32


def check_id_and_model(request, model_field: str = "model") -> None:
    """A request's id and model name within their bounds (any request type that has them):
    the id is copied into every chunk and log line, the name into messages."""
    if len(request.request_id) > MAX_ID_CHARS:
        raise BadField("request_id", f"request_id has {len(request.request_id)} characters: at most {MAX_ID_CHARS} "
                                     "are allowed")
    if len(request.model) > MAX_NAME_CHARS:
        raise BadField(model_field, f"{model_field} has {len(request.model)} characters: no model's name is longer "
                                    f"than {MAX_NAME_CHARS}")


def validate_request(request: pb.GenerateRequest, limits: RequestLimits = RequestLimits(),
                     names: Mapping[str, str] | None = None) -> None:
    """Raise InvalidRequest, with what to fix, for a request no server can serve: the
    message names the field, the limit and the value, and `param` the field. `names` maps
    a wire field to the name the client knows it by (an HTTP front's: "stop" is
    "stop_sequences" in Anthropic's API), for the fronts that check a request before they
    send it."""
    named = (lambda field: names.get(field, field)) if names else (lambda field: field)
    check_id_and_model(request, named("model"))
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("the request has no prompt: set one of text, token_ids or chat")
    if which == "text" and not request.text:
        raise BadField(named("prompt"), "the prompt is empty: send some text")
    if which == "token_ids" and not request.token_ids.ids:
        raise BadField(named("prompt"), "the prompt is empty: send at least one token")
    if which == "chat" and not request.chat.messages:
        raise BadField(named("messages"), "the chat has no messages: send at least one")
    s = request.sampling
    if s.HasField("max_tokens") and s.max_tokens < MAX_TOKENS_LOW:
        raise BadField(named("max_tokens"), _MAX_TOKENS_MESSAGE.format(named("max_tokens"), s.max_tokens))
    stop = named("stop")
    if len(s.stop) > limits.max_stop_strings:
        raise BadField(stop, f"{len(s.stop)} stop strings: at most {limits.max_stop_strings} are allowed in '{stop}'")
    longest = max((len(x) for x in s.stop), default=0)
    if longest > limits.max_stop_string_length:
        raise BadField(stop, f"a stop string of {longest} characters: at most {limits.max_stop_string_length} are "
                             f"allowed in '{stop}'")
    if any(not x for x in s.stop):
        raise BadField(stop, f"an empty stop string in '{stop}' would stop at once: remove it")
    ids = named("stop_token_ids")
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise BadField(ids, f"{len(s.stop_token_ids)} stop token ids: at most {limits.max_stop_token_ids} are "
                            f"allowed in '{ids}'")
    if any(t < 0 for t in s.stop_token_ids):
        raise BadField(ids, f"'{ids}': stop token ids must be >= 0, got {min(s.stop_token_ids)}")
    check_sampling(s, named)
    if num_choices(request) > limits.max_n:
        raise BadField(named("n"), f"{named('n')}={s.n}: at most {limits.max_n} samples per request are allowed "
                                   "(max_n)")
    if s.n > 1 and request.resume_token_ids:
        raise BadField("resume_token_ids", "a request with n > 1 cannot be resumed (resume_token_ids)")
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and getattr(s, name) > MAX_LOGPROBS:
            raise BadField(named(name), f"{named(name)} must be between 0 and {MAX_LOGPROBS}, got {getattr(s, name)}")
    validate_tools(request, named)
    validate_reasoning(request, named)


# What reasoning_effort may say (OpenAI's values; a template reads it, gpt-oss's into its
# system message).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# chat_template_kwargs cannot set what the server itself passes to the template, nor the
# parameters of apply_chat_template itself (transformers'): the worker tokenizes in the same
# call, so truncation / max_length would cut the prompt, padding would fill it with pad
# tokens, return_tensors would change what comes back. Only template variables get through.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "padding", "truncation", "max_length", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def template_kwargs(request: pb.GenerateRequest) -> dict[str, Any]:
    """A chat's extra chat-template variables: its chat_template_kwargs and reasoning_effort."""
    out = parse_json(request.chat_template_kwargs, "chat_template_kwargs") if request.chat_template_kwargs else {}
    if request.reasoning_effort:
        out["reasoning_effort"] = request.reasoning_effort
    return out


def validate_reasoning(request: pb.GenerateRequest, named=lambda field: field) -> None:
    """chat_template_kwargs, reasoning_effort and thinking_token_budget: a chat's, well formed."""
    used = [name for name, on in (("chat_template_kwargs", bool(request.chat_template_kwargs)),
                                  ("reasoning_effort", bool(request.reasoning_effort)),
                                  ("thinking_token_budget", request.HasField("thinking_token_budget"))) if on]
    if used and request.WhichOneof("prompt") != "chat":
        raise BadField(named(used[0]), f"{', '.join(map(named, used))} need a chat prompt (messages)")
    if request.chat_template_kwargs:
        field = named("chat_template_kwargs")
        kwargs = parse_json(request.chat_template_kwargs, field)
        if not isinstance(kwargs, dict):
            raise BadField(field, f"{field} must be a JSON object of template variables")
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise BadField(field, f"{field} cannot set {', '.join(map(repr, reserved))}: these are not template "
                                  "variables (the server sets them from the request and its own settings)")
    if request.reasoning_effort and request.reasoning_effort not in REASONING_EFFORTS:
        field = named("reasoning_effort")
        raise BadField(field, f"{field} must be one of {', '.join(REASONING_EFFORTS)}, got "
                              f"{shown(request.reasoning_effort)}")


def num_choices(request: pb.GenerateRequest) -> int:
    """How many samples (`index` 0 .. n-1) the request's stream carries; each ends with
    a chunk that has its finish_reason, and the last of those has the usage."""
    return max(1, request.sampling.n)


def prompt_chars(request: pb.GenerateRequest) -> int:
    """Characters of a text or chat prompt (0 for token ids)."""
    which = request.WhichOneof("prompt")
    if which == "text":
        return len(request.text)
    if which == "chat":
        return len(request.tools) + len(request.chat_template_kwargs) + sum(
            len(m.content) + len(m.role) + len(m.reasoning) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
            for m in request.chat.messages)
    return 0


def check_fits(request: pb.GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """The request's max_tokens once its prompt is counted: InvalidRequest when an explicit
    max_tokens does not fit in max_model_len (vLLM's rule). Unset, a chat runs to the end
    of the context (as OpenAI's and vLLM's chat do); a text or token prompt gets
    DEFAULT_MAX_TOKENS, cut to the room left. Resumed tokens count as generated ones."""
    room = max_model_len - num_prompt_tokens
    s = request.sampling
    if s.HasField("max_tokens"):
        if s.max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + s.max_tokens} tokens ({num_prompt_tokens} in the prompt, {s.max_tokens} for "
                "the completion). Please reduce the length of the prompt or max_tokens.")
        return s.max_tokens
    if room < 1:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens and the prompt has "
                             f"{num_prompt_tokens}: no room for a completion. Please shorten the prompt.")
    return room if request.WhichOneof("prompt") == "chat" else min(DEFAULT_MAX_TOKENS, room)


def max_tokens(request: pb.GenerateRequest) -> int:
    s = request.sampling
    return s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
