"""Worker groups against one process, on the same model and load, in one run.

    python load/bench_group.py [--model DIR] [--requests 128] [--prompt-len 32] [--max-tokens 64]
                               [--modes one,pipeline1,pipeline2,tensor] [--repeats 3]
    python load/bench_group.py --check-cost [--repeats 3] ...

Modes (each a fresh set of processes; a group's ranks over MLX's ring on loopback):
  one        one process with 2 threads (OpenBLAS and OpenMP), the same total as a group of 2
  pipeline1  2-rank pipeline, 1 batch in flight: the stages take turns
  pipeline2  2-rank pipeline, 2 batches in flight (two virtual engines): both stages compute
  tensor     2-rank tensor parallel (mlx-lm's shard(): an all-reduce after each layer's
             attention and MLP)
Each rank of a group runs 1 thread pinned to its own core (2 cores: rank 0 on one, rank 1 on
the other). The load: `--requests` (128) greedy requests at once (EOS ignored), 64 running in a batch
(each engine's max_num_seqs; the pipelined group's two virtual engines run 64 each): a
saturating load. The machine's load average is printed: figures from a busy machine are
noise.

Printed per mode: output tokens/s and its ratio to `one`, the mean step time, and for a
group the plan's host time per step on rank 0 (encoding and sending it, in the engine
thread's CPU time, which a loaded machine does not inflate; target <= 1 ms at 64 running
sequences), rank 0's time in MLX collectives and waiting for the other stage per
step, the bytes per step against the theory (pipeline: hidden x 4 bytes per token at the one
stage boundary; tensor: 2 all-reduces of hidden x 4 bytes per layer per token), and each
rank's weights against its share of the split (target: within 10%) and its resident memory.
Targets printed at the end: pipeline2 >= 1.6x pipeline1 output tokens/s.

`--check-cost`: what `--group-check` (the mirrored-state check) costs. pipeline1 runs with
the check off and on every step, alternating `--repeats` times; printed: the mean step time
of each, rank 0's time in the check per checked step (its checksum and the wait for the
member's), and both as a share of a step at the default rate (every `--group-check`th
step; target: under 1%).

Where Linux's /proc is there, each rank's time over the timed steps is split into CPU and
run-queue wait (runnable, but the core was running something else: the machine's other
load), per step. Pipelining turns one rank's idle time into compute; on a machine whose
cores are already busy with other work that idle time was not idle, and the ratio shrinks
towards 1 whatever the engine does. So beside the measured ratio the report projects the
one a core each would give, from the ranks' CPU per step (pipeline1: c0 + c1 a step,
pipeline2: max(c0, c1)); the measured ratio means what the projection means only where the
run-queue waits are small beside the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.up import free_ports  # noqa: E402

MODES = ("one", "pipeline1", "pipeline2", "tensor")
PIN = True
TOKEN = "bench-group-token"


def env(threads: int) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                ORCHARD_JOIN_TOKEN=TOKEN, PYTHONUNBUFFERED="1")


def sched(pid: int | None) -> tuple[float, float] | None:
    """(CPU seconds, run-queue seconds) of process `pid` so far, over all its threads (MLX
    computes on a thread of its own): Linux's schedstat; None where there is none."""
    if pid is None:
        return None
    cpu = delay = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    ran, waited, _ = f.read().split()
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
                continue
            cpu += int(ran)
            delay += int(waited)
    except OSError:
        return None
    return cpu / 1e9, delay / 1e9


def since(before, after) -> list[float] | None:
    return None if before is None or after is None else [a - b for a, b in zip(after, before)]


def pin(cpu: int | None):
    """Each rank on a core of its own (`--no-pin`: where the OS puts it)."""
    if cpu is None or PIN is False or not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


# -- one run (rank 0, or the single process) -------------------------------------------------------

def run(args) -> dict:
    from cluster import platform

    platform.preload_blas()  # before MLX is imported
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    # 64 running per engine: a pipelined group's 2 virtual engines run 64 each
    config = EngineConfig(max_num_seqs=64, num_kv_blocks=args.blocks)
    if args.mode == "one":
        engine = Engine.from_pretrained(args.model, config)
    else:
        from cluster.worker.group.config import GroupOptions
        from cluster.worker.group.leader import load_group_engine

        options = GroupOptions(size=2, rank=0, hosts=args.hosts, port=args.port,
                               parallel="tensor" if args.mode == "tensor" else "pipeline",
                               inflight=2 if args.mode == "pipeline2" else 1, timeout=120,
                               check_every=args.check_every)
        engine = load_group_engine(args.model, config, options, TOKEN)
    engine.warm_up()
    rng = random.Random(0)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"b{i}", [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)], params)
    group = getattr(engine, "group", None)
    before = None if group is None else dict(vars(group.stats))
    steps = tokens = forwarded = 0
    s0, s1 = sched(os.getpid()), sched(args.member_pid or None)
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        outs = engine.step()
        tokens += sum(len(o.new_token_ids) for o in outs)
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    e0, e1 = sched(os.getpid()), sched(args.member_pid or None)
    forwarded = args.requests * (args.prompt_len + args.max_tokens - 1)
    out = {"mode": args.mode, "tok_s": tokens / wall, "tokens": tokens, "wall": wall, "steps": steps,
           "forwarded": forwarded, "rss0": platform.resident_bytes(), "cpu0": cpu,
           "sched0": since(s0, e0), "sched1": since(s1, e1)}
    if group is not None:
        s = group.stats
        n = s.steps - before["steps"]
        out.update(group_steps=n, plan_ms=1e3 * (s.plan_cpu_seconds - before["plan_cpu_seconds"]) / n,
                   plan_wall_ms=1e3 * (s.plan_seconds - before["plan_seconds"]) / n,
                   collective_ms=1e3 * (s.collective_seconds - before["collective_seconds"]) / n,
                   wait_ms=1e3 * (s.wait_seconds - before["wait_seconds"]) / n,
                   hidden_bytes=(s.hidden_bytes - before["hidden_bytes"]) / n,
                   plan_bytes=(s.plan_bytes - before["plan_bytes"]) / n, members=s.members,
                   checked=s.checked_steps - before["checked_steps"],
                   check_ms=1e3 * (s.check_seconds - before["check_seconds"]),
                   hidden=group.hidden_size, layers=group.assignment.num_layers)
        group.close()
    return out


# -- the driver -------------------------------------------------------------------------------------

def run_mode(mode: str, args, check_every: int = 0) -> dict:
    common = ["--model", str(args.model), "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
              "--max-tokens", str(args.max_tokens), "--blocks", str(args.blocks), "--check-every", str(check_every)]
    members = []
    if mode == "one":
        cmd = [sys.executable, __file__, "--role", "run", "--mode", mode, *common]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env(2), timeout=1800)
    else:
        *ring, port = free_ports(3)
        hosts = ",".join(f"127.0.0.1:{p}" for p in ring)
        parallel = "tensor" if mode == "tensor" else "pipeline"
        members.append(subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(args.model), "--group-size", "2",
             "--group-rank", "1", "--group-hosts", hosts, "--group-port", str(port), "--parallel", parallel,
             "--group-timeout", "120"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(1), preexec_fn=pin(1)))
        cmd = [sys.executable, __file__, "--role", "run", "--mode", mode, "--hosts", hosts, "--port", str(port),
               "--member-pid", str(members[0].pid), *common]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env(1), timeout=1800, preexec_fn=pin(0))
    member_cpu = 0.0
    for m in members:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # it exits when rank 0 stops the group (wait4: its CPU time too)
            try:
                pid, status, usage = os.wait4(m.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                member_cpu += usage.ru_utime + usage.ru_stime
                m.returncode = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.05)
        if m.poll() is None:
            m.kill()
            m.wait()
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    out["cpu1"] = member_cpu  # the member's whole life (start-up included)
    return out


def member_cpu(r: dict) -> tuple[float, str]:
    """Rank 1's CPU seconds over the timed steps where they were measured, else over its life."""
    if r.get("sched1") is not None:
        return r["sched1"][0], "the timed steps"
    return r["cpu1"], "its whole life: start-up included"


def check_cost(args) -> None:
    """`--check-cost`: pipeline1 with the check off and on every step, alternating."""
    from cluster.worker.group.config import GroupOptions

    every = GroupOptions.check_every
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for _ in range(args.repeats):
        for n in runs:
            runs[n].append(run_mode("pipeline1", args, check_every=n))
            r = runs[n][-1]
            print(f"  check {'every step' if n else 'off'}: {1e3 * r['wall'] / r['steps']:.2f} ms a step "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    off, on = (sum(r["wall"] / r["steps"] for r in runs[n]) / len(runs[n]) for n in (0, 1))
    check_ms = sum(r["check_ms"] / r["checked"] for r in runs[1]) / len(runs[1])
    ratio = on / off
    print(f"step: {1e3 * off:.2f} ms with the check off, {1e3 * on:.2f} ms checking every step ({ratio:.3f}x, "
          f"means of {args.repeats})")
    print(f"rank 0 in the check: {check_ms:.3f} ms a checked step = {check_ms / (1e3 * off):.2%} of a step")
    print(f"at the default, every {every}th step: {check_ms / every / (1e3 * off):.3%} of a step by rank 0's time in "
          f"the check, {(ratio - 1) / every:.3%} by the step times (target: under 1%)")


def report(results: dict[str, dict], requests: int) -> None:
    base = results.get("one")
    print(f"\n{'mode':<10} {'tok/s':>8} {'vs one':>7} {'step ms':>8} {'plan ms':>8} {'coll ms':>8} {'wait ms':>8} "
          f"{'bytes/step':>11} {'theory':>11}")
    for mode, r in results.items():
        step_ms = 1e3 * r["wall"] / r["steps"]
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        if "plan_ms" in r:
            per_step_tokens = r["forwarded"] / r["group_steps"]
            if mode == "tensor":
                measured = "(in MLX)"
                theory = 2 * r["layers"] * r["hidden"] * 4 * per_step_tokens
            else:
                measured = f"{r['hidden_bytes']:.0f}"
                theory = r["hidden"] * 4 * per_step_tokens
            print(f"{mode:<10} {r['tok_s']:>8.1f} {ratio:>7} {step_ms:>8.1f} {r['plan_ms']:>8.3f} "
                  f"{r['collective_ms']:>8.2f} {r['wait_ms']:>8.2f} {measured:>11} {theory:>11.0f}")
        else:
            print(f"{mode:<10} {r['tok_s']:>8.1f} {ratio:>7} {step_ms:>8.1f} {'-':>8} {'-':>8} {'-':>8} {'-':>11} "
                  f"{'-':>11}")
    for mode, r in results.items():
        if "cpu1" in r and r.get("members"):
            c1, what = member_cpu(r)
            print(f"{mode}: CPU per output token rank 0 {1e3 * r['cpu0'] / r['tokens']:.2f} ms, rank 1 "
                  f"{1e3 * c1 / r['tokens']:.2f} ms ({what}); busy rank 0 "
                  f"{100 * r['cpu0'] / r['wall']:.0f}% of the wall time")
    for mode, r in results.items():
        if r.get("sched0") is None:
            continue
        n = r["steps"]
        cpu, queued = (1e3 * x / n for x in r["sched0"])
        parts = [f"step {1e3 * r['wall'] / n:.1f} ms", f"rank 0 CPU {cpu:.1f}, run queue {queued:.1f}"]
        if r.get("sched1") is not None:
            parts.append(f"rank 1 CPU {1e3 * r['sched1'][0] / n:.1f}, run queue {1e3 * r['sched1'][1] / n:.1f}")
        print(f"{mode} per step (ms): " + "; ".join(parts) + " (run queue: runnable, a core busy elsewhere)")
    for mode, r in results.items():
        if "members" not in r:
            continue
        total = sum(m["weights"] for m in r["members"])
        share = 1 / len(r["members"])  # equal usable memory on one machine: equal shares
        parts = []
        for m in r["members"]:
            frac = m["weights"] / total
            parts.append(f"rank {m['rank']} layers {m['layers'][0]}-{m['layers'][1] - 1}: {m['weights'] / 2**20:.1f} "
                         f"MiB = {100 * frac:.0f}% of the weights (share {100 * share:.0f}%, "
                         f"{'within' if abs(frac - share) <= 0.1 * share else 'OUTSIDE'} 10%), "
                         f"resident {m.get('rss', 0) / 2**20:.0f} MiB")
        print(f"{mode}: " + "; ".join(parts))
    if "pipeline1" in results and "pipeline2" in results:
        ratio = results["pipeline2"]["tok_s"] / results["pipeline1"]["tok_s"]
        print(f"\npipeline, 2 batches in flight vs 1: {ratio:.2f}x output tok/s (target >= 1.6x)")
        r = results["pipeline2"]
        c1, what = member_cpu(r)
        c0, c1 = r["cpu0"] / r["tokens"] * 1e3, c1 / r["tokens"] * 1e3
        print(f"  CPU per output token: rank 0 {c0:.2f} ms (its stage, the head, scheduling, sampling), rank 1 "
              f"{c1:.2f} ms (its stage; {what}); with a free core each, 2 in flight can reach "
              f"{(c0 + c1) / max(c0, c1):.2f}x of taking turns (the slower rank sets the pace)")
        waits = [x[1] / x[0] for q in ("pipeline1", "pipeline2") for x in (results[q].get("sched0"),
                                                                           results[q].get("sched1")) if x]
        if waits:
            print(f"  run-queue wait up to {100 * max(waits):.0f}% of a rank's CPU time: "
                  + ("small, the measured ratio is the engine's" if max(waits) < 0.1 else
                     "the machine's other load took the cores' idle time, the measured ratio understates "
                     "what free cores give"))
    plans = [r["plan_ms"] for r in results.values() if "plan_ms" in r]
    if plans:
        walls = [r["plan_wall_ms"] for r in results.values() if "plan_wall_ms" in r]
        print(f"plan host time per step (64 running a batch): {max(plans):.3f} ms of CPU at most, {max(walls):.3f} "
              "ms wall clock (target <= 1 ms)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="mlx-lm model directory or name (default: small, random weights)")
    ap.add_argument("--requests", type=int, default=128, help="at once: 64 run in each batch in flight")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1024, help="KV blocks (per batch in flight: half each)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=1, help="runs of each mode, alternating; medians reported")
    ap.add_argument("--no-pin", action="store_true", help="do not pin each rank to a core of its own")
    ap.add_argument("--check-cost", action="store_true", help="measure --group-check's cost instead (see above)")
    ap.add_argument("--check-every", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="one", help=argparse.SUPPRESS)
    ap.add_argument("--hosts", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--member-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global PIN
    PIN = not args.no_pin
    if args.role == "run":
        print("RESULT " + json.dumps(run(args)), flush=True)
        return 0
    from cluster.models_cache import resolve_model

    args.model = resolve_model(args.model)
    if args.check_cost:
        print(f"model {args.model}; {args.requests} requests x {args.prompt_len} prompt tokens, {args.max_tokens} "
              f"new tokens each; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        check_cost(args)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    print(f"model {args.model}; {args.requests} requests x {args.prompt_len} prompt tokens, {args.max_tokens} new "
          f"tokens each (greedy, EOS ignored); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.repeats):  # the modes alternate: a load that comes and goes hits them alike
        for mode in modes:
            t = time.perf_counter()
            runs[mode].append(run_mode(mode, args))
            print(f"  {mode}: {runs[mode][-1]['tok_s']:.1f} tok/s ({time.perf_counter() - t:.0f} s with start-up, "
                  f"load average {os.getloadavg()[0]:.1f})", flush=True)
    # each mode's median run by output tokens/s
    results = {m: sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2] for m, rs in runs.items()}
    if args.repeats > 1:
        print(f"(medians of {args.repeats} alternating runs)")
        if "pipeline1" in runs and "pipeline2" in runs:  # each pair ran back to back: the least load drift
            pairs = [b["tok_s"] / a["tok_s"] for a, b in zip(runs["pipeline1"], runs["pipeline2"])]
            print("pipeline2 / pipeline1 of each repeat (run back to back): "
                  + ", ".join(f"{x:.2f}x" for x in pairs) + f"; median {sorted(pairs)[len(pairs) // 2]:.2f}x")
    report(results, args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
