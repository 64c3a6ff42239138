"""Each layer's attention, as the paged engine serves it.

mlx-lm says what a layer's attention needs in a few ways: the cache it makes for the
layer (a `KVCache`: full causal attention; a `RotatingKVCache`: a sliding window), the
attention module's own attributes (soft-capped logits, sinks) and a few model arguments
(K/V shared with an earlier layer, multi-head latent attention). `layer_specs` reads them
once, when the model loads, into one `LayerSpec` per layer, and refuses (UnsupportedModel)
a model with anything it does not know how to honour: a model is served exactly or not
at all.

`attach` then wraps each layer's attention module, and only that instance (a subclass
swap; mlx-lm's classes and modules are left as they are):
- most families call mlx-lm's `scaled_dot_product_attention` after writing K/V through
  `cache.update_and_fetch`; their own `__call__` runs unchanged, with that one name bound
  to `_paged_sdpa`, which sends a `PagedKVCache` layer to the paged kernels;
- a family whose attention does its own arithmetic has its call here (`FAMILY_CALLS`):
  Gemma 2 (soft-capped logits) and DeepSeek-V3's multi-head latent attention.

A hybrid model's recurrent layers (an mlx-lm `ArraysCache` / `MambaCache`: gated delta
nets, Mamba-2, short convolutions) get a spec marked `recurrent` and no K/V pool; their
modules (the ones that call `cache.advance`) are wrapped by `recurrent.attach`, which runs
mlx-lm's own code for them on per-request state slots. A layer with a recurrent mixer and
an attention side by side (Falcon-H1: mlx-lm makes it a `CacheList(ArraysCache, KVCache)`)
gets both: a spec that is `recurrent` and attends, with its `cache_list` saying which entry
is which; the runner hands it a `LayerCaches` that its code indexes as mlx-lm's CacheList.
Any other CacheList shape is refused, naming it.

The head geometry of every layer (KV heads, K and V widths) is measured, not guessed: a
forward over one token with recording caches builds the graph and reads the shapes
each layer writes (on a CPU the C kernels it reaches evaluate their inputs: one token's
worth of work).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from cluster.worker import kernels
from cluster.worker.patching import calls, original_call, rebind


class UnsupportedModel(ValueError):
    """The model needs something of its attention that the engine does not honour: refused
    when it loads, never served wrong."""


@dataclass(frozen=True)
class LayerSpec:
    """What layer `layer`'s attention needs from the paged engine."""

    layer: int
    kv_layer: int  # whose K/V pool it reads: its own, or an earlier layer's (shared K/V)
    window: int = -1  # sliding window in tokens (-1: full causal attention)
    softcap: float = 0.0  # attention logits soft-capped at this value (0: off)
    sinks: bool = False  # a learned logit per head joins the softmax (the module's `sinks`)
    latent: bool = False  # multi-head latent attention: K = V = [latent | rope key], one pool
    num_kv_heads: int = 0
    head_dim: int = 0  # width of a pool row
    recurrent: bool = False  # a recurrent state per request (a state slot)
    attention: bool = True  # attends over K/V (False: a recurrent layer alone, no K/V)
    # mlx-lm hands this layer a CacheList: what each of its entries is ("recurrent" for the
    # mixer's state, "kv" for the attention's K/V), in order; () for a single cache
    cache_list: tuple[str, ...] = ()

    @property
    def owns_kv(self) -> bool:
        return self.kv_layer == self.layer and self.attention


# -- the families' facts, in one place -------------------------------------------------------
# A family is listed under a feature only once it matches mlx-lm token for token with it
# (tests/test_engine.py, load/model_coverage.py). Everything else must be plain full
# attention through mlx-lm's scaled_dot_product_attention.

# Sliding-window layers: the window mlx-lm's RotatingKVCache keeps is the one the paged
# kernels apply to that layer.
SLIDING_WINDOW_FAMILIES = frozenset({"gemma3_text", "ministral3", "gpt_oss", "olmo3", "cohere2", "gemma4_text",
                                     "exaone4"})
# Attention logits soft-capped: the attention module's attribute that holds the cap.
SOFTCAP_FAMILIES = {"gemma2": "attn_logit_softcapping"}
# A learned sink logit per head (the attention module's `sinks`).
SINK_FAMILIES = frozenset({"gpt_oss"})
# Later layers reuse an earlier layer's K/V: `model.model.previous_kvs[i]` names it.
SHARED_KV_FAMILIES = frozenset({"gemma4_text"})
# Multi-head latent attention, cached as mlx-lm caches it: the compressed latent and the
# RoPE key, one row of kv_lora_rank + qk_rope_head_dim per token and layer.
MLA_FAMILIES = frozenset({"deepseek_v3"})
# Hybrids: recurrent layers (their own state per request, `recurrent.py`) beside attention
# layers. A layer without a cache (Nemotron-H's MLP blocks) is skipped: a spec's `layer`
# then counts the model's caches, in the order the model hands them to its layers. A layer
# with a recurrent mixer beside its attention (Falcon-H1) has one CacheList of the two.
HYBRID_FAMILIES = frozenset({"qwen3_next", "qwen3_5", "nemotron_h", "lfm2", "granitemoehybrid", "falcon_h1"})
RECURRENT_CACHES = frozenset({"ArraysCache", "MambaCache"})

_CACHE_MEANING = {
    "RotatingKVCache": "sliding-window attention",
    "ArraysCache": "a recurrent state: linear attention, Mamba or convolutions",
    "MambaCache": "a recurrent Mamba state",
    "CacheList": "several caches per layer: the engine serves a CacheList only as one recurrent state beside one "
                 "KVCache, in the hybrid families checked against mlx-lm",
    "ChunkedKVCache": "chunked local attention",
    "QuantizedKVCache": "a quantized K/V cache",
}
# attention-module attributes that change the arithmetic, and what they mean
_MODULE_FEATURES = {
    "attn_logit_softcapping": "soft-capped attention logits",
    "logit_softcapping": "soft-capped attention logits",
    "softcap": "soft-capped attention logits",
    "sinks": "attention sinks (a learned logit per head in the softmax)",
    "alibi": "ALiBi position biases",
    "alibi_slopes": "ALiBi position biases",
}


def model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", None) or type(model).__name__


def layer_modules(model: nn.Module) -> list[list[nn.Module]]:
    """The modules behind each of the model's caches, in order: the one of each layer whose
    `__call__` calls `cache.update_and_fetch` (self_attn, attention, attn, ... whatever the
    family names it), and in a hybrid family the recurrent one that calls `cache.advance`
    (one or the other, or both side by side; a hybrid's layer with neither has no cache).
    A layer another pipeline stage computes (`group/stage.py`) has none here."""
    found = []
    hybrid = model_type(model) in HYBRID_FAMILIES
    for i, layer in enumerate(model.layers):
        if getattr(layer, "_orchard_absent", False):  # another pipeline stage's layer: a pass-through here
            found.append([])
            continue
        mods = [m for _, m in layer.named_modules() if calls(type(m), "update_and_fetch")]
        mixers = [m for _, m in layer.named_modules() if is_recurrent(m)] if hybrid else []
        if hybrid and not mods and not mixers:
            continue
        if len(mods) > 1 or not hybrid and not mods:
            raise UnsupportedModel(f"model type {model_type(model)!r} is not served: layer {i} has {len(mods)} "
                                   "modules that write K/V, where the engine knows one attention per layer")
        if len(mixers) > 1:
            raise UnsupportedModel(f"model type {model_type(model)!r} is not served: layer {i} has "
                                   f"{len(mixers)} recurrent modules, where the engine knows one state per layer")
        found.append(mixers + mods)
    return found


def is_recurrent(module: nn.Module) -> bool:
    """A recurrent mixer: its `__call__` advances an mlx-lm ArraysCache (and writes no K/V)."""
    cls = type(module)
    return calls(cls, "advance") and not calls(cls, "update_and_fetch")


def layer_specs(model: nn.Module, fresh: bool = False) -> list[LayerSpec]:
    """One LayerSpec per layer (geometry measured), or UnsupportedModel naming the feature.
    Read once per model object, unless `fresh`."""
    cached = None if fresh else model.__dict__.get("_orchard_specs")
    if cached is None:
        cached = _layer_specs(model)
        object.__setattr__(model, "_orchard_specs", cached)  # a plain attribute, not a module child
    return list(cached)


def _layer_specs(model: nn.Module) -> tuple[LayerSpec, ...]:
    specs = _features(model)
    geometry = _measure(model, specs)
    out = []
    for s in specs:
        if not s.attention:
            out.append(s)
            continue
        kvh, dk, dv = geometry[s.kv_layer]
        if dk != dv and not s.latent:
            raise UnsupportedModel(f"model type {model_type(model)!r} is not served: layer {s.layer} has keys of "
                                   f"width {dk} and values of width {dv}; the paged kernels take one head size")
        out.append(LayerSpec(**{**s.__dict__, "num_kv_heads": kvh, "head_dim": dk}))
    return tuple(out)


def _features(model: nn.Module) -> list[LayerSpec]:
    """Each layer's window, softcap, sinks, shared K/V and MLA, from the model; geometry 0."""
    mt = model_type(model)
    make_cache = getattr(model, "make_cache", None)
    caches = make_cache() if make_cache is not None else None
    n, kv_layer = _kv_layers(model, mt, caches)
    windows, recurrent, attends, cache_list = _cache_features(mt, caches, n)
    modules = _attention_modules(model, mt, caches, recurrent, attends)
    latent = any(getattr(m, "kv_lora_rank", None) for m in modules)
    if latent and mt not in MLA_FAMILIES:
        raise _refused(mt, "it uses multi-head latent attention (MLA, kv_lora_rank), which the engine serves for "
                           f"{', '.join(sorted(MLA_FAMILIES))} only")
    for i in range(n):
        if kv_layer[i] != i:
            windows[i] = windows[kv_layer[i]]
    specs = []
    for i, m in enumerate(modules):
        if not attends[i]:
            specs.append(LayerSpec(layer=i, kv_layer=i, recurrent=True, attention=False))
            continue
        softcap, sinks = _module_features(mt, i, m)
        specs.append(LayerSpec(layer=i, kv_layer=kv_layer[i], window=windows[i], softcap=softcap, sinks=sinks,
                               latent=latent, recurrent=recurrent[i], cache_list=cache_list[i]))
    return specs


def _refused(mt: str, what: str) -> UnsupportedModel:
    return UnsupportedModel(f"model type {mt!r} is not served: {what}")


def _kv_layers(model: nn.Module, mt: str, caches: list | None) -> tuple[int, list[int]]:
    """The number of layers that hold state, and the layer whose K/V each reads: its own,
    or, in a family that shares K/V, an earlier one's."""
    n = len(model.layers)
    kv_layer = list(range(n))
    if mt in HYBRID_FAMILIES and caches is not None:
        n = len(caches)  # a hybrid's layers without a cache (MLP blocks) hold no state
    if caches is not None and len(caches) != n:
        previous = getattr(getattr(model, "model", None), "previous_kvs", None)
        if mt not in SHARED_KV_FAMILIES or previous is None or len(caches) > n:
            raise _refused(mt, f"it has {n} layers but {len(caches)} caches: a layer without a cache of its own is "
                               "served only where it reads an earlier layer's K/V, in "
                               + ", ".join(sorted(SHARED_KV_FAMILIES)))
        kv_layer = [int(p) for p in previous]
        owners = len(caches)  # layers 0 .. owners-1 write K/V; the rest read one of them
        if any(kv_layer[i] != i for i in range(owners)) or any(kv_layer[i] >= owners for i in range(owners, n)):
            raise _refused(mt, f"its layers' K/V sources {kv_layer} are not the first {owners} layers")
    return n, kv_layer


def _cache_features(mt: str, caches: list | None, n: int) -> tuple[list[int], list[bool], list[bool], list[tuple]]:
    """Per layer, from the caches mlx-lm makes: its sliding window (-1: none), whether it
    keeps a recurrent state, whether it attends, and a hybrid CacheList's state entries;
    UnsupportedModel for a cache the paged engine would serve wrongly."""
    hybrid = mt in HYBRID_FAMILIES
    windows, other, recurrent, attends, cache_list = [-1] * n, {}, [False] * n, [True] * n, [()] * n
    for i, cache in enumerate(caches or []):
        name = type(cache).__name__
        if name == "KVCache":
            continue
        if name in RECURRENT_CACHES and hybrid:
            recurrent[i], attends[i] = True, False
            continue
        if name == "CacheList" and hybrid and (entries := _state_beside_kv(cache)):
            recurrent[i], cache_list[i] = True, entries
            continue
        if name == "RotatingKVCache" and mt in SLIDING_WINDOW_FAMILIES and not getattr(cache, "keep", 0):
            windows[i] = int(cache.max_size)
        else:
            other.setdefault(_cache_name(cache), []).append(i)
    if other.keys() & RECURRENT_CACHES:
        ids = sorted(i for name in other.keys() & RECURRENT_CACHES for i in other[name])
        kinds = ", ".join(sorted(other.keys() & RECURRENT_CACHES))
        raise _refused(mt, f"layers {_ranges(ids)} keep a recurrent state ({kinds}), which the engine serves, with "
                           "state slots, only for the hybrid families checked against "
                           f"mlx-lm: {', '.join(sorted(HYBRID_FAMILIES))}")
    if other:
        what = "; ".join(f"layers {_ranges(ids)} use {name} "
                         f"({_CACHE_MEANING.get(name.split('(')[0], 'an attention the engine does not know')})"
                         for name, ids in other.items())
        raise _refused(mt, f"{what}. The paged engine would give those layers full attention and generate the "
                           "wrong tokens, so it refuses the model")
    return windows, recurrent, attends, cache_list


def _attention_modules(model: nn.Module, mt: str, caches: list | None, recurrent: list[bool],
                       attends: list[bool]) -> list[nn.Module]:
    """Each layer's attention module (its recurrent one where it has none), once its
    modules agree with the caches it makes."""
    modules = layer_modules(model)
    kinds = [(any(map(is_recurrent, ms)), not all(map(is_recurrent, ms))) for ms in modules]
    if len(modules) != len(recurrent) or kinds != list(zip(recurrent, attends)):
        raise _refused(mt, f"its layers' attention and recurrent modules do not match the caches it makes "
                           f"({', '.join(_cache_name(c) for c in caches or [])})")
    return [next((m for m in ms if not is_recurrent(m)), ms[0]) for ms in modules]


def _module_features(mt: str, i: int, m: nn.Module) -> tuple[float, bool]:
    """Layer `i`'s attention module's softcap and sinks; UnsupportedModel for a feature the
    engine does not apply for this family, or attention it computes in its own code."""
    softcap_attr = SOFTCAP_FAMILIES.get(mt)
    softcap = float(getattr(m, softcap_attr) or 0.0) if softcap_attr else 0.0
    sinks = mt in SINK_FAMILIES and getattr(m, "sinks", None) is not None
    for attr, meaning in _MODULE_FEATURES.items():
        value = getattr(m, attr, None)
        if value is None or value is False or attr == softcap_attr or (attr == "sinks" and sinks):
            continue
        if isinstance(value, (int, float)) and value == 0:
            continue
        raise _refused(mt, f"layer {i}'s attention ({type(m).__name__}) has {meaning} ({attr}), which the engine "
                           "does not apply for this family")
    if mt not in FAMILY_CALLS and not calls(type(m), "scaled_dot_product_attention"):
        raise _refused(mt, f"layer {i}'s attention ({type(m).__name__}) computes attention in its own code rather "
                           "than through mlx-lm's scaled_dot_product_attention, and the engine has no paged "
                           "version of it")
    return softcap, sinks


def _cache_name(cache) -> str:
    """A cache's type, and a CacheList's entries: 'CacheList(ArraysCache, KVCache)'."""
    name = type(cache).__name__
    if name == "CacheList":
        name += f"({', '.join(_cache_name(c) for c in getattr(cache, 'caches', ()))})"
    return name


def _state_beside_kv(cache) -> tuple[str, ...] | None:
    """The entries of a CacheList the engine serves (one recurrent state beside one plain
    KVCache, in either order) as ("recurrent", "kv") in its order; None for any other."""
    names = [type(c).__name__ for c in getattr(cache, "caches", ())]
    if len(names) != 2 or sum(n in RECURRENT_CACHES for n in names) != 1 or names.count("KVCache") != 1:
        return None
    return tuple("recurrent" if n in RECURRENT_CACHES else "kv" for n in names)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2, 4'."""
    out, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ", ".join(out)


# -- the cache each layer is handed ------------------------------------------------------------

class PagedKVCache:
    """The cache object one layer's attention gets: writes the step's K/V into the runner's
    pool through the step's slot mapping, and attends over the pool with the layer's spec."""

    def __init__(self, runner, spec: LayerSpec):
        self.runner = runner
        self.spec = spec
        self.pending: tuple[mx.array, mx.array] | None = None  # this step's K/V, not yet in the pool

    @property
    def offset(self) -> mx.array:
        return self.runner.batch.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys / values [T, KVH, 1, D] -> the flat pool [slots, KVH, D]. A layer that shares
        # an earlier layer's K/V writes nothing: that layer wrote them this step. With the C
        # kernels the rows are copied in place when the layer attends (`write_pending`):
        # MLX's scatter moves them element by element.
        s, r = self.spec, self.runner
        if s.owns_kv:
            if r.write_kv_in_c:
                self.pending = (keys, values)
                return keys, values
            T, KVH, _, D = keys.shape
            slots = r.batch.slot_mapping
            r.k_pool[s.layer][slots] = keys.reshape(T, KVH, D).astype(r.kv_dtype)
            if not s.latent:  # MLA: one pool holds both
                r.v_pool[s.layer][slots] = values.reshape(T, KVH, values.shape[-1]).astype(r.kv_dtype)
        return keys, values

    def write_pending(self, *with_them: mx.array) -> None:
        """Put this step's K/V rows (held since update_and_fetch) into the layer's pools,
        evaluating `with_them` in the same pass (the queries: one evaluation, not two)."""
        if self.pending is None:
            return
        keys, values = self.pending
        mx.eval(keys, values, *with_them)
        self.pending = None
        from cluster.worker.kernels import cpu

        s, r = self.spec, self.runner
        cpu.write_kv(r.k_pool[s.layer], None if s.latent else r.v_pool[s.layer], r.batch.slot_mapping,
                     keys, None if s.latent else values)

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        s, r = self.spec, self.runner
        self.write_pending(queries)
        b = r.batch
        T, H, _, D = queries.shape
        shape = (r.num_blocks, r.block_size, s.num_kv_heads, s.head_dim)
        out = kernels.paged_attention(
            queries.reshape(T, H, D),
            r.k_pool[s.kv_layer].reshape(shape),
            r.v_pool[s.kv_layer].reshape(shape),
            b.block_tables,
            b.seq_lens,
            b.cu_seqlens_q,
            scale=scale,
            sliding_window=s.window,
            softcap=s.softcap,
            sinks=sinks if s.sinks else None,
            plan=b.plan,
        )
        return out.reshape(T, H, 1, D)


class LayerCaches:
    """What a layer gets where mlx-lm hands it a CacheList: our caches for its entries, in
    mlx-lm's order (the mixer's RecurrentCache, the attention's PagedKVCache), indexed as
    mlx-lm's code indexes its CacheList (`cache[0]`, `cache[1]`)."""

    def __init__(self, spec: LayerSpec, caches):
        assert len(caches) == len(spec.cache_list)
        self.spec = spec
        self.caches = tuple(caches)

    def __getitem__(self, i):
        return self.caches[i]


def layer_cache(spec: LayerSpec, kv, state):
    """The one object a layer is handed: its K/V cache, its recurrent state, or, where
    mlx-lm gives it a CacheList, a LayerCaches of both in mlx-lm's order."""
    if spec.cache_list:
        return LayerCaches(spec, [state if k == "recurrent" else kv for k in spec.cache_list])
    return kv if kv is not None else state


class _ProbeCache:
    """Records the shapes a layer writes (`_measure`); its attention output is zeros."""

    def __init__(self, spec: LayerSpec):
        self.spec = spec
        self.shapes: tuple[int, int, int] | None = None
        self.offset = mx.array([0], dtype=mx.int32)

    def update_and_fetch(self, keys, values):
        if self.shapes is None:
            self.shapes = (keys.shape[1], keys.shape[-1], values.shape[-1])
        return keys, values

    def attend(self, queries, scale, sinks=None):
        return mx.zeros_like(queries)


def probe_forward(model: nn.Module, specs: list[LayerSpec]) -> list[tuple["_ProbeCache | None", object]]:
    """One token's forward (lazy but for what a C kernel evaluates): per layer, the
    _ProbeCache that recorded what its attention writes and the fresh mlx-lm cache its
    recurrent module ran on (None where it has no such part)."""
    attach(model)
    fresh = model.make_cache() if any(s.recurrent for s in specs) else None
    parts = []
    for s in specs:
        kv = _ProbeCache(s) if s.attention else None
        state = None
        if s.recurrent:
            state = fresh[s.layer][s.cache_list.index("recurrent")] if s.cache_list else fresh[s.layer]
        parts.append((kv, state))
    model(mx.zeros((1, 1), dtype=mx.int32), cache=[layer_cache(s, kv, state) for s, (kv, state) in zip(specs, parts)])
    return parts


def _measure(model: nn.Module, specs: list[LayerSpec]) -> list[tuple[int, int, int]]:
    """(KV heads, K width, V width) each layer writes, from one token's forward, unevaluated
    (a recurrent layer runs on a fresh mlx-lm cache of its own and writes none)."""
    probes = [kv or _ProbeCache(s) for s, (kv, _) in zip(specs, probe_forward(model, specs))]
    missing = [s.layer for s, p in zip(specs, probes) if p.shapes is None and s.owns_kv]
    if missing:
        raise UnsupportedModel(f"model type {model_type(model)!r} is not served: layers {_ranges(missing)} never "
                               "write K/V through their cache")
    return [p.shapes for p in probes]


# -- routing each layer's attention to the paged kernels -------------------------------------

def _paged_sdpa(queries, keys, values, cache, scale, mask=None, sinks=None, **kwargs):
    """mlx-lm's scaled_dot_product_attention, as the wrapped layers see it."""
    if not hasattr(cache, "attend"):
        from mlx_lm.models.base import scaled_dot_product_attention

        return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=sinks, **kwargs)
    if kwargs or isinstance(mask, mx.array):
        passed = "a mask array" if isinstance(mask, mx.array) else sorted(kwargs)
        raise UnsupportedModel(f"this attention passes {passed} to scaled_dot_product_attention, which the paged "
                               "kernels do not apply")
    return cache.attend(queries, scale, sinks)


def _gemma2_call(self, x, mask=None, cache=None):
    """Gemma 2's attention: logits soft-capped (mlx-lm computes them in the module)."""
    if not hasattr(cache, "attend"):
        return original_call(type(self))(self, x, mask, cache)
    B, L, _ = x.shape
    q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
    k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = self.rope(q, offset=cache.offset)
    k = self.rope(k, offset=cache.offset)
    cache.update_and_fetch(k, v)
    out = cache.attend(q, self.scale)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _mla_call(self, x, mask=None, cache=None):
    """DeepSeek-V3's multi-head latent attention over a paged pool of [latent | rope key]
    rows (MQA: one KV head). The query is absorbed into the latent space (embed_q), as
    mlx-lm does for decoding, and joined with its RoPE part, so one dot product gives
    mlx-lm's q_nope . latent + q_pe . k_pe; the output's latent part goes out through
    unembed_out."""
    if not hasattr(cache, "attend"):
        return original_call(type(self))(self, x, mask, cache)
    B, L, _ = x.shape
    if self.q_lora_rank is None:
        q = self.q_proj(x)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
    latent = self.kv_a_layernorm(latent)[:, None]  # [B, 1, L, r]
    k_pe = self.rope(k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3), cache.offset)
    q_pe = self.rope(q_pe, cache.offset)
    kv = mx.concatenate([latent, k_pe], axis=-1)  # [B, 1, L, r + rope]
    cache.update_and_fetch(kv, kv)
    query = mx.concatenate([self.embed_q(q_nope), q_pe], axis=-1)  # [B, H, L, r + rope]
    out = cache.attend(query, self.scale)[..., : self.kv_lora_rank]
    out = self.unembed_out(out)  # [B, H, L, v_head_dim]
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


# families whose attention is computed here, not through scaled_dot_product_attention
FAMILY_CALLS: dict[str, Callable] = {"gemma2": _gemma2_call, "deepseek_v3": _mla_call}

_WRAPPED: dict[tuple[type, str], type] = {}


def attach(model: nn.Module) -> None:
    """Wrap each layer's attention module (this model's instances only) so that, given a
    PagedKVCache, it attends through the paged kernels. Idempotent. A hybrid model's
    recurrent modules are left to `recurrent.attach`."""
    call = FAMILY_CALLS.get(model_type(model))
    for m in (m for ms in layer_modules(model) for m in ms):
        if is_recurrent(m):
            continue
        cls = type(m)
        if getattr(cls, "_orchard_paged", False):
            continue
        key = (cls, model_type(model))
        if key not in _WRAPPED:
            original = original_call(cls)
            paged = _per_class(call) if call else rebind(original, scaled_dot_product_attention=_paged_sdpa)
            paged._orchard_original = original
            _WRAPPED[key] = type(cls.__name__, (cls,), {"__call__": paged, "_orchard_paged": True})
        m.__class__ = _WRAPPED[key]


def _per_class(call: Callable) -> types.FunctionType:
    def paged(self, *args, **kwargs):
        return call(self, *args, **kwargs)

    return paged
