"""A worker group's memory (cluster/worker/group/memory.py): the split follows what each
rank gives now, every rank's part (weights + KV share) is checked before any rank loads,
rank 0's --num-kv-blocks never exceeds what a member holds, members size their KV from
their own --kv-cache-memory-bytes. And a pipelined group's virtual engines: one draft model
for all of them (counted in rank 0's capacity), and a request placed where its prefix is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import BadSize, ByteSize
from cluster.exit_codes import EXIT_PERMANENT
from cluster.up import free_ports
from cluster.worker.config import EngineConfig
from cluster.worker.group.config import GroupOptions
from cluster.worker.group.memory import DoesNotFit, LeastKV, RankPart, check_fit, join_info
from cluster.worker.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token"
GiB = 1 << 30


def test_sizes_take_units_and_refuse_what_is_not_a_size():
    assert ByteSize("24GiB") == 24 * GiB and ByteSize("512MiB") == 512 << 20 and ByteSize("1.5G") == 3 * GiB // 2
    assert ByteSize("4KB") == 4000 and ByteSize("100") == 100 and ByteSize(7) == 7
    for bad in ("lots", "12XB", "-1", "inf", ""):
        with pytest.raises(BadSize):
            ByteSize(bad)


def test_the_budget_flags_parse_and_a_member_reports_them(capsys):
    from cluster.cli import main

    info = join_info(ByteSize("3GiB"), ByteSize("1GiB"))
    assert info == {"memory": 3 * GiB, "memory_from": "budget", "kv_budget": GiB}
    free = join_info(None, None)
    assert free["memory_from"] == "free" and free["memory"] > 0 and free["kv_budget"] == 0
    with pytest.raises(ValueError, match="--memory-budget"):
        GroupOptions(size=2, memory_budget=0).validate()
    assert main(["worker", "serve", "--memory-budget", "lots"]) == EXIT_PERMANENT
    assert "--memory-budget: 'lots' is not a size" in capsys.readouterr().err


# -- the check, alone ------------------------------------------------------------------------------

def _part(rank, memory, weights, per_block=1 << 20, kv_budget=0, budgeted=True, layers=range(0, 2)):
    return RankPart(rank, f"mac{rank}", layers, memory, budgeted, weights, per_block, kv_budget)


def test_a_rank_whose_weights_and_kv_share_do_not_fit_is_refused_with_the_numbers():
    least = LeastKV(blocks=512, context=4096, batches=2)  # 512 blocks of 1 MiB: 0.5 GiB of KV
    fits = [_part(0, 8 * GiB, 4 * GiB, layers=range(2, 4)), _part(1, 8 * GiB, 4 * GiB)]
    check_fit(fits, least, None, 4)
    small = [fits[0], _part(1, 4 * GiB, 4 * GiB, budgeted=False)]
    with pytest.raises(DoesNotFit) as refused:
        check_fit(small, least, None, 4)
    says = str(refused.value)
    assert "rank 1 (mac1, layers 0-1) needs 4.5 GiB (weights 4 GiB + KV 0.5 GiB" in says
    assert "gives 4 GiB (the memory free when it started)" in says and "rank 0" not in says.split(".")[0]
    assert "--memory-budget" in says and "--group-shares" in says


def test_rank_0s_num_kv_blocks_never_exceeds_what_a_member_holds():
    parts = [_part(0, 64 * GiB, GiB), _part(1, 64 * GiB, GiB, kv_budget=100 << 20)]
    check_fit(parts, LeastKV(16, 256, 1), 100, 4)
    with pytest.raises(DoesNotFit, match=r"rank 1 .*--kv-cache-memory-bytes 0.0977 GiB holds 100 KV blocks of its "
                                         r"layers, fewer than rank 0's --num-kv-blocks 101"):
        check_fit(parts, LeastKV(16, 256, 1), 101, 4)
    # without a KV budget of its own, a member holds what its memory leaves
    parts = [_part(0, 64 * GiB, GiB), _part(1, 2 * GiB, GiB)]
    check_fit(parts, LeastKV(16, 256, 1), 1024, 4)
    with pytest.raises(DoesNotFit, match=r"rank 1 .*needs 2 GiB \(weights 1 GiB \+ KV 1 GiB for rank 0's "
                                         r"--num-kv-blocks 1025\) but gives 2 GiB"):
        check_fit(parts, LeastKV(16, 256, 1), 1025, 4)


def test_a_kv_budget_too_small_for_one_full_request_is_refused():
    least = LeastKV(blocks=256, context=4096, batches=1)
    check_fit([_part(0, 64 * GiB, GiB, kv_budget=256 << 20)], least, None, 2)
    with pytest.raises(DoesNotFit, match="holds 255 KV blocks of its layers, fewer than the group's least "
                                         r"\(256 blocks: one 4096-token request\)"):
        check_fit([_part(0, 64 * GiB, GiB, kv_budget=255 << 20)], least, None, 2)


def test_the_split_follows_the_memory_each_rank_gives(tmp_path):
    from mlx_lm.utils import load_model

    from cluster.modelgen import create_model
    from cluster.worker.group.leader import split

    lazy, _ = load_model(create_model(tmp_path / "deep", "llama", "tiny", seed=0, layers=8), lazy=True, strict=False)
    assert split(lazy, GroupOptions(size=2), {0: 8 * GiB, 1: 8 * GiB}) == ((4, 8), (0, 4))
    # rank 1's Mac holds another model and has little free: it gets the fewest layers it can
    assert split(lazy, GroupOptions(size=2), {0: 8 * GiB, 1: GiB // 64}) == ((1, 8), (0, 1))
    assert split(lazy, GroupOptions(size=2, shares="1,1"), {0: 8 * GiB, 1: GiB // 64}) == ((4, 8), (0, 4))


def test_the_split_is_the_layers_the_fleet_gave_each_rank(tmp_path):
    """The fleet's controller fetches a rank's files for the layers it planned (each rank
    only its shards): `--group-shares` as each rank's layers makes the group split exactly
    there, not by its layers' sizes."""
    from mlx_lm.utils import load_model

    from cluster.modelgen import create_model
    from cluster.worker.group.leader import split

    lazy, _ = load_model(create_model(tmp_path / "deep", "llama", "tiny", seed=0, layers=8), lazy=True, strict=False)
    assert split(lazy, GroupOptions(size=3, shares="7-7,1-6,0-0"), {0: GiB, 1: GiB, 2: GiB}) == ((7, 8), (1, 7), (0, 1))
    with pytest.raises(ValueError, match="'5-6,0-4'.*the model has 8"):
        split(lazy, GroupOptions(size=2, shares="5-6,0-4"), {0: GiB, 1: GiB})


@pytest.mark.parametrize("shares, words", [
    ("4-7,0-3,1", "either a share"),
    ("4-7", "2 ranks"),
    ("4-7,0-2", "follow"),
    ("0-3,4-7", "from layer 0"),
    ("4-7,1-3", "from layer 0"),
])
def test_group_shares_as_layers_that_do_not_tile_are_refused(shares, words):
    with pytest.raises(ValueError, match=words) as e:
        GroupOptions(size=2, shares=shares).validate()
    assert shares in str(e.value)


def test_a_rank_reports_its_capacity_from_its_own_kv_budget(tiny_model_dir):
    """A member sized its pool from its default budget whatever it was given; now its
    --kv-cache-memory-bytes, else a share of what its weights leave of the memory it
    gives, never under the group's least."""
    from cluster.worker.group.leader import capacity
    from cluster.worker.model_runner import Stage, kv_bytes_per_block, load_model, weight_dtype

    model, _ = load_model(tiny_model_dir)
    kv_dtype = weight_dtype(model)
    stage = Stage(range(0, 1))
    per_block = kv_bytes_per_block(model, 16, kv_dtype, stage.layers)
    given = capacity(model, stage, EngineConfig(kv_cache_memory_bytes=ByteSize("3MiB")), kv_dtype, 8 * GiB)
    assert given["blocks"] == (3 << 20) // per_block
    lean = capacity(model, stage, EngineConfig(), kv_dtype, given["weights"] + 4 * per_block, least_blocks=7)
    roomy = capacity(model, stage, EngineConfig(), kv_dtype, given["weights"] + (256 << 20), least_blocks=7)
    assert lean["blocks"] == 7 < roomy["blocks"]


# -- with real processes ----------------------------------------------------------------------------

def _env():
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", PYTHONUNBUFFERED="1",
                ORCHARD_JOIN_TOKEN=TOKEN)


def test_a_member_with_too_little_memory_is_refused_before_any_rank_loads(tiny_model_dir):
    """A member given a budget too small for its layers: both ranks exit 78 (permanent: no
    launcher loads the model again to learn the same), rank 0 saying what the member needs
    and gives, before the ring forms or any weight is read."""
    *ring, port = free_ports(3)
    common = ["--model", str(tiny_model_dir), "--group-size", "2", "--group-port", str(port), "--group-hosts",
              ",".join(f"127.0.0.1:{p}" for p in ring), "--group-join-timeout", "120"]
    member = subprocess.Popen([sys.executable, "-m", "cluster.cli", "worker", "serve", *common, "--group-rank", "1",
                               "--memory-budget", "1MiB"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        rank0 = subprocess.run([sys.executable, "-m", "cluster.cli", "worker", "serve", *common, "--group-rank", "0",
                                "--grpc", "127.0.0.1:0", "--metrics", "off"],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_env(), timeout=240)
        member_log = member.communicate(timeout=120)[0]
    finally:
        if member.poll() is None:
            member.kill()
            member.wait()
    assert rank0.returncode == EXIT_PERMANENT, rank0.stderr[-3000:]
    assert member.returncode == EXIT_PERMANENT, member_log[-3000:]
    said = " ".join(rank0.stderr.split())
    assert "does not fit the group's memory: rank 1 (" in said
    assert "but gives 0.000977 GiB (its --memory-budget)" in said
    assert "exit 78: permanent" in said and "Traceback" not in rank0.stderr
    assert "does not fit" in member_log and "Traceback" not in member_log
    # nothing loaded: the ring never formed, no rank reached its weights
    assert "group of 2 up" not in rank0.stderr + member_log and "serving layers" not in member_log


# -- virtual engines: one draft model, prefix-aware placement -----------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from cluster.modelgen import create_model, truncated_copy

    root = tmp_path_factory.mktemp("group-memory")
    model = create_model(root / "llama", "llama", "tiny", seed=0, layers=2)
    return model, truncated_copy(model, root / "llama-draft", 1)


def _virtual_engines(path, config: EngineConfig, virtual: int = 2, draft=None):
    """Rank 0's engines as `load_group_engine` builds them (`group_engine`), over a plain
    model runner: no members."""
    from cluster.worker.group.leader import group_engine
    from cluster.worker.model_runner import ModelRunner, load_model

    model, tokenizer = load_model(path)

    def shared_runner(num_blocks, block_size, kv_dtype, num_state_slots=0):
        return ModelRunner(model, num_blocks, block_size, kv_dtype, num_state_slots)

    return group_engine(model, tokenizer, config, "m", config.num_kv_blocks, virtual, shared_runner, draft)


def _generate(engine, prompts, max_tokens=12) -> list[list[int]]:
    out = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            out[int(o.request_id[1:])] += o.new_token_ids
    return out


def test_a_pipelined_group_loads_one_draft_model_counted_in_rank_0s_capacity(llama, monkeypatch):
    """Every virtual engine had loaded a draft model of its own, and rank 0's capacity left
    out the draft's weights and its pool. Now one is loaded, shared, counted; greedy tokens
    are the single process's with the same draft."""
    from cluster.worker.engine import Engine
    from cluster.worker.group.leader import capacity
    from cluster.worker.group.memory import draft_footprint
    from cluster.worker.model_runner import Stage, load_model, weight_dtype
    from cluster.worker.spec_decode import load_draft
    from cluster.worker.spec_decode.policy import SpecPolicy

    monkeypatch.setattr(SpecPolicy, "limits", lambda self, decodes, proposed, rows, decode_rows=None: list(proposed))
    path, draft_path = llama
    spec = json.dumps({"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 3})
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=4, speculative_config=spec)
    model, tokenizer = load_model(path)
    draft = load_draft(config, tokenizer, 512, "m")
    group = _virtual_engines(path, config, 2, draft)
    proposers = [e.speculator.proposer for e in group.engines]
    assert proposers[0] is not proposers[1] and proposers[0].model is proposers[1].model is draft.model
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [12, 13] * 9, [3, 4, 5, 6, 7] * 4]
    single = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, max_num_seqs=4, speculative_config=spec))
    assert _generate(group, prompts) == _generate(single, prompts)
    assert sum(e.speculator.stats.num_draft_tokens for e in group.engines) > 0
    # counted: its weights and its pool's bytes per block
    kv_dtype = weight_dtype(model)
    stage = Stage.whole(len(model.layers))
    without = capacity(model, stage, config, kv_dtype, 8 * GiB)
    with_draft = capacity(model, stage, config, kv_dtype, 8 * GiB, draft=draft)
    assert with_draft["weights"] == without["weights"] + draft.weight_bytes()
    assert with_draft["blocks"] < without["blocks"]
    assert draft_footprint(config) == (draft.weight_bytes(), draft.kv_bytes_per_block(config.block_size, None))


@pytest.mark.slow
def test_a_two_stage_group_with_a_draft_model_loads_it_once_and_gives_the_single_process_tokens(tmp_path):
    """Through `load_group_engine` with a member process: two batches in flight, one draft
    model on rank 0; every token the single process's with the same draft (logprobs may
    move in the last bits: the batches differ, as in test_two_batches_in_flight_...)."""
    from group_driver import config, draft_config, every_draft, run_workload
    from test_group import run_group

    from cluster.modelgen import create_model, truncated_copy
    from cluster.worker.engine import Engine
    from cluster.worker.spec_decode.policy import SpecPolicy

    model = create_model(tmp_path / "llama", "llama", "tiny", seed=3, layers=4)
    draft = truncated_copy(model, tmp_path / "llama-draft", 1)
    group = run_group(model, 2, inflight=2, draft=str(draft))
    assert group["group"]["draft_models"] == 1
    limits = SpecPolicy.limits
    every_draft()
    try:
        single = Engine.from_pretrained(model, EngineConfig(**dict(config(), speculative_config=draft_config(draft))))
        want = run_workload(single)
    finally:
        SpecPolicy.limits = limits
    assert single.speculator.stats.num_draft_tokens > 0
    assert group["results"].keys() == want["results"].keys()
    for rid, w in want["results"].items():
        got = group["results"][rid]
        if rid == "aborted/0":  # aborted after a number of steps, whose tokens differ with the batches and drafts
            n = min(len(got["tokens"]), len(w["tokens"]))
            assert n and got["tokens"][:n] == w["tokens"][:n]
        else:
            assert got["tokens"] == w["tokens"], rid


def test_a_request_goes_to_the_virtual_engine_that_holds_its_prefix(llama):
    """Least-loaded placement sent a request to the idle engine although the other held
    its prompt's prefix; now it follows the prefix while the loads are near (within one
    request), and its tokens are the single process's. Past that, load wins."""
    from cluster.worker.engine import Engine

    path, _ = llama
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=4)
    group = _virtual_engines(path, config)
    first = list(range(3, 3 + 70))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    group.add_request("a", first, greedy)
    while group.has_unfinished():
        group.step()
    group.add_request("busy", [7] * 20, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert group._owner("a") is None and group._owner("busy") == 0  # engine 0 holds a's prefix, and is busier
    follow = first[:64] + [100, 101, 102]
    group.add_request("b", follow, greedy)
    assert group._owner("b") == 0
    group.add_request("c", first[:64] + [200], greedy)
    assert group._owner("c") == 1  # engine 0 has 2 requests, engine 1 none: load wins
    out: dict[str, list[int]] = {}
    while group.has_unfinished():
        for o in group.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert group.engines[0].stats.prefix_hits >= 64
    single = Engine.from_pretrained(path, config)
    assert out["b"] == _generate(single, [follow], max_tokens=8)[0]
