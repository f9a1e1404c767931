"""Hybrid models: which decoder layers hold attention K/V (the pool's layers) and which do not.

A hybrid model (Qwen3-Next, Jamba, Bamba, Falcon-H1, LFM2, ...) mixes attention layers with linear-attention,
mamba or convolution layers. transformers names each layer's cache by a layer type (`get_layer_types_and_kwargs`):

    full_attention / sliding_attention / chunked_attention   K/V only                      -> pool layer
    linear_attention / conv                                  a recurrent or conv state     -> no pool layer
    hybrid / hybrid_sliding                                  a state and K/V (one layer)   -> pool layer
    dummy (from "moe" / "mlp")                               nothing (an MLP-only layer)   -> no pool layer

Only the layers holding K/V get pool storage: pool layer `p` is decoder layer `kv_layers[p]`, so a model of 48
layers with 12 attention layers has a pool of 12 layers. The states stay in transformers' own cache layer classes
(a `PagedCache` keeps them next to its paged layers, see cache/hybrid.py).

No torch import: layer types and indices only.
"""

from __future__ import annotations

from collections.abc import Sequence

# Layer types whose cache is a per-row recurrent or convolution state, no K/V.
STATE_LAYER_TYPES = ("linear_attention", "conv")
# Layer types holding a state and K/V in one layer, and the attention type their K/V are paged as.
HYBRID_LAYER_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
# Layer types transformers turns into "dummy": MLP-only layers, which cache nothing.
MLP_LAYER_TYPES = ("moe", "mlp")


def kv_layer_indices(layer_types: Sequence[str], attention_types: Sequence[str]) -> tuple[int, ...]:
    """The decoder layers (ascending) whose type holds K/V: an attention type (`attention_types`) or a hybrid type.

    >>> kv_layer_indices(["linear_attention", "full_attention", "dummy", "hybrid"], ["full_attention"])
    (1, 3)
    """
    return tuple(
        layer_idx
        for layer_idx, layer_type in enumerate(layer_types)
        if layer_type in attention_types or layer_type in HYBRID_LAYER_TYPES
    )


def paged_layer_type(layer_type: str) -> str:
    """The attention type a layer's K/V are paged as: its own, or that of a hybrid layer's attention part."""
    return HYBRID_LAYER_TYPES.get(layer_type, layer_type)


def holds_state(layer_type: str) -> bool:
    """Whether a layer of this type keeps a recurrent or convolution state (alone or next to K/V)."""
    return layer_type in STATE_LAYER_TYPES or layer_type in HYBRID_LAYER_TYPES


def mlp_only_layers(config) -> tuple[int, ...]:
    """The decoder layers a config names "moe" or "mlp" (transformers caches nothing for them: "dummy")."""
    layer_types = getattr(config, "layer_types", None) or ()
    return tuple(layer_idx for layer_idx, layer_type in enumerate(layer_types) if layer_type in MLP_LAYER_TYPES)
