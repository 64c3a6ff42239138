"""Speculative decoding inside continuous batching.

Each step, every running decode that speculates gets up to k draft tokens from a
proposer (`ngram.py`: prompt lookup; `draft.py`: a small model of the same tokenizer
with its own paged KV pool); its entry in the step is then 1 + k rows, scored in the
same packed forward as the other requests' decode rows and prefill chunks. Verification
(`verify.py`) keeps exactly what plain decoding would have produced: greedy rows their
argmax, sampled rows the target distribution (point-mass drafts by sampling each row
and keeping the matching prefix, drafts sampled from a draft distribution by rejection
sampling). K/V written for rejected positions is dropped (`num_computed_tokens` rolls
back, the blocks past the kept tokens are freed), so prefix caching, preemption, n > 1,
stop conditions, logprobs, penalties and structured outputs see only kept tokens.
`policy.py` decides, from measured step times and each request's acceptance, how many
drafts pay at the current batch size. `config.py` parses `--speculative-config`.

The engine's hooks: `Speculator.propose` before the scheduler plans a step (with
`next_step_rows`), the scheduler's drafts-aware decode entries and rollback
(`ScheduledSeq.spec_token_ids`, `BlockManager.trim`), the runner's extra sampled rows,
verification in the step's sample / verify (`step_sampling.verify`), then
`Speculator.step_done` (counts and the policy's step times); at start-up, the policy's
step times measured (`calibration.py`).
"""

from cluster.worker.spec_decode.config import SpeculativeConfig  # noqa: F401


def build_speculator(config, model, model_name: str, hybrid: bool, tokenizer=None, vocab_size: int = 0,
                     tasks: tuple[str, ...] = ("generate",), draft=None):
    """The engine's Speculator for its EngineConfig (None: speculation off), before the
    KV pool is sized (a draft model's pool takes its share: `kv_bytes_per_block`); the
    engine then calls `attach`. ValueError, naming the model, where the engine cannot
    speculate exactly, or has nothing to speculate on (`tasks`: what the model serves;
    an embedding model or a reranker generates nothing). `draft`: a draft model already
    loaded (`load_draft`) whose weights this engine shares instead of loading its own."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None:
        return None
    if "generate" not in tasks:
        raise ValueError(f"speculative decoding cannot serve {model_name}: it serves {' and '.join(tasks)} requests "
                         "only, which generate no tokens to draft; start it without --speculative-config")
    if hybrid:
        raise ValueError(f"speculative decoding cannot serve {model_name}: its recurrent layers' state (a hybrid "
                         "model) would take in the rejected draft tokens and cannot be rolled back; start it without "
                         "--speculative-config")
    from cluster.worker.spec_decode.speculator import Speculator

    proposer = None
    if spec.method == "draft_model":
        from cluster.worker.spec_decode.draft import DraftModelProposer

        proposer = draft.sharing() if draft is not None else DraftModelProposer.load(spec, config, tokenizer,
                                                                                       vocab_size, model_name)
    return Speculator(spec, proposer)


def load_draft(config, tokenizer, vocab_size: int, model_name: str):
    """The draft model of `config`'s `--speculative-config` (a `DraftModelProposer`, for
    `build_speculator`'s `draft`), loaded once for engines that share it; None without one."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    from cluster.worker.spec_decode.draft import DraftModelProposer

    return DraftModelProposer.load(spec, config, tokenizer, vocab_size, model_name)
