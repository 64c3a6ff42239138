"""`orchard worker serve --group-size N ...`: the settings of a worker group, and where its
members are (`Topology`: from the flags, a hostfile in mlx.launch's format, or the
`MLX_RANK` / `MLX_HOSTFILE` that mlx.launch sets). No MLX here."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.config import ByteSize, setting
from cluster.net import parse_address

PARALLEL_MODES = ("pipeline", "tensor")
MLX_LAUNCH_STARTING_PORT = 32323  # mlx.launch's --starting-port default: rank r's ring port is this + r
CONTROL_PORT_OFFSET = 1000  # rank 0's side channel listens on its ring port + this, unless --group-port
# --group-check's default: the cost of one checked step spread over this many stays under
# 1% of a step (load/bench_group.py --check-cost measures it)
CHECK_EVERY = 16


@dataclass(frozen=True)
class GroupOptions:
    size: int = setting(1, "processes (one a Mac) that serve this model together as one worker; 1: a plain worker",
                        flag="--group-size", metavar="N")
    parallel: str = setting("pipeline", "how the group splits the model: pipeline (layers per rank, any link) or "
                                        "tensor (heads per rank, all-reduces every layer: for RDMA links)",
                            choices=PARALLEL_MODES)
    backend: str = setting("ring", "MLX's collectives: ring (TCP, any link) or jaccl (RDMA over Thunderbolt 5, "
                                   "macOS 26.2+; its devices from mlx.launch's MLX_IBV_DEVICES and "
                                   "MLX_JACCL_COORDINATOR)", flag="--group-backend", choices=("ring", "jaccl"))
    rank: int | None = setting(None, "this process's rank (0 serves the router and schedules; default: $MLX_RANK, "
                                     "else 0)", flag="--group-rank")
    hosts: str | None = setting(None, "each rank's ring address for MLX's collectives, in rank order "
                                      "(default: $MLX_HOSTFILE's)", flag="--group-hosts",
                                metavar="HOST:PORT,HOST:PORT...")
    hostfile: str | None = setting(None, "the ranks' addresses from a hostfile in mlx.launch's format "
                                         "(ring ports from 32323 up, as mlx.launch gives them)",
                                   flag="--group-hostfile", metavar="FILE")
    port: int = setting(0, "rank 0's side-channel port (plans, heartbeats; authenticated with the join token; "
                           "0: its ring port + 1000)", flag="--group-port")
    shares: str | None = setting(None, "pipeline: each rank's relative share of the layers, e.g. 1,2, or each "
                                       "rank's layers, first-last, e.g. 16-31,0-15 (rank 0 holds the last ones) "
                                       "(default: in proportion to the memory each rank gives: --memory-budget, or "
                                       "its free memory)", flag="--group-shares", metavar="W,W...")
    timeout: float = setting(20.0, "a member silent or a step unfinished this long means the group is lost: its "
                                   "processes exit so that the group is started again", flag="--group-timeout",
                             metavar="SECONDS")
    join_timeout: float = setting(600.0, "how long rank 0 waits for the members to join and load (and a member "
                                         "tries to join)", flag="--group-join-timeout", metavar="SECONDS")
    handshake_timeout: float = setting(5.0, "a peer of rank 0's join port gets this long to prove the join token, "
                                            "or it is dropped (a member tries again until its join timeout)",
                                       flag="--group-handshake-timeout", metavar="SECONDS")
    check_every: int = setting(CHECK_EVERY, "every Nth step (the first included) each rank checksums its block "
                                            "tables and slot mapping and rank 0 compares them, so that a mirroring "
                                            "bug loses the group rather than giving wrong tokens (1: every step; 0: "
                                            "never)", flag="--group-check", metavar="N")
    memory_budget: ByteSize | None = setting(
        None, "the memory this rank gives the model (its layers and its KV share), e.g. 24GiB: the layers are split "
              "by what each rank gives, and a rank whose part does not fit is refused before any rank loads "
              "(default: the memory free when it starts, on a Mac within Metal's working set)", metavar="SIZE")
    inflight: int = setting(0, "pipeline: batches in flight at once (0: one per stage, so every rank computes)",
                            flag="--group-inflight", metavar="N")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def validate(self) -> None:
        if self.size < 1:
            raise ValueError(f"--group-size must be >= 1, not {self.size}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"--parallel must be one of {', '.join(PARALLEL_MODES)}, not {self.parallel!r}")
        if not 1 <= self.timeout <= 3600:
            raise ValueError(f"--group-timeout must be in [1, 3600] seconds, not {self.timeout}")
        if not 0.1 <= self.handshake_timeout <= 300:
            raise ValueError(f"--group-handshake-timeout must be in [0.1, 300] seconds, not {self.handshake_timeout}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise ValueError(f"--memory-budget must be a positive size, not {self.memory_budget}")
        if self.inflight < 0:
            raise ValueError(f"--group-inflight must be >= 0, not {self.inflight}")
        if self.check_every < 0:
            raise ValueError(f"--group-check must be >= 0 (0: never), not {self.check_every}")
        if self.shares is not None and parse_layer_runs(self.shares, self.size) is None:
            parse_shares(self.shares, self.size)


def require_join_token(token: str) -> None:
    """No group without a join token: its members prove it to rank 0 (and rank 0 to them),
    and proofs keyed with an empty one are proofs any process can make."""
    if not token:
        raise ValueError("a worker group needs a join token to authenticate its members: set $ORCHARD_JOIN_TOKEN "
                         "to the same secret on every rank (`orchard up` makes one for the groups it starts)")


_RUN = re.compile(r"\s*(\d+)-(\d+)\s*")


def parse_layer_runs(text: str, size: int, num_layers: int | None = None) -> list[range] | None:
    """`--group-shares` given as each rank's layers, first-last in rank order ("16-31,0-15":
    the fleet's controller plans a group so, and fetches each rank's files for exactly
    those layers): per rank, its layers; None when it gives relative shares (numbers).
    ValueError: runs that do not tile the layers from 0 on the last rank up to rank 0's
    last (`num_layers`, when given)."""
    runs = [_RUN.fullmatch(item) for item in text.split(",")]
    if not any(runs):
        return None
    if not all(runs):
        raise ValueError(f"--group-shares {text!r}: give either a share per rank (1,2) or each rank's layers "
                         "(16-31,0-15), not both")
    if len(runs) != size:
        raise ValueError(f"--group-shares {text!r} gives the layers of {len(runs)} ranks, not of its {size} ranks")
    out = [range(int(m[1]), int(m[2]) + 1) for m in runs]
    stages = out[::-1]  # stages run in reverse rank order: the last rank's layers come first
    if stages[0].start != 0:
        raise ValueError(f"--group-shares {text!r}: the last rank's layers must start from layer 0")
    if any(not r for r in out) or any(a.stop != b.start for a, b in zip(stages, stages[1:])):
        raise ValueError(f"--group-shares {text!r}: each rank's layers must follow the next rank's, none empty")
    if num_layers is not None and out[0].stop != num_layers:
        raise ValueError(f"--group-shares {text!r} gives layers 0-{out[0].stop - 1}, but the model has "
                         f"{num_layers} layers")
    return out


def parse_shares(text: str, size: int) -> list[float]:
    try:
        shares = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--group-shares {text!r} is not a list of numbers") from None
    if len(shares) != size or any(not s > 0 for s in shares):
        raise ValueError(f"--group-shares needs {size} positive numbers (one per rank), got {text!r}")
    return shares


@dataclass(frozen=True)
class Topology:
    """Where each rank is: its ring address (MLX's collectives) and rank 0's side channel."""

    rank: int
    ring: tuple[tuple[str, int], ...]  # per rank, in rank order
    control: tuple[str, int]  # rank 0's side-channel address

    @property
    def size(self) -> int:
        return len(self.ring)

    def joined(self, addresses: dict[int, str]) -> "Topology":
        """The ring with each member's address as the member itself gave it (`addresses`,
        rank -> HOST:PORT, from its HELLO) in place of this process's flags: a member knows
        where it listens, while another rank's flags may be stale (a Ray bundle that moved).
        A rank that gave none keeps its address from the flags."""
        ring = list(self.ring)
        for rank, address in addresses.items():
            ring[rank] = parse_address(address)
        return replace(self, ring=tuple(ring))

    def with_ring(self, addresses: list[str]) -> "Topology":
        """The ring rank 0 hands every rank (RING), in rank order."""
        if len(addresses) != self.size:
            raise ValueError(f"rank 0 sent {len(addresses)} ring addresses for a group of {self.size}")
        return replace(self, ring=tuple(parse_address(a) for a in addresses))

    def ring_addresses(self) -> list[str]:
        return [f"{h}:{p}" for h, p in self.ring]

    def ring_hostfile(self) -> str:
        """The JSON MLX's ring backend reads from $MLX_HOSTFILE: one list of addresses a rank."""
        return json.dumps([[f"{h}:{p}"] for h, p in self.ring])


def topology(options: GroupOptions, environ=os.environ) -> Topology:
    """This process's place in the group, from the flags or mlx.launch's environment."""
    rank = options.rank
    if rank is None:
        rank = int(environ["MLX_RANK"]) if environ.get("MLX_RANK", "").isdigit() else 0
    if options.hosts:
        ring = [parse_address(a.strip()) for a in options.hosts.split(",") if a.strip()]
    elif options.hostfile:
        ring = read_hostfile(options.hostfile)
    elif environ.get("MLX_HOSTFILE"):
        ring = read_hostfile(environ["MLX_HOSTFILE"])
    else:
        raise ValueError("a group needs its ranks' addresses: --group-hosts, --group-hostfile, or mlx.launch "
                         "(which sets MLX_HOSTFILE and MLX_RANK)")
    if len(ring) != options.size:
        raise ValueError(f"--group-size {options.size} but {len(ring)} ring addresses")
    if not 0 <= rank < len(ring):
        raise ValueError(f"rank {rank} is outside a group of {len(ring)}")
    host0, port0 = ring[0]
    control = (host0, options.port or port0 + CONTROL_PORT_OFFSET)
    return Topology(rank, tuple(ring), control)


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """The ring addresses in a hostfile: MLX's ring hostfile (a list per rank of "ip:port",
    the first is used), or mlx.launch's (`{"hosts": [{"ssh": ..., "ips": [...]}, ...]}` or
    the bare list of hosts; rank r's port is 32323 + r, as mlx.launch assigns them)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the hostfile {path}: {e}") from None
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list) or not hosts:
        raise ValueError(f"the hostfile {path} lists no hosts")
    out = []
    for r, h in enumerate(hosts):
        if isinstance(h, list) and h and isinstance(h[0], str):
            out.append(parse_address(h[0]))
        elif isinstance(h, dict) and h.get("ips"):
            out.append((str(h["ips"][0]), MLX_LAUNCH_STARTING_PORT + r))
        else:
            raise ValueError(f"the hostfile {path}: rank {r}'s entry {h!r} has no ring address (ring backend: "
                             "give each host its \"ips\")")
    return out
