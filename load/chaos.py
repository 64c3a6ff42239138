"""The chaos benchmark: one seeded load, once without faults and once per fault, through
the SDK against local processes (2 routers, 3 workers of one model; worker-0 is a group
of 2 processes, pipeline parallel). Nothing may be lost or changed.

    python load/chaos.py [--model DIR] [--requests 48] [--concurrency 16] [--max-tokens 128]
                         [--faults kill9-worker,sigstop-worker,...]

Each fault is injected once the load has received about a third of its tokens:

    kill9-worker    kill -9 of the worker serving most unfinished streams (restarted after)
    sigstop-worker  SIGSTOP of that worker for 20 s (a Mac asleep), then SIGCONT
    wedge-worker    its engine blocks inside a step for 20 s (a wedged engine thread)
    sigstop-member  SIGSTOP of the group's member (rank 1) for 20 s, then SIGCONT
    wedge-member    the group's member blocks inside a step for 20 s
    slow-worker     its steps take 5x as long for the rest of the run
    poison          one more request, whose prompt breaks any engine step it is part of
    kill9-router    kill -9 of the first router: the SDK carries on through the second

Greedy decoding with EOS ignored, so the no-fault run is the oracle: a stream "changed"
when its tokens differ from that run's. Per fault it prints requests sent, completed and
failed, streams changed, and the TTFT p99 against the no-fault run. Target: 0 failed and
0 changed for every fault, except the poison request itself, which alone fails with its
own error; TTFT p99 within 2x the no-fault run under a stop or a wedge (a stalled worker
or group is reported in seconds, and the router places nothing there meanwhile). The
wedge and poison faults use the test-only fault hooks (cluster/worker/faults.py, on only
with ORCHARD_FAULT_DIR). A group that loses a process is started again after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.sdk import AsyncClient, OrchardError  # noqa: E402
from cluster.up import LocalCluster, free_port  # noqa: E402
from cluster.worker.faults import POISON_MARK  # noqa: E402

FAULTS = ("kill9-worker", "sigstop-worker", "wedge-worker", "sigstop-member", "wedge-member", "slow-worker", "poison",
          "kill9-router")
GROUP = 0  # worker-0 is a group of 2; its member (rank 1) is what the member faults strike
WORDS = "apple pear plum cherry quince orchard branch root leaf blossom harvest basket ladder".split()
STOP_FOR = 20.0  # seconds a stopped or wedged worker stays so


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    ttft: float | None = None
    error: str | None = None
    worker: str = ""  # the worker of its latest chunk
    done: bool = False


def prompts(n: int, seed: int, words: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{seed}.{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


async def run_load(cluster: LocalCluster, texts: list[str], args, fault: str | None, faults_dir: Path,
                   ) -> tuple[list[Stream], Stream | None, float]:
    """The load through both routers; `fault` injected a third of the way in. Returns the
    streams, the poison request's stream (for that fault) and the seconds it all took."""
    streams = [Stream() for _ in texts]
    total = len(texts) * args.max_tokens
    received = [0]
    injected = asyncio.Event()
    semaphore = asyncio.Semaphore(args.concurrency)

    async with AsyncClient(cluster.router_addresses, timeout=600) as client:
        async def one(text: str, s: Stream) -> None:
            async with semaphore:
                t0 = time.monotonic()
                try:
                    async for chunk in client.stream(text, max_tokens=args.max_tokens, temperature=0.0,
                                                     ignore_eos=True):
                        if chunk.token_ids and s.ttft is None:
                            s.ttft = time.monotonic() - t0
                        s.tokens += chunk.token_ids
                        s.worker = chunk.worker_id or s.worker
                        received[0] += len(chunk.token_ids)
                        if fault and not injected.is_set() and received[0] >= total // 3:
                            injected.set()
                except OrchardError as e:
                    s.error = str(e)
                s.done = True

        poison = Stream() if fault == "poison" else None
        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(t, s)) for t, s in zip(texts, streams)]
        if fault:
            await injected.wait()
            if poison is not None:
                tasks.append(asyncio.create_task(one(f"{POISON_MARK} {texts[0]}", poison)))
            else:
                busiest = _busiest(streams)
                await asyncio.to_thread(inject, cluster, fault, busiest, faults_dir)
        await asyncio.gather(*tasks)
        return streams, poison, time.monotonic() - t0


def _busiest(streams: list[Stream]) -> int:
    """The index of the worker serving the most unfinished streams now."""
    counts: dict[str, int] = {}
    for s in streams:
        if not s.done and s.worker:
            counts[s.worker] = counts.get(s.worker, 0) + 1
    worker = max(counts, key=counts.get) if counts else "worker-0"
    return int(worker.rsplit("-", 1)[1])


def inject(cluster: LocalCluster, fault: str, i: int, faults_dir: Path) -> None:
    pid = cluster.workers[i].proc.pid
    worker_id = f"worker-{i}"
    member = cluster.members[GROUP][0]
    print(f"  {fault}: {worker_id if 'worker' in fault else member.name if 'member' in fault else 'router 0'}",
          flush=True)
    if fault == "sigstop-member":
        os.kill(member.proc.pid, signal.SIGSTOP)
        _after(STOP_FOR, _continue, member.proc)
    elif fault == "wedge-member":
        wedge = faults_dir / "rank1.wedge"
        wedge.touch()
        _after(STOP_FOR, wedge.unlink, missing_ok=True)
    elif fault == "kill9-worker":
        os.kill(pid, signal.SIGKILL)
    elif fault == "sigstop-worker":
        os.kill(pid, signal.SIGSTOP)
        _after(STOP_FOR, _continue, cluster.workers[i].proc)
    elif fault == "wedge-worker":
        wedge = faults_dir / f"{worker_id}.wedge"
        wedge.touch()
        _after(STOP_FOR, wedge.unlink, missing_ok=True)
    elif fault == "slow-worker":
        (faults_dir / f"{worker_id}.slow").write_text("5")
    elif fault == "kill9-router":
        os.kill(cluster.router.proc.pid, signal.SIGKILL)


TIMERS: list[threading.Timer] = []  # the ends of the stops and wedges under way


def _after(seconds: float, action, *args, **kwargs) -> None:
    timer = threading.Timer(seconds, action, args, kwargs)
    TIMERS.append(timer)
    timer.start()


def _continue(proc) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)


def restore(cluster: LocalCluster, faults_dir: Path) -> None:
    """After a fault's run (which may end before a 20 s stop is over): every process back
    (a group that lost one is started again whole, as `orchard up` does), no fault file
    left, every worker healthy again."""
    for timer in TIMERS:  # a stop or a wedge runs its course: a group may be lost at its end
        timer.join()
    TIMERS.clear()
    for f in faults_dir.iterdir():
        f.unlink()
    if cluster.router.proc.poll() is not None:
        cluster.start_router(0)
    settled = time.monotonic() + 2  # a group's survivors exit on their own once they see it lost
    while time.monotonic() < settled or cluster.restart_at or _ended(cluster):
        cluster.supervise()
        time.sleep(0.5)
    cluster.wait_ready(300)


def _ended(cluster: LocalCluster) -> bool:
    return any(c.proc.poll() is not None for i in range(len(cluster.workers)) for c in cluster.group_processes(i))


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model directory (default: a tiny random qwen3)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=120, help="words per prompt (~200 tokens)")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, from: " + ", ".join(FAULTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        ap.error(f"unknown faults: {', '.join(sorted(unknown))}")

    work = Path(tempfile.mkdtemp(prefix="orchard-chaos-"))
    model = args.model
    if model is None:
        from cluster.modelgen import create_model

        model = create_model(work / "tiny-qwen3", "qwen3", "tiny", seed=args.seed)
    faults_dir = work / "faults"
    faults_dir.mkdir()
    cluster = LocalCluster(
        model, workers=3, group_size=[2, 1, 1], routers=2, grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
        metrics_address=f"127.0.0.1:{free_port()}", worker_port_base=0, worker_metrics_port_base=0,
        log_dir=work / "logs", worker_env={"ORCHARD_FAULT_DIR": str(faults_dir)},
        router_args=["--heartbeat-interval", "0.5", "--stream-idle-timeout", "10", "--max-attempts", "6"],
        worker_args=["--num-kv-blocks", "2048", "--heartbeat-interval", "0.5",
                     "--no-prefix-caching"],  # every run does the same work: the same prompts are sent in each
    )
    texts = prompts(args.requests, args.seed, args.prompt_words)
    rows = []
    with cluster:
        print(f"2 routers, 3 workers, worker-0 a group of 2 ({model}); logs in {work / 'logs'}", flush=True)
        asyncio.run(run_load(cluster, prompts(args.requests, args.seed + 1, args.prompt_words), args, None,
                             faults_dir))  # warm-up: the first burst pays for first-time work
        base, _, took = asyncio.run(run_load(cluster, texts, args, None, faults_dir))
        lost = sum(s.error is not None for s in base)
        print(f"no fault: {len(base)} requests in {took:.1f} s, {lost} failed", flush=True)
        if lost:
            print("the run without faults failed requests: no oracle to compare with", file=sys.stderr)
            return 1
        base_ttft = p99([s.ttft for s in base])
        rows.append(("none", len(base), len(base), 0, 0, base_ttft, took, ""))
        for fault in faults:
            streams, poison, took = asyncio.run(run_load(cluster, texts, args, fault, faults_dir))
            failed = [s for s in streams if s.error is not None]
            changed = sum(s.tokens != b.tokens for s, b in zip(streams, base) if s.error is None)
            sent = len(streams) + (poison is not None)
            note = ""
            if poison is not None:
                note = f"poison: {poison.error or 'NOT FAILED'}"
            elif failed:
                note = failed[0].error
            rows.append((fault, sent, len(streams) - len(failed), len(failed) + (poison is not None and
                         poison.error is not None), changed, p99([s.ttft for s in streams if s.ttft]), took, note))
            print(f"{fault}: done in {took:.1f} s", flush=True)
            restore(cluster, faults_dir)

    print()
    print(f"{'fault':<16}{'sent':>6}{'completed':>11}{'failed':>8}{'changed':>9}{'TTFT p99':>11}{'vs none':>9}"
          f"{'run s':>8}  note")
    ok = True
    for fault, sent, completed, failed, changed, ttft, took, note in rows:
        expected_failed = 1 if fault == "poison" else 0
        ok &= failed == expected_failed and changed == 0 and completed == args.requests
        if fault == "poison":
            ok &= "2 workers" in note
        print(f"{fault:<16}{sent:>6}{completed:>11}{failed:>8}{changed:>9}{ttft * 1000:>9.0f}ms"
              f"{ttft / base_ttft:>8.2f}x{took:>8.1f}  {note[:90]}")
    print("\nnothing lost or changed" if ok else "\nFAILED: a fault lost or changed a stream", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
