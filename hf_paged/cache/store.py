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


class KVStore:
    """The store of one `PagedCache`: the backend is resolved once per step (`start_step`); the torch path keeps the
    pool's flat views between steps instead of making them every layer, the Triton path its launch into each layer
    (`StoreLaunch`)."""

    def __init__(self):
        self._backend: str | None = None
        self._multi_device = False
        self._flat_memo: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> (key, value, their flat views)
        # layer -> (key, value, the Triton store's `StoreLaunch` into them, or None: K and V of different shapes)
        self._launches: dict[int, tuple] = {}

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
                key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
                views = self._flat_memo.get(layer_idx)
                if views is None or views[0] is not key_cache or views[1] is not value_cache:
                    views = self._flat_views(pool, layer_idx)
                key_slots, value_slots = views[2], views[3]  # [1, kv_heads, num_slots, head_dim]
                if key_states.shape[0] == 1:
                    key_slots.index_copy_(2, slots, key_states)
                    value_slots.index_copy_(2, slots, value_states)
                elif key_states.shape[2] == 1:  # one token a row: [B, kv_heads, head_dim] into slot-major views
                    views[4].index_copy_(0, slots, key_states[:, :, 0])
                    views[5].index_copy_(0, slots, value_states[:, :, 0])
                else:
                    key_slots[0].index_copy_(1, slots, heads_first(key_states))
                    value_slots[0].index_copy_(1, slots, heads_first(value_states))
                return
        if backend == "triton" and not self._multi_device and not torch.compiler.is_compiling():
            # The kernel's launch into this layer's K and V, made once (and again when a private pool grew).
            key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
            memo = self._launches.get(layer_idx)
            if memo is None or memo[0] is not key_cache or memo[1] is not value_cache:
                launch = store_launch(*pool.nhd_views(layer_idx)) if key_cache.shape == value_cache.shape else None
                memo = self._launches[layer_idx] = (key_cache, value_cache, launch)
            if memo[2] is not None:
                memo[2](key_states, value_states, slots)
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

    def _flat_views(self, pool: BlockPool, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer_idx`'s K and V pool tensors, their [1, kv_heads, num_blocks * block_size, head_dim] views
        (slot-indexed) and their [num_blocks * block_size, kv_heads, head_dim] views (slot-major, for a row's token
        each), kept in `_flat_memo` and made again only when the pool's tensors changed (a private pool grew)."""
        key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
        key_slots, value_slots = (
            cache.view(1, cache.shape[0], -1, cache.shape[-1]) for cache in (key_cache, value_cache)
        )
        slot_major = (key_slots[0].transpose(0, 1), value_slots[0].transpose(0, 1))
        views = self._flat_memo[layer_idx] = (key_cache, value_cache, key_slots, value_slots, *slot_major)
        return views


def heads_first(states: torch.Tensor) -> torch.Tensor:
    """[W, kv_heads, q_len, head_dim] -> [kv_heads, W * q_len, head_dim], the order of the slots of W rows."""
    return states.transpose(0, 1).reshape(states.shape[1], -1, states.shape[-1])
