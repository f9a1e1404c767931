"""What `PagedCache.update` hands attention, and what transient memory it takes for it.

- a first prefill (nothing cached) returns the step's own K/V: nothing is gathered, no workspace is allocated;
- one row whose blocks are consecutive pool blocks (one row in a private pool) gets a strided view of the pool;
- otherwise K/V are gathered into a workspace shared by the caches of one pool in one thread, sized to the largest
  gather in whole blocks: at `generate()`'s end, exactly the visible K/V of the last decode step's one layer;
- under the "hf_paged" attention (torch path), rows that share their first blocks (the prompt of samples or beams)
  read that prefix once, a view of the pool, and gather only their own tails.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from bench.cache_report import kv_bytes_held
from hf_paged import PAGED_ATTENTION, BlockPool, KVLayout, PagedCache
from hf_paged.attention import plan_of
from hf_paged.attention.shared_prefix import shared_prefix_attention
from hf_paged.attention.torch_attention import torch_attention_forward
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


def test_a_layer_after_the_workspace_grew_gathers_into_the_new_buffer():
    """A step's gather views are made at its first layer and reused by its other layers: with another cache on the
    pool growing the shared buffer between two of them, every layer's K/V are still every row's own (the next layer
    gathers into the new buffer)."""
    pool = _pool()
    small, large = PagedCache(pool=pool), PagedCache(pool=pool)
    caches = ((small, 2, DynamicCache()), (large, 3, DynamicCache()))  # the larger gather grows the shared buffer
    for step, length in enumerate([6, 1, 1, 1]):
        for layer in (0, 1):
            for cache, batch, reference in caches:
                keys = _states(batch, length, 100 * step + 10 * layer + batch)
                out, values = cache.update(keys, -keys, layer)
                expected_keys, expected_values = reference.update(keys, -keys, layer)
                assert torch.equal(out, expected_keys) and torch.equal(values, expected_values)
    small.release()
    large.release()


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
    """The cache report's memory rows (8 samples, 4 beams) at its full size. With sdpa, the workspace is exactly one
    layer's visible K/V of the last decode step, in whole blocks (the prefill gathers nothing), so
    `ratio_with_workspace` is the pool's ratio plus 1 / num_layers, rounded up to blocks. With the "hf_paged"
    attention, the rows read the prompt they share from the pool and the workspace holds only their own tails.
    Deterministic: seeded model and sampling."""
    model = _six_layer_model()
    prompt_len, max_new_tokens = 1024, 64
    report = kv_bytes_held(
        model, prompt_len=prompt_len, max_new_tokens=max_new_tokens, attentions=("sdpa", PAGED_ATTENTION)
    )
    assert model.config._attn_implementation == "sdpa"  # restored
    rows = {row["mode"]: row for row in report if row["attention"] == "sdpa"}
    paged_rows = {row["mode"]: row for row in report if row["attention"] == PAGED_ATTENTION}
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
    # "hf_paged": the same blocks held, tokens identical; the last step's tails are 63 tokens (4 blocks) per row.
    tail_blocks = -(-(max_new_tokens - 1) // 16)
    for mode, num_rows in (("num_return_sequences=8 (sampling)", 8), ("num_beams=4", 4)):
        row = paged_rows[mode]
        assert row["identical"] and row["paged_bytes"] == rows[mode]["paged_bytes"]
        assert row["paged_workspace_bytes"] == 2 * num_rows * tail_blocks * 16 * kv_heads * head_dim * 4
    assert paged_rows["num_return_sequences=8 (sampling)"]["ratio_with_workspace"] <= 0.25
    assert paged_rows["num_beams=4"]["ratio_with_workspace"] <= 0.35


def _shared_prompt_cache(num_rows: int = 3, prompt_len: int = 9, num_steps: int = 3):
    """A cache of `num_rows` rows that share a `prompt_len`-token prompt, then diverge for `num_steps` tokens, under
    the "hf_paged" attention (the flag PagedCache reads at every step's layer 0), and the same rows' K/V in full."""
    pool = _pool(num_blocks=32)
    cache = PagedCache(pool=pool)
    cache._update.visible._runs_paged_attention = lambda: True
    prompt = _states(1, prompt_len, 0).expand(num_rows, -1, -1, -1)
    cache.update(prompt, prompt, 0)
    full = prompt
    for step in range(num_steps):
        token = _states(num_rows, 1, step + 1)
        keys, values = cache.update(token, token, 0)
        full = torch.cat([full, token], dim=2)
    return cache, keys, full


def test_rows_sharing_a_prompt_read_it_once_from_the_pool():
    cache, keys, full = _shared_prompt_cache()
    assert cache.layer_block_tables(0)[0][:2] == cache.layer_block_tables(0)[1][:2] == [0, 1]  # 8 tokens shared
    plan = plan_of(keys)
    assert keys.shape == (3, NUM_HEADS, 0, HEAD_DIM) and plan is not None
    prefix_keys, prefix_values, tail_keys, tail_values = plan.split_gather()
    assert prefix_keys.shape == (1, NUM_HEADS, 8, HEAD_DIM) and tail_keys.shape == (3, NUM_HEADS, 4, HEAD_DIM)
    assert _shares_storage(prefix_keys, cache.pool.key_cache[0])  # consecutive blocks: a view, no copy
    assert torch.equal(prefix_keys[0], full[0, :, :8]) and torch.equal(prefix_values[0], full[0, :, :8])
    assert torch.equal(tail_keys, full[:, :, 8:]) and torch.equal(tail_values, full[:, :, 8:])
    # the workspace holds the tails (1 block per row), not every row's 12 tokens (3 blocks per row)
    assert cache.workspace_bytes == 2 * 3 * 1 * BLOCK_SIZE * NUM_HEADS * HEAD_DIM * 4
    gathered, _ = plan.gather()  # the sdpa-shaped K/V stay available (attention sinks use them)
    assert torch.equal(gathered, full)
    cache.release()


@pytest.mark.parametrize("gap_after", [1, 4], ids=["gathered-once", "split-at-the-run"])
def test_a_shared_prefix_in_scattered_blocks(gap_after):
    """3 rows share a 5-block prompt whose blocks are not one run (another cache took a block after the first
    `gap_after`). Gathering the prefix once copies 5 blocks; splitting at the end of the run makes the rest part of
    each row's tail, 3 x (5 - gap_after) blocks: whichever copies less."""
    pool = _pool(num_blocks=32)
    cache, other = PagedCache(pool=pool), PagedCache(pool=pool)
    cache._update.visible._runs_paged_attention = lambda: True
    prompt = _states(1, 20, 0).expand(3, -1, -1, -1)
    cache.update(prompt[:, :, : 4 * gap_after], prompt[:, :, : 4 * gap_after], 0)
    other.update(_states(1, 4, 1), _states(1, 4, 1), 0)
    cache.update(prompt[:, :, 4 * gap_after :], prompt[:, :, 4 * gap_after :], 0)
    token = _states(3, 1, 2)
    keys, _ = cache.update(token, token, 0)
    assert cache.layer_block_tables(0)[0][:5] == [*range(gap_after), *range(gap_after + 1, 6)]
    prefix_keys, _, tail_keys, tail_values = plan_of(keys).split_gather()
    full = torch.cat([prompt, token], dim=2)
    run = gap_after == 4
    assert prefix_keys.shape[2] == (16 if run else 20) and _shares_storage(prefix_keys, pool.key_cache[0]) == run
    prefix_len = prefix_keys.shape[2]
    assert torch.equal(prefix_keys[0], full[0, :, :prefix_len])
    assert torch.equal(tail_keys, full[:, :, prefix_len:]) and torch.equal(tail_values, full[:, :, prefix_len:])
    cache.release()
    other.release()


def test_rows_without_a_shared_prefix_get_their_kv_on_cpu():
    """No rows in common and no kernel to run (CPU without Triton's interpreter): the K/V come back as they would
    for sdpa, no plan."""
    pool = _pool()
    cache = PagedCache(pool=pool, share_rows=False)
    cache._update.visible._runs_paged_attention = lambda: True
    keys = _states(2, 5, 0)
    cache.update(keys, keys, 0)
    step = _states(2, 1, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        out, _ = cache.update(step, step, 0)
    assert plan_of(out) is None and torch.equal(out, torch.cat([keys, step], dim=2))
    cache.release()


@pytest.mark.parametrize("mask", ["none", "left-padding", "additive"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_shared_prefix_attention_equals_attention_over_the_whole_context(mask, softcap):
    """One softmax over the prefix's and the tails' logits: the attention over each row's concatenated K/V (GQA,
    values of their own head_dim), to float rounding."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, head_dim, v_head_dim, prefix_len, tail_len = 3, 4, 2, 8, 6, 11, 5
    query = torch.randn(batch, heads, 1, head_dim, generator=generator)
    prefix_keys = torch.randn(1, kv_heads, prefix_len, head_dim, generator=generator)
    prefix_values = torch.randn(1, kv_heads, prefix_len, v_head_dim, generator=generator)
    tail_keys = torch.randn(batch, kv_heads, tail_len, head_dim, generator=generator)
    tail_values = torch.randn(batch, kv_heads, tail_len, v_head_dim, generator=generator)
    keys = torch.cat([prefix_keys.expand(batch, -1, -1, -1), tail_keys], dim=2)
    values = torch.cat([prefix_values.expand(batch, -1, -1, -1), tail_values], dim=2)
    kv_len = prefix_len + tail_len
    attention_mask = None
    if mask != "none":
        visible = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
        visible[1, ..., :3] = False  # row 1 left-padded by 3
        attention_mask = visible if mask == "left-padding" else torch.where(visible, 0.0, -1e4)
    out = shared_prefix_attention(
        query, prefix_keys, prefix_values, tail_keys, tail_values, attention_mask, scaling=0.3, softcap=softcap
    )
    expected, _ = torch_attention_forward(query, keys, values, attention_mask, scaling=0.3, softcap=softcap)
    assert out.shape == (batch, 1, heads, v_head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # tails gathered head-major (the decode runner's `[kv_heads, B, ...]` storage, seen as `[B, kv_heads, ...]`)
    tails = [tail.transpose(0, 1).contiguous().transpose(0, 1) for tail in (tail_keys, tail_values)]
    assert tails[0].stride(0) < tails[0].stride(1)
    head_major = shared_prefix_attention(
        query, prefix_keys, prefix_values, *tails, attention_mask, scaling=0.3, softcap=softcap
    )
    torch.testing.assert_close(head_major, out, rtol=1e-6, atol=1e-7)
    # all shared (no tails): the prefix alone
    out = shared_prefix_attention(query, prefix_keys, prefix_values, None, None, None)
    expected, _ = torch_attention_forward(
        query, prefix_keys.expand(batch, -1, -1, -1), prefix_values.expand(batch, -1, -1, -1), None
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one query token per row, got q_len=2"):
        shared_prefix_attention(torch.cat([query, query], dim=2), prefix_keys, prefix_values, None, None, None)


def test_the_workspace_keeps_one_buffer_per_device_of_a_split_pool():
    """Layers of a pool split over devices gather in turn: each device keeps its buffer instead of the two
    reallocating each other's every step ("meta" stands in for a second device)."""
    from hf_paged.cache.gather import GatherWorkspace

    workspace = GatherWorkspace()
    on_cpu, on_meta = torch.empty(1), torch.empty(1, device="meta")
    first = workspace.buffer("keys", (2, 4, 4), on_cpu)
    workspace.buffer("keys", (2, 4, 4), on_meta)
    assert workspace.buffer("keys", (2, 4, 4), on_cpu).data_ptr() == first.data_ptr()
    assert workspace.nbytes == 2 * (2 * 4 * 4) * on_cpu.element_size()
