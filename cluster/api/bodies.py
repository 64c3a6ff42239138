"""JSON request bodies, read once into typed values: each field checked by the name the
client sent (its type, its range, whether this endpoint reads it at all).

- `body_field`, `int_field`, `check_params`, `check_metadata`: the field readers every
  API's body uses (a BadField names the field, the kind or range, and the value).
- `ChatBody.parse(body, limits)` (/v1/chat/completions) and `CompletionBody.parse(body,
  limits)` (one prompt of /v1/completions): every field checked once, in one pass, into a
  frozen dataclass; its `request(request_id, limits)` is the `GenerateRequest`, checked as
  every backend will check it (`validate_request`), with the errors naming the body's
  fields. `Sampling` is what the two share.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from cluster.api.constraints import openai_extras
from cluster.api.errors import BadField
from cluster.api.limits import (COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_INT32, MAX_LOGPROBS, MAX_TOKENS_HIGH,
                                MAX_TOKENS_LOW, RequestLimits, quoted, shown)
from cluster.api.wire import build_request, validate_request
from cluster.proto.orchard.v1 import orchard_pb2 as pb

# Sent by real clients and changing no output: every API accepts them. Any other
# parameter an endpoint does not read is refused by name (400), never silently ignored.
ACCEPTED_NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                                "safety_identifier"})

_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
               list: "an array"}


def body_field(body: dict, name: str, kind: type | tuple, default=None, *, param: str | None = None):
    """`body[name]` if it is of `kind` (None: `default`), else BadField naming the field
    (`param`, when the client knows it by another name), the kind and the value."""
    value = body.get(name, default)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds) or (float in kinds and isinstance(value, int))
    if not ok:
        field = param or name
        raise BadField(field, f"'{field}' must be {' or '.join(_KIND_NAMES.get(k, k.__name__) for k in kinds)}, "
                              f"got {shown(value)}")
    return value


def int_field(body: dict, name: str, default: int | None = None, *, low: int | None = None, high: int | None = None,
              param: str | None = None) -> int | None:
    """An integer field within [low, high] (either end open when None), else BadField
    that names the field, the range and the value."""
    value = body_field(body, name, int, default, param=param)
    if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
        field = param or name
        what = (f"between {low} and {high}" if low is not None and high is not None else
                f">= {low}" if low is not None else f"<= {high}")
        raise BadField(field, f"'{field}' must be {what}, got {shown(value)}")
    return value


def check_params(body: dict, known: frozenset[str]) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise BadField(unknown[0][:80], f"unknown parameter{'s' if len(unknown) > 1 else ''} "
                                          f"{', '.join(map(quoted, unknown[:5]))}{more}: not supported by this server")


def check_metadata(body: dict) -> None:
    """OpenAI's bounds on `metadata` (where a response echoes it back and keeps it): at most
    16 pairs, keys of at most 64 characters, string values of at most 512."""
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise BadField("metadata", f"'metadata' must be an object of strings, got {shown(metadata)}")
    if len(metadata) > 16:
        raise BadField("metadata", f"'metadata' has {len(metadata)} keys: at most 16 are allowed")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise BadField("metadata", f"metadata[{shown(key)}]: keys are at most 64 characters and values strings "
                                       f"of at most 512, got {shown(value)}")


# What the chat and completions endpoints read (everything else is refused by name).
_COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "seed", "stop",
                     "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                     "top_k", "min_p", "stop_token_ids", "ignore_eos", "repetition_penalty", "response_format",
                     "speculative", "keep_alive",
                     "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}
                    ) | ACCEPTED_NO_EFFECT
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort", "thinking_token_budget",
                         "include_reasoning"}
# best_of and suffix are read to be refused by name (completions.py)
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "best_of", "suffix", "prompt_logprobs"}


def n_field(body: dict, limits: RequestLimits) -> int:
    """`n`, checked against the server's max_n before anything is built for its samples."""
    n = body_field(body, "n", int, 1)
    if n < 1:
        raise BadField("n", f"n must be >= 1, got {n}")
    if n > limits.max_n:
        raise BadField("n", f"n={shown(n)}: at most {limits.max_n} samples per request are allowed (max_n)")
    return n


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise BadField("stop", f"'stop' must be a string or an array of strings, got {shown(stop)}")


def _max_tokens(body: dict, chat: bool) -> int | None:
    """max_completion_tokens (chat's newer name) or max_tokens; unset, a completion's default
    (a chat runs to the end of the context)."""
    max_tokens = int_field(body, "max_completion_tokens", low=MAX_TOKENS_LOW, high=MAX_TOKENS_HIGH) if chat else None
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", low=MAX_TOKENS_LOW, high=MAX_TOKENS_HIGH)
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    return max_tokens


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token: chat's `logprobs: true` with `top_logprobs`, a completion's
    `logprobs` count; None asks for none."""
    if not chat:
        return int_field(body, "logprobs", low=0, high=MAX_LOGPROBS)
    want = body_field(body, "logprobs", bool, False)
    top = int_field(body, "top_logprobs", 0, low=0, high=MAX_LOGPROBS)
    return top if want else None


@dataclass(frozen=True)
class Sampling:
    """The sampling fields the chat and completions bodies share, checked, under
    `build_request`'s keyword names (None: unset)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    speculative: bool | None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    structured: pb.StructuredOutput | None = None
    keep_alive: float | None = None  # Ollama's (a router's fleet: how long its catalog model stays loaded)

    @classmethod
    def parse(cls, body: dict, chat: bool, limits: RequestLimits) -> Sampling:
        """Each sampling field of `body`, checked by the name the client sent; then the
        penalties, bias and structured output (`openai_extras`)."""
        n = n_field(body, limits)
        if n != 1 and not chat:  # completions.py takes n off the body and sets it per prompt
            raise BadField("n", "n is set per prompt by the completions endpoint")
        if body_field(body, "best_of", int, 1) != 1:
            raise BadField("best_of", "best_of is not supported")
        if body.get("echo"):
            raise BadField("echo", "echo is not supported")
        max_tokens = _max_tokens(body, chat)
        seed = int_field(body, "seed", low=-2**63, high=2**64 - 1)
        if seed is not None and seed < 0:
            seed &= 0xFFFF_FFFF_FFFF_FFFF  # OpenAI accepts negative seeds: keep them distinct
        logprobs = _logprobs(body, chat)
        stop_token_ids = body_field(body, "stop_token_ids", list, [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
            raise BadField("stop_token_ids", "'stop_token_ids' must be an array of integers")
        numbers = dict(temperature=body_field(body, "temperature", float), top_p=body_field(body, "top_p", float),
                       top_k=int_field(body, "top_k", low=0, high=MAX_INT32), min_p=body_field(body, "min_p", float))
        return cls(max_tokens=max_tokens, seed=seed, stop=_stop(body), stop_token_ids=stop_token_ids,
                   ignore_eos=body_field(body, "ignore_eos", bool, False), logprobs=logprobs,
                   speculative=body_field(body, "speculative", bool), n=n, keep_alive=_keep_alive(body), **numbers,
                   **openai_extras(body))  # penalties, logit_bias, structured outputs

    def kwargs(self) -> dict[str, Any]:
        """The `build_request` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _keep_alive(body: dict) -> float | None:
    """Ollama's keep_alive: seconds, or a duration such as "5m"; 0 unloads the model after
    the request, negative never."""
    from cluster.fleet import FleetError
    from cluster.fleet.catalog import MAX_KEEP_ALIVE_SECONDS, parse_duration

    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadField("keep_alive", f"'keep_alive' must be a duration (\"5m\", \"1h30m\") or a number of seconds, "
                                     f"got {shown(value)}")
    try:
        seconds = parse_duration(value)
    except FleetError as e:
        raise BadField("keep_alive", e.message) from None
    if seconds > MAX_KEEP_ALIVE_SECONDS:
        raise BadField("keep_alive", f"keep_alive: {shown(value)} is more than {MAX_KEEP_ALIVE_SECONDS:g} seconds; a "
                                     "negative keep_alive never unloads")
    return seconds


_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal",  # refusal: null only
                           "reasoning_content", "reasoning"})  # an assistant's thinking, for templates that keep it


def _chat_messages(body: dict) -> list[dict]:
    """OpenAI's messages as the wire takes them: text content (parts joined), an
    assistant's `tool_calls`, a tool result's `tool_call_id` and `name`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "'messages' must be a non-empty list of {role, content} objects")
    return [_chat_message(i, m) for i, m in enumerate(messages)]


def _chat_message(i: int, m: Any) -> dict:
    """messages[i], checked."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadField("messages", f"messages[{i}] must be an object with a string 'role'")
    if m["role"] not in _ROLES:
        raise BadField("messages", f"messages[{i}].role {shown(m['role'])} is not one of {', '.join(_ROLES)}")
    extra = sorted(k for k in m if k not in _MESSAGE_KEYS or (k == "refusal" and m[k] is not None))
    if extra:
        raise BadField("messages", f"messages[{i}]: {', '.join(map(quoted, extra[:5]))} not supported by this "
                                    "server")
    content = m.get("content") or ""
    if isinstance(content, list):  # content parts: keep the text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise BadField("messages", f"messages[{i}]: only text content parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise BadField("messages", f"messages[{i}].content must be a string or a list of text parts")
    msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) and isinstance(c.get("id", ""), (str, type(None)))
                and isinstance(c["function"].get("arguments", ""), (str, dict, type(None))) for c in calls):
            raise BadField("messages", f"messages[{i}].tool_calls must be a list of "
                                        "{id, type: function, function: {name, arguments}}")
        msg["tool_calls"] = calls
    for key in ("tool_call_id", "name", "reasoning_content", "reasoning"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise BadField("messages", f"messages[{i}].{key} must be a string")
            msg[key] = m[key]
    return msg


def _tool_choice(body: dict) -> str | dict | None:
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise BadField("tool_choice", "'tool_choice' must be a string or an object")
    return choice


@dataclass(frozen=True)
class ChatBody:
    """A /v1/chat/completions body, every field checked."""

    stream: bool
    include_usage: bool  # stream_options.include_usage, on a stream
    include_reasoning: bool  # vLLM's include_reasoning: false drops the thinking from the answer
    model: str
    sampling: Sampling
    messages: list[dict]
    tools: list | None
    tool_choice: str | dict | None
    parallel_tool_calls: bool | None
    chat_template_kwargs: dict | None  # vLLM's
    reasoning_effort: str | None
    thinking_token_budget: int | None  # its range: build_request's
    max_tokens_param: str  # the name the client gave max_tokens by (max_completion_tokens, newer)

    @classmethod
    def parse(cls, body: dict, limits: RequestLimits) -> ChatBody:
        """`body`'s fields, each checked once; BadField names the first that is wrong."""
        stream = body_field(body, "stream", bool, False)
        include_usage = bool(body_field(body, "stream_options", dict, {}).get("include_usage")) and stream
        include_reasoning = body_field(body, "include_reasoning", bool, True)
        check_params(body, CHAT_PARAMS)
        model = body_field(body, "model", str, "")
        sampling = Sampling.parse(body, True, limits)
        return cls(
            stream=stream, include_usage=include_usage, include_reasoning=include_reasoning, model=model,
            sampling=sampling, messages=_chat_messages(body), tools=body_field(body, "tools", list) or None,
            tool_choice=_tool_choice(body), parallel_tool_calls=body_field(body, "parallel_tool_calls", bool),
            chat_template_kwargs=body_field(body, "chat_template_kwargs", dict),
            reasoning_effort=body_field(body, "reasoning_effort", str),
            thinking_token_budget=body_field(body, "thinking_token_budget", int),
            max_tokens_param="max_completion_tokens" if body.get("max_completion_tokens") is not None else
            "max_tokens")

    @property
    def want_logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    def request(self, request_id: str, limits: RequestLimits) -> pb.GenerateRequest:
        """The wire request, checked as every backend will check it, the errors naming the
        body's fields."""
        request = build_request(messages=self.messages, model=self.model, request_id=request_id,
                                **self.sampling.kwargs(), tools=self.tools, tool_choice=self.tool_choice,
                                parallel_tool_calls=self.parallel_tool_calls,
                                chat_template_kwargs=self.chat_template_kwargs, reasoning_effort=self.reasoning_effort,
                                thinking_token_budget=self.thinking_token_budget)
        validate_request(request, limits, {"logprobs": "top_logprobs", "prompt": "messages",
                                           "max_tokens": self.max_tokens_param})
        return request


def completion_prompt(body: dict) -> str | list[int]:
    if "prompt" not in body:
        raise BadField("prompt", "'prompt' is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadField("prompt", "'prompt' must be a string or a list of token ids (one prompt per request)")


@dataclass(frozen=True)
class CompletionBody:
    """One prompt's /v1/completions body, its plain fields checked (completions.py reads the
    evaluation fields, echo, n, prompt lists, before)."""

    model: str
    sampling: Sampling
    prompt: str | list[int]

    @classmethod
    def parse(cls, body: dict, limits: RequestLimits) -> CompletionBody:
        check_params(body, COMPLETION_PARAMS)
        model = body_field(body, "model", str, "")
        sampling = Sampling.parse(body, False, limits)
        return cls(model=model, sampling=sampling, prompt=completion_prompt(body))

    def request(self, request_id: str, limits: RequestLimits) -> pb.GenerateRequest:
        """The wire request, checked as every backend will check it."""
        request = build_request(self.prompt, model=self.model, request_id=request_id, **self.sampling.kwargs())
        validate_request(request, limits, {"messages": "prompt"})
        return request
