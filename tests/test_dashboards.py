"""deploy/: Grafana dashboards carry what Grafana needs to import them and only use
contract metric names; provisioning and Prometheus config are well-formed.
(The live check, every panel's PromQL against a real Prometheus, is test_prometheus.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.deploy_tools import dashboard_panels, dashboard_queries, file_sd, write_prometheus_targets

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))

# The metric contract (the README's Metrics section); histograms add suffixes.
WORKER_METRICS = {
    "orchard_time_to_first_token_seconds", "orchard_inter_token_latency_seconds",
    "orchard_e2e_request_latency_seconds", "orchard_request_queue_time_seconds", "orchard_kv_cache_usage_ratio",
    "orchard_kv_cache_blocks_total", "orchard_num_requests_running", "orchard_num_requests_waiting",
    "orchard_prompt_tokens_total", "orchard_generation_tokens_total", "orchard_num_preemptions_total",
    "orchard_prefix_cache_queries_total", "orchard_prefix_cache_hits_total", "orchard_request_success_total",
    "orchard_engine_stalls_total", "orchard_step_kv_cache_usage_ratio",
    "orchard_state_slots_used", "orchard_state_slots_total",  # a hybrid model's recurrent-state slots
    # the prefix cache's tiers, and the disk tier's (--kv-disk-dir)
    "orchard_kv_cache_hit_tokens_total", "orchard_kv_disk_enabled", "orchard_kv_disk_usage_bytes",
    "orchard_kv_disk_budget_bytes", "orchard_kv_disk_bytes_written_total", "orchard_kv_disk_blocks_written_total",
    "orchard_kv_disk_bytes_read_total", "orchard_kv_disk_evictions_total", "orchard_kv_disk_blocks_dropped_total",
    "orchard_kv_disk_errors_total", "orchard_kv_disk_read_seconds", "orchard_kv_disk_write_queue_bytes",
    "orchard_num_requests_loading",
    # speculative decoding's (vLLM's names)
    "orchard_spec_decode_num_drafts_total", "orchard_spec_decode_num_draft_tokens_total",
    "orchard_spec_decode_num_accepted_tokens_total", "orchard_spec_decode_num_accepted_tokens_per_pos_total",
    # a worker group's (rank 0 reports them)
    "orchard_group_size", "orchard_group_steps_total", "orchard_group_collective_seconds_total",
    "orchard_group_wait_seconds_total", "orchard_group_plan_seconds_total", "orchard_group_bytes_total",
    "orchard_group_member_weight_bytes", "orchard_group_member_memory_bytes", "orchard_group_rank_step_seconds",
    "orchard_kv_events_total", "orchard_kv_event_snapshots_total",  # KV events to the routers
}
ROUTER_METRICS = {
    "orchard_router_requests_total", "orchard_router_time_to_first_token_seconds", "orchard_router_workers",
    "orchard_router_retries_total", "orchard_router_inflight_requests", "orchard_router_e2e_request_latency_seconds",
    "orchard_router_circuit_open", "orchard_router_poison_requests_total",
    "orchard_router_retry_budget_exhausted_total",
    "orchard_router_deadline_exceeded_total",
    "orchard_router_kv_events_applied_total", "orchard_router_kv_resyncs_total", "orchard_router_kv_map_blocks",
    # placement by KV cache (router/prompt_blocks.py, policy.py's kv_aware)
    "orchard_router_tokenize_seconds", "orchard_router_tokenize_fallbacks_total",
    "orchard_router_predicted_cached_tokens_total", "orchard_router_actual_cached_tokens_total",
}
# a router with a catalog (`--catalog`): the fleet's
FLEET_METRICS = {
    "orchard_fleet_models_loaded", "orchard_fleet_loads_total", "orchard_fleet_unloads_total",
    "orchard_fleet_load_seconds", "orchard_fleet_load_wait_seconds", "orchard_fleet_footprint_error_ratio",
    "orchard_fleet_node_memory_bytes", "orchard_fleet_fetch_bytes_total", "orchard_fleet_fetch_seconds_total",
    "orchard_fleet_fetches_total", "orchard_fleet_replacements_total", "orchard_fleet_replicas",
    "orchard_fleet_scale_events_total",
}
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(orchard_[a-z0-9_]+)", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_there_are_two_dashboards():
    assert {p.name for p in DASHBOARDS} == {"orchard-overview.json", "orchard-router.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_has_what_grafana_needs_to_import_it(path):
    d = _load(path)
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list), ("time", dict),
                      ("templating", dict), ("refresh", str), ("tags", list)):
        assert isinstance(d.get(key), kind), f"{path.name}: {key} must be a {kind.__name__}"
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", d["uid"]), "uid: at most 40 letters, digits, - or _"
    assert "id" not in d or d["id"] is None, "a dashboard to import carries no database id"
    assert d["time"].get("from") and d["time"].get("to")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"

    panels = dashboard_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), "panel ids: unique integers"
    boxes = []
    for p in panels:
        assert p.get("type") in PANEL_TYPES, p
        assert isinstance(p.get("title"), str) and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh")
        assert 0 <= g["x"] and g["w"] >= 1 and g["x"] + g["w"] <= 24 and g["h"] >= 1 and g["y"] >= 0, p["title"]
        boxes.append((g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"], p["title"]))
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert "defaults" in p["fieldConfig"] and isinstance(p["fieldConfig"].get("overrides"), list)
        targets = p["targets"]
        assert targets, f"{p['title']}: no queries"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), f"{p['title']}: refIds must be unique"
        for t in targets:
            assert t["expr"].strip() and t["datasource"] == p["datasource"]
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var.startswith("__") or var in variables, f"{p['title']}: ${var} is not a dashboard variable"
    for i, a in enumerate(boxes):  # no two panels on the same cells
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], f"{a[4]!r} overlaps {b[4]!r}"


def test_readme_documents_the_metric_contract():
    """The README's Metrics section names exactly the metrics the contract has (the
    router's and the fleet's written without their `orchard_router_` / `orchard_fleet_`
    prefix)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Metrics"):readme.index("## Develop")]
    worker_table, router_text = section.split("The router's", 1)
    router_text, fleet_text = router_text.split("A fleet router's", 1)
    assert set(re.findall(r"`(orchard_\w+)", worker_table)) == WORKER_METRICS
    assert {f"orchard_router_{n}" for n in re.findall(r"`(\w+)[`{]", router_text)} == ROUTER_METRICS
    assert {f"orchard_fleet_{n}" for n in re.findall(r"`(\w+)[`{]", fleet_text)} == FLEET_METRICS


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboards_use_only_contract_metrics(path):
    for title, ref, expr in dashboard_queries(_load(path)):
        unknown = _metric_names(expr) - WORKER_METRICS - ROUTER_METRICS - FLEET_METRICS
        assert not unknown, f"{path.name} / {title} / {ref}: not in the metric contract: {unknown}"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")


def test_dashboards_cover_what_operators_look_at():
    overview = _load(DEPLOY / "grafana" / "dashboards" / "orchard-overview.json")
    router = _load(DEPLOY / "grafana" / "dashboards" / "orchard-router.json")
    used = lambda d: set().union(*(_metric_names(e) for _, _, e in dashboard_queries(d)))  # noqa: E731
    assert {"orchard_time_to_first_token_seconds", "orchard_inter_token_latency_seconds",
            "orchard_e2e_request_latency_seconds", "orchard_prompt_tokens_total", "orchard_generation_tokens_total",
            "orchard_num_requests_running", "orchard_num_requests_waiting", "orchard_kv_cache_usage_ratio",
            "orchard_num_preemptions_total", "orchard_prefix_cache_hits_total", "orchard_prefix_cache_queries_total",
            "orchard_router_workers"} <= used(overview)
    assert {"orchard_router_requests_total", "orchard_router_retries_total", "orchard_router_inflight_requests",
            "orchard_router_time_to_first_token_seconds"} <= used(router)
    assert FLEET_METRICS <= used(router)
    exprs = " ".join(e for _, _, e in dashboard_queries(overview))
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(orchard_time_to_first_token_seconds_bucket" in exprs
    assert "by (worker) (orchard_kv_cache_usage_ratio" in exprs


def test_grafana_provisioning():
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "orchard.yml").read_text())
    assert ds["apiVersion"] == 1
    (prom,) = ds["datasources"]
    assert prom["type"] == "prometheus" and prom["uid"] and prom["url"].startswith("http")
    assert prom["jsonData"]["timeInterval"]  # what $__rate_interval is derived from
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "orchard.yml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_prometheus_config_and_targets(tmp_path):
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"orchard-router", "orchard-workers"}
    for job in jobs.values():
        (sd,) = job["file_sd_configs"]
        matched = [p for pattern in sd["files"] for p in (DEPLOY / "prometheus").glob(pattern)]
        assert matched, f"{job['job_name']}: no checked-in targets file"
        for p in matched:
            for group in json.loads(p.read_text()):
                assert group["targets"] and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in group["targets"])
    promtool = shutil.which("promtool")
    if promtool:
        r = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_targets_generator(tmp_path):
    from cluster.cli import main

    assert main(["deploy", "prometheus-targets", "--router", "10.0.0.1:9100", "--worker", "mac-1.local:9101",
                 "--worker", "http://mac-2.local:9101/metrics", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "workers.json").read_text()) == [
        {"targets": ["mac-1.local:9101", "mac-2.local:9101"], "labels": {"orchard_role": "worker"}}]
    assert json.loads((tmp_path / "router.json").read_text())[0]["targets"] == ["10.0.0.1:9100"]
    write_prometheus_targets(tmp_path, [], [])
    assert json.loads((tmp_path / "workers.json").read_text()) == [] == file_sd([], "worker")
    with pytest.raises(ValueError):
        file_sd(["no-port"], "worker")


def test_queries_substitute_grafana_variables():
    d = {"panels": [{"type": "row", "title": "r", "panels": [
        {"type": "timeseries", "title": "t", "targets": [
            {"refId": "A", "expr": 'rate(x{model=~"$model"}[$__rate_interval]) + ${model}'}]}]}]}
    assert dashboard_queries(d, {"$__rate_interval": "5s", "$model": ".*"}) == [
        ("t", "A", 'rate(x{model=~".*"}[5s]) + .*')]
