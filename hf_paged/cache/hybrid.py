"""Hybrid models in a `PagedCache`: paged attention layers next to transformers' own recurrent / conv state layers.

A hybrid model (Qwen3-Next, Jamba, Bamba, Falcon-H1, LFM2, ...) keeps, per decoder layer, attention K/V, a
recurrent or convolution state, both, or nothing (see storage/kv_layers.py). The cache's `layers` follow the decoder:

    decoder layer    0                    1                2                    3
    layer type       linear_attention     full_attention   hybrid               dummy ("moe")
    cache.layers     LinearAttentionLayer PagedLayer       PagedHybridLayer     DummyLayer
    holds            conv / ssm states    pool layer 0     states + pool        nothing
                     [B, ...]                              layer 1

Only the K/V are paged. The states are transformers' own cache layer classes, updated by the model exactly as in
`DynamicCache` (`update_conv_state`, `update_recurrent_state`): a state has no sequence dimension, so there is
nothing to page. `HybridStates` applies the cache's row and length operations to them: beam search reorders both
the block tables and the states (index_select on the batch dim), `batch_repeat_interleave` / `batch_select_indices`
repeat or pick state rows, a branch (`copy.deepcopy`) copies the states, and `crop` rolls back conv states where
transformers' own layer can (a recurrent state cannot be rolled back: refused).

Prefix reuse is refused: a recurrent state summarizes every token before it and cannot be rebuilt from the blocks
of a cached prefix.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ..errors import IncompleteStep, UnsupportedModel
from ..storage.kv_layers import HYBRID_LAYER_TYPES
from .layer import PagedIndexedLayer, PagedLayer

PREFIX_REUSE_REASON = (
    "it keeps recurrent or convolution states (layers {layers}), which summarize every earlier token and cannot be "
    "rebuilt from the K/V blocks of a cached prefix; prefix caching is for attention-only models"
)


class PagedHybridLayer(LinearAttentionLayer, PagedLayer):
    """A "hybrid" / "hybrid_sliding" decoder layer: a linear-attention state (transformers' `LinearAttentionLayer`)
    and paged attention K/V (`PagedLayer`) in one layer, as `LinearAttentionAndFullAttentionLayer` is for
    `DynamicCache`. Row and length operations go to the cache, which applies them to both parts."""

    is_compileable = False

    def __init__(self, cache, layer_idx: int, sliding_window: int | None = None, number_of_states: int = 1):
        PagedLayer.__init__(self, cache, layer_idx, sliding_window)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # `PagedCache.update` passes key and value states; `update_conv_state` / `update_recurrent_state` keywords.
        if args:
            PagedLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def activate_past_recording(self) -> None:
        self.record_past = True  # one flag for both parts: conv states grow, sliding blocks are kept until a crop

    update = PagedLayer.update
    get_max_length = PagedLayer.get_max_length
    reset = PagedLayer.reset
    crop = PagedLayer.crop
    reorder_cache = PagedLayer.reorder_cache
    batch_repeat_interleave = PagedLayer.batch_repeat_interleave
    batch_select_indices = PagedLayer.batch_select_indices
    offload = PagedLayer.offload
    prefetch = PagedLayer.prefetch


def decoder_layers(
    cache, layer_types: list[str], layer_kwargs: list[dict], kv_layers: tuple[int, ...], windows: list[int | None]
) -> tuple[list, list[PagedLayer]]:
    """The cache layers of every decoder layer, and the paged ones in pool-layer order.

    `layer_types` / `layer_kwargs`: transformers' `get_layer_types_and_kwargs` of the config; pool layer `p` stores
    decoder layer `kv_layers[p]`, whose sliding window is `windows[p]` (None: full attention).
    """
    pool_layer = {layer_idx: p for p, layer_idx in enumerate(kv_layers)}
    layers, paged = [], []
    for layer_idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        p = pool_layer.get(layer_idx)
        if p is None:  # a state-only or MLP-only layer: transformers' own class, as in DynamicCache
            layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs))
            continue
        window = windows[p]
        if layer_type in HYBRID_LAYER_TYPES:
            layer = PagedHybridLayer(cache, layer_idx, window, kwargs.get("number_of_states", 1))
        elif layer_type == "indexed_attention":
            layer = PagedIndexedLayer(cache, layer_idx, window)
        else:
            layer = PagedLayer(cache, layer_idx, window)
        layers.append(layer)
        paged.append(layer)
    return layers, paged


class HybridStates:
    """The recurrent / conv states of one `PagedCache` (its `LinearAttentionCacheLayerMixin` layers, `[B, ...]`
    tensors per row) and the row and length operations the cache applies to them next to its block tables. Empty
    (every operation a no-op) for an attention-only model."""

    def __init__(self, layers: list, model_type: str | None):
        self.layers = [layer for layer in layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.layer_indices = [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.model_type = model_type
        self.incomplete = False  # a step stopped part-way, after some states advanced (see `check_complete`)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def stop_step(self) -> None:
        """A step stopped part-way (`PoolExhausted`, `GradientsUnsupported`): the state layers before the failing
        layer advanced, and running the step again would advance them twice, so every update raises `IncompleteStep`
        until `clear()`."""
        self.incomplete = bool(self.layers)

    def check_complete(self) -> None:
        """Raise `IncompleteStep` after a step that stopped part-way (`incomplete`), until `clear()`."""
        if self.incomplete:
            raise IncompleteStep(
                f"a forward of this {self.model_type!r} cache stopped part-way (PoolExhausted, GradientsUnsupported) "
                f"after layers {self.layer_indices} may have advanced their states; release() it and start again "
                "(more blocks: BlockPool num_blocks or max_memory; no states that require grad: torch.no_grad())"
            )

    def refuse_prefix_reuse(self, call: str) -> None:
        """Raise `UnsupportedModel` when the cache keeps states: `call` (`from_prefix`, `release(token_ids=...)`)
        would reuse K/V blocks without the states computed with them."""
        if self.layers:
            reason = PREFIX_REUSE_REASON.format(layers=self.layer_indices)
            raise UnsupportedModel(self.model_type, reason, f"PagedCache.{call}")

    def select_rows(self, indices: torch.Tensor) -> None:
        """Row i takes the states of row `indices[i]` (beam reorder, batch select): index_select on dim 0."""
        for layer in self.layers:
            LinearAttentionCacheLayerMixin.reorder_cache(layer, torch.as_tensor(indices))

    def repeat_rows(self, repeats: int) -> None:
        """Each row's states `repeats` times in a row (`batch_repeat_interleave`)."""
        for layer in self.layers:
            for states, initialized in _state_dicts(layer):
                for i in states:
                    if initialized[i]:
                        states[i] = states[i].repeat_interleave(repeats, dim=0)

    def check_croppable(self, tokens_to_remove: int) -> None:
        """Raise `UnsupportedModel` unless every state layer can roll back `-tokens_to_remove` tokens as transformers'
        own layer does: conv states recorded since `activate_past_recording()`, and no recurrent state."""
        for layer_idx, layer in zip(self.layer_indices, self.layers):
            if any(layer.is_recurrent_states_initialized.values()) and tokens_to_remove:
                reason = (
                    f"crop({tokens_to_remove}) cannot roll back layer {layer_idx}'s recurrent state (it summarizes "
                    "every token; transformers' LinearAttentionLayer is not croppable either): assisted or "
                    "prompt-lookup decoding does not work with this model"
                )
                raise UnsupportedModel(self.model_type, reason, "PagedCache.crop")
            if tokens_to_remove and not layer.record_past and any(layer.is_conv_states_initialized.values()):
                reason = (
                    f"layer {layer_idx}'s conv states were not recorded: call cache.activate_past_recording() before "
                    f"the forwards that crop({tokens_to_remove}) rolls back (generate() does for assisted decoding)"
                )
                raise UnsupportedModel(self.model_type, reason, "PagedCache.crop")

    def crop(self, tokens_to_remove: int) -> None:
        """Roll the conv states back by `-tokens_to_remove` tokens and cut them to the kernel size (`check_croppable`
        first). Layers with no state yet, or that record no past (their conv states already have the kernel size:
        only `crop(0)` reaches them), are left as they are."""
        for layer in self.layers:
            if layer.record_past and any(layer.is_conv_states_initialized.values()):
                LinearAttentionCacheLayerMixin.crop(layer, tokens_to_remove)

    def clear(self) -> None:
        """Forget every state (release): the next forward starts them again, with any batch size."""
        self.incomplete = False
        for layer in self.layers:
            record_past = layer.record_past
            LinearAttentionLayer.__init__(layer, number_of_states=layer.number_of_states)
            layer.record_past = record_past

    def copy_from(self, other: HybridStates) -> None:
        """Take copies of `other`'s states (a branch of the cache: each continues on its own)."""
        for layer, source in zip(self.layers, other.layers):
            for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state"):
                setattr(layer, name, dict(getattr(source, name)))
            layer.conv_kernel_size = dict(source.conv_kernel_size)
            layer.conv_states = {i: _clone(t) for i, t in source.conv_states.items()}
            layer.recurrent_states = {i: _clone(t) for i, t in source.recurrent_states.items()}
            layer.record_past = source.record_past
            if source.device is not None:
                layer.dtype, layer.device = source.dtype, source.device


def _state_dicts(layer) -> list[tuple[dict, dict]]:
    return [
        (layer.conv_states, layer.is_conv_states_initialized),
        (layer.recurrent_states, layer.is_recurrent_states_initialized),
    ]


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()
