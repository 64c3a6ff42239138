"""A generate request made ready for the engine: its prompt's token ids and its params.

`PromptBuilder` holds what the model says about its prompts (its chat template and
tokenizer, its thinking and tool-call formats, its special tokens, its grammar compiler)
and turns one validated `GenerateRequest` into a `Prompt` in one call (`build`), in the
order the cost of each step asks: the checks that only the worker can make (vocabulary,
how long a text can possibly fit) before anything is tokenized; a forced tool call and a
structured output compiled (off the event loop) before the prompt is rendered; the chat
template rendered in a process of its own (chat_render.py) or, for a tokenizer that
renders chats its own way, on the tokenizer's thread pool; the params fitted to the
prompt's length; for a chat, how its output is read (`ChatReading`: thinking, calls).

Errors are `cluster.api.errors` exceptions, as the service raises them.
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from cluster.api.errors import BadField, InvalidRequest
from cluster.api.limits import quoted
from cluster.api.tools import parse_tools, template_messages, tool_choice_mode
from cluster.api.wire import CHARS_PER_TOKEN_BOUND, check_fits, max_tokens, prompt_chars, template_kwargs
from cluster.formats.calls import CallFormat
from cluster.formats.registry import call_format, reasoning_format
from cluster.formats.split import OutputSplitter, make_splitter
from cluster.formats.thinking import ReasoningFormat, ThinkingSpec, ThinkingTracker, prompt_state
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.worker.admission import out_of_vocabulary
from cluster.worker.chat_render import PROBE_MESSAGES, RenderPool, TemplateTypeError, render_call
from cluster.worker.sampling_params import SamplingParams, StructuredOutput
from cluster.worker.structured import InvalidGrammar, call_constraint, with_thinking

# Prompts shorter than this are tokenized inline: a thread-pool hop would cost more.
INLINE_TOKENIZE_CHARS = 512


def sampling_params_from_proto(request: pb.GenerateRequest, num_resumed: int = 0,
                               limit: int | None = None) -> SamplingParams | None:
    """The engine's params for a validated request (`limit`: its max_tokens, once fitted
    to max_model_len); None when the `num_resumed` tokens generated elsewhere already
    reach it (nothing is left to generate). Values out of the engine's ranges are
    InvalidRequest, in the engine's words."""
    s = request.sampling
    limit = max_tokens(request) if limit is None else limit
    kwargs = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "repetition_penalty",
                 "prompt_logprobs", "speculative"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    if s.HasField("structured"):
        kind = s.structured.WhichOneof("kind")
        spec = {"json_object": "", "choice": tuple(s.structured.choice.choices)}.get(kind)
        kwargs["structured"] = StructuredOutput(kind, getattr(s.structured, kind) if spec is None else spec)
    try:
        params = SamplingParams(
            max_tokens=limit,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            logit_bias=dict(s.logit_bias),
            n=max(1, s.n),
            **kwargs,
        )
    except (TypeError, ValueError) as e:
        raise InvalidRequest(str(e)) from None
    return params if limit > num_resumed else None


@dataclass(frozen=True)
class ChatReading:
    """How a chat request's output is read: the model's thinking format and where the
    prompt left it, the call format when tools are on, the special tokens kept (and the call
    markers among them, which never reach the text)."""

    reasoning: ReasoningFormat | None
    state: str
    calls: CallFormat | None
    tools: list
    parallel: bool
    kept: frozenset
    hidden: tuple[str, ...] = ()

    def splitter(self) -> OutputSplitter | None:
        return make_splitter(self.reasoning, self.state, self.calls, self.tools, self.parallel, self.hidden)

    def tracker(self, token_text: Callable[[int], str]) -> ThinkingTracker | None:
        """One sample's thinking over its token ids: usage's reasoning_tokens."""
        if self.reasoning is None:
            return None
        return ThinkingTracker(ThinkingSpec(self.reasoning.start, self.reasoning.end, self.state == "open"), token_text)


@dataclass(frozen=True)
class Prompt:
    """A request ready for the engine: its prompt's token ids, the tokens generated
    elsewhere before (`resume`), its params (None: the resumed tokens already reach its
    max_tokens) and, for a chat, how its output is read."""

    token_ids: list[int]
    resume: list[int]
    params: SamplingParams | None
    reading: ChatReading | None


def probe_call(tokenizer) -> dict | None:
    """What the render processes' health probe renders: the model's template on a
    one-line chat (None, where no call can be built for it: the pool's own probe)."""
    try:
        return render_call(tokenizer, PROBE_MESSAGES)
    except Exception:
        return None


class PromptBuilder:
    """The prompts of one loaded model. `renders` renders its Jinja chat template (None:
    the tokenizer renders chats its own way); `tokenize_pool` takes long tokenizations
    and such renders off the event loop, `grammar_pool` grammar compiles; `grammars` is
    the engine's (thread-safe) compiler, None for an engine without one."""

    def __init__(self, model_name: str, tokenizer, vocab_size: int, max_model_len: int, grammars,
                 renders: RenderPool | None, tokenize_pool: ThreadPoolExecutor, grammar_pool: ThreadPoolExecutor):
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.renders = renders
        self._tokenize_pool = tokenize_pool
        self._grammar_pool = grammar_pool
        self._read_formats(tokenizer)

    async def build(self, request: pb.GenerateRequest) -> Prompt:
        """The request's prompt and params (see the module's docstring for the order)."""
        self._check_cost(request)  # before any work
        chat = request.WhichOneof("prompt") == "chat"
        calls, forced = await self._check_asks(request)
        resume = list(request.resume_token_ids)
        prompt = await self.prompt_token_ids(request)
        self._check_length(len(prompt), len(resume))
        params = sampling_params_from_proto(request, len(resume), check_fits(request, len(prompt),
                                                                             self.max_model_len))
        reading = self._chat(request, prompt, calls) if chat else None
        if params is not None and reading is not None:
            params = await self._chat_params(request, params, reading, forced)
        return Prompt(prompt, resume, params, reading)

    async def count(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt `build` would make of `request`: what a token count asks. What `build`
        refuses is refused here too, but for a prompt longer than max_model_len, which is
        counted (the caller compares), up to the same cost bound on its text."""
        self._check_cost(request, counting=True)
        await self._check_asks(request)
        ids = await self.prompt_token_ids(request)
        wrong = out_of_vocabulary(ids, self.vocab_size)  # (the engine's own check, which a count never reaches)
        if wrong:
            raise BadField("prompt", wrong)
        return ids

    async def _check_asks(self, request: pb.GenerateRequest) -> tuple[CallFormat | None, str | None]:
        """What the request asks beside its prompt, checked before tokenizing: its tools (the
        model's call format, a forced call's grammar) and the engine's ranges for its sampling.
        Returns the call format and the forced tool_choice."""
        calls = self._call_format(request)
        forced = self._force_tool_call(request, calls)
        early = sampling_params_from_proto(request, len(request.resume_token_ids))
        if early is not None and early.structured is not None:
            await self._compile(early.structured, forced)
        return calls, forced

    async def encode(self, text: str, **kwargs) -> list[int]:
        """`text`'s token ids: inline when short, else on the tokenizer's thread pool."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text, **kwargs))
        return list(await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, functools.partial(self.tokenizer.encode, text, **kwargs)))

    # -- cost checks --------------------------------------------------------------------
    def _check_cost(self, request: pb.GenerateRequest, counting: bool = False) -> None:
        """What only the worker knows: the vocabulary, and how long a text can possibly fit
        (`counting`: a token count, which tokenizes a text up to that bound and takes any
        number of token ids)."""
        bad = [t for t in request.sampling.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"stop token id {bad[0]} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        bad = [t for t in request.sampling.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token id {bad[0]} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        chars, bound = prompt_chars(request), CHARS_PER_TOKEN_BOUND * self.max_model_len
        if chars > bound:
            raise BadField("messages" if request.WhichOneof("prompt") == "chat" else "prompt",
                           f"the prompt has {chars} characters, more than max_model_len={self.max_model_len} "
                           f"tokens can hold (at most {bound} characters are read): shorten it")
        if len(request.token_ids.ids) > self.max_model_len and not counting:
            raise InvalidRequest(f"the prompt has {len(request.token_ids.ids)} tokens, more than "
                                 f"max_model_len={self.max_model_len}: shorten it")

    def _check_length(self, num_prompt: int, num_resumed: int) -> None:
        n, limit = num_prompt + num_resumed, self.max_model_len
        if n > limit:
            what = f"{num_prompt} prompt + {num_resumed} resumed tokens" if num_resumed else f"{num_prompt} tokens"
            raise InvalidRequest(f"the prompt has {what}, more than max_model_len={limit}: shorten it")

    # -- the prompt's tokens ------------------------------------------------------------
    async def prompt_token_ids(self, request: pb.GenerateRequest, max_chars: int | None = None) -> list[int]:
        """The prompt's token ids (a validated request has one of the three kinds). The
        router calls it too, to name a prompt's KV blocks as this worker will
        (router/prompt_blocks.py), with `max_chars`: only the first `max_chars` characters of
        the prompt's text are tokenized (its tokens then differ from the whole text's at
        most near the cut). A chat the tokenizer renders its own way takes no `max_chars`."""
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which == "text":
            return await self.encode(request.text[:max_chars])
        tools = parse_tools(request.tools) if tool_choice_mode(request) != "none" else None
        if self.renders is None:  # no Jinja template: the tokenizer's own rendering (trusted code)
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, self._apply_chat_template, request.chat.messages, tools, template_kwargs(request))
        text = await self._render_chat(request.chat.messages, tools or None, template_kwargs(request))
        return await self.encode(text[:max_chars], add_special_tokens=False)

    async def _render_chat(self, messages, tools: list[dict] | None, kwargs: dict) -> str:
        """The chat's prompt text, rendered by the model's Jinja template in a render
        process. A template that takes a call's arguments only as text (DeepSeek's
        concatenate them) gets them so on a second try."""
        try:
            return await self.renders.render(self._render_call(template_messages(messages), tools, kwargs))
        except TemplateTypeError:
            if not any(m.tool_calls for m in messages):
                raise
        return await self.renders.render(self._render_call(template_messages(messages, arguments_as_text=True),
                                                           tools, kwargs))

    def _render_call(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> dict:
        try:
            return render_call(self.tokenizer, messages, tools, kwargs)
        except Exception as e:  # no template for these (a dict of templates without a default, ...)
            raise InvalidRequest(f"the chat template could not be applied to these messages: {e}") from None

    def _apply_chat_template(self, messages, tools: list[dict] | None = None, kwargs: dict | None = None) -> list[int]:
        """The chat's prompt tokens, for a tokenizer that renders chats its own way. A
        template that takes a call's arguments only as text gets them so on a second try."""
        extra = dict(kwargs or {}, **({"tools": tools} if tools else {}))
        try:
            try:
                ids = self.tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                                         tokenize=True, **extra)
            except TypeError:
                if not any(m.tool_calls for m in messages):
                    raise
                ids = self.tokenizer.apply_chat_template(template_messages(messages, arguments_as_text=True),
                                                         add_generation_prompt=True, tokenize=True, **extra)
        except Exception as e:
            raise InvalidRequest(f"the chat template could not be applied to these messages: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers may return an encoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    async def _compile(self, spec: StructuredOutput, forced: str | None = None) -> None:
        """Compile (and cache) a structured output's grammar before any engine work, off
        the event loop: a schema that cannot be compiled, or that no output can follow, is
        the request's fault. `forced`: the tool_choice whose call the grammar forces."""
        if self.grammars is None:
            raise InvalidRequest("structured outputs are not supported by this worker's engine")
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.grammars.compile, spec)
        except InvalidGrammar as e:
            if forced is not None:
                raise BadField("tools", f"tool_choice {forced} forces a call that the tools' parameters schemas "
                                        f"make impossible: {str(e).replace('the grammar', 'the call')}") from None
            raise BadField("response_format", str(e)) from None

    # -- formats, tool forcing, thinking, grammars -------------------------------------
    def _read_formats(self, tok) -> None:
        """The model's thinking and call formats, from its chat template and vocabulary, and
        its special tokens (a marker that is one is named <[id]> in a grammar)."""
        template = getattr(tok, "chat_template", None)
        vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}  # (a test's bare tokenizer has none)
        self.reasoning = reasoning_format(template, vocab)
        mlx = None
        if getattr(tok, "has_tool_calling", False):
            mlx = (tok.tool_call_start, tok.tool_call_end or "", tok.tool_parser,
                   getattr(tok.tool_parser, "__module__", "") or "")
        self.calls = call_format(template, vocab, mlx)
        added = getattr(tok, "added_tokens_decoder", None) or {}
        self._special = {t.content: i for i, t in added.items() if getattr(t, "special", False)}

    def _call_format(self, request: pb.GenerateRequest) -> CallFormat | None:
        """The model's call format for a request that offers tools (None without); a model
        with no tool calling refuses tools."""
        if tool_choice_mode(request) == "none":
            return None
        if self.calls is None:
            raise InvalidRequest(f"model {self.model_name!r} has no tool calling (its chat template and tokenizer "
                                 "have no tool-call format Orchard or mlx-lm knows): send the request without tools")
        return self.calls

    def _atom(self, text: str) -> str:
        """A marker as a grammar atom (a terminal of the grammar): <[id]> for a special token,
        else its quoted text."""
        i = self._special.get(text)
        return f"<[{i}]>" if i is not None else json.dumps(text)

    def _force_tool_call(self, request: pb.GenerateRequest, calls: CallFormat | None) -> str | None:
        """tool_choice "required" or a named function: the request's output is constrained
        (a grammar in its `structured` field) to one call in the family's own format, the
        arguments following the function's parameters schema; a format that allows no
        grammar (XML calls, pythonic ones) is refused by name. Returns the choice (for
        messages), None when nothing is forced."""
        mode = tool_choice_mode(request)
        if mode not in ("required", "function"):
            return None
        what = "'required'" if mode == "required" else f"function {quoted(request.tool_choice.function)}"
        if request.sampling.HasField("structured"):
            raise InvalidRequest(f"tool_choice {what} and a structured output (response_format) cannot be combined: "
                                 "send one of them")
        if calls.grammar is None:
            raise InvalidRequest(f"tool_choice {what} is enforced by constrained decoding, which the call format of "
                                 f"model {self.model_name!r} ({calls.name}) does not allow: use tool_choice 'auto'")
        choice = "required" if mode == "required" else request.tool_choice.function
        try:
            spec = call_constraint(calls.grammar, parse_tools(request.tools), choice, self._atom, calls.start,
                                   calls.end)
        except InvalidGrammar as e:
            raise InvalidRequest(str(e)) from None
        request.sampling.structured.grammar = spec.spec
        return what

    def _chat(self, request: pb.GenerateRequest, prompt: list[int], calls: CallFormat | None) -> ChatReading:
        fmt = self.reasoning
        state = prompt_state(fmt, self.tokenizer.decode(prompt[-32:], skip_special_tokens=False)) if fmt else "free"
        markers = (fmt.markers if fmt else ()) + (calls.markers if calls else ())
        kept = frozenset(self._special[m] for m in markers if m in self._special)
        parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
        hidden = tuple(m for m in (calls.markers if calls else ()) if m in self._special)
        return ChatReading(fmt, state, calls, parse_tools(request.tools) if calls else [], parallel, kept, hidden)

    async def _chat_params(self, request: pb.GenerateRequest, params: SamplingParams, reading: ChatReading,
                           forced: str | None) -> SamplingParams:
        """A chat's params: the family's markers kept in its text; for a thinking model with a
        budget the thinking followed by the engine (and ended at the budget), and a structured
        output or forced call applied to the answer after the thinking."""
        fmt, changes = reading.reasoning, {"kept_special_ids": reading.kept}
        if fmt is not None:
            budget = request.thinking_token_budget if request.HasField("thinking_token_budget") else None
            if budget is not None:  # without one the engine's step does nothing for the thinking
                end_ids = tuple(self.tokenizer.encode(fmt.end, add_special_tokens=False))
                changes["thinking"] = ThinkingSpec(fmt.start, fmt.end, reading.state == "open", budget, end_ids)
            if params.structured is not None:
                thinking = None
                if reading.state != "closed":
                    # a model that opens its thinking itself may skip it, unless a budget asks for it
                    thinking = fmt.thinking_grammar(self._atom, open=reading.state == "open",
                                                    optional=reading.state == "free" and budget is None)
                prefix = fmt.answer_prefix(self._atom) if forced is None else ""  # a forced call has its own
                try:
                    changes["structured"] = with_thinking(params.structured, thinking, prefix)
                except InvalidGrammar as e:
                    raise InvalidRequest(str(e)) from None
                await self._compile(changes["structured"], forced)
        return replace(params, **changes)

