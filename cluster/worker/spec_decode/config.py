"""`--speculative-config`: vLLM's JSON, parsed and checked once (pure Python, no MLX).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/path/to/small-mlx-model", "num_speculative_tokens": 4}

`method` may be left out when `model` is given (a draft model, as vLLM infers it).
`mtp` is refused by name: mlx-lm drops every checkpoint's multi-token-prediction weights
when it loads a model (see `MTP_REFUSAL`), so there are no MTP layers to run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per request per step at most (the verify rows are 1 + this)
# What mlx-lm (0.32) does with the MTP weights of the families that ship them.
MTP_REFUSAL = (
    "method 'mtp' is not available: mlx-lm drops the multi-token-prediction weights of every family that ships "
    "them when it loads the checkpoint (deepseek_v3's sanitize removes model.layers.61, glm4_moe's every layer past "
    "num_hidden_layers, qwen3_next's and qwen3_5's every 'mtp.' key; mimo, nemotron_h, ernie4_5_moe and the others "
    "likewise), so there are no MTP layers to run. Use 'ngram', or 'draft_model' with a small model of the same "
    "tokenizer")
_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: draft tokens per request per step at most
    model: str | None = None  # the draft model's directory (draft_model)
    prompt_lookup_min: int = 2  # ngram: the shortest suffix that may match
    prompt_lookup_max: int = 4  # ngram: the longest (the longest that matches wins)

    @classmethod
    def parse(cls, text: str | None) -> "SpeculativeConfig | None":
        """The config for `--speculative-config` (None, or "" / "off": speculation off).
        ValueError naming the key, the limit and the value for anything wrong."""
        if text is None or text.strip() in ("", "off", "none", "null"):
            return None
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--speculative-config must be a JSON object: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(_KEYS))})")
        method = raw.get("method") or ("draft_model" if raw.get("model") else "ngram")
        if method in ("draft", "draft_model"):
            method = "draft_model"
        if method == "mtp" or (isinstance(method, str) and method.endswith("_mtp")):
            raise ValueError(MTP_REFUSAL)
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)} (or mtp, which is "
                             f"refused), got {method!r}")
        k = raw.get("num_speculative_tokens", cls.num_speculative_tokens)
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = cls.prompt_lookup_min, cls.prompt_lookup_max
        lo = hi if lo is None else lo  # vLLM's rule: one given sets the other
        hi = lo if hi is None else hi
        config = cls(method, k, raw.get("model"), lo, hi)
        config.validate()
        return config

    def validate(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("--speculative-config: method 'draft_model' needs \"model\": the draft model's "
                             "directory (same tokenizer as the served model)")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("--speculative-config: method 'ngram' takes no \"model\"")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
                    raise ValueError(f"--speculative-config: {name} must be an integer in [1, 64], got {v!r}")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) is more than "
                                 f"prompt_lookup_max ({self.prompt_lookup_max})")
