"""The router's fleet settings (`orchard router serve --catalog FILE ...`): without a
catalog the router runs no fleet and serves only the workers that register with it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.config import setting

DEFAULT_CONTEXT = 4096
DEFAULT_CONCURRENCY = 4


@dataclass(frozen=True)
class FleetConfig:
    catalog: str | None = setting(
        None, "the fleet's model catalog (SQLite; routers of one fleet share the file): models in it are loaded on "
              "the fleet's nodes when a request names them (default: no fleet)", metavar="FILE")
    load_timeout: float = setting(
        600.0, "how long a load may take (placing the model, starting its workers, loading the weights) and so how "
               "long a request for a model being loaded is held; past it, 503 with Retry-After", metavar="SECONDS")
    default_keep_alive: str = setting(
        "5m", "how long a catalog model with no keep-alive of its own stays loaded after its last request "
              "(Ollama's durations: 5m, 1h30m, 30s; 0: unload after each request; negative: never)",
        metavar="DURATION")
    fleet_context: int = setting(
        DEFAULT_CONTEXT, "the context (--max-model-len) a catalog model's workers get when its entry names none "
                         "(capped by the model's own)", metavar="TOKENS")
    fleet_concurrency: int = setting(
        DEFAULT_CONCURRENCY, "requests of full context the KV pool of a placed worker holds at once (the footprint "
                             "counts that pool)", metavar="N")

    scale_up_wait: float = setting(
        2.0, "a catalog model gets one more replica (up to its --max-replicas) when more than half its requests "
             "over a --scale-window waited longer than this for their first token (from their arrival at the "
             "router)", metavar="SECONDS")
    scale_window: float = setting(
        30.0, "the span a model's waits are judged over; its replicas change at most once in it", metavar="SECONDS")
    scale_down_idle: float = setting(
        120.0, "a model's replicas come down one (to its --min-replicas) when for this long one fewer would have "
               "carried its requests in flight at half their slots, and its waits stayed under half "
               "--scale-up-wait", metavar="SECONDS")

    @property
    def enabled(self) -> bool:
        return bool(self.catalog)

    @property
    def scale_policy(self):
        """The replica rule's settings (`cluster.fleet.scaling`)."""
        from cluster.fleet.scaling import ScalePolicy

        return ScalePolicy(self.scale_up_wait, self.scale_window, self.scale_down_idle)

    def check(self) -> None:
        """ValueError naming the flag, the limit and the value."""
        from cluster.fleet import FleetError
        from cluster.fleet.catalog import parse_duration

        if not self.load_timeout > 0:
            raise ValueError(f"--load-timeout must be > 0 seconds, got {self.load_timeout:g}")
        if self.fleet_context < 1:
            raise ValueError(f"--fleet-context must be >= 1 token, got {self.fleet_context}")
        if self.fleet_concurrency < 1:
            raise ValueError(f"--fleet-concurrency must be >= 1, got {self.fleet_concurrency}")
        for flag, value in (("--scale-up-wait", self.scale_up_wait), ("--scale-window", self.scale_window)):
            if not 0 < value < math.inf:
                raise ValueError(f"{flag} must be > 0 seconds, got {value:g}")
        if not self.scale_window <= self.scale_down_idle < math.inf:
            raise ValueError(f"--scale-down-idle must be at least --scale-window ({self.scale_window:g} s), "
                             f"got {self.scale_down_idle:g}")
        try:
            parse_duration(self.default_keep_alive, "--default-keep-alive")
        except FleetError as e:  # it names the flag and the forms it takes
            raise ValueError(e.message) from None
