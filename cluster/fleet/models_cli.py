"""`orchard models add|list|remove|load|unload`: the fleet's catalog on a running router
(its `Fleet` service, with the admin key)."""

from __future__ import annotations

import argparse
import shlex
import sys

import grpc

from cluster.fleet import FleetError
from cluster.config import human_bytes
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.security import ClientSecurity, channel, client_from_args

# A load answers once the model serves: up to the router's --load-timeout (600 s by default).
LOAD_TIMEOUT = 900.0
CALL_TIMEOUT = 30.0
# An unload drains the model's workers first: their requests in flight finish.
UNLOAD_TIMEOUT = 300.0


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    from cluster.router.config import RouterConfig
    from cluster.security import add_client_flags

    parser.add_argument("--router", default=RouterConfig.grpc_address, help="the router's gRPC address")
    if name != "list":
        parser.add_argument("name", help="the model's name in the catalog (what requests name as model)")
    if name == "add":
        parser.add_argument("--source", default="", metavar="DIR|FILE.gguf|ollama:NAME:TAG",
                            help="the model's files: a directory or GGUF file name under each node's --models-dir "
                                 "(default: the name)")
        parser.add_argument("--pin", action="store_true", help="never unloaded for its keep-alive nor evicted")
        parser.add_argument("--keep-alive", default=None, metavar="DURATION",
                            help="how long it stays loaded after its last request (5m, 1h30m, 30s; 0: unload "
                                 "after each request; -1: never; default: the router's --default-keep-alive)")
        parser.add_argument("--max-nodes", type=int, default=0, metavar="N",
                            help="a pipeline group over at most N nodes (0: any; 1: never a group)")
        parser.add_argument("--min-replicas", type=int, default=0, metavar="N",
                            help="replicas (each a worker or a group) placed when it loads and kept while it is "
                                 "loaded (0: one; scale to zero is its keep-alive)")
        parser.add_argument("--max-replicas", type=int, default=0, metavar="N",
                            help="replicas it may grow to when its requests wait for their first token longer "
                                 "than the router's --scale-up-wait (0: --min-replicas, or 1)")
        parser.add_argument("--context", type=int, default=0, metavar="TOKENS",
                            help="its workers' --max-model-len (0: the model's, capped by the router's "
                                 "--fleet-context)")
        parser.add_argument("--engine-arg", action="append", default=[], metavar="FLAGS",
                            help="more `orchard worker serve` flags, e.g. --engine-arg=--max-num-seqs=16 "
                                 "(repeatable; quoted words are split as a shell does)")
        parser.add_argument("--replace", action="store_true", help="change an entry that exists")
    add_client_flags(parser, admin=True)


def replicas(m: pb.CatalogModel) -> str:
    """An entry's replicas now, and their bounds when it has some: "2 (1-3)"."""
    now = str(m.replicas) if m.replicas else "-"
    if not (m.min_replicas or m.max_replicas):
        return now
    floor = max(m.min_replicas, 1)
    return f"{now} ({floor}-{max(m.max_replicas, floor) if m.max_replicas else floor})"


def format_catalog(models: list[pb.CatalogModel]) -> str:
    """One row per entry: name, source, state, footprint, replicas, keep-alive, pin."""
    from cluster.fleet.catalog import format_duration

    header = ("NAME", "SOURCE", "STATE", "FOOTPRINT", "REPLICAS", "KEEP-ALIVE", "PIN")
    rows = [header] + [(m.name, m.source, m.state or "-", human_bytes(m.footprint_bytes) if m.footprint_bytes else "-",
                        replicas(m),
                        format_duration(m.keep_alive_seconds) if m.HasField("keep_alive_seconds") else "default",
                        "yes" if m.pin else "") for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out = [lines[0]]
    for line, m in zip(lines[1:], models):
        out.append(line)
        if m.status:
            out.append(f"  {m.status}")
    return "\n".join(out)


def _entry(args) -> pb.CatalogModel:
    """The entry `orchard models add` asks for; FleetError naming a bad flag."""
    from cluster.fleet.catalog import check_replicas, parse_duration

    for flag, value in (("--max-nodes", args.max_nodes), ("--context", args.context)):
        if value < 0:
            raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"{flag} must be >= 0, got {value}")
    check_replicas(args.min_replicas, args.max_replicas, ("--min-replicas", "--max-replicas"))
    entry = pb.CatalogModel(name=args.name, source=args.source, pin=args.pin, max_nodes=args.max_nodes,
                            context=args.context, replace=args.replace, min_replicas=args.min_replicas,
                            max_replicas=args.max_replicas)
    if args.keep_alive is not None:
        entry.keep_alive_seconds = parse_duration(args.keep_alive, "--keep-alive")
    try:
        entry.engine_args.extend(word for arg in args.engine_arg for word in shlex.split(arg))
    except ValueError as e:
        raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"--engine-arg: {e}") from None
    return entry


def _call(router: str, method: str, request, security: ClientSecurity, timeout: float):
    with channel(router, security, aio=False) as ch:
        return getattr(pb_grpc.FleetStub(ch), method)(request, timeout=timeout)


def run(args) -> int:
    command = args.models_command
    security = client_from_args(args, admin=True)
    try:
        if command == "add":
            added = _call(args.router, "AddModel", _entry(args), security, CALL_TIMEOUT)
            print(format_catalog([added]))
        elif command == "list":
            models = list(_call(args.router, "ListCatalog", pb.ListCatalogRequest(), security, CALL_TIMEOUT).models)
            print(format_catalog(models) if models else "the catalog is empty (orchard models add NAME --source ...)")
        elif command == "remove":
            _call(args.router, "RemoveModel", pb.RemoveModelRequest(name=args.name), security, UNLOAD_TIMEOUT)
            print(f"removed {args.name}")
        elif command == "load":
            print(format_catalog([_call(args.router, "LoadModel", pb.LoadModelRequest(name=args.name), security,
                                        LOAD_TIMEOUT)]))
        elif command == "unload":
            print(format_catalog([_call(args.router, "UnloadModel", pb.UnloadModelRequest(name=args.name), security,
                                        UNLOAD_TIMEOUT)]))
    except FleetError as e:
        print(f"orchard models {command}: {e.message}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"orchard models {command}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0
