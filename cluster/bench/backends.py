"""Send one request, stream its answer, and time it: `RequestRecord`.

Backends:
- `grpc`: the SDK's `AsyncClient` (a router or a worker); prompts as token ids or text;
  each chunk carries its token ids, so token counts per chunk are exact.
- `openai`: POST /v1/completions with `stream: true` (SSE);
- `openai-chat`: POST /v1/chat/completions with `stream: true`.
  Over HTTP a chunk carries text only; token counts come from the final usage chunk
  (`stream_options.include_usage`) and are spread evenly over the chunks for the
  tokens-over-time plot.

Times are `time.perf_counter()` seconds. ITL, as in `vllm bench serve`, is the gap
between consecutive chunks after the first.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from cluster.bench.datasets import SampleRequest

BACKENDS = ("grpc", "openai", "openai-chat")


@dataclass
class RequestRecord:
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter when sent
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk with output
    chunk_tokens: list[float] = field(default_factory=list)  # tokens in each chunk
    prompt_tokens: int = 0  # from the server's usage, else the dataset's count
    output_tokens: int = 0
    cached_tokens: int = 0
    worker_id: str = ""

    def _chunk(self, now: float, tokens: float) -> None:
        if not self.chunk_times:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.chunk_times[-1])
        self.chunk_times.append(now)
        self.chunk_tokens.append(tokens)


@dataclass(frozen=True)
class RequestOptions:
    model: str = ""
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    timeout: float | None = None


class GrpcTarget:
    name = "grpc"

    def __init__(self, target: str, security=None):
        from cluster.sdk import AsyncClient
        from cluster.security import NO_SECURITY

        s = security or NO_SECURITY
        self.target = target
        self.client = AsyncClient(target, options=[("grpc.max_receive_message_length", 64 << 20)],
                                  api_key=s.api_key or None, tls_ca=s.tls_ca, tls_cert=s.tls_cert, tls_key=s.tls_key)

    async def send(self, req: SampleRequest, opts: RequestOptions) -> RequestRecord:
        out = RequestRecord(prompt_tokens=req.prompt_len)
        params = dict(model=opts.model, max_tokens=req.output_len, temperature=opts.temperature,
                      top_p=opts.top_p, top_k=opts.top_k, ignore_eos=opts.ignore_eos)
        messages = [{"role": r, "content": c} for r, c in req.messages] if req.messages is not None else None
        out.start = time.perf_counter()
        try:
            async for chunk in self.client.stream(req.prompt, messages=messages, timeout=opts.timeout, **params):
                now = time.perf_counter()
                if chunk.token_ids:
                    out._chunk(now, len(chunk.token_ids))
                    out.output_tokens += len(chunk.token_ids)
                if chunk.usage is not None:
                    out.prompt_tokens = chunk.usage.prompt_tokens
                    out.output_tokens = chunk.usage.completion_tokens
                    out.cached_tokens = chunk.usage.cached_tokens
                out.worker_id = chunk.worker_id or out.worker_id
            out.latency = time.perf_counter() - out.start
            out.success = bool(out.chunk_times)
            if not out.success:
                out.error = "no tokens"
        except Exception as e:  # noqa: BLE001  (a failed request is a result, not a crash)
            out.error = f"{type(e).__name__}: {e}"
            out.latency = time.perf_counter() - out.start
        return out

    async def close(self) -> None:
        await self.client.close()


class OpenAIBackend:
    """`openai` (completions) or `openai-chat` (chat completions) over aiohttp, SSE."""

    def __init__(self, base_url: str, chat: bool = False, security=None):
        import ssl

        import aiohttp

        base = base_url if "://" in base_url else f"http://{base_url}"
        base = base.rstrip("/")
        base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.name = "openai-chat" if chat else "openai"
        self.chat = chat
        self.url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
        ctx = ssl.create_default_context(cafile=security.tls_ca) if security and security.tls_ca else None
        headers = {"Authorization": f"Bearer {security.api_key}"} if security and security.api_key else None
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=ctx), headers=headers)

    def _body(self, req: SampleRequest, opts: RequestOptions) -> dict:
        body = {"model": opts.model, "max_tokens": req.output_len, "temperature": opts.temperature,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": opts.ignore_eos}
        if opts.top_p is not None:
            body["top_p"] = opts.top_p
        if opts.top_k is not None:
            body["top_k"] = opts.top_k
        if self.chat:
            if req.messages is None:
                raise ValueError("the chat endpoint needs messages (see datasets.as_chat)")
            body["messages"] = [{"role": r, "content": c} for r, c in req.messages]
        else:
            body["prompt"] = req.prompt if req.prompt is not None else "".join(c for _, c in req.messages)
        return body

    async def send(self, req: SampleRequest, opts: RequestOptions) -> RequestRecord:
        import aiohttp

        out = RequestRecord(prompt_tokens=req.prompt_len)
        body = self._body(req, opts)
        timeout = aiohttp.ClientTimeout(total=opts.timeout)
        out.start = time.perf_counter()
        usage = None
        try:
            async with self.session.post(self.url, json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    out.latency = time.perf_counter() - out.start
                    return out
                buf = b""
                async for data in resp.content.iter_any():
                    now = time.perf_counter()
                    buf += data
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        payload = event.decode("utf-8").removeprefix("data:").strip()
                        if not payload or payload == "[DONE]":
                            continue
                        obj = json.loads(payload)
                        if "error" in obj:
                            raise RuntimeError(obj["error"].get("message", "error"))
                        if obj.get("usage"):
                            usage = obj["usage"]
                        for choice in obj.get("choices") or ():
                            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                            if text:
                                out._chunk(now, 1.0)
            out.latency = time.perf_counter() - out.start
            if usage is not None:
                out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
                out.output_tokens = usage.get("completion_tokens", 0)
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            else:
                out.output_tokens = len(out.chunk_times)
            if out.chunk_times:  # spread the exact count over the chunks for the timeline
                per = out.output_tokens / len(out.chunk_times)
                out.chunk_tokens = [per] * len(out.chunk_times)
            out.success = bool(out.chunk_times)
            if not out.success:
                out.error = "no tokens"
        except Exception as e:  # noqa: BLE001
            out.error = f"{type(e).__name__}: {e}"
            out.latency = time.perf_counter() - out.start
        return out

    async def close(self) -> None:
        await self.session.close()


def make_backend(name: str, target: str, security=None):
    """`security`: a cluster.security.ClientSecurity (key, CA, client certificate), or None."""
    if name == "grpc":
        return GrpcTarget(target, security)
    if name in ("openai", "openai-chat"):
        return OpenAIBackend(target, chat=name == "openai-chat", security=security)
    raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
