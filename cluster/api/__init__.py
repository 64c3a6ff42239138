"""What the router, the worker and the SDK share: the API layer.

    errors.py    typed errors, one per gRPC status (and its HTTP code)
    limits.py    what a request may ask for and how large / slow it may be: one place for every server
    wire.py      finish-reason names, defaults; build_request / validate_request (once)
    servicer.py  the `Backend` protocol and the one `Generation` servicer over it
    openai.py    OpenAI-compatible HTTP over any `Backend` (+ /v1/models/{id}, errors in OpenAI's shape)
    bodies.py    a JSON body read once into typed values: the field readers, `ChatBody`, `CompletionBody`
    streams.py   a backend's stream as the HTTP fronts read it: deadline, finish, keepalive in one place
    tools.py     tool definitions and choices checked once; tool calls cut out of the output
    responses.py OpenAI's Responses API (/v1/responses) on the same app
    messages.py  Anthropic's Messages API (/v1/messages) on the same app
    serving.py   one start-up for a server's gRPC (+ health), HTTP and /metrics

The servers (cluster.worker, cluster.router) and the SDK (cluster.sdk) depend on this
package; it depends on neither, and never imports MLX.
"""
