"""`orchard ...`: argument parsing and dispatch only. Each command lives in its module."""

from __future__ import annotations

import argparse
import logging
import sys


def _cmd_model_create(args) -> int:
    from cluster.modelgen import create_model, num_parameters

    path = create_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.arch} {args.size} model ({num_parameters(path):,} parameters) to {path}")
    return 0


def _cmd_run(args) -> int:
    """Offline generation on one machine: the engine without any server."""
    from cluster.worker.offline import run_offline

    return run_offline(args)


def _cmd_worker_serve(args) -> int:
    """A worker: the engine behind gRPC, Prometheus metrics and optional OpenAI HTTP."""
    from cluster.worker.server import serve

    return serve(args)


def _cmd_generate(args) -> int:
    """One request through the SDK to a router or worker."""
    from cluster.sdk.cli import generate

    return generate(args)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: from memory)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 2048 on Metal, 512 on the CPU)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-partial-prefills", type=int, default=1)
    g.add_argument("--max-long-partial-prefills", type=int, default=1)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--max-waiting", type=int, default=1024, help="queued requests before refusing (0 = unbounded)")
    g.add_argument("--finish-wait-ms", type=float, default=10.0,
                   help="after a step that finished requests, wait up to this long for as many new ones, so "
                        "clients that come straight back join the next step (0 = off)")


def engine_config_from_args(args):
    from cluster.worker.config import EngineConfig

    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_waiting=args.max_waiting,
        finish_wait_ms=args.finish_wait_ms,
    )


def off(address: str | None) -> str | None:
    """An address flag's value, or None for "off" (or empty): that endpoint is not served."""
    return None if address in (None, "", "off") else address


def _cmd_router_serve(args) -> int:
    import asyncio

    from cluster.net import check_addresses
    from cluster.router.server import RouterConfig, serve

    try:
        check_addresses(args.grpc, off(args.http), off(args.metrics), *(args.worker or ()))
    except ValueError as e:
        print(f"orchard router serve: {e}", file=sys.stderr)
        return 2
    config = RouterConfig(
        grpc_address=args.grpc, http_address=off(args.http), metrics_address=off(args.metrics), policy=args.policy,
        join_token=args.join_token, heartbeat_interval=args.heartbeat_interval,
        missed_heartbeats=args.missed_heartbeats, remove_after=args.remove_after, max_attempts=args.max_attempts,
        worker_wait=args.worker_wait,
        static_workers=tuple(args.worker or ()),
    )
    try:
        asyncio.run(serve(config))
    except (OSError, ValueError) as e:
        print(f"orchard router serve: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_router_admin(args) -> int:
    from cluster.router.admin import run

    return run(args)


def _cmd_up(args) -> int:
    from cluster.up import run_up

    return run_up(args)


def add_router_parsers(sub) -> None:
    """`orchard router serve|register|workers|drain|remove` and `orchard up`."""
    import os

    from cluster.router.policy import POLICIES

    router = sub.add_parser("router", help="the router: serve, register workers, list, drain")
    rsub = router.add_subparsers(dest="router_command", required=True)
    serve = rsub.add_parser("serve", help="run a router")
    serve.add_argument("--grpc", default="127.0.0.1:50051", help="gRPC address (Generation + Router services)")
    serve.add_argument("--http", default="127.0.0.1:8080", help="OpenAI-compatible HTTP address, or off")
    serve.add_argument("--metrics", default="127.0.0.1:9100", help="Prometheus /metrics address, or off")
    serve.add_argument("--join-token", default=os.environ.get("ORCHARD_JOIN_TOKEN", ""),
                       help="workers must present it to register (default $ORCHARD_JOIN_TOKEN; empty: open)")
    serve.add_argument("--policy", choices=sorted(POLICIES), default="prefix_aware")
    serve.add_argument("--worker", action="append", metavar="ADDR", help="a static worker to poll (repeatable)")
    serve.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats/polls")
    serve.add_argument("--missed-heartbeats", type=int, default=3, help="missed beats before a worker is unhealthy")
    serve.add_argument("--remove-after", type=float, default=30.0, help="seconds of silence before removal")
    serve.add_argument("--max-attempts", type=int, default=4, help="placements per request (retries + resumes)")
    serve.add_argument("--worker-wait", type=float, default=5.0, metavar="SECONDS",
                       help="how long a request with no healthy worker waits for an unhealthy one to report in")
    serve.set_defaults(func=_cmd_router_serve)
    for name, what in (("register", "add static workers (the router polls them)"), ("workers", "list the workers"),
                       ("drain", "stop new placements on a worker; it finishes what it has"),
                       ("remove", "forget a worker")):
        p = rsub.add_parser(name, help=what)
        p.add_argument("--router", default="127.0.0.1:50051", help="the router's gRPC address")
        if name == "register":
            p.add_argument("--worker", action="append", required=True, metavar="ADDR", help="worker gRPC address")
        elif name in ("drain", "remove"):
            p.add_argument("worker", help="worker id or address")
        if name == "drain":
            p.add_argument("--undo", action="store_true", help="take requests again")
        p.set_defaults(func=_cmd_router_admin)

    up = sub.add_parser("up", help="a router and N local workers, until Ctrl-C")
    up.add_argument("--model", default=None, help="mlx-lm model directory (default: the built-in small model)")
    up.add_argument("--workers", type=int, default=2, help="local worker processes")
    up.add_argument("--grpc", default="127.0.0.1:50051", help="the router's gRPC address")
    up.add_argument("--http", default="127.0.0.1:8080", help="or off")
    up.add_argument("--metrics", default="127.0.0.1:9100", help="or off")
    up.add_argument("--policy", choices=sorted(POLICIES), default="prefix_aware")
    up.add_argument("--worker-port-base", type=int, default=50061, help="worker i: gRPC port base+i (0: free ports)")
    up.add_argument("--worker-metrics-port-base", type=int, default=9101, help="worker i: metrics port base+i (0: free)")
    up.add_argument("--log-dir", default=None, help="where the processes log (default: a temporary directory)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the workers")
    up.set_defaults(func=_cmd_up)


def add_worker_parsers(sub) -> None:
    """`orchard worker serve` and `orchard generate`."""
    import os

    worker = sub.add_parser("worker", help="worker commands").add_subparsers(dest="worker_command", required=True)
    serve = worker.add_parser("serve", help="serve a model over gRPC (+ metrics, + OpenAI HTTP with --http)")
    serve.add_argument("--model", default=None, help="mlx-lm model directory (default: the built-in small model)")
    serve.add_argument("--grpc", default="127.0.0.1:50061", metavar="HOST:PORT", help="gRPC address (port 0: any free)")
    serve.add_argument("--http", default=None, metavar="HOST:PORT", help="OpenAI-compatible HTTP address (default: off)")
    serve.add_argument("--metrics", default="127.0.0.1:9101", metavar="HOST:PORT", help="Prometheus /metrics address, or off")
    serve.add_argument("--worker-id", default=None, help="default: HOSTNAME-GRPCPORT")
    serve.add_argument("--router", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                       help="register with this router (or these routers) and send heartbeats")
    serve.add_argument("--join-token", default=os.environ.get("ORCHARD_JOIN_TOKEN", ""),
                       help="the router's join token (default $ORCHARD_JOIN_TOKEN)")
    serve.add_argument("--advertise", default=None, metavar="HOST:PORT",
                       help="the gRPC address the router should use (default: the bound one)")
    serve.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="SECONDS",
                       help="load report to the router every SECONDS (the router's interval, if shorter, wins)")
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_worker_serve)

    gen = sub.add_parser("generate", help="send one request to a router or worker (through the SDK)")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT", help="router (default) or a worker")
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


def _cmd_ray(args) -> int:
    from cluster import ray_launcher

    return {"up": ray_launcher.run_up, "down": ray_launcher.run_down, "status": ray_launcher.run_status}[
        args.ray_command](args)


def add_ray_parser(sub) -> None:
    """`orchard ray up|down|status`: router and workers as Ray actors (cluster/ray_launcher.py)."""
    import os

    from cluster.router.policy import POLICIES

    ray = sub.add_parser("ray", help="run Orchard as Ray actors on an existing Ray cluster")
    rsub = ray.add_subparsers(dest="ray_command", required=True)
    up = rsub.add_parser("up", help="start the router (this node) and workers (nodes with --resource)")
    up.add_argument("--model", required=True, help="mlx-lm model directory, at the same path on every worker node")
    up.add_argument("--workers-per-node", type=int, default=1)
    up.add_argument("--resource", default="orchard_worker", help="Ray resource that marks worker nodes")
    up.add_argument("--host", default=None, help="bind/advertise address (default: each node's Ray IP)")
    up.add_argument("--router-port", type=int, default=50051, help="router gRPC port")
    up.add_argument("--router-http-port", type=int, default=8080, help="OpenAI HTTP port (-1: off)")
    up.add_argument("--router-metrics-port", type=int, default=9100, help="-1: off")
    up.add_argument("--worker-port", type=int, default=50061, help="worker i on a node: port+i (0: free ports)")
    up.add_argument("--worker-metrics-port", type=int, default=9101, help="worker i: port+i (0: free, -1: off)")
    up.add_argument("--join-token", default=os.environ.get("ORCHARD_JOIN_TOKEN", ""),
                    help="workers present it to the router (default $ORCHARD_JOIN_TOKEN)")
    up.add_argument("--policy", choices=sorted(POLICIES), default="prefix_aware")
    up.add_argument("--max-restarts", type=int, default=-1, help="Ray restarts of a dead actor (-1: for ever)")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the workers")
    add_engine_args(up)
    for p in (up, rsub.add_parser("down", help="kill the orchard actors"),
              rsub.add_parser("status", help="list the orchard actors and their addresses")):
        p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
        p.set_defaults(func=_cmd_ray)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchard", description="Serve LLMs from a fleet of Macs.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    create = model.add_parser("create", help="write a random-weight mlx-lm model directory (offline)")
    create.add_argument("dir", help="where to write the mlx-lm model directory")
    create.add_argument("--arch", choices=["qwen3", "llama", "qwen2"], default="qwen3", help="mlx-lm architecture")
    create.add_argument("--size", choices=["tiny", "small"], default="tiny",
                        help="tiny: 2 layers, hidden 128 (tests); small: 8 layers, hidden 512 (benchmarks, `orchard up`)")
    create.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokenizer's corpus")
    create.set_defaults(func=_cmd_model_create)

    run = sub.add_parser("run", help="generate offline with the engine (no server)")
    run.add_argument("prompts", nargs="*", help="prompts (default: a few built-in ones)")
    run.add_argument("--model", default=None, help="mlx-lm model directory (default: the built-in small model)")
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(run)
    run.set_defaults(func=_cmd_run)
    add_router_parsers(sub)
    add_worker_parsers(sub)
    add_bench_parser(sub)
    add_deploy_parser(sub)
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
