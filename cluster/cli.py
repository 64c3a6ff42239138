"""`orchard ...`: argument parsing and dispatch only. Each command lives in its module.

A command's flags are generated from its config dataclass (cluster/config.py), which holds
each setting's default and help text; the command receives an instance of it.

The command tree is built first with each command's name and help only; a command's
flags (and so its module) are added when that command is the one run. `orchard --help`,
the router, `orchard generate` and `orchard bench` never import the worker package nor
MLX. The commands that run MLX in this process load OpenBLAS first (`RUN_MLX`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable

from cluster.config import add_flags, from_args

# Each command: its words, its help, and what adds its flags ("module:function"). The
# function takes the command's parser; `_configs` builds the common kind from dataclasses.
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("model", "create"), "write a random-weight mlx-lm model directory (offline)", "cluster.cli:_model_create"),
    (("model", "import"), "write a GGUF file (llama.cpp's, Ollama's) as an mlx-lm model directory",
     "cluster.cli:_model_import"),
    (("model", "pull"), "download a model from the Hugging Face Hub (hf:ORG/REPO[@REVISION]) into a node's hub "
                        "cache, checked against the hub's hashes", "cluster.cli:_model_pull"),
    (("run",), "generate offline with the engine (no server)", "cluster.cli:_run"),
    (("router", "serve"), "run a router", "cluster.cli:_router_serve"),
    (("router", "register"), "add static workers (the router polls them)", "cluster.cli:_router_admin"),
    (("router", "workers"), "list the workers", "cluster.cli:_router_admin"),
    (("router", "drain"), "stop new placements on a worker; it finishes what it has", "cluster.cli:_router_admin"),
    (("router", "remove"), "forget a worker", "cluster.cli:_router_admin"),
    (("models", "add"), "add a model to the fleet's catalog (loaded on demand on the nodes)",
     "cluster.cli:_models_admin"),
    (("models", "list"), "the catalog: each model's state and where it is loaded", "cluster.cli:_models_admin"),
    (("models", "remove"), "unload a model and remove it from the catalog", "cluster.cli:_models_admin"),
    (("models", "load"), "load a catalog model now (returns once it serves)", "cluster.cli:_models_admin"),
    (("models", "unload"), "unload a catalog model now (its requests in flight finish first)",
     "cluster.cli:_models_admin"),
    (("up",), "a router and N local workers, until Ctrl-C", "cluster.cli:_up"),
    (("supervise",), "run an orchard command, started again after a backoff unless it fails for good (exit 78): "
                     "for launchd", "cluster.cli:_supervise"),
    (("worker", "serve"), "serve a model over gRPC (+ metrics, + OpenAI HTTP with --http)",
     "cluster.cli:_worker_serve"),
    (("generate",), "send one request to a router or worker (through the SDK)", "cluster.cli:_generate"),
    (("bench",), "serving benchmark (vllm bench serve style) against a router or worker", "cluster.cli:_bench"),
    (("deploy", "prometheus-targets"), "write Prometheus file_sd targets (router.json, workers.json)",
     "cluster.cli:_prometheus_targets"),
    (("certs", "init"), "create the fleet CA in DIR", "cluster.cli:_certs_init"),
    (("certs", "issue"), "a key and certificate for a router or worker Mac", "cluster.cli:_certs_issue"),
    (("node", "serve"), "run the node agent: the fleet's routers start and stop workers on this Mac through it",
     "cluster.cli:_node_serve"),
    (("nodes", "list"), "list the fleet's node agents: memory, disk, models on disk, workers",
     "cluster.cli:_nodes_list"),
    (("ray", "up"), "start the router (this node) and workers (nodes with --resource)", "cluster.cli:_ray_up"),
    (("ray", "down"), "kill the orchard actors", "cluster.cli:_ray_down"),
    (("ray", "status"), "list the orchard actors and their addresses", "cluster.cli:_ray_status"),
]
GROUPS = {"model": "model utilities", "router": "the router: serve, register workers, list, drain",
          "worker": "worker commands", "models": "the fleet's model catalog on a router (--catalog)",
          "deploy": "deployment helpers",
          "certs": "a CA for the fleet and certificates for its Macs (TLS, mutual TLS)",
          "ray": "run Orchard as Ray actors on an existing Ray cluster",
          "node": "the node agent of a fleet (one per Mac)", "nodes": "the fleet's node agents"}


def _configs(parser: argparse.ArgumentParser, run: Callable, *configs: type) -> None:
    """`parser`'s flags come from the config dataclasses `configs`; the command `run` is
    called with one instance of each, built from the parsed flags."""
    for cls in configs:
        add_flags(parser, cls)
    parser.set_defaults(func=lambda args: run(*(from_args(cls, args) for cls in configs)))


# -- the commands' flags (imported when the command runs) ----------------------------------------
def _model_create(parser: argparse.ArgumentParser) -> None:
    from cluster.modelgen import ModelSpec, create_model, num_parameters

    def run(spec: ModelSpec) -> int:
        from cluster.gguf import GGUFError, import_gguf
        from cluster.models_cache import real_gguf
        from cluster.owned_dir import TargetError, write_dir

        try:
            if spec.real:
                print(f"wrote {spec.real} to {import_gguf(real_gguf(spec.real), spec.path)}")
                return 0
            path = write_dir(spec.path, "random-weight model", f"{spec.arch} {spec.size} seed {spec.seed}",
                             lambda tmp: create_model(tmp, arch=spec.arch, size=spec.size, seed=spec.seed,
                                                      kind=spec.kind, layers=spec.layers, files=spec.files,
                                                      chat=spec.chat))
        except (GGUFError, TargetError, OSError) as e:
            print(f"orchard model create: {e}", file=sys.stderr)
            return 2
        print(f"wrote {spec.arch} {spec.size} model ({num_parameters(path):,} parameters) to {path}")
        return 0

    _configs(parser, run, ModelSpec)


def _model_import(parser: argparse.ArgumentParser) -> None:
    from cluster.models_cache import ModelImport, run_import

    _configs(parser, run_import, ModelImport)


def _model_pull(parser: argparse.ArgumentParser) -> None:
    from cluster.fleet.hub import PullConfig, run_pull

    _configs(parser, run_pull, PullConfig)


def _run(parser: argparse.ArgumentParser) -> None:
    from cluster.worker.offline import RunConfig, run_offline

    _configs(parser, run_offline, RunConfig)


def _router_serve(parser: argparse.ArgumentParser) -> None:
    from cluster.router.config import RouterConfig
    from cluster.router.server import run

    _configs(parser, run, RouterConfig)


def _router_admin(parser: argparse.ArgumentParser) -> None:
    from cluster.router.config import RouterConfig
    from cluster.security import add_client_flags

    def run(args) -> int:
        from cluster.router.admin import run

        return run(args)

    name = parser.prog.split()[-1]
    parser.add_argument("--router", default=RouterConfig.grpc_address, help="the router's gRPC address")
    if name == "register":
        parser.add_argument("--worker", action="append", required=True, metavar="ADDR", help="worker gRPC address")
    elif name in ("drain", "remove"):
        parser.add_argument("worker", help="worker id or address")
    if name == "drain":
        parser.add_argument("--undo", action="store_true", help="take requests again")
    add_client_flags(parser, admin=True)
    parser.set_defaults(func=run)


def _models_admin(parser: argparse.ArgumentParser) -> None:
    from cluster.fleet.models_cli import add_arguments

    def run(args) -> int:
        from cluster.fleet.models_cli import run

        return run(args)

    add_arguments(parser, parser.prog.split()[-1])
    parser.set_defaults(func=run)


def _up(parser: argparse.ArgumentParser) -> None:
    from cluster.up import UpConfig, run_up

    _configs(parser, run_up, UpConfig)


def _supervise(parser: argparse.ArgumentParser) -> None:
    from cluster.supervise import run_supervise

    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help="the orchard command and its flags, e.g. worker serve --model M")
    parser.set_defaults(func=run_supervise)


def _worker_serve(parser: argparse.ArgumentParser) -> None:
    from cluster.worker.config import WorkerOptions

    def serve(options: WorkerOptions) -> int:
        from cluster.worker.server import serve

        return serve(options)

    _configs(parser, serve, WorkerOptions)


def _generate(parser: argparse.ArgumentParser) -> None:
    from cluster.router.config import RouterConfig
    from cluster.sdk.cli import add_constraint_flags, generate
    from cluster.security import add_client_flags

    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--target", default=RouterConfig.grpc_address, metavar="HOST:PORT[,HOST:PORT...]",
                        help="router (default) or a worker")
    parser.add_argument("--stream", action="store_true", help="print the text as it comes")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--model", default="", help="model name (default: whatever the target serves)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--timeout", type=float, default=None, help="seconds")
    add_constraint_flags(parser)
    add_client_flags(parser)
    parser.set_defaults(func=generate)


def _bench(parser: argparse.ArgumentParser) -> None:
    """`orchard bench`: a serving benchmark against a router or worker (cluster/bench/serve.py)."""
    from cluster.bench.serve import add_arguments, main

    add_arguments(parser)
    parser.set_defaults(func=main)


def _prometheus_targets(parser: argparse.ArgumentParser) -> None:
    from cluster.deploy_tools import run_prometheus_targets

    parser.add_argument("--router", action="append", metavar="HOST:PORT",
                        help="the router's metrics address (repeatable)")
    parser.add_argument("--worker", action="append", metavar="HOST:PORT",
                        help="a worker's metrics address (repeatable)")
    parser.add_argument("--out", default="deploy/prometheus/targets",
                        help="directory (default: deploy/prometheus/targets)")
    parser.set_defaults(func=run_prometheus_targets)


def _certs_init(parser: argparse.ArgumentParser) -> None:
    from cluster.certs import CertsInit, run_init

    _configs(parser, run_init, CertsInit)


def _certs_issue(parser: argparse.ArgumentParser) -> None:
    from cluster.certs import CertsIssue, run_issue

    _configs(parser, run_issue, CertsIssue)


def _node_serve(parser: argparse.ArgumentParser) -> None:
    from cluster.fleet.node_config import NodeConfig

    def serve(config: NodeConfig) -> int:
        from cluster.fleet.agent import run

        return run(config)

    _configs(parser, serve, NodeConfig)


def _nodes_list(parser: argparse.ArgumentParser) -> None:
    from cluster.router.config import RouterConfig
    from cluster.security import add_client_flags

    def run(args) -> int:
        from cluster.fleet.nodes import run_list

        return run_list(args)

    parser.add_argument("--router", default=RouterConfig.grpc_address, help="the router's gRPC address")
    add_client_flags(parser, admin=True)
    parser.set_defaults(func=run)


def _ray_up(parser: argparse.ArgumentParser) -> None:
    from cluster.ray_launcher import RayAddress, RaySpec, run_up

    def up(spec: RaySpec, address: RayAddress) -> int:
        # a catalog's node side: worker actors placed on the Ray nodes (it builds on
        # ray_launcher's actors, so the launcher is given it rather than importing it)
        from cluster.fleet.ray_nodes import RayNodes

        return run_up(spec, address, node_side=RayNodes if spec.fleet.enabled else None)

    _configs(parser, up, RaySpec, RayAddress)


def _ray_down(parser: argparse.ArgumentParser) -> None:
    from cluster.ray_launcher import RayAddress, run_down

    _configs(parser, run_down, RayAddress)


def _ray_status(parser: argparse.ArgumentParser) -> None:
    from cluster.ray_launcher import RayAddress, run_status

    _configs(parser, run_status, RayAddress)


# -- the tree ----------------------------------------------------------------------------------
def _chosen(argv: list[str]) -> tuple[str, ...]:
    """The command words `argv` names (the only top-level flag, -v, takes no value)."""
    words = [a for a in argv if not a.startswith("-")]
    for command, _, _ in COMMANDS:
        if tuple(words[: len(command)]) == command:
            return command
    return ()


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv`, only the command it names gets its flags (and imports its
    module); with None, every command does."""
    chosen = None if argv is None else _chosen(argv)
    parser = argparse.ArgumentParser(prog="orchard", description="Serve LLMs from a fleet of Macs.")
    parser.add_argument("-v", "--verbose", action="store_true")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for command, help_text, adder in COMMANDS:
        sub = top
        if len(command) == 2:
            if command[0] not in groups:
                group = top.add_parser(command[0], help=GROUPS[command[0]])
                groups[command[0]] = group.add_subparsers(dest=f"{command[0]}_command", required=True)
            sub = groups[command[0]]
        p = sub.add_parser(command[-1], help=help_text, description=help_text)
        if chosen is None or chosen == command:
            module, _, function = adder.partition(":")
            getattr(importlib.import_module(module), function)(p)
    return parser


# Commands that launchers keep running (`orchard up`, launchd, Ray): a command line they
# cannot parse is a permanent failure (cluster/exit_codes.py), not argparse's 2.
SUPERVISED = {("worker", "serve"), ("router", "serve"), ("node", "serve")}
# Commands that run MLX in this process: OpenBLAS is loaded before anything imports MLX
# (cluster/platform.py). Those that only may (`model create`, `up` making or importing its
# model, `bench`) load it where they import MLX.
RUN_MLX = {("worker", "serve"), ("run",)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _chosen(argv) in RUN_MLX:
        from cluster import platform

        platform.preload_blas()
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as e:
        if e.code == 2 and _chosen(argv) in SUPERVISED:
            from cluster.exit_codes import EXIT_PERMANENT

            return EXIT_PERMANENT
        raise
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
