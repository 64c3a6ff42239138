"""Batched sampling with per-row parameters.

Greedy rows take the argmax. Other rows: temperature, then top-k, top-p and min-p
filters, then the Gumbel-max trick. A row with a seed draws its noise from a key derived
from (seed, index of the token in the output), so the same seed gives the same tokens
whatever else shares the batch, and after a preemption too.

Before any of that, `process_logits` changes the rows that ask for it, and only those:
a grammar's bitmask (disallowed tokens to -inf), logit bias, then the repetition penalty
(over prompt and output) and the frequency and presence penalties (over the output), in
vLLM's order. Rows that ask for none are not touched, and a batch where no row asks
skips it entirely.

Logprobs are of the model's distribution after that processing (vLLM's "processed
logprobs"), before temperature and the top-k/top-p/min-p filters: what the request's own
settings made of the model, so a token that bias or a grammar rules out has logprob
-inf and never appears among the top alternatives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cluster.worker.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens, when any row asked for logprobs
    top_logprobs: list[list[tuple[int, float]] | None]  # per row, when asked


def process_logits(logits: mx.array, params: list[SamplingParams], histories=None,
                   bitmask: np.ndarray | None = None, masked_rows: list[int] = ()) -> mx.array:
    """`logits` [N, V] with the per-row processing applied to the rows that ask for it.

    `histories[i]` is (token ids so far, number of prompt tokens) of row i, needed by rows
    with penalties. `bitmask` [len(masked_rows), ceil(V / 32)] int32 holds one allowed-token
    bitmask (bit t % 32 of word t // 32) for each of `masked_rows`.

    The touched rows are processed in numpy, sparsely (only the biased and the seen
    tokens of a row are touched), and put back with one gather: MLX's CPU scatter and
    selects over a [rows, vocabulary] array cost milliseconds."""
    N, V = logits.shape
    touched = sorted(set(masked_rows) | {i for i, p in enumerate(params) if p.processes_logits})
    if not touched:
        return logits
    x = np.array(logits[mx.array(touched)] if len(touched) < N else logits)
    if len(masked_rows):
        allowed = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")[:, :V]
        where = {row: k for k, row in enumerate(masked_rows)}
    for r, i in enumerate(touched):
        p, row = params[i], x[r]
        if len(masked_rows) and i in where:
            row[allowed[where[i]] == 0] = -np.inf
        if not p.processes_logits:
            continue
        if p.logit_bias:
            ids, values = _bias_arrays(p.logit_bias, V)
            row[ids] += values
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            tokens, num_prompt = histories[i]
            tokens = np.asarray(tokens, dtype=np.int64)
        if p.repetition_penalty != 1.0:
            # a token seen twice is written twice with the same value: no need to dedupe
            v = row[tokens]
            row[tokens] = np.where(v > 0, v / np.float32(p.repetition_penalty), v * np.float32(p.repetition_penalty))
        if p.presence_penalty or p.frequency_penalty:
            ids, counts = np.unique(tokens[num_prompt:], return_counts=True)
            row[ids] -= (np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty)).astype(np.float32)
    if len(touched) == N:
        return mx.array(x)
    order = list(range(N))
    for r, i in enumerate(touched):
        order[i] = N + r
    return mx.concatenate([logits, mx.array(x)])[mx.array(order)]


@functools.lru_cache(maxsize=1024)
def _bias_arrays(bias: tuple[tuple[int, float], ...], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    kept = [(t, b) for t, b in bias if t < vocab_size]
    return (np.array([t for t, _ in kept], dtype=np.int64), np.array([b for _, b in kept], dtype=np.float32))


def _seed_for(seed: int, step: int) -> int:
    return hash((seed, step)) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, seed: int = 0):
        self.key = mx.random.key(seed)

    def _next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def __call__(self, logits: mx.array, params: list[SamplingParams], steps: list[int], histories=None,
                 bitmask: np.ndarray | None = None, masked_rows: list[int] = ()) -> SampleResult:
        """logits [N, V] float32; `steps[i]` is the index of the token row i produces;
        `histories`, `bitmask`, `masked_rows` as `process_logits` takes them."""
        N, V = logits.shape
        if masked_rows or any(p.processes_logits for p in params):
            logits = process_logits(logits, params, histories, bitmask, masked_rows)
        greedy = [p.greedy for p in params]
        tokens = mx.argmax(logits, axis=-1)
        if not all(greedy):
            sampled = self._sample(logits, params, steps, greedy)
            tokens = mx.where(mx.array(greedy), tokens, sampled)
        top: list[list[tuple[int, float]] | None] = [None] * N
        if not any(p.logprobs is not None for p in params):
            # log-softmax over the vocabulary is costly on the CPU: only when asked
            mx.eval(tokens)
            return SampleResult(tokens.tolist(), None, top)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        k = max((p.logprobs or 0) for p in params)
        if k:
            top_ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
            top_vals = mx.take_along_axis(logprobs, top_ids, axis=-1)
            mx.eval(tokens, chosen, top_ids, top_vals)
            ids, vals = top_ids.tolist(), top_vals.tolist()
        else:
            mx.eval(tokens, chosen)
        for i, p in enumerate(params):
            if p.logprobs is not None:
                ranked = sorted(zip(ids[i], vals[i]), key=lambda t: -t[1])[: p.logprobs] if k else []
                top[i] = [(t, v) for t, v in ranked if v != -float("inf")]
        return SampleResult(tokens.tolist(), chosen.tolist(), top)

    def _sample(self, logits, params, steps, greedy) -> mx.array:
        N, V = logits.shape
        x = filtered(logits, params)
        noise = []
        shared = None
        for p, step, g in zip(params, steps, greedy):
            if g:
                noise.append(mx.zeros((V,), dtype=mx.float32))
            elif p.seed is not None:
                noise.append(mx.random.gumbel(shape=(V,), key=mx.random.key(_seed_for(p.seed, step))))
            else:
                if shared is None:
                    shared = mx.random.gumbel(shape=(N, V), key=self._next_key())
                noise.append(shared[len(noise)])
        return mx.argmax(x + mx.stack(noise), axis=-1)


def filtered(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """What a sampled row draws from, as logits: divided by the temperature, with the
    tokens top-k, top-p and min-p leave out at -inf (each row by its own parameters)."""
    N, V = logits.shape
    temps = mx.array([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=mx.float32)
    x = logits / temps[:, None]
    neg_inf = mx.array(-float("inf"), dtype=x.dtype)
    if any(p.top_k > 0 for p in params):
        ks = mx.array([p.top_k if 0 < p.top_k < V else V for p in params], dtype=mx.int32)
        sorted_desc = -mx.sort(-x, axis=-1)
        kth = mx.take_along_axis(sorted_desc, (ks - 1)[:, None], axis=-1)
        x = mx.where(x < kth, neg_inf, x)
    if any(p.top_p < 1.0 for p in params) or any(p.min_p > 0 for p in params):
        probs = mx.softmax(x, axis=-1)
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        top_p = mx.array([p.top_p for p in params], dtype=mx.float32)[:, None]
        min_p = mx.array([p.min_p for p in params], dtype=mx.float32)[:, None]
        # keep a token if the mass before it is < top_p (the top token always stays)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = (mass_before < top_p) & (sorted_probs >= min_p * sorted_probs[:, :1])
        keep = mx.put_along_axis(mx.zeros((N, V), dtype=mx.bool_), order, keep_sorted, axis=-1)
        x = mx.where(keep, x, neg_inf)
    return x


def filtered_probs(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """The distribution a sampled row draws from (`filtered`, softmaxed): float32 [N, V]."""
    return mx.softmax(filtered(logits, params), axis=-1)
