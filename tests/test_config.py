"""One source for configuration: the CLI's flags are generated from the config dataclasses,
so each command's config built from an empty command line equals the dataclass defaults;
the library, `orchard up`, Ray and the registry/proxy share them; settings named with
`env=` come from the environment; nothing below the CLI imports it."""

from __future__ import annotations

import ast
from dataclasses import fields, replace
from pathlib import Path

import pytest

from cluster.cli import build_parser
from cluster.config import default_of, from_args, port_of
from cluster.modelgen import ModelSpec
from cluster.ray_launcher import RayAddress, RaySpec
from cluster.router.config import RouterConfig
from cluster.router.proxy import ProxyConfig
from cluster.router.registry import RegistryConfig
from cluster.up import LocalCluster, UpConfig
from cluster.worker.config import SERVING_MAX_WAITING, EngineConfig, WorkerOptions
from cluster.worker.offline import RunConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("ORCHARD_JOIN_TOKEN", raising=False)


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_worker_serve_defaults_are_the_worker_config():
    options = from_args(WorkerOptions, _parse("worker", "serve"))
    assert options == WorkerOptions()
    assert options.engine_config == replace(EngineConfig(), max_waiting=SERVING_MAX_WAITING)


def test_a_worker_refuses_beyond_1024_waiting_the_library_never():
    args = _parse("worker", "serve")
    assert args.max_waiting == 1024 == WorkerOptions().engine_config.max_waiting
    assert EngineConfig().max_waiting == 0  # Engine.generate takes a whole batch at once
    assert from_args(RunConfig, _parse("run")).engine == EngineConfig()


def test_router_serve_defaults_are_the_router_config():
    assert from_args(RouterConfig, _parse("router", "serve")) == RouterConfig()


def test_model_create_defaults_are_the_model_spec():
    import inspect

    from cluster.modelgen import create_model

    assert from_args(ModelSpec, _parse("model", "create", "/d")) == ModelSpec(path="/d")
    params = inspect.signature(create_model).parameters
    assert all(params[name].default == getattr(ModelSpec(path="/d"), name) for name in ("arch", "size", "seed"))


def test_registry_and_proxy_defaults_come_from_the_router_config():
    router = RouterConfig()
    for cls in (RegistryConfig, ProxyConfig):
        for f in fields(cls):
            assert getattr(cls(), f.name) == getattr(router, f.name), f"{cls.__name__}.{f.name}"


def test_up_defaults_are_the_routers_and_the_workers():
    up = from_args(UpConfig, _parse("up"))
    assert up == UpConfig()
    router, worker = RouterConfig(), WorkerOptions()
    assert (up.grpc_address, up.http_address, up.metrics_address, up.policy) == (
        router.grpc_address, router.http_address, router.metrics_address, router.policy)
    assert up.worker_port_base == port_of(worker.grpc_address)
    assert up.worker_metrics_port_base == port_of(worker.metrics_address)
    cluster = LocalCluster("/m", log_dir="/tmp/unused")
    for name in ("grpc_address", "http_address", "metrics_address", "policy", "worker_port_base",
                 "worker_metrics_port_base"):
        assert getattr(cluster, name) == getattr(up, name), name
    assert cluster.num_workers == up.workers


def test_ray_up_defaults_are_the_routers_and_the_workers():
    spec = from_args(RaySpec, _parse("ray", "up", "--model", "/m"))
    assert spec == RaySpec(model="/m")
    router, worker = RouterConfig(), WorkerOptions()
    assert spec.router_port == port_of(router.grpc_address)
    assert spec.router_http_port == port_of(router.http_address)
    assert spec.router_metrics_port == port_of(router.metrics_address)
    assert spec.worker_port == port_of(worker.grpc_address)
    assert spec.worker_metrics_port == port_of(worker.metrics_address)
    assert (spec.policy, spec.join_token) == (router.policy, router.join_token)
    assert spec.engine == worker.engine_config
    assert from_args(RayAddress, _parse("ray", "status")) == RayAddress()


def test_flags_keep_their_meaning():
    options = from_args(WorkerOptions, _parse(
        "worker", "serve", "--model", "/m", "--grpc", "0.0.0.0:1", "--metrics", "off", "--http", "h:2",
        "--advertise", "a:1", "--no-prefix-caching", "--max-num-batched-tokens", "256", "--max-waiting", "0"))
    assert (options.model_path, options.grpc_address, options.metrics_address, options.http_address,
            options.advertise_address) == ("/m", "0.0.0.0:1", None, "h:2", "a:1")
    engine = options.engine_config
    assert not engine.enable_prefix_caching and engine.max_num_batched_tokens == 256 and engine.max_waiting == 0
    assert WorkerOptions().engine_config.max_num_batched_tokens is None  # the device's default

    router = from_args(RouterConfig, _parse("router", "serve", "--http", "off", "--metrics", "", "--worker", "w:1",
                                            "--worker", "w:2", "--policy", "round_robin"))
    assert (router.http_address, router.metrics_address) == (None, None)
    assert router.static_workers == ("w:1", "w:2") and router.policy == "round_robin"
    with pytest.raises(SystemExit):
        _parse("router", "serve", "--policy", "nope")

    spec = from_args(RaySpec, _parse("ray", "up", "--model", "/m", "--router-http-port", "-1",
                                     "--worker-metrics-port", "0"))
    assert spec.router_http_port is None and spec.worker_metrics_port == 0

    run = from_args(RunConfig, _parse("run", "a", "b", "--max-tokens", "3"))
    assert run.prompts == ("a", "b") and run.max_tokens == 3


@pytest.mark.parametrize("argv, cls", [
    (("worker", "serve"), WorkerOptions),
    (("router", "serve"), RouterConfig),
    (("ray", "up", "--model", "/m"), RaySpec),
])
def test_the_join_token_comes_from_the_environment(monkeypatch, argv, cls):
    monkeypatch.setenv("ORCHARD_JOIN_TOKEN", "from-env")
    assert from_args(cls, _parse(*argv)).join_token == "from-env"
    assert from_args(cls, _parse(*argv, "--join-token", "flag")).join_token == "flag"


def test_every_setting_read_from_the_environment_is_named_once_in_a_config():
    """`env=` in a field's metadata is the one place: no module reads ORCHARD_JOIN_TOKEN itself."""
    named = {f.metadata["env"] for cls in (WorkerOptions, RouterConfig, RaySpec) for f in fields(cls)
             if "env" in f.metadata}
    assert "ORCHARD_JOIN_TOKEN" in named
    for path in (ROOT / "cluster").rglob("*.py"):
        text = path.read_text()
        for name in named:
            if f'"{name}"' in text:
                assert "env=" in text.split(f'"{name}"')[0].rsplit("\n", 1)[-1], f"{path}: reads {name} itself"


def test_a_default_is_read_from_its_dataclass():
    assert default_of(WorkerOptions, "engine_config") == WorkerOptions().engine_config
    assert default_of(RouterConfig, "policy") == RouterConfig().policy
    with pytest.raises(ValueError):
        default_of(ModelSpec, "path")  # a required setting has none


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_nothing_below_the_cli_imports_it():
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "cluster").rglob("*.py"))
                 if p != ROOT / "cluster" / "cli.py" and "cluster.cli" in _imports(p)]
    assert offenders == []


def test_launchd_templates_use_the_default_ports():
    """The templates bind every interface (so they spell the addresses out): on the ports
    the configs default to."""
    import plistlib
    import re

    def args_of(name: str):
        text = re.sub(r"__[A-Z_]+__", "x", (ROOT / "deploy" / "launchd" / name).read_text())
        args = plistlib.loads(text.encode())["ProgramArguments"][1:]
        return _parse(*args[args[0] == "supervise":])  # a worker runs under `orchard supervise`

    router, worker = RouterConfig(), WorkerOptions()
    r = from_args(RouterConfig, args_of("ai.orchard.router.plist"))
    for name in ("grpc_address", "http_address", "metrics_address"):
        assert port_of(getattr(r, name)) == port_of(getattr(router, name)), name
    assert replace(r, grpc_address=router.grpc_address, http_address=router.http_address,
                   metrics_address=router.metrics_address) == router
    w = from_args(WorkerOptions, args_of("ai.orchard.worker.plist"))
    for name in ("grpc_address", "metrics_address", "advertise_address"):
        assert port_of(getattr(w, name)) == port_of(worker.grpc_address if name == "advertise_address"
                                                    else getattr(worker, name)), name
    assert w.engine_config == worker.engine_config
