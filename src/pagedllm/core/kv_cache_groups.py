"""KV cache groups: attention layers that share one block table (vLLM's hybrid allocator).

Layers are grouped by attention spec (full attention, or a sliding window of W tokens). A
model whose layers all have one spec is one group holding every layer (Llama, Qwen, Mistral).
A model mixing specs (Gemma 2: local/global 1:1; Gemma 3: 5 local : 1 global) gets groups of
equal layer count, ``layers_per_group`` each, all drawing from one pool of same-sized blocks:
a physical block holds the K/V of ``layers_per_group`` layers, and block id b of group g
addresses slot i of the layer ``groups[g].layers[i]``. Each group has its own block table per
request, so a sliding group frees the blocks that fell out of its window while the full group
keeps them. Full-attention groups come first: group 0 holds every block of a request
whenever some layer attends to the whole context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class KVCacheGroupSpec:
    sliding_window: int | None  # None: full attention
    layers: tuple[int, ...]  # global layer indices; layers[i] is stored in slot i of the group's blocks


def make_kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """Group the layers (``layer_windows[i]``: layer i's window, None for full attention).

    One spec: one group of every layer. Several: the group size is the fewest layers any spec
    has (or the most, when the counts are within 25% of each other, as vLLM does), each spec's
    layers split in order into groups of that size (the last one may hold fewer)."""
    if not layer_windows:
        raise ValueError("a model with KV cache needs at least one attention layer")
    by_spec: dict[int | None, list[int]] = {}
    for i, window in enumerate(layer_windows):
        by_spec.setdefault(window, []).append(i)
    if len(by_spec) == 1:
        ((window, layers),) = by_spec.items()
        return [KVCacheGroupSpec(window, tuple(layers))]
    counts = [len(layers) for layers in by_spec.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups = []
    for window in sorted(by_spec, key=lambda w: (w is not None, w or 0)):
        layers = by_spec[window]
        groups += [KVCacheGroupSpec(window, tuple(layers[k:k + size])) for k in range(0, len(layers), size)]
    return groups


def layers_per_group(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Layer slots in one physical block."""
    return max(len(g.layers) for g in groups)


def layer_placement(groups: Sequence[KVCacheGroupSpec]) -> dict[int, tuple[int, int]]:
    """Layer index -> (its group, its slot in the group's blocks)."""
    return {layer: (g, slot) for g, spec in enumerate(groups) for slot, layer in enumerate(spec.layers)}


def blocks_per_request(groups: Sequence[KVCacheGroupSpec], block_size: int, max_model_len: int,
                       max_num_batched_tokens: int) -> int:
    """Blocks one request of ``max_model_len`` tokens may hold at once, over all groups: a full
    group all of its context; a sliding group its window before a step and the step's tokens
    (plus one block the window starts in the middle of)."""
    full = -(-max_model_len // block_size)
    if len(groups) == 1:
        return full  # one group keeps the whole context until the step that frees it
    total = 0
    for g in groups:
        if g.sliding_window is None:
            total += full
        else:
            total += min(full, -(-(g.sliding_window - 1 + max_num_batched_tokens) // block_size) + 1)
    return total
