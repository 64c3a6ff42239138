"""Verification: which draft tokens a request keeps, exactly as if it had not speculated.

A speculating request's step scores 1 + k rows: row j is the distribution of the token
after its context and its first j drafts. Two ways to verify, both exact:

- **Point-mass drafts** (n-gram lookup, a greedy draft model): each row is sampled as a
  plain decode step would sample it (the same processed logits, temperature and filters,
  the same seeded noise for that output index), and the drafts are kept while they equal
  what was drawn; the first row that disagrees, or the row after the last draft, gives
  the one more token. This *is* rejection sampling with q a point mass at the draft d:
  d is kept with probability p(d) = min(1, p(d)/q(d)), and when it is not, the drawn
  token is distributed as p given "not d", which is the normalised residual
  max(0, p - q). Greedy rows take the argmax, so greedy output is unchanged token for
  token, and a seeded request draws the same tokens as without speculation.
- **Drafts sampled from a distribution q** (a draft model sampling at the request's
  temperature): `rejection_sample`, the standard method. Draft d_j is accepted with
  probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from
  the normalised residual max(0, p_j - q_j); when all k are accepted one more is drawn
  from p_k. The output is distributed as p exactly (Leviathan et al. 2023, Chen et al.
  2023); the tests check it with a chi-square test that a planted bug fails.
"""

from __future__ import annotations

import numpy as np

# rejection sampling's uniforms and residual draws (requests whose drafts are sampled are
# unseeded: their draws come from here, as the sampler's unseeded rows from its own key)
_rng = np.random.default_rng()


def accept_drafts(drafts: list[int], drawn: list[int]) -> list[int]:
    """Point-mass verification: `drawn[j]` is the token row j drew (len(drafts) + 1 rows).
    The tokens the request keeps: the drafts that match, then the first drawn token that
    differs (or the draw after the last draft)."""
    out = []
    for d, t in zip(drafts, drawn):
        out.append(t)
        if t != d:
            return out
    out.append(drawn[len(drafts)])
    return out


def acceptance(pd: np.ndarray, qd: np.ndarray) -> np.ndarray:
    """The probability of keeping a draft d: min(1, p(d) / q(d)) (q(d) > 0: d was drawn from q)."""
    return np.minimum(1.0, pd / qd)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """What is drawn from after a rejection, before normalising: max(0, p - q)."""
    return np.maximum(p - q, 0.0)


def normalise(weights: np.ndarray) -> np.ndarray:
    """Rows of non-negative weights scaled to sum to 1 (the last axis)."""
    return weights / weights.sum(axis=-1, keepdims=True)


def sample_rows(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: for each row of `probs` [..., V], the first index whose
    cumulative probability exceeds `u` [...] (uniform in [0, 1))."""
    cdf = np.cumsum(probs, axis=-1)
    idx = (cdf <= u[..., None]).sum(axis=-1)
    return np.minimum(idx, probs.shape[-1] - 1)


def rejection_sample(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, rng: np.random.Generator
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Rejection sampling for R requests at once.

    `p` [R, k + 1, V]: the target's probabilities at each verify row; `q` [R, k, V]: the
    draft distributions the drafts [R, k] were drawn from. Returns (tokens [R, k + 1], n
    [R]): request r keeps tokens[r, :n[r]] (its accepted drafts, then the residual's or
    the bonus row's draw; the rest of the row is padding)."""
    R, k = drafts.shape
    rows = np.arange(R)[:, None]
    cols = np.arange(k)[None, :]
    pd = p[rows, cols, drafts]  # p_j(d_j)
    qd = q[rows, cols, drafts]  # q_j(d_j) > 0: d_j was drawn from q_j
    rejected = rng.random((R, k)) >= acceptance(pd, qd)
    first = np.where(rejected.any(axis=1), rejected.argmax(axis=1), k)  # accepted drafts per request
    rest = residual(p[:, :k], q)
    mass = rest.sum(axis=-1, keepdims=True)
    # p == q leaves no residual (and no rejection ever happens there): draw from p then
    rest = np.where(mass > 0, rest, p[:, :k])
    fixes = sample_rows(normalise(rest), rng.random((R, k)))  # [R, k]: the draw after a rejection at j
    bonus = sample_rows(p[:, k], rng.random(R))
    tokens = np.concatenate([drafts, np.zeros((R, 1), drafts.dtype)], axis=1)
    has_rejection = first < k
    safe = np.minimum(first, k - 1) if k else first
    tokens[np.arange(R), first] = np.where(has_rejection, fixes[np.arange(R), safe] if k else 0, bonus)
    return tokens, first + 1


def verify_sampled_drafts(logits, params, histories, drafts: list[int], q: np.ndarray
                          ) -> tuple[list[int], list[float]]:
    """Rejection sampling for one request whose drafts were drawn from `q` [k, V]:
    `logits` [k + 1, V] its verify rows (float32), `histories` its penalties' history at
    each row. The target's p is what the sampler would draw from at each row (penalties
    and bias, then temperature, top-k, top-p, min-p). Returns the kept tokens and their
    logprobs (of the processed distribution, as the sampler reports them)."""
    import mlx.core as mx

    from cluster.worker.sampler import filtered_probs, process_logits

    rows = [params] * (len(drafts) + 1)
    x = process_logits(logits, rows, histories) if params.processes_logits else logits
    p = np.array(filtered_probs(x, rows), dtype=np.float64)
    p /= p.sum(axis=-1, keepdims=True)
    tokens, n = rejection_sample(p[None], q[None], np.asarray([drafts], dtype=np.int64), _rng)
    kept = tokens[0, : n[0]].tolist()
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    logprobs = [float(lp[j, t].item()) for j, t in enumerate(kept)]
    return kept, logprobs
