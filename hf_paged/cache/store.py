"""KVStore: writes a step's new K/V into the pool, at the slots of the rows that write.

The slot of token `pos` of a row is `table[pos // block_size] * block_size + pos % block_size` (table_metadata.py),
an index into the `[kv_heads, num_blocks * block_size, head_dim]` flat view of a head-major pool tensor. Only the
writers store: one row per row group (block_tables.py), all rows when none share.
"""

from __future__ import annotations

import torch

from ..attention import store_backend, store_kv_rows
from ..attention.kernels.dispatch import store_launch
from ..storage import BlockPool

_NONE = object()  # a layer memo's "not made yet" (None: K and V of different shapes, no store launch)


class KVStore:
    """The store of one `PagedCache`: the backend is resolved once per step (`start_step`); the torch path keeps the
    pool's flat views between steps instead of making them every layer, the Triton path its launch into each layer
    (`StoreLaunch`), both in the pool's layer memo, which a growable pool drops with the tensors it replaces."""

    def __init__(self):
        self._backend: str | None = None
        self._multi_device = False

    def start_step(self, pool: BlockPool, multi_device: bool) -> None:
        """At layer 0's update: the store backend for the step's layers (`multi_device`: `pool.is_multi_device`)."""
        self._backend = store_backend(pool.device)
        self._multi_device = multi_device

    def store(
        self,
        pool: BlockPool,
        layer_idx: int,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor | None,
        device: torch.device | None,
    ) -> None:
        """Store pool layer `layer_idx`'s new K/V ([B, kv_heads, q_len, head_dim]) of the `rows` that write (an int64
        index, all rows when None) at their `slots` ([W * q_len] int64, row by row); `device`: the layer's, on a pool
        split over devices."""
        if rows is not None:
            key_states, value_states = key_states[rows], value_states[rows]
        if self._multi_device:
            backend = store_backend(device)
        else:
            backend = self._backend
            if backend == "torch":
                # `store_kv_rows`' torch path, with the pool's flat views made once: one `index_copy_` per K and V.
                memo = pool.layer_memo(layer_idx)  # dropped when a growable pool replaces its tensors
                views = memo.get("flat_views")
                if views is None:
                    views = memo["flat_views"] = self._flat_views(pool, layer_idx)
                key_slots, value_slots = views[0], views[1]  # [1, kv_heads, num_slots, head_dim]
                if key_states.shape[0] == 1:
                    key_slots.index_copy_(2, slots, key_states)
                    value_slots.index_copy_(2, slots, value_states)
                elif key_states.shape[2] == 1:  # one token a row: [B, kv_heads, head_dim] into slot-major views
                    views[2].index_copy_(0, slots, key_states[:, :, 0])
                    views[3].index_copy_(0, slots, value_states[:, :, 0])
                else:
                    key_slots[0].index_copy_(1, slots, heads_first(key_states))
                    value_slots[0].index_copy_(1, slots, heads_first(value_states))
                return
        if backend == "triton" and not self._multi_device and not torch.compiler.is_compiling():
            # The kernel's launch into this layer's K and V, made once (and again when a private pool grew).
            memo = pool.layer_memo(layer_idx)
            launch = memo.get("store_launch", _NONE)
            if launch is _NONE:
                key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
                same_shape = key_cache.shape == value_cache.shape  # else each is stored on its own (below)
                launch = memo["store_launch"] = store_launch(*pool.nhd_views(layer_idx)) if same_shape else None
            if launch is not None:
                launch(key_states, value_states, slots)
                return
        # The Triton path with the pool's kernel views made once (`BlockPool.nhd_views`): one launch for K and V.
        nhd_views = pool.nhd_views(layer_idx) if backend == "triton" and not self._multi_device else None
        store_kv_rows(
            pool.key_cache[layer_idx],
            pool.value_cache[layer_idx],
            key_states,
            value_states,
            slots,
            backend=backend,
            nhd_views=nhd_views,
        )

    @staticmethod
    def _flat_views(pool: BlockPool, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer_idx`'s K and V [1, kv_heads, num_blocks * block_size, head_dim] views (slot-indexed) and
        [num_blocks * block_size, kv_heads, head_dim] views (slot-major, for a row's token each), kept in the pool's
        layer memo (made again when a private pool grew)."""
        key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
        key_slots, value_slots = (
            cache.view(1, cache.shape[0], -1, cache.shape[-1]) for cache in (key_cache, value_cache)
        )
        return key_slots, value_slots, key_slots[0].transpose(0, 1), value_slots[0].transpose(0, 1)


def heads_first(states: torch.Tensor) -> torch.Tensor:
    """[W, kv_heads, q_len, head_dim] -> [kv_heads, W * q_len, head_dim], the order of the slots of W rows."""
    return states.transpose(0, 1).reshape(states.shape[1], -1, states.shape[-1])
