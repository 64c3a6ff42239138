"""A prompt's KV block hashes at the router, as the worker that serves it will name them.

Workers publish the blocks they hold by their chained token-block hashes
(`cluster.kv.hashing`); to match a prompt against them the router needs the prompt's
token ids exactly as the worker's engine sees them. So it uses the worker's own tokenizer
files (`WorkerAdmin.GetTokenizer`, fetched once per digest from a worker reporting it in
`LoadReport.tokenizer_digest`, kept under --tokenizer-cache) and the worker's own prompt
code (`cluster.worker.prompt.PromptBuilder.prompt_token_ids`: MLX-free; chat templates
rendered in `chat_render.RenderPool`'s processes, as on the worker), never a second
renderer. A chat whose tokenizer renders chats its own way (no Jinja template: mlx-lm's
Python templates) is not hashed here.

Bounds, since this runs for every request on the router's event loop:
- Token-id prompts need no tokenizer: up to `INLINE_BLOCKS` blocks are hashed inline,
  longer ones on the thread pool under the deadline and the bound below.
- Only the first --router-tokenize-max-tokens tokens are hashed; a text (or a rendered
  chat) is cut at `CHARS_PER_TOKEN` characters a token before tokenizing, and the tokens
  near a cut (`CUT_MARGIN` of them) are dropped, since the whole text's may differ there.
- Tokenizing runs on --router-tokenize-threads threads (renders in as many processes),
  at most `QUEUED_PER_THREAD` requests a thread at once (more: placed by the approximate
  map at once, reason "busy"), and a request waits for its hashes at most
  --router-tokenize-timeout, or for a long prompt `DEADLINE_SHARE` of what prefilling it
  would cost (its size over the workers' reported prefill rate): a long prompt sent to
  the wrong worker costs far more than waiting for its hashes. Past that the request is
  placed by the approximate map (`prefix_index.prompt_keys`) while the work goes on and
  fills the cache.
- The cache: an LRU over a digest of the request's prompt part (kind, prompt, tools,
  tool choice, template variables) and the tokenizer, bounded in bytes by
  --router-tokenize-cache, so a resent prompt (a retry, a session's replay) costs a lookup.
- No tokenizer yet (none reported, being fetched, or failed: tried again after
  `FETCH_RETRY` seconds; at most `MAX_FETCHES` fetched at once): the approximate map. At
  most `MAX_TOKENIZERS` are held (a fleet's models), the least recently used dropped
  (loaded again from the cache directory).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.api.tokenizer_files import (PROMPT_FILE, TokenizerFilesError, check_files, read_files,
                                         write_files)
from cluster.api.wire import prompt_chars
from cluster.kv.hashing import HASH_BYTES, block_hashes
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.config import KvRoutingConfig, assumed_rates

if TYPE_CHECKING:
    from cluster.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

INLINE_BLOCKS = 1024  # token-id prompts up to this many blocks are hashed on the event loop
CHARS_PER_TOKEN = 4  # a text is cut at this many characters a hashed token
CUT_MARGIN = 64  # tokens dropped before a cut: tokenizing a cut text differs from the whole near its end
QUEUED_PER_THREAD = 8
FETCH_TIMEOUT = 60.0  # seconds for GetTokenizer (tens of MB on a busy worker)
FETCH_RETRY = 30.0  # seconds before a failed fetch or load is tried again
ENTRY_OVERHEAD = 200  # bytes a cache entry costs beside its hashes
MAX_TOKENIZERS = 16  # loaded at once (a fleet's models), least recently used dropped first
MAX_FETCHES = 4  # tokenizers fetched at once (each answer up to a gRPC message held in memory)
DEADLINE_SHARE = 0.02  # of a long prompt's prefill time, the most its placement waits for its hashes
DIGEST = re.compile(r"[0-9a-f]{64}")  # a sha256 hex digest (`files_digest`): the only name a cache directory has


@dataclass(frozen=True)
class Blocks:
    """A prompt's leading full blocks: per block size, their hashes in order.
    `digest`: the tokenizer they came from ('' for a token-id prompt: any worker's);
    `num_tokens`: the prompt's tokens (those hashed, at most --router-tokenize-max-tokens)."""

    num_tokens: int
    hashes: dict[int, list[bytes]]
    digest: str = ""


class _Model:
    """A tokenizer fetched from a worker: the worker's prompt code over it."""

    def __init__(self, builder, chats: bool):
        self.builder = builder
        self.chats = chats  # the worker renders chats with a Jinja template, which the router can do too


class _LikeWorker:
    """The Hugging Face tokenizer as the worker's mlx-lm wrapper presents it to the prompt
    code: what the wrapper adds to a chat's render (`PROMPT_FILE`), the rest delegated."""

    def __init__(self, hf, prompt: dict):
        self._tokenizer = hf
        self._chat_template = None
        self._thinking_kwarg = prompt.get("thinking_kwarg")
        self.has_thinking = bool(prompt.get("has_thinking"))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


def load_tokenizer(directory: Path, model: str, pool: ThreadPoolExecutor, renders) -> _Model:
    """The worker's prompt code over the tokenizer files in `directory` (on a thread:
    transformers reads and builds it)."""
    from transformers import AutoTokenizer

    from cluster.worker.prompt import PromptBuilder  # no MLX (tests/test_router_kv.py)

    prompt = json.loads((directory / PROMPT_FILE).read_text())
    hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    tok = _LikeWorker(hf, prompt)
    chats = bool(prompt.get("renders_jinja"))
    builder = PromptBuilder(model, tok, len(hf), 1 << 30, None, renders if chats else None, pool, pool)
    return _Model(builder, chats)


def hash_prompt(ids, block_sizes, max_tokens: int, cut: bool) -> Blocks:
    """`ids`' blocks per block size (the first `max_tokens`; a `cut` text's last tokens
    dropped), those a worker can serve from its cache: it computes a whole prompt's last
    token itself (its logits start the answer), so a block ending with it is left out."""
    whole = not cut and len(ids) <= max_tokens
    ids = ids[:max_tokens]
    if cut:
        ids = ids[: max(0, len(ids) - CUT_MARGIN)]
    servable = ids[:-1] if whole else ids
    return Blocks(len(ids), {bs: block_hashes(servable, bs) for bs in block_sizes})


def prompt_digest(request: pb.GenerateRequest, digest: str, max_chars: int) -> bytes:
    """The cache's key: what of a request makes its prompt's tokens, and the tokenizer."""
    h = hashlib.blake2b(digest_size=16)
    kind = request.WhichOneof("prompt") or ""
    parts = [kind.encode(), digest.encode(), str(max_chars).encode()]
    if kind == "chat":
        parts += [request.chat.SerializeToString(deterministic=True),
                  request.tools.encode(),
                  request.tool_choice.SerializeToString(deterministic=True),
                  request.chat_template_kwargs.encode(), request.reasoning_effort.encode()]
    else:
        parts.append(request.text.encode())
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.digest()


class PromptBlocks:
    """`await keys(request, workers)`: the request's `Blocks` for the workers that may take
    it, or None (then the approximate map places it; the metrics say why). Owns a thread
    pool, the render processes and the tokenizers; `close()` ends them."""

    def __init__(self, config: KvRoutingConfig = KvRoutingConfig(), metrics: RouterMetrics | None = None):
        self.config = config
        self.metrics = metrics
        self.directory = Path(config.tokenizer_cache).expanduser()
        self._pool = ThreadPoolExecutor(config.router_tokenize_threads, thread_name_prefix="orchard-router-tokenize")
        self._models: OrderedDict[tuple[str, str], _Model] = OrderedDict()
        self._fetching: dict[tuple[str, str], asyncio.Task] = {}
        self._failed: dict[tuple[str, str], float] = {}  # -> when it may be tried again
        self._cache: OrderedDict[bytes, Blocks] = OrderedDict()
        self._cache_bytes = 0
        self._running = 0  # tokenizations and hashings started and not finished
        self._renders = None  # a RenderPool, started with the first tokenizer that renders chats
        self._tasks: set[asyncio.Task] = set()
        self._prepared: set[tuple[str, str]] = set()  # (model, digest) fetched as a worker reported it

    @property
    def max_chars(self) -> int:
        return CHARS_PER_TOKEN * self.config.router_tokenize_max_tokens

    async def keys(self, request: pb.GenerateRequest, workers) -> Blocks | None:
        """The hashes of the request's prompt for the block sizes of `workers` (records
        with a `report`), within --router-tokenize-timeout."""
        t0 = time.perf_counter()
        try:
            return await self._keys(request, workers)
        finally:
            if self.metrics is not None:
                self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)

    async def _keys(self, request: pb.GenerateRequest, workers) -> Blocks | None:
        block_sizes = sorted({w.report.block_size for w in workers if w.report.block_size})
        if not block_sizes:
            return None
        max_tokens = self.config.router_tokenize_max_tokens
        if request.WhichOneof("prompt") == "token_ids":
            ids = request.token_ids.ids
            if min(len(ids), max_tokens) // block_sizes[0] <= INLINE_BLOCKS:
                return hash_prompt(ids, block_sizes, max_tokens, cut=False)
            if self._busy():
                return self._fallback("busy")
            return await self._within_deadline(self._start(self._hash_ids(list(ids[:max_tokens]), block_sizes)),
                                               self._deadline(min(len(ids), max_tokens), workers))
        digests = Counter(w.report.tokenizer_digest for w in workers if w.report.tokenizer_digest)
        if not digests:
            return self._fallback("no_tokenizer")
        digest = digests.most_common(1)[0][0]
        block_sizes = sorted({w.report.block_size for w in workers if w.report.tokenizer_digest == digest})
        model = self._model(request.model, digest, [w for w in workers if w.report.tokenizer_digest == digest])
        if model is None:
            return self._fallback("no_tokenizer")
        if request.WhichOneof("prompt") == "chat" and not model.chats:
            return self._fallback("no_renderer")
        key = prompt_digest(request, digest, self.max_chars)
        cached = self._cache.get(key)
        if cached is not None and all(bs in cached.hashes for bs in block_sizes):
            self._cache.move_to_end(key)
            return cached
        if self._busy():
            return self._fallback("busy")
        return await self._within_deadline(self._start(self._tokenize(model, request, block_sizes, key, digest)),
                                           self._deadline(min(prompt_chars(request) // CHARS_PER_TOKEN, max_tokens),
                                                          workers))

    def _busy(self) -> bool:
        return self._running >= QUEUED_PER_THREAD * self.config.router_tokenize_threads

    def _start(self, coro) -> asyncio.Task:
        """Tokenizing or hashing in the background, counted in `_running` from now (not from
        when the task first runs: requests of one burst would all pass `_busy`) until it ends."""
        self._running += 1
        task = self._background(coro)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, _task) -> None:
        self._running -= 1

    def _deadline(self, tokens: int, workers) -> float:
        """How long a prompt of about `tokens` tokens may wait for its hashes: the
        configured timeout, or `DEADLINE_SHARE` of its prefill at the rate the placement
        assumes (`assumed_rates`), whichever is longer."""
        rate, _ = assumed_rates(workers, self.config.kv_prefill_tps, self.config.kv_read_tps)
        return max(self.config.router_tokenize_timeout, DEADLINE_SHARE * tokens / rate)

    async def _within_deadline(self, task: asyncio.Task, timeout: float) -> Blocks | None:
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            return self._fallback("timeout")
        except Exception as e:  # the worker says what is wrong with the request, if anything
            log.debug("placement: a prompt could not be tokenized here: %s", e)
            return self._fallback("error")

    def _fallback(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.tokenize_fallbacks.labels(reason=reason).inc()
        return None

    def _background(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: a late failure logs nothing
        return task

    async def _hash_ids(self, ids: list[int], block_sizes: list[int]) -> Blocks:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, hash_prompt, ids, block_sizes, self.config.router_tokenize_max_tokens, False)

    async def _tokenize(self, model: _Model, request: pb.GenerateRequest, block_sizes: list[int], key: bytes,
                        digest: str) -> Blocks:
        ids = await model.builder.prompt_token_ids(request, self.max_chars)
        blocks = await asyncio.get_running_loop().run_in_executor(
            self._pool, hash_prompt, ids, block_sizes, self.config.router_tokenize_max_tokens,
            _may_be_cut(request, self.max_chars))
        blocks = Blocks(blocks.num_tokens, blocks.hashes, digest)
        self._remember(key, blocks)
        return blocks

    def _remember(self, key: bytes, blocks: Blocks) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_bytes -= _entry_bytes(old)
        self._cache[key] = blocks
        self._cache_bytes += _entry_bytes(blocks)
        while self._cache_bytes > self.config.router_tokenize_cache and self._cache:
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= _entry_bytes(dropped)

    # -- tokenizers -----------------------------------------------------------------------
    def prepare(self, workers) -> None:
        """Start loading each reported tokenizer (model, digest) once, as its first worker
        reports it, not at its first request: after a restart the approximate map is empty,
        so requests placed while the tokenizer loads land anywhere, away from their disk
        blocks. Once only: a tokenizer the LRU dropped loads again at its next request."""
        found: dict[tuple[str, str], list] = {}
        for w in workers:
            if w.report.tokenizer_digest:
                found.setdefault((w.model, w.report.tokenizer_digest), []).append(w)
        for (model, digest), reporting in found.items():
            if (model, digest) not in self._prepared:
                self._prepared.add((model, digest))
                self._model(model, digest, reporting)

    def _model(self, model: str, digest: str, workers) -> _Model | None:
        """The tokenizer with `digest`, or None while it is fetched (the fetch starts here)."""
        key = (model, digest)
        found = self._models.get(key)
        if found is not None:
            self._models.move_to_end(key)
            return found
        now = time.monotonic()
        if key in self._fetching or self._failed.get(key, 0.0) > now or len(self._fetching) >= MAX_FETCHES:
            return None
        self._failed = {k: t for k, t in self._failed.items() if t > now}  # (a worker may report many digests)
        task = self._fetching[key] = self._background(self._fetch(model, digest, workers))
        task.add_done_callback(lambda _: self._fetching.pop(key, None))
        return None

    async def _fetch(self, model: str, digest: str, workers) -> None:
        key = (model, digest)
        try:
            directory = await self._files(digest, workers)
            if self._renders is None:
                self._renders = self._start_renders()
            self._models[key] = await asyncio.get_running_loop().run_in_executor(
                self._pool, load_tokenizer, directory, model, self._pool, self._renders)
            while len(self._models) > MAX_TOKENIZERS:
                self._models.popitem(last=False)
            log.info("placement: model %s's tokenizer %s loaded (prompts hashed as its workers do)", model or "-",
                     digest[:12])
        except Exception as e:  # a worker that cannot send it, files transformers cannot load: the approximate map
            self._failed[key] = time.monotonic() + FETCH_RETRY
            log.warning("placement: model %s's tokenizer %s could not be loaded (%s): placing its requests by the "
                        "approximate prefix map; trying again in %g s", model or "-", digest[:12], e, FETCH_RETRY)

    async def _files(self, digest: str, workers) -> Path:
        """The directory of the tokenizer files with `digest`: the cache's, or fetched."""
        from cluster.owned_dir import write_dir

        if not DIGEST.fullmatch(digest):  # a worker's report names the directory: never a path of its choosing
            raise TokenizerFilesError(f"the reported tokenizer digest {digest[:80]!r} is no sha256 hex digest")
        loop = asyncio.get_running_loop()
        cached = self.directory / digest
        if cached.is_dir():
            held = await loop.run_in_executor(self._pool, read_files, cached)
            if held.digest == digest:
                return cached
        errors = []
        for w in workers:
            if w.admin is None:
                continue
            try:
                answer = await w.admin.GetTokenizer(pb.GetTokenizerRequest(), timeout=FETCH_TIMEOUT)
                await loop.run_in_executor(self._pool, check_files, answer, digest)
            except Exception as e:  # unreachable, refused, or files that are no tokenizer: the next worker
                errors.append(f"{w.worker_id}: {e}")
                continue
            await loop.run_in_executor(self._pool, lambda: self.directory.mkdir(parents=True, exist_ok=True))
            return await loop.run_in_executor(self._pool, lambda: write_dir(
                cached, "tokenizer", w.worker_id, lambda tmp: write_files(tmp, answer), replace=True))
        raise TokenizerFilesError("; ".join(errors) or "no worker to fetch it from")

    def _start_renders(self):
        from cluster.worker.chat_render import ChatTemplateLimits, RenderPool  # no MLX

        pool = RenderPool(ChatTemplateLimits(chat_template_processes=self.config.router_tokenize_threads))
        pool.start()
        return pool

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._renders is not None:
            await self._renders.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _may_be_cut(request: pb.GenerateRequest, max_chars: int) -> bool:
    """Whether the prompt's text may have been cut at `max_chars`: a text longer, or a chat
    whose contents reach half of it (its render, with the template's markup, may pass it)."""
    if request.WhichOneof("prompt") == "text":
        return len(request.text) > max_chars
    return 2 * (request.chat.ByteSize() + len(request.tools)) >= max_chars


def _entry_bytes(blocks: Blocks) -> int:
    return ENTRY_OVERHEAD + HASH_BYTES * sum(len(h) for h in blocks.hashes.values())
