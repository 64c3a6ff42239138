"""`orchard bench` / load/bench_serve.py: arrivals, datasets, metrics, /metrics scraping,
and real runs against a worker over gRPC and OpenAI HTTP."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.bench import datasets as ds
from cluster.bench.backends import RequestRecord
from cluster.bench.metrics import compute, parse_goodput
from cluster.bench.serve import arrival_gaps, build_parser, main
from cluster.bench.server_metrics import ServerMetricsSampler, metrics_url, parse

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return ds.Tokenizer(tiny_model_dir)


# -- arrivals -------------------------------------------------------------------------------
def test_arrivals_poisson_and_gamma():
    assert arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5
    poisson = arrival_gaps(20001, 10.0, 1.0, seed=1)[1:]
    assert statistics.mean(poisson) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(poisson) / statistics.mean(poisson) == pytest.approx(1.0, rel=0.05)  # exponential
    bursty = arrival_gaps(20001, 10.0, 0.25, seed=1)[1:]
    assert statistics.mean(bursty) == pytest.approx(0.1, rel=0.1)  # same rate ...
    assert statistics.stdev(bursty) / statistics.mean(bursty) == pytest.approx(2.0, rel=0.1)  # ... CV 1/sqrt(k)
    regular = arrival_gaps(20001, 10.0, 16.0, seed=1)[1:]
    assert statistics.stdev(regular) / statistics.mean(regular) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, 1.0, 0)


# -- datasets ---------------------------------------------------------------------------------
def test_random_dataset_lengths(tokenizer):
    reqs = ds.random_requests(tokenizer, 200, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    assert all(20 <= r.prompt_len <= 60 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in reqs)
    assert not set(t for r in reqs for t in r.prompt) & tokenizer.special_ids
    assert len({r.prompt_len for r in reqs}) > 10  # really drawn from the range
    fixed = ds.random_requests(tokenizer, 5, input_len=32, output_len=8, prefix_len=16, seed=3)
    assert all(r.prompt_len == 48 and r.output_len == 8 and r.prompt[:16] == fixed[0].prompt[:16] for r in fixed)
    text = ds.random_requests(tokenizer, 20, input_len=50, output_len=8, as_text=True, seed=3)
    for r in text:
        assert isinstance(r.prompt, str)
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len
        assert abs(r.prompt_len - 50) <= 5


def test_prefix_repetition_dataset(tokenizer):
    reqs = ds.prefix_repetition_requests(tokenizer, 24, prefix_len=32, suffix_len=8, num_prefixes=3, output_len=4)
    groups = {tuple(r.prompt[:32]) for r in reqs}
    assert len(groups) == 3 and all(len(r.prompt) == 40 for r in reqs)
    assert len({tuple(r.prompt) for r in reqs}) == 24  # suffixes differ
    text = ds.prefix_repetition_requests(tokenizer, 12, prefix_len=32, suffix_len=8, num_prefixes=2, output_len=4,
                                         as_text=True)
    heads = {r.prompt[:40] for r in text}
    assert len(heads) == 2


def test_text_slices_and_custom(tmp_path, tokenizer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The orchard is quiet in the morning. Workers pick apples from every tree. " * 50)
    reqs = ds.text_slice_requests(tokenizer, corpus, 10, input_len=30, output_len=5, prefix_len=8)
    assert all(r.prompt_len == 38 for r in reqs)
    assert len({tuple(r.prompt[:8]) for r in reqs}) == 1
    text = ds.text_slice_requests(tokenizer, corpus, 4, input_len=30, output_len=5, as_text=True)
    assert all("orchard" in r.prompt or "apples" in r.prompt or "tree" in r.prompt for r in text)

    jsonl = tmp_path / "custom.jsonl"
    jsonl.write_text("\n".join([
        json.dumps({"prompt": "Hello there", "output_tokens": 7}),
        json.dumps({"prompt": [5, 6, 7, 8]}),
        json.dumps({"messages": [{"role": "user", "content": "Hi"}]}),
        "",
    ]))
    reqs = ds.custom_requests(jsonl, 5, output_len=3, tokenizer=tokenizer)
    assert [r.output_len for r in reqs] == [7, 3, 3, 7, 3]
    assert reqs[1].prompt == [5, 6, 7, 8] and reqs[2].messages == (("user", "Hi"),)
    chat = ds.as_chat(reqs, tokenizer)
    assert all(r.messages for r in chat) and chat[0].messages == (("user", "Hello there"),)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        ds.custom_requests(bad, 1, 3)


# -- metrics ----------------------------------------------------------------------------------
def _out(start, ttft, gaps, tokens_per_chunk=1, prompt=10):
    o = RequestRecord(success=True, start=start, prompt_tokens=prompt)
    o._chunk(start + ttft, tokens_per_chunk)
    t = start + ttft
    for g in gaps:
        t += g
        o._chunk(t, tokens_per_chunk)
    o.latency = t - start
    o.output_tokens = tokens_per_chunk * (len(gaps) + 1)
    return o


def test_metrics_like_vllm():
    outs = [_out(0.0, 0.1, [0.01] * 9), _out(0.1, 0.3, [0.05] * 4), RequestRecord(success=False, error="boom")]
    m = compute(outs, duration_s=2.0, percentiles=[50, 99], slos=parse_goodput(["ttft:200", "tpot:20"]), t0=0.0)
    assert (m.completed, m.failed) == (1 + 1, 1)
    assert m.total_output_tokens == 15 and m.total_input_tokens == 20
    assert m.request_throughput == pytest.approx(1.0) and m.output_throughput == pytest.approx(7.5)
    assert m.latency["ttft"].mean_ms == pytest.approx(200.0)
    assert m.latency["tpot"].mean_ms == pytest.approx((10.0 + 50.0) / 2)
    assert m.latency["itl"].mean_ms == pytest.approx((9 * 10 + 4 * 50) / 13)
    assert m.latency["e2el"].percentiles_ms["p50"] == pytest.approx((190 + 500) / 2)
    assert m.max_output_tokens_per_s == 15  # all in the first 1-s window
    assert m.goodput == pytest.approx(0.5)  # only the first meets ttft <= 200 ms and tpot <= 20 ms
    assert m.max_concurrent_requests == 2
    with pytest.raises(ValueError):
        parse_goodput(["latency:3"])


EXPOSITION = """\
# TYPE orchard_kv_cache_usage_ratio gauge
orchard_kv_cache_usage_ratio{{model="m",worker="w0"}} {kv}
# TYPE orchard_num_requests_running gauge
orchard_num_requests_running{{model="m",worker="w0"}} {running}
# TYPE orchard_num_requests_waiting gauge
orchard_num_requests_waiting{{model="m",worker="w0"}} 0
# TYPE orchard_num_preemptions_total counter
orchard_num_preemptions_total{{model="m",worker="w0"}} {pre}
# TYPE orchard_prefix_cache_queries_total counter
orchard_prefix_cache_queries_total{{model="m",worker="w0"}} {q}
# TYPE orchard_prefix_cache_hits_total counter
orchard_prefix_cache_hits_total{{model="m",worker="w0"}} {h}
"""


def test_server_summary_from_samples():
    s = ServerMetricsSampler(["127.0.0.1:1"])
    url = s.urls[0]
    assert url == "http://127.0.0.1:1/metrics" and metrics_url("http://h:2/metrics") == "http://h:2/metrics"
    from cluster.bench.server_metrics import ServerSample

    before = parse(EXPOSITION.format(kv=0.0, running=0, pre=2, q=100, h=10))
    s._before[url] = before
    s.samples = [ServerSample(0.0, url, before),
                 ServerSample(0.5, url, parse(EXPOSITION.format(kv=0.75, running=6, pre=3, q=150, h=30))),
                 ServerSample(1.0, url, parse(EXPOSITION.format(kv=0.25, running=2, pre=5, q=300, h=70)))]
    summary = s.summarize({url: s.samples[-1].values})
    assert summary.kv_usage_peak == 0.75 and summary.kv_usage_peak_by_worker == {"w0": 0.75}
    assert summary.running_peak == 6 and summary.preemptions == 3
    assert summary.prefix_cache_queries == 200 and summary.prefix_cache_hit_rate == pytest.approx(0.3)


def test_the_kv_peak_counts_every_step_not_the_samples():
    """A load that comes and goes between two scrapes still has its KV peak: each step's
    usage is counted into the worker's histogram, and the peak is read from it."""
    from cluster.bench.server_metrics import ServerSample
    from cluster.worker.engine import EngineStats
    from cluster.worker.metrics import WorkerMetrics

    stats = EngineStats(num_blocks_total=100)
    metrics = WorkerMetrics("m", "w0", lambda: stats)
    for used in (3, 7):  # before the run: a warm-up
        stats.observe_kv_usage(used / 100)
    s = ServerMetricsSampler(["127.0.0.1:1"])
    url = s.urls[0]
    s._before[url] = before = parse(metrics.render().decode())
    for used in (12, 38, 44, 9):  # the run, with the gauge back at 0 whenever it is scraped
        stats.observe_kv_usage(used / 100)
    after = parse(metrics.render().decode())
    s.samples = [ServerSample(0.0, url, before), ServerSample(1.0, url, after)]
    summary = s.summarize({url: after})
    assert summary.kv_series["w0"] == [(0.0, 0.0), (1.0, 0.0)]  # every sample missed it
    assert summary.kv_usage_peak == 0.5 and summary.kv_usage_peak_by_worker == {"w0": 0.5}  # 0.44 in (0.4, 0.5]
    stats.observe_kv_usage(1.0)  # a full pool lands in the last finite bucket
    again = parse(metrics.render().decode())
    assert s.summarize({url: again}).kv_usage_peak == 1.0


# -- real runs --------------------------------------------------------------------------------
def _args(*argv: str):
    return build_parser().parse_args(["--disable-tqdm", *argv])


def test_bench_grpc_against_a_worker(tiny_worker, tiny_model_dir, tmp_path, capsys):
    result_file, plot = tmp_path / "run.json", tmp_path / "run.png"
    args = _args("--target", tiny_worker.grpc, "--tokenizer", str(tiny_model_dir), "--dataset", "prefix-repetition",
                 "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "16",
                 "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "12",
                 "--num-prompts", "16", "--num-warmups", "2", "--request-rate", "40", "--max-concurrency", "6",
                 "--ignore-eos", "--metrics-url", tiny_worker.metrics, "--metrics-interval", "0.2",
                 "--metric-percentiles", "50,90,99", "--goodput", "ttft:60000", "e2el:60000",
                 "--result-file", str(result_file), "--plot", str(plot), "--save-detailed")
    assert main(args) == 0
    printed = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "Mean TTFT (ms):", "P99 ITL (ms):", "Median TPOT (ms):",
                 "Request goodput (req/s):", "Peak KV-cache usage (%):", "Prefix-cache hit rate (%):", "Preemptions:"):
        assert line in printed, line
    r = json.loads(result_file.read_text())
    assert r["completed"] == 16 and r["failed"] == 0
    assert r["total_output_tokens"] == 16 * 12  # --ignore-eos: exactly the output length
    assert r["total_input_tokens"] == 16 * 80
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert r["p99_ttft_ms"] >= r["median_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0
    server = r["server"]
    assert server["prompt_tokens"] == 16 * 80 and server["generation_tokens"] == 16 * 12  # warm-ups not counted
    assert server["prefix_cache_hit_rate"] > 0.3  # two prefixes, 16 prompts: most prefixes are cached
    assert 0 < server["kv_usage_peak"] <= 1 and server["preemptions"] == 0
    assert len(r["requests"]) == 16 and all(q["output_tokens"] == 12 for q in r["requests"])
    if _has_matplotlib():
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_http_against_a_worker(tiny_worker, tiny_model_dir, tmp_path, backend):
    result_file = tmp_path / "run.json"
    args = _args("--backend", backend, "--target", f"http://{tiny_worker.http}/v1", "--tokenizer",
                 str(tiny_model_dir), "--random-input-len", "24", "--random-output-len", "8",
                 "--random-range-ratio", "0.5", "--num-prompts", "10", "--request-rate", "inf", "--ignore-eos",
                 "--result-file", str(result_file))
    assert main(args) == 0
    r = json.loads(result_file.read_text())
    assert r["completed"] == 10 and r["failed"] == 0
    assert r["total_output_tokens"] >= 10 * 4 and r["mean_ttft_ms"] > 0 and "server" not in r


def test_bench_reports_failures(tmp_path, tiny_model_dir):
    from cluster.up import free_port

    args = _args("--target", f"127.0.0.1:{free_port()}", "--tokenizer", str(tiny_model_dir), "--num-prompts", "3",
                 "--random-input-len", "8", "--random-output-len", "2", "--timeout", "5",
                 "--result-file", str(tmp_path / "r.json"))
    assert main(args) == 1  # nothing completed: a non-zero exit
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["failed"] == 3 and r["errors"] and "Unavailable" in r["errors"][0]


def test_thin_wrapper_and_cli_share_the_arguments(tiny_worker, tiny_model_dir, tmp_path):
    from cluster.cli import build_parser as orchard_parser

    args = orchard_parser().parse_args(["bench", "--target", "h:1", "--num-prompts", "3", "--burstiness", "0.5"])
    assert args.func is main and args.num_prompts == 3 and args.burstiness == 0.5  # `orchard bench` runs bench's main
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Once upon a time", "output_tokens": 4}) + "\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load" / "bench_serve.py"), "--target", tiny_worker.grpc, "--dataset", "custom",
         "--dataset-path", str(jsonl), "--num-prompts", "3", "--ignore-eos", "--disable-tqdm"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:                    3" in proc.stdout
    assert "Total generated tokens:                 12" in proc.stdout


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_sampler_survives_an_unreachable_endpoint():
    async def go():
        from cluster.up import free_port

        s = ServerMetricsSampler([f"127.0.0.1:{free_port()}"], interval=0.05, timeout=1)
        await s.before()
        s.start()
        await asyncio.sleep(0.15)
        return await s.after()

    summary = asyncio.run(go())
    assert summary.errors and summary.kv_usage_peak is None and summary.preemptions is None
