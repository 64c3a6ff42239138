"""deploy/launchd: the router and worker templates are valid property lists that launchd
can load, and once filled in, their command lines are ones `orchard` accepts."""

from __future__ import annotations

import plistlib
import re
from pathlib import Path

import pytest

from cluster.cli import build_parser

LAUNCHD = Path(__file__).resolve().parents[1] / "deploy" / "launchd"
PLISTS = sorted(LAUNCHD.glob("*.plist"))
FILLED = {"__ORCHARD__": "/Users/me/orchard/.venv/bin/orchard", "__HOME__": "/Users/me",
          "__MODEL__": "/Users/me/models/m",
          "__ROUTER__": "router-mac.local:50051", "__ADVERTISE__": "mac-2.local", "__JOIN_TOKEN__": "s3cret",
          "__GROUP_SIZE__": "3", "__RANK__": "2", "__GROUP_HOSTS__": "10.0.0.1:32323,10.0.0.2:32323,10.0.0.3:32323"}


def _fill(path: Path) -> dict:
    text = path.read_text()
    for k, v in FILLED.items():
        text = text.replace(k, v)
    assert not re.search(r"__[A-Z_]+__", text), f"{path.name}: a placeholder the README does not fill"
    return plistlib.loads(text.encode())


def test_router_and_worker_templates_exist():
    assert {p.name for p in PLISTS} == {"ai.orchard.router.plist", "ai.orchard.worker.plist",
                                        "ai.orchard.group-member.plist"}


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
    assert p["RunAtLoad"] is True and p["KeepAlive"] is True
    assert isinstance(p["ThrottleInterval"], int) and p["ThrottleInterval"] > 0
    for key in ("StandardOutPath", "StandardErrorPath", "WorkingDirectory"):
        assert p[key].startswith("/"), f"{key}: launchd does not expand ~"
    env = p["EnvironmentVariables"]
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    assert env["ORCHARD_JOIN_TOKEN"] == "s3cret"


@pytest.mark.parametrize("path", PLISTS, ids=lambda p: p.name)
def test_command_line_is_one_orchard_accepts(path):
    p = _fill(path)
    args = build_parser().parse_args(p["ProgramArguments"][1:])
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
    else:
        assert args.command == "worker" and args.worker_command == "serve"
        assert args.router == "router-mac.local:50051" and args.advertise == "mac-2.local:50061"
        assert args.model == "/Users/me/models/m" and args.metrics.endswith(":9101")
