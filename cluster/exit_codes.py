"""What an Orchard process's exit status tells whoever started it, and what a launcher
does about it: one table for every process (a worker, a group's rank 0 and its members)
and every launcher (`orchard up`, `orchard supervise` under launchd, `orchard ray up`).

| status | meaning | examples | a launcher |
| --- | --- | --- | --- |
| 78 (sysexits.h EX_CONFIG) | permanent: starting it again gives the same answer | bad flags, a model that cannot be loaded, a model whose config differs from rank 0's, a refused join (a wrong join token) | stops: not started again, the reason in its log |
| 75 (EX_TEMPFAIL) | transient | a lost group peer, a lost connection, a timeout, a busy port, a member late to join | starts it again after a backoff |
| anything else | a crash, a signal, or stopped (0) | | as 75 |

The backoff is Kubernetes' CrashLoopBackOff, shorter: `BACKOFF_FIRST_S` doubling to
`BACKOFF_CAP_S`, back to the first once a process has run `BACKOFF_RESET_S`.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_TRANSIENT = 75  # sysexits.h EX_TEMPFAIL
EXIT_PERMANENT = 78  # sysexits.h EX_CONFIG

BACKOFF_FIRST_S = 1.0
BACKOFF_CAP_S = 60.0
BACKOFF_RESET_S = 300.0  # a process that ran this long was healthy: its next failure is a first one

# Errors a process cannot get past by starting again (a ValueError is a setting or a model's file).
_PERMANENT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


class PermanentError(Exception):
    """A failure that starting the process again cannot fix (exit 78)."""


def exit_code(error: BaseException, default: int = EXIT_PERMANENT) -> int:
    """The exit status of a process ended by `error`: an error's own `permanent` attribute
    (set by whoever knows, e.g. a peer's refusal) first, then its kind; `default` for an
    error of no known kind (at start-up, a model that does not load)."""
    permanent = getattr(error, "permanent", None)
    if permanent is not None:
        return EXIT_PERMANENT if permanent else EXIT_TRANSIENT
    if isinstance(error, (PermanentError, *_PERMANENT_ERRORS)):
        return EXIT_PERMANENT
    if isinstance(error, OSError):  # ConnectionError and TimeoutError included
        return EXIT_TRANSIENT
    return default


def is_permanent(code: int | None) -> bool:
    return code == EXIT_PERMANENT


def describe(code: int | None) -> str:
    """An exit status in words, for a launcher's log line."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    if code == EXIT_PERMANENT:
        return f"exit {code}: permanent"
    if code == EXIT_TRANSIENT:
        return f"exit {code}: transient"
    return f"exit {code}"


@dataclass
class Backoff:
    """A launcher's delays before starting a process again: `first` doubling per failure
    to `cap`; a run of `reset_after` seconds or more clears the count."""

    first: float = BACKOFF_FIRST_S
    cap: float = BACKOFF_CAP_S
    reset_after: float = BACKOFF_RESET_S
    failures: int = 0

    def next_delay(self, ran_for: float) -> float:
        """The wait before the next start, after a run of `ran_for` seconds that ended."""
        if ran_for >= self.reset_after:
            self.failures = 0
        delay = min(self.cap, self.first * 2 ** min(self.failures, 30))
        self.failures += 1
        return delay
