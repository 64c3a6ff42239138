"""A rank's part of the model: which layers it holds, loading only them, and running them.

Pipeline parallel. The layers are split into contiguous runs, one a rank, in proportion
to each rank's share (the memory it gives: `memory.py`, or `--group-shares`), counted in weight bytes:
the first stage also holds the embedding, the last the final norm and LM head. As in
mlx-lm's `pipeline()`, the stages run in reverse rank order: rank N-1 embeds and holds
the first layers, rank 0 holds the last ones and the head, so the logits are computed
where the sampler is and nothing comes back. Activations go rank r -> r - 1 (ring
neighbours).

Each rank loads only its part: mlx-lm builds the model lazily from the weight files that
hold its layers (a model with an index: the others are not opened), the other layers are
dropped before anything is evaluated (`prune`: each becomes a pass-through with no
weights), then the part is dequantized / converted and evaluated as `model_runner.load_model`
does a whole model. The model's own code still runs unchanged (`StageRunner`): on a later
stage the first held layer takes the previous stage's hidden state in place of its input,
and on an earlier stage the last held layer's output is the result (`StageOutput` ends
the forward there: the norm, the head and the dropped layers after it never run). A llama
/ qwen2 / qwen3 stage on the CPU runs its layers on the host path (`host_forward.py`), as
the single process does.

Tensor parallel: every rank loads the whole model lazily and mlx-lm's `shard()` splits
its heads and MLPs (MLX's sharded linears all-reduce); members stop after the last layer.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from mlx import nn

from cluster.worker import attention, recurrent
from cluster.worker.kernels import AttentionPlan, needs_plan
from cluster.worker.model_runner import (
    ModelRunner,
    Stage,
    StepBatch,
    check_served,
    ready_to_serve,
    text_args,
)
from cluster.worker.group.split import split_layers  # noqa: F401  (re-exported)
from cluster.worker.group.split import stage_weight_files
from cluster.worker.patching import original_call

log = logging.getLogger(__name__)

# Families a pipeline group serves: each checked against the single process bit for bit
# (tests/test_group.py). Their model code passes only the hidden state from layer to layer.
PIPELINE_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gemma3_text", "deepseek_v3",
                               "qwen3_5", "phi3", "olmo2", "qwen2_moe", "mixtral"})


class StageOutput(Exception):
    """Raised by an earlier stage's last layer: its output is the stage's result."""

    def __init__(self, hidden: mx.array):
        super().__init__("stage output")
        self.hidden = hidden


# -- the split -----------------------------------------------------------------------------------

def stage_of_rank(rank: int, size: int) -> int:
    """Stages run in reverse rank order (mlx-lm's convention): rank size-1 is the first."""
    return size - 1 - rank


# -- finding the parts of a model ------------------------------------------------------------------

def _parts(model: nn.Module):
    """(inner, outer): the module that holds the layers and the embedding, and the one that
    holds the LM head (mlx-lm's Model, or a wrapper's language model)."""
    layer0 = model.layers[0]
    for name, m in model.named_modules():
        if "embed_tokens" in m and "layers" in m and m["layers"] and m["layers"][0] is layer0:
            parent = model
            for part in name.split(".")[:-1]:
                parent = parent[part]
            return m, parent
    raise ValueError(f"cannot find the embedding and layers of a {type(model).__module__} model")


def module_bytes(module, compute_dtype=None) -> int:
    """Bytes of a (lazily loaded) module's weights, its floating-point ones in
    `compute_dtype` when given (what they take once `ready_to_serve` converted them)."""
    from mlx.utils import tree_flatten

    return sum(p.size * compute_dtype.size if compute_dtype is not None and mx.issubdtype(p.dtype, mx.floating)
               else p.nbytes for _, p in tree_flatten(module.parameters()))


def part_bytes(model: nn.Module, compute_dtype=None) -> tuple[list[int], int, int]:
    """(bytes of each layer, of the embedding, of the final norm + LM head) of a lazily
    loaded model (nothing is evaluated), floating-point weights in `compute_dtype` when
    given. A tied head counts the embedding again: the last stage keeps it for the head."""
    inner, outer = _parts(model)
    embed = module_bytes(inner["embed_tokens"], compute_dtype)
    head = module_bytes(inner["norm"], compute_dtype) + (module_bytes(outer["lm_head"], compute_dtype)
                                                         if "lm_head" in outer else embed)
    return [module_bytes(layer, compute_dtype) for layer in model.layers], embed, head


class _ZeroEmbedding(nn.Module):
    """A later stage's embedding: its first held layer takes the previous stage's hidden
    state instead, so the lookup (and its weights) are not needed; zeros of the right shape."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self._dims = (hidden, vocab)
        self._dtype = mx.float32

    def __call__(self, ids):
        return mx.zeros((*ids.shape, self._dims[0]), dtype=self._dtype)

    def as_linear(self, x):  # never reached while serving: the head is the last stage's
        return mx.zeros((*x.shape[:-1], self._dims[1]), dtype=self._dtype)


class _Identity(nn.Module):
    def __call__(self, x, *args, **kwargs):
        return x


_ABSENT: dict[type, type] = {}


def _make_absent(layer: nn.Module) -> None:
    """Drop this layer's weights (lazy: never read) and make it a pass-through."""
    for key in list(layer.keys()):
        del layer[key]
    cls = type(layer)
    if cls not in _ABSENT:
        _ABSENT[cls] = type(cls.__name__, (cls,), {"__call__": lambda self, x, *a, **k: x, "_orchard_absent": True})
    layer.__class__ = _ABSENT[cls]


def prune(model: nn.Module, stage: Stage) -> None:
    """Keep this stage's part of a lazily loaded model: its layers, the embedding on the
    first stage, the norm and head on the last (a tied head keeps the embedding)."""
    inner, outer = _parts(model)
    for i, layer in enumerate(model.layers):
        if i not in stage.layers:
            _make_absent(layer)
    tied = "lm_head" not in outer
    if not stage.embeds and not (stage.heads and tied):
        inner.embed_tokens = _ZeroEmbedding(int(text_args(model).hidden_size), int(text_args(model).vocab_size))
    if not stage.heads:
        inner.norm = _Identity()
        if not tied:
            outer.lm_head = _Identity()


# -- loading a part ---------------------------------------------------------------------------------

def local_weight_files(path: Path, stage: Stage | None) -> list[str] | None:
    """The weight files `stage` reads (None: the model has no index, every rank reads its
    one file): those of its layers, the embedding's on the first stage, the final norm's
    and head's (a tied head: the embedding's) on the last. Anything else outside the
    layers is read by every stage."""
    index = path / "model.safetensors.index.json"
    if stage is None or not index.exists():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    return stage_weight_files(weight_map, stage.layers, stage.embeds, stage.heads)


def load_part(path: str | Path, parallel: str, stage: Stage | None, group=None, cpu_dequantize: str = "auto",
              num_layers: int | None = None):
    """This rank's part of the model at `path`, ready to serve (weights evaluated, modules
    attached as `model_runner.load_model` attaches them): `stage` under pipeline
    parallelism, mlx-lm's `shard(group)` under tensor parallelism."""
    from mlx_lm.utils import load_model

    path = Path(path)
    files = local_weight_files(path, stage if parallel == "pipeline" else None)
    with tempfile.TemporaryDirectory(prefix="orchard-stage-") as tmp:
        where = path
        if files is not None:  # mlx-lm reads every model*.safetensors of a directory: show it ours only
            where = Path(tmp)
            for f in path.iterdir():
                if f.suffix != ".safetensors" or f.name in files:
                    os.symlink(f, where / f.name)
            missing = [f for f in files if not (path / f).exists()]
            if missing:
                raise FileNotFoundError(f"this rank's weight files are not in {path}: {', '.join(missing)}")
        model, _ = load_model(where, lazy=True, strict=files is None)
    check_family(model, parallel)
    check_served(model)  # every layer's spec, on the whole (lazy) model
    if parallel == "pipeline":
        if num_layers is not None and len(model.layers) != num_layers:
            raise ValueError(f"this rank's model has {len(model.layers)} layers, rank 0's {num_layers}")
        prune(model, stage)
        if files is not None:
            _check_complete(model, path, files)
    else:
        model.shard(group)
        attention.layer_specs(model, fresh=True)  # the heads each rank holds
    ready_to_serve(model, cpu_dequantize)
    return model


def _check_complete(model: nn.Module, path: Path, files: list[str]) -> None:
    """Every weight this stage keeps came from its files (mlx-lm loaded them with
    strict=False, so a missing one would stay at its random initial value)."""
    from mlx.utils import tree_flatten

    weights = {}
    for f in files:
        weights.update(mx.load(str(path / f)))
    if hasattr(model, "sanitize"):  # on a fresh instance: some families' sanitize changes the model
        weights = type(model)(model.args).sanitize(weights)
    missing = [name for name, _ in tree_flatten(model.parameters()) if name not in weights]
    if missing:
        raise ValueError(f"weights of this rank's layers are not in its files {files}: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))


def check_family(model: nn.Module, parallel: str) -> None:
    """Refuse, by name, a family the group cannot serve this way."""
    family = attention.model_type(model)
    if parallel == "tensor":
        if not hasattr(model, "shard"):
            raise ValueError(f"model type {family!r} cannot be served tensor parallel: its mlx-lm class has no "
                             "shard(); use --parallel pipeline")
        return
    if family not in PIPELINE_FAMILIES:
        raise ValueError(f"model type {family!r} is not served pipeline parallel (checked families: "
                         f"{', '.join(sorted(PIPELINE_FAMILIES))})")


# -- running a part -----------------------------------------------------------------------------------

_WRAPPED: dict[tuple[type, bool, bool], type] = {}


def _wrap_boundary(layer: nn.Module, runner: StageRunner, takes_input: bool, gives_output: bool) -> None:
    """A stage's first held layer takes the previous stage's hidden state in place of its
    input; its last ends the forward with its output (only while the runner steps)."""
    base = type(layer)
    key = (base, takes_input, gives_output)
    if key not in _WRAPPED:
        original = original_call(base) or base.__call__

        def __call__(self, x, *args, **kwargs):
            r = self._orchard_stage
            if takes_input and r.stage_active and r.stage_input is not None:
                x = r.stage_input.reshape(x.shape)
            out = original(self, x, *args, **kwargs)
            if gives_output and r.stage_active:
                raise StageOutput(out)
            return out

        __call__._orchard_original = original
        _WRAPPED[key] = type(base.__name__, (base,), {"__call__": __call__})
    layer.__class__ = _WRAPPED[key]
    object.__setattr__(layer, "_orchard_stage", runner)


class StageRunner(ModelRunner):
    """The model runner of one rank's part: `forward(batch, hidden)` gives the logits on
    the last stage, the hidden state [T, hidden size] to pass on elsewhere. `stage.heads`
    False with all layers held: a tensor-parallel member (no head)."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, kv_dtype, num_state_slots: int,
                 stage: Stage):
        self.stage_active = False
        super().__init__(model, num_blocks, block_size, kv_dtype, num_state_slots, stage=stage)
        for m in model.modules():
            if isinstance(m, _ZeroEmbedding):
                m._dtype = self.dtype
        held = [model.layers[i] for i in stage.layers]
        if not stage.embeds or not stage.heads:
            takes, gives = not stage.embeds, not stage.heads
            if held[0] is held[-1]:
                _wrap_boundary(held[0], self, takes, gives)
            else:
                if takes:
                    _wrap_boundary(held[0], self, True, False)
                if gives:
                    _wrap_boundary(held[-1], self, False, True)

    def forward(self, batch: StepBatch, stage_input: mx.array | None = None) -> mx.array:
        self.stage_active = True
        try:
            return super().forward(batch, stage_input)
        except StageOutput as out:
            for c in self.kv_caches:
                c.write_pending()
            return out.hidden.reshape(batch.num_tokens, -1)
        finally:
            self.stage_active = False
            self.stage_input = None


def member_batch(plan, runner: StageRunner) -> StepBatch:
    """A member's StepBatch from a decoded plan (`wire.StepPlan`): what `ModelRunner.prepare`
    built on rank 0, without the rows only the head reads."""
    bs = runner.block_size
    block_tables = mx.array(plan.block_tables)
    cu, lens = plan.cu_seqlens_q.tolist(), plan.seq_lens.tolist()
    rec = None
    if runner.has_recurrent:
        entries = [SimpleNamespace(seq=SimpleNamespace(state_slot=int(slot), request_id=f"slot {int(slot)}"),
                                   start=int(start), num_new_tokens=int(n))
                   for slot, start, n in zip(plan.state_slots, plan.starts, plan.counts)]
        rec = recurrent.plan_step(entries)
    return StepBatch(
        input_ids=mx.array(plan.input_ids),
        positions=mx.array(plan.positions),
        slot_mapping=mx.array(plan.slot_mapping),
        cu_seqlens_q=mx.array(plan.cu_seqlens_q),
        seq_lens=mx.array(plan.seq_lens),
        block_tables=block_tables,
        logit_rows=mx.array(np.zeros(0, np.int32)),
        sample_index=[],
        prompt_rows=[],
        plan=AttentionPlan.build(cu, lens, block_tables, bs) if needs_plan(runner.dtype, runner.kv_dtype) else None,
        num_tokens=plan.num_tokens,
        recurrent=rec,
    )


@dataclass(frozen=True)
class Assignment:
    """What rank 0 tells every rank at start: the mode and each rank's part."""

    parallel: str
    size: int
    stages: tuple[tuple[int, int], ...] = ()  # pipeline: per rank, its layers [start, stop)
    num_layers: int = 0

    def stage(self, rank: int) -> Stage:
        if self.parallel == "tensor":
            return Stage(range(self.num_layers), embeds=True, heads=rank == 0)
        start, stop = self.stages[rank]
        return Stage(range(start, stop), embeds=stop - start > 0 and start == 0,
                     heads=stop == self.num_layers)

    def to_json(self) -> dict:
        return {"parallel": self.parallel, "size": self.size, "stages": [list(s) for s in self.stages],
                "num_layers": self.num_layers}

    @classmethod
    def from_json(cls, d: dict) -> Assignment:
        return cls(str(d["parallel"]), int(d["size"]), tuple((int(a), int(b)) for a, b in d["stages"]),
                   int(d["num_layers"]))
