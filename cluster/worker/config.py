"""Engine configuration (vLLM's names). Frozen: derived values are resolved before use."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # Explicit KV pool size in blocks; None derives it from `kv_cache_memory_bytes`.
    num_kv_blocks: int | None = None
    # Memory budget for the KV pool when `num_kv_blocks` is None; None picks a default
    # from the device (see `ModelRunner.default_kv_budget`).
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 64
    # Tokens per step; None: 2048 on Metal, 512 on the CPU (platform.default_max_num_batched_tokens).
    max_num_batched_tokens: int | None = None
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # 0: 4% of max_model_len, as vLLM.
    long_prefill_token_threshold: int = 0
    # Requests allowed to wait for admission before add_request refuses more (0 = unbounded).
    max_waiting: int = 0
    # After a step that finished requests, the worker's engine loop waits up to this long
    # for as many new ones before the next step: closed-loop clients (benchmarks, agents,
    # batch jobs) send their next request a few ms after the last token, and joining the
    # next step saves them a whole step's wait. 0 turns it off.
    finish_wait_ms: float = 10.0
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
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            problems.append("num_kv_blocks must be >= 1")
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

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
