"""Per-rank layouts in one process: what tensor parallelism changes in KVLayout, BlockPool and PagedCache.

The ranks themselves run in tests/test_tensor_parallel.py (torchrun, 2 CPU ranks); these tests pin the single-process
pieces: a config with an explicit `tp_size`, a model's sharding read from its plan, the hint a mismatch gives.
"""

import copy

import pytest
import torch

from hf_paged import BlockPool, Engine, KVLayout, PagedCache, PoolMismatch
from hf_paged.errors import ServeUnavailable, UnsupportedModel
from hf_paged.storage.sharding import agree_num_blocks, kv_shard_factors
from tests.models import tiny_model


def test_config_with_tp_size_gives_one_ranks_heads():
    config = tiny_model("llama").config  # 2 kv heads x 16, 2 layers
    layout = KVLayout.from_config(config, tp_size=2)
    assert layout == KVLayout((1, 1), (16, 16)) and layout.tp_size == 2
    assert KVLayout.from_config(config) == KVLayout((2, 2), (16, 16))
    with pytest.raises(ValueError, match="layer 0 has 2 kv heads, which do not split over tp_size=4"):
        KVLayout.from_config(config, tp_size=4)
    sliding = KVLayout.from_config(tiny_model("mistral").config, tp_size=2)
    assert sliding.num_kv_heads == (1, 1) and sliding.windows == (8, 8)


def test_pool_of_one_rank_serves_the_full_config_and_stores_half_the_heads():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model.config, tp_size=2, max_memory=2 * 1024 * 8, block_size=4)
    # K and V, 2 layers, 4 tokens, 1 head x 16 dims, 4 bytes: half the bytes of a block of every head.
    assert pool.bytes_per_block == 2 * 2 * 4 * 1 * 16 * 4 == 1024
    assert pool.num_blocks == 16  # no process group: this process's budget alone
    assert pool.key_cache[0].shape == (1, 16, 4, 16)
    cache = PagedCache(config=model.config, pool=pool)  # the config's layout (2 heads) fits a 2-rank pool
    keys = torch.randn(1, 1, 5, 16)
    out_keys, _ = cache.update(keys, keys.clone(), 0)
    torch.testing.assert_close(out_keys, keys)
    with pytest.raises(PoolMismatch, match="pool holds 1 kv heads x head_dim 16, key_states have 2 x 16"):
        cache.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), 1)
    cache.release()
    assert pool.num_used_blocks == 0


def test_paged_cache_with_tp_size_builds_a_private_pool_of_one_ranks_heads():
    cache = PagedCache(config=tiny_model("mistral").config, tp_size=2, block_size=4)
    keys = torch.randn(2, 1, 6, 16)
    cache.update(keys, keys.clone(), 0)
    assert cache.pool.key_cache[0].shape[0] == 1 and cache.pool.layout.tp_size == 2


def test_a_config_alone_without_a_process_group_keeps_every_head_and_names_the_fix():
    cache = PagedCache(config=tiny_model("llama").config)
    fix = r"under tensor parallelism .* pass tp_size \(PagedCache\(config, tp_size=N\)"
    with pytest.raises(PoolMismatch, match=fix):
        cache.update(torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16), 0)


def test_sharding_falls_back_to_the_plan_when_k_proj_is_no_dtensor():
    model = copy.deepcopy(tiny_model("llama"))
    assert kv_shard_factors(model, (2, 2)) == (1, 1)  # loaded without a plan: one rank
    model._tp_size = 2  # what from_pretrained(tp_plan=...) sets; the weights stay plain tensors here
    assert kv_shard_factors(model, (2, 2)) == (2, 2)  # Llama's plan shards k_proj and v_proj
    layout = KVLayout.from_config(model)
    assert layout.num_kv_heads == (1, 1) and layout.tp_size == 2
    with pytest.raises(ValueError, match="tp_size=4 but the model runs on 2 tensor-parallel rank"):
        KVLayout.from_config(model, tp_size=4)
    # A pool built from the config alone holds every head: the Engine names the fix.
    with pytest.raises(PoolMismatch, match=r"tensor parallel over 2 ranks\); build the pool from the model"):
        Engine(model, BlockPool.for_model(model.config, num_blocks=8))
    assert Engine(copy.deepcopy(model), BlockPool.for_model(model.config, num_blocks=8, tp_size=2), max_num_seqs=4)
    with pytest.raises(UnsupportedModel, match="layer 0 has 2 kv heads, which do not split over 4"):
        model._tp_size = 4
        kv_shard_factors(model, (2, 2))


def test_agree_num_blocks_without_a_process_group_is_the_count_itself():
    assert agree_num_blocks(37) == 37


def test_hf_paged_serve_refuses_a_torchrun_launch():
    from hf_paged.__main__ import main, refuse_distributed_launch

    refuse_distributed_launch({"WORLD_SIZE": "1"})
    with pytest.raises(ServeUnavailable, match="runs in one process, got WORLD_SIZE=2"):
        refuse_distributed_launch({"WORLD_SIZE": "2"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit, match="hf-paged: hf-paged serve runs in one process"):
            main(["serve", "some/model"])
