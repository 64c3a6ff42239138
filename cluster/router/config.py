"""The router's configuration: every setting of `orchard router serve`, its default and its
help text (the flags are generated from it, cluster/config.py). The registry's and the
proxy's configs take their defaults from here."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.api.wire import RequestLimits
from cluster.config import ByteSize, setting
from cluster.fleet.config import FleetConfig
from cluster.security import SecurityConfig


# The placement policies (router/policy.py's POLICIES; tests/test_placement.py checks they
# agree): named here so that a config names them without importing the policies.
POLICY_NAMES = ("kv_aware", "least_loaded", "prefix_aware", "round_robin")


def policy_names() -> list[str]:
    return list(POLICY_NAMES)


def assumed_rates(workers, prefill_tps: float, read_tps: float) -> tuple[float, float]:
    """The prefill and disk-read rates (tokens a second) to assume for a worker that has
    measured none yet: the mean of those `workers` (records with a `report`) measured, else
    `prefill_tps` / `read_tps` (the flags'). The flags' alone would make a worker that never
    prefilled look faster or slower than the others for good: never chosen, it would never
    measure its own."""
    prefill = [w.report.prefill_tokens_per_second for w in workers if w.report.prefill_tokens_per_second > 0]
    read = [w.report.kv_disk.read_tokens_per_second for w in workers if w.report.kv_disk.read_tokens_per_second > 0]
    return (sum(prefill) / len(prefill) if prefill else prefill_tps, sum(read) / len(read) if read else read_tps)


@dataclass(frozen=True)
class KvRoutingConfig:
    """How the router hashes prompts into the workers' KV block names and what it assumes
    of a worker's speeds before the worker reports them (router/prompt_blocks.py, policy.py)."""

    router_tokenize_threads: int = setting(2, "threads that tokenize prompts for placement by KV cache",
                                           metavar="N")
    router_tokenize_timeout: float = setting(
        0.05, "a prompt not tokenized within this many seconds is placed by the approximate prefix map (its "
              "tokens still fill the cache for the next request with that prompt)", metavar="SECONDS")
    router_tokenize_max_tokens: int = setting(
        131_072, "only a prompt's first this many tokens are hashed for placement (its text is cut at 4 "
                 "characters a token)", metavar="TOKENS")
    router_tokenize_cache: ByteSize = setting(ByteSize(64 << 20), "memory for prompts' block hashes, least "
                                              "recently used dropped first (64MiB, 1GiB, ...)", metavar="SIZE")
    tokenizer_cache: str = setting("~/.cache/orchard/tokenizers", "where the router keeps the tokenizers it "
                                   "fetched from workers (by digest)", metavar="DIR")
    kv_prefill_tps: float = setting(
        2000.0, "prompt tokens a second a worker is assumed to prefill until it reports its own rate",
        metavar="TOKENS")
    kv_read_tps: float = setting(
        50000.0, "prompt tokens a second a worker is assumed to read back from its disk KV tier until it reports "
                 "its own rate", metavar="TOKENS")

    def check(self) -> None:
        """ValueError naming the flag, the limit and the value."""
        for flag, value, least in (("--router-tokenize-threads", self.router_tokenize_threads, 1),
                                   ("--router-tokenize-max-tokens", self.router_tokenize_max_tokens, 1)):
            if value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
        for flag, value in (("--router-tokenize-timeout", self.router_tokenize_timeout),
                            ("--kv-prefill-tps", self.kv_prefill_tps), ("--kv-read-tps", self.kv_read_tps)):
            if not 0 < value < math.inf:
                raise ValueError(f"{flag} must be a number > 0, got {value:g}")


@dataclass(frozen=True)
class RouterConfig:
    grpc_address: str = setting("127.0.0.1:50051", "gRPC address (Generation + Router services)", flag="--grpc")
    http_address: str | None = setting("127.0.0.1:8080", "OpenAI-compatible HTTP address, or off", flag="--http",
                                       off="off")  # None: no HTTP API
    metrics_address: str | None = setting("127.0.0.1:9100", "Prometheus /metrics address, or off", flag="--metrics",
                                          off="off")  # None: no metrics endpoint
    console: str = setting("on", "the web console on the HTTP port, at / (on or off)", choices=("on", "off"))
    policy: str = setting("kv_aware", "how requests are placed on workers (kv_aware: by where each worker's KV "
                          "cache holds the prompt, from its KV events; prefix_aware: by an approximate map of "
                          "the prompts sent to each)", choices=policy_names)
    join_token: str = setting("", "workers must present it to register (empty: open)",
                              env="ORCHARD_JOIN_TOKEN")
    heartbeat_interval: float = setting(1.0, "seconds between heartbeats/polls")
    missed_heartbeats: int = setting(3, "missed beats before a worker is unhealthy")
    remove_after: float = setting(30.0, "seconds of silence before removal")
    max_attempts: int = setting(4, "placements per request (retries + resumes)")
    worker_wait: float = setting(
        5.0, "how long a request with no healthy worker waits for an unhealthy one to report in", metavar="SECONDS")
    resume_wait: float = setting(
        120.0, "how long a request whose model has no worker that can take it (its sole worker or group "
               "restarting) is held, its stream kept open, for one to register or come back; it then resumes "
               "token-exact. New requests for the model wait as long, then get 503 with Retry-After. The default "
               "covers a restart of a big model: a new process loads tens of GB of weights before it registers. "
               "0: no hold", metavar="SECONDS")
    max_held: int = setting(1000, "requests held at once for a worker of their model (--resume-wait); past it, "
                                  "503 at once")
    stream_idle_timeout: float = setting(
        30.0, "a started stream with no output for this long resumes on another worker (its worker is wedged or "
              "asleep; before the first token a request may queue for long, and keepalive finds dead peers)",
        metavar="SECONDS")
    request_timeout: float | None = setting(
        None, "an OpenAI HTTP request that takes longer is answered 504 and cancelled (a client may ask for less "
              "with X-Request-Timeout; default: no limit)", metavar="SECONDS")
    circuit_threshold: int = setting(3, "failed requests in a row that open a worker's circuit breaker")
    circuit_cooldown: float = setting(
        2.0, "how long an open circuit keeps requests off a worker before one probe (doubling while probes fail)",
        metavar="SECONDS")
    static_workers: tuple[str, ...] = setting((), "a static worker to poll (repeatable)", flag="--worker",
                                              metavar="ADDR", repeat=True)
    limits: RequestLimits = setting(default_factory=RequestLimits, group="request limits")
    security: SecurityConfig = setting(default_factory=SecurityConfig, group="security")
    fleet: FleetConfig = setting(default_factory=FleetConfig, group="fleet (models loaded on demand on node agents)")
    kv: KvRoutingConfig = setting(default_factory=KvRoutingConfig, group="placement by KV cache (--policy kv_aware)")
