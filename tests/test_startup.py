"""Start-up without OpenBLAS: bounded, and only the processes that run MLX load it.

`orchard --help`, the router, `orchard generate` and `orchard bench` import neither MLX
nor OpenBLAS (the CLI imports a command's module when that command runs); finding
OpenBLAS never walks a directory tree (issue 26: a recursive glob of /usr/lib ran for
over 10 minutes on one machine). OpenBLAS is loaded by an explicit `preload_blas()` at
each entry point, before MLX is imported; importing a module never loads it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster import platform
from cluster.up import free_port

ROOT = Path(__file__).resolve().parent.parent
UNFINDABLE = {**os.environ, "ORCHARD_OPENBLAS": "/nonexistent/libopenblas.so.0", "PYTHONPATH": str(ROOT)}
PROBE = ("import sys\nfrom cluster.cli import build_parser\n"
         "args = build_parser(sys.argv[1:]).parse_args(sys.argv[1:])\n"
         "maps = open('/proc/self/maps').read() if sys.platform.startswith('linux') else ''\n"
         "print('mlx' in sys.modules, 'cluster.worker' in sys.modules, 'openblas' in maps)")


def test_help_is_quick_and_loads_neither_mlx_nor_openblas():
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "--help"], capture_output=True, text=True,
                         env=UNFINDABLE, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 0 and "worker" in out.stdout and "router" in out.stdout, out.stderr
    assert took < 30, took  # ~0.1 s here; a loaded CI machine gets room, a directory walk does not fit
    for argv in (["--help"], ["router", "workers"], ["generate", "hi"], ["bench"], ["router", "serve"]):
        if argv == ["--help"]:
            argv = ["router", "--help"]
        probe = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                               env=UNFINDABLE, timeout=60)
        if "--help" not in argv:
            assert probe.returncode == 0, (argv, probe.stderr)
            assert probe.stdout.split() == ["False", "False", "False"], argv


def test_worker_commands_still_get_their_flags():
    """The lazy tree gives a chosen command its flags: `worker serve` parses --model."""
    from cluster.cli import build_parser

    args = build_parser(["worker", "serve", "--model", "m"]).parse_args(["worker", "serve", "--model", "m"])
    assert args.model == "m" and callable(args.func)
    every = build_parser()  # None: every command built (docs, the launchd tests)
    assert every.parse_args(["up", "--workers", "3"]).workers == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/maps")
@pytest.mark.parametrize("env", [UNFINDABLE, {**os.environ, "PYTHONPATH": str(ROOT)}], ids=["unfindable", "findable"])
def test_a_router_starts_and_maps_neither_openblas_nor_mlx(tmp_path, env):
    ports = [free_port() for _ in range(3)]
    argv = [sys.executable, "-m", "cluster.cli", "router", "serve", "--grpc", f"127.0.0.1:{ports[0]}",
            "--http", f"127.0.0.1:{ports[1]}", "--metrics", f"127.0.0.1:{ports[2]}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=tmp_path)
    watchdog = threading.Timer(90, proc.kill)  # a hang fails the test instead of stalling it
    watchdog.start()
    try:
        seen = []
        for line in proc.stdout:  # the router prints its addresses once it serves
            seen.append(line)
            if line.startswith("orchard router: grpc="):
                break
        took = time.monotonic() - t0
        assert seen and seen[-1].startswith("orchard router: grpc="), "".join(seen)
        assert took < 60, took
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "openblas" not in maps and "/mlx/" not in maps
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_finding_openblas_never_walks_a_tree(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    deep = lib / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "libopenblas.so.0").write_bytes(b"")  # only a recursive walk finds this one
    monkeypatch.delenv("ORCHARD_OPENBLAS", raising=False)
    monkeypatch.setattr(platform, "OPENBLAS_DIRS", (str(lib),))
    monkeypatch.setattr(platform, "_ldconfig_openblas", lambda: [])
    assert platform.find_openblas() is None
    for sub in ("openblas-pthread", "openblas-openmp"):
        (lib / sub).mkdir()
        (lib / sub / "libopenblas.so.0").write_bytes(b"")
    assert platform.find_openblas() == str(lib / "openblas-openmp" / "libopenblas.so.0")  # the OpenMP build first
    monkeypatch.setattr(platform, "OPENBLAS_DIRS", (str(tmp_path / "none"),))
    monkeypatch.setattr(platform, "_ldconfig_openblas", lambda: ["/from/the/cache/libopenblas.so.0"])
    assert platform.find_openblas() == "/from/the/cache/libopenblas.so.0"  # the loader's cache, last
    monkeypatch.setenv("ORCHARD_OPENBLAS", str(tmp_path / "missing.so"))
    assert platform.find_openblas() is None  # an explicit path is the only place looked


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is preloaded on Linux only")
def test_a_worker_without_openblas_says_where_it_looked(caplog):
    code = ("import logging\nfrom cluster import platform\nlogging.basicConfig()\nplatform.preload_blas()\n"
            "platform.warn_if_slow_blas()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=UNFINDABLE, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "OpenBLAS is not loaded (looked in ORCHARD_OPENBLAS=/nonexistent/libopenblas.so.0" in out.stderr
    assert "apt-get install libopenblas0-openmp" in out.stderr


LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is preloaded on Linux only")
MAPS_PROBE = "maps = open('/proc/self/maps').read()\nprint('openblas' in maps, 'mlx.core' in sys.modules)"


@LINUX_ONLY
def test_importing_the_worker_package_loads_neither_openblas_nor_mlx():
    code = "import sys, cluster.worker, cluster.worker.config\n" + MAPS_PROBE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


@LINUX_ONLY
def test_the_cli_loads_openblas_before_mlx_for_the_commands_that_run_mlx():
    if platform.find_openblas() is None:
        pytest.skip("no OpenBLAS on this machine")
    for command, loaded in ((["run"], "True"), (["worker", "serve"], "True"), (["router", "serve"], "False")):
        code = ("import sys\nfrom cluster import cli\ntry:\n    cli.main([*sys.argv[1:], '--help'])\n"
                "except SystemExit:\n    pass\n" + MAPS_PROBE)
        out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, cwd=ROOT,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1].split() == [loaded, "False"], command


@LINUX_ONLY
def test_a_worker_process_has_openblas_which_is_refused_once_mlx_is_imported(tiny_worker):
    """OpenBLAS in a serving worker's memory proves it was loaded before MLX: once MLX is
    imported, `preload_blas` does not load it (MLX has bound its own BLAS) and says so."""
    if platform.find_openblas() is None:
        pytest.skip("no OpenBLAS on this machine")
    assert "openblas" in Path(f"/proc/{tiny_worker.proc.pid}/maps").read_text()
    code = ("import logging, sys\nlogging.basicConfig()\nimport mlx.core\nfrom cluster import platform\n"
            "print(platform.preload_blas())\n" + MAPS_PROBE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "False", "True"]
    assert "mlx was imported before preload_blas" in out.stderr


def test_no_module_imports_the_worker_package_for_a_side_effect():
    """OpenBLAS is loaded by calling `platform.preload_blas()`; a bare `import cluster.worker`
    does nothing, and would mislead a reader into thinking it does."""
    bare = re.compile(r"^\s*import cluster\.worker\s*(#.*)?$", re.M)
    found = [str(p.relative_to(ROOT)) for d in ("cluster", "tests", "load") for p in (ROOT / d).rglob("*.py")
             if bare.search(p.read_text())]
    assert found == []
