"""Prefix caching: exact allocator behaviour (hits, LRU eviction, invalidation) and generate() from a cached prefix."""

import pytest
import torch
from transformers import DynamicCache

from hf_paged import BlockAllocator, BlockPool, KVLayout, PagedCache, PoolExhausted, SamplingParams
from hf_paged.engine import Request, Scheduler
from hf_paged.storage import block_hashes, hash_block_tokens
from tests.models import left_padded_batch, tiny_model
from tests.prefix_kv import LAYOUT, update_rows

H = [hash_block_tokens(None, i, [i]) for i in range(4)]


def test_hash_chain_depends_on_every_earlier_token_and_position():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the trailing partial block has no hash
    b = block_hashes([9, 2, 3, 4, 5, 6], 2)
    assert a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, different parent
    assert block_hashes([1, 2, 3, 4], 2) == a[:2]
    assert hash_block_tokens(None, 0, [1, 2]) != hash_block_tokens(None, 1, [1, 2])


def test_freed_cached_blocks_are_hit_and_taken_back_out_of_the_free_queue():
    allocator = BlockAllocator(4, enable_prefix_caching=True)
    assert allocator.allocate(2) == [0, 1]
    allocator.cache_block(0, H[0])
    allocator.cache_block(1, H[1])
    allocator.free([0, 1])
    assert allocator.num_free_blocks == 4 and allocator.num_cached_blocks == 2
    assert allocator.lookup_prefix([H[0], H[1], H[2]]) == [0, 1]
    assert (allocator.num_prefix_queries, allocator.num_prefix_hits) == (3, 2)
    assert allocator.ref_count(0) == 1 and allocator.num_free_blocks == 2
    assert allocator.allocate(2) == [2, 3]  # the hit blocks are not in the queue any more
    allocator.check_invariants()


def test_lookup_stops_at_the_first_miss():
    allocator = BlockAllocator(3, enable_prefix_caching=True)
    allocator.allocate(2)
    allocator.cache_block(1, H[1])
    assert allocator.peek_prefix([H[0], H[1]]) == []
    assert allocator.lookup_prefix([H[0], H[1]]) == []  # block 1 is cached, but its parent is not


def test_peek_prefix_names_what_a_lookup_would_take_and_takes_nothing():
    allocator = BlockAllocator(4, enable_prefix_caching=True)
    allocator.allocate(3)
    for block_id in range(3):
        allocator.cache_block(block_id, H[block_id])
    allocator.free([1, 2])
    assert allocator.peek_prefix([H[0], H[1], H[3], H[2]]) == [0, 1]
    assert allocator.peek_prefix([H[0], H[1], H[2]]) == [0, 1, 2]
    assert allocator.num_free_blocks == 3 and allocator.ref_count(1) == 0  # nothing taken
    assert (allocator.num_prefix_queries, allocator.num_prefix_hits) == (0, 0)  # not a query
    allocator.check_invariants()


def test_each_layer_group_caches_its_own_blocks():
    """Two groups' blocks for the same tokens hold different layers: a hash cached in one group is not found in
    another, and evicting one group's block leaves the other's."""
    allocator = BlockAllocator(4, enable_prefix_caching=True)
    assert allocator.allocate(2) == [0, 1]
    allocator.cache_block(0, H[0])  # group 0
    allocator.cache_block(1, H[0], group=1)
    assert allocator.peek_prefix([H[0]]) == [0] and allocator.peek_prefix([H[0]], group=1) == [1]
    assert allocator.peek_prefix([H[0]], group=2) == []
    allocator.free([0, 1])  # free queue: 2, 3, 0, 1
    assert allocator.allocate(3) == [2, 3, 0]  # evicts group 0's copy
    assert allocator.peek_prefix([H[0]]) == [] and allocator.lookup_prefix([H[0]], group=1) == [1]
    assert allocator.peek_blocks([H[1], H[0], H[2]], group=1) == [None, 1, None]  # every hash, not a leading run
    assert allocator.num_cached_blocks == 1
    allocator.check_invariants()


SLIDING, FULL = "sliding_attention", "full_attention"


def _hybrid_scheduler(window: int = 8) -> tuple[Scheduler, int, int]:
    """A scheduler on a pool with a sliding group (window `window`) and a full one, blocks of 4, prefix caching on;
    with the indices of its sliding and full groups."""
    pool = BlockPool(KVLayout((2, 2), (4, 4), (SLIDING, FULL)), num_blocks=64, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, sliding_windows=[window, None])
    sliding = scheduler.group_windows.index(window)
    return scheduler, sliding, 1 - sliding


def _cache(allocator: BlockAllocator, hashes: list[bytes], indices, group: int) -> dict[int, int]:
    """Cache blocks for `hashes[i]`, i in `indices`, in `group`, then free them (cached, evictable): index -> id."""
    blocks = {}
    for index in indices:
        (blocks[index],) = allocator.allocate(1)
        allocator.cache_block(blocks[index], hashes[index], group)
    allocator.free(blocks.values())
    return blocks


@pytest.mark.parametrize(
    "full_cached, sliding_cached, num_hit",
    [
        (range(10), range(8, 10), 10),  # the window from position 40 spans blocks 8-9: the rest may be gone
        (range(10), [*range(2, 8), 9], 8),  # block 8 missing: a hit of 9 or 10 blocks needs it; 8 needs 6-7
        (range(6), range(10), 6),  # a full group needs every block from the first
        (range(10), [3, 4], 5),  # only a window in the middle: n = 5 (it needs blocks 3-4) and nothing above
        (range(10), [], 0),
    ],
    ids=["window-only", "hole-in-window", "full-shorter", "window-in-the-middle", "sliding-empty"],
)
def test_a_hit_needs_every_block_of_a_full_group_and_the_window_of_a_sliding_one(full_cached, sliding_cached, num_hit):
    scheduler, sliding, full = _hybrid_scheduler(window=8)
    allocator = scheduler.pool.allocator
    tokens = list(range(1, 42))  # 41 tokens: 10 full blocks looked up (one token is always left to compute)
    hashes = block_hashes(tokens, 4)
    full_blocks = _cache(allocator, hashes, full_cached, full)
    sliding_blocks = _cache(allocator, hashes, sliding_cached, sliding)
    request = Request(0, tokens, SamplingParams(max_new_tokens=4))
    hit = scheduler.prefix.peek(request)
    assert hit.num_blocks == num_hit
    assert hit.waits_for == (hashes[num_hit] if num_hit < 10 else None)
    first_sliding = max(num_hit * 4 - 8 + 1, 0) // 4  # the first block a query at position 4 * num_hit sees
    assert hit.first_blocks[full] == 0 and hit.first_blocks[sliding] == first_sliding
    assert hit.tables[full] == [full_blocks[i] for i in range(num_hit)]
    assert hit.tables[sliding] == [sliding_blocks[i] for i in range(first_sliding, num_hit)]
    num_free = allocator.num_free_blocks
    scheduler.prefix.take(request)  # takes exactly what the peek named
    assert request.block_tables == hit.tables and request.first_blocks == hit.first_blocks
    assert request.num_computed == 4 * num_hit == scheduler.num_prefix_hit_tokens
    assert allocator.num_free_blocks == num_free - len(hit.tables[full]) - len(hit.tables[sliding])
    allocator.check_invariants()


def test_a_hash_cached_in_another_group_is_not_a_hit():
    scheduler, sliding, full = _hybrid_scheduler()
    tokens = list(range(1, 42))
    _cache(scheduler.pool.allocator, block_hashes(tokens, 4), range(10), full)  # the sliding group holds none
    assert scheduler.prefix.peek(Request(0, tokens, SamplingParams())).num_blocks == 0


def test_eviction_takes_the_least_recently_freed_cached_block():
    allocator = BlockAllocator(3, enable_prefix_caching=True)
    allocator.allocate(3)
    for block_id in range(3):
        allocator.cache_block(block_id, H[block_id])
    allocator.free([1])
    allocator.free([0])
    allocator.free([2])
    assert allocator.allocate(1) == [1]  # evicts block 1: its hash is forgotten
    assert allocator.lookup_prefix([H[1]]) == []
    assert allocator.lookup_prefix([H[0]]) == [0]
    assert allocator.num_cached_blocks == 2
    allocator.check_invariants()


def test_writing_in_place_forgets_the_hash_and_duplicates_stay_uncached():
    allocator = BlockAllocator(3, enable_prefix_caching=True)
    a, b = allocator.allocate(2)
    allocator.cache_block(a, H[0])
    allocator.cache_block(b, H[0])  # same contents in a second block: not moved
    assert allocator.lookup_prefix([H[0]]) == [a]
    allocator.free([a])
    assert allocator.copy_on_write(a) == a  # sole holder writes in place
    assert allocator.num_cached_blocks == 0
    allocator.check_invariants()


def test_disabled_prefix_caching_caches_nothing():
    allocator = BlockAllocator(2)
    (a,) = allocator.allocate(1)
    allocator.cache_block(a, H[0])
    assert allocator.lookup_prefix([H[0]]) == [] and allocator.num_cached_blocks == 0


def _cold(model, input_ids, max_new_tokens=8):
    return model.generate(input_ids, past_key_values=DynamicCache(), max_new_tokens=max_new_tokens, do_sample=False)


def test_generate_from_a_cached_prefix_equals_a_cold_run():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4, enable_prefix_caching=True)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 128, (1, 21), generator=generator)

    with PagedCache(config=model.config, pool=pool) as cache:
        first = model.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False)
        cache.release(token_ids=first)  # prompt + 7 fed tokens = 28 cached tokens = 7 full blocks
    assert torch.equal(first, _cold(model, prompt))
    assert pool.num_used_blocks == 0 and pool.stats()["cached_blocks"] == 7

    # Same prompt again: 5 of its 5 full blocks are cached but one token must stay uncached -> (21-1)//4 = 5.
    cache = PagedCache.from_prefix(pool, prompt, model.config)
    assert cache.get_seq_length() == 20
    with cache:
        assert torch.equal(model.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False), first)

    # A different continuation of the first 13 tokens reuses 3 blocks and computes the rest.
    other = torch.cat([prompt[:, :13], torch.randint(1, 128, (1, 9), generator=generator)], dim=1)
    with PagedCache.from_prefix(pool, other, model.config) as cache:
        assert cache.get_seq_length() == 12
        out = model.generate(other, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, _cold(model, other))

    # A prompt that is exactly the cached sequence still leaves one token to compute.
    with PagedCache.from_prefix(pool, first[:, :28], model.config) as cache:
        assert cache.get_seq_length() == 24
    stats = pool.stats()
    assert stats["prefix_cache_hits"] == 5 + 3 + 6 and pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_padded_rows_are_not_cached_and_overwritten_blocks_are_forgotten():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4, enable_prefix_caching=True)
    input_ids, attention_mask = left_padded_batch(2, 12)  # row 0 unpadded, row 1 padded
    with PagedCache(config=model.config, pool=pool) as cache:
        out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=4)
        full_mask = torch.cat([attention_mask, torch.ones(2, 4, dtype=attention_mask.dtype)], dim=1)
        cache.release(token_ids=out, attention_mask=full_mask)
    assert pool.stats()["cached_blocks"] == 15 // 4  # row 0 only: 15 cached tokens -> 3 full blocks

    with PagedCache.from_prefix(pool, out[0], model.config) as cache:
        assert cache.get_seq_length() == 12
        cache.crop(-2)  # positions 10, 11 of block 2 will be rewritten
        num_kv_heads, head_dim = 2, 16
        for layer_idx in range(model.config.num_hidden_layers):
            new = torch.zeros(1, num_kv_heads, 2, head_dim)
            cache.update(new, new, layer_idx)
    assert pool.stats()["cached_blocks"] == 2  # block 2 no longer holds what its hash says
    with PagedCache.from_prefix(pool, out[0], model.config) as cache:
        assert cache.get_seq_length() == 8


def test_from_prefix_rejects_batches_and_release_checks_rows():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="one sequence"):
        PagedCache.from_prefix(pool, torch.ones(2, 8, dtype=torch.long), model.config)
    cache = PagedCache(config=model.config, pool=pool)
    model.generate(torch.ones(1, 6, dtype=torch.long), past_key_values=cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="release got token_ids for 2 rows, the cache holds 1"):
        cache.release(token_ids=torch.ones(2, 8, dtype=torch.long))
    cache.release()
    assert pool.num_used_blocks == 0


def test_release_refuses_token_ids_after_beam_search_and_caches_nothing():
    """After beam search the rows are beams and generate() returns its hypotheses by score: row i need not hold
    out[i]'s tokens, so caching row i's blocks under out[i]'s hashes would hand a later from_prefix other K/V."""
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=64, block_size=2, enable_prefix_caching=True)
    prompt = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    cache = PagedCache(config=model.config, pool=pool)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=8, num_beams=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="after beam search: the cache's rows are its beams"):
        cache.release(token_ids=out)
    assert pool.num_used_blocks == 0 and pool.stats()["cached_blocks"] == 0
    # Released, the cache is empty and not beams any more: a greedy generation's blocks are cached again.
    greedy = model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False)
    cache.release(token_ids=greedy)
    assert pool.stats()["cached_blocks"] == 12 // 2  # prompt + 3 fed tokens
    with PagedCache.from_prefix(pool, greedy, model.config) as hit:
        assert hit.get_seq_length() == 12
        assert torch.equal(model.generate(greedy, past_key_values=hit, max_new_tokens=4), _cold(model, greedy, 4))


# ------------------------------------------------------------------------------------------------ regressions
# What the machine found: an update() that raised PoolExhausted held the blocks it held before, but had changed the
# prefix cache (it took fresh blocks, then failed on a copy-on-write). Now it counts fresh blocks and copies first.
def test_failed_update_keeps_cached_free_blocks():
    """Two forked rows diverge past their half-full shared block: 2 new blocks fit the 2 free (cached) ones, the
    copy of the shared block does not. The update must fail without evicting the 2 cached blocks."""
    pool = BlockPool(LAYOUT, num_blocks=5, block_size=4, enable_prefix_caching=True)
    first = PagedCache(pool=pool)
    update_rows(first, [[1] * 8])
    first.release(token_ids=[[1] * 8])
    assert pool.allocator.num_cached_blocks == 2 and pool.num_free_blocks == 5
    forked = PagedCache(pool=pool)
    update_rows(forked, [[2] * 6])
    forked.batch_repeat_interleave(2)
    other = PagedCache(pool=pool)
    update_rows(other, [[3]])
    assert pool.num_free_blocks == 2 and all(pool.allocator.is_cached(b) for b in pool.allocator.free_queue())
    # 1 fresh block for each of the 2 diverged rows, and 1 copy of their shared half-full block
    with pytest.raises(PoolExhausted, match=r"need 3 blocks, 2 free of 5"):
        update_rows(forked, [[2] * 6 + [1] * 6, [2] * 6 + [3] * 6], num_past=6)
    assert forked.block_tables == [[2, 3], [2, 3]] and pool.num_free_blocks == 2
    assert pool.allocator.num_cached_blocks == 2, "the failed update evicted cached blocks"


def test_failed_update_keeps_the_hash_of_a_block_it_did_not_write():
    """A cached prefix shared by two forked rows, cropped into its last block: the rows diverge, one must copy the
    block (no block is free), the other would write it in place. The update fails; the block was not written."""
    pool = BlockPool(LAYOUT, num_blocks=2, block_size=4, enable_prefix_caching=True)
    first = PagedCache(pool=pool)
    update_rows(first, [[1] * 8])
    first.release(token_ids=[[1] * 8])
    cache = PagedCache.from_prefix(pool, [1] * 9)
    assert cache.block_tables == [[0, 1]]
    cache.batch_repeat_interleave(2)
    cache.crop(-2)
    with pytest.raises(PoolExhausted, match=r"need 1 blocks, 0 free of 2"):
        update_rows(cache, [[1] * 6 + [2, 2], [1] * 6 + [3, 3]], num_past=6)
    assert cache.block_tables == [[0, 1], [0, 1]] and cache.get_seq_length() == 6
    assert pool.allocator.num_cached_blocks == 2, "the failed update forgot the hash of a block it did not write"
