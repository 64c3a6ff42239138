"""`orchard deploy prometheus-targets`: the file-based discovery files that
deploy/prometheus/prometheus.yml reads (targets/router.json, targets/workers.json).

Each file is Prometheus's file_sd format: a JSON list of {"targets": [...], "labels": {...}}.
Prometheus re-reads them when they change, so adding a worker is: regenerate, done.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _target(address: str) -> str:
    """HOST:PORT (a URL's scheme and /metrics path are dropped: Prometheus adds its own)."""
    a = address.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return a


def file_sd(addresses: list[str], role: str) -> list[dict]:
    return [{"targets": [_target(a) for a in addresses], "labels": {"orchard_role": role}}] if addresses else []


def write_prometheus_targets(out_dir: str | os.PathLike, router: list[str], workers: list[str]) -> list[Path]:
    """Write router.json and workers.json into `out_dir` (atomically: Prometheus may be reading)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, addresses, role in (("router.json", router, "router"), ("workers.json", workers, "worker")):
        path = out / name
        tmp = path.with_name(f".{name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(file_sd(addresses, role), indent=2) + "\n")
        tmp.replace(path)
        written.append(path)
    return written


def run_prometheus_targets(args) -> int:
    try:
        paths = write_prometheus_targets(args.out, args.router or [], args.worker or [])
    except ValueError as e:
        print(f"orchard deploy prometheus-targets: {e}")
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel of a Grafana dashboard, rows' nested panels included (rows themselves too)."""
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out += dashboard_panels(p) if p.get("type") == "row" else []
    return out


def dashboard_queries(dashboard: dict, substitutions: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) for every query of every panel, with Grafana variables
    replaced (e.g. {"$__rate_interval": "5s", "$model": ".*"}), longest names first."""
    subs = sorted((substitutions or {}).items(), key=lambda kv: -len(kv[0]))
    out = []
    for p in dashboard_panels(dashboard):
        for t in p.get("targets", []):
            expr = t.get("expr", "")
            for name, value in subs:
                expr = expr.replace("${" + name.lstrip("$") + "}", value).replace(name, value)
            out.append((p.get("title", ""), t.get("refId", ""), expr))
    return out
