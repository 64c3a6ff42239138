"""The model-file fuzzer (load/fuzz_models.py): mutated GGUF files and Ollama manifests, each
imported by `orchard model import` in a process of its own under a memory limit. No
traceback, no bad tensor table imported, no blob from outside blobs/, nothing written outside
the target; each within 10 CPU seconds (the wall-clock limit, for hangs, is loose here: a
loaded 2-core machine). The full run (2,000 files and 200 manifests) is a bench test: `-m bench`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def fuzz(*args: str, timeout: float) -> tuple[dict, str, int]:
    out = subprocess.run([sys.executable, str(ROOT / "load" / "fuzz_models.py"), *args],
                         capture_output=True, text=True, timeout=timeout)
    figures = dict(line.split(": ", 1) for line in out.stdout.splitlines() if re.match(r"^[a-z ]+: ", line))
    return figures, out.stdout[-6000:] + out.stderr[-3000:], out.returncode


def check(figures: dict, text: str, code: int, gguf: int, manifests: int) -> None:
    assert figures.get("gguf runs") == str(gguf + 1) and figures.get("manifest runs") == str(manifests), text
    for name in ("tracebacks", "timeouts", "killed by a signal", "bad imports", "written outside the target",
                 "failures"):
        assert figures[name] == "0", text
    assert int(figures["gguf imported"]) >= 1 and int(figures["gguf refused"]) > gguf // 2, text  # it did both
    assert int(figures["manifest imported"]) >= 1 and int(figures["manifest refused"]) >= 1, text
    assert code == 0 and "\nPASS" in text, text


def test_sixty_mutated_files_and_twenty_manifests_import_or_are_refused_cleanly():
    figures, text, code = fuzz("--gguf", "60", "--manifests", "20", "--seed", "3", "--wall-timeout", "300",
                               timeout=1500)
    check(figures, text, code, 60, 20)


@pytest.mark.bench  # 2,200 imports, each a process: the full run, by hand (CI runs the bounded one above)
def test_the_full_model_file_fuzz():
    jobs = str(max(2, (os.cpu_count() or 2)))
    figures, text, code = fuzz("--gguf", "2000", "--manifests", "200", "--jobs", jobs, timeout=4 * 3600)
    check(figures, text, code, 2000, 200)
