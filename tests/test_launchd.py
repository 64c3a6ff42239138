"""deploy/launchd: the router and worker templates are valid property lists that launchd
can load, and once filled in, their command lines are ones `orchard` accepts."""

from __future__ import annotations

import plistlib
import re
from pathlib import Path

import pytest

from cluster.cli import build_parser
from cluster.worker.config import WorkerOptions

LAUNCHD = Path(__file__).resolve().parents[1] / "deploy" / "launchd"
PLISTS = sorted(LAUNCHD.glob("*.plist"))
FILLED = {"__ORCHARD__": "/Users/me/orchard/.venv/bin/orchard", "__HOME__": "/Users/me",
          "__MODEL__": "/Users/me/models/m",
          "__ROUTER__": "router-mac.local:50051", "__ADVERTISE__": "mac-2.local", "__JOIN_TOKEN__": "s3cret",
          "__GROUP_SIZE__": "3", "__RANK__": "2", "__GROUP_HOSTS__": "10.0.0.1:32323,10.0.0.2:32323,10.0.0.3:32323",
          "__MEMORY_BUDGET__": "48GiB"}


def _fill(path: Path) -> dict:
    text = path.read_text()
    for k, v in FILLED.items():
        text = text.replace(k, v)
    assert not re.search(r"__[A-Z_]+__", text), f"{path.name}: a placeholder the README does not fill"
    return plistlib.loads(text.encode())


def test_router_and_worker_templates_exist():
    assert {p.name for p in PLISTS} == {"ai.orchard.router.plist", "ai.orchard.worker.plist",
                                        "ai.orchard.group-member.plist", "ai.orchard.node.plist"}


@pytest.mark.parametrize("path", PLISTS, ids=lambda p: p.name)
def test_template_is_a_valid_launchd_plist(path):
    with open(path, "rb") as f:
        raw = plistlib.load(f)  # the template itself parses: placeholders sit inside strings
    assert raw["Label"] == path.stem
    for placeholder in re.findall(r"__[A-Z_]+__", path.read_text()):
        assert placeholder in FILLED, f"{placeholder} is not documented"
        assert placeholder in path.read_text().split("-->")[0], f"{placeholder}: explain it in the header comment"
    p = _fill(path)
    assert isinstance(p["ProgramArguments"], list) and all(isinstance(a, str) for a in p["ProgramArguments"])
    assert p["ProgramArguments"][0].startswith("/"), "launchd needs an absolute path to the program"
    assert p["RunAtLoad"] is True
    if "router" in path.name:
        assert p["KeepAlive"] is True
    else:  # a worker runs under `orchard supervise`, which exits 0 only where it must stay stopped
        assert p["ProgramArguments"][1] == "supervise" and p["KeepAlive"] == {"SuccessfulExit": False}
        assert p["ExitTimeOut"] > WorkerOptions.grace_seconds, "SIGTERM drains before launchd's SIGKILL"
    assert isinstance(p["ThrottleInterval"], int) and p["ThrottleInterval"] > 0
    for key in ("StandardOutPath", "StandardErrorPath", "WorkingDirectory"):
        assert p[key].startswith("/"), f"{key}: launchd does not expand ~"
    env = p["EnvironmentVariables"]
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    assert env["ORCHARD_JOIN_TOKEN"] == "s3cret"


def _command(plist: dict) -> list[str]:
    """The orchard command a job runs (under `orchard supervise`: the command it supervises)."""
    args = plist["ProgramArguments"][1:]
    if args[0] == "supervise":
        supervised = build_parser(args).parse_args(args).argv
        assert supervised == args[1:]
        return supervised
    return args


def _launchd_restarts(plist: dict, code: int) -> bool:
    """Whether launchd starts the job again after its program exits with `code`."""
    keep = plist["KeepAlive"]
    return keep is True or (isinstance(keep, dict) and keep.get("SuccessfulExit") is False and code != 0)


@pytest.mark.parametrize("name", ["ai.orchard.worker.plist", "ai.orchard.group-member.plist",
                                  "ai.orchard.node.plist"])
def test_a_permanent_failure_stops_the_job_and_a_transient_one_backs_off(name):
    """launchd cannot tell 75 from 78: under the template, a worker exiting 75 is started
    again by `orchard supervise` after growing delays, and one exiting 78 makes supervise
    exit 0, which the template's KeepAlive does not restart (it was restarted for ever)."""
    import threading

    from cluster.exit_codes import Backoff
    from cluster.supervise import supervise

    plist = _fill(LAUNCHD / name)
    codes, runs, delays, lines = iter([75, 75, 75, 75, 78]), [], [], []
    now = [0.0]

    class Stop(threading.Event):
        def wait(self, timeout=None):  # the backoff's sleep, on a clock the test moves
            delays.append(timeout)
            now[0] += timeout
            return False

    class Proc:
        def __init__(self, argv):
            runs.append(argv)
            self.code = next(codes)

        def wait(self):
            now[0] += 2  # each run lasts 2 s
            return self.code

    code = supervise(_command(plist), spawn=Proc, backoff=Backoff(first=1, cap=60, reset_after=300),
                     clock=lambda: now[0], stop=Stop(), log=lines.append)
    assert delays == [1, 2, 4, 8] and len(runs) == 5 and runs[0] == _command(plist)
    assert "exit 75: transient): starting it again in 8 s" in lines[3]
    assert "exit 78: permanent): not started again" in lines[4]
    assert code == 0 and not _launchd_restarts(plist, code), "launchd leaves a permanent failure stopped"
    assert _launchd_restarts(plist, -9), "supervise itself killed: launchd starts it again"


def test_orchard_supervise_stops_on_a_permanent_failure(tmp_path):
    """For real: a worker command line that cannot be parsed exits 78 and is run once."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "supervise", "worker", "serve", "--max-num-seqs",
                           "many"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("invalid int value") == 1, proc.stderr
    assert "orchard supervise: worker serve exited (exit 78: permanent): not started again" in proc.stderr


@pytest.mark.parametrize("path", PLISTS, ids=lambda p: p.name)
def test_command_line_is_one_orchard_accepts(path, monkeypatch):
    p = _fill(path)
    for name, value in p.get("EnvironmentVariables", {}).items():  # what launchd gives it (the join token)
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(_command(p))
    if "router" in path.name:
        assert args.command == "router" and args.router_command == "serve"
        assert args.grpc.endswith(":50051") and args.metrics.endswith(":9100")
    elif "group-member" in path.name:
        from cluster.config import from_args
        from cluster.worker.config import WorkerOptions
        from cluster.worker.group.config import topology

        assert args.command == "worker" and args.worker_command == "serve"
        options = from_args(WorkerOptions, args)
        t = topology(options.group, environ={})
        assert options.group.size == 3 and t.rank == 2 and t.control == ("10.0.0.1", 33323)
        assert not options.router, "a member serves nothing itself: rank 0 registers for the group"
    elif "node" in path.name:
        from cluster.config import from_args
        from cluster.fleet.node_config import NodeConfig

        assert args.command == "node" and args.node_command == "serve"
        config = from_args(NodeConfig, args)
        config.validate()
        assert config.router == "router-mac.local:50051" and config.advertise == "mac-2.local"
        assert config.memory_budget == 48 << 30 and config.models_dir == "/Users/me/models"
        assert p["ExitTimeOut"] > config.stop_grace, "the agent's workers get their grace before launchd's SIGKILL"
    else:
        assert args.command == "worker" and args.worker_command == "serve"
        assert args.router == "router-mac.local:50051" and args.advertise == "mac-2.local:50061"
        assert args.model == "/Users/me/models/m" and args.metrics.endswith(":9101")


def test_orchard_supervise_passes_sigterm_on_and_ends_with_its_command():
    """launchctl bootout sends SIGTERM to supervise: the command gets it, drains, and
    supervise ends with it instead of starting it again."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    from cluster.up import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "supervise", "router", "serve", "--grpc",
                             f"127.0.0.1:{port}", "--http", "off", "--metrics", "off"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            raise TimeoutError("the supervised router did not listen")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "starting it again" not in err, err
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, "the router is still listening"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
