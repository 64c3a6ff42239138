"""The memory a worker of a model holds, estimated before it loads (router side; pure).

    footprint = weights + KV pool + recurrent state + overhead

- weights: `DiskModel.weight_bytes`, as the worker holds them on the node's platform
  (`facts.py`).
- KV pool: what the controller gives the worker with `--kv-cache-memory-bytes`
  (`kv_pool_bytes`): whole blocks of BLOCK_SIZE tokens, enough for `concurrent_contexts`
  requests of the full context at once. As in vLLM, the pool is sized by memory, not by
  `max_num_seqs`: more requests than that run at once when they are shorter, and when
  the blocks run out the scheduler preempts the newest and recomputes it later. A pool for
  `max_num_seqs` full contexts would reserve memory that a fleet's mostly short requests
  never touch, so it holds CONCURRENT_CONTEXTS of them (fewer when `max_num_seqs` is smaller).
- overhead: the worker process's own resident cost beside its weights and pool (Python,
  MLX, gRPC, the tokenizer, OpenBLAS and the C kernels on a CPU). On a CPU it is measured
  with a real worker (MEASUREMENTS.md, "fleet footprint"; `tests/test_fleet_footprint.py`
  checks the whole estimate against a worker's `LoadReport.resident_bytes`). On a Mac it
  cannot be measured here: METAL_OVERHEAD_BYTES is an allowance (the same process plus
  Metal's command buffers and library), to be checked against `resident_bytes` on a Mac.

- recurrent state: a hybrid model's, one slot per request the worker runs at once (its
  `--max-num-seqs`): `DiskModel.state_bytes_per_seq` each.

Not counted: a step's activations (MLX's buffer cache gives them back when the worker is
idle) and the worker's chat-template render processes (processes of their own, sharing
most of their pages with their fork server).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from cluster.fleet import FleetError
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.worker.group.split import split_layers

BLOCK_SIZE = 16  # the worker's default --block-size
CONCURRENT_CONTEXTS = 4  # full-context requests a worker's KV pool holds at once
CPU_OVERHEAD_BYTES = 160 << 20
METAL_OVERHEAD_BYTES = 1 << 30
OVERHEAD_BYTES = {"cpu": CPU_OVERHEAD_BYTES, "metal": METAL_OVERHEAD_BYTES}


@dataclass(frozen=True)
class Footprint:
    """Bytes a worker holds: its weights, its KV pool, the process's own overhead, and a
    hybrid model's recurrent state slots."""

    weights: int
    kv: int
    overhead: int
    state: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead + self.state


def concurrent_contexts(max_num_seqs: int) -> int:
    """Full-context requests the pool is sized for (see the module docstring)."""
    return max(1, min(max_num_seqs, CONCURRENT_CONTEXTS))


def kv_pool_bytes(disk: pb.DiskModel, context: int, concurrent_contexts: int = 1, block_size: int = BLOCK_SIZE) -> int:
    """The `--kv-cache-memory-bytes` that gives a worker whole blocks for
    `concurrent_contexts` requests of `context` tokens (the worker makes exactly that many
    blocks of it)."""
    return kv_pool_blocks(context, concurrent_contexts, block_size) * block_size * disk.kv_bytes_per_token


def kv_pool_blocks(context: int, concurrent_contexts: int = 1, block_size: int = BLOCK_SIZE) -> int:
    """The blocks of that pool (a group's `--num-kv-blocks`: the same blocks on every rank)."""
    return concurrent_contexts * math.ceil(context / block_size)


def _check(disk: pb.DiskModel, context: int, max_num_seqs: int, platform: str) -> None:
    if disk.error:
        raise FleetError(grpc.StatusCode.FAILED_PRECONDITION, f"model {disk.name!r} cannot be loaded: {disk.error}")
    if platform not in OVERHEAD_BYTES:
        raise FleetError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"platform must be one of {', '.join(OVERHEAD_BYTES)}, not {platform!r}")
    if context < 1:
        raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"context must be at least 1 token, not {context}")
    if max_num_seqs < 1:
        raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"max_num_seqs must be at least 1, not {max_num_seqs}")


def estimate(disk: pb.DiskModel, context: int, max_num_seqs: int, platform: str) -> Footprint:
    """The footprint of a worker of `disk` on `platform` ("cpu" or "metal") serving
    `context` tokens a request with at most `max_num_seqs` requests at once (the worker's
    --max-num-seqs: a hybrid holds a state slot for each). FleetError:
    a model whose files could not be read (FAILED_PRECONDITION), an argument out of range
    (INVALID_ARGUMENT)."""
    _check(disk, context, max_num_seqs, platform)
    return Footprint(weights=disk.weight_bytes, kv=kv_pool_bytes(disk, context, concurrent_contexts(max_num_seqs)),
                     overhead=OVERHEAD_BYTES[platform], state=max_num_seqs * disk.state_bytes_per_seq)


def rank_shares(disk: pb.DiskModel, nodes_budgets: list[int], footprint: Footprint | None = None
                ) -> list[tuple[int, int, int]]:
    """A pipeline group's split of the model over nodes in proportion to their budgets, the
    first layers on the first node: per node (first layer, last layer, bytes), bytes being
    its layers' share of the model's weights, KV pool and state (`footprint`: the whole model's;
    default: its weights alone) and a whole process's overhead. Layers are taken to weigh
    alike (a DiskModel has no per-layer sizes); the group splits by its real layer sizes
    in the same proportion (`worker/group/split.py`), so a rank's part is close to this."""
    if not disk.num_layers:
        raise FleetError(grpc.StatusCode.FAILED_PRECONDITION, f"model {disk.name!r}: its number of layers is not known")
    if not nodes_budgets or len(nodes_budgets) > disk.num_layers or min(nodes_budgets) <= 0:
        raise FleetError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"a group of model {disk.name!r} ({disk.num_layers} layers) needs 1 to {disk.num_layers} "
                         f"nodes with a budget above 0, not {list(nodes_budgets)}")
    whole = footprint or Footprint(disk.weight_bytes, 0, 0)
    per_layer = (whole.weights + whole.kv + whole.state) / disk.num_layers
    stages = split_layers([1] * disk.num_layers, [float(b) for b in nodes_budgets])
    return [(r.start, r.stop - 1, math.ceil(per_layer * len(r)) + whole.overhead) for r in stages]
