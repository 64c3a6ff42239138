"""`orchard supervise COMMAND...`: run one orchard command (`worker serve ...`) and start it
again when it ends, as `cluster/exit_codes.py` says: after a backoff for anything but a
permanent failure, never after one (78). launchd cannot tell 75 from 78 by itself, so the
launchd templates run their worker under this: on a permanent failure it logs why and
exits 0, and `KeepAlive {SuccessfulExit: false}` leaves the job stopped; if it dies
itself, launchd starts it again. SIGTERM and SIGINT go to the command, and supervise ends
when it has.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from cluster.exit_codes import Backoff, describe, is_permanent


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cluster", *argv])


def _log(line: str) -> None:
    print(f"orchard supervise: {line}", file=sys.stderr, flush=True)


def restart_delay(code: int | None, ran_for: float, backoff: Backoff) -> float | None:
    """How long to wait before starting again a process that ended with `code` after
    `ran_for` seconds; None: never (a permanent failure). Every launcher that restarts
    Orchard processes by this rule (`orchard supervise`, the node agent) asks here."""
    if is_permanent(code):
        return None
    return backoff.next_delay(ran_for)


def supervise(argv: list[str], *, spawn: Callable[[list[str]], subprocess.Popen] = _spawn,
              backoff: Backoff | None = None, clock: Callable[[], float] = time.monotonic,
              stop: threading.Event | None = None, log: Callable[[str], None] = _log) -> int:
    """Run `orchard ARGV` until it fails for good or `stop` is set (by SIGTERM / SIGINT when
    `stop` is not given); returns 0 then. `spawn`, `clock` and `stop.wait` (the backoff's
    sleep) are what a test replaces."""
    backoff = backoff or Backoff()
    running: list[subprocess.Popen] = []  # the command now, for the signal handler
    if stop is None:
        stop = threading.Event()
        _on_signals(stop, running)
    name = " ".join(argv[:2])
    while not stop.is_set():
        started = clock()
        running[:] = [spawn(argv)]
        if stop.is_set():  # a signal between the check and the start
            running[0].terminate()
        code = running[0].wait()
        if stop.is_set():
            break
        delay = restart_delay(code, clock() - started, backoff)
        if delay is None:
            log(f"{name} exited ({describe(code)}): not started again; its log says why. Fix that, then start "
                "the job again (launchctl kickstart)")
            return 0
        log(f"{name} exited ({describe(code)}): starting it again in {delay:g} s")
        stop.wait(delay)
    return 0


def _on_signals(stop: threading.Event, running: list[subprocess.Popen]) -> None:
    def on_signal(signum, frame):
        stop.set()
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def run_supervise(args) -> int:
    """`orchard supervise`: the command is everything after it (`worker serve ...`)."""
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("orchard supervise: name the command to run, e.g. orchard supervise worker serve --model M",
              file=sys.stderr)
        return 2
    return supervise(argv)
