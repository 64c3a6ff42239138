"""Placement policies: pick one worker among the healthy candidates serving the model.

Load of a worker (see `WorkerRecord.load`): its last report (running + waiting) plus the
requests this router placed there since that report, and never less than this router's
own in-flight count there. Reports arrive every second; the in-flight count is fresh.

`prefix_aware` (the default), after SGLang's cache-aware routing, with an imbalance guard:

    least    = argmin_w (load(w), kv_usage(w))
    affine   = argmax_w (matched(w), -load(w))     matched(w) = leading prompt chunks the
                                                    prefix index attributes to w
    if matched(affine) >= min_match_chunks and not imbalanced(affine, least):
        choose affine                               (its KV cache likely holds the prefix)
    else:                                           a new prefix, or affinity would pile up:
        choose argmin_w (held(w), load(w)) over the w with not imbalanced(w, least)
                                                    held(w) = prefix keys the index gives w:
                                                    new prefixes go where the cache is
                                                    emptiest, so groups spread over workers
    imbalanced(a, l) = load(a) - load(l) > balance_abs_threshold       (default 8 requests)
                       and load(a) > balance_rel_threshold * load(l)   (default 1.5x)

Both thresholds must trip: a small absolute gap never overrides affinity (a prefix hit
saves a whole prefill, worth a few more rows in a decode batch), and neither does a large
relative gap between two lightly loaded workers (1 vs 3). The chosen worker counts as
holding the prompt's prefix while the request is being placed there, and is recorded in
the index once it accepted the request (its first chunk: the prompt is prefilled there),
so the next request with that prefix follows, even one sent at the same time; a request
the worker refuses (a prompt too long for it, a bad field) or never answers records
nothing, so hostile prompts neither fill the index nor point it at caches that never
held them. A prompt too short for one full chunk has no keys and goes to the least
loaded worker.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from cluster.router.prefix_index import PrefixIndex


class Candidate(Protocol):
    worker_id: str

    @property
    def load(self) -> float: ...

    @property
    def kv_usage(self) -> float: ...


class Policy(ABC):
    """Chooses a worker for a request; `candidates` is non-empty, healthy and serves the model.

    `keys` are the prompt's chained prefix keys (`prefix_index.prompt_keys`). Each choice
    is then `settled`, once: the worker accepted the request, or never will (prefix-aware
    policies learn from it). Single-threaded: the router calls it from its event loop.
    """

    name: str = ""

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate], keys: list[bytes]) -> Candidate: ...

    def settled(self, worker_id: str, keys: list[bytes], accepted: bool) -> None:
        """The worker chosen for a request with these keys accepted it (its first chunk
        came) or never will (it refused the request, failed, or the client left first)."""

    def forget(self, worker_id: str) -> None:
        """A worker left: drop what the policy knows about it."""


def _least_loaded(candidates: Sequence[Candidate], tick: int) -> Candidate:
    # Rotate the start so that equal loads spread instead of all landing on the first.
    n = len(candidates)
    order = [candidates[(tick + i) % n] for i in range(n)]
    return min(order, key=lambda w: (w.load, w.kv_usage))


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._next = itertools.count()

    def choose(self, candidates, keys):
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        return ordered[next(self._next) % len(ordered)]


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self):
        self._tick = itertools.count()

    def choose(self, candidates, keys):
        return _least_loaded(candidates, next(self._tick))


class PrefixAware(Policy):
    name = "prefix_aware"

    def __init__(
        self,
        balance_abs_threshold: float = 8,
        balance_rel_threshold: float = 1.5,
        min_match_chunks: int = 1,
        index: PrefixIndex | None = None,
    ):
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.min_match_chunks = min_match_chunks
        self.index = index if index is not None else PrefixIndex()
        self.placing = PrefixIndex()  # chosen, not yet settled: at most a key per in-flight prompt chunk
        self._tick = itertools.count()

    def imbalanced(self, affine: Candidate, least: Candidate) -> bool:
        gap = affine.load - least.load
        return gap > self.balance_abs_threshold and affine.load > self.balance_rel_threshold * least.load

    def choose(self, candidates, keys):
        least = _least_loaded(candidates, next(self._tick))
        if not keys:
            return least
        chosen = self._choose(candidates, keys, least)
        self.placing.insert(keys, chosen.worker_id)
        return chosen

    def _choose(self, candidates, keys, least):
        ids = [w.worker_id for w in candidates]
        cached, placing = self.index.match(keys, ids), self.placing.match(keys, ids)
        matched = {w: max(cached[w], placing[w]) for w in ids}
        affine = max(candidates, key=lambda w: (matched[w.worker_id], -w.load))
        if matched[affine.worker_id] >= self.min_match_chunks and not self.imbalanced(affine, least):
            return affine
        eligible = [w for w in candidates if w is least or not self.imbalanced(w, least)]
        return min(eligible, key=lambda w: (self.index.held[w.worker_id], w.load, w is not least))

    def settled(self, worker_id, keys, accepted):
        if keys:
            self.placing.remove(keys, worker_id)
            if accepted:
                self.index.insert(keys, worker_id)

    def forget(self, worker_id):
        self.index.remove_worker(worker_id)
        self.placing.remove_worker(worker_id)


POLICIES = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAware)}


def make_policy(name: str, **kwargs) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}") from None
    return cls(**kwargs) if cls is PrefixAware else cls()
