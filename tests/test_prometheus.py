"""The dashboards against the real thing: Prometheus (deploy/prometheus/prometheus.yml, at
a 1 s scrape interval) scrapes a live router and 2 workers under load from `orchard bench`;
every PromQL expression of every panel must return a non-empty result with a number in
it through Prometheus's HTTP API.

Needs the `prometheus` binary (scripts/setup installs Debian's package on Linux as root).
Without it the test is skipped, except under CI=true, where it fails.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from cluster.deploy_tools import dashboard_queries, write_prometheus_targets
from cluster.up import LocalCluster, free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCRAPE = "1s"
# Grafana's $__rate_interval is max(4 x scrape interval, step + scrape interval): 4 s at a
# 1 s scrape; 5 s leaves room for a late scrape.
SUBSTITUTIONS = {"$__rate_interval": "5s", "$model": ".*", "$worker": ".*"}


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is not installed: scripts/setup installs it (apt-get install prometheus)")
        pytest.skip("prometheus is not installed (apt-get install prometheus, or run scripts/setup as root)")
    return path


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _query(base: str, expr: str) -> list[dict]:
    body = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", body
    return body["data"]["result"]


def _has_number(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


class Prometheus:
    def __init__(self, binary: str, workdir: Path, router_metrics: str, worker_metrics: list[str]):
        cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        cfg["global"].update(scrape_interval=SCRAPE, scrape_timeout=SCRAPE, evaluation_interval=SCRAPE)
        for job in cfg["scrape_configs"]:
            for sd in job.get("file_sd_configs", []):
                sd["refresh_interval"] = "1s"
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        write_prometheus_targets(workdir / "targets", [router_metrics], worker_metrics)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.workdir = workdir

    def wait_targets_up(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.workdir / "prometheus.log").read_text()[-2000:]
            try:
                active = _get(f"{self.base}/api/v1/targets")["data"]["activeTargets"]
                last = [(t["labels"].get("job"), t["health"], t.get("lastError")) for t in active]
                if sum(t["health"] == "up" for t in active) >= n:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"Prometheus targets not up: {last}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def test_every_panel_query_returns_data(prometheus_bin, tiny_model_dir, tmp_path):
    cluster = LocalCluster(
        tiny_model_dir, workers=2, grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
        metrics_address=f"127.0.0.1:{free_port()}", worker_port_base=0, worker_metrics_port_base=0,
        log_dir=tmp_path / "logs", worker_args=["--num-kv-blocks", "256", "--max-model-len", "512"],
    )
    prom = None
    load_thread = None
    try:
        cluster.start(timeout=120)
        prom = Prometheus(prometheus_bin, tmp_path, cluster.metrics_address, cluster.worker_metrics)
        prom.wait_targets_up(3)

        # Load for ~15 s (bounded by count and rate): shared prefixes (prefix-cache
        # hits), exact output lengths.
        from cluster.bench.serve import build_parser, main

        args = build_parser().parse_args([
            "--target", cluster.router_address, "--tokenizer", str(tiny_model_dir), "--dataset", "prefix-repetition",
            "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "16",
            "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", "24", "--num-prompts", "120",
            "--request-rate", "8", "--max-concurrency", "8", "--ignore-eos", "--disable-tqdm", "--timeout", "60",
            "--result-file", str(tmp_path / "bench.json"),
        ])
        load_done = threading.Event()
        load_thread = threading.Thread(target=lambda: (main(args), load_done.set()), daemon=True)
        load_thread.start()
        time.sleep(6)  # a few scrapes with load, so every rate window has two samples

        queries = []
        for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
            queries += [(path.name, *q) for q in dashboard_queries(json.loads(path.read_text()), SUBSTITUTIONS)
                        if "orchard_fleet_" not in q[2]]  # no catalog here: test_fleet_e2e checks the fleet's
        assert len(queries) > 30
        pending = {(name, title, ref): expr for name, title, ref, expr in queries}
        results = {}
        deadline = time.monotonic() + 30
        while pending and time.monotonic() < deadline and not load_done.is_set():
            for key, expr in list(pending.items()):
                results[key] = _query(prom.base, expr)
                if _has_number(results[key]):
                    del pending[key]
            if pending:
                time.sleep(1)
        assert not pending, "queries without data:\n" + "\n".join(
            f"  {k}: {e}\n    -> {results.get(k)}" for k, e in pending.items())

        # the dashboards' variables resolve too
        for label in ("model", "worker"):
            values = _get(f"{prom.base}/api/v1/label/{label}/values?match[]=orchard_kv_cache_blocks_total")["data"]
            assert values, label
        workers = _get(f"{prom.base}/api/v1/label/worker/values?match[]=orchard_kv_cache_blocks_total")["data"]
        assert set(workers) == {"worker-0", "worker-1"}
    finally:
        if load_thread is not None:
            load_thread.join(timeout=90)
        if prom is not None:
            prom.stop()
        cluster.stop()
    assert not load_thread.is_alive()
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["failed"] == 0 and bench["completed"] == 120
