"""TableMetadata: what a step derives from one layer group's `BlockTables`, worked out once for every layer.

`BlockTables` is host bookkeeping: Python lists of block ids, row groups, reference counts. Attention and the store
want other forms of the same tables, and every layer of a group would otherwise rebuild them: the `[B, n]` tables
tensor, the slots of the step's new tokens, the gather index of a head-major pool view, runs of consecutive pool
blocks (a view instead of a gather), the prefix of blocks every row shares, the decode kernel's tables and
lengths. `TableMetadata` memoizes each until the tables change (`BlockTables.version` moves).

A layer whose pool storage sits on another device than the pool's first layer reads them through `DeviceTables`,
with the index tensors on its device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..attention.kernels.launch_config import INDEX_DTYPE
from ..storage.transfer import to_device
from .block_tables import BlockTables, GatherTables, head_major_index

if TYPE_CHECKING:
    from ..storage import BlockPool

# `slots` works out at most this many slots on the host (a decode step's), more with tensor arithmetic (a prefill's).
HOST_SLOTS = 256


class TableMetadata(GatherTables):
    """The tensors and indexes of one `BlockTables` a step's layers share: the first layer of the group builds each,
    the rest look it up. A gather reads the tables through it (`GatherTables`)."""

    def __init__(self, tables: BlockTables):
        self.tables = tables
        self._memo: dict[tuple | str, object] = {}
        self._version = tables.version  # the tables' version `_memo` was derived from
        self._tables_tensor: torch.Tensor | None = None

    @property
    def pool(self) -> BlockPool:
        return self.tables.pool

    @property
    def num_rows(self) -> int:
        return self.tables.num_rows

    @property
    def memo(self) -> dict:
        """Values derived from the tables, emptied whenever the tables changed since they were derived."""
        if self._version != self.tables.version:
            self._memo.clear()
            self._tables_tensor = None
            self._version = self.tables.version
        return self._memo

    def tables_tensor(self, device: torch.device | None = None) -> torch.Tensor:
        """`[B, num_table_blocks]` int64 on the pool's device (or `device`, for a layer of a pool split over
        devices); rebuilt only when a table changed."""
        memo = self.memo
        if self._tables_tensor is None:
            host = self.tables.tables
            width = len(host[0]) if host else 0
            flat = [entry for table in host for entry in table]
            self._tables_tensor = to_device([flat], torch.long, self.pool.device)[0].view(len(host), width)
        if device is None or device == self._tables_tensor.device:
            return self._tables_tensor
        key = ("tables", device)
        tables = memo.get(key)
        if tables is None:
            tables = memo[key] = self._tables_tensor.to(device)
        return tables

    def on(self, device: torch.device) -> TableMetadata | DeviceTables:
        """These tables for a layer whose pool storage is on `device`: the index tensors of `gather_index` and
        `slots` land there (a pool split over devices, `BlockPool.devices`)."""
        return self if device == self.pool.device else DeviceTables(self, device)

    def step(self, num_tokens: int) -> dict:
        """Decode metadata for a step with `num_tokens` per row: int64 block tables and seq_lens (what every caller
        hands the kernels: `launch_config.INDEX_DTYPE`), plus memos that the attention of every layer shares (first
        keys, backends, kernel launches). Built by the first layer, reused by the rest.

        Kernel positions count from the first block still held: `seq_lens = num_tokens - base * block_size`, and
        `position_offset` says how much to subtract from an absolute position."""
        memo = self.memo
        key = ("step", num_tokens)
        step = memo.get(key)
        if step is None:
            tables = self.tables_tensor()
            position_offset = self.tables.base * self.pool.block_size
            step = {
                "block_tables": tables,
                "seq_lens": torch.full(
                    (self.num_rows,), num_tokens - position_offset, dtype=INDEX_DTYPE, device=tables.device
                ),
                "position_offset": position_offset,
                "kv_starts": {},
                "backends": {},
                "launches": {},
            }
            memo[key] = step
        return step

    def slots(
        self, rows: tuple[int, ...] | None, start: int, end: int, device: torch.device | None = None
    ) -> torch.Tensor:
        """Slot ids of positions [start, end) for `rows` (all rows if None): `[len(rows) * (end - start)]` int64,
        row by row. All layers of one step share one tensor."""
        memo = self.memo
        key = (rows, start, end, device)
        slots = memo.get(key)
        if slots is None:
            block_size, base = self.pool.block_size, self.tables.base
            host_tables = self.tables.tables
            if (end - start) * len(host_tables) <= HOST_SLOTS:
                # A decode step's few slots: worked out on the host and made in one tensor creation.
                # One asynchronous copy on CUDA (`to_device`): a plain `torch.tensor(..., device=)` would make the
                # host wait for the GPU at the first layer of every step.
                host_slots = [
                    host_tables[row][position // block_size - base] * block_size + position % block_size
                    for row in (range(len(host_tables)) if rows is None else rows)
                    for position in range(start, end)
                ]
                (slots,) = to_device([host_slots], torch.long, device or self.pool.device)
            else:
                tables = self.tables_tensor(device)
                if rows is not None:
                    tables = tables[list(rows)]
                positions = torch.arange(start, end, device=tables.device)
                slots = (tables[:, positions // block_size - base] * block_size + positions % block_size).flatten()
            memo[key] = slots
        return slots

    def writer_index(self, device: torch.device | None = None) -> torch.Tensor:
        """`BlockTables.writers()` as an int64 tensor on `device` (the pool's by default)."""
        memo = self.memo
        key = ("writer_index", device)
        index = memo.get(key)
        if index is None:
            index = memo[key] = torch.tensor(self.tables.writers(), device=device or self.pool.device)
        return index

    def gather_index(
        self,
        first_block: int,
        end_block: int,
        num_heads: int,
        num_pool_blocks: int,
        device: torch.device | None = None,
        row: int | None = None,
    ) -> torch.Tensor:
        """`[B * num_heads * n]` int64 rows of a `[num_heads * num_pool_blocks, block_size, head_dim]` pool view, in
        `[B, num_heads, n]` order, for logical blocks [first_block, end_block): one `index_select` then lands every
        row's blocks in `[B, num_heads, n * block_size, head_dim]` order (`row`: that row's only, B = 1)."""
        memo = self.memo
        key = ("gather", first_block, end_block, num_heads, num_pool_blocks, device, row)
        index = memo.get(key)
        if index is None:
            base = self.tables.base
            assert first_block >= base, f"block {first_block} was released (base {base})"
            tables = self.tables_tensor(device)[:, first_block - base : end_block - base]
            if row is not None:
                tables = tables[row : row + 1]
            index = head_major_index(tables, num_heads, num_pool_blocks)
            memo[key] = index
        return index

    def consecutive_run(self, first_block: int, end_block: int, row: int | None = None) -> int | None:
        """The pool block id of logical block `first_block` when the tables hold ONE row whose logical blocks
        [first_block, end_block) are consecutive pool blocks, else None: that row's K/V are then one strided view of
        the pool (gather.py). Several rows are never one view: a view's batch and head dimensions could not be merged
        (models reshape K/V to `[B * heads, kv_len, head_dim]` with `.view`). `row`: that row's blocks, whatever the
        number of rows (a prefix the rows share)."""
        memo = self.memo
        key = ("run", first_block, end_block, row)
        if key in memo:
            return memo[key]
        run = None
        tables = self.tables.tables
        lo, hi = first_block - self.tables.base, end_block - self.tables.base
        if (len(tables) == 1 or row is not None) and 0 <= lo < hi <= self.tables.num_table_blocks:
            table = tables[0 if row is None else row]
            if table[hi - 1] - table[lo] == hi - 1 - lo and table[lo:hi] == list(range(table[lo], table[hi - 1] + 1)):
                run = table[lo]
        memo[key] = run
        return run

    def run_end(self, row: int, first_block: int, end_block: int) -> int:
        """The logical block, at most `end_block`, where row `row`'s consecutive pool blocks from `first_block` end:
        [first_block, run_end) is one run (one strided view)."""
        memo = self.memo
        key = ("run_end", row, first_block, end_block)
        end = memo.get(key)
        if end is None:
            base = self.tables.base
            table, lo, hi = self.tables.tables[row], first_block - base, end_block - base
            end = lo + 1
            while end < hi and table[end] == table[end - 1] + 1:
                end += 1
            end = memo[key] = end + base
        return end

    def shared_blocks(self) -> int:
        """How many leading table entries every row holds in common (the prompt that `num_return_sequences` /
        `num_beams` rows share, stored once): 0 for fewer than two rows."""
        memo = self.memo
        shared = memo.get("shared")
        if shared is None:
            shared = 0
            tables = self.tables.tables
            if len(tables) > 1:
                for column in zip(*tables):
                    if column.count(column[0]) != len(column):
                        break
                    shared += 1
            memo["shared"] = shared
        return shared


class DeviceTables(GatherTables):
    """`TableMetadata` seen from a layer whose storage is on another device than the pool's first layer: what a
    gather reads (`GatherTables`), with index tensors on that device."""

    def __init__(self, metadata: TableMetadata, device: torch.device):
        self.metadata, self.device = metadata, device

    @property
    def pool(self) -> BlockPool:
        return self.metadata.pool

    @property
    def num_rows(self) -> int:
        return self.metadata.num_rows

    @property
    def memo(self) -> dict:
        return self.metadata.memo

    def gather_index(self, first_block: int, end_block: int, num_heads: int, num_pool_blocks: int) -> torch.Tensor:
        return self.metadata.gather_index(first_block, end_block, num_heads, num_pool_blocks, self.device)

    def consecutive_run(self, first_block: int, end_block: int) -> int | None:
        return self.metadata.consecutive_run(first_block, end_block)
