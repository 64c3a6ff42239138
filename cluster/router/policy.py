"""Placement policies: pick one worker among the healthy candidates serving the model.

Load of a worker (see `WorkerRecord.load`): its last report (running + waiting) plus the
requests this router placed there since that report, and never less than this router's
own in-flight count there. Reports arrive every second; the in-flight count is fresh.

`kv_aware` (the default) places a request where its prompt's KV blocks are, by what the
workers say they hold (their KV events, `router/kv_map.py`), at the cost of each tier:

    N = the prompt's tokens; per candidate w (bs its block size, the blocks hashed with its
    tokenizer, router/prompt_blocks.py):
    m, d     = leading blocks w holds in memory, then the next ones on its disk (KvMap.match;
               0, 0 while w's map is resyncing); blocks this router placed there and w has not
               reported yet count as in memory, so a burst with one prefix follows its first
    miss     = N - (m + d) * bs                       tokens to prefill
    t(w)     = (queue(w) + miss) / prefill_tps(w) + d * bs / read_tps(w)
               queue(w) = pending_miss(w) + max(0, queued_prefill(w) - age(w) * prefill_tps(w)
                                                   - pending(w))
               pending: the prompts this router placed on w that have not started (no first
               chunk yet), pending_miss their uncached tokens; queued_prefill: the prompt
               tokens w reports waiting or mid-prefill, less what it prefilled since (the
               report is age(w) seconds old). A worker counts a waiting prompt whole, its
               cached blocks too, so this router's own are taken out of the report and
               counted by what they miss (a session's queued turns cost little where their
               history is); the rates are w's
               measured ones (LoadReport), else the mean of the candidates' measured ones,
               else --kv-prefill-tps / --kv-read-tps
    choose argmin t(w) over the w with not imbalanced(w, least), ties to the one holding
    more of the prompt (a burst's later requests wait for its first's prefill either way,
    and only there find it all after), then to the lower load

So a session goes back to the worker that holds its context unless that worker's queue
costs more than prefilling the context elsewhere, and never to one the imbalance guard
below rules out. A prompt no worker holds any block of (by the events, or placed there
and not yet reported) goes where the approximate map below sends it: it learns a placement
as soon as the worker accepts it, before the worker's next report carries the events. So
does a request whose hashes are not known in time (no tokenizer yet, past the tokenizing
deadline).

`prefix_aware`, after SGLang's cache-aware routing, with an imbalance guard:

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
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cluster.router.config import KvRoutingConfig, assumed_rates
from cluster.router.prefix_index import PrefixIndex
from cluster.router.prompt_blocks import Blocks


class Candidate(Protocol):
    worker_id: str

    @property
    def load(self) -> float: ...

    @property
    def kv_usage(self) -> float: ...


@dataclass
class PromptKeys:
    """What a policy knows of a request's prompt: `approx`, its chained prefix keys
    (`prefix_index.prompt_keys`); `blocks`, its KV block hashes as the workers name them
    (None: not known in time). A policy notes what it expected of its choice: `predicted`,
    per worker, (tokens in memory, tokens on disk); `credited`, per worker, the hashes it
    counts as placed there until the choice is settled, and `pending`, (prompt tokens,
    uncached tokens) it counts in the worker's queue as long."""

    approx: list[bytes] = field(default_factory=list)
    blocks: Blocks | None = None
    predicted: dict[str, tuple[int, int]] = field(default_factory=dict)
    credited: dict[str, list[bytes]] = field(default_factory=dict)
    pending: dict[str, tuple[int, int]] = field(default_factory=dict)


def approx_keys(keys: PromptKeys | list[bytes]) -> list[bytes]:
    """The approximate keys (a bare list: those alone)."""
    return keys.approx if isinstance(keys, PromptKeys) else keys


class Policy(ABC):
    """Chooses a worker for a request; `candidates` is non-empty, healthy and serves the model.

    `keys` are what is known of the prompt (`PromptKeys`, or a bare list of its approximate
    keys). Each choice is then `settled`, once, with the same keys: the worker accepted the
    request, or never will (prefix-aware policies learn from it). Single-threaded: the
    router calls it from its event loop.
    """

    name: str = ""

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate], keys: PromptKeys | list[bytes]) -> Candidate: ...

    def settled(self, worker_id: str, keys: PromptKeys | list[bytes], accepted: bool) -> None:
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
        keys = approx_keys(keys)
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
        keys = approx_keys(keys)
        if keys:
            self.placing.remove(keys, worker_id)
            if accepted:
                self.index.insert(keys, worker_id)

    def forget(self, worker_id):
        self.index.remove_worker(worker_id)
        self.placing.remove_worker(worker_id)


class KvAware(PrefixAware):
    """The module's `kv_aware`. `kv_map`: the workers' blocks by tier (`KvMap`: `match`,
    `complete`; None: none known, every prompt a miss, placed by cost and load)."""

    name = "kv_aware"

    def __init__(self, balance_abs_threshold: float = 8, balance_rel_threshold: float = 1.5,
                 min_match_chunks: int = 1, index: PrefixIndex | None = None, kv_map=None,
                 prefill_tps: float = KvRoutingConfig.kv_prefill_tps, read_tps: float = KvRoutingConfig.kv_read_tps):
        super().__init__(balance_abs_threshold, balance_rel_threshold, min_match_chunks, index)
        self.kv_map = kv_map
        self.prefill_tps = prefill_tps
        self.read_tps = read_tps
        self._placing: dict[str, Counter[bytes]] = {}  # chosen, not settled: hashes credited to the worker
        self._accepted: dict[str, tuple[object, set[bytes]]] = {}  # settled since the worker's last report
        self._pending: dict[str, list[int]] = {}  # placed, not started: [prompt tokens, uncached tokens]
        self._seen: dict[str, Candidate] = {}  # the workers chosen, by id (their reports, at settling)

    def choose(self, candidates, keys):
        blocks = keys.blocks if isinstance(keys, PromptKeys) else None
        if blocks is None or not blocks.num_tokens:
            return super().choose(candidates, keys)
        least = _least_loaded(candidates, next(self._tick))
        eligible = [w for w in candidates if w is least or not self.imbalanced(w, least)]
        rates = assumed_rates(candidates, self.prefill_tps, self.read_tps)
        costs = {w.worker_id: self._cost(w, blocks, rates) for w in eligible}
        if any(memory or disk for _, memory, disk, _ in costs.values()):
            chosen = min(eligible, key=lambda w: (costs[w.worker_id][0], -costs[w.worker_id][1] - costs[w.worker_id][2],
                                                  w.load, w is not least))
            if keys.approx:
                self.placing.insert(keys.approx, chosen.worker_id)
        else:  # held nowhere the workers said: the approximate map (it learns a placement as it is accepted)
            chosen = super().choose(candidates, keys)
        if chosen.worker_id not in costs:
            costs[chosen.worker_id] = self._cost(chosen, blocks, rates)
        _, memory, disk, hashes = costs[chosen.worker_id]
        keys.predicted[chosen.worker_id] = (memory, disk)
        keys.credited[chosen.worker_id] = hashes
        self._seen[chosen.worker_id] = chosen
        self._placing.setdefault(chosen.worker_id, Counter()).update(hashes)
        pending = (blocks.num_tokens, max(0, blocks.num_tokens - memory - disk))
        keys.pending[chosen.worker_id] = pending
        total = self._pending.setdefault(chosen.worker_id, [0, 0])
        total[0] += pending[0]
        total[1] += pending[1]
        return chosen

    def _cost(self, w, blocks: Blocks, rates: tuple[float, float]) -> tuple[float, int, int, list[bytes]]:
        """(t(w), tokens held in memory, tokens on disk, the hashes of w's block size)."""
        report = w.report
        bs = report.block_size
        same = not blocks.digest or report.tokenizer_digest == blocks.digest
        hashes = blocks.hashes.get(bs, []) if same and bs else []
        m, d = self._match(w, hashes)
        memory, disk = m * bs, d * bs
        miss = max(0, blocks.num_tokens - memory - disk)
        prefill = report.prefill_tokens_per_second or rates[0]
        read = report.kv_disk.read_tokens_per_second or rates[1]
        tokens, uncached = self._pending.get(w.worker_id, (0, 0))
        age = time.monotonic() - getattr(w, "last_seen", time.monotonic())
        queued = uncached + max(0.0, report.queued_prefill_tokens - age * prefill - tokens)
        return (queued + miss) / prefill + disk / read, memory, disk, hashes

    def _match(self, w, hashes: list[bytes]) -> tuple[int, int]:
        """Leading blocks in memory, then on disk: the map's (if complete), and the blocks
        this router placed on w that its reports do not show yet counted in memory."""
        if not hashes:
            return 0, 0
        m = d = 0
        if self.kv_map is not None and self.kv_map.complete(w.worker_id):
            m, d = self.kv_map.match(w.worker_id, hashes)
        placing = self._placing.get(w.worker_id, ())
        accepted = self._since_report(self._accepted, w, set())[1]
        credit = 0
        for h in hashes:
            if h not in placing and h not in accepted:
                break
            credit += 1
        held = max(m + d, credit)
        m = max(m, credit)
        return m, held - m

    def _since_report(self, table: dict, w, empty):
        """A per-worker value kept until the worker's next report: (its report, the value)."""
        entry = table.get(w.worker_id)
        if entry is None or entry[0] is not w.report:
            return w.report, empty
        return entry

    def settled(self, worker_id, keys, accepted):
        super().settled(worker_id, keys, accepted)
        pending = keys.pending.pop(worker_id, None) if isinstance(keys, PromptKeys) else None
        total = self._pending.get(worker_id)
        if pending is not None and total is not None:  # started there (its prefill done), or never will
            total[0] -= pending[0]
            total[1] -= pending[1]
        hashes = keys.credited.pop(worker_id, None) if isinstance(keys, PromptKeys) else None
        if not hashes:
            return
        placing = self._placing.get(worker_id)
        if placing is not None:
            placing.subtract(hashes)
            for h in hashes:
                if placing[h] <= 0:
                    del placing[h]
        if accepted:  # its blocks are computed there: counted until the report that carries their events
            report, held = self._accepted.get(worker_id, (None, set()))
            record = self._seen.get(worker_id)
            if record is not None and record.report is not report:
                report, held = record.report, set()
            held.update(hashes)
            self._accepted[worker_id] = (report, held)

    def forget(self, worker_id):
        super().forget(worker_id)
        for table in (self._placing, self._accepted, self._pending, self._seen):
            table.pop(worker_id, None)


POLICIES = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAware, KvAware)}


def make_policy(name: str, **kwargs) -> Policy:
    """The policy called `name`; `kwargs` go to the prefix-aware ones (KvAware: `kv_map`,
    `prefill_tps`, `read_tps` too)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}") from None
    if cls is KvAware:
        return cls(**kwargs)
    if cls is PrefixAware:
        return cls(**{k: v for k, v in kwargs.items() if k not in ("kv_map", "prefill_tps", "read_tps")})
    return cls()
