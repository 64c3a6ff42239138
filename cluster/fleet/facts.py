"""What a node holds on disk, as the fleet plans with it: a `pb.DiskModel` per model under
`--models-dir` (node side; no MLX, no tensor data read).

From an mlx-lm directory: config.json and each `model*.safetensors` file's JSON header
(8 bytes of length, then the header; the tensors are never read). From a GGUF file: its
metadata and tensor table, through the importer's own plan (`gguf.imported_tensors`:
what the worker will load is the import of that file).

- weight_bytes: what the worker holds once `model_runner.ready_to_serve` ran on that
  platform. "cpu": every floating-point weight in float32 (the compute dtype there), and a
  quantized layer dequantized to float32 (`dequantize.py`, as `--cpu-dequantize yes` does;
  its scales and biases are gone). "metal": as stored. Tensors mlx-lm's loaders drop
  (a tied model's `lm_head`, RoPE's `inv_freq`, multi-token-prediction heads, a multimodal
  checkpoint's vision and audio towers) are not counted.
- kv_bytes_per_token: one token's K and V over the layers that own a pool, in the compute
  dtype (the dtype of the model's first floating-point parameter, its embedding's, on
  Metal): what `model_runner.kv_bytes_per_block` gives per block, divided by the block
  size. A sliding-window layer holds a full pool (the engine's pools are not windowed); a
  layer that reads an earlier layer's K/V (Gemma 4) none; an MLA layer one row of latent +
  RoPE key; a hybrid's recurrent layers none: their state is per request, not per token.
- state_bytes_per_seq: that state (a hybrid's; the worker holds one per `--max-num-seqs`),
  from the family's config as mlx-lm's caches hold it.
- tasks: what the worker serves with it (`pooling.Pooler.for_model`: an embedding model
  "embed", a reranker or classifier "score", else "generate").
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from cluster.proto.orchard.v1 import orchard_pb2 as pb

log = logging.getLogger(__name__)

PLATFORMS = ("cpu", "metal")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "U64": 8, "I32": 4,
               "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
DEFAULT_GROUP_SIZE = 64  # mlx-lm's, where a quantized model's config names none
# mlx-lm's defaults for the config keys read below, where a family's config leaves them out
GEMMA4_DEFAULTS = {"num_kv_shared_layers": 20, "global_head_dim": 512, "num_key_value_heads": 1,
                   "sliding_window_pattern": 5}
QWEN3_NEXT_FULL_ATTENTION_INTERVAL = 4


class ModelFilesError(ValueError):
    """A model's files cannot be read as a model (the DiskModel's `error`)."""


@dataclass(frozen=True)
class Tensor:
    dtype: str  # safetensors' name: "F32", "U32", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


# -- reading files -------------------------------------------------------------------------------

def safetensors_header(path: Path) -> dict[str, Tensor]:
    """A safetensors file's tensors (name -> dtype and shape) from its header alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelFilesError(f"{path.name}: not a safetensors file ({len(head)} bytes)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise ModelFilesError(f"{path.name}: a safetensors header of {n} bytes (at most {MAX_HEADER_BYTES})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ModelFilesError(f"{path.name}: an unreadable safetensors header ({e})") from None
    return header_tensors(header, path.name)


def header_tensors(header: dict, name: str) -> dict[str, Tensor]:
    """The tensors of a safetensors header (its JSON, however it was read: from a file here,
    or through the hub's range reads in `hub.describe`), checked."""
    try:
        tensors = {key: Tensor(str(t["dtype"]), tuple(int(d) for d in t["shape"]))
                   for key, t in header.items() if key != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ModelFilesError(f"{name}: an unreadable safetensors header ({e})") from None
    odd = sorted({t.dtype for t in tensors.values()} - DTYPE_BYTES.keys())
    if odd:
        raise ModelFilesError(f"{name}: tensor dtype {odd[0]} is not one Orchard knows")
    negative = next((key for key, t in tensors.items() if any(d < 0 for d in t.shape)), None)
    if negative is not None:
        raise ModelFilesError(f"{name}: tensor {negative} has a negative dimension {tensors[negative].shape}")
    return tensors


WEIGHT_FILES = "model*.safetensors"  # the files mlx-lm loads a model's weights from


def checkpoint_tensors(model_dir: Path) -> dict[str, Tensor]:
    """Every tensor of the files mlx-lm loads (`WEIGHT_FILES`)."""
    files = sorted(model_dir.glob(WEIGHT_FILES))
    if not files:
        raise ModelFilesError(f"{model_dir.name}: no model*.safetensors file")
    tensors: dict[str, Tensor] = {}
    for f in files:
        tensors.update(safetensors_header(f))
    return tensors


def read_config(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelFilesError(f"{model_dir.name}/config.json: {e}") from None
    return checked_config(config, model_dir.name)


def checked_config(config, name: str) -> dict:
    """A parsed config.json that names its model_type, or ModelFilesError."""
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelFilesError(f"{name}/config.json: no model_type")
    return config


def text_config(config: dict) -> dict:
    """The language model's config: a multimodal wrapper's `text_config` over its own keys."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


# -- weights ---------------------------------------------------------------------------------------

# a multimodal checkpoint's towers, which mlx-lm's text models drop
_NOT_TEXT = re.compile(r"(?:^|\.)(?:vision_tower|vision_model|visual|audio_tower|multi_modal_projector|"
                       r"embed_vision|embed_audio)\.")


def dropped_at_load(name: str, config: dict) -> bool:
    """Whether mlx-lm's loaders drop this tensor (their `sanitize`): never held."""
    return ("rotary_emb.inv_freq" in name or name.startswith("mtp.") or ".mtp." in name
            or _NOT_TEXT.search(name) is not None
            or (name.startswith("lm_head.") and text_config(config).get("tie_word_embeddings") is True))


def _quantization(config: dict, module: str) -> dict:
    q = config.get("quantization") or config.get("quantization_config") or {}
    own = q.get(module)
    return own if isinstance(own, dict) else q


def weight_bytes(tensors: dict[str, Tensor], config: dict, platform: str) -> int:
    """Bytes of the weights the worker holds on `platform` (see the module docstring)."""
    held = {name: t for name, t in tensors.items() if not dropped_at_load(name, config)}
    if platform == "metal":
        return sum(t.nbytes for t in held.values())
    total = 0
    for name, t in held.items():
        base, _, kind = name.rpartition(".")
        if f"{base}.scales" in held:  # a quantized layer: dequantized to float32
            if kind == "weight":
                group = int(_quantization(config, base).get("group_size") or DEFAULT_GROUP_SIZE)
                scales = held[f"{base}.scales"].shape
                total += 4 * math.prod(scales[:-1]) * scales[-1] * group
            elif kind not in ("scales", "biases"):
                total += 4 * t.numel if t.dtype in FLOATING else t.nbytes
            continue
        total += 4 * t.numel if t.dtype in FLOATING else t.nbytes
    return total


def compute_dtype_bytes(tensors: dict[str, Tensor], platform: str) -> int:
    """Bytes per element of what the model computes in, and its KV pool holds: float32 on
    a CPU; on Metal the dtype of its first floating-point parameter (`model_runner.weight_dtype`),
    its embedding's (a quantized embedding's scales)."""
    if platform != "metal":
        return 4
    for kind in ("weight", "scales", "biases"):
        for name, t in tensors.items():
            if name.endswith(f"embed_tokens.{kind}") and t.dtype in FLOATING:
                return DTYPE_BYTES[t.dtype]
    floating = [t for t in tensors.values() if t.dtype in FLOATING]
    return DTYPE_BYTES[max(floating, key=lambda t: t.nbytes).dtype] if floating else 4


# -- the KV pool ---------------------------------------------------------------------------------

def _heads(c: dict) -> tuple[int, int]:
    """(KV heads, head size) of a family's plain attention layer."""
    heads = int(c.get("num_attention_heads") or c.get("n_head") or 0)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or (int(c.get("hidden_size") or 0) // heads if heads else 0))
    return kv_heads, head_dim


def num_layers(config: dict) -> int:
    c = text_config(config)
    return int(c.get("num_hidden_layers") or c.get("num_layers") or c.get("n_layer") or 0)


def attention_layers(config: dict) -> list[int]:
    """The layers that attend over K/V, in a hybrid family the ones that are not recurrent."""
    c, n = text_config(config), num_layers(config)
    mt = c.get("model_type")
    if mt in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        interval = int(c.get("full_attention_interval") or QWEN3_NEXT_FULL_ATTENTION_INTERVAL)
        return [i for i in range(n) if (i + 1) % interval == 0]
    if mt == "nemotron_h":  # one layer per block; "*" attends ("M" Mamba, "-" an MLP)
        return [i for i, b in enumerate(str(c.get("hybrid_override_pattern") or "")) if b == "*"]
    if mt == "lfm2":
        if c.get("full_attn_idxs") is not None:
            return [int(i) for i in c["full_attn_idxs"]]
        return [i for i, t in enumerate(c.get("layer_types") or []) if t == "full_attention"]
    if mt == "granitemoehybrid":
        return [i for i, t in enumerate(c.get("layer_types") or []) if t == "attention"]
    return list(range(n))


_PROJECTION = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.+\.)?([kv])_proj\.weight$")


def kv_row_elements(config: dict, tensors: dict[str, Tensor]) -> list[int]:
    """Per layer that owns a KV pool, the elements one token takes in it (K and V). A
    layer's K and V widths are its k_proj's and v_proj's rows (KV heads x head size,
    whatever a family takes its head size from); the config's where a family fuses them."""
    c = text_config(config)
    if c.get("kv_lora_rank"):  # multi-head latent attention: one row of latent + RoPE key serves as K and V
        return [int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0)] * num_layers(config)
    if c.get("model_type") == "gemma4_text":
        return _gemma4_rows(c)
    rows: dict[tuple[int, str], int] = {}
    for name, t in tensors.items():
        if (m := _PROJECTION.search(name)) and t.shape:
            rows[(int(m.group(1)), m.group(2))] = t.shape[0]
    kv_heads, head_dim = _heads(c)
    out = []
    for i in attention_layers(config):
        k = rows.get((i, "k"), kv_heads * head_dim)
        out.append(k + rows.get((i, "v"), k))
    return out


def _gemma4_rows(c: dict) -> list[int]:
    """Gemma 4: full-attention layers have their own head size (and, K = V, their own KV
    heads); the last `num_kv_shared_layers` layers read an earlier layer's K/V."""
    g = {**GEMMA4_DEFAULTS, **{k: v for k, v in c.items() if v is not None}}
    n = num_layers(c)
    types = g.get("layer_types")
    if not types:
        pattern = ["sliding_attention"] * (int(g["sliding_window_pattern"]) - 1) + ["full_attention"]
        types = (pattern * (n // len(pattern) + 1))[:n]
    owners = n - int(g["num_kv_shared_layers"])
    rows = []
    for i in range(owners if owners > 0 else n):
        full = types[i] == "full_attention"
        head_dim = int(g["global_head_dim"] or g["head_dim"]) if full else int(g["head_dim"])
        kv_heads = int(g["num_key_value_heads"])
        if full and g.get("attention_k_eq_v") and g.get("num_global_key_value_heads") is not None:
            kv_heads = int(g["num_global_key_value_heads"])
        rows.append(2 * kv_heads * head_dim)
    return rows


def kv_bytes_per_token(config: dict, tensors: dict[str, Tensor], dtype_bytes: int) -> int:
    return dtype_bytes * sum(kv_row_elements(config, tensors))


def recurrent_layers(config: dict) -> list[int]:
    """A hybrid family's layers that keep a recurrent state per request (none elsewhere)."""
    c, n = text_config(config), num_layers(config)
    mt = c.get("model_type")
    if mt in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2"):
        attends = set(attention_layers(config))
        return [i for i in range(n) if i not in attends]
    if mt == "nemotron_h":
        return [i for i, b in enumerate(str(c.get("hybrid_override_pattern") or "")) if b == "M"]
    if mt == "granitemoehybrid":
        return [i for i, t in enumerate(c.get("layer_types") or []) if t == "mamba"]
    if mt == "falcon_h1":
        return list(range(n))
    return []


def _state_elements(c: dict) -> tuple[int, int]:
    """(convolution state, recurrent state) elements of one recurrent layer for one request,
    as mlx-lm's caches hold them: the last kernel - 1 inputs of its convolution, and the
    linear attention's or Mamba-2's state."""
    mt = c.get("model_type")
    if mt in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # gated DeltaNet
        nk, dk = int(c["linear_num_key_heads"]), int(c["linear_key_head_dim"])
        nv, dv = int(c["linear_num_value_heads"]), int(c["linear_value_head_dim"])
        return (int(c["linear_conv_kernel_dim"]) - 1) * (2 * nk * dk + nv * dv), nv * dk * dv
    if mt == "lfm2":  # a short convolution, no other state
        return (int(c["conv_L_cache"]) - 1) * int(c["hidden_size"]), 0
    if mt == "nemotron_h":  # Mamba-2
        heads, head_dim, kernel = int(c["mamba_num_heads"]), int(c["mamba_head_dim"]), int(c["conv_kernel"])
        groups, state = int(c.get("n_groups") or 1), int(c["ssm_state_size"])
        inner = heads * head_dim
    elif mt == "falcon_h1":
        heads, head_dim, kernel = int(c["mamba_n_heads"]), int(c["mamba_d_head"]), int(c["mamba_d_conv"])
        groups, state = int(c.get("mamba_n_groups") or 1), int(c["mamba_d_state"])
        inner = int(c.get("mamba_d_ssm") or heads * head_dim)
    else:  # granitemoehybrid
        heads, head_dim, kernel = int(c["mamba_n_heads"]), int(c["mamba_d_head"]), int(c["mamba_d_conv"])
        groups, state = int(c.get("mamba_n_groups") or 1), int(c["mamba_d_state"])
        inner = heads * head_dim
    return (kernel - 1) * (inner + 2 * groups * state), heads * head_dim * state


def state_bytes_per_seq(config: dict, dtype_bytes: int) -> int:
    """A hybrid's recurrent state for one running request (`ModelRunner.state_bytes_per_slot`):
    the convolution's inputs in the compute dtype, the recurrent state in float32 (mlx-lm
    keeps it so)."""
    layers = recurrent_layers(config)
    if not layers:
        return 0
    conv, state = _state_elements(text_config(config))
    return len(layers) * (conv * dtype_bytes + state * 4)


def max_context(config: dict) -> int:
    c = text_config(config)
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if c.get(key):
            return int(c[key])
    return 0


def tasks(model_dir: Path, config: dict) -> list[str]:
    from cluster.worker.pooling import Pooler  # imports no MLX

    hidden = int(text_config(config).get("hidden_size") or 0)
    return list(Pooler.for_model(model_dir, hidden).tasks)


# -- a model, a directory of them ---------------------------------------------------------------

def disk_model(path: Path, platform: str) -> pb.DiskModel:
    """The facts of the model at `path` (an mlx-lm directory or a GGUF file) for a worker on
    `platform` ("cpu" or "metal"). A model that cannot be read gets `error` set, saying why."""
    _check_platform(platform)
    path = Path(path)
    out = pb.DiskModel(name=path.name)
    config: dict = {}
    try:
        out.file_bytes = _file_bytes(path)
        if path.is_file():
            from cluster import gguf

            config, planned = gguf.imported_tensors(path)
            tensors = {name: Tensor(dtype, shape) for name, dtype, shape in planned}
            model_tasks = ["generate"]
        else:
            config, tensors = read_config(path), checkpoint_tensors(path)
            model_tasks = tasks(path, config)
    except Exception as e:  # noqa: BLE001  (any unreadable model is reported, never fatal to the node)
        log.debug("cannot read %s", path, exc_info=True)
        out.error = _why(e, config)
        return out
    return model_facts(out, config, tensors, model_tasks, platform)


def model_facts(out: pb.DiskModel, config: dict, tensors: dict[str, Tensor], model_tasks: list[str],
                platform: str) -> pb.DiskModel:
    """`out` (its name and file_bytes set) with the facts of a model of this config and
    tensor table, however they were read: from a directory (`disk_model`) or from the hub's
    metadata (`hub.describe`). A config its family cannot be read from sets `error`."""
    _check_platform(platform)
    try:
        out.weight_bytes = weight_bytes(tensors, config, platform)
        dtype_bytes = compute_dtype_bytes(tensors, platform)
        out.kv_bytes_per_token = kv_bytes_per_token(config, tensors, dtype_bytes)
        out.state_bytes_per_seq = state_bytes_per_seq(config, dtype_bytes)
        out.num_layers = num_layers(config)
        out.max_context = max_context(config)
        out.tasks.extend(model_tasks)
    except Exception as e:  # noqa: BLE001  (any unreadable model is reported, never fatal to the node)
        log.debug("cannot read the facts of %s", out.name, exc_info=True)
        out.error = _why(e, config)
    return out


def _check_platform(platform: str) -> None:
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, not {platform!r}")


def _why(e: Exception, config: dict) -> str:
    if isinstance(e, KeyError):  # a config.json without a key its family needs
        return f"config.json has no {e.args[0]!r}, which a {config.get('model_type')} model needs"
    return str(e) or type(e).__name__


def _file_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def signature(path: Path) -> tuple:
    """What changes when a model's files do (sizes and modification times)."""
    files = [path] if path.is_file() else sorted(
        f for f in path.iterdir() if f.name == "config.json" or f.suffix in (".safetensors", ".json"))
    return tuple((f.name, s.st_size, s.st_mtime_ns) for f in files for s in [f.stat()])


_cache: dict[tuple[str, str], dict[str, tuple[tuple, pb.DiskModel]]] = {}  # (dir, platform) -> name -> (files, facts)


def is_model(path: Path) -> bool:
    return (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf")


def model_names(source: str) -> tuple[str, ...]:
    """The names under a node's --models-dir (`DiskModel.name`) that catalog source `source`
    may be, in order: NAME itself (a directory, or a file NAME.gguf named in full), then
    NAME.gguf. The one rule the agent, Ray's node side and the controller look a source up by."""
    return (source,) if source.endswith(".gguf") else (source, f"{source}.gguf")


def scan(models_dir: Path, platform: str) -> list[pb.DiskModel]:
    """The models directly under `models_dir` (directories with a config.json, *.gguf
    files), by name; each read again only when its files changed. A directory that does not
    exist holds none."""
    models_dir = Path(models_dir)
    try:
        entries = sorted(p for p in models_dir.iterdir() if not p.name.startswith(".") and is_model(p))
    except OSError:
        return []
    before = _cache.get((str(models_dir), platform), {})
    now: dict[str, tuple[tuple, pb.DiskModel]] = {}
    for path in entries:
        try:
            sig = signature(path)
        except OSError:
            continue  # removed while we looked
        cached = before.get(path.name)
        now[path.name] = cached if cached is not None and cached[0] == sig else (sig, disk_model(path, platform))
    _cache[(str(models_dir), platform)] = now  # a model removed from the directory is forgotten
    return [facts for _, facts in now.values()]
