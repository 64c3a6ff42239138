"""Pooling models: embeddings and relevance scores from the same engine as generation.

A pooling request is a prefill-only request. It is scheduled, chunked and packed into the
same steps as any prompt, but nothing is sampled from it: the step returns the final
hidden states (after the last norm, before the LM head) of the rows its pooling reads,
the request accumulates them chunk by chunk, and when its last chunk has run it finishes
with a vector (an embedding) or a number (a score) instead of a token.

What the model says decides the pooling (`Pooler.for_model`): sentence-transformers'
`modules.json` and its Pooling module's `config.json` where the directory has them
(last token, as Qwen3-Embedding; mean; CLS; max), its `Normalize` module, and Matryoshka
truncation (`dimensions`) where `config.json` allows it (`is_matryoshka` or
`matryoshka_dimensions`, vLLM's keys). Without them a causal model pools its last token
and normalizes (as vLLM and llama.cpp do for a causal embedding model).

Prefix caching: a cache hit skips computing the cached positions, so only pooling that
reads the last position alone (last-token pooling, and scores) keeps the prefix cache:
the last position is always computed, against the cached K/V. Pooling that reads every
position (mean, max, CLS) bypasses the lookup, as prompt logprobs do: the final hidden
states of cached positions are not kept (caching them would take a second cache the size
of hidden x tokens beside the KV pool, with its own eviction), and their recomputation
costs one prefill. Such a request still writes its blocks to the cache, for the requests
that can use them.

Scores (`task="score"`, rerankers), from the last token's final hidden state:
- `yes_no` (Qwen3-Reranker, a causal LM): sigmoid(logit("yes") - logit("no")) through
  the model's own LM head, i.e. softmax over the two logits, as its model card computes;
- `classifier` (a `*ForSequenceClassification` checkpoint of a family mlx-lm loads, e.g.
  a Qwen3 reranker converted to one label): sigmoid of its `score` projection, as
  sentence-transformers' CrossEncoder and vLLM report a one-label classifier.

Nothing here imports MLX at module level: the worker's asyncio side reads the model's
facts (`model_tasks`) from here too.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

TASKS = ("generate", "embed", "score")
POOLING_TYPES = ("last", "mean", "cls", "max")
# sentence-transformers' Pooling config: its mode names -> ours
_ST_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean", "cls_token": "cls", "cls": "cls",
             "max_tokens": "max", "max": "max"}
# Qwen3-Reranker's prompt (its model card): the system turn, the user turn's frame, and the
# assistant turn with an empty thought, after which "yes" or "no" is the next token
QWEN3_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                       "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                       "<|im_start|>user\n")
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class UnsupportedPooling(ValueError):
    """The model's pooling configuration is one the engine does not compute exactly."""


@dataclass(frozen=True)
class PoolingParams:
    """What one pooling request asks for. `task`: "embed" (a vector) or "score" (one number,
    a reranker's). `dimensions`: Matryoshka truncation (None: the whole vector);
    `normalize`: L2-normalize after truncating (None: as the model says)."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self):
        if self.task not in ("embed", "score"):
            raise ValueError(f"a pooling task is 'embed' or 'score', not {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")


@dataclass
class PoolState:
    """A request's pooling so far (reset when its prefill restarts at position 0)."""

    acc: np.ndarray | None = None  # sum (mean), running max (max), the row itself (last, cls)
    count: int = 0


@dataclass(frozen=True)
class Pooler:
    """A model's pooling and scoring (see the module docstring). `tasks`: what the worker
    serves with it ("generate", "embed", "score")."""

    hidden_size: int
    pooling: str = "last"
    normalize: bool = True
    matryoshka: tuple[int, ...] | bool = False  # allowed `dimensions`: a list, any (True), or none
    tasks: tuple[str, ...] = ("generate",)
    score_kind: str | None = None  # "yes_no" | "classifier" | None
    yes_no_ids: tuple[int, int] | None = None  # (yes, no) token ids, for "yes_no"
    score_format: str = "qwen3"  # a score's input: "qwen3" (Qwen3-Reranker's prompt) | "pair" (the tokenizer's pair)
    source: str = "default"  # where the pooling came from, for the log and errors

    def __post_init__(self):
        if self.pooling not in POOLING_TYPES:
            raise UnsupportedPooling(f"pooling {self.pooling!r} is not one of {', '.join(POOLING_TYPES)}")

    # -- what the model is ------------------------------------------------------------------
    @classmethod
    def for_model(cls, path: str | Path, hidden_size: int, tokenizer=None, task: str = "auto",
                  embeddings: bool = False) -> "Pooler":
        """The model directory's pooling and tasks. `task`: "auto" (from the directory:
        sentence-transformers modules -> embed; a sequence classifier, vLLM's
        `classifier_from_token` or a directory named *reranker* -> score; else generate),
        or one of TASKS to force it. `embeddings`: a generation model also serves
        embeddings (llama.cpp's --embeddings), pooled by its last token."""
        path = Path(path)
        config = _read_json(path / "config.json") or {}
        st = _sentence_transformers(path)
        architectures = config.get("architectures") or []
        classifier = any(str(a).endswith("ForSequenceClassification") for a in architectures)
        yes_no = "classifier_from_token" in config or (
            not classifier and st is None and "reranker" in path.name.lower())
        if task == "auto":
            task = "embed" if st is not None else "score" if (classifier or yes_no) else "generate"
        if task not in TASKS:
            raise ValueError(f"task must be auto or one of {', '.join(TASKS)}, got {task!r}")
        pooling, normalize, source = "last", True, "default (last token, normalized)"
        if st is not None:
            pooling, normalize, source = st
        tasks = (task,) if task != "generate" else (("generate", "embed") if embeddings else ("generate",))
        matryoshka: tuple[int, ...] | bool = False
        if config.get("matryoshka_dimensions"):
            matryoshka = tuple(sorted(int(d) for d in config["matryoshka_dimensions"]))
        elif config.get("is_matryoshka"):
            matryoshka = True
        score_kind, ids, score_format = None, None, "qwen3"
        if task == "score":
            if classifier:
                score_kind = "classifier"
                # Qwen3 rerankers converted to a classifier keep Qwen3-Reranker's prompt; other
                # cross-encoders read (query, document) as their tokenizer pairs them
                qwen3 = config.get("model_type") == "qwen3" or config.get("is_original_qwen3_reranker")
                score_format = "qwen3" if qwen3 else "pair"
            else:
                score_kind = "yes_no"
                tokens = config.get("classifier_from_token") or ["no", "yes"]
                ids = _yes_no_ids(tokenizer, tokens) if tokenizer is not None else None
        return cls(hidden_size=hidden_size, pooling=pooling, normalize=normalize, matryoshka=matryoshka,
                   tasks=tasks, score_kind=score_kind, yes_no_ids=ids, score_format=score_format, source=source)

    @property
    def pools(self) -> bool:
        """Whether the model serves embeddings or scores (pooling requests) at all."""
        return "embed" in self.tasks or "score" in self.tasks

    def describe(self) -> str:
        what = ", ".join(self.tasks)
        if "embed" in self.tasks:
            what += f"; pooling {self.pooling}{', normalized' if self.normalize else ''} ({self.source})"
            if self.matryoshka:
                what += f"; Matryoshka dimensions {'any' if self.matryoshka is True else list(self.matryoshka)}"
        if self.score_kind:
            what += f"; scores by {self.score_kind}"
        return what

    def check(self, params: PoolingParams) -> None:
        """ValueError (the request's fault, in words a client can act on) for what this
        model cannot give."""
        if params.task not in self.tasks:
            raise ValueError(f"this model does not serve {params.task} requests (it serves: {', '.join(self.tasks)})")
        d = params.dimensions
        if d is not None and params.task == "embed" and d != self.hidden_size:
            if not self.matryoshka:
                raise ValueError(f"dimensions={d}: this model's embeddings have {self.hidden_size} dimensions and it "
                                 "does not support Matryoshka truncation (no is_matryoshka / matryoshka_dimensions "
                                 "in its config.json)")
            if d > self.hidden_size:
                raise ValueError(f"dimensions={d} is more than the model's {self.hidden_size}")
            if self.matryoshka is not True and d not in self.matryoshka:
                raise ValueError(f"dimensions={d} is not one of the model's Matryoshka dimensions "
                                 f"{list(self.matryoshka)}")

    # -- in the step ----------------------------------------------------------------------------
    def kind_for(self, params: PoolingParams) -> str:
        return "last" if params.task == "score" else self.pooling

    def needs_every_position(self, params: PoolingParams) -> bool:
        """Whether the request reads the hidden state of every position (then it bypasses
        the prefix cache: see the module docstring)."""
        return self.kind_for(params) != "last"

    def hidden_rows(self, params: PoolingParams, start: int, num_new: int, last_chunk: bool) -> range:
        """Offsets within a chunk (positions start .. start + num_new) whose final hidden
        states the request's pooling reads."""
        kind = self.kind_for(params)
        if kind == "last":
            return range(num_new - 1, num_new) if last_chunk else range(0)
        if kind == "cls":
            return range(0, 1) if start == 0 else range(0)
        return range(num_new)

    def accumulate(self, state: PoolState, params: PoolingParams, start: int, rows: np.ndarray) -> None:
        """Fold one chunk's rows (float32 [n, hidden]) into `state`."""
        if start == 0:  # a (re)started prefill: a preempted request is recomputed from the start
            state.acc, state.count = None, 0
        if not len(rows):
            return
        kind = self.kind_for(params)
        if kind == "mean":
            s = rows.sum(axis=0, dtype=np.float64)
            state.acc = s if state.acc is None else state.acc + s
        elif kind == "max":
            m = rows.max(axis=0)
            state.acc = m if state.acc is None else np.maximum(state.acc, m)
        else:  # last, cls: the one row
            state.acc = rows[-1].copy()
        state.count += len(rows)

    def pooled(self, state: PoolState, params: PoolingParams) -> np.ndarray:
        """The pooled hidden state (float32 [hidden]) once every chunk is in."""
        if state.acc is None:
            raise RuntimeError("pooling found no hidden state for the request")
        v = state.acc / state.count if self.kind_for(params) == "mean" else state.acc
        return np.asarray(v, dtype=np.float32)

    def embedding(self, pooled: np.ndarray, params: PoolingParams) -> np.ndarray:
        """Matryoshka truncation, then normalization (as the model's Normalize module, or
        as asked): vLLM's order, so a truncated embedding is a unit vector again."""
        v = pooled[: params.dimensions] if params.dimensions else pooled
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return np.asarray(v, dtype=np.float32)


def is_classifier(path: str | Path) -> bool:
    """A `*ForSequenceClassification` checkpoint (a cross-encoder reranker with a `score` head)."""
    config = _read_json(Path(path) / "config.json") or {}
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


_BACKBONE = ("embed_tokens.", "layers.", "norm.")  # a transformers *Model's own keys (no "model." prefix)


def needs_own_loader(path: str | Path) -> bool:
    """Whether mlx-lm's `load` cannot take this pooling model as it is: a sequence
    classifier (a `score` head), or an embedding checkpoint saved as the bare backbone
    (official Qwen3-Embedding and e5-mistral: keys without "model.", and no LM head)."""
    path = Path(path)
    if is_classifier(path):
        return True
    if not (path / "modules.json").exists():
        return False
    keys = checkpoint_keys(path)
    config = _read_json(path / "config.json") or {}
    return any(k.startswith(_BACKBONE) for k in keys) or (
        not config.get("tie_word_embeddings", True) and "lm_head.weight" not in keys)


def checkpoint_keys(path: Path) -> set[str]:
    """The tensor names of a model directory's safetensors (from the index, or each file's
    header: nothing is loaded)."""
    index = _read_json(path / "model.safetensors.index.json")
    if index is not None:
        return set(index.get("weight_map", {}))
    keys: set[str] = set()
    for f in sorted(path.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            keys |= {k for k in json.loads(fh.read(n)) if k != "__metadata__"}
    return keys


def load_pooling_model(path: str | Path):
    """(model, tokenizer) for what `needs_own_loader` says mlx-lm's `load` cannot take:
    mlx-lm's own model class of the family, with
    - a bare backbone's keys put under "model." (as mlx-lm names them), and its LM head
      tied to the embeddings when the checkpoint has none (Qwen3-Embedding-8B says untied
      and ships no head: an embedding model never uses it);
    - for a sequence classifier (`*ForSequenceClassification` of a family mlx-lm loads:
      Qwen3, Qwen2, Llama, Mistral, ...) a `score` Linear (hidden -> 1, no bias) beside its
      layers. One label (a relevance logit) only. A family mlx-lm cannot load (BERT,
      XLM-RoBERTa cross-encoders) fails with mlx-lm's error.
    Weights load strictly: every tensor must find its place."""
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes, load_model, load_tokenizer

    path = Path(path)
    config = _read_json(path / "config.json") or {}
    keys = checkpoint_keys(path)
    labels = 0
    if is_classifier(path):
        labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
        if labels != 1:
            raise UnsupportedPooling(f"{path.name}: a classifier of {labels} labels; only a one-label relevance "
                                     "score is served")
    overrides = {}
    if not config.get("tie_word_embeddings", True) and "lm_head.weight" not in keys:
        log.info("%s has no LM head: its embeddings stand in for it (never used for embeddings)", path.name)
        overrides["tie_word_embeddings"] = True

    def classes(config: dict):
        model_class, args_class = _get_classes(config)

        def build(args):
            # mlx-lm's own family model (the host path and the per-family code know it by its
            # class), with the classifier's head beside its layers and the keys renamed first
            model = model_class(args)
            if labels:
                model.score = nn.Linear(args.hidden_size, labels, bias=False)
            family_sanitize = getattr(model, "sanitize", None)

            def sanitize(weights):
                weights = {("model." + k if k.startswith(_BACKBONE) else k): v for k, v in weights.items()}
                return family_sanitize(weights) if family_sanitize is not None else weights

            model.sanitize = sanitize
            return model

        return build, args_class

    model, config = load_model(path, get_model_classes=classes, model_config=overrides)
    return model, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def yes_no_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """Qwen3-Reranker's input for one (query, document) pair (its model card's format)."""
    instruction = instruction or DEFAULT_RERANK_INSTRUCTION
    return (f"{QWEN3_RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
            f"{QWEN3_RERANK_SUFFIX}")


def _yes_no_ids(tokenizer, tokens) -> tuple[int, int]:
    """(yes, no) token ids from vLLM's `classifier_from_token` order ([no, yes])."""
    no, yes = tokens[0], tokens[1]
    ids = []
    for t in (yes, no):
        i = tokenizer.convert_tokens_to_ids(t)
        if i is None or (getattr(tokenizer, "unk_token_id", None) is not None and i == tokenizer.unk_token_id):
            raise UnsupportedPooling(f"the reranker's tokenizer has no single token {t!r} to score with")
        ids.append(int(i))
    return ids[0], ids[1]


def _read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        raise UnsupportedPooling(f"{path} cannot be read: {e}") from None


def _sentence_transformers(path: Path) -> tuple[str, bool, str] | None:
    """(pooling, normalize, source) from sentence-transformers' modules, or None when the
    directory has none. A module the engine does not compute (Dense, a pooling mode other
    than one of POOLING_TYPES, several at once, a pooling without the prompt) is refused."""
    modules = _read_json(path / "modules.json")
    if modules is None:
        return None
    pooling, normalize = None, False
    for m in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            cfg = _read_json(path / m.get("path", "") / "config.json") or {}
            pooling = _st_pooling_mode(cfg, path / m.get("path", ""))
        else:
            raise UnsupportedPooling(f"{path.name}: sentence-transformers module {kind} ({m.get('path')}) is not "
                                     "supported (only Transformer, Pooling and Normalize)")
    if pooling is None:
        raise UnsupportedPooling(f"{path.name}: modules.json has no Pooling module")
    return pooling, normalize, "sentence-transformers modules.json"


def _st_pooling_mode(cfg: dict, where: Path) -> str:
    if cfg.get("include_prompt") is False:
        raise UnsupportedPooling(f"{where}: pooling without the prompt (include_prompt false) is not supported")
    if isinstance(cfg.get("pooling_mode"), str):
        modes = [cfg["pooling_mode"]]
    else:
        modes = [k[len("pooling_mode_"):] for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise UnsupportedPooling(f"{where}: pooling mode {modes or 'none'} is not supported (one of lasttoken, "
                                 "mean_tokens, cls_token, max_tokens)")
    return _ST_MODES[modes[0]]
