"""A serving benchmark against an Orchard router or worker (gRPC or OpenAI HTTP).

    python load/bench_serve.py --target 127.0.0.1:50051 --num-prompts 200 --request-rate 8

The same as `orchard bench`; the logic lives in `cluster/bench/serve.py` (`--help` there).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.bench.serve import build_parser, main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
