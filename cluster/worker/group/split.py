"""How a pipeline group's layers are split over its stages, by weight (pure: no MLX, so
that the fleet's controller, which runs without it, plans a group's shares as the group
itself splits its layers)."""

from __future__ import annotations


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
