"""pytest-benchmark microbenchmarks of the hot paths: allocator operations and PagedCache.update.

CI runs these once each with --benchmark-disable (a smoke test); `make microbench` times them for real.
Each still asserts its result, so a broken hot path fails here too.
"""

import pytest
import torch

from hf_paged import BlockAllocator, BlockPool, KVLayout, PagedCache


def test_allocate_free_cycle(benchmark):
    allocator = BlockAllocator(4096)

    def cycle():
        block_ids = allocator.allocate(64)
        allocator.free(block_ids)
        return block_ids

    assert len(benchmark(cycle)) == 64
    assert allocator.num_free_blocks == 4096


def test_fork_and_copy_on_write(benchmark):
    allocator = BlockAllocator(4096)
    table = allocator.allocate(64)

    def fork_then_write_last_block():
        allocator.incref(table)
        new = allocator.copy_on_write(table[-1])
        allocator.free(table[:-1] + [new])
        return new

    assert benchmark(fork_then_write_last_block) != table[-1]
    assert allocator.num_used_blocks == 64


def _filled_cache(batch_size: int, context: int, num_layers: int = 4):
    layout = KVLayout((4,) * num_layers, (64,) * num_layers)
    pool = BlockPool(layout, num_blocks=batch_size * (context // 16 + 4), block_size=16)
    cache = PagedCache(pool=pool)
    states = torch.randn(batch_size, 4, context, 64)
    for layer_idx in range(num_layers):
        cache.update(states, states, layer_idx)
    return cache, num_layers


@pytest.mark.parametrize("batch_size, context", [(1, 512), (16, 512)])
def test_cache_update_decode_step(benchmark, batch_size, context):
    """One decode step of every layer: store one token per row, gather the whole context."""
    cache, num_layers = _filled_cache(batch_size, context)
    step = torch.randn(batch_size, 4, 1, 64)

    def decode_step():
        for layer_idx in range(num_layers):
            keys, _ = cache.update(step, step, layer_idx)
        cache.crop(-1)  # keep the context fixed across rounds
        return keys

    keys = benchmark(decode_step)
    assert keys.shape == (batch_size, 4, context + 1, 64)
    assert torch.equal(keys[:, :, -1], step[:, :, 0])
    cache.release()
