"""The house's sizes that issue 39 set, kept: no function in `cluster/` over 80 lines
(generated protobuf aside), and the worker's service and engine each under 450 lines, so
a reader sees a step or a request's path in one screenful of calls."""

from __future__ import annotations

import ast
from pathlib import Path

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = {"worker/service.py": 450, "worker/engine.py": 450}


def _long_functions() -> list[str]:
    found = []
    for path in sorted(CLUSTER.rglob("*.py")):
        if "proto" in path.relative_to(CLUSTER).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(CLUSTER)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_is_over_80_lines():
    assert _long_functions() == []


def test_the_service_and_the_engine_stay_small():
    sizes = {name: len((CLUSTER / name).read_text().splitlines()) for name in MAX_FILE_LINES}
    assert all(sizes[name] < limit for name, limit in MAX_FILE_LINES.items()), sizes
