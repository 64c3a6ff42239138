"""What one request may ask for, and how long and how large a client may be in sending
it: one place, read by the HTTP fronts, the gRPC servers and channels, the router and the
worker, so a request is refused (INVALID_ARGUMENT / HTTP 4xx, the message naming the field,
the limit and the value) the same way wherever it comes in, before any work that grows
with what it asks for.

`RequestLimits` holds what an operator may change (flags of `orchard worker serve` and
`orchard router serve`, the "request limits" group); the constants below are the wire's
own bounds, the same for every server and client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster.api.errors import BadField
from cluster.config import setting

# gRPC messages, both ways, on every server (worker, router), every channel the router opens
# to a worker, and the SDK's channels: a message one side accepts, the other can carry.
GRPC_MAX_MESSAGE_BYTES = 64 << 20
HTTP_MAX_BODY_BYTES = 32 << 20  # an HTTP request body (413 beyond)
MAX_ID_CHARS = 256  # request_id, a tool call's id: copied into every chunk and every log line
MAX_NAME_CHARS = 256  # a model's, a function's or a message author's name
MAX_LOGPROBS = 20  # alternatives per token (logprobs, top_logprobs, prompt_logprobs), as OpenAI's
MAX_INT32 = 2**31 - 1  # token ids, top_k: the wire's int32 fields
# A deadline longer than this is no deadline (gRPC's own arithmetic overflows near 1e11 s).
MAX_TIMEOUT_SECONDS = 30 * 86400.0
MAX_SHOWN_CHARS = 80  # of a value quoted back in an error message
# Arrays and objects within each other in any JSON a client sends: a body, or JSON text
# carried in one of its strings (tool call arguments, tools, a JSON schema, template
# kwargs). Code that walks such a value recursively (templates, schema rewriting,
# json.dumps) stays far from Python's recursion limit. A schema spends two levels on each
# nested property ("properties", then the property's schema), so this admits objects about
# 30 properties deep.
MAX_JSON_DEPTH = 64

# max_tokens: its range, and what an unset one means in each API, here and nowhere else.
MAX_TOKENS_LOW, MAX_TOKENS_HIGH = 1, 2**32 - 1  # at least one token; the wire's uint32
# A text or token prompt over gRPC or the SDK; a chat there, and OpenAI's chat, run to the
# end of the context (as OpenAI's and vLLM's chat do; the .proto says so too).
DEFAULT_MAX_TOKENS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# (Anthropic's Messages API requires max_tokens; the Responses API's max_output_tokens, unset,
# runs a chat to the end of the context.)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, so that no request costs the server without bound
    (stop strings are matched at every token on the engine thread; n samples each hold a
    sequence), and how long a client may take to send one (a slow client holds a
    connection, never the server)."""

    max_stop_strings: int = setting(16, "stop strings per request at most")
    max_stop_string_length: int = setting(256, "characters per stop string at most")
    max_stop_token_ids: int = setting(64, "stop token ids per request at most")
    max_n: int = setting(16, "samples per request (n) at most")
    max_pooling_inputs: int = setting(256, "inputs of one embedding request (documents of one rerank) at most")
    # (a rerank's query counts once per document: each pair is prefilled, and held, whole)
    max_pooling_tokens: int = setting(
        300_000, "tokens of one embedding request's inputs (a rerank's query-document pairs) together at most, as "
                 "OpenAI's embeddings API")
    http_header_timeout: float = setting(
        30.0, "seconds an HTTP client may take to send a request's headers, from their first byte (a new "
              "connection's first request: from connecting): a slower one is disconnected")
    # aiohttp's own default: longer than proxies (nginx 60-75 s, cloud load balancers up to an
    # hour) and client pools (httpx 5 s, aiohttp 15 s, Go 90 s) keep an idle connection, so
    # the client always drops it first and never writes a request on one the server is closing
    http_keepalive_timeout: float = setting(
        3630.0, "seconds an idle keep-alive HTTP connection stays open between two requests")
    http_body_timeout: float = setting(60.0, "seconds an HTTP client may take to send a request's body (408 after)")


def shown(value: Any) -> str:
    """`value` as JSON for an error message, cut to MAX_SHOWN_CHARS (an error never echoes
    a client's megabytes back)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[:MAX_SHOWN_CHARS]}... ({len(text)} characters)"


def quoted(name: str) -> str:
    """A field name or key a client sent, quoted for a message and cut to MAX_SHOWN_CHARS."""
    return repr(name if len(name) <= MAX_SHOWN_CHARS else name[:MAX_SHOWN_CHARS] + "...")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (a number must be finite)")


def loads_strict(text: str | bytes) -> Any:
    """`json.loads` of strict JSON: NaN and Infinity are a ValueError (as any other
    syntax error); a RecursionError when it is nested past what the parser can hold."""
    return json.loads(text, parse_constant=_no_constant)


def too_deep(field: str, limit: int = MAX_JSON_DEPTH, param: str | None = None) -> BadField:
    return BadField(param or field, f"{quoted(field)} is nested more than {limit} levels deep (arrays and objects "
                                    f"within each other): at most {limit} are allowed")


def check_json_depth(value: Any, field: str, limit: int = MAX_JSON_DEPTH, param: str | None = None) -> None:
    """BadField naming `field` and the limit when `value` (parsed JSON) holds arrays and
    objects more than `limit` deep (`param`: the error's field, `field` by default). One
    pass over the value level by level: it never recurses, whatever the depth."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise too_deep(field, limit, param)
        level = [x for c in level for x in (c.values() if isinstance(c, dict) else c) if isinstance(x, (dict, list))]


def parse_json(text: str | bytes, field: str, param: str | None = None) -> Any:
    """JSON text a client sent in `field` (tools, a JSON schema, template kwargs, a tool
    call's arguments), parsed as the HTTP fronts parse a body: strict (no NaN or
    Infinity) and nested at most MAX_JSON_DEPTH deep. Anything else is BadField naming
    `field` (its `param`: `param`, or `field`)."""
    try:
        value = loads_strict(text)
    except RecursionError:  # deeper than the parser holds: past any limit
        raise too_deep(field, param=param) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadField(param or field, f"{quoted(field)} is not valid JSON: {e}") from None
    check_json_depth(value, field, param=param)
    return value
