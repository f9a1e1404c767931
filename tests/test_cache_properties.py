"""Random operation sequences on several `PagedCache`s sharing one small `BlockPool`, checked against a shadow model.

The shadow holds, per cache and layer, the contiguous `[B, H, S, D]` K/V that a `DynamicCache` would hold after the
same operations (cat on append, repeat_interleave on fork, index on reorder/select, slice on crop). After every step
the paged caches must hold exactly the shadow's K/V, and the pool's bookkeeping must add up: every ref_count equals
the number of block-table entries naming that block, summed over all live caches, and no block is held by nobody.

Appends draw rows that are identical (grouped at the first update, or kept in their group after a fork) or that
differ (a group splits, shared blocks are copied on write), sometimes differing only from a later layer on. A pool
of 24 blocks runs out often: a `PoolExhausted` must leave the pool and every cache exactly as they were before the
failing `update()` call, which for an append that runs out in its first layer means before the append.

Sliding-window caches have their own machine in test_sliding_properties.py (which reuses `Tracked` and
`draw_states`), prefix caching in test_prefix_properties.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged import BlockPool, KVLayout, PagedCache, PoolExhausted

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 4
LAYOUT = KVLayout((NUM_KV_HEADS,) * NUM_LAYERS, (HEAD_DIM,) * NUM_LAYERS)
NUM_BLOCKS = 24
MAX_CACHES = 4
MAX_ROWS = 6  # forks stop here, so one cache cannot take the whole pool in one step
MAX_Q_LEN = 6


def check_holders(pool: BlockPool, tracked, num_blocks: int) -> None:
    """The allocator's own invariants; free + used = total; every ref count equals the number of tables (over all
    `tracked` caches) naming the block; and held == named by some table: a block nobody names is a leak, a named
    free block a use-after-free."""
    allocator = pool.allocator
    allocator.check_invariants()
    assert pool.num_free_blocks + pool.num_used_blocks == num_blocks
    holders = Counter(block_id for t in tracked for table in t.cache.block_tables for block_id in table)
    for block_id in range(num_blocks):
        ref_count = allocator.ref_count(block_id)
        assert ref_count == holders[block_id], f"block {block_id}: ref_count {ref_count}, {holders[block_id]} holders"
    assert pool.num_used_blocks == len(holders), "a held block that no table names, or a named free block"


def release_all(pool: BlockPool | None, tracked) -> None:
    """A machine's teardown: release every cache; then nothing may be held and the allocator must be consistent."""
    for t in tracked:
        t.cache.release()
    if pool is not None:
        assert pool.num_used_blocks == 0, pool.stats()
        pool.allocator.check_invariants()


def machine_settings(max_examples: int) -> settings:
    """Hypothesis settings of the state machines: the same examples on every run (derandomized, no example
    database), so CI is stable; raise `max_examples` locally to explore more."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=30,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class Tracked:
    """One cache under test and its shadow: per layer `[B, H, S, D]` K and V, or None before the first append."""

    def __init__(self, cache: PagedCache):
        self.cache = cache
        self.keys: list[torch.Tensor] | None = None
        self.values: list[torch.Tensor] | None = None
        self.just_released = False

    def __repr__(self) -> str:  # hypothesis prints the drawn cache: its shape, not its tensors
        return f"Tracked(rows={self.batch}, seq_len={self.seq_len}, tables={self.cache.block_tables})"

    @property
    def batch(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[0]

    @property
    def seq_len(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def apply(self, fn) -> None:
        """Apply `fn` to every shadow tensor (a row selection or a slice)."""
        self.keys = [fn(k) for k in self.keys]
        self.values = [fn(v) for v in self.values]


def draw_states(data, tracked: Tracked, batch: int, q_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer `[batch, H, q_len, D]` float32 K and V, with a drawn pattern of identical rows.

    - "distinct": every row its own values;
    - "by_history": rows whose cached K/V are identical get identical new K/V (the same next token: a group stays);
    - "pattern": row r copies a drawn earlier row (or is fresh), regardless of history.
    `diverge_layer`: from that layer on, every row is fresh (a group splits in the middle of a step).
    """
    mode = data.draw(st.sampled_from(["distinct", "by_history", "pattern"]), label="rows")
    source = list(range(batch))  # source[r] = the row r copies (itself: fresh)
    if mode == "by_history":
        for row in range(batch):
            for earlier in range(row):
                if tracked.keys is None or all(
                    torch.equal(k[row], k[earlier]) and torch.equal(v[row], v[earlier])
                    for k, v in zip(tracked.keys, tracked.values)
                ):
                    source[row] = earlier
                    break
    elif mode == "pattern":
        source = [data.draw(st.integers(0, row), label=f"source[{row}]") for row in range(batch)]
    diverge_layer = data.draw(st.none() | st.integers(1, NUM_LAYERS - 1), label="diverge_layer")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    generator = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for layer_idx in range(NUM_LAYERS):
        k = torch.randn(batch, NUM_KV_HEADS, q_len, HEAD_DIM, generator=generator)
        v = torch.randn(batch, NUM_KV_HEADS, q_len, HEAD_DIM, generator=generator)
        if diverge_layer is None or layer_idx < diverge_layer:
            for row in range(batch):
                k[row], v[row] = k[source[row]], v[source[row]]
        keys.append(k)
        values.append(v)
    return keys, values


class PagedCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool: BlockPool | None = None
        self.tracked: list[Tracked] = []

    @initialize(block_size=st.sampled_from([2, 4]), share_rows=st.booleans())
    def make_pool(self, block_size, share_rows):
        self.pool = BlockPool(LAYOUT, num_blocks=NUM_BLOCKS, block_size=block_size)
        # Start with one cache, so that most rules are enabled from the first step.
        self.tracked.append(Tracked(PagedCache(pool=self.pool, share_rows=share_rows)))

    # ---------------------------------------------------------------- helpers
    def pick(self, data, with_rows: bool = False) -> Tracked:
        candidates = [t for t in self.tracked if t.keys is not None] if with_rows else self.tracked
        return data.draw(st.sampled_from(candidates), label="cache")

    def snapshot(self) -> list:
        """What a failed operation must leave unchanged: the free count, and per cache its block tables, layer
        lengths and visible K/V. (Not its row groups: a failed append may rightly learn that two rows differ.)"""
        state = [self.pool.num_free_blocks]
        for t in self.tracked:
            cache = t.cache
            lengths = [cache.get_seq_length(i) for i in range(NUM_LAYERS)]
            gathered = [cache._update.visible.gather(i, 0, n) if n > 0 else None for i, n in enumerate(lengths)]
            state.append((cache.block_tables, lengths, gathered))
        return state

    def assert_unchanged(self, before: list) -> None:
        after = self.snapshot()
        assert after[0] == before[0], f"free blocks {before[0]} -> {after[0]} across a failed operation"
        for index, (old, new) in enumerate(zip(before[1:], after[1:])):
            assert new[0] == old[0], f"cache {index}: block tables {old[0]} -> {new[0]} across a failed operation"
            assert new[1] == old[1], f"cache {index}: layer lengths {old[1]} -> {new[1]} across a failed operation"
            for layer_idx, (a, b) in enumerate(zip(old[2], new[2])):
                if a is not None:
                    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"cache {index} layer {layer_idx}"

    def append(self, t: Tracked, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """`update()` every layer of `t` in order, and the shadow with it. Returns whether the step went through.

        A `PoolExhausted` must leave the pool and every cache exactly as they were before the failing `update()`
        call. When that call is the first layer's, that is the state before the step. A later layer can run out too
        (its rows turn out to differ, so shared blocks need copies); the earlier layers then hold the step's tokens,
        as a DynamicCache's would when a forward fails halfway, and the cache is only good for `release()`, which is
        what generate()'s `with` block does with it.
        """
        num_groups = len(set(t.cache._blocks.leaders))
        for layer_idx in range(NUM_LAYERS):
            before = self.snapshot()
            try:
                got_k, got_v = t.cache.update(keys[layer_idx], values[layer_idx], layer_idx)
            except PoolExhausted as error:
                assert error.num_needed > error.num_free and error.num_total == NUM_BLOCKS, str(error)
                self.assert_unchanged(before)
                if layer_idx > 0:
                    event("append: PoolExhausted in a later layer")
                    self.release_tracked(t)
                else:
                    event("append: PoolExhausted")
                return False
            # update() returns what a DynamicLayer would: everything cached so far, the new tokens included.
            want_k = keys[layer_idx] if t.keys is None else torch.cat([t.keys[layer_idx], keys[layer_idx]], dim=2)
            want_v = values[layer_idx] if t.keys is None else torch.cat([t.values[layer_idx], values[layer_idx]], dim=2)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"update() of layer {layer_idx}"
        event("append: ok, rows shared" if t.cache._blocks.has_groups() else "append: ok")
        if t.keys is not None and len(set(t.cache._blocks.leaders)) > num_groups:
            event("append: ok, a group split")
        if t.keys is None:
            t.keys, t.values = list(keys), list(values)
        else:
            t.keys = [torch.cat([a, b], dim=2) for a, b in zip(t.keys, keys)]
            t.values = [torch.cat([a, b], dim=2) for a, b in zip(t.values, values)]
        t.just_released = False
        return True

    def release_tracked(self, t: Tracked) -> None:
        t.cache.release()
        t.keys = t.values = None  # an empty cache: the next append may pick a new batch size
        t.just_released = True

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
        self.append(t, *draw_states(data, t, batch, q_len))

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def exhaust(self, data):
        """An append one block larger than the free pool raises PoolExhausted and changes nothing."""
        t = self.pick(data)
        batch = t.batch or data.draw(st.integers(1, 3), label="batch")
        block_size = self.pool.block_size
        tables = t.cache.block_tables
        num_table_blocks = len(tables[0]) if tables else 0
        # Even a single group of rows needs one block more than the pool has free.
        q_len = (num_table_blocks + self.pool.num_free_blocks + 1) * block_size - t.seq_len
        assert not self.append(t, *draw_states(data, t, batch, q_len)), "an append larger than the pool succeeded"

    @precondition(lambda self: any(0 < t.batch <= MAX_ROWS // 2 for t in self.tracked))
    @rule(data=st.data())
    def fork(self, data):
        t = data.draw(st.sampled_from([t for t in self.tracked if 0 < t.batch <= MAX_ROWS // 2]), label="cache")
        repeats = data.draw(st.integers(1, MAX_ROWS // t.batch), label="repeats")
        t.cache.batch_repeat_interleave(repeats)
        t.apply(lambda x: x.repeat_interleave(repeats, dim=0))

    @precondition(lambda self: any(t.keys is not None for t in self.tracked))
    @rule(data=st.data())
    def reorder(self, data):
        t = self.pick(data, with_rows=True)
        indices = data.draw(st.lists(st.integers(0, t.batch - 1), min_size=t.batch, max_size=t.batch), label="beam_idx")
        t.cache.reorder_cache(torch.tensor(indices))
        t.apply(lambda x: x[indices])

    @precondition(lambda self: any(t.keys is not None for t in self.tracked))
    @rule(data=st.data())
    def select(self, data):
        t = self.pick(data, with_rows=True)
        indices = data.draw(st.lists(st.integers(0, t.batch - 1), min_size=1, max_size=t.batch), label="indices")
        t.cache.batch_select_indices(torch.tensor(indices))
        t.apply(lambda x: x[indices])

    @precondition(lambda self: any(t.seq_len > 0 for t in self.tracked))
    @rule(data=st.data())
    def crop(self, data):
        t = data.draw(st.sampled_from([t for t in self.tracked if t.seq_len > 0]), label="cache")
        num_removed = data.draw(st.integers(1, t.seq_len), label="num_removed")
        t.cache.crop(-num_removed)
        keep = t.seq_len - num_removed
        t.apply(lambda x: x[:, :, :keep])

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def release(self, data):
        self.release_tracked(self.pick(data))

    # ------------------------------------------------------------- invariants
    @invariant()
    def contents_match_the_shadow(self):
        for index, t in enumerate(self.tracked):
            cache = t.cache
            num_rows = len(cache.block_tables)
            assert num_rows == t.batch, f"cache {index}: {num_rows} rows, the shadow {t.batch}"
            for layer_idx in range(NUM_LAYERS):
                assert cache.get_seq_length(layer_idx) == t.seq_len, f"cache {index} layer {layer_idx} length"
                if t.seq_len == 0:
                    continue
                keys, values = cache._update.visible.gather(layer_idx, 0, t.seq_len)
                assert torch.equal(keys, t.keys[layer_idx]), f"cache {index} layer {layer_idx}: keys differ"
                assert torch.equal(values, t.values[layer_idx]), f"cache {index} layer {layer_idx}: values differ"

    @invariant()
    def ref_counts_match_the_tables(self):
        check_holders(self.pool, self.tracked, NUM_BLOCKS)

    @invariant()
    def tables_are_rectangular_and_groups_share_tables(self):
        """All rows of a cache have as many blocks as their length needs (or more); a group's rows hold one table."""
        for index, t in enumerate(self.tracked):
            tables = t.cache.block_tables
            leaders = t.cache._blocks.leaders
            assert len({len(table) for table in tables}) <= 1, f"cache {index}: ragged tables {tables}"
            if tables:
                assert len(tables[0]) >= -(-t.seq_len // self.pool.block_size), f"cache {index}: too few blocks"
            for row, leader in enumerate(leaders):
                assert tables[row] == tables[leader], f"cache {index}: row {row} and its leader {leader} differ"

    @invariant()
    def released_caches_hold_nothing(self):
        for t in self.tracked:
            if t.just_released:
                assert t.cache.num_held_blocks == 0 and t.cache.block_tables == []
                assert t.cache.get_seq_length() == 0

    def teardown(self):
        release_all(self.pool, self.tracked)


PagedCacheMachine.TestCase.settings = machine_settings(max_examples=100)
test_paged_cache_state_machine = PagedCacheMachine.TestCase


# ------------------------------------------------------------------------------------------------ regressions
# Minimal cases of what the state machine found: a PoolExhausted must change nothing, and must not be raised while
# enough blocks are free.
def _update(cache: PagedCache, keys: torch.Tensor) -> None:
    """`keys` ([B, H, q_len, D]) as both K and V of every layer."""
    for layer_idx in range(NUM_LAYERS):
        cache.update(keys, keys, layer_idx)


def _forked_pair(num_blocks: int) -> tuple[BlockPool, PagedCache]:
    """A pool of `num_blocks` blocks of 4 and a cache of 2 rows forked from one: 6 tokens, blocks [0, 1] shared,
    block 1 half full."""
    pool = BlockPool(LAYOUT, num_blocks=num_blocks, block_size=4)
    cache = PagedCache(pool=pool)
    _update(cache, torch.randn(1, NUM_KV_HEADS, 6, HEAD_DIM))
    cache.batch_repeat_interleave(2)
    assert cache.block_tables == [[0, 1], [0, 1]]
    return pool, cache


def test_exhausted_first_append_leaves_the_cache_empty():
    """A first append that runs out must not fix the cache's batch size: a retry with fewer rows works."""
    pool = BlockPool(LAYOUT, num_blocks=4, block_size=4)
    cache = PagedCache(pool=pool)
    with pytest.raises(PoolExhausted, match="need 10 blocks, 4 free of 4"):
        _update(cache, torch.randn(2, NUM_KV_HEADS, 20, HEAD_DIM))
    assert cache.block_tables == [] and cache.get_seq_length() == 0
    keys = torch.randn(1, NUM_KV_HEADS, 3, HEAD_DIM)
    _update(cache, keys)
    assert torch.equal(cache._update.visible.gather(0, 0, 3)[0], keys)
    cache.release()
    assert pool.num_used_blocks == 0


def test_exhausted_copy_on_write_returns_the_blocks_taken_for_new_tokens():
    """Two forked rows diverge across a block boundary: 2 new blocks and 1 copy of the shared half-full block are
    needed, 2 are free. The failed update must give back the 2 it took before finding out."""
    pool, cache = _forked_pair(num_blocks=4)
    with pytest.raises(PoolExhausted):
        _update(cache, torch.randn(2, NUM_KV_HEADS, 6, HEAD_DIM))
    assert pool.num_free_blocks == 2 and cache.block_tables == [[0, 1], [0, 1]]
    assert cache.get_seq_length() == 6


def test_diverging_rows_need_one_copy_of_their_shared_block_not_two():
    """The same step with 3 free blocks fits exactly: 2 new blocks, and 1 copy (the second row keeps the
    original once the first has its copy). It must not raise."""
    pool, cache = _forked_pair(num_blocks=5)
    new = torch.randn(2, NUM_KV_HEADS, 6, HEAD_DIM)
    _update(cache, new)
    assert pool.num_free_blocks == 0
    assert torch.equal(cache._update.visible.gather(0, 0, 12)[0][:, :, 6:], new)
    cache.release()
    assert pool.num_used_blocks == 0
