"""A draft model: a smaller model of the same tokenizer proposes the drafts.

The draft has its own paged KV pool, indexed by the target's block tables (the same block
ids and slots, one more pool per draft layer), and runs in the same packed step style as
the target: each step, one forward packs every speculating request's rows (the tokens
its draft pool has not seen yet, which is usually the last one or two: the kept tokens
of the last verify step; a whole prompt for a request just prefilled), and samples the
first draft of each from the last row; then k - 1 forwards of one row per request draft
the rest. Positions past the request's tokens (where the drafts go) get their blocks
first, only while enough free blocks are left for the others' next tokens: drafts never
make the scheduler preempt anyone.

What the draft's pool holds is only ever a proposal's input: a request's draft K/V is
trusted up to min(what the draft computed, what the target kept), from scratch after a
preemption (its blocks were freed), and a forked sample (n > 1) or a prefix-cache hit
has its prompt drafted again. Garbage there could only lower the acceptance rate; what
the request outputs is decided by the target's verification alone.

Drafts are the draft model's greedy choice for greedy and seeded requests and for
structured outputs (point-mass proposals, verified by sampling each row: token-exact
with the request's seed). An unseeded sampled request draws its drafts from the draft's
distribution q at the request's temperature and top-k / top-p / min-p, and keeps q, for
`verify.rejection_sample` (more drafts accepted when q is close to the target's p).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from cluster.worker.spec_decode.config import SpeculativeConfig
from cluster.worker.spec_decode.policy import cost_clock
from cluster.worker.spec_decode.state import state_of

log = logging.getLogger(__name__)


@dataclass
class _DraftState:
    computed: int = 0  # positions whose draft K/V are in the draft pool
    preemptions: int = 0  # the request's count when `computed` was set (a preemption resets it)
    probs: np.ndarray | None = None  # [k, V] the draft distributions of this step's drafts (sampled drafts)


class _View:
    """What ModelRunner.prepare reads of a sequence, for a draft forward: the request's
    tokens followed by the drafts so far, over its own block table."""

    __slots__ = ("token_ids", "block_table", "sampling_params")
    wants_prompt_logprobs = False

    def __init__(self, seq, drafts: list[int]):
        self.token_ids = seq.token_ids + drafts if drafts else seq.token_ids
        self.block_table = seq.block_table
        self.sampling_params = seq.sampling_params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def samples_drafts(params) -> bool:
    """Whether a request's drafts are drawn from the draft's distribution (and verified by
    rejection sampling) rather than taken greedily."""
    return not params.greedy and params.seed is None and params.structured is None


class DraftModelProposer:
    free = False  # its drafts cost forwards: the policy decides how many before proposing

    def __init__(self, config: SpeculativeConfig, model, tokenizer):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.max_batched_tokens = 0  # attach(): the engine's step budget (a catch-up forward's rows at most)
        self.runner = None  # attach(): the draft's ModelRunner over the target's block ids
        self.block_manager = None
        self.clock = cost_clock()  # the policy's clock (CPU time on a CPU: see policy.py)
        self.seconds = 0.0  # cost of drafting, in seconds of that clock
        self.rows = 0  # draft rows computed
        self.rng = np.random.default_rng()  # sampled drafts (unseeded requests only)

    @classmethod
    def load(cls, config: SpeculativeConfig, engine_config, target_tokenizer, target_vocab: int,
             model_name: str) -> "DraftModelProposer":
        from cluster.worker.model_runner import has_recurrent_layers, load_model, text_args

        model, tokenizer = load_model(str(draft_directory(config)), engine_config.cpu_dequantize)
        vocab = int(text_args(model).vocab_size)
        if vocab != target_vocab or _vocab(tokenizer) != _vocab(target_tokenizer):
            raise ValueError(f"--speculative-config: the draft model {config.model} has another tokenizer than "
                             f"{model_name} ({vocab} vs {target_vocab} ids, or other tokens): a draft model must "
                             "share the served model's tokenizer")
        if has_recurrent_layers(model):
            raise ValueError(f"--speculative-config: the draft model {config.model} has recurrent layers, whose "
                             "state cannot be rolled back past rejected drafts: use an attention-only draft")
        return cls(config, model, tokenizer)

    def sharing(self) -> "DraftModelProposer":
        """Another proposer over the same draft weights, for another engine (a pipelined
        group's virtual engines: one draft model, each engine its own pool and state)."""
        return type(self)(self.config, self.model, self.tokenizer)

    def weight_bytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(p.nbytes for _, p in tree_flatten(self.model.parameters()))

    def kv_bytes_per_block(self, block_size: int, kv_dtype) -> int:
        from cluster.worker.model_runner import kv_bytes_per_block, weight_dtype

        return kv_bytes_per_block(self.model, block_size, weight_dtype(self.model) if kv_dtype is None else kv_dtype)

    def attach(self, block_manager, max_batched_tokens: int, kv_dtype=None) -> None:
        """Give the draft its KV pool (as many blocks as the target's, indexed by the same ids)
        and the engine's step budget."""
        from cluster.worker.model_runner import ModelRunner

        self.block_manager = block_manager
        self.max_batched_tokens = max_batched_tokens
        self.runner = ModelRunner(self.model, block_manager.num_blocks, block_manager.block_size, kv_dtype)

    # -- proposing -----------------------------------------------------------------------------
    def _state(self, seq) -> _DraftState:
        spec = state_of(seq)
        spec.kind = "draft"
        st = spec.proposer
        if not isinstance(st, _DraftState) or st.preemptions != seq.num_preemptions:
            st = spec.proposer = _DraftState(preemptions=seq.num_preemptions)
        return st

    def propose_batch(self, seqs: list, limits: list[int], num_running: int = 0) -> list[list[int]]:
        """Drafts for each of `seqs` (running decodes), at most `limits[i]` each."""
        t0 = self.clock()
        out: list[list[int]] = [[] for _ in seqs]
        bm = self.block_manager
        spare = bm.num_free_blocks - num_running  # blocks the others' next tokens may need, kept free
        budget = self.max_batched_tokens
        first: list[tuple[int, int, int]] = []  # (index in seqs, start, rows) of the first forward
        for i, (seq, k) in enumerate(zip(seqs, limits)):
            st = self._state(seq)
            st.probs = None
            if k <= 0:
                continue
            start = min(st.computed, seq.num_computed_tokens)
            rows = seq.num_tokens - start
            if rows > budget:  # too far behind (a long prompt just prefilled): catch up, no drafts yet
                if budget > 0:
                    first.append((i, start, budget))
                    budget = 0
                continue
            need = bm.blocks_needed(seq.num_tokens + k - 1) - len(seq.block_table)
            if need > 0 and (need > spare or not bm.allocate_slots(seq, k)):
                continue  # no room for the drafts' positions without risking a preemption
            spare -= max(0, need)
            budget -= rows
            first.append((i, start, rows))
        if not first:
            return out
        drafts: dict[int, list[int]] = {}
        probs: dict[int, list[np.ndarray]] = {}
        entries = []
        for i, start, rows in first:
            seq = seqs[i]
            entries.append((i, _View(seq, []), start, rows))
        # forward 1: catch-up rows and each request's first draft; then one row per request per draft
        while entries:
            logits, rows = self._forward(entries)
            self.rows += sum(n for _, _, _, n in entries)
            greedy = mx.argmax(logits, axis=-1).tolist() if logits.shape[0] else []
            nxt = []
            for (i, view, start, n), r in zip(entries, rows):
                seq = seqs[i]
                st = self._state(seq)
                st.computed = start + n
                if r is None:  # a catch-up chunk that did not reach the end
                    continue
                if samples_drafts(seq.sampling_params):
                    token, q = self._sample(seq, logits[r])
                    probs.setdefault(i, []).append(q)
                else:
                    token = greedy[r]
                drafts.setdefault(i, []).append(token)
                if len(drafts[i]) < limits[i]:
                    pos = view.num_tokens
                    nxt.append((i, _View(seq, drafts[i]), pos, 1))
            entries = nxt
        for i, d in drafts.items():
            out[i] = d
            if i in probs:
                self._state(seqs[i]).probs = np.stack(probs[i])
        self.seconds += self.clock() - t0
        return out

    def _forward(self, entries) -> tuple[mx.array, list[int | None]]:
        """One packed draft forward: the last-row logits [M, V] of the entries that reach
        their view's end, and each entry's row there (None for one that stops short)."""
        from cluster.worker.scheduler import ScheduledSeq, SchedulerOutput

        plan = SchedulerOutput([ScheduledSeq(view, start, n) for _, view, start, n in entries])
        batch = self.runner.prepare(plan)
        logits = self.runner.forward(batch)
        mx.eval(logits, *self.runner.pool_arrays())
        rows, r = [], 0
        for entry in plan.scheduled:
            rows.append(r if entry.sample else None)
            r += entry.sample
        return logits, rows

    def _sample(self, seq, logits: mx.array) -> tuple[int, np.ndarray]:
        """A draft drawn from the draft model's distribution q at the request's temperature
        and top-k / top-p / min-p (q kept for rejection sampling)."""
        from cluster.worker.sampler import filtered_probs

        q = np.array(filtered_probs(logits[None, :], [seq.sampling_params])[0], dtype=np.float64)
        q /= q.sum()
        return int(self.rng.choice(q.shape[0], p=q)), q

    def seconds_per_row(self) -> float:
        return self.seconds / self.rows if self.rows else 0.0


def draft_directory(config: SpeculativeConfig) -> Path:
    """The draft model's directory; ValueError, naming it, where it is not an mlx-lm model's."""
    where = Path(config.model).expanduser()
    if not (where / "config.json").is_file():  # else mlx-lm takes it for a hub repo id
        raise ValueError(f"--speculative-config: the draft model directory {config.model} "
                         + ("has no config.json (not an mlx-lm model directory)" if where.is_dir() else
                            "does not exist"))
    return where


def _vocab(tokenizer) -> dict:
    get = getattr(tokenizer, "get_vocab", None)
    return get() if get is not None else {}
