"""The disk KV tier across worker restarts, on a real model (SmolLM2-135M-Instruct): a long
prompt served before a graceful stop is read back from disk after it (its cached tokens,
the same output, and its time to first token printed beside the cold one); a worker killed
while it writes serves correctly after a restart."""

from __future__ import annotations

import random
import re
import signal
import time
import urllib.request

import pytest

from cluster.sdk import Client
from cluster.sdk.types import Completion

from tests.conftest import wait_for

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 4000


def ask(grpc: str, prompt: list[int], max_tokens: int = 16) -> tuple[float, Completion]:
    """(seconds to the first token, the whole completion) of one greedy request: the timing
    `load/bench_kv_tier.py` reuses."""
    result = Completion()
    with Client(grpc, timeout=600) as client:
        start, first = time.perf_counter(), None
        for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - start
            result.add(chunk)
    return first, result


def tier_ready(grpc: str, timeout: float = 120.0) -> None:
    """Until the worker reports its disk tier serving (it hashes its weights first)."""
    with Client(grpc, timeout=30) as client:
        wait_for(lambda: client.get_load().kv_disk.enabled, timeout, "the disk tier serving")


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def disk_flags(kv_dir) -> tuple[str, ...]:
    return ("--kv-disk-dir", str(kv_dir), "--num-kv-blocks", "400", "--max-model-len", "4608")


def test_a_restarted_worker_serves_a_long_prompt_from_disk(smollm2_dir, worker_process, tmp_path):
    prompt = random_prompt(PROMPT_TOKENS, seed=42)
    first = worker_process(smollm2_dir, *disk_flags(tmp_path / "kv"), http=False)
    tier_ready(first.grpc)
    cold, _ = ask(first.grpc, prompt)
    warm, from_memory = ask(first.grpc, prompt)  # the prefix from memory: the arithmetic a disk hit repeats
    assert from_memory.usage.cached_tokens >= 3968
    assert first.stop() == 0  # SIGTERM: queued writes flushed first

    again = worker_process(smollm2_dir, *disk_flags(tmp_path / "kv"), http=False)
    tier_ready(again.grpc)
    from_disk_ttft, from_disk = ask(again.grpc, prompt)
    assert from_disk.usage.cached_tokens >= 3968 and from_disk.usage.cached_tokens_disk >= 3968
    assert from_disk.token_ids == from_memory.token_ids
    with Client(again.grpc, timeout=30) as client:
        load = client.get_load()
    assert load.kv_disk.read_tokens_per_second > 0 and load.kv_disk.used_bytes > 0
    print(f"\nTTFT of a {PROMPT_TOKENS}-token prompt: computed {cold:.3f} s, from memory {warm:.3f} s, "
          f"from disk after a restart {from_disk_ttft:.3f} s ({cold / from_disk_ttft:.1f}x lower than computed)")


def blocks_written(metrics: str) -> float:
    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    m = re.search(r"^orchard_kv_disk_blocks_written_total\{[^}]*\} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_worker_killed_while_writing_serves_correctly_after_a_restart(smollm2_dir, worker_process, tmp_path,
                                                                        monkeypatch):
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "kv-write.slow").write_text("0.5")  # each block write waits: the kill lands among them
    monkeypatch.setenv("ORCHARD_FAULT_DIR", str(faults))
    prompt = random_prompt(1000, seed=7)
    doomed = worker_process(smollm2_dir, *disk_flags(tmp_path / "kv"), http=False)
    tier_ready(doomed.grpc)
    _, computed = ask(doomed.grpc, prompt)
    wait_for(lambda: blocks_written(doomed.metrics) >= 4, 60, "some blocks written")
    assert blocks_written(doomed.metrics) < 60, "the writes were meant to be still under way"
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait(30)

    (faults / "kv-write.slow").unlink()
    again = worker_process(smollm2_dir, *disk_flags(tmp_path / "kv"), http=False)
    tier_ready(again.grpc)
    _, restarted = ask(again.grpc, prompt)
    assert 64 <= restarted.usage.cached_tokens_disk < 992, "what was written before the kill, from disk"
    assert restarted.token_ids == computed.token_ids
    assert not list((tmp_path / "kv").rglob("*.part")), "a write cut short leaves no partial file"
