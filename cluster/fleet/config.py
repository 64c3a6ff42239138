"""The router's fleet settings (`orchard router serve --catalog FILE ...`): without a
catalog the router runs no fleet and serves only the workers that register with it."""

from __future__ import annotations

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

    @property
    def enabled(self) -> bool:
        return bool(self.catalog)

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
        try:
            parse_duration(self.default_keep_alive, "--default-keep-alive")
        except FleetError as e:  # it names the flag and the forms it takes
            raise ValueError(e.message) from None
