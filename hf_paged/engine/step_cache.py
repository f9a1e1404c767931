"""StepCache: one engine forward's view of the pool, for rows that each have their own block table and length.

`PagedCache` serves `generate()`, where every row has the same length. The engine batches requests of different
lengths, so each step builds a `StepCache` over the scheduled requests' block tables:

- a decode step: B rows, one new token each at its own position; attention gets a ragged `DecodePlan` (per-row
  `seq_lens`), so no row is padded to the longest for storage and the Triton kernel reads each row's blocks;
- a prefill chunk: one row, `q_len` new tokens after `seq_len` cached ones; attention gets the gathered K/V.

The blocks must already be allocated (the scheduler does it); a `StepCache` never allocates or frees.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..block_tables import head_major_index
from ..cache import DecodePlan, store_kv_rows
from ..pool import BlockPool


class _StepLayer(CacheLayerMixin):
    """Layer view for the mask machinery: it describes the step's keys, the cache does the work."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: StepCache):
        super().__init__()
        self._cache = cache
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None: ...

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("StepCache.update is called on the cache, not its layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    """Rows `b` with block tables `tables[b]` holding `seq_lens[b]` cached tokens; this forward adds `q_len` each.

    Args:
        pool (`BlockPool`): the shared pool.
        tables (`list[list[int]]`): per-row block ids; each must already cover `seq_lens[b] + q_len` tokens.
        seq_lens (`list[int]`): tokens already cached per row.
        q_len (`int`): new tokens per row in this forward (1 for a decode step; a prefill chunk is one row).
    """

    def __init__(self, pool: BlockPool, tables: list[list[int]], seq_lens: list[int], q_len: int):
        if q_len > 1 and len(tables) != 1:
            raise ValueError(f"a prefill chunk is one row, got {len(tables)} rows with q_len {q_len}")
        self.pool = pool
        self.seq_lens = list(seq_lens)
        self.q_len = q_len
        device, block_size = pool.device, pool.block_size
        num_table_blocks = max(-(-(n + q_len) // block_size) for n in seq_lens)
        for table, n in zip(tables, seq_lens):
            if len(table) * block_size < n + q_len:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {n + q_len} tokens")
        # Rows padded to the longest table; padding entries are never read (each row stops at its length).
        padded = [table[:num_table_blocks] + [0] * (num_table_blocks - len(table[:num_table_blocks])) for table in tables]
        self.tables = torch.tensor(padded, dtype=torch.long, device=device)  # [B, num_table_blocks]
        positions = torch.tensor(seq_lens, device=device)[:, None] + torch.arange(q_len, device=device)  # [B, q]
        self.slots = (
            self.tables.gather(1, positions // block_size) * block_size + positions % block_size
        ).flatten()  # [B * q_len]
        self.new_lens = torch.tensor([n + q_len for n in seq_lens], dtype=torch.int32, device=device)
        self._index: dict[tuple[int, int], torch.Tensor] = {}  # (kv_heads, pool blocks) -> gather index
        super().__init__(layers=[_StepLayer(self) for _ in range(pool.layout.num_layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.seq_lens)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [B, kv_heads, q_len, head_dim] -> a ragged decode placeholder (q_len 1), or the prefill
        row's K/V [1, kv_heads, seq_len + q_len, head_dim]."""
        pool = self.pool
        pool.check_states(layer_idx, key_states)
        key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
        store_kv_rows(key_cache, value_cache, key_states, value_states, self.slots)
        if self.q_len == 1:
            plan = DecodePlan(
                key_cache=pool.nhd_view(key_cache),
                value_cache=pool.nhd_view(value_cache),
                block_tables=self.tables.to(torch.int32),
                seq_lens=self.new_lens,
                kv_offset=0,
                position_offset=0,
                gather=lambda: self._gather(layer_idx),
                ragged=True,
            )
            batch_size, num_heads, _, head_dim = key_states.shape
            placeholder = key_states.new_empty(batch_size, num_heads, 0, head_dim)
            placeholder.decode_plan = plan
            return placeholder, placeholder
        return self._gather(layer_idx)

    def _gather(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, kv_heads, longest, head_dim] keys and values; positions past a row's length are not its keys."""
        key_cache, value_cache = self.pool.key_cache[layer_idx], self.pool.value_cache[layer_idx]
        num_heads, num_pool_blocks, block_size, head_dim = key_cache.shape
        # Layers may differ in kv heads, so the index is keyed by shape (one entry for a uniform model).
        index = self._index.get((num_heads, num_pool_blocks))
        if index is None:
            index = self._index[(num_heads, num_pool_blocks)] = head_major_index(self.tables, num_heads, num_pool_blocks)
        length = int(self.new_lens.max())
        batch_size = self.tables.shape[0]
        return tuple(
            torch.index_select(cache.view(-1, block_size, head_dim), 0, index)
            .view(batch_size, num_heads, -1, head_dim)[:, :, :length]
            for cache in (key_cache, value_cache)
        )
