"""Random prefix-caching sequences on `PagedCache`s sharing one `BlockPool(enable_prefix_caching=True)`.

K/V are what a model would write: a function of the whole token prefix up to and including the position
(`tests/prefix_kv.py`), so from token ids alone the test knows what every live cache and every cached block must hold.

Rules: append tokens, fork / reorder / select rows, crop, release (with token ids, some rows marked padded, or
without), start a cache from a prefix of a released sequence (or of a fresh one) with `from_prefix`, crop back into
a held cached block and write it again, fill part of the free pool with a fresh sequence (cached free blocks are
evicted least recently freed first), and an append one block larger than the free pool (PoolExhausted).

After every step: the allocator's invariants; free + used = total; every ref_count equals the number of block-table
entries naming the block over all live caches; each cached hash maps to one block whose stored hash is that hash,
and which is either held or in the free queue, never both; every cached block holds the K/V of the tokens its hash
names; every live cache holds the K/V of its rows' tokens. Each rule also checks how the free queue and the hash map
changed: an append takes blocks only from the front of the free queue and forgets exactly the hashes of the blocks
it took or wrote in place; a lookup takes exactly the longest cached prefix (never the whole input) out of the queue
and changes no hash; freeing puts blocks at the back and changes no hash; `release(token_ids=...)` adds exactly the
hashes of the full blocks of its unpadded rows that are not cached yet.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged import BlockPool, PagedCache, PoolExhausted
from hf_paged.storage import block_hashes
from tests.prefix_kv import LAYOUT, NUM_LAYERS, read_blocks, rows_kv, token_kv
from tests.test_cache_properties import check_holders, machine_settings, release_all

NUM_BLOCKS = 16
MAX_CACHES = 3
MAX_ROWS = 4
MAX_Q_LEN = 8
TOKENS = st.integers(1, 3)  # a tiny vocabulary: independently drawn sequences often share a prefix


# ----------------------------------------------------------------------------------------------- the machine
class Tracked:
    """One cache under test and the token ids of its rows (`rows == []`: no rows yet, or released)."""

    def __init__(self, cache: PagedCache):
        self.cache = cache
        self.rows: list[list[int]] = []
        self.reordered = False  # reorder_cache since the last release: release(token_ids=...) then raises

    def __repr__(self) -> str:
        return f"Tracked(rows={self.rows}, tables={self.cache.block_tables})"

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def seq_len(self) -> int:
        return len(self.rows[0]) if self.rows else 0


@dataclass
class PoolState:
    free: list[int]  # the free queue, front (next to be allocated) first
    cached: dict[bytes, int]  # hash -> block id
    tables: list[list[list[int]]]  # per tracked cache
    lengths: list[int]  # per tracked cache


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool: BlockPool | None = None
        self.tracked: list[Tracked] = []
        self.released: list[tuple[int, ...]] = []  # rows released so far, for from_prefix to start from
        self.tokens_of_hash: dict[bytes, tuple[int, ...]] = {}  # every block hash computed here -> its prefix

    @initialize(block_size=st.sampled_from([2, 4]), share_rows=st.booleans())
    def make_pool(self, block_size, share_rows):
        self.pool = BlockPool(LAYOUT, num_blocks=NUM_BLOCKS, block_size=block_size, enable_prefix_caching=True)
        self.tracked.append(Tracked(PagedCache(pool=self.pool, share_rows=share_rows)))

    # ---------------------------------------------------------------- helpers
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def pick(self, data, with_rows: bool = False) -> Tracked:
        candidates = [t for t in self.tracked if t.rows] if with_rows else self.tracked
        return data.draw(st.sampled_from(candidates), label="cache")

    def snapshot(self) -> PoolState:
        allocator = self.pool.allocator
        return PoolState(
            free=allocator.free_queue(),
            cached=dict(allocator._block_of_hash),
            tables=[t.cache.block_tables for t in self.tracked],
            lengths=[t.cache.get_seq_length() for t in self.tracked],
        )

    def hashes(self, tokens) -> list[bytes]:
        """The block hashes of `tokens`' full blocks, remembered with the prefix each names."""
        result = block_hashes(list(tokens), self.block_size)
        for index, block_hash in enumerate(result):
            self.tokens_of_hash[block_hash] = tuple(tokens[: (index + 1) * self.block_size])
        return result

    def draw_new_rows(self, data, t: Tracked, batch: int, q_len: int) -> list[list[int]]:
        """`q_len` new tokens per row. A row with the same history as an earlier row may continue like it (its
        group stays together) or draw its own tokens (the group splits, shared blocks are copied on write)."""
        rows = t.rows or [[] for _ in range(batch)]
        new_rows: list[list[int]] = []
        for row in range(batch):
            twin = next((earlier for earlier in range(row) if rows[earlier] == rows[row]), None)
            if twin is not None and data.draw(st.booleans(), label=f"row {row} continues like row {twin}"):
                new_rows.append(list(new_rows[twin]))
            else:
                new_rows.append(data.draw(st.lists(TOKENS, min_size=q_len, max_size=q_len), label=f"new[{row}]"))
        return new_rows

    def append(self, t: Tracked, new_rows: list[list[int]]) -> bool:
        """Feed the K/V of `new_rows` (one token list per row, equal lengths) to every layer of `t`, check what
        `update()` returns and how the free queue and the hash map changed. Returns whether the step went through."""
        rows = [old + new for old, new in zip(t.rows or [[] for _ in new_rows], new_rows)]
        num_past, num_tokens = t.seq_len, len(rows[0])
        keys, values = rows_kv(rows, num_past, num_tokens)
        want_keys, want_values = rows_kv(rows, 0, num_tokens)
        before = self.snapshot()
        tables_before = t.cache.block_tables
        for layer_idx in range(NUM_LAYERS):
            try:
                got_k, got_v = t.cache.update(keys[layer_idx], values[layer_idx], layer_idx)
            except PoolExhausted as error:
                # K/V differ between rows exactly where their tokens do, so groups split in layer 0 and every block
                # a step needs is taken there: no later layer can run out.
                assert layer_idx == 0, f"PoolExhausted in layer {layer_idx}: {error}"
                assert error.num_needed > error.num_free and error.num_total == NUM_BLOCKS, str(error)
                self.check_failed_update(before)
                event("append: PoolExhausted")
                return False
            want_k, want_v = want_keys[layer_idx], want_values[layer_idx]
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"update() of layer {layer_idx}"
        t.rows = rows
        after = self.snapshot()
        # An append only takes blocks, and takes them from the front: the least recently freed block goes first.
        # (Copy-on-write frees nothing: the block it copies keeps its other holders.)
        num_taken = len(before.free) - len(after.free)
        assert after.free == before.free[num_taken:], f"free queue {before.free} -> {after.free}: not FIFO"
        taken = set(before.free[:num_taken])
        # A block written in place (same id before and after, at a written position) no longer holds what its hash
        # names, whatever the new tokens are; a taken block is evicted. Every other hash stays.
        block_size = self.block_size
        written = {
            after_table[index]
            for old_table, after_table in zip(tables_before, t.cache.block_tables)
            for index in range(num_past // block_size, (num_tokens - 1) // block_size + 1)
            if index < len(old_table) and old_table[index] == after_table[index]
        }
        expected = {h: b for h, b in before.cached.items() if b not in taken and b not in written}
        lost = set(before.cached.values()) - set(after.cached.values())
        assert after.cached == expected, f"an append forgot blocks {lost}, should forget {taken | written}"
        if len(expected) < len(before.cached):
            event("append: forgot cached blocks (evicted or written in place)")
        return True

    def check_failed_update(self, before: PoolState) -> None:
        """A PoolExhausted leaves every cache and the pool as they were: tables, lengths, the free queue (in order)
        and the hash map. (Contents: the invariants check every cache against its unchanged rows.)"""
        after = self.snapshot()
        assert after.tables == before.tables, f"block tables {before.tables} -> {after.tables} across a failed update"
        assert after.lengths == before.lengths
        # NOTE: in order, and every hash kept: an update counts what it needs before taking anything (these pin
        # the regressions at the end of this file, found by this machine).
        assert after.free == before.free, f"free queue {before.free} -> {after.free} across a failed update"
        assert after.cached == before.cached, "a failed update forgot or cached a hash"

    def check_only_freed(self, before: PoolState) -> None:
        """For rules that only drop holders: freed blocks join the back of the free queue, the rest keep their order,
        and no hash is added or forgotten (a freed cached block stays cached, with its contents)."""
        after = self.snapshot()
        assert after.free[: len(before.free)] == before.free, f"free queue {before.free} -> {after.free}"
        assert after.cached == before.cached, "the hash map changed without an append, lookup or release"

    def release_tracked(self, t: Tracked, data) -> None:
        """`release()` `t`, with its token ids (some rows marked padded, some trailing tokens never fed) or without."""
        mode = data.draw(st.sampled_from(["token_ids", "token_ids+mask", "none"]), label="release")
        before = self.snapshot()
        tables = t.cache.block_tables
        expected = dict(before.cached)
        if mode == "none" or not t.rows:
            t.cache.release()
        elif t.reordered:
            # Beam search's rows need not be generate()'s sequences: the token ids are refused, the blocks go back.
            with pytest.raises(ValueError, match="after beam search"):
                t.cache.release(token_ids=torch.tensor(t.rows))
            event("release: token_ids refused after a reorder")
        else:
            padded = [
                mode == "token_ids+mask" and data.draw(st.booleans(), label=f"padded[{row}]") for row in range(t.batch)
            ]
            # generate() returns one token more than it fed: release() must cache only what was written.
            extra = data.draw(st.lists(TOKENS, max_size=2), label="unfed tokens")
            token_ids = torch.tensor([row + extra for row in t.rows])
            attention_mask = None
            if mode == "token_ids+mask":
                attention_mask = torch.ones_like(token_ids)
                if token_ids.shape[1]:
                    attention_mask[[row for row, is_padded in enumerate(padded) if is_padded], 0] = 0
            hash_of_block = {b: h for h, b in expected.items()}
            for row, table, is_padded in zip(t.rows, tables, padded):
                self.remember_released(row)
                if is_padded:
                    continue
                for block_id, block_hash in zip(table, self.hashes(row)):
                    if block_id in hash_of_block:
                        # The block holds this row's K/V, and K/V name their prefix: a different hash is stale.
                        assert hash_of_block[block_id] == block_hash, f"block {block_id} is cached under another prefix"
                    elif block_hash not in expected:  # a duplicate of a cached block stays uncached
                        expected[block_hash] = block_id
                        hash_of_block[block_id] = block_hash
            t.cache.release(token_ids=token_ids, attention_mask=attention_mask)
            event(f"release: {mode}, {'some' if len(expected) > len(before.cached) else 'no'} blocks newly cached")
        after = self.snapshot()
        assert after.cached == expected, "release() cached other blocks than the full blocks of its unpadded rows"
        assert after.free[: len(before.free)] == before.free, f"free queue {before.free} -> {after.free}"
        others = Counter(b for o in self.tracked if o is not t for table in o.cache.block_tables for b in table)
        freed = {b for table in tables for b in table if not others[b]}
        assert sorted(after.free[len(before.free) :]) == sorted(freed), "release() freed other blocks than its own"
        assert t.cache.block_tables == [] and t.cache.get_seq_length() == 0
        t.rows, t.reordered = [], False

    def remember_released(self, row: list[int]) -> None:
        if row and tuple(row) not in self.released:
            self.released.append(tuple(row))

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.tracked) < MAX_CACHES)
    @rule(share_rows=st.booleans())
    def create(self, share_rows):
        self.tracked.append(Tracked(PagedCache(pool=self.pool, share_rows=share_rows)))

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def append_tokens(self, data):
        t = self.pick(data)
        batch = t.batch or data.draw(st.integers(1, 3), label="batch")
        q_len = data.draw(st.integers(1, MAX_Q_LEN), label="q_len")
        self.append(t, self.draw_new_rows(data, t, batch, q_len))

    @rule(data=st.data(), share_rows=st.booleans())
    def start_from_prefix(self, data, share_rows):
        """`from_prefix` holds exactly the cached blocks of the longest cached prefix, leaving >= 1 token to compute;
        then the rest of the input is appended, as generate() would. (With MAX_CACHES live, one is released and
        dropped first: a finished request making room for the next.)"""
        if len(self.tracked) == MAX_CACHES:
            finished = self.pick(data)
            self.release_tracked(finished, data)
            self.tracked.remove(finished)
        block_size = self.block_size
        cached = self.pool.allocator._block_of_hash
        # Released rows whose first block is still cached: most likely to hit, so drawn from most often.
        warm = [row for row in self.released if len(row) > block_size and self.hashes(row[:block_size])[0] in cached]
        source = data.draw(st.sampled_from(["warm", "released", "fresh"]), label="input from")
        if source == "warm" and warm:
            row = data.draw(st.sampled_from(warm), label="warm row")
            cut = data.draw(st.integers(block_size + 1, len(row)), label="cut")
            input_ids = list(row[:cut]) + data.draw(st.lists(TOKENS, max_size=2 * block_size), label="then")
        elif source == "released" and self.released:
            row = data.draw(st.sampled_from(self.released), label="released row")
            cut = data.draw(st.integers(1, len(row)), label="cut")
            input_ids = list(row[:cut]) + data.draw(st.lists(TOKENS, max_size=2 * block_size), label="then")
        else:
            input_ids = data.draw(st.lists(TOKENS, min_size=1, max_size=4 * block_size), label="input_ids")
        before = self.snapshot()
        num_reusable = (len(input_ids) - 1) // block_size  # at least one token must stay to compute
        want: list[int] = []
        for block_hash in self.hashes(input_ids[: num_reusable * block_size]):
            if block_hash not in before.cached:
                break
            want.append(before.cached[block_hash])

        cache = PagedCache.from_prefix(self.pool, torch.tensor([input_ids]), share_rows=share_rows)
        t = Tracked(cache)
        self.tracked.append(t)
        num_cached_tokens = len(want) * block_size
        assert cache.block_tables == ([want] if want else []), f"from_prefix took {cache.block_tables}, want {want}"
        assert cache.get_seq_length() == num_cached_tokens < len(input_ids)
        t.rows = [input_ids[:num_cached_tokens]] if want else []
        after = self.snapshot()
        assert after.cached == before.cached, "a lookup changed the hash map"
        assert after.free == [b for b in before.free if b not in want], "a hit must leave the queue, nothing else"
        event(f"from_prefix: {min(len(want), 3)}{'+' if len(want) >= 3 else ''} hits")
        if any(b in before.free for b in want):
            event("from_prefix: hit a free cached block")
        if len(want) == num_reusable and want and len(input_ids) % block_size == 0:
            event("from_prefix: whole input cached, last block recomputed")
        self.append(t, [input_ids[num_cached_tokens:]])
        if self.holds_cached_block(t) and data.draw(st.booleans(), label="rewrite part of the prefix"):
            self.rewrite(t, data)

    @precondition(lambda self: self.tracked and self.pool.num_free_blocks > 0)
    @rule(data=st.data())
    def fill(self, data):
        """A fresh one-row sequence takes k free blocks: exactly the k least recently freed, cached or not."""
        t = self.pick(data)
        if t.rows:
            self.release_tracked(t, data)
        num_blocks = data.draw(st.integers(1, self.pool.num_free_blocks), label="num_blocks")
        num_cached_free = sum(1 for b in self.pool.allocator.free_queue() if self.pool.allocator.is_cached(b))
        tokens = data.draw(
            st.lists(TOKENS, min_size=num_blocks * self.block_size, max_size=num_blocks * self.block_size),
            label="tokens",
        )
        num_free = self.pool.num_free_blocks
        assert self.append(t, [tokens]), "a sequence that fits the free blocks failed"
        assert self.pool.num_free_blocks == num_free - num_blocks
        if num_cached_free:
            event("fill: with cached free blocks")

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def exhaust(self, data):
        """An append one block larger than the free pool raises PoolExhausted and changes nothing."""
        t = self.pick(data)
        batch = t.batch or data.draw(st.integers(1, 3), label="batch")
        tables = t.cache.block_tables
        num_table_blocks = len(tables[0]) if tables else 0
        q_len = (num_table_blocks + self.pool.num_free_blocks + 1) * self.block_size - t.seq_len
        assert not self.append(t, self.draw_new_rows(data, t, batch, q_len)), "an append larger than the pool succeeded"

    @precondition(lambda self: any(0 < t.batch <= MAX_ROWS // 2 for t in self.tracked))
    @rule(data=st.data())
    def fork(self, data):
        t = data.draw(st.sampled_from([t for t in self.tracked if 0 < t.batch <= MAX_ROWS // 2]), label="cache")
        repeats = data.draw(st.integers(1, MAX_ROWS // t.batch), label="repeats")
        before = self.snapshot()
        t.cache.batch_repeat_interleave(repeats)
        t.rows = [list(row) for row in t.rows for _ in range(repeats)]
        self.check_only_freed(before)

    @precondition(lambda self: any(t.rows for t in self.tracked))
    @rule(data=st.data())
    def reorder(self, data):
        t = self.pick(data, with_rows=True)
        indices = data.draw(st.lists(st.integers(0, t.batch - 1), min_size=t.batch, max_size=t.batch), label="beam_idx")
        before = self.snapshot()
        t.cache.reorder_cache(torch.tensor(indices))
        t.rows = [list(t.rows[i]) for i in indices]
        t.reordered = True
        self.check_only_freed(before)

    @precondition(lambda self: any(t.rows for t in self.tracked))
    @rule(data=st.data())
    def select(self, data):
        t = self.pick(data, with_rows=True)
        indices = data.draw(st.lists(st.integers(0, t.batch - 1), min_size=1, max_size=t.batch), label="indices")
        before = self.snapshot()
        t.cache.batch_select_indices(torch.tensor(indices))
        t.rows = [list(t.rows[i]) for i in indices]
        self.check_only_freed(before)

    @precondition(lambda self: any(t.seq_len > 0 for t in self.tracked))
    @rule(data=st.data())
    def crop(self, data):
        """Crop (into a cached block too: its next write must not leave its hash behind)."""
        t = data.draw(st.sampled_from([t for t in self.tracked if t.seq_len > 0]), label="cache")
        num_removed = data.draw(st.integers(1, t.seq_len), label="num_removed")
        before = self.snapshot()
        t.cache.crop(-num_removed)
        t.rows = [row[: t.seq_len - num_removed] for row in t.rows]
        self.check_only_freed(before)

    def holds_cached_block(self, t: Tracked) -> bool:
        return any(self.pool.allocator.is_cached(b) for table in t.cache.block_tables for b in table)

    @precondition(lambda self: any(self.holds_cached_block(t) for t in self.tracked))
    @rule(data=st.data())
    def rewrite_cached_block(self, data):
        candidates = [t for t in self.tracked if self.holds_cached_block(t)]
        self.rewrite(data.draw(st.sampled_from(candidates), label="cache"), data)

    def rewrite(self, t: Tracked, data) -> None:
        """Crop back into a held cached block and append: written in place (sole holders) it must lose its hash;
        shared with others, it is copied and keeps it."""
        block_size = self.block_size
        cached_indices = [index for index, b in enumerate(t.cache.block_tables[0]) if self.pool.allocator.is_cached(b)]
        index = data.draw(st.sampled_from(cached_indices), label="block index")
        # A crop may have cut into the block already (crop alone does not forget its hash).
        keep = data.draw(st.integers(index * block_size, min((index + 1) * block_size - 1, t.seq_len)), label="keep")
        before = self.snapshot()
        t.cache.crop(keep - t.seq_len)
        t.rows = [row[:keep] for row in t.rows]
        self.check_only_freed(before)
        q_len = data.draw(st.integers(1, 2 * block_size), label="q_len")
        cached_before = self.pool.allocator.num_cached_blocks
        if self.append(t, self.draw_new_rows(data, t, t.batch, q_len)):
            event("rewrite: ok" + (", forgot a hash" if self.pool.allocator.num_cached_blocks < cached_before else ""))
        event("rewrite: tried")

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def release(self, data):
        self.release_tracked(self.pick(data), data)

    # ------------------------------------------------------------- invariants
    @invariant()
    def pool_bookkeeping(self):
        check_holders(self.pool, self.tracked, NUM_BLOCKS)
        allocator = self.pool.allocator
        free = set(allocator.free_queue())
        assert allocator.num_cached_blocks == len(allocator._block_of_hash) == len(allocator._hash_of_block)
        for block_hash, block_id in allocator._block_of_hash.items():
            assert allocator._hash_of_block[block_id] == block_hash, f"block {block_id}: hash maps disagree"
            assert allocator.is_cached(block_id)
            assert (allocator.ref_count(block_id) > 0) != (block_id in free), f"cached block {block_id}: held and free"

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        block_size = self.block_size
        for block_hash, block_id in self.pool.allocator._block_of_hash.items():
            tokens = self.tokens_of_hash.get(block_hash)
            assert tokens is not None, f"block {block_id} is cached under a hash of no released prefix"
            want_keys, want_values = token_kv(tokens)
            for layer_idx in range(NUM_LAYERS):
                keys, values = read_blocks(self.pool, layer_idx, [block_id])
                assert torch.equal(keys, want_keys[layer_idx][:, -block_size:]), f"cached block {block_id}: keys"
                assert torch.equal(values, want_values[layer_idx][:, -block_size:]), f"cached block {block_id}: values"

    @invariant()
    def caches_hold_their_tokens(self):
        block_size = self.block_size
        for index, t in enumerate(self.tracked):
            tables = t.cache.block_tables
            assert len(tables) == t.batch, f"cache {index}: {len(tables)} rows, the test {t.batch}"
            for layer_idx in range(NUM_LAYERS):
                assert t.cache.get_seq_length(layer_idx) == t.seq_len, f"cache {index} layer {layer_idx} length"
            for row, table in zip(t.rows, tables):
                assert len(table) == len(tables[0]) >= -(-t.seq_len // block_size), f"cache {index}: tables {tables}"
                if not row:
                    continue
                want_keys, want_values = token_kv(row)
                for layer_idx in range(NUM_LAYERS):
                    keys, values = read_blocks(self.pool, layer_idx, table)
                    where = f"cache {index} row {row} layer {layer_idx}"
                    assert torch.equal(keys[:, : t.seq_len], want_keys[layer_idx]), f"{where}: keys"
                    assert torch.equal(values[:, : t.seq_len], want_values[layer_idx]), f"{where}: values"

    def teardown(self):
        release_all(self.pool, self.tracked)


PrefixCacheMachine.TestCase.settings = machine_settings(max_examples=200)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
