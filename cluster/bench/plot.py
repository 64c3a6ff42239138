"""A PNG of a run: the TTFT distribution, output tokens/s over time, and (when the
target's metrics were sampled) KV-cache usage per worker. Needs matplotlib (the `bench`
extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cluster.bench.backends import RequestRecord
from cluster.bench.metrics import BenchmarkMetrics, output_token_series
from cluster.bench.server_metrics import ServerSummary


def plot_run(path: str | Path, outputs: list[RequestRecord], t0: float, metrics: BenchmarkMetrics,
             server: ServerSummary | None = None, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    with_kv = bool(server and server.kv_series)
    fig, axes = plt.subplots(1, 3 if with_kv else 2, figsize=(17 if with_kv else 12, 4.5))
    fig.suptitle(title or "orchard bench", fontsize=11)

    ax = axes[0]
    ttfts = np.array([o.ttft for o in ok]) * 1000.0
    if len(ttfts):
        ax.hist(ttfts, bins=min(40, max(5, len(ttfts) // 3)), color="#4C72B0", alpha=0.85)
        stats = metrics.latency["ttft"]
        ax.axvline(stats.median_ms, color="black", linestyle="--", linewidth=1,
                   label=f"median {stats.median_ms:.1f} ms")
        for name, value in stats.percentiles_ms.items():
            if name != "p50":
                ax.axvline(value, color="#C44E52", linestyle=":", linewidth=1, label=f"{name} {value:.1f} ms")
        ax.legend(fontsize=8)
    ax.set_title(f"Time to first token ({len(ttfts)} requests)")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("requests")

    ax = axes[1]
    # about 40 bins, of a round width
    bin_s = next((b for b in (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0) if b >= metrics.duration_s / 40), 60.0)
    times, rate = output_token_series(ok, t0, bin_s=bin_s)
    if len(times):
        ax.step(np.append(times, times[-1] + bin_s), np.append(rate, rate[-1]), where="post", color="#55A868",
                label=f"per {bin_s:g} s")
        ax.axhline(metrics.output_throughput, color="black", linestyle="--", linewidth=1,
                   label=f"mean {metrics.output_throughput:.0f} tok/s")
        ax.legend(fontsize=8)
    ax.set_title("Output tokens/s over time")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)

    if with_kv:
        ax = axes[2]
        peak = 0.0
        for worker, pts in sorted(server.kv_series.items()):
            ys = [v * 100 for _, v in pts]
            peak = max(peak, max(ys, default=0.0))
            ax.plot([t for t, _ in pts], ys, marker=".", label=f"{worker} (peak {max(ys, default=0):.2g}%)")
        ax.set_title("KV-cache usage per worker (server side)")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("% of blocks")
        ax.set_ylim(0, min(100.0, max(1.0, peak * 1.25)))  # small pools and big ones both readable
        ax.legend(fontsize=8)

    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
