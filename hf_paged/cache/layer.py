"""PagedLayer: one decoder layer's view of a `PagedCache` (a length and a sliding window, no tensors).

The per-layer contract transformers' mask machinery and `generate()` call (`get_mask_sizes`, `get_seq_length`,
`is_sliding`, `crop`, `reorder_cache`, ...); everything that touches blocks is forwarded to the cache.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import UnsupportedCacheAttribute

if TYPE_CHECKING:
    import torch


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a `PagedCache`. It holds a length, not tensors: the K/V are in the pool.

    `sliding_window=None` mirrors `DynamicLayer`; an int mirrors `DynamicSlidingWindowLayer` (same returned K/V,
    same mask sizes). Whether out-of-window blocks go back to the pool is decided per layer group by `PagedCache`.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: Cache, layer_idx: int, sliding_window: int | None = None):
        super().__init__()
        # A weak reference: the cache owns its layers, and a cycle would delay the finalizer that frees blocks.
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.cumulative_length = 0
        self.record_past = False  # as DynamicSlidingWindowLayer: keep out-of-window blocks until the next crop

    def activate_past_recording(self) -> None:
        self.record_past = True

    def rebind(self, cache: Cache) -> None:
        """View `cache` from now on (the Engine's per-request step keeps a hybrid layer, and its states, from one
        forward's cache to the next)."""
        self._cache = weakref.proxy(cache)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def first_visible(self, num_past: int) -> int:
        """Absolute position of the first key returned by an update after `num_past` cached tokens."""
        if self.sliding_window is None:
            return 0
        return max(num_past - self.sliding_window + 1, 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = self.first_visible(self.cumulative_length)
        return self.cumulative_length - kv_offset + query_length, kv_offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        max_cache_len = self._cache.max_cache_len
        if max_cache_len is not None:
            return max_cache_len
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        self._cache.release()

    def crop(self, tokens_to_remove: int) -> None:
        self._cache.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._cache.batch_select_indices(indices)

    def offload(self):
        raise NotImplementedError("PagedCache layers cannot be offloaded: their K/V live in the shared BlockPool")

    prefetch = offload

    # `CacheLayerMixin` layers hold their K/V as `keys` / `values`; a paged layer holds none, so a model that reads
    # them (to attend another layer's K/V, or a cross-attention cache) is refused by name rather than handed None.
    @property
    def keys(self):
        raise self._missing("keys")

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:  # `CacheLayerMixin.__init__` sets None
            raise self._missing("keys")

    @property
    def values(self):
        raise self._missing("values")

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise self._missing("values")

    def _missing(self, name: str) -> UnsupportedCacheAttribute:
        try:
            model_type = self._cache.model_type
        except ReferenceError:  # the cache is gone
            model_type = None
        return UnsupportedCacheAttribute(model_type, name, type(self).__name__)

    def __getattr__(self, name: str):
        # Reached only for an attribute the layer lacks. A model that reads one of transformers' own layer classes
        # (`keys`, `values`, a state of its own) gets a typed refusal naming it, not an AttributeError from deep in
        # its forward; the error is an AttributeError too, so `hasattr` and `getattr(layer, name, default)` work.
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise self._missing(name)


class PagedIndexedLayer(PagedLayer):
    """An "indexed_attention" layer's view (DeepSeek Sparse Attention, Qwen4-Exp's QSA): a `PagedLayer` whose
    `indexer_position_ids` (`[..., B, S]`, the position ids Qwen4-Exp keeps on its first indexed layer) live in the
    cache beside the indexer keys, so beams, repeats, crop, branches and release move them with the rows."""

    @property
    def indexer_position_ids(self) -> torch.Tensor | None:
        return self._cache.get_indexer_position_ids(self.layer_idx)

    @indexer_position_ids.setter
    def indexer_position_ids(self, position_ids: torch.Tensor | None) -> None:
        self._cache.set_indexer_position_ids(self.layer_idx, position_ids)
