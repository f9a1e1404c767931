"""Per-row block tables of one layer group of a `PagedCache` and their row groups: which blocks each row holds.

A `PagedCache` holds one `BlockTables` per layer group of its pool (layer_groups.py); a uniform model has one. Block
ids in one layer group's tables are read and written only by that group's layers.

A *row* is one sequence of the batch that `generate()` runs. All rows of a cache have the same length (left padding
is stored like any token and masked by the attention mask, exactly as in `DynamicCache`), so the tables form a
rectangle and one `[B, num_table_blocks]` tensor describes them.

Block tables are indexed by *logical* block (`position // block_size`), offset by `base`: the number of leading
blocks every row has already given back because no layer of the group can attend to them again (a layer group whose
layers all slide). `tables[row][i]` holds logical block `base + i`.

Row groups are how one `generate()` call stores a prompt once for `num_return_sequences=n` or `num_beams=n`:
rows in one group hold identical block tables *and* are expected to write identical K/V. Only the group's leader
(its lowest row) writes; every layer verifies that the followers' new K/V equal the leader's, and a follower that
differs leaves the group and copies-on-write the blocks it is about to write. So sharing never changes a value:
it only skips storing the same value twice.

The tensors and indexes a step derives from the tables (slots, gather indices, the decode kernel's tables) are kept
by a `TableMetadata` (table_metadata.py) until `version` moves. `GatherTables` names what a gather reads of the
tables of some rows (gather.py): `TableMetadata` and the Engine's one-row tables implement it.

NOTE: this object holds the block ids but not the cache: a `weakref.finalize` on the cache calls `release` on every
layer group's tables, so a cache dropped without `release()` still returns its blocks.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch

from ..storage import BlockPool, block_hashes


class BlockTables:
    """The block tables of one layer group's rows and their row groups: which blocks each row holds, taken from,
    shared in and given back to the pool by reference count (host bookkeeping: `TableMetadata` derives the
    tensors)."""

    def __init__(self):
        self.pool: BlockPool | None = None
        self.tables: list[list[int]] = []  # tables[row] = block ids, in token order
        self.leaders: list[int] = []  # leaders[row] = the lowest row of its group (itself when alone)
        self.base = 0  # logical index of tables[row][0]: leading blocks released by a sliding layer group
        self.version = 0  # bumped on every table change: what was derived from the tables is stale
        self._memo: dict[tuple | str, object] = {}  # row groups and writes already planned; cleared on a change

    # ------------------------------------------------------------------ queries
    @property
    def num_rows(self) -> int:
        return len(self.tables)

    @property
    def num_table_blocks(self) -> int:
        return len(self.tables[0]) if self.tables else 0

    @property
    def end_block(self) -> int:
        """Logical index one past the last block of every table."""
        return self.base + self.num_table_blocks

    def held_block_ids(self) -> set[int]:
        return {block_id for table in self.tables for block_id in table}

    def has_groups(self) -> bool:
        """Whether some row follows another (memoized until the next table change)."""
        grouped = self._memo.get("grouped")
        if grouped is None:
            grouped = self._memo["grouped"] = any(leader != row for row, leader in enumerate(self.leaders))
        return grouped

    def writers(self) -> tuple[int, ...]:
        """The rows that store K/V: each row group's leader, ascending (memoized until the next table change)."""
        writers = self._memo.get("writers")
        if writers is None:
            writers = self._memo["writers"] = tuple(sorted(set(self.leaders)))
        return writers

    # --------------------------------------------------------------- lifecycle
    def start(self, leaders: list[int]) -> None:
        """Begin with `len(leaders)` empty rows grouped as given."""
        assert not self.tables, "start() on a BlockTables that still holds rows"
        self.tables = [[] for _ in leaders]
        self.leaders = list(leaders)
        self.base = 0
        self._changed()

    def release(self) -> None:
        """Return every block to the pool and forget all rows (idempotent)."""
        if self.pool is not None and self.tables:
            # One `free` per holder: a block shared by k tables is dropped k times.
            self.pool.allocator.free([block_id for table in self.tables for block_id in table])
        self.tables, self.leaders = [], []
        self.base = 0
        self._changed()

    def _changed(self) -> None:
        self.version += 1
        self._memo.clear()

    # ---------------------------------------------------------------- blocks
    def _take(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh blocks (one holder each) in ONE allocator call: atomic against other threads sharing
        the pool, so a `PoolExhausted` here means nothing changed. A private pool grows first instead."""
        allocator = self.pool.allocator
        if self.pool.growable and not allocator.can_allocate(num_blocks):
            self.pool.grow(max(num_blocks - allocator.num_free_blocks, allocator.num_blocks))
        return allocator.allocate(num_blocks)

    # -------------------------------------------------------------- row groups
    def start_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, share_rows: bool) -> None:
        """Begin with one row per row of the first layer's `key_states` ([B, kv_heads, q_len, head_dim]). With
        `share_rows`, adjacent rows with identical K and V form one row group (generate() expands prompts with
        repeat_interleave, so copies are adjacent)."""
        batch_size = key_states.shape[0]
        leaders = list(range(batch_size))
        if share_rows and batch_size > 1:
            same = rows_equal(key_states[1:], key_states[:-1]) & rows_equal(value_states[1:], value_states[:-1])
            for row, is_same in enumerate(same.tolist(), start=1):
                if is_same:
                    leaders[row] = leaders[row - 1]
        self.start(leaders)

    def verify_row_groups(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Split off every follower whose new K/V ([B, kv_heads, q_len, head_dim]) differ from its leader's.

        A split row becomes its own writer; the `prepare_write` that follows copies-on-write the blocks it is
        about to write, with the earlier layers of this step (written by its old leader, equal to its own) inside.
        NOTE: per layer group. A row split in one group may still share in another: every layer of that other group
        verified its writes equal, which is all sharing promises.
        """
        followers = [row for row, leader in enumerate(self.leaders) if leader != row]
        leaders = [self.leaders[row] for row in followers]
        same = rows_equal(key_states[followers], key_states[leaders]) & rows_equal(
            value_states[followers], value_states[leaders]
        )
        diverged = [row for row, is_same in zip(followers, same.tolist()) if not is_same]
        if diverged:
            self.split(diverged)

    def prepare_write(self, writers: tuple[int, ...], start: int, end: int) -> None:
        """Make positions [start, end) writable for every writer (a row group's leader): fresh blocks up to `end`,
        one per row group and shared by its members, and a copy of every block a writer's group is about to write
        that somebody outside the group also holds.

        All or nothing: the fresh blocks and the copies are counted first and taken in ONE allocator call, so a
        `PoolExhausted` (which names the whole count) leaves the tables, the free queue (in order) and the prefix
        cache as they were. Memoized for the later layers of a step (a table change in between, such as a split,
        clears the memo and plans again).
        """
        key = ("writable", writers, start, end)
        if key in self._memo:
            return
        block_size = self.pool.block_size
        # A write further on in the one block the writers' last write made writable, with no table change since (the
        # memo goes at each): that block is already their own and no block is missing (a decode step's common case).
        # Another holder can only come through a table change of these tables (`share_from` and `select_rows` clear
        # both sides' memos) or a prefix lookup, which takes only cached blocks: full ones, and the write that made
        # this block writable left it uncached.
        open_key = ("open block", writers)
        last = self._memo.get(open_key)
        if last is not None and start >= last[1] and start // block_size == (end - 1) // block_size == last[0]:
            self._memo[open_key] = (last[0], end)
            return
        sizes = Counter(self.leaders)  # leader -> rows in its group
        allocator = self.pool.allocator
        # NOTE: plan and take under the allocator lock, so no other thread's prefix lookup can take a hold on a block
        # between "nobody else holds it" and forgetting its hash, and no other thread can take the counted blocks.
        with allocator.lock:
            num_missing = max(-(-end // block_size) - self.end_block, 0)
            todo, in_place = self._plan_copies(writers, start, end, sizes)
            num_fresh = num_missing * len(sizes)
            new_block_ids = self._take(num_fresh + len(todo)) if num_fresh + len(todo) else []
            # Only now that nothing can fail: a block written in place (after a crop) stops matching its hash.
            for block_id in in_place:
                allocator.uncache(block_id)
        for group, (leader, size) in enumerate(sizes.items()):
            group_block_ids = new_block_ids[group * num_missing : (group + 1) * num_missing]
            if size > 1:
                allocator.incref(group_block_ids, times=size - 1)
            for row in range(self.num_rows):
                if self.leaders[row] == leader:
                    self.tables[row].extend(group_block_ids)
        if todo:
            copies = new_block_ids[num_fresh:]
            src = [self.tables[leader][index] for leader, index in todo]
            # Copy while the group still holds every source block: once dropped, another thread may reuse it.
            self.pool.copy_blocks(src, copies)
            for (leader, index), old, new in zip(todo, src, copies):
                if sizes[leader] > 1:
                    allocator.incref([new], times=sizes[leader] - 1)
                for row in range(self.num_rows):
                    if self.leaders[row] == leader:
                        self.tables[row][index] = new
                allocator.free([old], times=sizes[leader])  # other holders remain: only this group moved off
        if new_block_ids:
            self._changed()
        self._memo[key] = True
        if start // block_size == (end - 1) // block_size:
            self._memo[open_key] = (start // block_size, end)

    def _plan_copies(
        self, writers: tuple[int, ...], start: int, end: int, sizes: Counter
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Which held blocks that writers write in [start, end) need a copy: `(leader, table index)` pairs, and the
        cached blocks written in place instead. Changes nothing; the caller holds the allocator lock.

        Plans against the ref counts as the plan leaves them: once the other holders of a block have moved to their
        copies, the last group holding it writes in place (two rows forked from one need one copy, not two). Blocks
        past the end of the tables are fresh, held by their group alone, so they never need a copy."""
        block_size, allocator = self.pool.block_size, self.pool.allocator
        first = start // block_size - self.base
        stop = min((end - 1) // block_size + 1 - self.base, self.num_table_blocks)
        moved: Counter = Counter()
        todo, in_place = [], []
        for leader in writers:
            for index in range(first, stop):
                block_id = self.tables[leader][index]
                if allocator.ref_count(block_id) - moved[block_id] != sizes[leader]:
                    todo.append((leader, index))
                    moved[block_id] += sizes[leader]
                elif allocator.is_cached(block_id):
                    in_place.append(block_id)
        return todo, in_place

    def split(self, rows: list[int]) -> None:
        """Take `rows` out of their groups (their next write will copy-on-write)."""
        for row in rows:
            leader = self.leaders[row]
            if leader == row:  # a leader leaving: the next member leads the rest
                members = [r for r in range(self.num_rows) if self.leaders[r] == row and r != row]
                for member in members:
                    self.leaders[member] = members[0]
            self.leaders[row] = row
        self._changed()

    def truncate(self, num_tokens: int) -> None:
        """Drop the blocks past the first `num_tokens` tokens of every row."""
        keep = -(-num_tokens // self.pool.block_size) - self.base
        if keep >= self.num_table_blocks:
            # No block dropped, but positions past `num_tokens` will be written again: plan those writes anew (a
            # block may have gained a holder since, e.g. a branch of this cache, and must then be copied first).
            self._changed()
            return
        if keep < 0:
            raise RuntimeError(
                f"cannot keep {num_tokens} tokens: the first {self.base * self.pool.block_size} were already released "
                "by the sliding window; call activate_past_recording() before generating to be able to roll back"
            )
        dropped = [block_id for table in self.tables for block_id in table[keep:]]
        self.tables = [table[:keep] for table in self.tables]
        self.pool.allocator.free(dropped)
        self._changed()

    def release_front(self, first_needed: int) -> None:
        """Give back every block wholly before position `first_needed` (no layer will attend to it again)."""
        num_released = min(first_needed // self.pool.block_size - self.base, self.num_table_blocks)
        if num_released <= 0:
            return
        self.pool.allocator.free([block_id for table in self.tables for block_id in table[:num_released]])
        self.tables = [table[num_released:] for table in self.tables]
        self.base += num_released
        self._changed()

    def select_rows(self, indices: list[int]) -> None:
        """New row i becomes a copy of old row `indices[i]` (beam reorder, batch select, repeat-interleave).

        Rows copied from one old group form one new group: same tables, and until proven otherwise, same writes.
        """
        old_tables, old_leaders = self.tables, self.leaders
        self.tables = [list(old_tables[i]) for i in indices]
        first_row_of_old_group: dict[int, int] = {}
        self.leaders = [first_row_of_old_group.setdefault(old_leaders[i], new) for new, i in enumerate(indices)]
        if self.pool is not None:
            # NOTE: incref before free, so a block kept by the new tables never passes through the free queue.
            self.pool.allocator.incref(block_id for table in self.tables for block_id in table)
            self.pool.allocator.free(block_id for table in old_tables for block_id in table)
        self._changed()

    def share_from(self, other: BlockTables) -> None:
        """Begin with `other`'s rows, row groups and base, one more holder on each of their blocks: the first write
        to a shared block by either side copies that block (`prepare_write`), and each side releases on its own."""
        assert not self.tables, "share_from() on a BlockTables that still holds rows"
        assert self.pool is other.pool, "tables share blocks of one pool"
        self.tables = [list(table) for table in other.tables]
        self.leaders, self.base = list(other.leaders), other.base
        if self.pool is not None and self.tables:
            self.pool.allocator.incref(block_id for table in self.tables for block_id in table)
        self._changed()
        other._changed()  # its blocks have another holder now: its next write to them copies first

    def adopt(self, block_ids: list[int], base: int = 0) -> None:
        """Begin with one row whose table is `block_ids`, already held for it (a prefix-cache hit), after `base`
        blocks it does not hold (a sliding group's hit starts at its window)."""
        self.start([0])
        self.tables[0] = list(block_ids)
        self.base = base
        self._changed()

    # ----------------------------------------------------------- prefix cache
    def cache_rows(self, rows: list[list[int]], padded: list[bool], num_tokens: int, group: int = 0) -> None:
        """Remember every full block of each unpadded row by the hash chain of its tokens, as layer group `group`'s:
        `rows[r]` are row r's token ids, of which the first `num_tokens` have their K/V stored."""
        allocator, block_size = self.pool.allocator, self.pool.block_size
        for row, (row_ids, is_padded) in enumerate(zip(rows, padded)):
            if is_padded:
                continue
            hashes = block_hashes(row_ids[:num_tokens], block_size)[self.base :]  # released blocks are gone
            for block_id, block_hash in zip(self.tables[row], hashes):
                allocator.cache_block(block_id, block_hash, group)


class GatherTables(Protocol):
    """The block tables of some rows of one layer group, as a gather reads them (gather.py), by logical block
    (`position // block_size`): `TableMetadata` (a `PagedCache`'s rows), `DeviceTables` (the same, indexed on another
    device) and the Engine's one-row tables implement it."""

    pool: BlockPool
    num_rows: int
    memo: dict  # values worked out once for a step's layers (pool views of runs), dropped when the tables change

    def consecutive_run(self, first_block: int, end_block: int) -> int | None:
        """The pool block id of logical block `first_block` when the tables hold ONE row whose logical blocks
        [first_block, end_block) are consecutive pool blocks, else None."""
        ...

    def gather_index(self, first_block: int, end_block: int, num_heads: int, num_pool_blocks: int) -> torch.Tensor:
        """`[num_rows * num_heads * n]` int64 rows of the head-major `[num_heads * num_pool_blocks, block_size,
        head_dim]` pool view for logical blocks [first_block, end_block), in `[num_rows, num_heads, n]` order."""
        ...


def head_major_index(tables: torch.Tensor, num_heads: int, num_pool_blocks: int) -> torch.Tensor:
    """tables [B, n] -> [B * num_heads * n] int64 rows of a `[num_heads * num_pool_blocks, block_size, head_dim]`
    pool view, in `[B, num_heads, n]` order (see `GatherTables.gather_index`)."""
    heads = torch.arange(num_heads, device=tables.device) * num_pool_blocks
    return (heads[None, :, None] + tables[:, None, :]).flatten()


def rows_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N, ...] x [N, ...] -> [N] bool: row n of a equals row n of b exactly."""
    return (a == b).flatten(1).all(dim=1)
