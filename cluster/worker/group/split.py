"""How a pipeline group's layers are split over its stages, by weight (pure: no MLX, so
that the fleet's controller, which runs without it, plans a group's shares as the group
itself splits its layers)."""

from __future__ import annotations

import re

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def split_layers(layer_bytes: list[int], shares: list[float], embed_bytes: int = 0, head_bytes: int = 0) -> list[range]:
    """Per stage (first stage first), its run of layers: stage s's weights (its layers, the
    embedding on stage 0, the head on the last) as close as the layer boundaries allow to
    its share of the whole. Every stage gets at least one layer."""
    n, stages = len(layer_bytes), len(shares)
    if n < stages:
        raise ValueError(f"{n} layers cannot be split over {stages} stages")
    total = sum(layer_bytes) + embed_bytes + head_bytes
    weights = [s / sum(shares) for s in shares]
    bounds, start, done = [], 0, embed_bytes
    target = 0.0
    for s in range(stages - 1):
        target += weights[s] * total
        best, best_err, acc = start + 1, None, done
        for end in range(start + 1, n - (stages - 1 - s) + 1):
            acc += layer_bytes[end - 1]
            err = abs(acc - target)
            if best_err is None or err < best_err:
                best, best_err = end, err
        done += sum(layer_bytes[start:best])
        bounds.append(range(start, best))
        start = best
    bounds.append(range(start, n))
    return bounds


def stage_weight_files(weight_map: dict[str, str], layers: range, embeds: bool, heads: bool) -> list[str]:
    """The weight files (a model.safetensors.index.json's `weight_map`: tensor -> file) a
    stage reads: those of its `layers`, the embedding's on the first stage (`embeds`), the
    final norm's and head's (a tied head: the embedding's) on the last (`heads`). Anything
    else outside the layers is read by every stage. Pure, so the fleet's hub pull fetches
    for a rank the files its stage will read."""
    tied = not any("lm_head" in name for name in weight_map)
    files = set()
    for name, f in weight_map.items():
        m = _LAYER.search(name)
        if m is not None:
            needed = int(m.group(1)) in layers
        elif "embed_tokens" in name:
            needed = embeds or (heads and tied)
        elif "lm_head" in name or re.search(r"(?:^|\.)norm\.", name):
            needed = heads
        else:
            needed = True
        if needed:
            files.add(f)
    return sorted(files)
