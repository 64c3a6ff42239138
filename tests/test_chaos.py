"""Every fault of the chaos benchmark with real processes (2 routers, 3 workers, one a
group of 2), on a small load: nothing lost, nothing changed against the run without faults, the poison
request alone failed with its own error. (load/chaos.py with its full load is the
benchmark; this is its smallest honest run.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_no_fault_loses_or_changes_a_stream(tiny_model_dir):
    out = subprocess.run(
        [sys.executable, str(ROOT / "load" / "chaos.py"), "--model", str(tiny_model_dir), "--requests", "16",
         "--concurrency", "8", "--max-tokens", "64", "--prompt-words", "60"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in ("none", "kill9-worker", "sigstop-worker", "wedge-worker",
                                                    "sigstop-member", "wedge-member", "slow-worker", "poison",
                                                    "kill9-router")}
    assert len(rows) == 9, out.stdout
    for fault, cols in rows.items():
        sent, completed, failed, changed = map(int, cols[1:5])
        assert (completed, changed) == (16, 0), (fault, cols)
        assert failed == (1 if fault == "poison" else 0), (fault, cols)
    assert "the request failed on 2 workers" in out.stdout
    assert "nothing lost or changed" in out.stdout
