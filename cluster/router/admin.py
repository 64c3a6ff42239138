"""`orchard router register|workers|drain|remove`: operate a running router over gRPC."""

from __future__ import annotations

import sys

import grpc

from cluster.config import human_bytes
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.breaker import CLOSED
from cluster.router.registry import STATE_NAMES
from cluster.security import NO_SECURITY, ClientSecurity, channel, client_from_args


def _call(router: str, method: str, request, security: ClientSecurity = NO_SECURITY, timeout: float = 10.0):
    with channel(router, security, aio=False) as ch:
        return getattr(pb_grpc.RouterStub(ch), method)(request, timeout=timeout)


def format_workers(workers: list[pb.WorkerInfo]) -> str:
    """One row per worker: id, address, model, state (and its circuit breaker when not
    closed), running, waiting, KV %, in-flight; beneath it, why it reports itself unhealthy
    or why it could not start."""
    header = ("ID", "ADDRESS", "MODEL", "STATE", "RUNNING", "WAITING", "KV %", "INFLIGHT")
    rows = [header]
    for w in workers:
        total = w.load.kv_blocks_total
        kv = f"{100.0 * w.load.kv_blocks_used / total:.1f}" if total else "-"
        state = STATE_NAMES.get(w.state, "unknown") + (" (static)" if w.static else "")
        if w.circuit and w.circuit != CLOSED:  # placed on by no request until it closes
            state += f", circuit {w.circuit.replace('_', '-')}"
        rows.append((w.worker_id, w.address or "-", w.model or "-", state, str(w.load.num_running),
                     str(w.load.num_waiting), kv, str(w.inflight)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {4, 5, 6, 7}
    lines = ["  ".join(c.rjust(wd) if i in right else c.ljust(wd) for i, (c, wd) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    out = []
    for line, w in zip(lines[1:], workers):
        out.append(line)
        if w.HasField("failure"):  # a worker that could not start: why, and whether it is started again
            f = w.failure
            then = "not started again until that is fixed" if f.permanent else "being started again"
            out.append(f"  could not start {f.age_seconds:.0f} s ago (exit {f.exit_code}; {then}): {f.reason}")
        if w.node_id:  # started by the fleet for a catalog entry
            out.append(f"  fleet: catalog model {w.catalog_model or '?'} on node {w.node_id}")
        if w.load.unhealthy_reason:  # what the worker says keeps it from taking requests
            out.append(f"  unhealthy: {w.load.unhealthy_reason}")
        if w.load.HasField("group"):  # a worker group: one row, its members beneath
            g = w.load.group
            out.append(f"  group of {g.size}, {g.parallel} parallel: " + "; ".join(
                f"rank {m.rank} {m.host or '?'} layers {m.first_layer}-{m.last_layer - 1}, "
                f"weights {human_bytes(m.weight_bytes)}, memory {human_bytes(m.memory_bytes)}"
                + (f", {m.step_seconds * 1000:.0f} ms a step" if m.step_seconds else "") for m in g.members))
    return "\n".join([lines[0], *out])


def list_workers(router: str, security: ClientSecurity = NO_SECURITY, timeout: float = 10.0) -> list[pb.WorkerInfo]:
    return list(_call(router, "ListWorkers", pb.ListWorkersRequest(), security, timeout).workers)


def run(args) -> int:
    security = client_from_args(args, admin=True)
    try:
        if args.router_command == "register":
            for address in args.worker:
                resp = _call(args.router, "AddWorker", pb.AddWorkerRequest(address=address), security)
                print(f"registered {address} as {resp.worker_id}")
        elif args.router_command == "workers":
            workers = list_workers(args.router, security)
            print(format_workers(workers) if workers else "no workers")
        elif args.router_command == "drain":
            resp = _call(args.router, "DrainWorker", pb.DrainWorkerRequest(worker_id=args.worker, drain=not args.undo),
                         security)
            w = resp.worker
            print(f"{w.worker_id}: {STATE_NAMES.get(w.state, 'unknown')}, {w.load.num_running} running, "
                  f"{w.load.num_waiting} waiting, {w.inflight} in flight from the router")
        elif args.router_command == "remove":
            _call(args.router, "RemoveWorker", pb.RemoveWorkerRequest(worker_id=args.worker), security)
            print(f"removed {args.worker}")
    except grpc.RpcError as e:
        print(f"orchard router {args.router_command}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0
