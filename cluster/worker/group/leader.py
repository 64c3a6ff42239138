"""Rank 0 of a group: the worker the router sees, whose engine steps the whole group.

`load_group_engine` admits the members (authenticated with the join token), splits the
model, starts MLX's ring, loads rank 0's part, agrees on the KV pool (the fewest blocks
any rank holds) and builds an ordinary `Engine` whose runner is a `GroupRunner`: its
`prepare` also sends the step's plan to every member, its `forward` receives the
previous stage's hidden state (pipeline) before running rank 0's layers and the head.
The engine's step is unchanged: schedule -> prepare -> forward -> sample -> postprocess.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import numpy as np

from cluster import platform
from cluster.exit_codes import exit_code, is_permanent
from cluster.worker.config import EngineConfig
from cluster.worker.group import wire
from cluster.worker.group.channel import (
    EXIT_GROUP_LOST,
    HEARTBEAT_S,
    START_BACKSTOP_S,
    Leader,
    StepFailed,
    Watchdog,
)
from cluster.worker.group.config import (GroupOptions, Topology, parse_layer_runs, parse_shares, require_join_token,
                                        topology)
from cluster.worker.group.deadline import exit_after
from cluster.worker.group.kv import LeaderKv
from cluster.worker.group.memory import LeastKV, check_fit, draft_footprint, join_info, rank_parts
from cluster.worker.group.pipelined import PipelinedEngine, VirtualRunner
from cluster.worker.group.progress import StepProgress
from cluster.worker.group.stage import (
    Assignment,
    Stage,
    StageRunner,
    load_part,
    part_bytes,
    split_layers,
    stage_of_rank,
)
from cluster.worker.kernels.cpu import host_view
from cluster.worker.spec_decode import load_draft
from cluster.worker.model_runner import (
    default_kv_budget,
    has_recurrent_layers,
    kv_bytes_per_block,
    text_args,
    weight_dtype,
)

log = logging.getLogger(__name__)


@dataclass
class GroupStats:
    """What the group costs, for metrics, load reports and `load/bench_group.py` (plain
    numbers, read from any thread)."""

    size: int = 1
    parallel: str = "pipeline"
    members: list[dict] = field(default_factory=list)  # per rank: host, memory, weights, layers
    steps: int = 0
    plan_bytes: int = 0  # side channel: plans sent, over all members
    hidden_bytes: int = 0  # MLX: hidden states received by rank 0
    plan_seconds: float = 0.0  # host time building and sending plans (wall clock)
    plan_cpu_seconds: float = 0.0  # the same in CPU time of the engine thread (what a loaded machine does not inflate)
    wait_seconds: float = 0.0  # waiting for the previous stage's notice (its compute)
    collective_seconds: float = 0.0  # inside MLX receives on rank 0
    mismatches: int = 0  # mirrored-state check failures
    failed_steps: int = 0  # steps a rank failed and the group survived (the engine failed their requests)
    checked_steps: int = 0  # steps checked, once per member
    check_seconds: float = 0.0  # rank 0's time in the checks: its checksums and waiting for the members'
    progress: StepProgress | None = None  # each member's part of each step (pipeline)


def config_digest(path: str | Path) -> str:
    """Every rank must serve the same model: the hash of its config.json."""
    return hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()


# A member whose heartbeat answers are this late is named silent in a stall's report.
SILENT_AFTER = 2 * HEARTBEAT_S

RING_FILE_PREFIX = "orchard-ring-"  # + the writer's process id: a later start removes what a killed one left


def remove_stale_ring_files(directory: str | None = None) -> list[Path]:
    """Ring hostfiles of this user's processes that are gone (killed while MLX's init
    waited for its peers: nothing ran to remove them). Returns those removed."""
    gone = []
    for path in Path(directory or tempfile.gettempdir()).glob(f"{RING_FILE_PREFIX}*-*.json"):
        pid = path.name[len(RING_FILE_PREFIX):].split("-")[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid() or _alive(int(pid)):
                continue
            path.unlink()
        except OSError:
            continue
        gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ring_timeout(options: GroupOptions) -> float:
    """How long a rank's MLX init may take once every rank was told RING (each starts it at
    once): `--group-timeout`, within the join timeout."""
    return min(options.timeout, options.join_timeout)


def init_ring(topo: Topology, backend: str = "ring", within: float | None = None):
    """MLX's group over the ranks (the variables mlx.launch would set): the ring backend
    over the ranks' addresses, or jaccl over the RDMA devices mlx.launch names. `within`:
    past that many seconds the process exits 75 (`deadline.py`: MLX's init cannot be
    interrupted, and waits for ever on a neighbour that died before connecting)."""
    if backend == "jaccl":
        missing = [v for v in ("MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR") if not os.environ.get(v)]
        if missing:
            raise ValueError(f"--group-backend jaccl needs {' and '.join(missing)} (run the group with "
                             "mlx.launch --backend jaccl, which sets them)")
        os.environ["MLX_RANK"] = str(topo.rank)
    elif os.environ.get("MLX_HOSTFILE") is None or os.environ.get("MLX_RANK") != str(topo.rank):
        # MLX reads the hostfile once, in init: it is removed as soon as init returns or fails
        given = os.environ.get("MLX_HOSTFILE")
        remove_stale_ring_files()
        fd, path = tempfile.mkstemp(prefix=f"{RING_FILE_PREFIX}{os.getpid()}-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(topo.ring_hostfile())
            os.environ["MLX_HOSTFILE"] = path
            os.environ["MLX_RANK"] = str(topo.rank)
            return _init_mlx_group(topo, backend, within)
        finally:
            if given is None:
                os.environ.pop("MLX_HOSTFILE", None)
            else:
                os.environ["MLX_HOSTFILE"] = given
            with contextlib.suppress(OSError):
                os.unlink(path)
    return _init_mlx_group(topo, backend, within)


def _init_mlx_group(topo: Topology, backend: str, within: float | None):
    try:
        if within is None:
            group = mx.distributed.init(backend=backend, strict=True)
        else:
            with exit_after(within, EXIT_GROUP_LOST, f"forming MLX's {backend} group as rank {topo.rank}"):
                group = mx.distributed.init(backend=backend, strict=True)
    except RuntimeError as e:  # a peer not there (gone, or not yet listening): starting again may find it
        raise ConnectionError(f"MLX's {backend} group did not form: {e}") from None
    if group.size() != topo.size or group.rank() != topo.rank:
        raise ValueError(f"MLX's ring is rank {group.rank()} of {group.size()}, expected {topo.rank} of {topo.size}")
    return group


class GroupState:
    """Rank 0's view of the running group: its channel, ring, plan encoder and stats. Steps
    are numbered as their plans are sent; with batches in flight (`pipelined.py`) they
    finish in the order they were sent, as the hidden states come back in that order."""

    def __init__(self, leader: Leader, ring, topo: Topology, assignment: Assignment, options: GroupOptions,
                 hidden_size: int, stats: GroupStats, max_in_flight: int = 1):
        """`max_in_flight`: batches that may be in flight at once (`pipelined.py`'s virtual
        engines; 1: a step is sent and finished before the next)."""
        self.leader = leader
        self.ring = ring
        self.topo = topo
        self.assignment = assignment
        self.options = options
        self.hidden_size = hidden_size
        self.stats = stats
        self.writer = wire.PlanWriter()
        self.watchdog = Watchdog(leader.on_lost)
        self.step = 0  # the last step sent
        self.max_in_flight = max_in_flight
        # (step, rank 0's checksum, its batch) sent, not finished, oldest first
        self.in_flight: deque[tuple[int, int | None, object]] = deque()
        self.receiving: tuple[int, float] | None = None  # (step, since when) while rank 1's hidden state comes

    @cached_property
    def kv(self) -> LeaderKv:
        """The disk KV tier's messages to the members (their answers past --group-timeout:
        none good); made by the first engine with a tier."""
        return LeaderKv(self.leader, self.options.timeout)

    @property
    def pipeline(self) -> bool:
        return self.assignment.parallel == "pipeline"

    def send_plan(self, scheduled, batch, block_size: int) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.step += 1
        self.watchdog.arm(self.options.timeout, f"group step {self.in_flight[0][0] if self.in_flight else self.step}")
        check = None
        if self.checked(self.step):
            c = time.perf_counter()
            mx.eval(batch.block_tables, batch.slot_mapping)
            check = wire.checksum(host_view(batch.block_tables, np.int32), host_view(batch.slot_mapping, np.int32))
            self.stats.check_seconds += time.perf_counter() - c
        payload = self.writer.encode(self.step, scheduled, block_size, check)
        self.leader.progress.sent(self.step)
        self.leader.broadcast(wire.STEP, payload)
        self.in_flight.append((self.step, check, batch))
        self.stats.plan_bytes += len(payload) * len(self.leader.members)
        self.stats.plan_seconds += time.perf_counter() - t0
        self.stats.plan_cpu_seconds += time.thread_time() - c0

    def checked(self, step: int) -> bool:
        """Whether step `step` is one the ranks compare (`--group-check`: every Nth, the
        first included). Rank 0 decides; the plan's flag tells the members."""
        every = self.options.check_every
        return every > 0 and (step - 1) % every == 0

    def oldest_step(self, batch) -> int:
        """The step id of `batch`, which must be the oldest step in flight: the members run
        the steps in the order they were sent and their hidden states come back in that
        order, so finishing any other batch would give it another step's hidden state.
        Anything else (a step sent and never finished here) loses the group."""
        if not self.in_flight or self.in_flight[0][2] is not batch:
            sent = [step for step, _, _ in self.in_flight]
            self.leader.lose(f"rank 0 finishes a batch that is not the oldest step in flight (steps in flight: {sent})")
            raise ConnectionError("the group is lost")
        return self.in_flight[0][0]

    def receive_hidden(self, step: int, num_tokens: int, dtype) -> mx.array:
        """The previous stage's (rank 1's) hidden state of step `step`, once it says it is
        coming."""
        t0 = time.perf_counter()
        self.leader.wait_ready(step, 1, self.options.timeout)
        t1 = time.perf_counter()
        self.receiving = (step, time.monotonic())
        h = mx.distributed.recv((num_tokens, self.hidden_size), dtype, 1, group=self.ring, stream=mx.cpu)
        mx.eval(h)
        self.receiving = None
        self.stats.wait_seconds += t1 - t0
        self.stats.collective_seconds += time.perf_counter() - t1
        self.stats.hidden_bytes += h.nbytes
        return h

    def finish_step(self) -> None:
        step, crc, _ = self.in_flight.popleft()
        if crc is not None:
            c = time.perf_counter()
            for rank in self.leader.members:
                theirs = self.leader.wait_ack(rank, step, self.options.timeout)
                self.stats.checked_steps += 1
                if theirs != crc:
                    self.stats.mismatches += 1
                    self.leader.lose(f"step {step}: rank {rank}'s block tables and slot mapping differ from "
                                     "rank 0's (mirrored state diverged)")
            self.stats.check_seconds += time.perf_counter() - c
        self.stats.steps += 1
        if self.in_flight:
            self.watchdog.arm(self.options.timeout, f"group step {self.in_flight[0][0]}")
        else:
            self.watchdog.disarm()

    def silent(self, after: float = 0.0) -> dict[int, float]:
        """Members silent on the side channel (stopped, or cut off: their heartbeats go
        unanswered) for over `after` seconds, at least SILENT_AFTER: rank -> seconds."""
        now, after = time.monotonic(), max(after, SILENT_AFTER)
        return {r: now - c.last_heard for r, c in sorted(dict(self.leader.members).items())
                if now - c.last_heard > after}

    def late(self) -> str:
        """What the group waits on, in words, for a stall's report: the rank that has not
        done its part of the oldest step in flight yet under pipeline parallelism (or rank 0
        itself), and any member silent."""
        parts = []
        try:
            step = self.in_flight[0][0]
        except IndexError:  # nothing in flight (another thread pops it)
            step = None
        if step is not None and self.pipeline:
            now = time.monotonic()
            late = self.leader.progress.late(step, now)
            receiving = self.receiving
            if late is None and receiving is not None and receiving[0] == step:  # its notice came, its data not
                parts.append(f"rank 1 has not sent its hidden state of step {step} after "
                             f"{now - receiving[1]:.1f} s")
            elif late is None:
                parts.append(f"rank 0 has not finished step {step}")
            else:
                member = self.leader.members.get(late.rank)
                host = member.info.get("host", "?") if member is not None else "?"
                parts.append(f"rank {late.rank} ({host}) has not finished its part of step {step} after "
                             f"{late.seconds:.1f} s")
        elif step is not None:
            parts.append(f"step {step} waits in a collective")
        parts += [f"rank {r} silent for {seconds:.1f} s" for r, seconds in self.silent().items()]
        return "; ".join(parts)

    def close(self) -> None:
        self.watchdog.stop()
        self.leader.close()


class GroupRunner(StageRunner):
    """Rank 0's model runner: each step's plan goes to the members; under pipeline
    parallelism rank 0 starts from rank 1's hidden state.

    A pipeline step that fails on any rank (a member's FAILED, or rank 0's own layers)
    raises from `forward` as an ordinary step error once the step is finished in order, so
    the engine fails it as a single worker does and the group goes on. Anything that
    leaves the ranks out of step (a tensor that did not move, any failure under tensor
    parallelism) loses the group."""

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype, num_state_slots: int = 0, *,
                 stage, group: GroupState):
        self.group = group
        super().__init__(model, num_blocks, block_size, kv_dtype, num_state_slots, stage)

    @property
    def group_identity(self) -> dict:
        """This rank's place in the group, for the disk tier's identity (`kv_tier.model_identity`)."""
        return {"parallel": self.group.assignment.parallel, "rank": 0, "size": self.group.topo.size}

    def prepare(self, plan):
        g = self.group
        if len(g.in_flight) >= g.max_in_flight:  # a step was planned and never run (an error between the two)
            g.leader.lose(f"step {g.in_flight[0][0]} was sent to the members and never finished here")
            raise ConnectionError("the group is lost")
        batch = super().prepare(plan)
        g.send_plan(plan.scheduled, batch, self.block_size)
        return batch

    def forward(self, batch, hidden=None):
        g = self.group
        step = g.oldest_step(batch)
        received = not (g.pipeline and g.topo.size > 1)  # whatever rank 0 takes from the ring for this step
        try:
            if not received:
                hidden = g.receive_hidden(step, batch.num_tokens, self.dtype)
                received = True
            out = super().forward(batch, hidden)
        except Exception as e:
            if not g.pipeline or not (received or isinstance(e, StepFailed)):
                g.leader.lose(f"step {step} failed on rank 0: {type(e).__name__}: {e}")
                raise
            # every rank is done with this step (a member's FAILED came, or rank 0's layers
            # failed after the hidden state did): finished in order, the group goes on
            log.error("group step %d failed (%s: %s); the engine fails its requests", step, type(e).__name__, e)
            g.stats.failed_steps += 1
            g.finish_step()
            raise
        except BaseException as e:  # the ranks are out of step now: the group cannot go on
            g.leader.lose(f"step {step} failed on rank 0: {type(e).__name__}: {e}")
            raise
        g.finish_step()
        return out


def refuse_pooling(model_path: str, config: EngineConfig) -> None:
    """A group's steps serve generation only: a model that serves embeddings or scores (by
    its directory, `--task` or `--embeddings`) is refused before the group starts, rather than
    served as a generation model (an embedding model would answer chats)."""
    from cluster.worker.pooling import Pooler

    tasks = Pooler.for_model(model_path, 0, None, config.task, config.embeddings).tasks
    if tasks != ("generate",):
        raise ValueError(f"{Path(model_path).name} serves {', '.join(tasks)}: a worker group serves generation only "
                         "(embeddings and scores are served by a single-process worker: leave out --group-size, or "
                         "--embeddings)")


def load_group_engine(model_path: str, config: EngineConfig, options: GroupOptions, join_token: str,
                      model_name: str | None = None):
    """Rank 0's engine for a group (see the module docstring). Blocks until every member
    has joined and loaded its part (or `options.join_timeout` passes)."""
    options.validate()
    topo = topology(options)
    if topo.rank != 0:
        raise ValueError(f"rank {topo.rank} is a member: it runs `cluster.worker.group.member`")
    require_join_token(join_token)
    refuse_pooling(model_path, config)
    t0 = time.monotonic()
    leader = Leader(topo.control, topo.size, join_token, options.timeout,
                    handshake_timeout=options.handshake_timeout)
    watchdog = Watchdog(leader.on_lost)  # a backstop for what has no deadline of its own (loading)
    watchdog.arm(options.join_timeout + START_BACKSTOP_S, "the group's start")
    try:
        return _start_group(model_path, config, options, topo, leader, watchdog, t0, model_name)
    except BaseException as e:  # the members are told (78 too where rank 0 exits 78); nothing of the start is left
        watchdog.stop()
        if not leader.lost:
            leader.refuse(f"rank 0: {e}", permanent=is_permanent(exit_code(e)))
        raise


def _start_group(model_path: str, config: EngineConfig, options: GroupOptions, topo: Topology, leader: Leader,
                 watchdog: Watchdog, t0: float, model_name: str | None):
    """Rank 0's start: admit the members serving this model, plan the split and check it
    fits before any rank loads, send the plan and the ring, load this rank's part, agree
    the KV pool with the members, then serve."""
    deadline = t0 + options.join_timeout
    digest = _admit_members(leader, topo, options, model_path, deadline)
    # each member's ring address as it says, not as this rank's flags have it (a Ray
    # bundle may have moved since they were written)
    topo = topo.joined({r: c.info["ring"] for r, c in leader.members.items() if "ring" in c.info})
    assignment, memory, least, virtual = _plan(model_path, config, options, topo, leader)
    engine_settings = {"block_size": config.block_size, "kv_cache_dtype": config.kv_cache_dtype,
                       "cpu_dequantize": config.cpu_dequantize, "max_num_seqs": config.max_num_seqs,
                       "least_kv_blocks": least.blocks}
    leader.broadcast(wire.ASSIGN, wire.dumps({"assignment": assignment.to_json(), "config": digest,
                                              "engine": engine_settings, "check_every": options.check_every}))
    leader.broadcast(wire.RING, wire.dumps({"ring": topo.ring_addresses()}))
    ring = init_ring(topo, options.backend, ring_timeout(options))
    log.info("group: MLX %s group of %d up (%s)", options.backend, topo.size,
             ", ".join(f"{h}:{p}" for h, p in topo.ring))
    stage = assignment.stage(0)
    model, tokenizer, name, draft = _load_own_part(model_path, config, options, stage, ring, assignment.num_layers,
                                                   model_name)
    kv_dtype = weight_dtype(model) if config.kv_cache_dtype == "auto" else getattr(mx, config.kv_cache_dtype)
    loaded = leader.gather(wire.LOADED, deadline)
    mine = capacity(model, stage, config, kv_dtype, memory[0], least.blocks, draft)
    num_blocks = _pool_blocks(config, [mine["blocks"]] + [int(loaded[r]["blocks"]) for r in sorted(loaded)], virtual)
    num_state_slots = virtual * config.max_num_seqs if has_recurrent_layers(model) else 0
    leader.broadcast(wire.START, wire.dumps({"num_blocks": num_blocks, "kv_dtype": str(kv_dtype).split(".")[-1],
                                             "num_state_slots": num_state_slots}))
    members = _member_stats(leader, assignment, memory, mine, loaded)
    stats = GroupStats(size=topo.size, parallel=options.parallel, members=members,
                       progress=leader.progress if options.parallel == "pipeline" else None)
    leader.serve()
    watchdog.stop()
    group = GroupState(leader, ring, topo, assignment, options, int(text_args(model).hidden_size), stats,
                       max_in_flight=virtual)
    log.info("group of %d up in %.1f s: %s; %d KV blocks (the fewest any rank holds)", topo.size,
             time.monotonic() - t0, "; ".join(f"rank {m['rank']} layers {m['layers'][0]}-{m['layers'][1] - 1}, "
                                              f"{m['weights'] / 2**20:.0f} MiB" for m in members), num_blocks)

    def shared_runner(num_blocks, block_size, kv_dtype, num_state_slots=0):
        return GroupRunner(model, num_blocks, block_size, kv_dtype, num_state_slots, stage=stage, group=group)

    config = _disk_tier_on_every_rank(config, loaded)
    engine = group_engine(model, tokenizer, config, name, num_blocks, virtual, shared_runner, draft, group,
                          model_path=model_path)
    if virtual > 1:
        log.info("group: %d batches in flight, each over %d of the %d KV blocks", virtual, num_blocks // virtual,
                 num_blocks)
    return engine


def _admit_members(leader: Leader, topo: Topology, options: GroupOptions, model_path: str, deadline: float) -> str:
    """Wait for every member, and refuse one serving another model: this model's config digest."""
    log.info("group: rank 0 of %d (%s parallel), waiting for the members on %s:%d", topo.size, options.parallel,
             *leader.address)
    leader.admit(deadline)
    digest = config_digest(model_path)
    for r, c in sorted(leader.members.items()):
        if c.info.get("config", digest) != digest:
            raise ValueError(f"rank {r} ({c.info.get('host', '?')}) serves another model: its config.json differs "
                             f"from rank 0's ({model_path})")
    return digest


def _plan(model_path: str, config: EngineConfig, options: GroupOptions, topo: Topology,
          leader: Leader) -> tuple[Assignment, dict[int, int], LeastKV, int]:
    """Each rank's part, the memory each gives, the fewest KV blocks to serve with, and the
    batches in flight; ValueError, before any rank loads, where the parts do not fit."""
    from mlx_lm.utils import load_model

    # from a lazily built model: nothing read but the files' headers
    lazy, _ = load_model(Path(model_path), lazy=True, strict=False)
    num_layers = len(lazy.layers)
    infos = {0: {"host": socket.gethostname(), **join_info(options.memory_budget, config.kv_cache_memory_bytes)},
             **{r: c.info for r, c in leader.members.items()}}
    memory = {r: int(infos[r].get("memory", 0)) for r in range(topo.size)}
    assignment = Assignment(options.parallel, topo.size, split(lazy, options, memory), num_layers)
    # pipelined batches: the requests split over `virtual` engines, each with its share of
    # the pool and its own state slots (pipelined.py)
    virtual = (options.inflight or topo.size) if options.parallel == "pipeline" else 1
    least = LeastKV.of(lazy, config, virtual)
    try:
        check_fit(rank_parts(lazy, assignment, config, infos, draft_footprint(config)), least, config.num_kv_blocks,
                  num_layers)
    except ValueError as e:  # a setting (or a draft model that is not there): no rank loads, none starts again
        log.error("group: %s", e)
        raise
    return assignment, memory, least, virtual


def _load_own_part(model_path: str, config: EngineConfig, options: GroupOptions, stage: Stage, ring, num_layers: int,
                   model_name: str | None):
    """Rank 0's part of the model, the tokenizer, the served name and the draft model (one,
    whatever the batches in flight)."""
    from mlx_lm.utils import load_config, load_tokenizer

    model = load_part(model_path, options.parallel, stage, ring, config.cpu_dequantize, num_layers)
    tokenizer = load_tokenizer(Path(model_path), None,
                               eos_token_ids=load_config(Path(model_path)).get("eos_token_id", None))
    name = model_name or Path(model_path).name
    return model, tokenizer, name, load_draft(config, tokenizer, int(text_args(model).vocab_size), name)


def _disk_tier_on_every_rank(config: EngineConfig, loaded: dict) -> EngineConfig:
    """Rank 0's config, its disk tier off where a member runs none (no --kv-disk-dir there):
    every read would be recomputed anyway, as that rank holds none of its layers' blocks."""
    without = [r for r in sorted(loaded) if not loaded[r].get("kv_disk", False)]
    if config.kv_disk_dir is None or not without:
        return config
    log.warning("the disk KV tier is off: rank(s) %s of the group run none (give every rank a --kv-disk-dir of "
                "its own)", ", ".join(map(str, without)))
    return replace(config, kv_disk_dir=None)


def _pool_blocks(config: EngineConfig, capacities: list[int], virtual: int) -> int:
    """The KV blocks every rank holds: the setting, or the fewest any rank has room for, a
    multiple of the batches in flight."""
    num_blocks = config.num_kv_blocks or max(1, min(capacities))
    num_blocks -= num_blocks % virtual
    if num_blocks < virtual:
        raise ValueError(f"{num_blocks} KV blocks cannot be shared by {virtual} batches in flight")
    return num_blocks


def _member_stats(leader: Leader, assignment: Assignment, memory: dict[int, int], mine: dict,
                  loaded: dict) -> list[dict]:
    """Each rank's host, memory, weights, layers and resident bytes, for the group's stats."""
    stages, num_layers = assignment.stages, assignment.num_layers
    members = [{"rank": 0, "host": socket.gethostname(), "memory": memory[0], "weights": mine["weights"],
                "layers": list(stages[0]) if stages else [0, num_layers], "rss": platform.resident_bytes()}]
    for r in sorted(loaded):
        info = leader.members[r].info
        members.append({"rank": r, "host": str(info.get("host", "")), "memory": memory[r],
                        "weights": int(loaded[r]["weights"]), "layers": list(stages[r]) if stages else [0, num_layers],
                        "rss": int(loaded[r].get("rss", 0))})
    return members


def split(model, options: GroupOptions, memory: dict[int, int]) -> tuple[tuple[int, int], ...]:
    """Pipeline: each rank's layers [start, stop), in proportion to the memory it gives (or
    to `--group-shares`; or as `--group-shares` gives them, layer by layer); tensor: none
    (every rank holds a slice of every layer)."""
    if options.parallel != "pipeline":
        return ()
    size = options.size
    runs = parse_layer_runs(options.shares, size, len(model.layers)) if options.shares else None
    if runs is not None:  # the fleet's plan: each rank fetched the files of these layers only
        return tuple((run.start, run.stop) for run in runs)
    shares = parse_shares(options.shares, size) if options.shares else [memory[r] or 1 for r in range(size)]
    layer_bytes, embed_bytes, head_bytes = part_bytes(model)
    by_stage = split_layers(layer_bytes, [shares[size - 1 - s] for s in range(size)], embed_bytes, head_bytes)
    return tuple((by_stage[stage_of_rank(r, size)].start, by_stage[stage_of_rank(r, size)].stop) for r in range(size))


def group_engine(model, tokenizer, config: EngineConfig, name: str, num_blocks: int, virtual: int, shared_runner,
                 draft=None, group=None, model_path: str | None = None):
    """Rank 0's engine over a pool of `num_blocks`: an `Engine` whose runner is
    `shared_runner(num_blocks, block_size, kv_dtype, num_state_slots=...)`, or with `virtual`
    batches in flight a `PipelinedEngine` of that many engines, each over its share of the
    one runner. `draft` (`spec_decode.load_draft`): the one draft model they all share.
    `model_path`: the model's directory (the disk tier's identity hashes its files)."""
    from cluster.worker.engine import Engine

    if virtual == 1:
        def runner_factory(model, num_blocks, block_size, kv_dtype, num_state_slots=0):
            return shared_runner(num_blocks, block_size, kv_dtype, num_state_slots)

        engine = Engine(model, tokenizer, replace(config, num_kv_blocks=num_blocks), model_name=name,
                        runner_factory=runner_factory, draft=draft, model_path=model_path)
        engine.group = group
        if engine.kv_tier is not None and group is not None:
            engine.kv_tier.peers = group.kv.peers()
        return engine
    kv_dtype = weight_dtype(model) if config.kv_cache_dtype == "auto" else getattr(mx, config.kv_cache_dtype)
    num_state_slots = virtual * config.max_num_seqs if has_recurrent_layers(model) else 0
    shared = shared_runner(num_blocks, config.block_size, kv_dtype, num_state_slots)
    share = num_blocks // virtual
    engines = []
    for v in range(virtual):
        def runner_factory(model, num_blocks, block_size, kv_dtype, num_state_slots=0, v=v):
            return VirtualRunner(shared, v * share, v * config.max_num_seqs)

        # one disk store a process: the first engine's, which the others share (PipelinedEngine)
        engines.append(Engine(model, tokenizer, replace(config, num_kv_blocks=share,
                                                        kv_disk_dir=config.kv_disk_dir if v == 0 else None),
                              model_name=name, runner_factory=runner_factory, draft=draft,
                              model_path=model_path))
    engine = PipelinedEngine(engines, group)
    for v, e in enumerate(engines):
        if e.kv_tier is not None and group is not None:
            e.kv_tier.peers = group.kv.peers(v * share)
    return engine


def capacity(model, stage, config: EngineConfig, kv_dtype, memory: int, least_blocks: int = 1, draft=None) -> dict:
    """How many KV blocks this rank holds, and its weights' bytes: its
    `--kv-cache-memory-bytes` over one block of its layers (rank 0: and of the `draft`
    model's), else a share of what its weights leave of the `memory` it gives, never
    under the group's least (`memory.LeastKV`: the check before loading made room for it)."""
    from mlx.utils import tree_flatten

    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    per_block = kv_bytes_per_block(model, config.block_size, kv_dtype, stage.layers)
    draft_weights = 0
    if draft is not None:
        per_block += draft.kv_bytes_per_block(config.block_size, None if config.kv_cache_dtype == "auto" else kv_dtype)
        draft_weights = draft.weight_bytes()
    if not per_block:
        return {"blocks": 1 << 30, "weights": weights + draft_weights}
    if config.kv_cache_memory_bytes:
        blocks = config.kv_cache_memory_bytes // per_block
    else:
        blocks = max(least_blocks, default_kv_budget(model, memory, draft_weights) // per_block)
    return {"blocks": blocks, "weights": weights + draft_weights}
