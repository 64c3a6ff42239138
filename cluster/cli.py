"""`orchard ...`: argument parsing and dispatch only. Each command lives in its module.

A command's flags are generated from its config dataclass (cluster/config.py), which holds
each setting's default and help text; the command receives an instance of it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from cluster import ray_launcher
from cluster.config import add_flags, from_args
from cluster.modelgen import ModelSpec
from cluster.models_cache import ModelImport, run_import
from cluster.ray_launcher import RayAddress, RaySpec
from cluster.security import add_client_flags
from cluster.router.config import RouterConfig
from cluster.up import UpConfig, run_up
from cluster.worker.config import WorkerOptions
from cluster.worker.offline import RunConfig, run_offline


def _command(parser: argparse.ArgumentParser, run, *configs: type) -> None:
    """`parser`'s flags come from the config dataclasses `configs`; the command `run` is
    called with one instance of each, built from the parsed flags."""
    for cls in configs:
        add_flags(parser, cls)
    parser.set_defaults(func=lambda args: run(*(from_args(cls, args) for cls in configs)))


def _cmd_model_create(spec: ModelSpec) -> int:
    from cluster.modelgen import create_model, num_parameters

    if spec.real:
        from cluster.gguf import import_gguf
        from cluster.models_cache import real_gguf

        print(f"wrote {spec.real} to {import_gguf(real_gguf(spec.real), spec.path)}")
        return 0
    path = create_model(spec.path, arch=spec.arch, size=spec.size, seed=spec.seed)
    print(f"wrote {spec.arch} {spec.size} model ({num_parameters(path):,} parameters) to {path}")
    return 0


def _cmd_worker_serve(options: WorkerOptions) -> int:
    """A worker: the engine behind gRPC, Prometheus metrics and optional OpenAI HTTP."""
    from cluster.worker.server import serve

    return serve(options)


def _cmd_generate(args) -> int:
    """One request through the SDK to a router or worker."""
    from cluster.sdk.cli import generate

    return generate(args)


def _cmd_router_serve(config: RouterConfig) -> int:
    from cluster.router.server import run

    return run(config)


def _cmd_router_admin(args) -> int:
    from cluster.router.admin import run

    return run(args)


def add_router_parsers(sub) -> None:
    """`orchard router serve|register|workers|drain|remove` and `orchard up`."""
    router = sub.add_parser("router", help="the router: serve, register workers, list, drain")
    rsub = router.add_subparsers(dest="router_command", required=True)
    _command(rsub.add_parser("serve", help="run a router"), _cmd_router_serve, RouterConfig)
    for name, what in (("register", "add static workers (the router polls them)"), ("workers", "list the workers"),
                       ("drain", "stop new placements on a worker; it finishes what it has"),
                       ("remove", "forget a worker")):
        p = rsub.add_parser(name, help=what)
        p.add_argument("--router", default=RouterConfig.grpc_address, help="the router's gRPC address")
        if name == "register":
            p.add_argument("--worker", action="append", required=True, metavar="ADDR", help="worker gRPC address")
        elif name in ("drain", "remove"):
            p.add_argument("worker", help="worker id or address")
        if name == "drain":
            p.add_argument("--undo", action="store_true", help="take requests again")
        add_client_flags(p, admin=True)
        p.set_defaults(func=_cmd_router_admin)

    _command(sub.add_parser("up", help="a router and N local workers, until Ctrl-C"), run_up, UpConfig)


def add_worker_parsers(sub) -> None:
    """`orchard worker serve` and `orchard generate`."""
    worker = sub.add_parser("worker", help="worker commands").add_subparsers(dest="worker_command", required=True)
    serve = worker.add_parser("serve", help="serve a model over gRPC (+ metrics, + OpenAI HTTP with --http)")
    _command(serve, _cmd_worker_serve, WorkerOptions)

    gen = sub.add_parser("generate", help="send one request to a router or worker (through the SDK)")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--target", default=RouterConfig.grpc_address, metavar="HOST:PORT[,HOST:PORT...]",
                     help="router (default) or a worker")
    gen.add_argument("--stream", action="store_true", help="print the text as it comes")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--model", default="", help="model name (default: whatever the target serves)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=None, help="seconds")
    from cluster.sdk.cli import add_constraint_flags

    add_constraint_flags(gen)
    add_client_flags(gen)
    gen.set_defaults(func=_cmd_generate)


def _cmd_bench(args) -> int:
    from cluster.bench.serve import main

    return main(args)


def add_bench_parser(sub) -> None:
    """`orchard bench`: a serving benchmark against a router or worker (cluster/bench/serve.py)."""
    from cluster.bench.serve import add_arguments

    bench = sub.add_parser("bench", help="serving benchmark (vllm bench serve style) against a router or worker")
    add_arguments(bench)
    bench.set_defaults(func=_cmd_bench)


def _cmd_deploy_targets(args) -> int:
    from cluster.deploy_tools import run_prometheus_targets

    return run_prometheus_targets(args)


def add_deploy_parser(sub) -> None:
    """`orchard deploy prometheus-targets`: files for deploy/prometheus/prometheus.yml."""
    deploy = sub.add_parser("deploy", help="deployment helpers").add_subparsers(dest="deploy_command", required=True)
    t = deploy.add_parser("prometheus-targets", help="write Prometheus file_sd targets (router.json, workers.json)")
    t.add_argument("--router", action="append", metavar="HOST:PORT", help="the router's metrics address (repeatable)")
    t.add_argument("--worker", action="append", metavar="HOST:PORT", help="a worker's metrics address (repeatable)")
    t.add_argument("--out", default="deploy/prometheus/targets", help="directory (default: deploy/prometheus/targets)")
    t.set_defaults(func=_cmd_deploy_targets)


def add_certs_parser(sub) -> None:
    """`orchard certs init|issue`: the fleet's CA and its certificates (cluster/certs.py)."""
    from cluster.certs import CertsInit, CertsIssue, run_init, run_issue

    certs = sub.add_parser("certs", help="a CA for the fleet and certificates for its Macs (TLS, mutual TLS)")
    csub = certs.add_subparsers(dest="certs_command", required=True)
    _command(csub.add_parser("init", help="create the fleet CA in DIR"), run_init, CertsInit)
    _command(csub.add_parser("issue", help="a key and certificate for a router or worker Mac"), run_issue, CertsIssue)


def add_ray_parser(sub) -> None:
    """`orchard ray up|down|status`: router and workers as Ray actors (cluster/ray_launcher.py)."""
    ray = sub.add_parser("ray", help="run Orchard as Ray actors on an existing Ray cluster")
    rsub = ray.add_subparsers(dest="ray_command", required=True)
    up = rsub.add_parser("up", help="start the router (this node) and workers (nodes with --resource)")
    _command(up, ray_launcher.run_up, RaySpec, RayAddress)
    _command(rsub.add_parser("down", help="kill the orchard actors"), ray_launcher.run_down, RayAddress)
    _command(rsub.add_parser("status", help="list the orchard actors and their addresses"), ray_launcher.run_status,
             RayAddress)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchard", description="Serve LLMs from a fleet of Macs.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    create = model.add_parser("create", help="write a random-weight mlx-lm model directory (offline)")
    _command(create, _cmd_model_create, ModelSpec)
    _command(model.add_parser("import", help="write a GGUF file (llama.cpp's, Ollama's) as an mlx-lm model directory"),
             run_import, ModelImport)

    _command(sub.add_parser("run", help="generate offline with the engine (no server)"), run_offline, RunConfig)
    add_router_parsers(sub)
    add_worker_parsers(sub)
    add_bench_parser(sub)
    add_deploy_parser(sub)
    add_certs_parser(sub)
    add_ray_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
