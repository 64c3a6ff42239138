"""`orchard node serve ARGS` for the tests; where `cluster.fleet.facts` has not landed yet, a
stand-in that lists the models under --models-dir by name (facts are helper B's part)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

try:
    from cluster.fleet import facts  # noqa: F401
except ImportError:
    import cluster.fleet
    from cluster.proto.orchard.v1 import orchard_pb2 as pb

    def is_model(path: Path) -> bool:
        return (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf")

    def scan(models_dir, platform: str) -> list:
        models_dir = Path(models_dir)
        if not models_dir.is_dir():
            return []
        return [pb.DiskModel(name=p.name) for p in sorted(models_dir.iterdir()) if is_model(p)]

    stand_in = types.ModuleType("cluster.fleet.facts")
    stand_in.is_model, stand_in.scan = is_model, scan
    sys.modules["cluster.fleet.facts"] = cluster.fleet.facts = stand_in

from cluster.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["node", "serve", *sys.argv[1:]]))
