"""A group member (rank >= 1): joins rank 0, loads its part, then runs exactly the steps
rank 0 plans, until rank 0 says stop (exit 0) or the group is lost (exit 75, so that
whatever started the group starts it again). No scheduler, sampler or server here.
Told to stop itself (SIGTERM: `orchard up` stopping, launchd booting its Mac out), a
serving member asks rank 0 to drain and stop the whole group (STOP), and runs the steps
of the drain until rank 0's SHUTDOWN.

Each step: decode the plan against the mirrored block tables (`wire.PlanReader`), build
the batch, and under pipeline parallelism wait for the previous stage's notice, receive
its hidden state, run the held layers, tell the next stage and send it on (the first
stage starts from the token ids); under tensor parallelism run the whole sharded model,
whose all-reduces meet the other ranks'.

A pipeline step that raises here (its batch or its layers: a request that breaks them)
is told to the next stage as FAILED, with the cause, in place of READY and the hidden
state; a stage told FAILED passes it on. Rank 0 then fails that step as a single worker's
step fails (the request that breaks it fails alone) and the group goes on. What cannot be
survived loses the group: a plan that does not decode, a tensor that does not move, and
any failure under tensor parallelism (the other ranks wait inside a collective).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import NoReturn

import mlx.core as mx

from cluster import platform
from cluster.exit_codes import EXIT_PERMANENT, describe, exit_code, is_permanent
from cluster.worker.config import EngineConfig
from cluster.worker.faults import MemberFaults
from cluster.worker.group import wire
from cluster.worker.group.channel import EXIT_GROUP_LOST, START_BACKSTOP_S, Member, StepFailed, Watchdog
from cluster.worker.group.config import GroupOptions, require_join_token, topology
from cluster.worker.group.kv import MemberKv
from cluster.worker.group.leader import capacity, config_digest, init_ring, ring_timeout
from cluster.worker.group.memory import join_info
from cluster.worker.group.stage import Assignment, StageRunner, load_part, member_batch
from cluster.worker.model_runner import text_args, weight_dtype
from cluster.worker.power import PowerNotifier, StayAwake, system_power

# how much longer than rank 0's drain a member waits for its answer (macOS waits
# power.SLEEP_ACK_S in all)
SLEEP_ANSWER_S = 5.0

log = logging.getLogger(__name__)


def member_process(model_path: str, options: GroupOptions, join_token: str,
                   config: EngineConfig | None = None) -> NoReturn:
    """A member process (`orchard worker serve`): `run_member`, then the process ends with
    its exit code: a member that could not start, or whose group ended, is a process gone,
    which its launcher starts again unless the code says permanent (`cluster/exit_codes.py`),
    never one left alive doing nothing. (A Ray actor's thread ends with `end_actor`.)"""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    code = run_member(model_path, options, join_token, config, stop=stop)
    logging.shutdown()
    os._exit(code)


def run_member(model_path: str, options: GroupOptions, join_token: str, config: EngineConfig | None = None,
               power: PowerNotifier | None = None, stop: threading.Event | None = None) -> int:
    """The member's whole life; returns the process's exit code. `config`: this process's
    engine flags, of which a member takes its KV budget (`--kv-cache-memory-bytes`); rank
    0 sets the rest. `power`: the machine's power management (None: `system_power()`):
    the Mac is kept awake while the member holds its layers, and a sleep that comes anyway
    has rank 0 drain the group first. `stop`: set when the process is told to stop
    (`_stop_when_told`)."""
    try:
        options.validate()
        topo = topology(options)
        if topo.rank == 0:
            raise ValueError("rank 0 serves the group: `orchard worker serve` without a member rank")
        require_join_token(join_token)
    except ValueError as e:  # a setting: one line, and the code that says so
        log.error("group member cannot start: %s", e)
        return EXIT_PERMANENT
    kv_budget = config.kv_cache_memory_bytes if config is not None else None
    own = config or EngineConfig()  # this rank's flags (its --kv-disk-dir: its own layers' disk tier)
    deadline = time.monotonic() + options.join_timeout
    member = Member(topo.control, topo.rank, topo.size, join_token, options.timeout,
                    info={"host": socket.gethostname(), "pid": os.getpid(), "ring": topo.ring_addresses()[topo.rank],
                          **join_info(options.memory_budget, kv_budget), **_model_digest(model_path)},
                    handshake_timeout=options.handshake_timeout)
    watchdog = Watchdog(member.on_lost)  # a backstop for what has no deadline of its own (loading)
    watchdog.arm(options.join_timeout + START_BACKSTOP_S, "joining the group")
    serving = threading.Event()
    if stop is not None:
        threading.Thread(target=_stop_when_told, args=(member, stop, serving, topo.rank), name="orchard-group-stop",
                         daemon=True).start()
    try:
        member.join(deadline)
        member.listen()  # rank 0 gone or silent from now on: noticed at once, wherever the start is
        log.info("group: rank %d joined rank 0 at %s:%d", topo.rank, *topo.control)
        assign = member.receive(wire.ASSIGN, deadline)
        if assign["config"] != config_digest(model_path):
            raise ValueError(f"the model at {model_path} is not rank 0's (its config.json differs)")
        assignment = Assignment.from_json(assign["assignment"])
        engine = assign["engine"]
        topo = topo.with_ring(member.receive(wire.RING, deadline)["ring"])  # every rank's, as rank 0 learnt them
        ring = init_ring(topo, options.backend, ring_timeout(options))
        stage = assignment.stage(topo.rank)
        model = load_part(model_path, assignment.parallel, stage, ring, engine["cpu_dequantize"],
                          assignment.num_layers)
        config = EngineConfig(block_size=int(engine["block_size"]), kv_cache_dtype=engine["kv_cache_dtype"],
                              kv_cache_memory_bytes=kv_budget)
        kv_dtype = weight_dtype(model) if config.kv_cache_dtype == "auto" else getattr(mx, config.kv_cache_dtype)
        mine = capacity(model, stage, config, kv_dtype, member.info["memory"], int(engine.get("least_kv_blocks", 1)))
        member.send(wire.LOADED, wire.dumps({**mine, "rss": platform.resident_bytes(),
                                             "kv_disk": own.kv_disk_dir is not None}))
        start = member.receive(wire.START, deadline)
        kv_dtype = getattr(mx, start["kv_dtype"])
        slots = int(start["num_state_slots"])
        runner = StageRunner(model, int(start["num_blocks"]), config.block_size, kv_dtype, slots, stage)
        runner.group_identity = {"parallel": assignment.parallel, "rank": topo.rank, "size": topo.size}
        kv = MemberKv.open(member.send, runner, model, own, model_path)  # never raises: off, saying why
    except Exception as e:  # told to rank 0, which stops the group's start (for good when it is permanent)
        code = exit_code(e)
        if isinstance(e, wire.Refused):  # rank 0 said why (a setting, a group that does not fit): no traceback
            log.error("group rank %d could not start (%s): %s", topo.rank, describe(code), e)
        else:
            log.exception("group rank %d could not start (%s)", topo.rank, describe(code))
        member.send_error(f"rank {topo.rank}: {type(e).__name__}: {e}", permanent=is_permanent(code))
        # nothing of this start may outlive it: the watchdog, armed for the join, would end
        # whatever process runs this later (a Ray actor's, a test's) with on_lost
        watchdog.stop()
        member.close()
        return code
    watchdog.disarm()
    serving.set()
    log.info("group rank %d serving layers %d-%d (%s parallel), %d KV blocks", topo.rank, stage.layers.start,
             stage.layers.stop - 1, assignment.parallel, runner.num_blocks)
    awake = StayAwake(power or system_power(), f"orchard group rank {topo.rank} holds layers {stage.layers.start}-"
                      f"{stage.layers.stop - 1}", lambda seconds: _drain_group(member, seconds), member.awake).start()
    try:
        return _serve(member, runner, ring, assignment, topo.rank, options, watchdog,
                      int(text_args(model).hidden_size), kv)
    finally:
        awake.stop()


def _drain_group(member: Member, seconds: float) -> None:
    """This Mac is about to sleep: rank 0 drains the group (its streams end, for the router
    to resume or hold) before the member lets it. The group is lost once this rank is
    silent for --group-timeout, and started again when the Mac is back."""
    if not member.sleeping(seconds + SLEEP_ANSWER_S):
        log.warning("group rank %d: rank 0 did not say the group was drained; sleeping anyway", member.rank)


def _model_digest(model_path: str) -> dict:
    """The model's config digest, told as the member joins: rank 0 refuses a group whose
    ranks serve different models before any rank waits in MLX's ring init (where a member
    that stops does not end rank 0's wait: it would exit 75, to be started again for
    ever). Without a readable config.json, nothing: the member says so on ASSIGN."""
    try:
        return {"config": config_digest(model_path)}
    except OSError:
        return {}


def _stop_when_told(member: Member, stop: threading.Event, serving: threading.Event, rank: int) -> None:
    """Told to stop: a serving member asks rank 0 to drain and stop the group, and goes on
    running steps until rank 0's SHUTDOWN (exit 0). Before the group serves (or with no
    rank 0 to ask) there is nothing to drain: the process ends now, with 0; rank 0 notices
    it gone (and admits it again if it comes back while the group forms)."""
    stop.wait()
    if serving.is_set() and member.ask_to_stop("told to stop (SIGTERM)"):
        log.info("group rank %d: told to stop: rank 0 drains and stops the group", rank)
        return
    log.info("group rank %d: told to stop before the group serves: exiting", rank)
    logging.shutdown()
    os._exit(0)


def _serve(member: Member, runner: StageRunner, ring, assignment: Assignment, rank: int, options: GroupOptions,
           watchdog: Watchdog, hidden_size: int, kv: MemberKv) -> int:
    reader = wire.PlanReader(runner.block_size, runner.num_blocks)
    faults = MemberFaults.from_env(rank)  # None unless ORCHARD_FAULT_DIR is set (tests)
    while True:
        kind, payload = member.plans.get()
        if kind == wire.SHUTDOWN:
            log.info("group rank %d: rank 0 stopped the group", rank)
            kv.close()
            member.close()
            watchdog.stop()
            return 0
        try:
            if kind in wire.KV_KINDS:  # the disk tier's saves, reads and installs, between steps
                kv.handle(kind, payload)
                continue
            plan = reader.decode(payload)
            watchdog.arm(options.timeout, f"group step {plan.step}")
            if plan.check is not None:
                mine = plan.checksum()
                member.send(wire.ACK, wire.ACK_MSG.pack(plan.step, mine))
                if mine != plan.check:
                    log.error("group rank %d: step %d's block tables and slot mapping differ from rank 0's", rank,
                              plan.step)
            if assignment.parallel == "pipeline":
                _pipeline_step(member, runner, ring, plan, rank, options.timeout, hidden_size, faults)
            else:
                if faults is not None:
                    faults.before_step(plan.input_ids)
                out = runner.forward(member_batch(plan, runner))
                mx.eval(out, *runner.pool_arrays())
            watchdog.disarm()
        except Exception as e:  # this rank cannot follow rank 0 any more: the group is lost
            log.exception("group rank %d: step failed", rank)
            member.send_error(f"rank {rank}: {type(e).__name__}: {e}")
            member.on_lost(f"step failed: {e}")
            return EXIT_GROUP_LOST


def _pipeline_step(member: Member, runner: StageRunner, ring, plan: wire.StepPlan, rank: int, timeout: float,
                   hidden_size: int, faults: MemberFaults | None) -> None:
    """This rank's stage of one step. Its own work failing (the batch, the layers) is told
    downstream as FAILED; the previous stage's hidden state is received all the same (MLX's
    ring stays in step). Moving tensors failing raises (the group is lost)."""
    failure = None
    batch = hidden = None
    try:
        if faults is not None:
            faults.before_step(plan.input_ids)
        batch = member_batch(plan, runner)
    except Exception as e:  # noqa: BLE001  (told downstream, with its cause)
        failure = _cause(rank, plan.step, e)
    if not runner.stage.embeds:
        try:
            member.wait_ready(plan.step, rank + 1, timeout)
        except StepFailed as e:  # nothing comes from it: pass its cause on
            failure = failure or str(e)
        else:
            hidden = mx.distributed.recv((plan.num_tokens, hidden_size), runner.dtype, rank + 1, group=ring,
                                         stream=mx.cpu)
            mx.eval(hidden)
    if failure is None:
        try:
            out = runner.forward(batch, hidden).astype(runner.dtype)
            mx.eval(out, *runner.pool_arrays())
        except Exception as e:  # noqa: BLE001
            failure = _cause(rank, plan.step, e)
    if failure is not None:
        member.notify_failed(plan.step, rank - 1, failure)
        return
    member.notify_ready(plan.step, rank - 1)
    mx.eval(mx.distributed.send(out, rank - 1, group=ring, stream=mx.cpu))


def _cause(rank: int, step: int, error: Exception) -> str:
    log.exception("group rank %d: step %d failed; rank 0 fails its requests and the group goes on", rank, step)
    return f"rank {rank}: {type(error).__name__}: {error}"
