"""FixedWidthSteps: the device-side inputs of a compileable `PagedCache` (one built with `max_cache_len`).

A compiled (and CUDA-graph replayed) forward cannot take blocks from the allocator: that is host bookkeeping. So a
step is split in two, as vLLM splits its scheduler from its model runner:

    host, before the forward (`reserve`)            device, inside the forward (`store` / `gather`)
    ------------------------------------            -----------------------------------------------
    take blocks for [length, length + n),           write K/V to `slot_mapping`
    copy-on-write what rows shared,                 read K/V through `block_tables`, padded to
    fill the persistent buffers below               max_cache_len (the mask hides the rest)

The buffers keep their addresses for the cache's life (and are marked static for dynamo), so a captured graph reads
each step's values. Every tensor has a shape fixed by the batch and `max_cache_len`:

    block_tables[g]  [B, W] int64    W = ceil(max_cache_len / block_size); entries past a row's blocks name block 0,
                                     whose keys the causal mask hides
    slot_mapping[g]  [B * n] int64   the slots of the step's n new tokens of every row, row by row
    seq_lens         [B] int32       tokens per row after the step (the decode kernel's lengths)
    past_length      [] int64        tokens per row before the step (`get_seq_length` inside a compiled forward)

`g` is the layer group (a Gemma-style pool keeps one table per group); every row writes its own slots, so rows that
shared a prompt's blocks get their own copy of the block they write next.
"""

from __future__ import annotations

import weakref

import torch

from .block_tables import head_major_index


class FixedWidthSteps:
    def __init__(self, max_cache_len: int, block_size: int, num_groups: int):
        self.max_cache_len = max_cache_len
        self.block_size = block_size
        self.width = -(-max_cache_len // block_size)  # W: block table entries per row
        self.num_groups = num_groups
        self.block_tables: list[torch.Tensor] = []
        self.slot_mapping: list[torch.Tensor] = []
        self.seq_lens: torch.Tensor | None = None
        self.past_length: torch.Tensor | None = None
        self._versions: list[int] = [-1] * num_groups  # the BlockTables version each table buffer holds
        self._static_pool_tensors: dict[int, weakref.ref] = {}  # id -> the pool tensors already marked static

    def fill(self, groups: list, past_length: int, num_new_tokens: int, device: torch.device) -> None:
        """Write one step's inputs: `groups` (one `BlockTables` per layer group, every row its own writer and holding
        blocks up to `past_length + num_new_tokens`)."""
        self._mark_pool_static(groups[0].pool)
        num_rows = groups[0].num_rows
        self._allocate(num_rows, num_new_tokens, device)
        block_size, end = self.block_size, past_length + num_new_tokens
        for group, tables in enumerate(groups):
            assert tables.base == 0, "a compileable PagedCache keeps every block from position 0"
            if self._versions[group] != tables.version:
                padded = [table + [0] * (self.width - len(table)) for table in tables.tables]
                self.block_tables[group].copy_(_host(padded, torch.int64), non_blocking=True)
                self._versions[group] = tables.version
            slots = [
                table[position // block_size] * block_size + position % block_size
                for table in tables.tables
                for position in range(past_length, end)
            ]
            self.slot_mapping[group].copy_(_host(slots, torch.int64), non_blocking=True)
        self.seq_lens.fill_(end)
        self.past_length.fill_(past_length)

    def _allocate(self, num_rows: int, num_new_tokens: int, device: torch.device) -> None:
        """(Re)make the buffers when the batch, the step's token count or the device changed."""
        same_rows = self.seq_lens is not None and self.seq_lens.device == device and self.seq_lens.shape[0] == num_rows
        if same_rows and self.slot_mapping[0].shape[0] == num_rows * num_new_tokens:
            return
        self.slot_mapping = [
            _static(torch.zeros(num_rows * num_new_tokens, dtype=torch.long, device=device))
            for _ in range(self.num_groups)
        ]
        if same_rows:
            return
        self.block_tables = [
            _static(torch.zeros(num_rows, self.width, dtype=torch.long, device=device)) for _ in range(self.num_groups)
        ]
        self.seq_lens = _static(torch.zeros(num_rows, dtype=torch.int32, device=device))
        self.past_length = _static(torch.zeros((), dtype=torch.long, device=device))
        self._versions = [-1] * self.num_groups

    def _mark_pool_static(self, pool) -> None:
        """A compiled step writes the pool in place: its tensors must be static inputs, or CUDA graphs would copy them
        in (and write the copy) or be skipped. Marked once per tensor (a shared pool that grows has new ones)."""
        for tensor in (*pool.key_cache, *pool.value_cache):
            marked = self._static_pool_tensors.get(id(tensor))
            if marked is None or marked() is not tensor:
                self._static_pool_tensors[id(tensor)] = weakref.ref(_static(tensor))


def gather_fixed(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    max_cache_len: int,
    index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A head-major pool tensor `[kv_heads, num_blocks, block_size, head_dim]` read through `block_tables` `[B, W]`:
    `[B, kv_heads, max_cache_len, head_dim]` (one index_select, no copy after it). `index`: `head_major_index` of
    the same tables, where the caller keeps it for other layers; `out`: a 1-D buffer of at least
    `B * kv_heads * W * block_size * head_dim` values to gather into (a fresh tensor without it)."""
    num_heads, num_blocks, block_size, head_dim = cache.shape
    batch_size, width = block_tables.shape
    if index is None:
        index = head_major_index(block_tables, num_heads, num_blocks)
    # Blocks as rows of block_size * head_dim values (on CPU, index_select copies 2-D rows ~3x faster than 3-D ones).
    flat = cache.view(num_heads * num_blocks, block_size * head_dim)
    if out is None:
        rows = flat.index_select(0, index)
    else:
        rows = torch.index_select(
            flat, 0, index, out=out[: index.numel() * block_size * head_dim].view(-1, flat.shape[1])
        )
    return rows.view(batch_size, num_heads, width * block_size, head_dim)[:, :, :max_cache_len]


def _host(values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _static(tensor: torch.Tensor) -> torch.Tensor:
    """Tell dynamo the tensor keeps its address (CUDA graphs read it in place instead of copying it in)."""
    torch._dynamo.mark_static_address(tensor)
    return tensor
