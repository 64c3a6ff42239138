"""What the worker needs from an engine: the contract between an engine and its users.

The engine thread (`engine_loop.py`) drives it, the worker's asyncio side (`service.py`)
reads its facts and counters, and a pipelined worker group (`group/pipelined.py`) offers
it over several engines. `Engine` implements it, as do `PipelinedEngine` and the tests'
fake engine (`tests/scripted_engine.py`).

Single-threaded: every method is called on the engine thread, except that `stats` and
the read-only facts (`model_name`, `tokenizer`, `vocab_size`, `config`) may be read from
any thread once the engine is built. Optional, read with `getattr` where an engine may
lack them: `grammars` (a `GrammarCompiler`, for structured outputs), `pooler` (a
`Pooler`: what the model serves and how it pools), `speculator` (speculative decoding is
on), `group` (rank 0 of a worker group), `warm_up()`, `has_runnable()` (whether a step
would do something now, rather than wait for disk reads: the loop then blocks on its
inbox), `set_wake(fn)` (`fn()`, called on another thread, wakes the loop: a read done),
`close()` (on the engine thread when the loop stops: a disk tier's writes land).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from cluster.worker.engine_stats import EngineStats
    from cluster.worker.outputs import RequestOutput
    from cluster.worker.sampling_params import SamplingParams


@runtime_checkable
class EngineProtocol(Protocol):
    model_name: str
    tokenizer: Any
    vocab_size: int
    config: Any  # an EngineConfig, resolved (the loop reads `finish_wait_ms`)
    stats: EngineStats  # counters for metrics and load reports

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, resume_token_ids=()) -> None:
        """Queue a request, or raise ValueError (the request's fault) or QueueFullError
        (try later). `resume_token_ids`: tokens already generated for it elsewhere, taken
        as context and as output, and not emitted again."""

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its samples) now and free what it holds; False if it is
        unknown or done."""

    def abort_all(self) -> list[str]:
        """Abort every live request; their ids."""

    def step(self) -> list[RequestOutput]:
        """One step of every request it can run now; what each produced."""

    def has_unfinished(self) -> bool:
        """Whether a `step` has anything to do."""

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (new or preempted)."""

    def is_waiting(self, request_id: str) -> bool:
        """Whether a live request waits to be scheduled (not yet, or no longer, running)."""

    def live_request_ids(self) -> list[str]:
        """The ids of the live requests."""

    def request_state(self, request_id: str) -> tuple[list[int], list[int], SamplingParams, float]:
        """(prompt token ids, output token ids so far, sampling params, arrival time) of a
        live request: what it takes to add it again."""
