"""The committed generated code in cluster/proto matches protos/ byte for byte."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("orchard/v1/orchard_pb2.py", "orchard/v1/orchard_pb2.pyi", "orchard/v1/orchard_pb2_grpc.py")


def test_generated_code_matches_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "gen_protos"), str(tmp_path)], check=True, env=env, cwd=ROOT)
    stale = [name for name in GENERATED
             if (tmp_path / name).read_bytes() != (ROOT / "cluster" / "proto" / name).read_bytes()]
    assert not stale, f"{stale} differ from protos/: run `scripts/gen_protos` and commit the result"


def test_generated_code_imports():
    from cluster.proto.orchard.v1 import orchard_pb2, orchard_pb2_grpc

    assert orchard_pb2.GenerateRequest(text="hi").WhichOneof("prompt") == "text"
    assert hasattr(orchard_pb2_grpc, "GenerationStub") and hasattr(orchard_pb2_grpc, "WorkerAdminStub")
