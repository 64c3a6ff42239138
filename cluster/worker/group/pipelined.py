"""Pipelined batches: a P-stage pipeline group keeps up to P batches in flight, so that no
stage waits while another computes (vLLM's virtual engines).

The requests are split among P ordinary `Engine`s (virtual engines), each with its own
scheduler, block manager and state slots over its own share of the pool (its block ids
and state slots offset into the one pool every rank holds: `VirtualRunner`), and all of
them stepping one model runner. A request lives in one virtual engine, so it is in at
most one batch in flight, and a virtual engine has at most one batch in flight: its next
batch is planned only once the last one is done, exactly as a single engine plans it.

`PipelinedEngine.step()` begins a batch for every idle virtual engine with work (its plan
goes to the members at once, so the first stage starts on it while the last is still on
an earlier batch), then finishes the oldest batch in flight: batches finish in the order
their plans were sent, the order the hidden states come back in. An abort of a request
whose batch is in flight waits until that batch is done (its blocks are being written).
A batch that fails (a rank's step raised) raises from `step()` as a single engine's step
does; the engine loop then takes every request out (`abort_all`, which sees the batches
still in flight through first) and brings them back one at a time to find the cause.

A new request goes to the virtual engine whose prefix cache holds the longest prefix of
its prompt, among those within one request of the least loaded (`choose`): each engine
has a prefix cache of its own, and a request placed by load alone would miss the prefix
another engine holds.

It offers the engine's interface that the worker's engine loop and service use.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from dataclasses import fields, replace

from cluster.worker.engine import Engine, EngineStats, RequestOutput
from cluster.worker.engine_protocol import EngineProtocol
from cluster.worker.kv_tier import KvTier
from cluster.worker.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


AFFINITY_SLACK = 1  # requests more than the least loaded virtual engine that a prefix hit may cost


class _Probe:
    """A prompt as `BlockManager.get_computed_blocks` reads a sequence not yet admitted."""

    __slots__ = ("block_hashes", "block_table", "token_ids")

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []


class _Shifted:
    """A sequence as the shared runner sees it: block ids and state slot offset into the
    virtual engine's share of the pool; everything else is the sequence's own."""

    __slots__ = ("__weakref__", "_blocks", "_seq", "_slots")

    def __init__(self, seq, block_offset: int, slot_offset: int):
        self._seq = seq
        self._blocks = block_offset
        self._slots = slot_offset

    @property
    def block_table(self) -> list[int]:
        off = self._blocks
        return [b + off for b in self._seq.block_table] if off else self._seq.block_table

    @property
    def state_slot(self) -> int:
        slot = self._seq.state_slot
        return slot + self._slots if slot >= 0 else slot

    def __getattr__(self, name):
        return getattr(self._seq, name)


class VirtualRunner:
    """One virtual engine's view of the shared runner."""

    def __init__(self, shared, block_offset: int, slot_offset: int):
        self.shared = shared
        self.block_offset = block_offset
        self.slot_offset = slot_offset
        self._proxies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> _Shifted (stable ids)

    def _proxy(self, seq):
        p = self._proxies.get(seq)
        if p is None:
            p = self._proxies[seq] = _Shifted(seq, self.block_offset, self.slot_offset)
        return p

    def prepare(self, plan: SchedulerOutput):
        shifted = SchedulerOutput([replace(e, seq=self._proxy(e.seq)) for e in plan.scheduled], plan.preempted)
        return self.shared.prepare(shifted)

    # the disk tier's copies in and out of this engine's share of the pool
    def read_blocks(self, block_ids: list[int]):
        return self.shared.read_blocks([b + self.block_offset for b in block_ids])

    def write_blocks(self, block_ids: list[int], arrays) -> None:
        self.shared.write_blocks([b + self.block_offset for b in block_ids], arrays)

    def __getattr__(self, name):
        return getattr(self.shared, name)


def _request_ids(pending) -> set[str]:
    return {e.seq.group_id for e in pending.plan.scheduled}


class PipelinedEngine(EngineProtocol):
    """P virtual engines over one group runner (see the module docstring)."""

    def __init__(self, engines: list[Engine], group):
        self.engines = engines
        self.group = group
        first = engines[0]
        for e in engines[1:]:
            e.grammars = first.grammars  # one compiler: the service checks specs against it
        self.model_name = first.model_name
        self.tokenizer = first.tokenizer
        self.vocab_size = first.vocab_size
        self.grammars = first.grammars
        self.pooler = getattr(first, "pooler", None)
        self.runner = first.runner
        # one KV journal for the process: a hash leaves its memory tier when no engine caches it;
        # one disk store (the first engine's), each engine's tier writing through its own blocks
        self.kv_journal = first.kv_journal
        self.kv_tier = first.kv_tier
        for e in engines[1:]:
            e.kv_journal = first.kv_journal
            e.block_manager.listener = first.kv_journal.memory_listener()
            if first.kv_tier is not None:  # (it chains itself to the listener)
                e.kv_tier = KvTier(replace(e.config, kv_disk_dir=first.config.kv_disk_dir), e.block_manager,
                                   e.runner, None, shared=first.kv_tier)
        self.config = replace(first.config, max_num_seqs=sum(e.config.max_num_seqs for e in engines),
                              num_kv_blocks=sum(e.config.num_kv_blocks for e in engines))
        self.in_flight: deque = deque()  # (virtual engine index, PendingStep), oldest first
        self.deferred: dict[int, list[str]] = {}  # aborts waiting for a batch in flight
        self.fresh: set[str] = set()  # requests added since the last step (`step` sees each through a batch)
        self.stats = EngineStats()
        self._refresh_stats()

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, sampling_params=None, arrival_time=None,
                    resume_token_ids=()) -> None:
        if self._owner(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        v = self.choose(prompt_token_ids)
        self.engines[v].add_request(request_id, prompt_token_ids, sampling_params, arrival_time=arrival_time,
                                    resume_token_ids=resume_token_ids)
        self.fresh.add(request_id)
        self._refresh_stats()

    def choose(self, prompt_token_ids) -> int:
        """The virtual engine a new request goes to: of those within one request of the
        least loaded (the pipeline needs every engine busy, so affinity only breaks near
        ties), the one whose prefix cache holds the longest prefix of the prompt, then the
        less loaded, then the first."""
        loads = [len(e.scheduler.running) + len(e.scheduler.waiting) for e in self.engines]
        near = [v for v, load in enumerate(loads) if load <= min(loads) + AFFINITY_SLACK]
        probe = _Probe(list(prompt_token_ids))  # its block hashes, computed once for every engine
        return max(near, key=lambda v: (len(self.engines[v].block_manager.get_computed_blocks(probe)), -loads[v], -v))

    def _owner(self, request_id: str) -> int | None:
        for i, e in enumerate(self.engines):
            if request_id in e.seqs or request_id in e.groups:
                return i
        return None

    def _busy(self, v: int) -> bool:
        return any(i == v for i, _ in self.in_flight)

    def abort(self, request_id: str) -> bool:
        v = self._owner(request_id)
        if v is None:
            return False
        if self._busy(v):  # its blocks are being written: after that batch
            self.deferred.setdefault(v, []).append(request_id)
            return True
        done = self.engines[v].abort(request_id)
        self._refresh_stats()
        return done

    def abort_all(self) -> list[str]:
        while self.in_flight:  # the members are in these steps: see them through first
            v, pending = self.in_flight.popleft()
            try:
                self.engines[v].finish_step(pending)
            except Exception:  # (after a failed step, another may fail: its requests are aborted all the same)
                log.exception("group: a batch in flight failed while its requests were aborted")
        self.deferred.clear()
        ids = [rid for e in self.engines for rid in e.abort_all()]
        self._refresh_stats()
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.in_flight) or any(e.has_unfinished() for e in self.engines)

    def close(self) -> None:
        """As `Engine.close`: each engine's waiting disk writes land through the one store,
        which the first engine's tier then closes."""
        for e in self.engines[1:]:
            if e.kv_tier is not None:
                e.kv_tier.flush()
        self.engines[0].close()

    def has_runnable(self) -> bool:
        return bool(self.in_flight) or any(e.has_runnable() for e in self.engines)

    def set_wake(self, wake) -> None:
        for e in self.engines:
            e.set_wake(wake)

    def live_request_ids(self) -> list[str]:
        return [rid for e in self.engines for rid in e.live_request_ids()]

    def request_state(self, request_id: str):
        v = self._owner(request_id)
        if v is None:
            raise KeyError(request_id)
        return self.engines[v].request_state(request_id)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    def is_waiting(self, request_id: str) -> bool:
        v = self._owner(request_id)
        return v is not None and self.engines[v].is_waiting(request_id)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Begin a batch on every idle virtual engine with work, finish the oldest in
        flight; the outputs. As a single engine's step, it returns only once each request
        added since the last step that went into a batch has been through it (the batches
        before it are finished first, and each one's successor begun): the engine loop
        counts a request added back after a failed step as cleared, or as the cause, by
        the step after it."""
        fresh, self.fresh = self.fresh, set()
        self._begin_idle()
        outputs: list[RequestOutput] = []
        while self.in_flight:
            v, pending = self.in_flight.popleft()
            fresh -= _request_ids(pending)
            outputs += self.engines[v].finish_step(pending)
            for rid in self.deferred.pop(v, []):
                self.engines[v].abort(rid)
            self._begin_idle()  # its next batch goes out before rank 0 waits on the next one
            # v's next batch was the first a request added to v while v was busy could join:
            # one not in it could not be scheduled (as in a single engine's step: done with)
            following = next((_request_ids(p) for i, p in self.in_flight if i == v), set())
            fresh -= {rid for rid in fresh if rid not in following and self._owner(rid) == v}
            busy = {i for i, _ in self.in_flight}
            if not any(self._owner(rid) in busy for rid in fresh):
                break
        self._refresh_stats()
        return outputs

    def _begin_idle(self) -> None:
        for v, e in enumerate(self.engines):  # (one batch in flight at most per virtual engine)
            if self._busy(v) or not e.has_unfinished():
                continue
            pending = e.begin_step()
            if pending.batch is None:  # nothing could be scheduled: no plan went out
                e.finish_step(pending)
            else:
                self.in_flight.append((v, pending))

    def warm_up(self) -> float:
        return self.engines[0].warm_up()

    def check_integrity(self) -> None:
        for e in self.engines:
            e.check_integrity()

    generate = Engine.generate  # the same loop, over this engine's add_request and step

    def _refresh_stats(self) -> None:
        """The virtual engines' counters, summed (what metrics and load reports read)."""
        total = self.stats
        for f in fields(EngineStats):
            values = [getattr(e.stats, f.name) for e in self.engines]
            first = values[0]
            if isinstance(first, (int, float)) and not isinstance(first, bool):
                setattr(total, f.name, sum(values))
            elif isinstance(first, dict):
                merged: dict = {}
                for d in values:
                    for k, n in d.items():
                        merged[k] = merged.get(k, 0) + n
                setattr(total, f.name, merged)
            elif isinstance(first, list):
                setattr(total, f.name, [sum(x) for x in zip(*values)])
            else:
                setattr(total, f.name, first)
