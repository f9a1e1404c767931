"""PagedLayer: one decoder layer's view of a `PagedCache` (a length and a sliding window, no tensors).

The per-layer contract transformers' mask machinery and `generate()` call (`get_mask_sizes`, `get_seq_length`,
`is_sliding`, `crop`, `reorder_cache`, ...); everything that touches blocks is forwarded to the cache.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from transformers.cache_utils import Cache, CacheLayerMixin

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
