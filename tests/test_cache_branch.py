"""`copy.deepcopy(PagedCache)`: a branch sharing every block copy-on-write, as users copy a DynamicCache to continue
one prompt several ways."""

import copy

import pytest
import torch
from transformers import DynamicCache

from hf_paged import BlockPool, PagedCache
from tests.models import random_prompt, tiny_model

BLOCK_SIZE = 4


def _prefill(model, cache, prompt):
    with torch.no_grad():
        return model(prompt, past_key_values=cache).past_key_values


def _continue(model, cache, prompt, suffix, max_new_tokens=6):
    input_ids = torch.cat([prompt, suffix], dim=1)
    return model.generate(input_ids, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_branches_continue_like_copied_dynamic_caches(name):
    model = tiny_model(name)
    prompt = random_prompt(10)  # 2 full blocks and a partial one
    suffixes = [random_prompt(3, seed=1), random_prompt(5, seed=2)]
    dynamic = _prefill(model, DynamicCache(config=model.config), prompt)
    expected = [_continue(model, copy.deepcopy(dynamic), prompt, suffix) for suffix in suffixes]

    pool = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE)
    cache = _prefill(model, PagedCache(config=model.config, pool=pool), prompt)
    held = pool.num_used_blocks
    tables = [cache.layer_block_tables(layer) for layer in range(len(cache.layers))]
    keys_before = [layer.clone() for layer in pool.key_cache]

    branches = [copy.deepcopy(cache) for _ in suffixes]
    assert pool.num_used_blocks == held  # a branch shares every block
    assert all(branch.get_seq_length() == 10 and branch.pool is pool for branch in branches)
    for branch, suffix, reference in zip(branches, suffixes, expected):
        assert torch.equal(_continue(model, branch, prompt, suffix), reference)

    # The original kept its blocks and its K/V: each branch copied the partial block it wrote to.
    assert [cache.layer_block_tables(layer) for layer in range(len(cache.layers))] == tables
    for layer, before in enumerate(keys_before):
        for block_id in tables[layer][0]:
            assert torch.equal(pool.key_cache[layer][:, block_id], before[:, block_id])
    full = next(layer.layer_idx for layer in cache.layers if not layer.is_sliding)  # a layer that keeps every block
    assert all(branch.layer_block_tables(full)[0][:2] == tables[full][0][:2] for branch in branches)  # shared
    assert all(branch.layer_block_tables(full)[0][2] != tables[full][0][2] for branch in branches)  # copied
    for branch in branches:
        branch.release()
    assert pool.num_used_blocks == held
    assert torch.equal(_continue(model, cache, prompt, suffixes[0]), expected[0])
    cache.release()
    assert pool.num_used_blocks == 0
    pool.allocator.check_invariants()


def test_branch_of_a_cache_with_a_private_pool_shares_that_pool():
    model = tiny_model("llama")
    prompt = random_prompt(9)
    cache = _prefill(model, PagedCache(config=model.config, block_size=BLOCK_SIZE), prompt)
    branch = copy.deepcopy(cache)
    assert branch.pool is cache.pool and branch.block_tables == cache.block_tables
    expected = _continue(
        model,
        copy.deepcopy(_prefill(model, DynamicCache(config=model.config), prompt)),
        prompt,
        random_prompt(2, seed=3),
    )
    assert torch.equal(_continue(model, branch, prompt, random_prompt(2, seed=3)), expected)
    branch.release()
    cache.release()
    assert cache.pool.num_used_blocks == 0


def test_branch_of_an_empty_cache_is_empty():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=8, block_size=BLOCK_SIZE)
    branch = copy.deepcopy(PagedCache(config=model.config, pool=pool))
    assert branch.get_seq_length() == 0 and branch.block_tables == [] and pool.num_used_blocks == 0


def test_a_cropped_parent_rewriting_a_block_its_branch_holds_copies_it_first():
    """Fork, then crop the parent back inside its last block (no block dropped) and write that position again: the
    write copies the block the branch still reads instead of writing into it."""
    from hf_paged import KVLayout

    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=32, block_size=BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)

    def states(num_tokens):
        return torch.randn(1, 2, num_tokens, 4, generator=generator)

    parent, reference = PagedCache(pool=pool), DynamicCache()
    for new in (states(6), states(1)):  # position 6 written: the write plan for [6, 7) is remembered
        parent.update(new, new, 0)
        reference.update(new, new, 0)
    branch = copy.deepcopy(parent)
    parent.crop(-1)  # back to 6 tokens, inside the last block: no block dropped
    rewritten = states(1)
    parent.update(rewritten, rewritten, 0)
    after = states(1)
    keys, _ = branch.update(after, after, 0)
    assert torch.equal(keys, reference.update(after, after, 0)[0])
    assert parent.block_tables[0][-1] != branch.block_tables[0][-1]  # the parent wrote into a copy
