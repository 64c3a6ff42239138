"""Placement by where the KV cache is: the router hashes a prompt's blocks as the worker
does (router/prompt_blocks.py, over the worker's own tokenizer files and prompt code), and
`kv_aware` (router/policy.py) weighs memory, disk and misses against each worker's queue.

Oracles: the worker's own `PromptBuilder` over mlx-lm's tokenizer wrapper (what the engine
gets) for the hashes; a scripted KV map (`FakeKvMap`: the `KvMap.match` / `complete`
contract) for the policy."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cluster.api.tokenizer_files import (PROMPT_FILE, TokenizerFilesError, check_files, files_digest,
                                         tokenizer_files, write_files)
from cluster.kv.hashing import block_hashes
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.config import KvRoutingConfig
from cluster.router.policy import KvAware, PrefixAware, PromptKeys, make_policy
from cluster.router.prefix_index import prompt_keys
from cluster.router.prompt_blocks import Blocks, PromptBlocks, _Model
from cluster.router.registry import WorkerRecord
from tests.conftest import run

ROOT = Path(__file__).resolve().parent.parent
BS = 16
TOOLS = json.dumps([{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])


class FakeAdmin:
    """A worker's WorkerAdmin as far as GetTokenizer goes."""

    def __init__(self, files: pb.TokenizerFiles):
        self.files = files
        self.calls = 0

    async def GetTokenizer(self, request, timeout=None):
        self.calls += 1
        return self.files


def record(worker_id: str, digest: str = "", admin=None, **report) -> WorkerRecord:
    report.setdefault("block_size", BS)
    w = WorkerRecord(worker_id, f"{worker_id}:1", report=pb.LoadReport(worker_id=worker_id, model="m",
                                                                       tokenizer_digest=digest, **report))
    w.admin = admin
    return w


def chat_request(tools: str = "") -> pb.GenerateRequest:
    req = pb.GenerateRequest(model="m", tools=tools)
    req.chat.messages.add(role="system", content="You are a careful orchard assistant. " * 30)
    req.chat.messages.add(role="user", content="Which apples keep best over winter, and why? " * 8)
    req.chat.messages.add(role="assistant", content="Late keepers with thick skins.", reasoning="They store.")
    req.chat.messages.add(role="user", content="And pears?")
    return req


# -- the hashes: the router's equal the worker's ----------------------------------------------
@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory) -> Path:
    """A tiny qwen3 with Qwen3's real chat template (tools, thinking: enable_thinking)."""
    from cluster.modelgen import create_model

    return create_model(tmp_path_factory.mktemp("qwen3-chat") / "m", "qwen3", "tiny", seed=0, chat="qwen3")


MODEL_DIRS = {"tiny": "tiny_model_dir", "thinking": "thinking_model_dir", "gguf": "smollm2_dir"}


@pytest.mark.parametrize("model, kind", [("tiny", "text"), ("tiny", "chat"), ("thinking", "chat_tools"),
                                         ("thinking", "chat"),
                                         pytest.param("gguf", "chat", marks=pytest.mark.slow)])
def test_prompt_blocks_hash_a_prompt_as_the_worker_does(model, kind, request, tmp_path):
    """`gguf`: SmolLM2's GGUF file imported (its tokenizer built from the GGUF's metadata)."""
    from mlx_lm.utils import load_tokenizer

    from cluster.worker.chat_render import RenderPool, jinja_tokenizer
    from cluster.worker.prompt import PromptBuilder

    wrapper = load_tokenizer(request.getfixturevalue(MODEL_DIRS[model]))
    files = tokenizer_files(wrapper, renders_jinja=jinja_tokenizer(wrapper) is not None)
    if kind == "text":
        prompt = pb.GenerateRequest(model="m", text="An orchard in spring: blossom, bees and frost. " * 40)
    else:
        prompt = chat_request(TOOLS if kind == "chat_tools" else "")

    async def main():
        pool = ThreadPoolExecutor(2)
        renders = RenderPool()
        renders.start()
        blocks = PromptBlocks(KvRoutingConfig(router_tokenize_timeout=60, tokenizer_cache=str(tmp_path)))
        try:
            worker = PromptBuilder("m", wrapper, len(wrapper), 1 << 20, None, renders, pool, pool)
            ids = await worker.prompt_token_ids(prompt)
            workers = [record("a", files.digest, FakeAdmin(files), block_size=BS),
                       record("b", files.digest, FakeAdmin(files), block_size=32)]
            assert await blocks.keys(prompt, workers) is None  # no tokenizer yet: fetched now
            await _until_loaded(blocks)
            got = await blocks.keys(prompt, workers)
        finally:
            await blocks.close()
            await renders.close()
            pool.shutdown()
        return ids, got

    ids, got = run(main())
    assert len(ids) > 4 * BS
    assert got.num_tokens == len(ids) and got.digest == files.digest
    # the blocks a worker may serve from its cache (it computes the prompt's last token itself)
    assert got.hashes == {BS: block_hashes(ids[:-1], BS), 32: block_hashes(ids[:-1], 32)}
    assert (tmp_path / files.digest / "tokenizer.json").is_file()  # kept for the next start, by digest


async def _until_loaded(blocks: PromptBlocks, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not blocks._models:
        assert blocks._fetching or blocks._models, "the fetch failed"
        assert time.monotonic() < deadline, "the tokenizer was not loaded in time"
        await asyncio.sleep(0.05)


def test_token_id_prompts_need_no_tokenizer_and_long_ones_are_cut():
    blocks = PromptBlocks(KvRoutingConfig(router_tokenize_max_tokens=40 * BS, router_tokenize_timeout=60))
    ids = list(range(10 * BS + 3))
    request = pb.GenerateRequest(model="m", token_ids=pb.TokenIds(ids=ids))

    async def main():
        try:
            short = await blocks.keys(request, [record("a")])
            request.token_ids.ids.extend(range(100 * BS))
            long = await blocks.keys(request, [record("a")])
        finally:
            await blocks.close()
        return short, long

    short, long = run(main())
    assert short == Blocks(len(ids), {BS: block_hashes(ids[:-1], BS)})
    assert long.num_tokens == 40 * BS and long.hashes[BS] == block_hashes(list(request.token_ids.ids), BS, 40)


class SlowBuilder:
    """The worker's prompt code, slow (a long render): its ids after `delay` seconds."""

    def __init__(self, ids: list[int], delay: float):
        self.ids, self.delay, self.calls = ids, delay, 0

    async def prompt_token_ids(self, request, max_chars=None):
        self.calls += 1
        await asyncio.sleep(self.delay)
        return self.ids


def test_past_the_deadline_the_approximate_map_places_it_and_the_result_fills_the_cache():
    from cluster.router.metrics import RouterMetrics
    from cluster.router.registry import Registry

    metrics = RouterMetrics(Registry(connect=False))
    blocks = PromptBlocks(KvRoutingConfig(router_tokenize_timeout=0.01), metrics)
    ids = list(range(8 * BS))
    slow = SlowBuilder(ids, delay=0.5)
    blocks._models[("m", "d1")] = _Model(slow, chats=True)
    request = pb.GenerateRequest(model="m", text="the same long prompt")
    workers = [record("a", "d1")]

    async def main():
        try:
            late = await blocks.keys(request, workers)
            await asyncio.sleep(0.01)
            deadline = time.monotonic() + 60
            while not blocks._cache and time.monotonic() < deadline:  # it finishes in the background
                await asyncio.sleep(0.05)
            again = await blocks.keys(request, workers)  # from the cache: no second tokenization
        finally:
            await blocks.close()
        return late, again

    late, again = run(main())
    assert late is None and slow.calls == 1
    assert again == Blocks(len(ids), {BS: block_hashes(ids[:-1], BS)}, "d1")
    assert len(again.hashes[BS]) == 7  # a prompt of 8 whole blocks: its last is computed, never served
    assert metrics.tokenize_fallbacks.labels(reason="timeout")._value.get() == 1

    # and the policy, without hashes, places it by the approximate map as prefix_aware would
    policy, baseline = KvAware(), PrefixAware()
    a, b = record("a"), record("b")
    keys = prompt_keys(pb.GenerateRequest(model="m", text="system: a long shared prefix. " * 20))
    for p in (policy, baseline):
        p.settled("b", keys, accepted=True)
    assert policy.choose([a, b], PromptKeys(keys)).worker_id == baseline.choose([a, b], keys).worker_id == "b"


def test_a_long_prompt_waits_for_its_hashes_a_share_of_its_prefill():
    """A prompt whose prefill costs minutes is worth a longer wait for its hashes than the
    configured timeout: placed by the approximate map, it may go to a worker without its
    blocks. Its wait scales with its size over the workers' reported prefill rate."""
    from cluster.router.prompt_blocks import DEADLINE_SHARE

    blocks = PromptBlocks(KvRoutingConfig(router_tokenize_timeout=0.01, kv_prefill_tps=1000))
    ids = list(range(8 * BS))
    slow = SlowBuilder(ids, delay=0.3)
    blocks._models[("m", "d1")] = _Model(slow, chats=True)
    slow_worker = [record("a", "d1", prefill_tokens_per_second=200.0)]
    long_text = pb.GenerateRequest(model="m", text="x" * 4 * 20_000)  # ~20k tokens: 100 s to prefill there
    assert blocks._deadline(20_000, slow_worker) == pytest.approx(DEADLINE_SHARE * 20_000 / 200.0)
    assert blocks._deadline(100, slow_worker) == 0.01  # a short prompt: the configured timeout
    assert blocks._deadline(20_000, [record("b", "d1")]) == pytest.approx(DEADLINE_SHARE * 20_000 / 1000)

    async def main():
        try:
            return await blocks.keys(long_text, slow_worker)
        finally:
            await blocks.close()

    got = run(main())
    assert got is not None and got.hashes[BS] == block_hashes(ids[:-1], BS)


def test_no_tokenizer_reported_or_a_chat_the_router_cannot_render_falls_back():
    blocks = PromptBlocks(KvRoutingConfig())
    blocks._models[("m", "d1")] = _Model(SlowBuilder([1] * 64, 0), chats=False)

    async def main():
        try:
            return (await blocks.keys(chat_request(), [record("a")]),  # no digest reported
                    await blocks.keys(chat_request(), [record("a", "d1")]))  # renders its own way
        finally:
            await blocks.close()

    assert run(main()) == (None, None)


def test_the_router_holds_a_bounded_number_of_tokenizers(monkeypatch, tmp_path):
    from cluster.router import prompt_blocks

    monkeypatch.setattr(prompt_blocks, "MAX_TOKENIZERS", 2)
    monkeypatch.setattr(prompt_blocks, "load_tokenizer", lambda *a: _Model(None, chats=True))
    blocks = PromptBlocks(KvRoutingConfig(tokenizer_cache=str(tmp_path)))

    async def files(digest, workers):
        return tmp_path

    blocks._files = files
    blocks._start_renders = lambda: None

    async def main():
        try:
            for i in range(3):
                await blocks._fetch(f"m{i}", f"d{i}", [])
                blocks._model("m1", "d1", [])  # used: kept over m0
        finally:
            await blocks.close()

    run(main())
    assert sorted(blocks._models) == [("m1", "d1"), ("m2", "d2")]


def test_a_reported_tokenizer_loads_before_the_first_request(monkeypatch, tmp_path):
    """A worker that joins names its tokenizer: the router loads it then, once, so the first
    requests after a (re)start are placed by their blocks, not by the empty approximate map."""
    from cluster.router import prompt_blocks

    monkeypatch.setattr(prompt_blocks, "load_tokenizer", lambda *a: _Model(None, chats=True))
    blocks = PromptBlocks(KvRoutingConfig(tokenizer_cache=str(tmp_path)))
    fetched = []

    async def files(digest, workers):
        fetched.append((digest, [w.worker_id for w in workers]))
        return tmp_path

    blocks._files = files
    blocks._start_renders = lambda: None
    workers = [record("w0", "d0"), record("w1", "d0"), record("w2")]

    async def main():
        try:
            blocks.prepare(workers)
            await _until_loaded(blocks)
            blocks.prepare(workers)  # loaded already: not again
            await asyncio.sleep(0)
        finally:
            await blocks.close()

    run(main())
    assert list(blocks._models) == [("m", "d0")]
    assert fetched == [("d0", ["w0", "w1"])]


def test_tokenizer_files_are_checked_before_use(tmp_path):
    good = pb.TokenizerFiles(files=[pb.TokenizerFile(name=PROMPT_FILE, data=b"{}"),
                                    pb.TokenizerFile(name="tokenizer.json", data=b"{}")])
    good.digest = files_digest(good.files)
    check_files(good, good.digest)
    with pytest.raises(TokenizerFilesError, match="digest"):
        check_files(good, "0" * 64)
    evil = pb.TokenizerFiles(files=[*good.files, pb.TokenizerFile(name="../escape", data=b"x")])
    evil.digest = files_digest(evil.files)
    with pytest.raises(TokenizerFilesError, match="plain file name"):
        check_files(evil, evil.digest)


def test_a_worker_sends_its_tokenizer_and_reports_its_digest(tiny_worker, tmp_path):
    import grpc

    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
    from cluster.router.prompt_blocks import load_tokenizer

    with grpc.insecure_channel(tiny_worker.grpc) as channel:
        admin = pb_grpc.WorkerAdminStub(channel)
        files = admin.GetTokenizer(pb.GetTokenizerRequest(), timeout=60)
        report = admin.GetLoad(pb.GetLoadRequest(), timeout=60)
    assert files.digest and report.tokenizer_digest == files.digest
    check_files(files, report.tokenizer_digest)
    write_files(tmp_path, files)
    model = load_tokenizer(tmp_path, "m", ThreadPoolExecutor(1), renders=None)
    assert model.chats and len(model.builder.tokenizer) > 0


def test_the_router_hashes_a_chat_without_importing_mlx(tiny_model_dir, tmp_path):
    """The router's tokenizer path (files, the worker's prompt code, a render process)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    write_files(tmp_path, tokenizer_files(hf, renders_jinja=True))
    code = f"""
import asyncio, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from cluster.proto.orchard.v1 import orchard_pb2 as pb
import cluster.router.server
from cluster.router.prompt_blocks import load_tokenizer
from cluster.worker.chat_render import RenderPool

async def main():
    renders = RenderPool()
    renders.start()
    model = load_tokenizer(Path({str(tmp_path)!r}), "m", ThreadPoolExecutor(1), renders)
    req = pb.GenerateRequest(model="m")
    req.chat.messages.add(role="user", content="hello " * 50)
    ids = await model.builder.prompt_token_ids(req)
    await renders.close()
    print(len(ids) > 50, "mlx" in sys.modules, any(m.startswith("mlx") for m in sys.modules))

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"], out.stdout + out.stderr


# -- the policy ---------------------------------------------------------------------------------
class FakeKvMap:
    """`KvMap`'s contract: per worker, the hashes in memory and on disk, and whether its map
    is complete (not resyncing)."""

    def __init__(self):
        self.memory: dict[str, set] = {}
        self.disk: dict[str, set] = {}
        self.incomplete: set[str] = set()

    def hold(self, worker_id: str, memory=(), disk=()):
        self.memory.setdefault(worker_id, set()).update(memory)
        self.disk.setdefault(worker_id, set()).update(disk)

    def complete(self, worker_id: str) -> bool:
        return worker_id not in self.incomplete

    def match(self, worker_id: str, hashes: list[bytes]) -> tuple[int, int]:
        memory, disk = self.memory.get(worker_id, set()), self.disk.get(worker_id, set())
        m = 0
        while m < len(hashes) and hashes[m] in memory:
            m += 1
        d = 0
        while m + d < len(hashes) and hashes[m + d] in disk:
            d += 1
        return m, d


IDS = list(range(64 * BS))  # a 1,024-token prompt
HASHES = block_hashes(IDS, BS)


def keys_of(ids=IDS) -> PromptKeys:
    return PromptKeys(approx=[], blocks=Blocks(len(ids), {BS: block_hashes(ids, BS)}, "d1"))


def test_kv_aware_prefers_memory_to_disk_to_a_miss():
    kv = FakeKvMap()
    policy = KvAware(kv_map=kv, prefill_tps=1000, read_tps=50_000)
    memory, disk, miss = record("memory", "d1"), record("disk", "d1"), record("miss", "d1")
    kv.hold("memory", memory=HASHES)
    kv.hold("disk", disk=HASHES)
    assert policy.choose([miss, disk, memory], keys_of()).worker_id == "memory"
    policy.forget("memory")  # (its in-flight credit gone with it)
    assert policy.choose([miss, disk], keys_of()).worker_id == "disk"
    keys = keys_of()
    assert policy.choose([miss], keys).worker_id == "miss" and keys.predicted["miss"] == (0, 0)
    # a prefix half in memory, half on disk beats one all on disk
    kv.hold("half", memory=HASHES[:32], disk=HASHES[32:])
    keys = keys_of()
    policy = KvAware(kv_map=kv, prefill_tps=1000, read_tps=50_000)
    assert policy.choose([record("disk", "d1"), record("half", "d1")], keys).worker_id == "half"
    assert keys.predicted["half"] == (32 * BS, 32 * BS)


def test_kv_aware_passes_a_holder_too_busy_to_pay():
    kv = FakeKvMap()
    policy = KvAware(kv_map=kv, prefill_tps=1000)
    kv.hold("holder", memory=HASHES)
    # its queue costs 5 s of prefill; prefilling the prompt elsewhere costs about 1 s
    busy = record("holder", "d1", queued_prefill_tokens=5000, num_running=2)
    assert policy.choose([busy, record("idle", "d1", num_running=2)], keys_of()).worker_id == "idle"
    # a shorter queue than the prompt's prefill: the holder still wins
    policy = KvAware(kv_map=kv, prefill_tps=1000)
    assert policy.choose([record("holder", "d1", queued_prefill_tokens=500), record("idle", "d1")],
                         keys_of()).worker_id == "holder"
    # a worker's own measured rate counts over the flag's: a fast holder pays its queue
    policy = KvAware(kv_map=kv, prefill_tps=1000)
    fast = record("holder", "d1", queued_prefill_tokens=5000, prefill_tokens_per_second=100_000)
    slow = record("idle", "d1", prefill_tokens_per_second=1000)
    assert policy.choose([fast, slow], keys_of()).worker_id == "holder"


def test_a_reported_queue_drains_as_the_report_ages():
    """A queue reported a while ago has been prefilled since, at the worker's rate."""
    kv = FakeKvMap()
    kv.hold("holder", memory=HASHES)
    busy = record("holder", "d1", queued_prefill_tokens=5000, num_running=2)
    idle = record("idle", "d1", num_running=2)
    busy.last_seen -= 4.5  # 4,500 of its 5,000 queued tokens prefilled since, at 1,000 a second
    assert KvAware(kv_map=kv, prefill_tps=1000).choose([busy, idle], keys_of()).worker_id == "holder"


def test_a_session_s_queued_turns_cost_what_they_miss_not_what_the_worker_reports():
    """A worker reports a waiting prompt whole, its cached blocks too: this router's own
    placements there count by their uncached tokens, until they start."""
    kv = FakeKvMap()
    kv.hold("holder", memory=HASHES)
    policy = KvAware(kv_map=kv, prefill_tps=1000)
    holder, idle = record("holder", "d1"), record("idle", "d1")
    queued = [keys_of() for _ in range(3)]
    assert [policy.choose([holder, idle], k).worker_id for k in queued] == ["holder"] * 3
    holder.report = pb.LoadReport(worker_id="holder", block_size=BS, tokenizer_digest="d1",
                                  queued_prefill_tokens=3 * len(IDS), num_waiting=3)
    assert policy.choose([holder, idle], keys_of()).worker_id == "holder"
    # another client's 3,072 queued tokens there are a real queue: the prompt goes elsewhere
    for k in queued:
        policy.settled("holder", k, accepted=True)
    holder.report = pb.LoadReport(worker_id="holder", block_size=BS, tokenizer_digest="d1",
                                  queued_prefill_tokens=3 * len(IDS), num_waiting=3)
    assert policy.choose([holder, idle], keys_of()).worker_id == "idle"


def test_a_worker_that_measured_no_rate_yet_is_costed_at_the_others_rate():
    """Else one never chosen (slower by the flag's rate) would never measure its own."""
    kv = FakeKvMap()
    kv.hold("new", memory=HASHES[:16])  # a quarter of the prompt: 768 tokens to prefill, against 1,024
    policy = KvAware(kv_map=kv, prefill_tps=1000)
    measured = record("measured", "d1", prefill_tokens_per_second=10_000)
    assert policy.choose([measured, record("new", "d1")], keys_of()).worker_id == "new"


def test_kv_aware_keeps_the_imbalance_guard():
    kv = FakeKvMap()
    kv.hold("holder", memory=HASHES)
    policy = KvAware(kv_map=kv)
    piled = record("holder", "d1", num_running=30)
    assert policy.choose([piled, record("idle", "d1", num_running=2)], keys_of()).worker_id == "idle"


def test_kv_aware_ignores_a_resyncing_map_and_another_tokenizer():
    kv = FakeKvMap()
    kv.hold("holder", memory=HASHES)
    kv.incomplete.add("holder")
    assert KvAware(kv_map=kv).choose([record("holder", "d1", num_running=1), record("other", "d1")],
                                     keys_of()).worker_id == "other"
    kv.incomplete.clear()
    assert KvAware(kv_map=kv).choose([record("holder", "d1", num_running=1), record("other", "d1")],
                                     keys_of()).worker_id == "holder"
    # hashes made with another tokenizer than the holder's name none of its blocks
    assert KvAware(kv_map=kv).choose([record("holder", "d2", num_running=1), record("other", "d1")],
                                     keys_of()).worker_id == "other"


def test_a_burst_follows_its_first_request_until_the_events_arrive():
    kv = FakeKvMap()
    policy = KvAware(kv_map=kv)
    a, b = record("a", "d1"), record("b", "d1", num_running=1)
    first = keys_of()
    assert policy.choose([a, b], first).worker_id == "a"
    a.report = pb.LoadReport(worker_id="a", block_size=BS, tokenizer_digest="d1", num_running=1)
    b.report = pb.LoadReport(worker_id="b", block_size=BS, tokenizer_digest="d1")
    second = keys_of()
    assert policy.choose([a, b], second).worker_id == "a"  # in flight there: credited
    policy.settled("a", first, accepted=True)
    policy.settled("a", second, accepted=True)
    third = keys_of()
    assert policy.choose([a, b], third).worker_id == "a"  # accepted, no report since
    policy.settled("a", third, accepted=True)
    a.report = pb.LoadReport(worker_id="a", block_size=BS, tokenizer_digest="d1", num_running=1)
    assert policy.choose([a, b], keys_of()).worker_id == "b"  # a report without its events: not held


def test_make_policy_makes_kv_aware_the_default():
    from cluster.router.config import RouterConfig

    assert RouterConfig().policy == "kv_aware"
    policy = make_policy("kv_aware", kv_map=FakeKvMap(), prefill_tps=10, read_tps=20)
    assert isinstance(policy, KvAware) and policy.prefill_tps == 10
    assert type(make_policy("prefix_aware", kv_map=None, prefill_tps=10, read_tps=20)) is PrefixAware


@pytest.mark.parametrize("flag, value", [("router_tokenize_threads", 0), ("router_tokenize_timeout", 0),
                                         ("kv_prefill_tps", float("inf")), ("router_tokenize_max_tokens", 0)])
def test_bad_flags_are_refused_by_name(flag, value):
    with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
        KvRoutingConfig(**{flag: value}).check()


# -- end to end: a router and real workers ------------------------------------------------------
def test_a_revisited_chat_goes_where_its_blocks_are_and_the_router_predicts_its_hits(tiny_model_dir, tmp_path):
    """Two tiny workers behind a kv_aware router: each session's second turn goes to the
    worker that served its first, and the cached tokens the router predicted from the
    workers' KV events are those the workers served."""
    import grpc

    from cluster.bench.closed_loop import one_request, scrape
    from cluster.bench.server_metrics import parse, total
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
    from cluster.up import LocalCluster, free_port

    metrics = f"127.0.0.1:{free_port()}"
    c = LocalCluster(tiny_model_dir, workers=2, policy="kv_aware", grpc_address=f"127.0.0.1:{free_port()}",
                     http_address=None, metrics_address=metrics, worker_port_base=0, worker_metrics_port_base=0,
                     log_dir=tmp_path / "logs", worker_args=["--num-kv-blocks", "512"],
                     router_args=["--heartbeat-interval", "0.2", "--router-tokenize-timeout", "30",
                                  "--tokenizer-cache", str(tmp_path / "tokenizers")])

    def chat(*contents: str) -> pb.GenerateRequest:
        roles = ["system"] + ["user", "assistant"] * len(contents)
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role=r, content=t) for r, t in zip(roles, contents)]),
            sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))

    def fallbacks() -> float:
        return total(parse(scrape(metrics)), "orchard_router_tokenize_fallbacks_total")

    async def main():
        async with grpc.aio.insecure_channel(c.router_address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            deadline = time.monotonic() + 120
            while True:  # until the router has the model's tokenizer: a chat placed by its hashes
                before = fallbacks()
                await one_request(stub, chat("warm up"))
                if fallbacks() == before:
                    break
                assert time.monotonic() < deadline, "the router never loaded the tokenizer"
                await asyncio.sleep(0.2)
            sessions = [f"Session {s}: you look after the {tree} trees of the orchard. " * 6
                        for s, tree in enumerate(("apple", "pear", "plum", "cherry"))]
            held = total(parse(scrape(metrics)), "orchard_router_kv_map_blocks", tier="memory")
            first = [await one_request(stub, chat(system, "How do I prune?")) for system in sessions]
            want = held + sum(r.prompt_tokens // BS for r in first)
            while total(parse(scrape(metrics)), "orchard_router_kv_map_blocks", tier="memory") < want:
                assert time.monotonic() < deadline + 120, "the first turns' blocks never reached the router's map"
                await asyncio.sleep(0.1)  # the workers report every 0.2 s
            before = parse(scrape(metrics))
            second = [await one_request(stub, chat(system, "How do I prune?", "Cut in winter.", "And thin?"))
                      for system in sessions]
            after = parse(scrape(metrics))
        return first, second, before, after

    with c:
        first, second, before, after = run(main(), timeout=300)
    assert [r.worker_id for r in second] == [r.worker_id for r in first]
    assert len({r.worker_id for r in first}) == 2  # new sessions spread
    name = "orchard_router_predicted_cached_tokens_total"
    predicted = total(after, name, tier="memory") - total(before, name, tier="memory")
    actual = total(after, "orchard_router_actual_cached_tokens_total") - total(
        before, "orchard_router_actual_cached_tokens_total")
    assert all(r.cached_tokens >= 4 * BS for r in second)
    assert predicted == actual == sum(r.cached_tokens for r in second)


@pytest.mark.parametrize("digest", ["..", "../outside", "/etc", "a/b"])
def test_a_reported_digest_that_is_no_digest_is_never_a_path(digest, tmp_path):
    """The digest comes from a worker's report and names the cache's directory: one that
    is no sha256 digest is refused before the filesystem or the worker is asked."""
    cache = tmp_path / "cache"
    (tmp_path / "outside").mkdir()
    blocks = PromptBlocks(KvRoutingConfig(tokenizer_cache=str(cache)))
    admin = FakeAdmin(pb.TokenizerFiles())

    async def main():
        try:
            with pytest.raises(TokenizerFilesError, match="no sha256 hex digest"):
                await blocks._files(digest, [record("a", digest, admin)])
        finally:
            await blocks.close()

    run(main())
    assert admin.calls == 0 and not cache.exists()


def test_long_token_id_prompts_are_bounded_like_texts():
    """A burst of long token-id prompts (hashed on the pool) takes at most the queue's
    bound of the pool at once; the rest are placed by the approximate map at once."""
    from cluster.router import prompt_blocks

    blocks = PromptBlocks(KvRoutingConfig(router_tokenize_threads=1, router_tokenize_timeout=0.01))
    release, started = asyncio.Event(), []

    async def hash_ids(ids, block_sizes):
        started.append(len(ids))
        await release.wait()

    blocks._hash_ids = hash_ids
    request = pb.GenerateRequest(model="m", token_ids=pb.TokenIds(ids=range((prompt_blocks.INLINE_BLOCKS + 1) * BS)))

    async def main():
        try:
            got = await asyncio.gather(*(blocks.keys(request, [record("a")])
                                         for _ in range(3 * prompt_blocks.QUEUED_PER_THREAD)))
            release.set()
            return got
        finally:
            await blocks.close()

    assert run(main()) == [None] * (3 * prompt_blocks.QUEUED_PER_THREAD)
    assert len(started) == prompt_blocks.QUEUED_PER_THREAD


def test_a_worker_removed_while_the_prompt_is_hashed_is_not_chosen():
    """The pool is taken again after the wait for the prompt's hashes: a worker removed
    during it (here the least loaded one) was still chosen, its attempt sure to fail."""
    from cluster.router.metrics import RouterMetrics
    from cluster.router.proxy import RouterBackend
    from cluster.router.registry import Registry

    class Stop(Exception):
        pass

    class Spy(KvAware):
        def choose(self, candidates, keys):
            self.chosen = super().choose(candidates, keys).worker_id
            raise Stop

    class RemovingBlocks:
        async def keys(self, request, workers):
            registry.remove("a")
            return None

    registry = Registry(connect=False)
    registry.register("a", "a:1", "", pb.LoadReport(worker_id="a", model="m", block_size=BS))
    registry.register("b", "b:1", "", pb.LoadReport(worker_id="b", model="m", block_size=BS, num_running=5))
    policy = Spy()
    backend = RouterBackend(registry, policy, RouterMetrics(registry), prompt_blocks=RemovingBlocks())

    async def main():
        with pytest.raises(Stop):
            async for _ in backend.generate(pb.GenerateRequest(model="m", text="hello")):
                pass

    run(main())
    assert policy.chosen == "b"


def test_tokenizers_are_fetched_a_bounded_number_at_once():
    """Workers reporting many digests (each fetch holds up to a gRPC message): at most
    MAX_FETCHES fetches run at once, and failures past their retry time are not kept."""
    from cluster.router import prompt_blocks

    blocks = PromptBlocks(KvRoutingConfig())
    never = asyncio.Event()

    async def fetch(model, digest, workers):
        await never.wait()

    blocks._fetch = fetch
    blocks._failed = {("m", "old"): time.monotonic() - 1}

    async def main():
        try:
            for i in range(3 * prompt_blocks.MAX_FETCHES):
                assert blocks._model("m", f"{i:064x}", []) is None
            return len(blocks._fetching)
        finally:
            await blocks.close()

    assert run(main()) == prompt_blocks.MAX_FETCHES
    assert blocks._failed == {}
