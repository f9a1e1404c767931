"""What `PagedCache.update` hands attention, and what transient memory it takes for it.

- a first prefill (nothing cached) returns the step's own K/V: nothing is gathered, no workspace is allocated;
- one row whose blocks are consecutive pool blocks (one row in a private pool) gets a strided view of the pool;
- otherwise K/V are gathered into a workspace shared by the caches of one pool in one thread, sized to the largest
  gather in whole blocks: at `generate()`'s end, exactly the visible K/V of the last decode step's one layer.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from bench.cache_report import kv_bytes_held
from hf_paged import BlockPool, KVLayout, PagedCache
from hf_paged.cache.gather import workspace_for

NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 8, 4


def _pool(num_layers: int = 2, num_blocks: int = 64) -> BlockPool:
    return BlockPool(
        KVLayout((NUM_HEADS,) * num_layers, (HEAD_DIM,) * num_layers), num_blocks=num_blocks, block_size=BLOCK_SIZE
    )


def _states(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, NUM_HEADS, length, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def _shares_storage(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def test_first_prefill_returns_its_own_states_and_allocates_no_workspace():
    pool = _pool()
    cache = PagedCache(pool=pool)
    keys, values = _states(3, 10, 0), _states(3, 10, 1)
    for layer_idx in range(2):
        out_keys, out_values = cache.update(keys, values, layer_idx)
        assert out_keys is keys and out_values is values
    assert cache.workspace_bytes == 0
    # ... and the pool holds them: the next step returns them back (gathered: three rows are not one run)
    step = _states(3, 1, 2)
    out_keys, out_values = cache.update(step, step, 0)
    assert torch.equal(out_keys, torch.cat([keys, step], dim=2))
    assert torch.equal(out_values, torch.cat([values, step], dim=2))
    cache.release()


def test_one_row_in_consecutive_blocks_is_a_view_of_the_pool():
    pool = _pool()
    cache, reference = PagedCache(pool=pool), DynamicCache()
    for step, length in enumerate([9, 1, 1, 1, 1, 1, 1, 1]):  # crosses two block boundaries
        keys, values = _states(1, length, 2 * step), _states(1, length, 2 * step + 1)
        for layer_idx in range(2):
            out = cache.update(keys, values, layer_idx)
            expected = reference.update(keys, values, layer_idx)
            assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
            if step:
                assert _shares_storage(out[0], pool.key_cache[layer_idx])
                assert _shares_storage(out[1], pool.value_cache[layer_idx])
    assert cache.block_tables == [[0, 1, 2, 3]]
    assert cache.workspace_bytes == 0
    cache.release()


def test_several_rows_are_gathered_even_in_consecutive_blocks():
    """Two rows in blocks [0, 1] and [2, 3] could be one strided view, but its batch and head dimensions could not be
    merged, and models reshape K/V to [B * heads, kv_len, head_dim] with `.view` (gpt_neox_japanese does)."""
    pool = _pool()
    cache = PagedCache(pool=pool, share_rows=False)
    keys = _states(2, 8, 0)
    cache.update(keys, keys, 0)
    step = _states(2, 1, 1)
    cache.crop(-1)  # the rows keep their blocks; the next update rewrites position 7
    out, _ = cache.update(step, step, 0)
    assert cache.layer_block_tables(0) == [[0, 1], [2, 3]]
    assert not _shares_storage(out, pool.key_cache[0])
    assert torch.equal(out, torch.cat([keys[:, :, :7], step], dim=2))
    assert torch.equal(out.view(2 * NUM_HEADS, 8, HEAD_DIM), out.reshape(2 * NUM_HEADS, 8, HEAD_DIM))
    cache.release()


def test_interleaved_caches_gather_into_one_workspace_sized_in_whole_blocks():
    pool = _pool()
    first, second = PagedCache(pool=pool), PagedCache(pool=pool)
    references = DynamicCache(), DynamicCache()
    for step, length in enumerate([5, 1, 1, 1, 1]):
        for cache, reference in zip((first, second), references):
            keys = _states(2, length, 10 * step + (cache is second))
            out, _ = cache.update(keys, keys, 0)
            assert torch.equal(out, reference.update(keys, keys, 0)[0])
            assert not _shares_storage(out, pool.key_cache[0])  # two rows: gathered
    assert first.workspace_bytes == second.workspace_bytes == workspace_for(pool).nbytes
    # 9 tokens of 2 rows: 3 blocks per row, K and V
    assert first.workspace_bytes == 2 * (2 * 3 * BLOCK_SIZE) * NUM_HEADS * HEAD_DIM * 4
    first.release()
    assert second.workspace_bytes == 0  # released with the caches' K/V: the next gather allocates again
    second.release()


def test_each_thread_gets_its_own_workspace_of_a_pool():
    pool = _pool()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(workspace_for(pool)))
    thread.start()
    thread.join()
    assert seen[0] is not workspace_for(pool)
    assert workspace_for(pool) is workspace_for(pool)


def _six_layer_model() -> LlamaForCausalLM:
    """Six layers like the benchmark's model (the memory ratios depend on the layer count and the block structure,
    not on head sizes), small enough for a 1,024-token prompt in a second."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_kv_bytes_held_with_workspace_on_a_1024_token_prompt():
    """The cache report's memory rows (8 samples, 4 beams) at its full size: the workspace is exactly one layer's
    visible K/V of the last decode step, in whole blocks (the prefill gathers nothing), so `ratio_with_workspace` is
    the pool's ratio plus 1 / num_layers, rounded up to blocks. Deterministic: seeded model and sampling."""
    model = _six_layer_model()
    prompt_len, max_new_tokens = 1024, 64
    rows = {row["mode"]: row for row in kv_bytes_held(model, prompt_len=prompt_len, max_new_tokens=max_new_tokens)}
    config = model.config
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    visible_blocks = -(-(prompt_len + max_new_tokens - 1) // 16)
    for mode, num_rows in (("num_return_sequences=8 (sampling)", 8), ("num_beams=4", 4)):
        row = rows[mode]
        assert row["identical"]
        assert row["paged_workspace_bytes"] == 2 * num_rows * visible_blocks * 16 * kv_heads * head_dim * 4
        assert row["ratio_with_workspace"] == pytest.approx(row["ratio"] + 1 / 6, abs=0.002)
    # Every sampled row diverged at its first token: the 64 prompt blocks once, 4 blocks of its own per row.
    samples = rows["num_return_sequences=8 (sampling)"]
    assert samples["paged_bytes"] == (64 + 8 * 4) * 6 * 2 * 16 * kv_heads * head_dim * 4
    assert round(samples["ratio"], 3) == 0.177 and round(samples["ratio_with_workspace"], 3) == 0.343
    # Before: the first prefill was gathered into a workspace with 25% headroom (0.373 at the benchmark's model).
    assert samples["ratio_with_workspace"] < 0.373
    assert rows["num_beams=4"]["ratio_with_workspace"] < 0.454


def test_the_workspace_keeps_one_buffer_per_device_of_a_split_pool():
    """Layers of a pool split over devices gather in turn: each device keeps its buffer instead of the two
    reallocating each other's every step ("meta" stands in for a second device)."""
    from hf_paged.cache.gather import GatherWorkspace

    workspace = GatherWorkspace()
    on_cpu, on_meta = torch.empty(1), torch.empty(1, device="meta")
    first = workspace._view("keys", (2, 4, 4), on_cpu)
    workspace._view("keys", (2, 4, 4), on_meta)
    assert workspace._view("keys", (2, 4, 4), on_cpu).data_ptr() == first.data_ptr()
    assert workspace.nbytes == 2 * (2 * 4 * 4) * on_cpu.element_size()
