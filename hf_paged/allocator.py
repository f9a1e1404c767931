"""Block allocator: a free queue and reference counts over integer block ids.

No torch import: this module deals in ids and counts only, so its tests run in microseconds and assert exact ids.
The storage that the ids index lives in `pool.py`.

Invariants (checked by `check_invariants`, relied on everywhere):
- a block is either free (`ref_count == 0`, in the free queue exactly once) or held (`ref_count >= 1`, not queued);
- `num_free_blocks + num_used_blocks == num_blocks`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from .errors import PoolExhausted


class BlockAllocator:
    """Hands out block ids `0 .. num_blocks-1` from a FIFO free queue and tracks how many holders each has.

    A "holder" is one block-table entry that names the block: a block shared by two sequences after a fork has
    `ref_count == 2`. Every public method is atomic under an internal lock, so one allocator can back caches that
    live on different threads; a failed call leaves the allocator exactly as it was.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # NOTE: FIFO order. Freed blocks go to the back, so the least recently freed block is reused first; the
        # allocator tests pin this order down exactly.
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # ---------------------------------------------------------------- mutations
    def allocate(self, num_blocks: int, num_holders: int = 1) -> list[int]:
        """Take `num_blocks` fresh blocks, each with `ref_count == num_holders`.

        Raises `PoolExhausted` (and changes nothing) when fewer than `num_blocks` are free.
        """
        if num_blocks < 0 or num_holders < 1:
            raise ValueError(f"allocate needs num_blocks >= 0 and num_holders >= 1, got {num_blocks}, {num_holders}")
        with self._lock:
            if num_blocks > len(self._free):
                raise PoolExhausted(num_blocks, len(self._free), self.num_blocks)
            block_ids = [self._free.popleft() for _ in range(num_blocks)]
            for block_id in block_ids:
                assert self._ref_counts[block_id] == 0, f"free block {block_id} had ref_count {self._ref_counts[block_id]}"
                self._ref_counts[block_id] = num_holders
            return block_ids

    def incref(self, block_ids: Iterable[int], times: int = 1) -> None:
        """Add `times` holders to each held block (a fork: a second block table now names it)."""
        with self._lock:
            block_ids = list(block_ids)
            for block_id in block_ids:
                if self._ref_counts[block_id] <= 0:
                    raise RuntimeError(f"incref of free block {block_id}: only held blocks can be shared")
            for block_id in block_ids:
                self._ref_counts[block_id] += times

    def free(self, block_ids: Iterable[int], times: int = 1) -> None:
        """Drop `times` holders from each block; a block whose count reaches zero goes back to the free queue.

        A double free (dropping a holder the block does not have) raises before anything changes.
        """
        with self._lock:
            block_ids = list(block_ids)
            drops: dict[int, int] = {}
            for block_id in block_ids:
                drops[block_id] = drops.get(block_id, 0) + times
            for block_id, num in drops.items():
                if self._ref_counts[block_id] < num:
                    raise RuntimeError(
                        f"double free of block {block_id}: dropping {num} holders, it has {self._ref_counts[block_id]}"
                    )
            for block_id in block_ids:
                self._ref_counts[block_id] -= times
                if self._ref_counts[block_id] == 0:
                    self._free.append(block_id)

    def copy_on_write(self, block_id: int, num_holders: int = 1) -> int:
        """Make `block_id` writable for a caller that holds it `num_holders` times.

        Returns `block_id` itself when nobody else holds it. Otherwise moves the caller's holds to a fresh block and
        returns its id; the caller must then copy the data (`BlockPool.copy_blocks`) before writing.
        """
        with self._lock:
            ref_count = self._ref_counts[block_id]
            if ref_count < num_holders:
                raise RuntimeError(f"copy_on_write of block {block_id} by {num_holders} holders, it has {ref_count}")
            if ref_count == num_holders:
                return block_id
            (new_block_id,) = self.allocate(1, num_holders)
            self._ref_counts[block_id] -= num_holders
            return new_block_id

    def grow(self, num_new_blocks: int) -> None:
        """Append `num_new_blocks` free ids at the end of the id range (the pool grew its storage to match)."""
        if num_new_blocks <= 0:
            raise ValueError(f"grow needs a positive number of blocks, got {num_new_blocks}")
        with self._lock:
            self._free.extend(range(self.num_blocks, self.num_blocks + num_new_blocks))
            self._ref_counts.extend([0] * num_new_blocks)
            self.num_blocks += num_new_blocks

    # --------------------------------------------------------------- debugging
    def check_invariants(self) -> None:
        """Assert the allocator's invariants; for tests and debugging, O(num_blocks)."""
        with self._lock:
            free = list(self._free)
            assert len(free) == len(set(free)), "a block is in the free queue twice"
            for block_id in free:
                assert self._ref_counts[block_id] == 0, f"queued block {block_id} has ref_count {self._ref_counts[block_id]}"
            num_held = sum(1 for count in self._ref_counts if count > 0)
            assert all(count >= 0 for count in self._ref_counts), "negative ref_count"
            assert num_held + len(free) == self.num_blocks, f"{num_held} held + {len(free)} free != {self.num_blocks}"

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free_blocks={self.num_free_blocks})"
