"""What each rank of a worker group gives the model, what its part needs, and the check,
on rank 0 before any rank loads a weight, that every part fits.

What a rank gives: its `--memory-budget` when set, else the memory free when it starts
(on a Mac, at most Metal's recommended working set), so that a Mac already holding
another model gives less. The layers are split in proportion to it (`stage.split_layers`;
`--group-shares` sets the proportion instead, and the check still holds).

What a rank's part needs: its weights as it will hold them (floating-point ones in the
dtype it computes in: float32 on a CPU), plus its share of the KV pool. The pool has the
same blocks on every rank, a block holding the K/V of that rank's layers (on rank 0 also
the draft model's, whose weights count there too). The blocks counted: rank 0's
`--num-kv-blocks` when given (a member's `--kv-cache-memory-bytes` must hold that many);
else a rank's `--kv-cache-memory-bytes` when given, which must hold at least the least a
group serves; else that least: one request of full context for each batch in flight, the
context being `--max-model-len`, or the model's up to MIN_CONTEXT_TOKENS.

A part that does not fit is refused with the numbers of every rank whose part does not,
in GiB, naming the flags that change them: a permanent error (exit 78 on rank 0 and,
told so, on every member), before any rank has loaded anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from cluster import platform
from cluster.worker.group.stage import Assignment, module_bytes, part_bytes
from cluster.worker.model_runner import kv_bytes_per_block, text_args, weight_dtype

MIN_CONTEXT_TOKENS = 4096  # the context a group is checked for when --max-model-len is not given
UNKNOWN_FREE_MEMORY = 8 << 30  # where the free memory cannot be read


class DoesNotFit(ValueError):
    """A rank's part of the model does not fit in what it gives (permanent: a setting)."""


def memory_now(budget: int | None) -> tuple[int, bool]:
    """(bytes this rank gives the model, whether that is its `--memory-budget`): the budget
    when set, else the memory free now, on a Mac at most Metal's recommended working set."""
    if budget:
        return int(budget), True
    free = platform.available_memory()
    if platform.has_metal():
        limit = int(mx.device_info()["max_recommended_working_set_size"])
        free = min(free, limit) if free else limit
    return free or UNKNOWN_FREE_MEMORY, False


def join_info(budget: int | None, kv_budget: int | None) -> dict:
    """What a rank tells rank 0 of its memory when it joins (`wire.HELLO_INFO`)."""
    memory, budgeted = memory_now(budget)
    return {"memory": memory, "memory_from": "budget" if budgeted else "free", "kv_budget": int(kv_budget or 0)}


@dataclass(frozen=True)
class RankPart:
    """One rank's part of the model and the memory it gives, in bytes."""

    rank: int
    host: str
    layers: range
    memory: int  # what it gives
    budgeted: bool  # `memory` is its --memory-budget (else the memory free when it started)
    weights: int  # as held once loaded (rank 0: with the draft model's)
    kv_per_block: int  # one KV block over its layers (rank 0: and over the draft model's)
    kv_budget: int = 0  # its --kv-cache-memory-bytes (0: not given)

    def describe(self, num_layers: int) -> str:
        a, b = self.layers.start, self.layers.stop - 1
        held = "all layers" if len(self.layers) == num_layers else f"layer {a}" if a == b else f"layers {a}-{b}"
        return f"rank {self.rank}" + (f" ({self.host}, {held})" if self.host else f" ({held})")


def rank_parts(model, assignment: Assignment, config, infos: dict[int, dict], draft: tuple[int, int] = (0, 0)
               ) -> list[RankPart]:
    """Each rank's part of the lazily loaded `model` under `assignment`; `infos`: per rank,
    what it gives (`join_info`, with its host); `draft`: rank 0's draft model's (weights,
    KV bytes per block). Every rank is taken to compute as rank 0 does (Macs, or CPUs)."""
    compute = platform.compute_dtype(weight_dtype(model))
    kv_dtype = compute if config.kv_cache_dtype == "auto" else getattr(mx, config.kv_cache_dtype)
    layer_bytes, embed, head = part_bytes(model, compute)
    size = assignment.size
    parts = []
    for r in range(size):
        stage = assignment.stage(r)
        if assignment.parallel == "pipeline":
            weights = (sum(layer_bytes[i] for i in stage.layers) + (embed if stage.embeds else 0)
                       + (head if stage.heads else 0))
            per_block = kv_bytes_per_block(model, config.block_size, kv_dtype, stage.layers)
        else:  # heads and MLPs split over the ranks; the embedding on every rank, the head on rank 0
            weights = -(-sum(layer_bytes) // size) + embed + (head if stage.heads else 0)
            per_block = -(-kv_bytes_per_block(model, config.block_size, kv_dtype) // size)
        if r == 0:
            weights, per_block = weights + draft[0], per_block + draft[1]
        info = infos[r]
        parts.append(RankPart(r, str(info.get("host", "")), stage.layers, int(info.get("memory", 0)),
                              info.get("memory_from") == "budget", weights, per_block, int(info.get("kv_budget", 0))))
    return parts


def draft_footprint(config) -> tuple[int, int]:
    """The draft model's (weights, KV bytes per block) as rank 0 will hold them, from its
    files' headers; (0, 0) without one."""
    from mlx_lm.utils import load_model

    from cluster.worker.spec_decode.config import SpeculativeConfig
    from cluster.worker.spec_decode.draft import draft_directory

    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None or spec.method != "draft_model":
        return 0, 0
    model, _ = load_model(Path(draft_directory(spec)), lazy=True, strict=False)
    compute = platform.compute_dtype(weight_dtype(model))
    kv_dtype = compute if config.kv_cache_dtype == "auto" else getattr(mx, config.kv_cache_dtype)
    return module_bytes(model, compute), kv_bytes_per_block(model, config.block_size, kv_dtype)


@dataclass(frozen=True)
class LeastKV:
    """The fewest KV blocks a group serves with: one request of `context` tokens for each
    of `batches` batches in flight."""

    blocks: int
    context: int
    batches: int

    @classmethod
    def of(cls, model, config, batches: int) -> LeastKV:
        model_max = int(getattr(text_args(model), "max_position_embeddings", 0) or 32768)
        context = config.max_model_len or min(model_max, MIN_CONTEXT_TOKENS)
        return cls(batches * -(-context // config.block_size), context, batches)

    def __str__(self) -> str:
        each = f"for each of {self.batches} batches in flight" if self.batches > 1 else ""
        return f"{self.blocks} blocks: one {self.context}-token request {each}".rstrip()


def gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_fit(parts: list[RankPart], least: LeastKV, num_kv_blocks: int | None, num_layers: int) -> None:
    """Refuse (`DoesNotFit`, every rank that does not fit, with the numbers) a group in
    which a rank's weights and KV share exceed what it gives, or whose pool a rank's KV
    budget cannot hold (see the module docstring for the blocks counted)."""
    problems = []
    for p in parts:
        who = p.describe(num_layers)
        held = p.kv_budget // p.kv_per_block if p.kv_per_block else None
        if num_kv_blocks:
            kv, why = num_kv_blocks * p.kv_per_block, f"rank 0's --num-kv-blocks {num_kv_blocks}"
            if p.rank and p.kv_budget and held is not None and held < num_kv_blocks:
                problems.append(f"{who}: its --kv-cache-memory-bytes {gib(p.kv_budget)} holds {held} KV blocks of "
                                f"its layers, fewer than {why}")
                continue
        elif p.kv_budget:
            kv, why = max(p.kv_budget, least.blocks * p.kv_per_block), "its --kv-cache-memory-bytes"
            if held is not None and held < least.blocks:
                problems.append(f"{who}: its --kv-cache-memory-bytes {gib(p.kv_budget)} holds {held} KV blocks of "
                                f"its layers, fewer than the group's least ({least})")
                continue
        else:
            kv, why = least.blocks * p.kv_per_block, str(least)
        needed = p.weights + kv
        if needed > p.memory:
            gives = "its --memory-budget" if p.budgeted else "the memory free when it started"
            problems.append(f"{who} needs {gib(needed)} (weights {gib(p.weights)} + KV {gib(kv)} for {why}) but gives "
                            f"{gib(p.memory)} ({gives})")
    if problems:
        raise DoesNotFit("the model does not fit the group's memory: " + "; ".join(problems) + ". Give such a rank "
                         "more (--memory-budget on it, or free memory there), move layers off it (--group-shares), "
                         "or ask for less KV (--max-model-len, --num-kv-blocks, --kv-cache-memory-bytes)")
