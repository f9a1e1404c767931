"""Random operation sequences on `PagedCache`s of an all-sliding-window (Mistral-style) config, driven past their
window and checked against `DynamicCache`.

Every `update()` must return what a `DynamicCache` returns for the same inputs (and the window of a shadow of every
token ever written); blocks wholly before the window must go back to the pool at the start of the next step (so a
decode step holds at most ceil(window / block_size) + 1 blocks per row); a crop inside the still-held blocks must work
and one that needs released positions must raise the documented error and change nothing. Rows, K/V draws and the
shadow come from test_cache_properties.py, whose machine covers full-attention caches.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import DynamicCache, MistralConfig

from hf_paged import BlockPool, PagedCache, PoolExhausted
from tests.prefix_kv import read_blocks
from tests.test_cache_properties import (
    HEAD_DIM,
    MAX_ROWS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    Tracked,
    check_holders,
    draw_states,
    machine_settings,
    release_all,
)

SLIDING_NUM_BLOCKS = 24


def sliding_config(window: int) -> MistralConfig:
    """A Mistral config (every layer slides by `window`) with the K/V shapes of test_cache_properties.LAYOUT. Only
    the config: no model."""
    return MistralConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_KV_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=window,
    )


class SlidingTracked(Tracked):
    """A sliding-window cache, the `DynamicCache` it must match, and the shadow of every token written (`keys` /
    `values`: per layer `[B, H, S, D]`, nothing dropped, so crops can be checked against it)."""

    def __init__(self, cache: PagedCache, config):
        super().__init__(cache)
        self.config = config
        self.recording = False  # activate_past_recording() was called: no release at the start of a step
        self.dynamic = self.new_dynamic()

    def new_dynamic(self) -> DynamicCache:
        dynamic = DynamicCache(config=self.config)
        if self.recording:
            dynamic.activate_past_recording()
        return dynamic

    def resync_dynamic(self) -> None:
        """A DynamicCache in the state the shadow describes (after a crop DynamicCache refuses, or a batch change
        of an empty cache, which DynamicCache ignores): fed every token at once, it keeps what it would have kept."""
        self.dynamic = self.new_dynamic()
        if self.seq_len > 0:
            for layer_idx in range(NUM_LAYERS):
                self.dynamic.update(self.keys[layer_idx], self.values[layer_idx], layer_idx)


class SlidingWindowMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool: BlockPool | None = None
        self.config = None
        self.window = 0
        self.share_rows = True
        self.tracked: list[SlidingTracked] = []

    @initialize(window=st.sampled_from([3, 5, 8]), block_size=st.sampled_from([2, 4]), share_rows=st.booleans())
    def make_pool(self, window, block_size, share_rows):
        self.config, self.window, self.share_rows = sliding_config(window), window, share_rows
        self.pool = BlockPool.for_model(self.config, num_blocks=SLIDING_NUM_BLOCKS, block_size=block_size)
        self.create()

    # ---------------------------------------------------------------- helpers
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def first_visible(self, num_past: int) -> int:
        """The first position an update after `num_past` tokens returns (DynamicSlidingWindowLayer keeps the last
        window - 1 tokens)."""
        return max(num_past - self.window + 1, 0)

    def released(self, t: SlidingTracked) -> int:
        """Positions before this one were given back: the tables end at the last token, so they start here."""
        tables = t.cache.block_tables
        if not tables:
            return 0
        return (-(-t.seq_len // self.block_size) - len(tables[0])) * self.block_size

    def snapshot(self, t: SlidingTracked) -> tuple:
        return self.pool.num_free_blocks, t.cache.block_tables, [t.cache.get_seq_length(i) for i in range(NUM_LAYERS)]

    def append(self, t: SlidingTracked, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """`update()` every layer of `t` with what its DynamicCache gets; both must return the same K/V (the window of
        the shadow). Returns whether the step went through."""
        num_past, q_len = t.seq_len, keys[0].shape[2]
        released_before = self.released(t)
        first = self.first_visible(num_past)
        for layer_idx in range(NUM_LAYERS):
            assert t.cache.get_mask_sizes(q_len, layer_idx) == t.dynamic.get_mask_sizes(q_len, layer_idx)
            before = self.snapshot(t)
            try:
                got_k, got_v = t.cache.update(keys[layer_idx], values[layer_idx], layer_idx)
            except PoolExhausted:
                self.check_failed_update(t, layer_idx, before, released_before, first)
                if layer_idx > 0:  # earlier layers hold the step's tokens: only good for release(), as in append()
                    event("sliding append: PoolExhausted in a later layer")
                    self.release_tracked(t)
                else:
                    event("sliding append: PoolExhausted")
                return False
            want_k, want_v = t.dynamic.update(keys[layer_idx], values[layer_idx], layer_idx)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"layer {layer_idx}: not DynamicCache's"
            if t.keys is not None:  # which is the window of everything written, the new tokens included
                window_k = torch.cat([t.keys[layer_idx][:, :, first:], keys[layer_idx]], dim=2)
                window_v = torch.cat([t.values[layer_idx][:, :, first:], values[layer_idx]], dim=2)
                assert torch.equal(got_k, window_k) and torch.equal(got_v, window_v), f"layer {layer_idx}: window"
        if t.keys is None:
            t.keys, t.values = list(keys), list(values)
        else:
            t.keys = [torch.cat([a, b], dim=2) for a, b in zip(t.keys, keys)]
            t.values = [torch.cat([a, b], dim=2) for a, b in zip(t.values, values)]
        released = self.released(t)
        if not t.recording:
            # Every block wholly before the window of this step was given back at its start...
            assert released >= first // self.block_size * self.block_size, (
                f"positions [{released}, {first}) left the window at the start of this step, their blocks are held"
            )
            # ...so a row holds the window's blocks plus at most one partial block at each end.
            bound = -(-(self.window - 1 + q_len + self.block_size - 1) // self.block_size)
            assert len(t.cache.block_tables[0]) <= bound, f"{t.cache.block_tables[0]} for window {self.window}"
        if released > released_before:
            event("sliding append: released blocks before the window")
        return True

    def check_failed_update(self, t, layer_idx, before, released_before: int, first: int) -> None:
        """A PoolExhausted changes nothing but (at the start of a step) the release of blocks before the window,
        which the step was due to do anyway."""
        free, tables, lengths = self.snapshot(t)
        assert lengths == before[2], f"layer lengths {before[2]} -> {lengths} across a failed update"
        if layer_idx > 0:
            assert (free, tables) == before[:2], "a later layer's failed update changed the pool or the tables"
            return
        num_released = (self.released(t) - released_before) // self.block_size
        assert num_released >= 0 and tables == [table[num_released:] for table in before[1]], (
            f"block tables {before[1]} -> {tables} across a failed update"
        )
        assert self.released(t) <= max(released_before, first // self.block_size * self.block_size), (
            f"a failed update released positions before {self.released(t)}, the window starts at {first}"
        )
        num_freed = free - before[0]
        assert 0 <= num_freed <= num_released * len(tables), "a failed update took or freed blocks"

    def release_tracked(self, t: SlidingTracked) -> None:
        t.cache.release()
        t.keys = t.values = None
        t.dynamic = t.new_dynamic()
        assert t.cache.num_held_blocks == 0 and t.cache.block_tables == []

    def draw_step(self, data, t: SlidingTracked, q_len: int):
        batch = t.batch or data.draw(st.integers(1, 3), label="batch")
        return draw_states(data, t, batch, q_len)

    def apply_rows(self, t: SlidingTracked, indices: list[int], op) -> None:
        """A batch operation on the cache, its DynamicCache and the shadow."""
        op(t.cache)
        t.apply(lambda x: x[indices])
        if t.seq_len > 0:
            op(t.dynamic)
        else:
            t.resync_dynamic()

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.tracked) < 2)
    @rule()
    def create(self):
        cache = PagedCache(config=self.config, pool=self.pool, share_rows=self.share_rows)
        self.tracked.append(SlidingTracked(cache, self.config))

    @rule(data=st.data())
    def append_tokens(self, data):
        t = data.draw(st.sampled_from(self.tracked), label="cache")
        q_len = data.draw(st.integers(1, 12), label="q_len")
        self.append(t, *self.draw_step(data, t, q_len))

    @rule(data=st.data())
    def decode(self, data):
        """A run of one-token steps, as generate() does after the prompt: it slides the window block by block."""
        t = data.draw(st.sampled_from(self.tracked), label="cache")
        for _ in range(data.draw(st.integers(1, 12), label="num_steps")):
            if not self.append(t, *self.draw_step(data, t, 1)):
                break

    @rule(data=st.data())
    def exhaust(self, data):
        """An append larger than the free pool plus every block the cache could release first."""
        t = data.draw(st.sampled_from(self.tracked), label="cache")
        num_blocks = -(-t.seq_len // self.block_size) + self.pool.num_free_blocks + t.cache.num_held_blocks + 1
        assert not self.append(t, *self.draw_step(data, t, num_blocks * self.block_size - t.seq_len))

    @precondition(lambda self: any(not t.recording for t in self.tracked))
    @rule(data=st.data())
    def record_past(self, data):
        """activate_past_recording(), as assisted decoding does: no more release at the start of a step."""
        t = data.draw(st.sampled_from([t for t in self.tracked if not t.recording]), label="cache")
        t.recording = True
        t.cache.activate_past_recording()
        t.dynamic.activate_past_recording()

    @precondition(lambda self: any(0 < t.batch <= MAX_ROWS // 2 for t in self.tracked))
    @rule(data=st.data())
    def fork(self, data):
        t = data.draw(st.sampled_from([t for t in self.tracked if 0 < t.batch <= MAX_ROWS // 2]), label="cache")
        repeats = data.draw(st.integers(1, MAX_ROWS // t.batch), label="repeats")
        indices = [row for row in range(t.batch) for _ in range(repeats)]
        self.apply_rows(t, indices, lambda cache: cache.batch_repeat_interleave(repeats))

    @precondition(lambda self: any(t.keys is not None for t in self.tracked))
    @rule(data=st.data())
    def reorder(self, data):
        t = data.draw(st.sampled_from([t for t in self.tracked if t.keys is not None]), label="cache")
        indices = data.draw(st.lists(st.integers(0, t.batch - 1), min_size=t.batch, max_size=t.batch), label="beam_idx")
        self.apply_rows(t, indices, lambda cache: cache.reorder_cache(torch.tensor(indices)))

    @precondition(lambda self: any(t.keys is not None for t in self.tracked))
    @rule(data=st.data())
    def select(self, data):
        t = data.draw(st.sampled_from([t for t in self.tracked if t.keys is not None]), label="cache")
        indices = data.draw(st.lists(st.integers(0, t.batch - 1), min_size=1, max_size=t.batch), label="indices")
        self.apply_rows(t, indices, lambda cache: cache.batch_select_indices(torch.tensor(indices)))

    @precondition(lambda self: any(t.keys is not None for t in self.tracked))
    @rule(data=st.data())
    def crop(self, data):
        """A crop whose new window starts at or after the released positions works; one that needs a released
        position raises the documented error and changes nothing."""
        t = data.draw(st.sampled_from([t for t in self.tracked if t.keys is not None]), label="cache")
        num_removed = data.draw(st.integers(0, t.seq_len), label="num_removed")
        keep = t.seq_len - num_removed
        needed, released = self.first_visible(keep), self.released(t)
        if needed < released:
            before = self.snapshot(t)
            message = f"needs keys from position {needed}, but the sliding window already released positions before"
            with pytest.raises(RuntimeError, match=re.escape(f"{message} {released}")):
                t.cache.crop(-num_removed)
            assert self.snapshot(t) == before, "a refused crop changed the cache"
            event("sliding crop: refused, needs released positions")
            return
        t.cache.crop(-num_removed)
        t.apply(lambda x: x[:, :, :keep])
        t.resync_dynamic()  # DynamicCache itself refuses any crop once past the window (unless recording)
        if released > 0:
            event("sliding crop: after a release, inside the held blocks")

    @rule(data=st.data())
    def release(self, data):
        self.release_tracked(data.draw(st.sampled_from(self.tracked), label="cache"))

    # ------------------------------------------------------------- invariants
    @invariant()
    def pool_bookkeeping(self):
        # Released blocks are free: a held block that no table names would be a leak.
        check_holders(self.pool, self.tracked, SLIDING_NUM_BLOCKS)

    @invariant()
    def held_blocks_hold_the_shadow(self):
        """The tables end at the last token and start at or before the next update's window, and every held
        position holds what was written there."""
        for index, t in enumerate(self.tracked):
            tables = t.cache.block_tables
            assert len(tables) == t.batch, f"cache {index}: {len(tables)} rows, the shadow {t.batch}"
            for layer_idx in range(NUM_LAYERS):
                assert t.cache.get_seq_length(layer_idx) == t.seq_len, f"cache {index} layer {layer_idx} length"
            if not tables:
                continue
            assert len({len(table) for table in tables}) == 1, f"cache {index}: ragged tables {tables}"
            released = self.released(t)
            assert 0 <= released <= self.first_visible(t.seq_len), (
                f"cache {index}: positions before {released} released, the next update returns from "
                f"{self.first_visible(t.seq_len)}"
            )
            for layer_idx in range(NUM_LAYERS):
                for row, table in enumerate(tables):
                    keys, values = read_blocks(self.pool, layer_idx, table)
                    want_keys = t.keys[layer_idx][row, :, released:]
                    want_values = t.values[layer_idx][row, :, released:]
                    num_held = t.seq_len - released
                    assert torch.equal(keys[:, :num_held], want_keys), f"cache {index} row {row} keys"
                    assert torch.equal(values[:, :num_held], want_values), f"cache {index} row {row} values"

    def teardown(self):
        release_all(self.pool, self.tracked)


SlidingWindowMachine.TestCase.settings = machine_settings(max_examples=100)
test_sliding_window_state_machine = SlidingWindowMachine.TestCase
