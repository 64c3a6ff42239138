"""Recurrent-state slots: which request holds which row of the recurrent layers' state pools.

Pure Python (no MLX), beside the block manager: a hybrid model's recurrent layers (gated
delta nets, Mamba-2, short convolutions) keep a fixed-size state per request instead of
K/V per token. The model runner holds, for each recurrent layer, arrays with one row per
slot (`recurrent.RecurrentCache`); this class hands the rows out.

- A slot is taken when the scheduler admits a request and given back when it finishes,
  is aborted or preempted (preemption recomputes from the tokens, so nothing is kept).
- A slot's old contents are never read: a request's first chunk starts from no state,
  as mlx-lm's first call does, and writes its slot; later chunks and decodes read it.
- `max_num_seqs` slots: a running request always has one.
- Invariant (`check_integrity`): every slot is free or held by exactly one live request.
"""

from __future__ import annotations

from typing import Iterable, Protocol


class _Seq(Protocol):
    request_id: str
    state_slot: int


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self.owner: dict[int, str] = {}  # slot -> request id holding it

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free_slots)

    def can_allocate(self) -> bool:
        return bool(self.free_slots)

    def allocate(self, seq: _Seq) -> int:
        if seq.state_slot >= 0:
            raise AssertionError(f"request {seq.request_id} already holds state slot {seq.state_slot}")
        if not self.free_slots:
            raise AssertionError("no free state slot: the scheduler admits a request only when one is free")
        slot = self.free_slots.pop()
        self.owner[slot] = seq.request_id
        seq.state_slot = slot
        return slot

    def free(self, seq: _Seq) -> None:
        """Give back `seq`'s slot, if it holds one (a waiting request holds none)."""
        slot = seq.state_slot
        if slot < 0:
            return
        if self.owner.get(slot) != seq.request_id:
            raise AssertionError(f"request {seq.request_id} frees state slot {slot}, held by {self.owner.get(slot)}")
        del self.owner[slot]
        self.free_slots.append(slot)
        seq.state_slot = -1

    def check_integrity(self, seqs: Iterable[_Seq] | None = None) -> None:
        """free + used == total, no slot twice; with `seqs` (the live requests), the held
        slots are exactly theirs."""
        free = set(self.free_slots)
        if len(free) != len(self.free_slots):
            raise AssertionError("a state slot is free twice")
        if free & set(self.owner) or len(free) + len(self.owner) != self.num_slots:
            raise AssertionError(f"free {sorted(free)} and held {sorted(self.owner)} do not partition "
                                 f"{self.num_slots} slots")
        if seqs is not None:
            held = {s.state_slot: s.request_id for s in seqs if s.state_slot >= 0}
            if held != self.owner:
                raise AssertionError(f"live requests hold slots {held}, the allocator says {self.owner}")
