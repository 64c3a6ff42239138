"""`orchard node serve`'s settings (the flags are generated from them, cluster/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ByteSize, setting
from cluster.net import is_loopback, parse_address
from cluster.security import SecurityConfig

DEFAULT_MODELS_DIR = "~/.orchard/models"
DEFAULT_STATE_DIR = "~/.orchard/node"
MAX_COPY_STREAMS = 64


@dataclass(frozen=True)
class NodeConfig:
    router: str = setting("127.0.0.1:50051", "register with this router (or these routers) and report every "
                                             "heartbeat", metavar="HOST:PORT[,HOST:PORT...]")
    grpc_address: str = setting("127.0.0.1:50071", "the Node service's gRPC address (the routers start and stop "
                                                   "workers through it; port 0: any free)", flag="--grpc",
                                metavar="HOST:PORT")
    advertise: str | None = setting(None, "the host the routers and the other Macs reach this one at: its Node "
                                          "service's and its workers' addresses (default: the --grpc host, or "
                                          "this machine's name when that is 0.0.0.0)", metavar="HOST")
    node_id: str | None = setting(None, "this node's name in the fleet (default: the host name; under mutual TLS "
                                        "its certificate's name)")
    memory_budget: ByteSize | None = setting(
        None, "the memory this node gives models, e.g. 48GiB: at most what the machine can (on a Mac Metal's "
              "recommended working set, on Linux the memory available when the agent starts; default: that)",
        metavar="SIZE")
    models_dir: str = setting(DEFAULT_MODELS_DIR, "where the models are: a catalog source names a directory "
                                                  "(with config.json) or a .gguf file in it", metavar="DIR")
    hub_cache: str | None = setting(
        None, "where models fetched from the hub or copied from another Mac go, in huggingface_hub's cache layout "
              "(~/.cache/huggingface/hub shares mlx-lm's downloads; default: DIR/.hub under --models-dir)",
        metavar="DIR")
    disk_budget: ByteSize | None = setting(
        None, "the fetched models' bytes at most this, e.g. 500GiB: the least recently used ones not in use are "
              "deleted to make room (default: no limit but the disk's free space)", metavar="SIZE")
    copy_bandwidth: ByteSize = setting(
        ByteSize(0), "copies of models from other Macs read at most SIZE per second in all, so that serving is "
                     "not starved (0: no limit)", metavar="SIZE")
    copy_streams: int = setting(4, "files copied from another Mac at once (default 4)", metavar="N")
    state_dir: str = setting(DEFAULT_STATE_DIR, "the agent's workers' logs and process ids, in a folder named "
                                                 "after the node id", metavar="DIR")
    max_loaded: int = setting(0, "models this node runs at once at most (0: no limit but memory)", metavar="N")
    join_token: str = setting("", "the routers' join token", env="ORCHARD_JOIN_TOKEN")
    heartbeat_interval: float = setting(
        1.0, "report to the routers every SECONDS (a router's interval, if shorter, wins)", metavar="SECONDS")
    drain_timeout: float = setting(
        60.0, "a worker being stopped gets this long to finish its requests in flight (unless the router says)",
        metavar="SECONDS")
    stop_grace: float = setting(
        15.0, "after its drain (or when the agent stops), a worker gets this long to exit after SIGTERM before "
              "SIGKILL", metavar="SECONDS")
    security: SecurityConfig = setting(default_factory=SecurityConfig, group="security")

    def validate(self) -> None:
        """ValueError naming the flag, its limit and its value."""
        if self.memory_budget is not None and self.memory_budget < 1:
            raise ValueError(f"--memory-budget must be a positive size, not {self.memory_budget}")
        if self.max_loaded < 0:
            raise ValueError(f"--max-loaded must be >= 0, not {self.max_loaded}")
        if self.disk_budget is not None and self.disk_budget < 1:
            raise ValueError(f"--disk-budget must be a positive size, not {self.disk_budget}")
        if not 1 <= self.copy_streams <= MAX_COPY_STREAMS:
            raise ValueError(f"--copy-streams must be in [1, {MAX_COPY_STREAMS}], not {self.copy_streams}")
        if not 0.05 <= self.heartbeat_interval <= 60:
            raise ValueError(f"--heartbeat-interval must be in [0.05, 60] seconds, not {self.heartbeat_interval}")
        for flag, value in (("--drain-timeout", self.drain_timeout), ("--stop-grace", self.stop_grace)):
            if not 0 <= value <= 3600:
                raise ValueError(f"{flag} must be in [0, 3600] seconds, not {value}")
        if self.node_id is not None and not (0 < len(self.node_id) <= 128 and "/" not in self.node_id
                                             and not self.node_id.startswith(".")):
            raise ValueError(f"--node-id must be 1 to 128 characters, no '/', not starting with '.': "
                             f"{self.node_id!r}")
        if not [r for r in self.router.split(",") if r.strip()]:
            raise ValueError("--router names no router")
        host = parse_address(self.grpc_address)[0]
        if not self.join_token and not is_loopback(host):
            raise ValueError(f"--grpc {self.grpc_address} is reachable from other machines and the Node service "
                             "starts processes for whoever calls it: set the fleet's join token "
                             "($ORCHARD_JOIN_TOKEN or --join-token), or bind --grpc to 127.0.0.1")
        self.security.check()
