"""Client-side metrics of a run, computed the way `vllm bench serve` does.

- TTFT: send -> first chunk with output
- TPOT: (E2E - TTFT) / (output tokens - 1), per request, for requests with > 1 token
- ITL: gaps between consecutive chunks, pooled over all requests
- E2E: send -> last chunk
- goodput: requests per second that met every SLO given (TTFT, TPOT, E2E in ms)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cluster.bench.backends import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


@dataclass
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[str, float]  # "p99" -> ms

    @classmethod
    def of(cls, seconds: list[float], percentiles: list[float]) -> "LatencyStats":
        a = np.asarray(seconds or [0.0], dtype=np.float64) * 1000.0
        return cls(float(a.mean()), float(np.median(a)), float(a.std()),
                   {_pname(p): float(np.percentile(a, p)) for p in percentiles})


def _pname(p: float) -> str:
    return f"p{p:g}"


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    cached_input_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float  # the best 1-s window
    max_concurrent_requests: int
    goodput: float | None
    latency: dict[str, LatencyStats] = field(default_factory=dict)


def tpot_of(o: RequestRecord) -> float | None:
    return (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else None


def output_token_series(outputs: list[RequestRecord], t0: float, bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times relative to t0, output tokens/s in each bin) over the run."""
    times = [t - t0 for o in outputs for t in o.chunk_times]
    tokens = [n for o in outputs for n in o.chunk_tokens]
    if not times:
        return np.zeros(0), np.zeros(0)
    nbins = max(1, int(math.ceil(max(times) / bin_s)))
    counts = np.zeros(nbins)
    for t, n in zip(times, tokens, strict=True):
        counts[min(nbins - 1, int(max(0.0, t) / bin_s))] += n
    return np.arange(nbins) * bin_s, counts / bin_s


def max_concurrency_seen(outputs: list[RequestRecord]) -> int:
    events = []
    for o in outputs:
        if o.latency > 0:
            events += [(o.start, 1), (o.start + o.latency, -1)]
    best = cur = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


def compute(outputs: list[RequestRecord], duration_s: float, percentiles: list[float],
            slos: dict[str, float] | None = None, t0: float | None = None) -> BenchmarkMetrics:
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    tpots = [t for o in ok if (t := tpot_of(o)) is not None]
    itls = [x for o in ok for x in o.itl]
    e2els = [o.latency for o in ok]
    total_in = sum(o.prompt_tokens for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    goodput = None
    if slos:
        good = 0
        for o in ok:
            tpot = tpot_of(o) or 0.0
            if (o.ttft * 1000 <= slos.get("ttft", math.inf) and tpot * 1000 <= slos.get("tpot", math.inf)
                    and o.latency * 1000 <= slos.get("e2el", math.inf)):
                good += 1
        goodput = good / duration_s if duration_s > 0 else 0.0
    _, series = output_token_series(ok, t0 if t0 is not None else min((o.start for o in ok), default=0.0))
    dur = duration_s if duration_s > 0 else float("nan")
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        cached_input_tokens=sum(o.cached_tokens for o in ok),
        request_throughput=len(ok) / dur,
        output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur,
        max_output_tokens_per_s=float(series.max()) if len(series) else 0.0,
        max_concurrent_requests=max_concurrency_seen(outputs),
        goodput=goodput,
        latency={"ttft": LatencyStats.of(ttfts, percentiles), "tpot": LatencyStats.of(tpots, percentiles),
                 "itl": LatencyStats.of(itls, percentiles), "e2el": LatencyStats.of(e2els, percentiles)},
    )
