"""The fleet end to end (issue 40's "done when"): a router with a catalog and node agents as
local processes (`cluster.fleet.local.LocalFleet`), each with its own models directory and
--memory-budget, serving the catalog's models on demand.

- Five models (two dense of different sizes, a MoE, a 4-bit quantized one, an embedding
  model) on three nodes whose budgets hold one model each: a seeded trace names them in
  turn; the first request for a model starts one load, 50 concurrent requests for a cold
  model one load; an idle model is unloaded when another needs its room, never one with
  requests in flight; a pinned model never; `keep_alive: 0` unloads after its request;
  every text equals the same model's served by a static worker (greedy).
- A model bigger than any node's budget, smaller than two together: a 2-node pipeline
  group the controller formed, its greedy text a single process's.
- Two routers on one catalog file: 50 requests for a cold model through both, one load; a
  router killed mid-stream loses nothing (the SDK resumes on the other); restarted, it
  finds the catalog and the loaded models and loads nothing twice.

And issue 41's: an `hf:` model on three nodes that hold nothing is pulled once from a fake
hub (`tests/fake_hub.py`) by its first placement, and copied from that node by the second
(no second hub download, the same checksums, the same greedy tokens). A hot model's
replicas grow to --max-replicas under a sustained wait for first tokens, each on its own
node and answering as the first does, and come back to one when the load ends, the
requests sent meanwhile all served. A node agent killed mid-trace with its workers, twice
(a single worker's node, then a group rank's): its models serve again on the nodes left,
the group formed afresh over them (the first node killed, back, among them), and every
stream completes token-exact.

Loads are counted twice: the routers' `orchard_fleet_loads_total` and the agents' logs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cluster.fleet.local import FIVE_MODELS, LocalFleet, ModelRecipe, TraceRequest, make_model, mixed_trace

MiB = 1 << 20
CONTEXT = 512  # every entry's: small KV pools, so the weights and the process decide what fits
MAX_TOKENS = 8
LOAD_WAIT = 240.0  # a load on a loaded 2-core machine: a worker process started and its model read
BIG = ModelRecipe("big", "qwen3", "small", seed=6)  # 8 layers: more than a node's budget below


# -- models and what a static worker serves ------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet-models")
    return {r.name: make_model(r, root) for r in (*FIVE_MODELS, BIG)}


def footprints(paths: dict[str, Path]) -> dict[str, int]:
    """Each model's footprint as the controller estimates it (context CONTEXT, the router's
    default concurrency, this machine's platform)."""
    from cluster import platform
    from cluster.fleet import facts, footprint
    from cluster.fleet.config import DEFAULT_CONCURRENCY

    kind = "metal" if platform.has_metal() else "cpu"
    return {name: footprint.estimate(facts.disk_model(p, kind), CONTEXT, DEFAULT_CONCURRENCY, kind).total
            for name, p in paths.items()}


class Static:
    """What each model serves from a static `orchard worker serve --model DIR` (greedy),
    asked once per distinct request."""

    def __init__(self, worker_process, models: dict[str, Path]):
        self.start = worker_process
        self.models = models
        self.answers: dict[tuple, object] = {}

    def want(self, reqs: list[TraceRequest]) -> list:
        missing = {}
        for r in reqs:
            if _key(r) not in self.answers:
                missing.setdefault(r.model, []).append(r)
        for model, todo in missing.items():
            w = self.start(self.models[model], "--max-model-len", str(CONTEXT), "--served-model-name", model,
                           http=False)
            try:
                for r, answer in zip(todo, serve(w.grpc, todo, concurrency=4)):
                    self.answers[_key(r)] = answer
            finally:
                w.stop()
        return [self.answers[_key(r)] for r in reqs]


def _key(r: TraceRequest) -> tuple:
    return r.model, r.task, r.prompt, r.max_tokens


@pytest.fixture(scope="module")
def static(worker_process, models) -> Static:
    return Static(worker_process, models)


# -- requests -----------------------------------------------------------------------------------
def serve_one(target, r: TraceRequest, timeout: float = LOAD_WAIT + 60):
    """A greedy completion's text (all its max_tokens), or an embedding (the SDK)."""
    from cluster.sdk import Client

    with Client(target, timeout=timeout) as c:
        if r.task == "embed":
            return list(c.embed([r.prompt], model=r.model)[0])
        return c.generate(r.prompt, model=r.model, max_tokens=r.max_tokens, temperature=0, ignore_eos=True).text


def same(got: list, want: list) -> bool:
    """The same texts, and embeddings equal to float32 rounding (batched with others or
    alone, a vector's sums run in another order)."""
    return len(got) == len(want) and all(
        g == w if isinstance(w, str) else np.allclose(g, w, rtol=0, atol=1e-4) for g, w in zip(got, want))


def serve(target, reqs: list[TraceRequest], concurrency: int = 1) -> list:
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(lambda r: serve_one(target, r), reqs))


def http_completion(fleet: LocalFleet, r: TraceRequest, **extra) -> str:
    body = json.dumps({"model": r.model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0,
                       "ignore_eos": True, **extra}).encode()
    req = urllib.request.Request(f"{fleet.http_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=LOAD_WAIT + 60) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def add_models(fleet: LocalFleet, recipes, pinned=(), router: int = 0) -> None:
    """`orchard models add` for each, --context CONTEXT."""
    from cluster.cli import main

    for r in recipes:
        args = ["models", "add", r.name, "--source", r.name, "--context", str(CONTEXT),
                "--router", fleet.router_addresses[router]]
        assert main(args + (["--pin"] if r.name in pinned else [])) == 0, r.name


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"not within {seconds:g} s: {what}"
        time.sleep(0.2)


def loads(fleet: LocalFleet, model: str, router: int | None = None) -> float:
    return fleet.metric("orchard_fleet_loads_total", router, model=model, outcome="loaded")


def unloads(fleet: LocalFleet, model: str, **labels) -> float:
    return fleet.metric("orchard_fleet_unloads_total", model=model, **labels)


def serving(fleet: LocalFleet, router: int = 0) -> set[str]:
    return {name for name, m in fleet.catalog(router).items() if m.state == "serving"}


def request(model: str, text: str, max_tokens: int = MAX_TOKENS) -> TraceRequest:
    task = next(r.task for r in (*FIVE_MODELS, BIG) if r.name == model)
    return TraceRequest(model, task, text, max_tokens)


def test_the_readme_quotes_the_placement_rule_as_the_code_states_it():
    root = Path(__file__).resolve().parents[1]
    doc = (root / "cluster" / "fleet" / "placement.py").read_text()
    rule = doc[doc.index("1. If a node has room"):doc.index("Keep-alive:")].strip()
    readme = (root / "README.md").read_text()
    quoted = readme[readme.index("> 1. If a node has room"):]
    quoted = quoted[:quoted.index("\n\n")]
    assert "\n".join(line.removeprefix(">").removeprefix(" ") for line in quoted.splitlines()) == rule


# -- one node, one model -------------------------------------------------------------------------
def test_a_catalog_model_loads_on_its_first_request(tmp_path, tiny_model_dir):
    """One node, one model: not loaded until asked for; then served, once loaded."""
    fleet = LocalFleet([1 << 30], tmp_path / "fleet")
    fleet.add_model("chat", tiny_model_dir)
    with fleet:
        add_models(fleet, [ModelRecipe("chat")])
        assert fleet.catalog()["chat"].state == "on disk" and fleet.worker_starts() == 0
        r = request("chat", "The first request")
        assert serve_one(fleet.router_address, r) == serve_one(fleet.router_address, r)
        wait_for(lambda: "chat" in serving(fleet), 30, "chat serving")
        assert loads(fleet, "chat") == 1 and fleet.worker_starts("chat") == 1


def test_a_model_on_a_node_without_room_is_copied_to_one_with_room_and_served_there(tmp_path, tiny_model_dir):
    """Two agents: the node that holds the model has no room for it, the other no copy of
    it. The router has node-1 copy it from node-0 (agent to agent, checksummed) and serves
    it there, its text the same on the next request; the nodes' totals say so."""
    fleet = LocalFleet([32 << 20, 1 << 30], tmp_path / "fleet")
    fleet.add_model("chat", tiny_model_dir, nodes=[0], copy=True)
    with fleet:
        add_models(fleet, [ModelRecipe("chat")])
        assert fleet.catalog()["chat"].state == "on disk"
        r = request("chat", "Copied over")
        assert serve_one(fleet.router_address, r) == serve_one(fleet.router_address, r)
        assert fleet.worker_starts("chat") == 1 and "node-1" in fleet.nodes[1].log_path.read_text()
        copied = fleet.nodes[1].models_dir / "chat"
        assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in tiny_model_dir.iterdir())
        wait_for(lambda: "serving on node-1" in fleet.catalog()["chat"].status, 30, "node-1's report of it")
        wait_for(lambda: fleet.metric("orchard_fleet_fetches_total", kind="peer", outcome="ok") == 1, 30,
                 "the copy counted (the node's next report)")
        assert fleet.metric("orchard_fleet_fetch_bytes_total", kind="peer") > 0


@pytest.mark.slow
def test_a_model_whose_node_agent_is_gone_serves_again_on_the_other_node(tmp_path, tiny_model_dir):
    """Two agents holding the model; the one serving it stops (its workers with it) and stays
    silent past --remove-after: the router places the model again on the other node without
    being asked, and a request is served there."""
    fleet = LocalFleet([1 << 30, 1 << 30], tmp_path / "fleet",
                       router_args=["--remove-after", "3", "--heartbeat-interval", "0.5"])
    fleet.add_model("chat", tiny_model_dir)
    with fleet:
        add_models(fleet, [ModelRecipe("chat")])
        r = request("chat", "Before and after")
        before = serve_one(fleet.router_address, r)
        wait_for(lambda: "chat" in serving(fleet), 30, "chat serving")
        [first] = [int(p.node_id.removeprefix("node-")) for p in fleet.catalog()["chat"].placements]
        fleet.stop_node(first)
        wait_for(lambda: fleet.metric("orchard_fleet_replacements_total", reason="node_lost") == 1, 60,
                 "the node lost and the model placed again")
        wait_for(lambda: "chat" in serving(fleet), LOAD_WAIT, "chat serving again")
        assert [p.node_id for p in fleet.catalog()["chat"].placements] == [f"node-{1 - first}"]
        assert serve_one(fleet.router_address, r) == before


# -- five models on three nodes ------------------------------------------------------------------
@pytest.mark.slow
def test_the_five_models_are_the_kinds_the_issue_names(models):
    """Two dense of different sizes, a MoE, a 4-bit quantized one, an embedding model."""
    from cluster import platform
    from cluster.fleet import facts

    kind = "metal" if platform.has_metal() else "cpu"
    config = {r.name: json.loads((models[r.name] / "config.json").read_text()) for r in FIVE_MODELS}
    disk = {r.name: facts.disk_model(models[r.name], kind) for r in FIVE_MODELS}
    assert config["chat"]["model_type"] == "qwen3" and config["coder"]["model_type"] == "llama"
    assert disk["coder"].weight_bytes > 10 * disk["chat"].weight_bytes
    assert config["moe"]["num_experts"] > 1
    assert config["chat-4bit"]["quantization"]["bits"] == 4
    assert list(disk["embed"].tasks) == ["embed"] and all(list(disk[n].tasks) == ["generate"] for n in disk
                                                          if n != "embed")


@pytest.mark.slow
def test_five_models_on_three_nodes_load_on_demand(models, static, tmp_path):
    sizes = footprints({r.name: models[r.name] for r in FIVE_MODELS})
    budget = max(sizes.values()) + 8 * MiB
    assert 2 * min(sizes.values()) > budget, sizes  # a node holds one model at a time: 3 of the 5 at once
    fleet = LocalFleet([budget] * 3, tmp_path / "fleet", router_args=["--default-keep-alive", "10m"])
    for r in FIVE_MODELS:
        fleet.add_model(r.name, models[r.name])
    with fleet:
        add_models(fleet, FIVE_MODELS, pinned={"embed"})
        assert set(fleet.catalog()) == {r.name for r in FIVE_MODELS}
        with urllib.request.urlopen(f"{fleet.http_url}/v1/models", timeout=30) as resp:
            listed = {m["id"]: m for m in json.loads(resp.read())["data"]}
        assert {r.name: listed[r.name]["state"] for r in FIVE_MODELS} == {r.name: "on disk" for r in FIVE_MODELS}

        # the first request for a model starts one load
        first = request("chat", "The first request for chat")
        assert serve_one(fleet.router_address, first) == static.want([first])[0]
        assert loads(fleet, "chat") == 1 and fleet.worker_starts("chat") == 1

        # 50 concurrent requests for a cold model: one load, all 50 served
        burst = [request("moe", f"Burst request {i}: an orchard of moe") for i in range(50)]
        assert same(serve(fleet.router_address, burst, concurrency=50), static.want(burst))
        assert loads(fleet, "moe") == 1 and fleet.worker_starts("moe") == 1

        # the pinned model: loaded now, never unloaded below
        pin = request("embed", "a pinned embedding model")
        assert same([serve_one(fleet.router_address, pin)], static.want([pin]))

        # the seeded trace, in turn, two at a time: every answer the static model's
        trace = mixed_trace(FIVE_MODELS, rounds=2, seed=40, max_tokens=MAX_TOKENS)
        assert same(serve(fleet.router_address, trace, concurrency=2), static.want(trace))
        assert unloads(fleet, "embed") == 0 and "embed" in serving(fleet)
        assert sum(unloads(fleet, r.name, reason="evicted") for r in FIVE_MODELS) > 0  # 3 fit, 5 were served
        for r in FIVE_MODELS:  # each start was a load the router counted, none twice at once
            assert fleet.worker_starts(r.name) == loads(fleet, r.name) >= 1, r.name

        # never an idle model's room taken from one with requests in flight: `busy` streams
        # while a cold model needs a node; the only idle unpinned model is the one unloaded
        busy, idle = _two_loaded_besides(fleet, "embed")
        cold = next(r.name for r in FIVE_MODELS if r.name not in serving(fleet) and r.task == "generate")
        long = request(busy, "A long answer while others load", max_tokens=CONTEXT - 64)
        before = {m: unloads(fleet, m) for m in (busy, idle)}
        got: list = []
        streaming = threading.Thread(target=lambda: got.append(serve_one(fleet.router_address, long)))
        streaming.start()
        try:
            wait_for(lambda: fleet.metric("orchard_router_inflight_requests") > 0, 60, f"{busy}'s stream started")
            c = request(cold, "A cold model needs a node")
            assert serve_one(fleet.router_address, c) == static.want([c])[0]
        finally:
            streaming.join(LOAD_WAIT)
        assert got == static.want([long])
        assert unloads(fleet, busy) == before[busy] and unloads(fleet, idle, reason="evicted") == before[idle] + 1

        # keep_alive 0: unloaded after its request
        k = request(cold, "Served once, then unloaded")
        assert http_completion(fleet, k, keep_alive=0) == static.want([k])[0]
        wait_for(lambda: unloads(fleet, cold, reason="keep_alive") == 1, 60, f"{cold} unloaded after keep_alive 0")
        wait_for(lambda: cold not in serving(fleet), 60, f"{cold} no longer serving")

        assert unloads(fleet, "embed") == 0
        _check_dashboard_metrics(fleet)
        print("footprint estimate error:", {m: round(fleet.metric("orchard_fleet_footprint_error_ratio", model=m), 3)
                                            for m in sorted(serving(fleet))})


def _two_loaded_besides(fleet: LocalFleet, pinned: str) -> tuple[str, str]:
    wait_for(lambda: len(serving(fleet) - {pinned}) == 2, 60, f"two models serving beside {pinned}")
    busy, idle = sorted(serving(fleet) - {pinned})
    return busy, idle


def _check_dashboard_metrics(fleet: LocalFleet) -> None:
    """Every fleet metric the router dashboard queries is one a fleet router exports."""
    from cluster.deploy_tools import dashboard_queries

    dashboard = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "orchard-router.json"
    names = {n for _, _, e in dashboard_queries(json.loads(dashboard.read_text()))
             for n in re.findall(r"\b(orchard_fleet_[a-z_]+?)(?:_bucket|_sum|_count)?\b", e)}
    with urllib.request.urlopen(fleet.metrics_url, timeout=10) as r:
        exported = r.read().decode()
    # a labelled metric nothing has counted yet is exported by its HELP and TYPE lines alone
    assert names and all(f"\n# TYPE {n} " in exported for n in names), names


# -- a model no node can hold alone -------------------------------------------------------------
@pytest.mark.slow
def test_a_model_bigger_than_any_node_is_served_by_a_group_the_controller_formed(models, static, tmp_path):
    from cluster import platform
    from cluster.fleet import facts, footprint
    from cluster.fleet.config import DEFAULT_CONCURRENCY

    kind = "metal" if platform.has_metal() else "cpu"
    disk = facts.disk_model(models["big"], kind)
    whole = footprint.estimate(disk, CONTEXT, DEFAULT_CONCURRENCY, kind)
    halves = footprint.rank_shares(disk, [1, 1], whole)
    budget = (whole.total + max(b for _, _, b in halves)) // 2
    assert max(b for _, _, b in halves) < budget < whole.total  # no node holds it, two together do
    fleet = LocalFleet([budget] * 2, tmp_path / "fleet")
    fleet.add_model("big", models["big"])
    with fleet:
        add_models(fleet, [BIG])
        reqs = [request("big", f"A group answers request {i}", max_tokens=16) for i in range(4)]
        assert same(serve(fleet.router_address, reqs, concurrency=4), static.want(reqs))
        entry = fleet.catalog()["big"]
        assert entry.state == "serving" and sorted((p.group_rank, p.group_size) for p in entry.placements) == [
            (0, 2), (1, 2)], entry
        assert {p.node_id for p in entry.placements} == {"node-0", "node-1"}
        assert loads(fleet, "big") == 1 and fleet.worker_starts("big") == 2  # one load, a process per rank


# -- two routers on one catalog file; a router restarted -----------------------------------------
@pytest.mark.slow
def test_two_routers_share_the_catalog_and_a_restarted_router_finds_what_is_loaded(models, static, tmp_path):
    from cluster.sdk import Client

    fleet = LocalFleet([1 << 30] * 2, tmp_path / "fleet", routers=2)
    recipes = [r for r in FIVE_MODELS if r.name in ("chat", "moe")]
    for r in recipes:
        fleet.add_model(r.name, models[r.name])
    with fleet:
        add_models(fleet, recipes)
        assert set(fleet.catalog(1)) == {"chat", "moe"}  # the second router reads the same file

        # 50 requests for a cold model through both routers at once: one load
        burst = [request("chat", f"Two routers, request {i}") for i in range(50)]
        with ThreadPoolExecutor(50) as pool:
            got = list(pool.map(lambda ir: serve_one(fleet.router_addresses[ir[0] % 2], ir[1]), enumerate(burst)))
        assert same(got, static.want(burst))
        assert loads(fleet, "chat") == 1 and fleet.worker_starts("chat") == 1
        wait_for(lambda: "chat" in serving(fleet, 1), 60, "the second router sees chat serving")

        # router 0 dies mid-stream: the stream resumes through router 1, token-exact
        long = request("chat", "A stream that outlives its router", max_tokens=CONTEXT - 64)
        chunks: list[str] = []
        with Client(fleet.router_addresses, timeout=LOAD_WAIT) as c:
            for chunk in c.stream(long.prompt, model="chat", max_tokens=long.max_tokens, temperature=0,
                                  ignore_eos=True):
                chunks.append(chunk.text)
                if len(chunks) == 4:
                    fleet.stop_router(0, kill=True)
        assert "".join(chunks) == static.want([long])[0]

        # restarted, router 0 finds the catalog and the loaded model: served, nothing loaded again
        fleet.cluster.start_router(0)
        fleet.wait_nodes(2)
        wait_for(lambda: "chat" in serving(fleet, 0), 60, "the restarted router sees chat serving")
        again = request("chat", "After the restart")
        assert serve_one(fleet.router_address, again) == static.want([again])[0]
        assert loads(fleet, "chat", router=0) == 0 and fleet.worker_starts("chat") == 1

        # a model neither router loaded yet: one load, whichever router's request comes first
        cold = [request("moe", f"After the restart, moe {i}") for i in range(10)]
        with ThreadPoolExecutor(10) as pool:
            got = list(pool.map(lambda ir: serve_one(fleet.router_addresses[ir[0] % 2], ir[1]), enumerate(cold)))
        assert same(got, static.want(cold))
        assert loads(fleet, "moe") == 1 and fleet.worker_starts("moe") == 1


# -- weights from the hub, then from a peer (issue 41) ------------------------------------------
HUB_REPO = "orchard-tests/tiny-chat"


@pytest.fixture
def fake_hub(tiny_model_dir, tmp_path, monkeypatch):
    """The fake hub holding HUB_REPO (the tiny model's files); the HF_* variables the node
    agents inherit point at it, and no token or cache of the user's is used."""
    from tests.fake_hub import FakeHub

    server = FakeHub()
    server.commit = server.add(HUB_REPO, tiny_model_dir)
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.close()


def whole_downloads(hub, name: str) -> int:
    """GETs of file `name`'s whole body from the fake hub: an LFS file's from its blob store (a
    ranged read of a safetensors header, for the footprint, is not one)."""
    f = hub.file(HUB_REPO, "main", name)
    paths = ({f"/blobs/{f.sha256}"} if f.lfs else
             {f"/{HUB_REPO}/resolve/{rev}/{name}" for rev in ("main", hub.commit)})
    gets = sum(1 for method, path in list(hub.requests) if method == "GET" and path in paths)
    return gets - len(hub.range_starts.get(name, []))


def checksums(root: Path) -> dict[str, str]:
    """sha256 of each file under `root` (a snapshot's symlinks followed to their blobs)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def node_report(fleet: LocalFleet, node_id: str):  # pb.NodeReport, as the router has it
    from cluster.proto.orchard.v1 import orchard_pb2 as pb
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
    from cluster.security import channel

    with channel(fleet.router_address, fleet.cluster.client_security(admin=True), aio=False) as ch:
        nodes = pb_grpc.FleetStub(ch).ListNodes(pb.ListNodesRequest(), timeout=30).nodes
    return next(n.report for n in nodes if n.report.node_id == node_id)


def running_workers(fleet: LocalFleet, model: str) -> dict[str, object]:  # node id -> pb.ManagedWorker
    return {n.report.node_id: w for n in fleet.healthy_nodes() for w in n.report.workers
            if w.model == model and w.state == "running"}


def chat_completion(fleet: LocalFleet, model: str, text: str) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{fleet.http_url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=LOAD_WAIT + 60) as resp:
        return json.loads(resp.read())


def assert_a_chat_answer(answer: dict, model: str) -> None:
    assert answer["object"] == "chat.completion" and answer["model"] == model, answer
    [choice] = answer["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str), answer
    assert choice["finish_reason"] in ("stop", "length") and 0 < answer["usage"]["completion_tokens"] <= MAX_TOKENS


def greedy_tokens(address: str, prompt: str, max_tokens: int = 16) -> list[int]:
    from cluster.sdk import Client

    with Client(address, timeout=120) as c:
        return c.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True).token_ids


@pytest.mark.slow
def test_a_hub_model_is_pulled_once_then_copied_from_the_node_that_has_it(fake_hub, tiny_model_dir, tmp_path):
    """Three nodes holding nothing; `chat` is `hf:ORG/REPO`. Its first request places it: one
    node pulls it from the hub, each file downloaded once. Asked for a second replica, another
    node copies it from the first: nothing more from the hub, the same checksums, and both
    workers answer a prompt with the same greedy tokens."""
    from cluster.cli import main
    from cluster.fleet import hub

    source = f"hf:{HUB_REPO}"
    fleet = LocalFleet([1 << 30] * 3, tmp_path / "fleet")
    files = {p.name for p in tiny_model_dir.iterdir() if p.is_file()}
    add = ["models", "add", "chat", "--source", source, "--context", str(CONTEXT), "--router", fleet.router_address]
    with fleet:
        assert main(add) == 0
        assert fleet.catalog()["chat"].state == "not on disk"

        # the first request: placed, pulled from the hub once, served
        assert_a_chat_answer(chat_completion(fleet, "chat", "Where do the weights come from?"), "chat")
        wait_for(lambda: len(running_workers(fleet, "chat")) == 1, 60, "chat's worker reported running")
        [first] = running_workers(fleet, "chat")
        downloads = {name: whole_downloads(fake_hub, name) for name in files}
        assert downloads.pop("config.json") >= 1  # a describe (the footprint, from the hub's metadata) reads it too
        assert downloads == {name: 1 for name in files - {"config.json"}}
        served = dict(fake_hub.served)
        pulled = {t.kind: t for t in node_report(fleet, first).transfer_totals}
        assert pulled["hub"].fetches == 1 and pulled["hub"].bytes == sum(
            (tiny_model_dir / name).stat().st_size for name in files)

        # a second replica: on another node, copied from the first
        assert main([*add, "--replace", "--min-replicas", "2", "--max-replicas", "2"]) == 0
        wait_for(lambda: len(running_workers(fleet, "chat")) == 2, LOAD_WAIT, "chat's second replica running")
        [second] = set(running_workers(fleet, "chat")) - {first}
        copied = {t.kind: t for t in node_report(fleet, second).transfer_totals}
        assert copied["peer"].fetches == 1 and copied["peer"].failures == 0
        assert "hub" not in copied or copied["hub"].fetches == 0
        assert dict(fake_hub.served) == served  # no second hub download, not even a header
        assert fleet.metric("orchard_fleet_fetches_total", kind="hub", outcome="ok") == 1
        assert fleet.metric("orchard_fleet_fetches_total", kind="peer", outcome="ok") == 1

        # the same files, byte for byte, as the hub's
        want = {name: fake_hub.file(HUB_REPO, "main", name).sha256 for name in files}
        snapshots = [hub.local_snapshot(source, fleet.nodes[int(n.removeprefix("node-"))].models_dir / ".hub")
                     for n in (first, second)]
        assert all(s is not None and s.name == fake_hub.commit for s in snapshots), snapshots
        assert checksums(snapshots[0]) == checksums(snapshots[1]) == want

        # the same weights: the two workers' greedy tokens for one prompt are equal
        workers = running_workers(fleet, "chat")
        tokens = [greedy_tokens(workers[n].address, "Copied Mac to Mac, the same weights") for n in (first, second)]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 16
        assert_a_chat_answer(chat_completion(fleet, "chat", "Where do the weights come from now?"), "chat")


# -- a hot model's replicas ------------------------------------------------------------------------
@pytest.mark.slow
def test_a_hot_models_replicas_grow_to_max_and_come_back_to_one(tmp_path, tiny_model_dir):
    scale = ["--scale-up-wait", "0.5", "--scale-window", "3", "--scale-down-idle", "6"]
    fleet = LocalFleet([1 << 30] * 3, tmp_path / "fleet", router_args=scale)
    fleet.add_model("chat", tiny_model_dir)
    with fleet:
        from cluster.cli import main

        assert main(["models", "add", "chat", "--source", "chat", "--context", str(CONTEXT), "--keep-alive", "-1",
                     "--max-replicas", "2", "--engine-arg=--max-num-seqs 2", "--router", fleet.router_address]) == 0
        assert main(["models", "load", "chat", "--router", fleet.router_address]) == 0
        replicas = lambda: fleet.catalog()["chat"].replicas  # noqa: E731
        hot, failures, texts = threading.Event(), [], set()
        hot.set()

        def client(i: int) -> None:  # 24 of them: requests queue behind a replica's 2 slots
            r = request("chat", "The same words every time", max_tokens=64)
            while hot.is_set():
                try:
                    texts.add(serve_one(fleet.router_address, r))
                except Exception as e:  # noqa: BLE001 (counted: none may fail)
                    failures.append(e)

        clients = [threading.Thread(target=client, args=(i,)) for i in range(24)]
        for t in clients:
            t.start()
        try:
            wait_for(lambda: replicas() == 2 and "chat" in serving(fleet), LOAD_WAIT, "a second replica serving")
        finally:
            hot.clear()
            for t in clients:
                t.join(LOAD_WAIT)
        nodes = [p.node_id for p in fleet.catalog()["chat"].placements]
        assert len(nodes) == len(set(nodes)) == 2  # one replica a node
        # a few requests one at a time as the replicas come back to one (each served), then none
        # (on a slow machine their waits could keep them from looking idle)
        quiet = request("chat", "The same words every time", max_tokens=64)
        for _ in range(5):
            texts.add(serve_one(fleet.router_address, quiet))
        wait_for(lambda: replicas() == 1, LOAD_WAIT, "back to one replica")
        assert failures == [] and len(texts) == 1  # greedy: every replica answers as the first
        events = lambda direction: fleet.metric("orchard_fleet_scale_events_total", model="chat",  # noqa: E731
                                                direction=direction)
        wait_for(lambda: events("down") == 1, 60, "the removal counted")  # once its placement is forgotten
        assert events("up") == 1
        assert fleet.worker_starts("chat") == 2 and loads(fleet, "chat") == 1


# -- a lost Mac (issue 41) -----------------------------------------------------------------------
LOST_AFTER = 15.0  # the router's --remove-after: a node silent this long is lost, its models placed again


class Streams:
    """Greedy streams through the router, each in a thread, their text gathered chunk by chunk."""

    def __init__(self, target: str, reqs: list[TraceRequest]):
        self.reqs = reqs
        self.chunks: list[list[str]] = [[] for _ in reqs]
        self.done = [threading.Event() for _ in reqs]
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._stream, args=(target, i), daemon=True) for i in range(len(reqs))]
        for t in self.threads:
            t.start()

    def _stream(self, target: str, i: int) -> None:
        from cluster.sdk import Client

        r = self.reqs[i]
        try:
            with Client(target, timeout=2 * LOAD_WAIT) as c:
                for chunk in c.stream(r.prompt, model=r.model, max_tokens=r.max_tokens, temperature=0,
                                      ignore_eos=True):
                    self.chunks[i].append(chunk.text)
        except BaseException as e:  # noqa: BLE001  (the test says which stream failed, and how)
            self.errors.append(e)
        finally:
            self.done[i].set()

    def started(self) -> bool:
        return all(len(c) >= 2 or d.is_set() for c, d in zip(self.chunks, self.done))

    def unfinished(self, model: str) -> int:
        return sum(1 for r, d in zip(self.reqs, self.done) if r.model == model and not d.is_set())

    def texts(self) -> list[str]:
        for t in self.threads:
            t.join(2 * LOAD_WAIT + 60)
        assert not self.errors and all(d.is_set() for d in self.done), self.errors
        return ["".join(c) for c in self.chunks]


def kill_node(fleet: LocalFleet, i: int) -> None:
    """Node `i` lost as a Mac is: its agent and its workers killed at once, by PID (each pid
    checked to be that worker's still: a pid is reused)."""
    from cluster.fleet.agent import _command_of, _is_worker

    n = fleet.nodes[i]
    workers = {p.stem: int(p.read_text().split()[0]) for p in (n.state_dir / n.name / "workers").glob("*.pid")}
    running = lambda: {w: pid for w, pid in workers.items() if _is_worker(_command_of(pid), w)}  # noqa: E731
    pids = running()
    assert pids, f"{n.name} runs no worker"
    n.child.proc.kill()
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    n.child.proc.wait(30)
    wait_for(lambda: not running(), 30, f"{n.name}'s workers gone")


def placed_on(fleet: LocalFleet, model: str) -> dict[str, tuple[int, int]]:
    """Where `model` serves now: node id -> (group rank, group size); empty unless serving."""
    entry = fleet.catalog()[model]
    return {p.node_id: (p.group_rank, p.group_size) for p in entry.placements} if entry.state == "serving" else {}


def serving_on(fleet: LocalFleet, model: str, seconds: float, without: str = "") -> dict[str, tuple[int, int]]:
    """Where `model` serves once it does with no part on node `without` (the nodes' reports
    say a worker runs a heartbeat after the router saw it serve): node id -> (rank, size)."""
    found: dict = {}

    def placed():
        found.clear()
        found.update(placed_on(fleet, model))
        return bool(found) and without not in found

    wait_for(placed, seconds, f"{model} serving" + (f" without {without}" if without else ""))
    return found


@pytest.mark.slow
def test_a_node_lost_mid_trace_its_models_serve_again_on_the_nodes_left_and_no_stream_is_lost(models, static,
                                                                                              tmp_path):
    """Four nodes, none of which can hold `big` alone: `big` a group over the two that hold
    its files, `chat` on one of the two that hold its files. Streams of both run while, first,
    chat's node is lost (its agent and workers killed): chat serves again on the other node
    that holds it, big's streams go on; that node comes back. Then a node of big's group is
    lost: big is formed again over the nodes left, the node back among them (copying big's
    files from the other holder). Every stream completes with the uninterrupted greedy text."""
    from cluster import platform
    from cluster.cli import main
    from cluster.fleet import facts, footprint
    from cluster.fleet.config import DEFAULT_CONCURRENCY

    sizes = footprints({name: models[name] for name in ("chat", "big")})
    kind = "metal" if platform.has_metal() else "cpu"
    big = facts.disk_model(models["big"], kind)
    half = max(b for _, _, b in footprint.rank_shares(
        big, [1, 1], footprint.estimate(big, CONTEXT, DEFAULT_CONCURRENCY, kind)))
    budget = (sizes["big"] + half) // 2
    assert half < budget < sizes["big"] and sizes["chat"] <= budget < sizes["chat"] + half, sizes
    fleet = LocalFleet([budget] * 4, tmp_path / "fleet",
                       router_args=["--remove-after", str(LOST_AFTER), "--resume-wait", str(2 * LOAD_WAIT),
                                    "--default-keep-alive", "1h"])
    fleet.add_model("big", models["big"], nodes=[0, 1])
    fleet.add_model("chat", models["chat"], nodes=[2, 3])
    first = [request(m, f"Lost Mac, first round: a stream of {m} {i}", max_tokens=n)
             for m, n in (("chat", CONTEXT - 64), ("big", 160)) for i in range(2)]
    second = [request(m, f"Lost Mac, second round: a stream of {m} {i}", max_tokens=n)
              for m, n in (("chat", CONTEXT - 64), ("big", 160)) for i in range(2)]
    want = static.want(first + second)
    with fleet:
        add_models(fleet, [BIG, ModelRecipe("chat")])
        for name in ("big", "chat"):
            assert main(["models", "load", name, "--router", fleet.router_address]) == 0
        group = serving_on(fleet, "big", 60)
        assert set(group) == {"node-0", "node-1"} and sorted(group.values()) == [(0, 2), (1, 2)]
        [chat_node] = serving_on(fleet, "chat", 60)
        other = "node-3" if chat_node == "node-2" else "node-2"
        lost = int(chat_node.removeprefix("node-"))

        # chat's node lost mid-trace: chat serves again on the other node that holds it
        resumed = fleet.metric("orchard_router_retries_total", kind="resume")
        streams = Streams(fleet.router_address, first)
        wait_for(streams.started, LOAD_WAIT, "every stream under way")
        kill_node(fleet, lost)
        cut = streams.unfinished("chat")
        assert serving_on(fleet, "chat", LOST_AFTER + LOAD_WAIT, without=chat_node) == {other: (0, 1)}
        assert streams.texts() == want[:len(first)]
        assert placed_on(fleet, "big") == group  # untouched
        assert fleet.metric("orchard_router_retries_total", kind="resume") >= resumed + cut
        assert fleet.metric("orchard_fleet_replacements_total", reason="node_lost") == 1

        # the node comes back: a node like any other, with the files it holds
        fleet.start_node(lost)
        wait_for(lambda: chat_node in {n.report.node_id for n in fleet.healthy_nodes()}, 120, f"{chat_node} back")
        assert "chat" in {m.name for m in node_report(fleet, chat_node).models}

        # a node of big's group lost mid-trace: big formed again over the nodes left
        streams = Streams(fleet.router_address, second)
        wait_for(streams.started, LOAD_WAIT, "every stream under way")
        resumed = fleet.metric("orchard_router_retries_total", kind="resume")
        kill_node(fleet, 0)
        cut = streams.unfinished("big")
        again = serving_on(fleet, "big", LOST_AFTER + LOAD_WAIT, without="node-0")
        # over two of the nodes left, the one back among them (either other node has a model
        # or a rank on it: the group needs its room)
        assert chat_node in again and len(again) == 2 and sorted(again.values()) == [(0, 2), (1, 2)], again
        assert streams.texts() == want[len(first):]
        assert fleet.metric("orchard_router_retries_total", kind="resume") >= resumed + cut
        assert fleet.metric("orchard_fleet_replacements_total", reason="node_lost") == 2
        after = request("chat", "After two Macs were lost")
        assert serve_one(fleet.router_address, after) == static.want([after])[0]
