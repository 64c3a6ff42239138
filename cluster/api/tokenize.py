"""vLLM's `POST /tokenize`: the token ids of the prompt a completion (`prompt`) or a chat
(`messages`, with its `tools`, `tool_choice` and `chat_template_kwargs`) would prefill, from a worker of
the model (`Backend.tokenize`), not run. The answer is vLLM's: `count`, `max_model_len`,
`tokens`. What the worker's prompt cannot be made to differ in (no generation prompt, a
continued final message, other special tokens, the tokens' strings) is a 400 naming it.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from cluster.api.bodies import ChatBody, completion_prompt, body_field, check_params
from cluster.api.errors import BadField, OrchardError
from cluster.api.http import BACKEND, LIMITS, error_of, read_body, request_timeout
from cluster.api.limits import quoted
from cluster.api.wire import build_request, validate_request

PARAMS = frozenset({"model", "prompt", "messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort",
                    "add_generation_prompt", "continue_final_message", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = ("model", "messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", _tokenize)


def _fixed(body: dict, name: str, served) -> None:
    """A field this server serves at one value only: any other is refused by name."""
    value = body_field(body, name, bool, served)
    if value != served:
        raise BadField(name, f"{name}={str(value).lower()} is not supported: the prompt is tokenized as generation "
                             f"prefills it ({name}={str(served).lower()})")


def tokenize_request(body: dict, limits):
    """The wire request whose prompt `body` asks for."""
    check_params(body, PARAMS)
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise BadField("prompt", "send one of 'prompt' (a completion's) or 'messages' (a chat's)")
    _fixed(body, "add_generation_prompt", True)
    _fixed(body, "continue_final_message", False)
    _fixed(body, "add_special_tokens", not chat)
    _fixed(body, "return_token_strs", False)
    rid = f"tok-{uuid.uuid4().hex}"
    if chat:
        return ChatBody.parse({k: body[k] for k in CHAT_FIELDS if k in body}, limits).request(rid, limits)
    chat_only = [k for k in CHAT_FIELDS[2:] if k in body]
    if chat_only:
        raise BadField(chat_only[0], f"{quoted(chat_only[0])} goes with 'messages' (a chat), not 'prompt'")
    request = build_request(completion_prompt(body), model=body_field(body, "model", str, ""), request_id=rid)
    validate_request(request, limits)
    return request


async def _tokenize(request: web.Request) -> web.Response:
    try:
        proto = tokenize_request(await read_body(request), request.app[LIMITS])
        counted = await request.app[BACKEND].tokenize(proto, timeout=request_timeout(request))
    except OrchardError as e:
        return error_of(e)
    return web.json_response({"count": len(counted.token_ids), "max_model_len": counted.max_model_len,
                              "tokens": list(counted.token_ids), "token_strs": None})
