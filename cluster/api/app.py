"""The HTTP app both servers run: every API's routes on the shared base (`cluster.api.http`).

OpenAI's chat, models and health (openai.py) and completions (completions.py), the
Responses API (responses.py), Anthropic's Messages API (messages.py), embeddings and
reranking (embeddings.py), and vLLM's /tokenize (tokenize.py), all over one
`Backend`: the worker's `WorkerService` or the router's `RouterBackend`.
"""

from __future__ import annotations

from aiohttp import web

from cluster.api import completions, embeddings, http, messages, openai, responses, tokenize
from cluster.api.servicer import Backend
from cluster.security import Keys


def create_app(backend: Backend, request_timeout: float | None = None, *, keys: Keys | None = None,
               allowed_hosts: tuple[str, ...] | None = None, cors_origins: tuple[str, ...] = ()) -> web.Application:
    """The OpenAI-, Responses- and Messages-compatible app over `backend` (`http.new_app`
    says what `keys`, `allowed_hosts` and `cors_origins` do). A request that takes longer
    than `request_timeout` seconds (or its own `X-Request-Timeout`, if shorter) is answered
    504, or ends its SSE stream with an error event, and is cancelled wherever it runs."""
    app = http.new_app(backend, request_timeout, keys=keys, allowed_hosts=allowed_hosts, cors_origins=cors_origins)
    for api in (openai, completions, responses, messages, embeddings, tokenize):
        api.add_routes(app)
    return app
