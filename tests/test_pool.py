"""BlockPool: sizing from blocks or bytes, stats, validation, copy and growth."""

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from hf_paged import BlockPool, KVLayout, PoolMismatch

LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_layout_from_llama_and_gpt2_configs():
    assert KVLayout.from_config(LLAMA) == KVLayout((2, 2, 2), (16, 16, 16))
    gpt2 = GPT2Config(n_layer=2, n_head=4, n_embd=32)
    assert KVLayout.from_config(gpt2) == KVLayout((4, 4), (8, 8))


def test_bytes_per_block_and_budget_sizing():
    pool = BlockPool.for_model(LLAMA, max_memory="1MiB", block_size=16, dtype=torch.float16)
    # K and V, 3 layers, 16 tokens, 2 heads x 16 dims, 2 bytes.
    assert pool.bytes_per_block == 2 * 3 * 16 * 2 * 16 * 2 == 6144
    assert pool.num_blocks == (1 << 20) // 6144 == 170
    assert pool.key_cache[0].shape == (2, 170, 16, 16)
    assert pool.key_cache[0].dtype == torch.float16
    assert BlockPool.for_model(LLAMA, max_memory=6144 * 5, dtype=torch.float16).num_blocks == 5


def test_stats_track_used_and_free():
    pool = BlockPool.for_model(LLAMA, num_blocks=10, block_size=4)
    pool.allocator.allocate(3)
    stats = pool.stats()
    assert stats["used_blocks"] == 3 and stats["free_blocks"] == 7 and stats["num_blocks"] == 10
    assert stats["used_bytes"] == 3 * pool.bytes_per_block
    assert stats["total_bytes"] == stats["used_bytes"] + stats["free_bytes"]


def test_for_model_follows_the_model_dtype():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(LLAMA).to(torch.bfloat16)
    pool = BlockPool.for_model(model, num_blocks=2)
    assert pool.dtype == torch.bfloat16 and pool.device == model.device


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_blocks=0), "num_blocks must be a positive int"),
        (dict(num_blocks=-3), "num_blocks must be a positive int"),
        (dict(num_blocks=4, block_size=0), "block_size must be a positive int"),
        (dict(), "exactly one of num_blocks and max_memory"),
        (dict(num_blocks=4, max_memory="1MiB"), "exactly one of num_blocks and max_memory"),
        (dict(max_memory="1KiB"), "holds no block"),
        (dict(max_memory=-5), "max_memory must be a positive byte count"),
        (dict(max_memory="lots"), "max_memory must be a positive byte count"),
    ],
)
def test_bad_sizes_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockPool.for_model(LLAMA, **kwargs)


def test_check_states_names_the_mismatch():
    pool = BlockPool.for_model(LLAMA, num_blocks=2)
    pool.check_states(0, torch.zeros(1, 2, 5, 16))
    with pytest.raises(PoolMismatch, match=r"pool holds 2 kv heads x head_dim 16, key_states have 4 x 16"):
        pool.check_states(0, torch.zeros(1, 4, 5, 16))
    with pytest.raises(PoolMismatch, match=r"torch.float32 on cpu, key_states are torch.float16"):
        pool.check_states(0, torch.zeros(1, 2, 5, 16, dtype=torch.float16))
    with pytest.raises(PoolMismatch, match="3 layers"):
        pool.check_states(3, torch.zeros(1, 2, 5, 16))
    other = LlamaConfig(**{**LLAMA.to_dict(), "num_hidden_layers": 2})
    with pytest.raises(PoolMismatch, match="pool was built for 3 layers.*the model has 2 layers"):
        pool.check_compatible(KVLayout.from_config(other))


def test_copy_blocks_copies_every_layer_k_and_v():
    pool = BlockPool.for_model(LLAMA, num_blocks=4, block_size=2)
    for cache in (*pool.key_cache, *pool.value_cache):
        cache.copy_(torch.randn_like(cache))
    pool.copy_blocks([1, 3], [0, 2])
    for cache in (*pool.key_cache, *pool.value_cache):
        assert torch.equal(cache[:, 0], cache[:, 1]) and torch.equal(cache[:, 2], cache[:, 3])


def test_grow_keeps_data_and_only_growable_pools_grow():
    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=2, block_size=2, growable=True)
    pool.key_cache[0][:, 1].fill_(7.0)
    pool.grow(3)
    assert pool.num_blocks == 5 and pool.key_cache[0].shape[1] == 5
    assert torch.all(pool.key_cache[0][:, 1] == 7.0)
    fixed = BlockPool(KVLayout((2,), (4,)), num_blocks=2)
    with pytest.raises(RuntimeError, match="not growable"):
        fixed.grow(1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_what_the_store_keeps_of_a_layer_goes_with_the_tensors_a_grow_replaces(backend, monkeypatch):
    """The store's views of a layer (torch) or its kernel launch into it (Triton) live in the pool's layer memo,
    which a grow drops: the replaced K/V tensors are freed, and the next store writes the new ones."""
    import gc
    import weakref

    from hf_paged.cache.store import KVStore

    if backend == "triton":
        from models import require_triton_on_cpu

        require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", backend)
    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=2, block_size=2, growable=True)
    store = KVStore()
    store.start_step(pool, multi_device=False)
    states = torch.ones(1, 2, 1, 4)
    store.store(pool, 0, states, states, torch.tensor([1]), None, None)
    assert pool.layer_memo(0)  # the views or the launch, kept for the next step
    old = weakref.ref(pool.key_cache[0])
    pool.grow(3)
    gc.collect()
    assert old() is None and not pool.layer_memo(0)
    store.store(pool, 0, 2 * states, 2 * states, torch.tensor([9]), None, None)  # slot 9: a block the grow added
    assert torch.all(pool.key_cache[0][:, 4, 1] == 2.0) and torch.all(pool.key_cache[0][:, 0, 1] == 1.0)
