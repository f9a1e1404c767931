"""BlockManager: the one place in the engine that gives requests blocks and takes them back.

The scheduler decides who runs and with how many tokens; the block manager does what that costs in blocks:

    grow                    blocks for a request's next tokens, in every layer group at once (all or nothing)
    fit_chunk               the most of a prefill chunk the free blocks hold (a request running alone)
    release_out_of_window   a sliding group's blocks that no query from now on sees
    free                    every block a request holds (it finished, or it is preempted)
    roll_back               a request's tables as they were before a step that is undone

Blocks a request takes from the prefix cache come through `PrefixReuse.take`; everything else a request holds came
from here.
"""

from __future__ import annotations

from ..storage import BlockPool
from .blocks import BlockCounts
from .request import Request


class BlockManager:
    """Allocation, growth and freeing of requests' block tables on `pool` (`counts`: the pool's block arithmetic)."""

    def __init__(self, pool: BlockPool, counts: BlockCounts):
        self.pool = pool
        self.counts = counts

    @property
    def num_free_blocks(self) -> int:
        return self.pool.allocator.num_free_blocks

    def solo_need(self, request: Request) -> int:
        """The fewest blocks `request` runs in: alone, a step computing as few tokens as it must (a prefill chunk
        shrinks to what the pool holds when a request runs alone), so one query at each position.

        A full group holds every block up to the query, a sliding group the blocks from the one its window starts
        in (`BlockCounts.held_at`). The most over the request's positions is at one of its last `block_size`: a query
        one block further on holds one more block in a full group and no fewer in a sliding one.

        NOTE: admission counts whole prefill chunks (`GrowthModel.demand`), an upper bound that can pass this; a
        request whose count passes the pool is admitted only when nothing else runs, and nothing joins it while
        its prompt is computed (once it decodes, its count is about what it holds, and others may).
        """
        end = request.max_kv_tokens
        start = max(end - self.counts.block_size, 0)
        return max(self.counts.held_at(position) for position in range(start, end))

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give `request` blocks for `num_tokens` tokens in every group; False when the pool has too few free."""
        num_groups = len(self.counts.group_windows)
        if not request.block_tables:
            request.block_tables = [[] for _ in range(num_groups)]
            request.first_blocks = [0] * num_groups
        missing = self._missing_blocks(request, num_tokens)
        total = sum(missing)
        if total == 0:
            return True
        if not self.pool.allocator.can_allocate(total):
            return False
        new = self.pool.allocator.allocate(total)  # one allocation for every group: all or nothing
        for table, count in zip(request.block_tables, missing):
            table += new[:count]
            del new[:count]
        return True

    def need(self, request: Request, num_tokens: int) -> int:
        """The blocks `grow(request, num_tokens)` would take, all groups."""
        return sum(self._missing_blocks(request, num_tokens))

    def fit_chunk(self, request: Request, chunk: int) -> int:
        """The most of `chunk` tokens (ending at a block boundary when fewer) that `request` can compute now with the
        pool's free blocks; 0 when not even one."""
        free, block_size = self.num_free_blocks, self.counts.block_size
        while chunk > 0:
            if sum(self._missing_blocks(request, request.num_computed + chunk)) <= free:
                return chunk
            end_block = self.counts.blocks_for(request.num_computed + chunk)
            chunk = (end_block - 1) * block_size - request.num_computed  # back to the end of the block before
        return 0

    def release_out_of_window(self, request: Request) -> None:
        """Give back each sliding group's blocks that no query from `num_computed` on can see."""
        for group, window in enumerate(self.counts.group_windows):
            if window is None:
                continue
            num_released = self.counts.first_needed_block(group, request.num_computed) - request.first_blocks[group]
            if num_released > 0:
                table = request.block_tables[group]
                self.pool.allocator.free(table[:num_released])
                del table[:num_released]
                request.first_blocks[group] += num_released
                request.table_epoch += 1

    def free(self, request: Request) -> None:
        """Give back every block `request` holds (with prefix caching, its cached full blocks stay findable until
        evicted)."""
        self.pool.allocator.free(request.block_ids)
        request.block_tables, request.first_blocks = [], []
        request.table_epoch += 1

    def roll_back(self, request: Request, first_blocks: tuple[int, ...], table_lengths: tuple[int, ...]) -> None:
        """Free the blocks `request` took after its tables were `table_lengths` long from `first_blocks` (a step
        undone). Blocks released out of the window since stay released: they left for good."""
        if not table_lengths:  # it held nothing: what it holds now came with this step
            self.free(request)
            return
        for group, table in enumerate(request.block_tables):
            released = request.first_blocks[group] - first_blocks[group]
            kept = table_lengths[group] - released
            self.pool.allocator.free(table[kept:])
            del table[kept:]
        request.table_epoch += 1

    def held_outside(self, request: Request) -> int:
        """Blocks of the pool in use that `request` does not hold (other requests', or a `PagedCache`'s)."""
        return self.pool.num_used_blocks - len(set(request.block_ids))

    def _missing_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Per group: the blocks `request` must add to hold `num_tokens` tokens (a request without tables has none)."""
        end_block = self.counts.blocks_for(num_tokens)
        if not request.block_tables:
            return [end_block] * len(self.counts.group_windows)
        tables = zip(request.block_tables, request.first_blocks)
        return [max(end_block - first - len(table), 0) for table, first in tables]
