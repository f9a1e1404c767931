"""Layer groups: which layers share one block table, and which storage slot each layer uses.

vLLM v1's hybrid allocator, smaller. A model whose layers all attend the same way (Llama: all full; Mistral: all
sliding) has one group of every layer, and one block id names the same token range in every layer. A model that
mixes attention types (Gemma2/3: sliding and full layers) gets one group per run of at most `m` layers of one type,
where `m` is the smallest per-type layer count; each group has its own block tables, so a sliding group can give
back the blocks that fell out of its window while a full group keeps them all.

Storage: the pool keeps `m` tensors ("slots") per K and V, and layer `l` at position `s` of its group uses slot `s`.
Layers of different groups at one slot alias one tensor, which is safe because a block id allocated to a group is
only ever read or written by that group's layers. So all groups draw from one allocator and one free-block space,
and a block is `m` layers' worth of bytes instead of all layers' worth.

No torch import: ids and counts only.
"""

from __future__ import annotations

from collections.abc import Sequence

LayerGroups = tuple[tuple[int, ...], ...]  # groups[g] = the layer indices of group g, ascending


def derive_layer_groups(layer_types: Sequence[str], shapes: Sequence[tuple[int, int]]) -> LayerGroups:
    """Split layers into groups by attention type; `shapes[l]` is layer l's `(num_kv_heads, head_dim)`.

    Layers of one type form groups of `m` consecutive (in that type's order) layers, `m` = the smallest per-type
    count; the last group of a type may be shorter (its missing slots simply have no layer). One type -> one group
    of every layer.

    NOTE: `m` = the smallest count means the rarest type (Gemma's full layers) is never padded; a padded group
    leaves `(m - len(group)) / m` of each of its blocks unused. Since the padded group is usually a sliding one,
    whose blocks are bounded by its window, that waste stays bounded too.

    NOTE: aliasing needs every layer at one slot position to have the same kv heads and head_dim; when they differ
    (per-layer head counts), fall back to one group: correct, just without per-group release.

    >>> derive_layer_groups(["sliding_attention", "full_attention"] * 2, [(2, 16)] * 4)
    ((0, 2), (1, 3))
    >>> derive_layer_groups(["sliding_attention"] * 3 + ["full_attention"] * 2, [(2, 16)] * 5)
    ((0, 1), (2,), (3, 4))
    """
    if len(layer_types) != len(shapes) or not layer_types:
        raise ValueError(f"need one layer type and one shape per layer, got {len(layer_types)} and {len(shapes)}")
    one_group = (tuple(range(len(layer_types))),)
    layers_of_type: dict[str, list[int]] = {}
    for layer_idx, layer_type in enumerate(layer_types):
        layers_of_type.setdefault(layer_type, []).append(layer_idx)
    if len(layers_of_type) == 1:
        return one_group
    m = min(len(layers) for layers in layers_of_type.values())
    groups = sorted(
        (tuple(layers[start : start + m]) for layers in layers_of_type.values() for start in range(0, len(layers), m)),
        key=lambda group: group[0],
    )
    for slot in range(m):
        if len({shapes[group[slot]] for group in groups if slot < len(group)}) > 1:
            return one_group
    return tuple(groups)


def group_windows(groups: LayerGroups, windows: Sequence[int | None]) -> list[int | None]:
    """Per group: the largest sliding window of its layers when every one of them slides (the group can give back
    blocks that left the window), else None (it keeps every block). `windows[l]`: layer l's window or None."""
    return [
        None if any(windows[layer] is None for layer in group) else max(windows[layer] for layer in group)
        for group in groups
    ]


def slot_of_layer(groups: LayerGroups) -> tuple[int, ...]:
    """`slots[l]` = the position of layer l in its group: the storage slot it reads and writes."""
    slots = {layer_idx: slot for group in groups for slot, layer_idx in enumerate(group)}
    assert sorted(slots) == list(range(len(slots))), f"groups must hold every layer once, got {groups}"
    return tuple(slots[layer_idx] for layer_idx in range(len(slots)))


def group_of_layer(groups: LayerGroups) -> tuple[int, ...]:
    """`owner[l]` = the index of the group that holds layer l."""
    owner = {layer_idx: group_idx for group_idx, group in enumerate(groups) for layer_idx in group}
    assert sorted(owner) == list(range(len(owner))), f"groups must hold every layer once, got {groups}"
    return tuple(owner[layer_idx] for layer_idx in range(len(owner)))
