"""A backend's stream of `GenerateResponse` chunks as the HTTP fronts read it, guarded in
one place: `generation` applies `within` (the request's deadline), `finished` (up to the
last finish chunk, never a cut-off answer taken for a whole one: `cluster.api.servicer`'s,
which the gRPC servicer and the SDK apply too) and, on a stream, `keepalive` (a held
request's waits, for SSE comments).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from cluster.api.errors import DeadlineExceeded
from cluster.api.servicer import Backend, finished
from cluster.api.wire import num_choices
from cluster.proto.orchard.v1 import orchard_pb2 as pb

# Seconds without a chunk after which a stream the backend holds (no worker of its model
# can take it now: the router's hold) gets an SSE comment: clients and proxies that drop an
# idle connection keep it.
KEEPALIVE_SECONDS = 5.0


def generation(backend: Backend, request: pb.GenerateRequest, timeout: float | None, *, held: bool = False):
    """The backend's chunks for `request` as an HTTP front answers them: cut at `timeout`
    (`within`), up to the finish of its last sample (`finished`); with `held` (a stream),
    the name of the model a held request waits for between them (`keepalive`). Closing it
    closes the backend's stream: the request is cancelled wherever it runs."""
    chunks = finished(within(backend.generate(request, timeout=timeout), timeout), num_choices(request))
    return keepalive(chunks, backend, request.request_id) if held else chunks


async def within(chunks, timeout: float | None):
    """`chunks`, or DeadlineExceeded once `timeout` seconds have passed (closing `chunks`:
    the request is cancelled wherever it runs)."""
    async with contextlib.aclosing(chunks):
        if timeout is None:
            async for chunk in chunks:
                yield chunk
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"the request took longer than its {timeout:g} s timeout") from None
            yield chunk


async def keepalive(chunks, backend: Backend, request_id: str):
    """`chunks`, and between them once the first is out (a stream's headers wait for it, so
    that a refusal keeps its HTTP status), while the backend holds the request (its
    `waiting` names the model it waits for a worker of), that model's name (a str) every
    `KEEPALIVE_SECONDS` without a chunk: the SSE loop writes it as a comment
    (`sse_comment`). Before the first chunk too while a router's fleet loads the request's
    model (the backend's `loading` holds its id): a load takes minutes, and the client
    hears how it goes. A backend that never holds a request: `chunks` as they are."""
    waiting = getattr(backend, "waiting", None)
    async with contextlib.aclosing(chunks):
        if waiting is None:
            async for chunk in chunks:
                yield chunk
            return
        loading = getattr(backend, "loading", ())
        started = False
        pending = None
        try:
            while True:
                # the next chunk in a task of its own: a timeout must not cancel it
                pending = asyncio.ensure_future(anext(chunks))
                while not (await asyncio.wait({pending}, timeout=KEEPALIVE_SECONDS))[0]:
                    if (model := waiting(request_id)) is not None and (started or request_id in loading):
                        yield model
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                started = True
                yield chunk
        finally:
            if pending is not None and not pending.done():  # the client left: the request ends
                pending.cancel()
                await asyncio.wait({pending})
