"""Layer groups: a model that mixes sliding and full attention (Gemma2/3) gets one block table per group, and its
sliding groups give back the blocks that left the window, so a long generation holds about what DynamicCache holds.

Group derivation is asserted exactly; generations are compared token for token with DynamicCache, and the blocks a
sliding group holds are asserted step by step against the window arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM

from bench.cache_report import dynamic_cache_bytes
from hf_paged import PAGED_ATTENTION, BlockPool, KVLayout, PagedCache, PoolExhausted
from hf_paged.storage import derive_layer_groups
from tests.models import (
    SLIDING_WINDOW,
    gemma3_config,
    left_padded_batch,
    random_prompt,
    require_triton_on_cpu,
    tiny_model,
)

S, F = "sliding_attention", "full_attention"
BLOCK_SIZE = 4


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def _sliding_blocks_per_row(num_tokens: int) -> int:
    """Blocks a sliding group holds per row after a decode step that ends at `num_tokens`: the release at the start of
    the step keeps position `num_tokens - 1 - SLIDING_WINDOW + 1` on (the first key the step's update returns)."""
    return _blocks(num_tokens) - max(num_tokens - SLIDING_WINDOW, 0) // BLOCK_SIZE


def gemma3_with_pattern(layer_types: list[str], attn_implementation: str = "sdpa") -> Gemma3ForCausalLM:
    """A tiny random Gemma3 with the given layer types (same settings as tests/models.py's gemma3)."""
    config = gemma3_config(layer_types)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


def _generate(model, cache, input_ids, **kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    return model.generate(input_ids, past_key_values=cache, **{"do_sample": False, **kwargs})


def assert_pool_clean(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_blocks, pool.stats()
    pool.allocator.check_invariants()


# ------------------------------------------------------------------------------------------------ derivation
def test_uniform_models_have_one_group_of_every_layer():
    for name in ("llama", "mistral"):
        pool = BlockPool.for_model(tiny_model(name), num_blocks=4)
        assert pool.layer_groups == ((0, 1),) and pool.num_groups == 1 and pool.num_slots == 2
        assert pool.key_cache[0] is not pool.key_cache[1]  # one group: every layer its own tensor, as before
        assert pool.bytes_per_block == pool.layout.bytes_per_block(pool.block_size, pool.dtype)
    mistral = tiny_model("mistral").config
    assert PagedCache(config=mistral)._rows.sliding_groups == (0,)  # the one group slides: release as before
    assert PagedCache(config=tiny_model("llama").config)._rows.sliding_groups == ()


def test_gemma3_alternating_layers_get_a_sliding_and_a_full_group():
    model = tiny_model("gemma3")  # layers: sliding, full
    pool = BlockPool.for_model(model, num_blocks=4)
    assert pool.layer_groups == ((0,), (1,)) and pool.num_groups == 2 and pool.num_slots == 1
    assert pool.key_cache[0] is pool.key_cache[1]  # slot 0 of both groups: one tensor
    assert pool.bytes_per_block == pool.layout.bytes_per_block(pool.block_size, pool.dtype) // 2
    assert PagedCache(config=model.config, pool=pool)._rows.sliding_groups == (0,)
    four = KVLayout((2,) * 4, (16,) * 4, (S, F, S, F))
    assert four.layer_groups() == ((0, 2), (1, 3))
    # The same byte budget buys L/m = 2x the blocks, each half the size.
    budget = 64 * pool.layout.bytes_per_block(16, torch.float32)
    assert BlockPool.for_model(model, max_memory=budget).num_blocks == 128
    assert BlockPool.for_model(model, max_memory=budget, group_layers=False).num_blocks == 64


@pytest.mark.parametrize(
    "layer_types, groups",
    [
        ([S] * 5 + [F], ((0,), (1,), (2,), (3,), (4,), (5,))),  # m = 1 full layer
        ([S] * 5 + [F] + [S] * 5 + [F], ((0, 1), (2, 3), (4, 6), (5, 11), (7, 8), (9, 10))),  # m = 2
        ([S, S, S, F, F], ((0, 1), (2,), (3, 4))),  # the last sliding group is padded: slot 1 has no layer
        ([S, "chunked_attention", S, "chunked_attention"], ((0, 2), (1, 3))),
    ],
)
def test_uneven_patterns_group_by_the_rarest_type(layer_types, groups):
    layout = KVLayout((2,) * len(layer_types), (16,) * len(layer_types), tuple(layer_types))
    assert layout.layer_groups() == groups
    pool = BlockPool(layout, num_blocks=3)
    m = max(map(len, groups))
    assert pool.num_slots == m and len({id(t) for t in pool.key_cache}) == m
    for group in groups:
        for slot, layer_idx in enumerate(group):
            assert pool.key_cache[layer_idx] is pool.key_cache[groups[0][slot]]


def test_layers_of_different_shapes_at_one_slot_fall_back_to_one_group():
    layout = KVLayout((2, 4), (16, 16), (S, F))
    assert layout.layer_groups() == ((0, 1),)
    assert derive_layer_groups([S, F, S, F], [(2, 16), (2, 16), (2, 8), (2, 8)]) == ((0, 2), (1, 3))  # slots agree
    assert derive_layer_groups([S, F, S, F], [(2, 16), (2, 8), (2, 16), (2, 8)]) == ((0, 1, 2, 3),)


def test_layout_equality_ignores_layer_types_and_group_layers_false_forces_one_group():
    gemma = tiny_model("gemma3").config
    assert KVLayout.from_config(gemma) == KVLayout((2, 2), (16, 16))
    assert KVLayout.from_config(gemma).layer_types == (S, F)
    pool = BlockPool.for_model(gemma, num_blocks=4, group_layers=False)
    assert pool.layer_groups == ((0, 1),)
    cache = PagedCache(config=gemma, pool=pool)
    assert cache._rows.sliding_groups == ()  # one mixed group: keeps every block (today's Gemma behaviour)


# ------------------------------------------------------------------------------------------------ long generation
def test_gemma3_long_generation_holds_about_what_dynamic_cache_holds():
    """200 new tokens, window 8: token-identical; the sliding group's blocks follow the window exactly; the KV held
    at the end is within 10% of DynamicCache's (a one-group pool holds about twice as much)."""
    model = tiny_model("gemma3")
    prompt, num_new = random_prompt(16), 200
    # Greedy output of a random model settles on one token, so compare every step's logits too: they depend on
    # every visible K/V, and are bit-identical when the caches return identical K/V.
    scored = dict(max_new_tokens=num_new, output_scores=True, return_dict_in_generate=True)
    dynamic = DynamicCache(config=model.config)
    reference = _generate(model, dynamic, prompt, **scored)
    expected = reference.sequences

    pool = BlockPool.for_model(model, num_blocks=128, block_size=BLOCK_SIZE)
    cache = PagedCache(config=model.config, pool=pool)
    trace = []  # (seq_len, held blocks per group) after every forward
    handle = model.register_forward_hook(lambda *_: trace.append((cache.get_seq_length(), cache.held_blocks_per_group)))
    try:
        actual = _generate(model, cache, prompt, **scored)
    finally:
        handle.remove()
    assert torch.equal(actual.sequences, expected)
    assert all(torch.equal(paged, dense) for paged, dense in zip(actual.scores, reference.scores, strict=True))

    num_cached = 16 + num_new - 1  # 215: the last token is never fed back
    assert [n for n, _ in trace] == list(range(16, num_cached + 1))
    sliding, full = zip(*(held for _, held in trace))
    assert sliding == (_blocks(16),) + tuple(_sliding_blocks_per_row(n) for n in range(17, num_cached + 1))
    assert max(sliding[1:]) == _blocks(SLIDING_WINDOW) + 1 == 3  # the window's blocks plus one partial block
    assert full == tuple(_blocks(n) for n in range(16, num_cached + 1))
    assert cache.held_blocks_per_group == (3, 54)

    dynamic_bytes = dynamic_cache_bytes(dynamic)  # full layer: 215 tokens; sliding layer: the last 7
    assert dynamic_bytes == (num_cached + SLIDING_WINDOW - 1) * 2 * 2 * 16 * 4 == 56832
    assert cache.held_bytes == (3 + 54) * pool.bytes_per_block == 58368
    assert cache.held_bytes <= 1.1 * dynamic_bytes
    cache.release()
    assert_pool_clean(pool)

    one_group = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE, group_layers=False)
    with PagedCache(config=model.config, pool=one_group) as cache:
        assert torch.equal(_generate(model, cache, prompt, max_new_tokens=num_new), expected)
        assert cache.held_bytes == 54 * one_group.bytes_per_block > 1.9 * dynamic_bytes
    assert_pool_clean(one_group)


@pytest.mark.parametrize("mode", ["beams", "sample_n", "left_padded", "prompt_lookup", "assisted"])
def test_gemma3_release_path_matches_dynamic_cache(mode):
    """Generations long enough (40 new tokens, window 8) that the sliding group releases many blocks while beams
    reorder, rows fork and diverge, padding is masked, and assisted / prompt-lookup decoding crop."""
    model = tiny_model("gemma3")
    prompt = random_prompt(13)
    kwargs = {
        "beams": dict(num_beams=3, num_return_sequences=2),
        "sample_n": dict(do_sample=True, num_return_sequences=3),
        "left_padded": {},
        "prompt_lookup": dict(prompt_lookup_num_tokens=3),
        "assisted": dict(assistant_model=tiny_model("gemma3", num_layers=1, seed=1)),
    }[mode]
    if mode == "left_padded":
        prompt, kwargs["attention_mask"] = left_padded_batch(3, 13)
    if mode == "prompt_lookup":
        prompt = torch.cat([prompt, prompt[:, :6], prompt[:, :6]], dim=1)
    expected = _generate(model, DynamicCache(config=model.config), prompt, max_new_tokens=40, **kwargs)
    pool = BlockPool.for_model(model, num_blocks=160, block_size=BLOCK_SIZE)
    with PagedCache(config=model.config, pool=pool) as cache:
        actual = _generate(model, cache, prompt, max_new_tokens=40, **kwargs)
        assert torch.equal(actual, expected)
        num_rows = len(cache.layer_block_tables(0))
        sliding, full = cache.held_blocks_per_group
        assert sliding <= num_rows * (_blocks(SLIDING_WINDOW) + 1) < full
        assert pool.num_used_blocks == cache.num_held_blocks
    assert_pool_clean(pool)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_attention_reads_each_groups_tables(backend, monkeypatch):
    """The registered attention's decode plan carries the layer's group tables (the sliding group's start at its
    first unreleased block); both backends give sdpa's tokens on a 4-layer Gemma3 (groups (0, 2) and (1, 3))."""
    if backend == "triton":
        require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", backend)
    layer_types = [S, F, S, F]
    prompt, num_new = random_prompt(10), 24 if backend == "triton" else 60  # Triton runs interpreted on CPU
    expected = _generate(gemma3_with_pattern(layer_types), DynamicCache(), prompt, max_new_tokens=num_new)
    model = gemma3_with_pattern(layer_types, PAGED_ATTENTION)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE)
    assert pool.layer_groups == ((0, 2), (1, 3))
    with PagedCache(config=model.config, pool=pool) as cache:
        assert torch.equal(_generate(model, cache, prompt, max_new_tokens=num_new), expected)
        assert cache.held_blocks_per_group == (_sliding_blocks_per_row(9 + num_new), _blocks(9 + num_new))
    assert_pool_clean(pool)


def test_five_sliding_to_one_full_pattern_matches_and_releases_per_group():
    layer_types = [S] * 5 + [F] + [S] * 5 + [F]  # groups of m = 2 layers; one full group
    model = gemma3_with_pattern(layer_types)
    prompt, num_new = random_prompt(12), 30
    expected = _generate(model, DynamicCache(config=model.config), prompt, max_new_tokens=num_new)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE)
    assert pool.num_groups == 6 and pool.num_slots == 2
    with PagedCache(config=model.config, pool=pool) as cache:
        assert torch.equal(_generate(model, cache, prompt, max_new_tokens=num_new), expected)
        num_cached = 12 + num_new - 1
        held = dict(zip(pool.layer_groups, cache.held_blocks_per_group))
        assert held.pop((5, 11)) == _blocks(num_cached)
        assert set(held.values()) == {_sliding_blocks_per_row(num_cached)}
        # 5 sliding groups of 3 blocks + 11 full blocks, each block 2 layers: far below 6 one-group blocks of 12.
        assert cache.held_bytes == (5 * 3 + 11) * pool.bytes_per_block
    assert_pool_clean(pool)


# ------------------------------------------------------------------------------------------------ cache operations
def _kv(batch: int, q_len: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 2, q_len, 16, generator=generator)


def _step(caches, num_layers: int, batch: int, q_len: int, generator: torch.Generator) -> None:
    """The same random K/V into every layer of both caches; the returned K/V must be equal."""
    dynamic, paged = caches
    for layer_idx in range(num_layers):
        assert paged.get_mask_sizes(q_len, layer_idx) == dynamic.get_mask_sizes(q_len, layer_idx)
        keys, values = _kv(batch, q_len, generator), _kv(batch, q_len, generator)
        expected, got = dynamic.update(keys, values, layer_idx), paged.update(keys, values, layer_idx)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), f"layer {layer_idx}"


def test_reorder_repeat_select_and_crop_after_the_window_track_dynamic_cache():
    config = gemma3_with_pattern([S, F, S, F]).config
    generator = torch.Generator().manual_seed(3)
    pool = BlockPool.for_model(config, num_blocks=96, block_size=BLOCK_SIZE)
    caches = (DynamicCache(config=config), PagedCache(config=config, pool=pool))
    for cache in caches:
        cache.activate_past_recording()  # as assisted decoding: nothing released until crop
    _step(caches, 4, 2, 11, generator)
    for _ in range(12):
        _step(caches, 4, 2, 1, generator)
    assert caches[1].held_blocks_per_group == (2 * _blocks(23), 2 * _blocks(23))  # recording: all kept
    for cache in caches:
        cache.crop(-6)  # back past the window edge: allowed, nothing was released
        for layer in cache.layers:
            layer.record_past = False
    # Like DynamicSlidingWindowLayer.crop, the crop dropped what the next step cannot see: keys before 17 - 8 + 1.
    assert caches[1].held_blocks_per_group == (2 * (_blocks(17) - 10 // BLOCK_SIZE), 2 * _blocks(17))
    _step(caches, 4, 2, 1, generator)  # 18 tokens
    assert len(caches[1].layer_block_tables(0)[0]) == _blocks(18) - 2
    for cache in caches:
        cache.batch_repeat_interleave(2)
    _step(caches, 4, 4, 1, generator)  # rows 0 and 1 diverge: they still share the released-into prefix
    sliding_tables = caches[1].layer_block_tables(0)
    assert sliding_tables[0][:-1] == sliding_tables[1][:-1] and sliding_tables[0][-1] != sliding_tables[1][-1]
    for cache in caches:
        cache.reorder_cache(torch.tensor([3, 3, 0, 1]))
    for _ in range(6):
        _step(caches, 4, 4, 1, generator)
    # DynamicCache refuses any crop past a full window without recording; PagedCache refuses what it released.
    with pytest.raises(RuntimeError, match="already released positions before 16"):
        caches[1].crop(-5)  # the sliding group would need position 13 again
    assert caches[1].get_seq_length() == 25  # a refused crop changes nothing
    for cache in caches:
        cache.batch_select_indices(torch.tensor([2, 0]))
    _step(caches, 4, 2, 3, generator)
    assert caches[1].held_blocks_per_group == (2 * (_blocks(28) - 17 // BLOCK_SIZE), 2 * _blocks(28))
    caches[1].release()
    assert caches[1].num_held_blocks == 0
    assert_pool_clean(pool)


def test_a_step_that_runs_out_in_a_later_group_is_undone_in_the_earlier_ones():
    """Sliding group first, full group second: the sliding group stores the step at layer 0, the full group finds too
    few blocks at layer 1. Nothing of the step stays: lengths, blocks held, free blocks; with room, it then runs."""
    config = gemma3_with_pattern([S, F]).config
    generator = torch.Generator().manual_seed(5)
    pool = BlockPool.for_model(config, num_blocks=12, block_size=BLOCK_SIZE)
    dynamic, paged = caches = (DynamicCache(config=config), PagedCache(config=config, pool=pool))
    _step(caches, 2, 2, 6, generator)  # 2 rows of 6 tokens: 2 blocks per row in each group
    assert paged.held_blocks_per_group == (4, 4) and pool.num_free_blocks == 4
    hog = pool.allocator.allocate(1)  # 3 free: 10 tokens need 2 more blocks in each group
    tables = [paged.layer_block_tables(layer_idx) for layer_idx in range(2)]
    with pytest.raises(PoolExhausted, match="need 2 blocks, 1 free of 12"):
        for layer_idx in range(2):
            paged.update(_kv(2, 4, generator), _kv(2, 4, generator), layer_idx)
    assert [layer.cumulative_length for layer in paged.layers] == [6, 6]
    assert [paged.layer_block_tables(layer_idx) for layer_idx in range(2)] == tables
    assert pool.num_free_blocks == 3
    pool.allocator.free(hog)
    _step(caches, 2, 2, 4, generator)  # DynamicCache never saw the failed step: the retried one matches it
    assert paged.held_blocks_per_group == (6, 6)
    paged.release()
    assert_pool_clean(pool)


def test_an_undone_step_after_the_window_released_blocks_with_forked_rows():
    """The same with a sliding group that already gave back blocks (its tables start past position 0) and two rows
    forked from one (shared blocks, then a copy-on-write as they diverge): the undo frees exactly the step's fresh
    blocks, keeps what was shared and released, and the step then runs as DynamicCache's."""
    config = gemma3_with_pattern([S, F]).config
    generator = torch.Generator().manual_seed(7)
    pool = BlockPool.for_model(config, num_blocks=40, block_size=BLOCK_SIZE)
    dynamic, paged = caches = (DynamicCache(config=config), PagedCache(config=config, pool=pool))
    _step(caches, 2, 1, 14, generator)
    for cache in caches:
        cache.batch_repeat_interleave(2)
    _step(caches, 2, 2, 1, generator)  # 15 tokens; the rows diverge (one copies the shared last block)
    sliding, full = paged.layer_block_tables(0), paged.layer_block_tables(1)
    assert sliding[0][0] == sliding[1][0] and sliding[0][-1] != sliding[1][-1]  # shared start, diverged end
    assert len(sliding[0]) < len(full[0])  # the sliding group gave back its first block
    # The next 4 tokens need a fresh block per row in each group; the step's release frees one more sliding block.
    hog = pool.allocator.allocate(pool.num_free_blocks - 2)
    with pytest.raises(PoolExhausted, match="need 2 blocks, 1 free of 40"):
        for layer_idx in range(2):
            paged.update(_kv(2, 4, generator), _kv(2, 4, generator), layer_idx)
    assert [layer.cumulative_length for layer in paged.layers] == [15, 15]
    assert paged.layer_block_tables(1) == full  # the failing group: as before the call
    assert paged.layer_block_tables(0) == [table[1:] for table in sliding]  # the step's release stays, no more
    assert pool.num_free_blocks == 3  # 2 left + the released block, both rows' fresh sliding blocks back
    pool.allocator.check_invariants()
    pool.allocator.free(hog)
    _step(caches, 2, 2, 4, generator)
    paged.release()
    assert_pool_clean(pool)


def test_a_first_step_that_runs_out_in_a_later_group_leaves_the_cache_empty():
    config = gemma3_with_pattern([S, F]).config
    generator = torch.Generator().manual_seed(6)
    pool = BlockPool.for_model(config, num_blocks=5, block_size=BLOCK_SIZE)
    paged = PagedCache(config=config, pool=pool)
    with pytest.raises(PoolExhausted, match="need 4 blocks, 1 free of 5"):
        for layer_idx in range(2):
            paged.update(_kv(2, 6, generator), _kv(2, 6, generator), layer_idx)
    assert paged.get_seq_length() == 0 and paged.held_blocks_per_group == (0, 0)
    assert_pool_clean(pool)
    dynamic = DynamicCache(config=config)
    _step((dynamic, paged), 2, 1, 6, generator)  # a smaller first step fits: 2 blocks per group
    assert paged.held_blocks_per_group == (2, 2)


def test_dropped_multi_group_cache_returns_every_groups_blocks():
    import gc

    model = tiny_model("gemma3")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE)
    cache = PagedCache(config=model.config, pool=pool)
    _generate(model, cache, random_prompt(13), max_new_tokens=20, num_beams=2)
    assert min(cache.held_blocks_per_group) > 0
    del cache
    gc.collect()
    assert_pool_clean(pool)


def test_private_pool_gets_groups_and_grows_with_them():
    model = tiny_model("gemma3")
    prompt = random_prompt(13)
    expected = _generate(model, DynamicCache(config=model.config), prompt, max_new_tokens=60)
    cache = PagedCache(config=model.config, block_size=BLOCK_SIZE)
    assert torch.equal(_generate(model, cache, prompt, max_new_tokens=60), expected)
    pool = cache.pool
    assert pool.num_groups == 2 and pool.num_blocks > 8  # grew from its first size
    assert pool.key_cache[0] is pool.key_cache[1] and pool.key_cache[0].shape[1] == pool.num_blocks
    cache.release()
    assert_pool_clean(pool)


# ------------------------------------------------------------------------------------------------ prefix caching
def test_from_prefix_with_layer_groups_continues_a_conversation():
    """Two layer groups, window 8, blocks of 4. A 10 + 20 token generation stores K/V for 29 tokens; its release
    caches the full group's 7 full blocks and the sliding group's last window (blocks 5-6: blocks 0-4 went back
    while it generated). The next turn (those 30 tokens + 5) starts from 7 blocks in both groups, the sliding one
    from block 5, and generates what a cold DynamicCache run does."""
    model = tiny_model("gemma3")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    assert pool.num_groups == 2
    with PagedCache(config=model.config, pool=pool) as cache:
        first = _generate(model, cache, random_prompt(10), max_new_tokens=20)
        cache.release(token_ids=first)
    second = torch.cat([first, random_prompt(5, seed=1)], dim=1)
    expected = _generate(model, DynamicCache(), second, max_new_tokens=8)
    with PagedCache.from_prefix(pool, second, model.config) as cache:
        assert cache.get_seq_length() == 28
        sliding = cache._rows.sliding_groups[0]
        assert [tables.base for tables in cache._tables.groups] == [5 if g == sliding else 0 for g in range(2)]
        held = [len(tables.tables[0]) for tables in cache._tables.groups]
        assert held == [2 if g == sliding else 7 for g in range(2)]
        assert torch.equal(_generate(model, cache, second, max_new_tokens=8), expected)
    stats = pool.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (8, 7)  # (35 - 1) // 4 blocks looked up
    assert_pool_clean(pool)


@pytest.mark.parametrize("max_new_tokens", [8, 9, 10])
def test_from_prefix_with_a_window_that_is_not_a_multiple_of_the_block_size(max_new_tokens):
    """Window 8, blocks of 3: after T stored tokens (17-19) the next turn's longest hit is every full block, T // 3,
    and its window may start a block before the one the next query needs. With prefix caching the sliding group
    keeps that block while it generates, so the whole hit is reused (without it, T = 17 reused nothing)."""
    model = tiny_model("gemma3")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=3, enable_prefix_caching=True)
    with PagedCache(config=model.config, pool=pool) as cache:
        first = _generate(model, cache, random_prompt(10), max_new_tokens=max_new_tokens)
        cache.release(token_ids=first)
    stored = first.shape[1] - 1  # the last generated token is never fed back
    second = torch.cat([first, random_prompt(4, seed=1)], dim=1)
    expected = _generate(model, DynamicCache(), second, max_new_tokens=6)
    with PagedCache.from_prefix(pool, second, model.config) as cache:
        assert cache.get_seq_length() == stored // 3 * 3
        assert torch.equal(_generate(model, cache, second, max_new_tokens=6), expected)
    assert_pool_clean(pool)


def test_from_prefix_with_layer_groups_misses_when_the_window_was_not_cached():
    """A shorter prefix of the same conversation (3 blocks looked up): the full group has its blocks, but the
    sliding group's windows there (blocks 1-2 for a 3-block hit, 0-1 for 2, 0 for 1) went back to the pool uncached
    while it generated, so nothing is reused; the output is still a cold run's."""
    model = tiny_model("gemma3")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    with PagedCache(config=model.config, pool=pool) as cache:
        first = _generate(model, cache, random_prompt(10), max_new_tokens=20)
        cache.release(token_ids=first)
    shorter = torch.cat([first[:, :13], random_prompt(3, seed=2)], dim=1)
    with PagedCache.from_prefix(pool, shorter, model.config) as cache:
        assert cache.get_seq_length() == 0
        assert torch.equal(
            _generate(model, cache, shorter, max_new_tokens=6),
            _generate(model, DynamicCache(), shorter, max_new_tokens=6),
        )
    assert_pool_clean(pool)


def test_prefix_caching_on_a_one_group_gemma3_pool_equals_a_cold_run():
    model = tiny_model("gemma3")
    pool = BlockPool.for_model(
        model, num_blocks=32, block_size=BLOCK_SIZE, enable_prefix_caching=True, group_layers=False
    )
    prompt = random_prompt(21)
    with PagedCache(config=model.config, pool=pool) as cache:
        first = _generate(model, cache, prompt, max_new_tokens=8)
        cache.release(token_ids=first)
    with PagedCache.from_prefix(pool, prompt, model.config) as cache:
        assert cache.get_seq_length() == 20
        assert torch.equal(_generate(model, cache, prompt, max_new_tokens=8), first)
    assert_pool_clean(pool)
