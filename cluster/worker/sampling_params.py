"""Per-request sampling parameters, validated at the door."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from cluster.api.constraints import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY, MAX_REPETITION_PENALTY
from cluster.formats.thinking import ThinkingSpec
from cluster.worker.pooling import PoolingParams

# "llguidance": a grammar already in llguidance's JSON form (the worker composes one: a
# thinking block, then the answer's grammar); never on the wire
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "llguidance")


@dataclass(frozen=True)
class StructuredOutput:
    """What a constrained decoder must produce: `kind` is one of STRUCTURED_KINDS and
    `spec` the schema's JSON text, the regex, the Lark grammar, or the choices; empty for
    json_object. Hashable, so compiled grammars are cached by it."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            object.__setattr__(self, "spec", tuple(self.spec))
            if not self.spec:
                raise ValueError("a choice constraint needs at least one choice")
        elif self.kind != "json_object" and not (isinstance(self.spec, str) and self.spec.strip()):
            raise ValueError(f"a {self.kind} constraint needs a non-empty {self.kind}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no logprobs. n >= 0: the chosen token's logprob plus the top n alternatives.
    logprobs: int | None = None
    # OpenAI's: minus presence_penalty for every token that occurs in the output so far,
    # minus frequency_penalty times its count there.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (HF's): logits of tokens seen in the prompt or the output are divided by it
    # when positive, multiplied by it when negative. 1 = off.
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is taken
    structured: StructuredOutput | None = None
    # None: none. k >= 0: each prompt token's logprob given its prefix (the first has
    # none) plus the top k alternatives, computed in the prefill's forward.
    prompt_logprobs: int | None = None
    n: int = 1  # samples of the prompt; the engine forks them after its prefill
    # set: a pooling request (an embedding or a score): prefill only, nothing sampled (pooling.py)
    pooling: PoolingParams | None = None
    # speculative decoding for this request: None follows the worker (on when it has a
    # --speculative-config), False turns it off, True asks for it (an error where it is off)
    speculative: bool | None = None
    # special tokens the output text keeps (a family's thinking and tool-call markers, which
    # the worker's parsers read); every other special token is skipped when decoding
    kept_special_ids: frozenset[int] = frozenset()
    # a thinking model's thinking with a budget: the engine follows it and forces its end
    # marker once the budget is spent (None: nothing to follow; the worker's service counts
    # usage's reasoning_tokens itself)
    thinking: ThinkingSpec | None = None

    def __post_init__(self):
        # Accept lists from callers; store tuples so the object stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        object.__setattr__(self, "kept_special_ids", frozenset(int(t) for t in self.kept_special_ids))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be between -2 and 2, got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                             f"got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries: at most {MAX_LOGIT_BIAS_ENTRIES} "
                             "are allowed")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias token id {token} must be >= 0")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias} for token {token}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        t = self.thinking
        if t is not None and t.budget is not None and (t.budget < 0 or not t.end_ids):
            raise ValueError("a thinking budget must be >= 0 and name the end marker's tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties or bias)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))
