"""Stop checks: whether the tokens a step gave a request end it, and where.

The tokens (several when drafts were kept) are checked one at a time, as if each came
from its own step: each goes through the request's incremental detokenizer (stop
strings), its thinking budget and its structured output's grammar; the first that
finishes the request ends it, and the tokens after it are dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.worker.sequence import SequenceStatus
from cluster.worker.structured import grammar_error

if TYPE_CHECKING:
    from cluster.worker.detokenizer import IncrementalDetokenizer
    from cluster.worker.sequence import Sequence
    from cluster.worker.structured import GrammarCompiler
    from cluster.worker.thinking_budget import ThinkingBudgets

log = logging.getLogger(__name__)


@dataclass
class StopVerdict:
    kept: int  # how many of the step's tokens the request keeps
    status: SequenceStatus | None = None  # how the request finished (None: it goes on)
    # why a structured output could not go on (the request then ends as aborted): the client's error
    error: str | None = None


class StopChecks:
    def __init__(self, eos_token_ids: set[int], max_model_len: int, grammars: GrammarCompiler,
                 thinking: ThinkingBudgets):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.thinking = thinking

    def check(self, seq: Sequence, detok: IncrementalDetokenizer, tokens: list[int]) -> StopVerdict:
        """Check the tokens this step appended to `seq`; the ones past a stop are taken off
        its `token_ids` again, and a stop string or token is its `stop_reason`."""
        params = seq.sampling_params
        past = seq.num_tokens - len(tokens)  # tokens before this step's
        for i, token in enumerate(tokens):
            num_tokens = past + i + 1
            stop_string = detok.add(token)
            if seq.thinking is not None:
                self.thinking.follow(seq, token)
            status = error = None
            if seq.matcher is not None and (not seq.matcher.consume_token(token) or seq.matcher.is_error()):
                # The matcher gave up (its mask then allows only EOS): the grammar ran past llguidance's
                # limits. The request's fault: it ends with the reason, never as an empty "stop".
                error = grammar_error(params.structured, seq.matcher, num_tokens - seq.num_prompt_tokens - 1)
                log.warning("engine: %s: %s", seq.request_id, error)
                self.grammars.forget(params.structured)  # its shared lexer may be spent: compiled afresh next time
                status = SequenceStatus.FINISHED_ABORTED
            elif stop_string is not None:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_string
            elif token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif seq.matcher is not None and seq.matcher.is_stopped():  # the structured output is complete
                status = SequenceStatus.FINISHED_STOPPED
            elif num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None:
                del seq.token_ids[past + i + 1 :]
                return StopVerdict(i + 1, status, error)
        return StopVerdict(len(tokens))
