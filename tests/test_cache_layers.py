"""PagedCache returns exactly what DynamicCache returns, layer by layer: same K/V tensors, same mask sizes.

This is the contract behind token-identical generate(): sliding layers return only their window, like
DynamicSlidingWindowLayer, and crop / reorder / repeat / select keep the two caches in step.
"""

import pytest
import torch
from transformers import DynamicCache

from hf_paged import BlockPool, PagedCache, UnsupportedCacheAttribute
from tests import zoo
from tests.models import tiny_model


def _kv_shape(config, batch, q_len):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return batch, config.num_key_value_heads, q_len, head_dim


def _step(caches, config, batch, q_len, generator):
    """Feed the same random K/V to every layer of both caches; compare returns and mask sizes."""
    dynamic, paged = caches
    for layer_idx in range(config.num_hidden_layers):
        assert paged.get_mask_sizes(q_len, layer_idx) == dynamic.get_mask_sizes(q_len, layer_idx)
        assert paged.get_seq_length(layer_idx) == dynamic.get_seq_length(layer_idx)
        keys = torch.randn(_kv_shape(config, batch, q_len), generator=generator)
        values = torch.randn(_kv_shape(config, batch, q_len), generator=generator)
        expected = dynamic.update(keys, values, layer_idx)
        got = paged.update(keys, values, layer_idx)
        assert got[0].shape == expected[0].shape, f"layer {layer_idx}"
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), f"layer {layer_idx}"


@pytest.mark.parametrize("name", ["mistral", "gemma3", "llama"])
def test_update_returns_what_dynamic_cache_returns(name):
    config = tiny_model(name).config  # mistral / gemma3: sliding window 8, so 30 tokens slide well past it
    generator = torch.Generator().manual_seed(0)
    pool = BlockPool.for_model(config, num_blocks=64, block_size=4)
    caches = (DynamicCache(config=config), PagedCache(config=config, pool=pool))
    assert caches[1].is_sliding == caches[0].is_sliding
    _step(caches, config, 2, 11, generator)  # prefill, ends inside a block
    for _ in range(20):  # decode past the window
        _step(caches, config, 2, 1, generator)
    _step(caches, config, 2, 3, generator)  # a multi-token step after the window is full
    # One layer group per attention type for gemma3 (sliding, full); one group of every layer otherwise.
    assert len(caches[1].layer_groups) == (2 if name == "gemma3" else 1)
    for group, held in zip(caches[1].layer_groups, caches[1].held_blocks_per_group):
        held_per_row = held / 2
        if all(caches[0].layers[layer_idx].is_sliding for layer_idx in group):
            # Every layer of the group slides: only the window's blocks (plus the partial ones) stay held.
            assert held_per_row <= -(-config.sliding_window // 4) + 1
        else:  # a full-attention layer needs every block
            assert held_per_row == -(-caches[1].get_seq_length() // 4)
    caches[1].release()
    assert pool.num_used_blocks == 0


def test_sliding_release_waits_for_crop_when_recording_past():
    config = tiny_model("mistral").config
    generator = torch.Generator().manual_seed(2)
    caches = (DynamicCache(config=config), PagedCache(config=config, block_size=4))
    for cache in caches:
        cache.activate_past_recording()
    _step(caches, config, 1, 6, generator)
    for _ in range(10):
        _step(caches, config, 1, 1, generator)
    assert caches[1].num_held_blocks == 4  # 16 tokens, nothing released while recording
    for cache in caches:
        cache.crop(-5)  # a rollback past the window edge works because nothing was released
    _step(caches, config, 1, 2, generator)
    for cache in caches:  # what generate()'s deferred stop check does when it hands the cache back
        cache.crop(0)
        for layer in cache.layers:
            layer.record_past = False
    _step(caches, config, 1, 1, generator)
    _step(caches, config, 1, 1, generator)
    assert caches[1].num_held_blocks <= 3  # released at the start of the next step
    caches[1].release()


def test_crop_past_released_blocks_raises_like_dynamic_sliding_layers():
    config = tiny_model("mistral").config
    cache = PagedCache(config=config, block_size=4)
    states = torch.randn(_kv_shape(config, 1, 20))
    for step in range(2):
        for layer_idx in range(config.num_hidden_layers):
            cache.update(states[:, :, : 20 if step == 0 else 1], states[:, :, : 20 if step == 0 else 1], layer_idx)
    assert cache.block_tables[0] and cache.get_seq_length() == 21
    with pytest.raises(RuntimeError, match="already released positions before 12.*activate_past_recording"):
        cache.crop(-6)
    assert cache.get_seq_length() == 21  # a refused crop changes nothing
    cache.crop(-1)
    assert cache.get_seq_length() == 20
    cache.release()


def _llama_caches(seed: int):
    """(config, generator, pool, (DynamicCache, PagedCache on the pool)) of the tiny Llama, for tests that keep both
    caches in step."""
    config = tiny_model("llama").config
    pool = BlockPool.for_model(config, num_blocks=64, block_size=4)
    caches = (DynamicCache(config=config), PagedCache(config=config, pool=pool))
    return config, torch.Generator().manual_seed(seed), pool, caches


def test_reorder_repeat_select_and_crop_track_dynamic_cache():
    config, generator, pool, caches = _llama_caches(seed=1)
    _step(caches, config, 2, 6, generator)
    for cache in caches:
        cache.batch_repeat_interleave(3)  # 6 rows sharing 2 rows' blocks
    assert caches[1].num_held_blocks == 2 * 2
    _step(caches, config, 6, 1, generator)
    for cache in caches:
        cache.reorder_cache(torch.tensor([5, 5, 0, 1, 2, 2]))
    _step(caches, config, 6, 2, generator)
    for cache in caches:
        cache.crop(-3)
    _step(caches, config, 6, 1, generator)
    for cache in caches:
        cache.batch_select_indices(torch.tensor([4, 1]))
    _step(caches, config, 2, 2, generator)
    caches[1].release()
    pool.allocator.check_invariants()
    assert pool.num_used_blocks == 0


def test_a_boolean_mask_or_negative_indices_select_the_rows_dynamic_cache_keeps():
    """`batch_select_indices` with a boolean mask keeps the rows where it is True, as tensor indexing (DynamicCache)
    reads it, not rows 1 and 0, and a negative index counts from the last row; a mask of another length, or a
    selection of no row, is refused before any change."""
    config, generator, pool, caches = _llama_caches(seed=2)
    _step(caches, config, 3, 5, generator)
    for cache in caches:
        cache.batch_select_indices(torch.tensor([False, True, True]))
    _step(caches, config, 2, 1, generator)
    paged = caches[1]
    with pytest.raises(IndexError, match=r"shape must be \(2,\), got \(3,\)"):
        paged.batch_select_indices(torch.tensor([True, False, True]))
    with pytest.raises(ValueError, match="keeps at least one row"):
        paged.batch_select_indices(torch.tensor([False, False]))
    with pytest.raises(ValueError, match="keeps at least one row"):
        paged.batch_select_indices(torch.tensor([], dtype=torch.long))
    _step(caches, config, 2, 1, generator)  # still in step with DynamicCache
    for cache in caches:
        cache.batch_select_indices(torch.tensor([-1, 0, -2]))  # negative indices count from the last row
    _step(caches, config, 3, 1, generator)
    paged.release()
    pool.allocator.check_invariants()
    assert pool.num_used_blocks == 0


def test_a_row_change_under_a_reservation_the_pool_cannot_take_again_still_changes_the_rows():
    """A compileable cache (`max_cache_len`) whose next forward's blocks are reserved takes them again for its new
    rows after `batch_repeat_interleave`; where the pool has no room for them, the rows are still the ones asked
    for (the repeat does not raise after changing them) and the next forward's reservation refuses that step."""
    from hf_paged import PoolExhausted

    config = tiny_model("llama").config
    pool = BlockPool.for_model(config, num_blocks=3, block_size=4)
    cache = PagedCache(config=config, pool=pool, max_cache_len=8)
    for layer_idx in range(config.num_hidden_layers):
        cache.update(*(torch.randn(_kv_shape(config, 1, 4)),) * 2, layer_idx)
    assert cache.get_mask_sizes(1, 0) == (8, 0)  # reserves the next token's block: 1 block left free
    cache.batch_repeat_interleave(3)  # three rows, each needing a block of its own for that token
    assert len(cache.block_tables) == 3 and cache.get_seq_length() == 4
    with pytest.raises(PoolExhausted):
        cache.get_mask_sizes(1, 0)
    cache.release()
    pool.allocator.check_invariants()
    assert pool.num_used_blocks == 0


def test_crop_rejects_positive_values_like_dynamic_cache():
    cache = PagedCache(config=tiny_model("llama").config)
    with pytest.raises(ValueError, match="negative integer"):
        cache.crop(3)


def test_batch_size_change_without_reorder_is_an_error():
    config = tiny_model("llama").config
    cache = PagedCache(config=config)
    cache.update(*(torch.zeros(_kv_shape(config, 2, 3)),) * 2, 0)
    with pytest.raises(ValueError, match="holds 2 rows but layer 0 got key_states for 3"):
        cache.update(*(torch.zeros(_kv_shape(config, 3, 1)),) * 2, 0)
    cache.release()


@pytest.mark.parametrize("num_beams", [1, 3])
def test_looped_layers_with_a_cache_per_loop_equal_dynamic_cache(num_beams):
    """Dory loops its middle layers, each loop after the first writing copies of their cache layers that the model
    appends to a cache of its decoder's length. A PagedCache holds those copies from the start (pool layers of their
    own: `cache_layers`), so the model appends none, and generates what DynamicCache does."""
    model = zoo.tiny_model("dory", "DoryForCausalLM")
    assert model.config.n_recurrent_loops == 2 and model.config.recurrent_kv_cache_mode == "per_loop"
    model_inputs = zoo.inputs()
    expected = zoo.generate(model, model_inputs, past_key_values=DynamicCache(config=model.config), num_beams=num_beams)
    cache = PagedCache(config=model.config)
    assert len(cache.layers) == 4 and cache.layout.num_layers == 4  # 3 decoder layers, the looped one twice
    got = zoo.generate(model, model_inputs, past_key_values=cache, num_beams=num_beams)
    assert zoo.compare(got, expected) is None


def test_looped_layers_reading_the_last_loops_keys_are_refused_by_name():
    """Dory's "last_loop" mode has earlier loops read the cached `keys` / `values` of the layers: a paged layer has
    none, and says so (UnsupportedCacheAttribute), rather than hand the model None."""
    model = zoo.tiny_model("dory", "DoryForCausalLM")
    model.config.recurrent_kv_cache_mode = "last_loop"
    cache = PagedCache(config=model.config)
    assert len(cache.layers) == 3  # no copies: the last loop writes the layers themselves
    with pytest.raises(UnsupportedCacheAttribute, match="model type 'dory'.*cache layer attribute 'keys'"):
        zoo.generate(model, zoo.inputs(), past_key_values=cache)
