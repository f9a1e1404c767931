"""Block allocator: a free queue and reference counts over integer block ids.

No torch import: this module deals in ids and counts only, so its tests run in microseconds and assert exact ids.
The storage that the ids index lives in `pool.py`.

Invariants (checked by `check_invariants`, relied on everywhere):
- a block is either free (`ref_count == 0`, in the free queue exactly once) or held (`ref_count >= 1`, not queued);
- `num_free_blocks + num_used_blocks == num_blocks`;
- with prefix caching, `block id -> (group, hash)` and each group's `hash -> block id` are inverse maps, and only
  full blocks whose contents are exactly the hashed tokens carry a hash.

Prefix caching (vLLM's design, smaller): a full block can be remembered by a hash chain over token ids. A freed
cached block stays in the free queue with its contents, in least-recently-freed order, and is evicted (its hash
forgotten) only when `allocate` pops it for new data; a lookup that hits it takes it back out of the queue.

Layer groups: a pool whose layers form several groups (sliding and full attention) gives each sequence one block
per group for the same tokens, holding different layers' K/V. So a hash is cached per group: every method that
takes a hash takes the `group` it is for (default 0), and a lookup in one group never finds another group's block.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ..errors import PoolExhausted


class BlockAllocator:
    """Hands out block ids `0 .. num_blocks-1` from a FIFO free queue and tracks how many holders each has.

    A "holder" is one block-table entry that names the block: a block shared by two sequences after a fork has
    `ref_count == 2`. Every public method is atomic under an internal lock, so one allocator can back caches that
    live on different threads; a failed call leaves the allocator exactly as it was.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # NOTE: FIFO order. Freed blocks go to the back, so the least recently freed block is reused first (and,
        # with prefix caching, the least recently used cached block is evicted first); the allocator tests pin
        # this order down exactly. The queue is the never-used ids `_fresh_start .. _fresh_end - 1`, then the
        # freed ones in `_free`: building an allocator costs the same for any `num_blocks`, and memory grows with
        # the blocks in use. An OrderedDict, not a deque: a prefix hit removes a block from the middle.
        self._fresh_start, self._fresh_end = 0, num_blocks
        self._free: OrderedDict[int, None] = OrderedDict()
        self._ref_counts: dict[int, int] = {}  # held blocks only; a free block has no entry
        # Re-entrant, and public so a caller can make a read-then-act sequence atomic (block_tables.py).
        self.lock = threading.RLock()
        self.enable_prefix_caching = enable_prefix_caching
        self._block_of_hash: dict[bytes, int] = {}  # group 0's hash -> block id
        self._blocks_by_group: dict[int, dict[bytes, int]] = {0: self._block_of_hash}  # group -> hash -> block id
        self._hash_of_block: dict[int, bytes] = {}  # block id -> hash
        self._group_of_block: dict[int, int] = {}  # block id -> the group its hash is cached for
        self.num_prefix_queries = 0  # blocks looked up
        self.num_prefix_hits = 0  # blocks found

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self._fresh_end - self._fresh_start + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts.get(block_id, 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def free_queue(self) -> list[int]:
        """The free block ids in the order `allocate` takes them; for tests and debugging, O(num_free_blocks)."""
        with self.lock:
            return [*range(self._fresh_start, self._fresh_end), *self._free]

    # ---------------------------------------------------------------- mutations
    def allocate(self, num_blocks: int, num_holders: int = 1) -> list[int]:
        """Take `num_blocks` fresh blocks, each with `ref_count == num_holders`.

        Raises `PoolExhausted` (and changes nothing) when fewer than `num_blocks` are free.
        """
        if num_blocks < 0 or num_holders < 1:
            raise ValueError(f"allocate needs num_blocks >= 0 and num_holders >= 1, got {num_blocks}, {num_holders}")
        with self.lock:
            if num_blocks > self.num_free_blocks:
                raise PoolExhausted(num_blocks, self.num_free_blocks, self.num_blocks)
            num_fresh = min(num_blocks, self._fresh_end - self._fresh_start)
            block_ids = list(range(self._fresh_start, self._fresh_start + num_fresh))
            self._fresh_start += num_fresh
            block_ids += [self._free.popitem(last=False)[0] for _ in range(num_blocks - num_fresh)]
            for block_id in block_ids:
                assert block_id not in self._ref_counts, (
                    f"free block {block_id} had ref_count {self._ref_counts[block_id]}"
                )
                self._ref_counts[block_id] = num_holders
                self._forget(block_id)  # evicted: new data will overwrite the cached contents
            return block_ids

    def allocate_spare(self) -> int | None:
        """Take one free block for scratch data, sparing cached ones: the least recently freed block that caches
        nothing, else a never-used one, else the least recently used cached block (evicted); None when none is free.

        Why: a block taken at the head of the queue (`allocate`) is the least recently freed one, which with prefix
        caching is often the first block of the prompt a waiting request is about to find cached; O(free blocks)."""
        with self.lock:
            spare = next((block_id for block_id in self._free if not self.is_cached(block_id)), None)
            if spare is None:
                return self.allocate(1)[0] if self.num_free_blocks else None
            del self._free[spare]
            self._ref_counts[spare] = 1
            return spare

    def incref(self, block_ids: Iterable[int], times: int = 1) -> None:
        """Add `times` holders to each held block (a fork: a second block table now names it)."""
        with self.lock:
            block_ids = list(block_ids)
            for block_id in block_ids:
                if block_id not in self._ref_counts:
                    raise RuntimeError(f"incref of free block {block_id}: only held blocks can be shared")
            for block_id in block_ids:
                self._ref_counts[block_id] += times

    def free(self, block_ids: Iterable[int], times: int = 1) -> None:
        """Drop `times` holders from each block; a block whose count reaches zero goes back to the free queue.

        A double free (dropping a holder the block does not have) raises before anything changes.
        """
        with self.lock:
            block_ids = list(block_ids)
            drops: dict[int, int] = {}
            for block_id in block_ids:
                drops[block_id] = drops.get(block_id, 0) + times
            for block_id, num in drops.items():
                if self.ref_count(block_id) < num:
                    raise RuntimeError(
                        f"double free of block {block_id}: dropping {num} holders, it has {self.ref_count(block_id)}"
                    )
            for block_id in block_ids:
                self._ref_counts[block_id] -= times
                if self._ref_counts[block_id] == 0:
                    del self._ref_counts[block_id]
                    self._free[block_id] = None

    def copy_on_write(self, block_id: int, num_holders: int = 1) -> int:
        """Make `block_id` writable for a caller that holds it `num_holders` times.

        Returns `block_id` itself when nobody else holds it. Otherwise moves the caller's holds to a fresh block and
        returns its id; the caller must then copy the data (`BlockPool.copy_blocks`) before writing.
        """
        with self.lock:
            ref_count = self.ref_count(block_id)
            if ref_count < num_holders:
                raise RuntimeError(f"copy_on_write of block {block_id} by {num_holders} holders, it has {ref_count}")
            if ref_count == num_holders:
                self._forget(block_id)  # written in place: its contents stop matching its hash
                return block_id
            (new_block_id,) = self.allocate(1, num_holders)
            self._ref_counts[block_id] -= num_holders
            return new_block_id

    def grow(self, num_new_blocks: int) -> None:
        """Append `num_new_blocks` free ids at the end of the id range (the pool grew its storage to match)."""
        if num_new_blocks <= 0:
            raise ValueError(f"grow needs a positive number of blocks, got {num_new_blocks}")
        with self.lock:
            new_ids = range(self.num_blocks, self.num_blocks + num_new_blocks)
            if self._free:  # behind the freed blocks in the queue
                self._free.update(OrderedDict.fromkeys(new_ids))
            elif self._fresh_start == self._fresh_end:
                self._fresh_start, self._fresh_end = new_ids.start, new_ids.stop
            else:  # the never-used run ends at the old `num_blocks`: it simply goes on
                self._fresh_end = new_ids.stop
            self.num_blocks += num_new_blocks

    # ----------------------------------------------------------- prefix cache
    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of_block

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of_block)

    def cached_blocks(self) -> dict[int, bytes]:
        """A copy of what the prefix cache holds now: block id -> the hash of its tokens."""
        with self.lock:
            return dict(self._hash_of_block)

    def cache_block(self, block_id: int, block_hash: bytes, group: int = 0) -> None:
        """Remember that held block `block_id` holds exactly the tokens that `block_hash` names, in layer group
        `group`'s layers.

        NOTE: a hash already cached in another block is not moved: block tables are append-only and may still
        name the other block, so the duplicate simply stays uncached (vLLM does the same).
        """
        if not self.enable_prefix_caching:
            return
        with self.lock:
            if block_id not in self._ref_counts:
                raise RuntimeError(f"cache_block of free block {block_id}: only held blocks can be cached")
            blocks = self._blocks_by_group.setdefault(group, {})
            if block_hash in blocks or block_id in self._hash_of_block:
                return
            blocks[block_hash] = block_id
            self._hash_of_block[block_id] = block_hash
            self._group_of_block[block_id] = group

    def lookup_prefix(self, block_hashes: Sequence[bytes], group: int = 0) -> list[int]:
        """Take a hold on the cached blocks of the longest cached prefix of `block_hashes` (in layer group `group`);
        return their ids."""
        with self.lock:
            block_ids = self.peek_prefix(block_hashes, group)
            self._take_cached(block_ids)
            self.num_prefix_queries += len(block_hashes)
            self.num_prefix_hits += len(block_ids)
            return block_ids

    def _take_cached(self, block_ids: Iterable[int]) -> None:
        """One more holder for each cached block; a freed one comes back out of the free queue."""
        for block_id in block_ids:
            if block_id not in self._ref_counts:
                del self._free[block_id]
            self._ref_counts[block_id] = self._ref_counts.get(block_id, 0) + 1

    def peek_prefix(self, block_hashes: Sequence[bytes], group: int = 0) -> list[int]:
        """The ids of the cached blocks `lookup_prefix(block_hashes, group)` would take now, taking nothing."""
        with self.lock:
            block_ids, blocks = [], self._blocks_by_group.get(group, {})
            for block_hash in block_hashes:
                block_id = blocks.get(block_hash)
                if block_id is None:
                    break
                block_ids.append(block_id)
            return block_ids

    def peek_blocks(self, block_hashes: Sequence[bytes], group: int = 0) -> list[int | None]:
        """The cached block of each hash in layer group `group`, None where there is none (every hash, not only the
        leading run: a sliding group needs only the blocks its window sees). Takes nothing."""
        with self.lock:
            blocks = self._blocks_by_group.get(group, {})
            return [blocks.get(block_hash) for block_hash in block_hashes]

    def peek_longest_prefix(
        self, block_hashes: Sequence[bytes], windows: Sequence[int | None], block_size: int
    ) -> tuple[int, list[int], list[list[int]]]:
        """The longest prefix of `block_hashes` that every layer group can start from, taking nothing:
        `(num_blocks, first_blocks, tables)`.

        `windows[g]`: layer group g's sliding window in tokens when it gives back blocks that left the window, None
        when it keeps every block. A hit of `n` blocks needs a keeping group's blocks `0 .. n-1` cached, but a
        sliding group's only from the first block its window sees at position `n * block_size`
        (`first_window_block`), as vLLM's hybrid manager does, so released and evicted blocks before the window do
        not shorten it. `first_blocks[g]` is that first block (0 for a keeping group) and `tables[g]` the cached
        blocks from it to `n - 1`.
        """
        with self.lock:
            found: dict[int, list] = {}  # group -> a keeping group's leading run, a sliding group's every block
            num_blocks = len(block_hashes)
            for group, window in enumerate(windows):
                if window is None:
                    found[group] = self.peek_prefix(block_hashes[:num_blocks], group)
                    num_blocks = len(found[group])
            sliding = [group for group, window in enumerate(windows) if window is not None]
            for group in sliding:
                found[group] = self.peek_blocks(block_hashes[:num_blocks], group)
            settled = not sliding
            while not settled:  # until every sliding group's window at num_blocks is whole
                hits = [_window_hit(found[group], num_blocks, windows[group], block_size) for group in sliding]
                settled = min(hits) == num_blocks
                num_blocks = min(hits)
        first_blocks = [first_window_block(num_blocks * block_size, window, block_size) for window in windows]
        tables = [found[group][first:num_blocks] for group, first in enumerate(first_blocks)]
        return num_blocks, first_blocks, tables

    def take_longest_prefix(
        self, block_hashes: Sequence[bytes], windows: Sequence[int | None], block_size: int
    ) -> tuple[int, list[int], list[list[int]]]:
        """`peek_longest_prefix`, and a hold on every block it names, in one atomic step. Counts `len(block_hashes)`
        queries and `num_blocks` hits (blocks of the sequence, whatever the number of groups)."""
        with self.lock:
            num_blocks, first_blocks, tables = self.peek_longest_prefix(block_hashes, windows, block_size)
            for table in tables:
                self._take_cached(table)
            self.num_prefix_queries += len(block_hashes)
            self.num_prefix_hits += num_blocks
            return num_blocks, first_blocks, tables

    def uncache(self, block_id: int) -> None:
        """Forget `block_id`'s hash (its contents are about to change)."""
        with self.lock:
            self._forget(block_id)

    def _forget(self, block_id: int) -> None:
        block_hash = self._hash_of_block.pop(block_id, None)
        if block_hash is not None:
            del self._blocks_by_group[self._group_of_block.pop(block_id)][block_hash]

    # --------------------------------------------------------------- debugging
    def check_invariants(self) -> None:
        """Assert the allocator's invariants; for tests and debugging, O(blocks ever used)."""
        with self.lock:
            fresh = range(self._fresh_start, self._fresh_end)
            assert 0 <= fresh.start <= fresh.stop <= self.num_blocks, f"never-used run {fresh} of {self.num_blocks}"
            for block_id in self._free:
                assert block_id not in fresh, f"block {block_id} is in the free queue twice"
                assert 0 <= block_id < self.num_blocks, f"queued block {block_id} out of range"
                assert block_id not in self._ref_counts, (
                    f"queued block {block_id} has ref_count {self.ref_count(block_id)}"
                )
            for block_id, count in self._ref_counts.items():
                assert count > 0, f"held block {block_id} has ref_count {count}"
                assert 0 <= block_id < self.num_blocks and block_id not in fresh, f"held block {block_id} is free"
            num_held, num_free = len(self._ref_counts), self.num_free_blocks
            assert num_held + num_free == self.num_blocks, f"{num_held} held + {num_free} free != {self.num_blocks}"
            num_cached = sum(len(blocks) for blocks in self._blocks_by_group.values())
            assert num_cached == len(self._hash_of_block) == len(self._group_of_block), "hash maps out of step"
            for group, blocks in self._blocks_by_group.items():
                for block_hash, block_id in blocks.items():
                    assert self._hash_of_block[block_id] == block_hash, f"block {block_id} hash maps disagree"
                    assert self._group_of_block[block_id] == group, f"block {block_id} cached for two groups"

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free_blocks={self.num_free_blocks})"


def first_window_block(position: int, window: int | None, block_size: int) -> int:
    """The first block a query at `position` (or later) can see with a sliding `window` (None: no window, 0)."""
    return 0 if window is None else max(position - window + 1, 0) // block_size


def _window_hit(blocks: list[int | None], num_blocks: int, window: int, block_size: int) -> int:
    """The largest n <= `num_blocks` whose window, blocks `first_window_block(n * block_size) .. n - 1`, are all
    cached in `blocks` (a sliding group's cached block of each leading block, None where it has none).

    One pass from the top: a missing block k rules out every n above it (windows only move right as n grows), so
    the next candidate is n = k, checked from block k - 1 on."""
    top, k = num_blocks, num_blocks - 1
    while top > 0:
        first = first_window_block(top * block_size, window, block_size)
        while k >= first and blocks[k] is not None:
            k -= 1
        if k < first:
            return top
        top, k = k, k - 1
    return 0


def hash_block_tokens(parent_hash: bytes | None, block_index: int, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block: its position in the chain, its tokens, and (through the parent) every token
    before it. SHA-256, so two different prefixes never share a cached block in practice."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(block_index.to_bytes(8, "little"))
    # Each token as 8 little-endian signed bytes, packed in one call (a prompt's blocks are hashed in the step that
    # prefills it: per-token Python there costs every token of the step).
    try:
        digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error as error:
        raise ValueError(f"token ids must be integers of 64 bits, got {list(token_ids)[:8]}...: {error}") from None
    return digest.digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hash chain over the full blocks of `token_ids` (a trailing partial block gets no hash)."""
    hashes: list[bytes] = []
    for index in range(len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, index, token_ids[index * block_size : (index + 1) * block_size]))
    return hashes
