"""Who may use a fleet: API keys, the admin key, TLS and mutual TLS, Host checking.

A secured local cluster (what `orchard up --secure` starts: a fleet CA, a certificate per
process, an API key, an admin key) with real processes; every endpoint of the router and
of a worker is tried without a key, with a wrong key, with an API key where the admin key
is needed, and with the right key.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.certs import common_name, init_ca, issue
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.security import ADMIN, INFERENCE, OPEN, ClientSecurity, Keys, channel, host_allowed, role_of
from cluster.up import LocalCluster, free_port


# -- the rules ----------------------------------------------------------------------------------

def test_which_rpc_needs_what():
    from cluster.proto.orchard.v1 import orchard_pb2 as pb

    for method in pb.DESCRIPTOR.services_by_name["Generation"].methods:  # embeddings with an API key, too
        assert role_of(f"/orchard.v1.Generation/{method.name}") == INFERENCE, method.name
    assert Keys(("k1",), "adm").refusal("Bearer k1", role_of("/orchard.v1.Generation/Embed")) is None
    assert role_of("/orchard.v1.Router/DrainWorker") == ADMIN
    assert role_of("/orchard.v1.WorkerAdmin/Drain") == ADMIN
    assert role_of("/orchard.v1.Router/SomethingNew") == ADMIN  # closed until listed
    assert role_of("/orchard.v2.Anything/New") == ADMIN
    assert role_of("/grpc.health.v1.Health/Check") == OPEN


@pytest.mark.parametrize("keys, authorization, role, want", [
    (Keys(), None, ADMIN, None),  # nothing configured: open, as before
    (Keys(("k1", "k2")), None, INFERENCE, "unauthenticated"),
    (Keys(("k1", "k2")), "Bearer k2", INFERENCE, None),
    (Keys(("k1", "k2")), "bearer k1", INFERENCE, None),
    (Keys(("k1",)), "Bearer k1x", INFERENCE, "unauthenticated"),
    (Keys(("k1",)), "Basic k1", INFERENCE, "unauthenticated"),
    (Keys(("k1",)), "Bearer k1", ADMIN, "permission_denied"),  # keys set, no admin key: admin is off
    (Keys(("k1",), "adm"), "Bearer k1", ADMIN, "permission_denied"),
    (Keys(("k1",), "adm"), "Bearer adm", ADMIN, None),
    (Keys(("k1",), "adm"), "Bearer adm", INFERENCE, None),  # the admin key may do everything
    (Keys(("k1",), "adm"), "Bearer nope", ADMIN, "unauthenticated"),
    (Keys((), "adm"), None, INFERENCE, None),  # an admin key alone guards admin only
    (Keys((), "adm"), None, ADMIN, "unauthenticated"),
])
def test_keys(keys, authorization, role, want):
    refused = keys.refusal(authorization, role)
    assert (refused and refused[0]) == want


def test_every_http_route_but_health_takes_the_api_key():
    """Walks every route the HTTP app registers: each refuses a request without the key
    before its handler (/rerank and /v2/rerank, Cohere's and Jina's paths, were open)."""
    from aiohttp.test_utils import TestClient, TestServer

    from cluster.api.app import create_app
    from cluster.api.http import OPEN_PATHS, needs_key
    from conftest import run

    app = create_app(None, keys=Keys(("k1",)))  # no backend: a refused request never reaches one
    routes = [(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"]
    assert {("POST", "/rerank"), ("POST", "/v2/rerank"), ("POST", "/tokenize")} <= set(routes)

    async def main():
        async with TestClient(TestServer(app)) as client:
            for method, path in routes:
                if path in OPEN_PATHS:
                    continue
                r = await client.request(method, path.replace("{", "").replace("}", ""), json={})
                assert r.status == 401, (method, path, r.status)
            assert (await client.post("/not-a-route", json={})).status == 401  # closed before it is routed

    run(main())
    assert not needs_key("/health") and not needs_key("/console/state")  # (the console checks keys itself)


def test_host_checking():
    loopback = ("localhost", "127.0.0.1", "::1", "[::1]")
    assert host_allowed("127.0.0.1:8080", loopback) and host_allowed("localhost", loopback)
    assert host_allowed("[::1]:8080", loopback)
    assert not host_allowed("evil.example:8080", loopback) and not host_allowed(None, loopback)
    assert host_allowed("anything", None)


def test_certificates(tmp_path):
    init_ca(tmp_path)
    with pytest.raises(FileExistsError):
        init_ca(tmp_path)  # one CA per fleet: never overwritten
    cert, key = issue(tmp_path, "mac-1", ("mac-1.local", "10.0.0.7"))
    assert common_name(cert) == "mac-1"
    for private in (key, tmp_path / "ca-key.pem"):
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    from cryptography import x509

    sans = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert {"mac-1.local", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} >= {"10.0.0.7", "127.0.0.1"}


# -- a secured cluster ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    c = LocalCluster(tiny_model_dir, workers=1, grpc_address=f"127.0.0.1:{free_port()}",
                     http_address=f"127.0.0.1:{free_port()}", metrics_address=f"127.0.0.1:{free_port()}",
                     worker_port_base=0, worker_metrics_port_base=0, log_dir=tmp_path_factory.mktemp("secure"),
                     worker_args=["--http", f"127.0.0.1:{free_port()}", "--num-kv-blocks", "128"], secure=True)
    with c:
        yield c


def as_(fleet: LocalCluster, key: str | None) -> ClientSecurity:
    """The cluster's client certificate and CA, with `key` ("api", "admin", a literal, or None)."""
    sec = fleet.client_security()
    api_key = {"api": fleet.secrets.api_key, "admin": fleet.secrets.admin_key}.get(key, key) or ""
    return ClientSecurity(api_key=api_key, tls_ca=sec.tls_ca, tls_cert=sec.tls_cert, tls_key=sec.tls_key)


def call(target: str, security: ClientSecurity, rpc: str):
    """One RPC by name; None when served, else the status code."""
    with channel(target, security, aio=False) as ch:
        gen, router, admin = pb_grpc.GenerationStub(ch), pb_grpc.RouterStub(ch), pb_grpc.WorkerAdminStub(ch)
        calls = {
            "Generate": lambda: list(gen.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6]), sampling=pb.SamplingParams(max_tokens=2)), timeout=30)),
            "ListModels": lambda: gen.ListModels(pb.ListModelsRequest(), timeout=10),
            "ListWorkers": lambda: router.ListWorkers(pb.ListWorkersRequest(), timeout=10),
            "DrainWorker": lambda: router.DrainWorker(pb.DrainWorkerRequest(worker_id="nobody"), timeout=10),
            "RemoveWorker": lambda: router.RemoveWorker(pb.RemoveWorkerRequest(worker_id="nobody"), timeout=10),
            "AddWorker": lambda: router.AddWorker(pb.AddWorkerRequest(address=""), timeout=10),
            "GetLoad": lambda: admin.GetLoad(pb.GetLoadRequest(), timeout=10),
            "Drain": lambda: admin.Drain(pb.DrainRequest(drain=False), timeout=10),
        }
        try:
            calls[rpc]()
        except grpc.RpcError as e:
            return e.code()
    return None


ROUTER_RPCS = {"Generate": INFERENCE, "ListModels": INFERENCE, "ListWorkers": ADMIN, "DrainWorker": ADMIN,
               "RemoveWorker": ADMIN, "AddWorker": ADMIN}
WORKER_RPCS = {"Generate": INFERENCE, "ListModels": INFERENCE, "GetLoad": ADMIN, "Drain": ADMIN}
AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.parametrize("where, rpc", [("router", r) for r in ROUTER_RPCS] + [("worker", r) for r in WORKER_RPCS])
def test_every_grpc_endpoint_asks_for_the_right_key(fleet, where, rpc):
    target = fleet.router_address if where == "router" else fleet.worker_addresses[0]
    role = (ROUTER_RPCS if where == "router" else WORKER_RPCS)[rpc]
    assert call(target, as_(fleet, None), rpc) == grpc.StatusCode.UNAUTHENTICATED
    assert call(target, as_(fleet, "not-a-key"), rpc) == grpc.StatusCode.UNAUTHENTICATED
    with_api_key = call(target, as_(fleet, "api"), rpc)
    if role == ADMIN:
        assert with_api_key == grpc.StatusCode.PERMISSION_DENIED
    else:
        assert with_api_key is None
    served = call(target, as_(fleet, "admin"), rpc)  # the admin key passes everywhere
    assert served not in AUTH_CODES  # (served, or e.g. NOT_FOUND for a worker that does not exist)


def test_health_stays_open_for_load_balancers(fleet):
    with channel(fleet.router_address, as_(fleet, None), aio=False) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def http(fleet, address: str, path: str, key: str | None, body: dict | None = None, host: str | None = None):
    """(status, JSON body) of an HTTPS request verified against the fleet CA."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if host:
        headers["Host"] = host
    req = urllib.request.Request(f"https://{address}{path}", headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    ctx = ssl.create_default_context(cafile=fleet.client_security().tls_ca)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("path, body", [
    ("/v1/models", None),
    ("/v1/completions", {"model": "", "prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
@pytest.mark.parametrize("where", ["router", "worker"])
def test_every_http_endpoint_asks_for_an_api_key(fleet, path, body, where):
    address = fleet.http_address if where == "router" else json.loads(
        [ln for ln in fleet.workers[0].log_path.read_text().splitlines() if ln.startswith("ORCHARD_WORKER_READY")][0]
        .split(" ", 1)[1])["http"]
    for key in (None, "not-a-key"):
        status, raw = http(fleet, address, path, key, body)
        err = json.loads(raw)["error"]
        assert status == 401 and err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    status, raw = http(fleet, address, path, fleet.secrets.api_key, body)
    assert status == 200, raw
    status, raw = http(fleet, address, path, fleet.secrets.api_key, body, host="evil.example")  # DNS rebinding
    assert status == 403 and b"allowed-hosts" in raw


def test_metrics_take_a_key_and_health_does_not(fleet):
    for address in (fleet.metrics_address, fleet.worker_metrics[0]):
        assert http(fleet, address, "/metrics", None)[0] == 401
        status, raw = http(fleet, address, "/metrics", fleet.secrets.api_key)
        assert status == 200 and b"orchard_" in raw
        assert http(fleet, address, "/health", None)[0] == 200


def test_tls_is_required_and_so_is_a_fleet_certificate(fleet):
    key = fleet.secrets.api_key
    plaintext = call(fleet.router_address, ClientSecurity(api_key=key), "ListModels")
    no_client_cert = call(fleet.router_address, ClientSecurity(api_key=key, tls_ca=fleet.client_security().tls_ca),
                          "ListModels")
    assert plaintext == grpc.StatusCode.UNAVAILABLE and no_client_cert == grpc.StatusCode.UNAVAILABLE
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # the HTTP API is HTTPS only
        urllib.request.urlopen(f"http://{fleet.http_address}/v1/models", timeout=10)


def test_a_worker_id_cannot_be_taken_by_another_certificate(fleet):
    """The join token is right, the certificate is the fleet's, but it is not worker-0's:
    PERMISSION_DENIED, and worker-0's address is unchanged."""
    d = fleet.secrets.dir
    issue(d, "mallory")
    mallory = ClientSecurity(tls_ca=str(d / "ca.pem"), tls_cert=str(d / "mallory.pem"),
                             tls_key=str(d / "mallory-key.pem"))
    before = {w.worker_id: w.address for w in fleet.healthy_workers()}
    with channel(fleet.router_address, mallory, aio=False) as ch:
        router = pb_grpc.RouterStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            router.RegisterWorker(pb.RegisterWorkerRequest(worker_id="worker-0", address="127.0.0.1:1",
                                                           join_token=fleet.join_token), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:  # nor its address under a new id
            router.RegisterWorker(pb.RegisterWorkerRequest(worker_id="mallory", address=before["worker-0"],
                                                           join_token=fleet.join_token), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:
            router.Heartbeat(pb.HeartbeatRequest(worker_id="worker-0", join_token=fleet.join_token), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert {w.worker_id: w.address for w in fleet.healthy_workers()} == before


def test_no_secret_on_a_command_line(fleet):
    """Keys and the join token reach the children in their environment (a command line is
    every user's to read)."""
    secrets = (fleet.join_token, fleet.secrets.api_key, fleet.secrets.admin_key)
    for child in fleet.children():
        cmdline = open(f"/proc/{child.proc.pid}/cmdline", "rb").read().decode(errors="replace")
        assert not any(s in cmdline for s in secrets), child.name
        log = child.log_path.read_text(errors="replace")
        assert not any(s in log for s in secrets), f"{child.name} logged a secret"
