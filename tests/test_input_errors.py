"""What a user can get wrong with a pool or a cache gets a typed error that names the allowed values and the actual
ones, raised before anything is allocated or changed; a refused call never keeps blocks."""

import time

import pytest
import torch
from transformers import DynamicCache

from hf_paged import BlockPool, GradientsUnsupported, PagedCache, PoolExhausted, PoolMismatch, PoolTooLarge
from hf_paged.storage import parse_memory
from tests.models import random_prompt, tiny_model


@pytest.mark.parametrize(
    "max_memory, num_bytes",
    [(536870912, 536870912), (2e9, 2 * 10**9), ("512MiB", 512 * 2**20), ("0.5GB", 5 * 10**8), ("2G", 2 * 10**9),
     ("2 gib", 2 * 2**30), ("1TiB", 2**40), ("3K", 3000), ("7", 7)],
)  # fmt: skip
def test_memory_sizes(max_memory, num_bytes):
    assert parse_memory(max_memory) == num_bytes


@pytest.mark.parametrize("max_memory", ["lots", "2 GB of RAM", "", "1PiB", -5, 0, True, float("inf"), [1]])
def test_bad_memory_sizes_name_the_forms(max_memory):
    with pytest.raises(ValueError, match=r"max_memory must be a positive byte count .* '2G' .* got "):
        parse_memory(max_memory)


def test_dtype_names_are_accepted_and_bad_ones_refused_up_front():
    model = tiny_model("llama")
    assert BlockPool.for_model(model, num_blocks=2, dtype="bfloat16").dtype == torch.bfloat16
    assert BlockPool.for_model(model, num_blocks=2, dtype="torch.float16").dtype == torch.float16
    for dtype in ("bf16", "int8", torch.int64):
        with pytest.raises(ValueError, match=rf"dtype must be a floating torch.dtype or its name .* got {dtype!r}"):
            BlockPool.for_model(model, num_blocks=2, dtype=dtype)
        with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
            PagedCache(config=model.config, dtype=dtype)


@pytest.mark.parametrize(
    "name, value", [("block_size", True), ("block_size", 0), ("num_blocks", True), ("num_blocks", 2.0)]
)
def test_sizes_must_be_positive_ints(name, value):
    model = tiny_model("llama")
    kwargs = {"num_blocks": 4, name: value}
    with pytest.raises(ValueError, match=rf"{name} must be a positive int, got {value!r}"):
        BlockPool.for_model(model, **kwargs)


def test_a_pool_larger_than_the_device_is_refused_before_allocating():
    model = tiny_model("llama")
    started = time.perf_counter()
    with pytest.raises(PoolTooLarge, match=r"a pool of 1000000000000 blocks .* more than the .* GiB cpu can hold"):
        BlockPool.for_model(model, num_blocks=10**12)
    with pytest.raises(PoolTooLarge, match="lower num_blocks or max_memory"):
        BlockPool.for_model(model, max_memory="1024TiB")
    assert time.perf_counter() - started < 1.0


def test_a_model_or_a_path_where_a_config_belongs():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"PagedCache takes the model's config, got the model \(LlamaForCausalLM\)"):
        PagedCache(model)
    with pytest.raises(TypeError, match="expected a transformers model or its config, got str .*from_pretrained"):
        BlockPool.for_model("path/to/checkpoint", num_blocks=4)
    with pytest.raises(TypeError, match="pool must be a BlockPool"):
        PagedCache(config=model.config, pool="pool")


def test_pool_exhausted_says_what_to_change():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=1, block_size=4)
    with pytest.raises(PoolExhausted, match=r"need 2 blocks, 1 free of 1; give the pool more blocks .*max_memory"):
        model.generate(random_prompt(5), past_key_values=PagedCache(config=model.config, pool=pool), max_new_tokens=2)
    assert pool.num_used_blocks == 0


def test_prefix_calls_need_a_prefix_caching_pool_and_release_anyway():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    prompt = random_prompt(9)
    with pytest.raises(ValueError, match=r"from_prefix needs a pool with prefix caching: .*enable_prefix_caching=True"):
        PagedCache.from_prefix(pool, prompt, model.config)
    cache = PagedCache(config=model.config, pool=pool)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"release\(token_ids=...\) needs a pool with prefix caching"):
        cache.release(token_ids=out)
    assert pool.num_used_blocks == 0


def test_release_refuses_token_ids_shorter_than_what_was_computed():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4, enable_prefix_caching=True)
    cache = PagedCache(config=model.config, pool=pool)
    out = model.generate(random_prompt(9), past_key_values=cache, max_new_tokens=4)  # 12 tokens computed
    with pytest.raises(ValueError, match="release got a row of 8 token_ids, the cache computed 12 per row"):
        cache.release(token_ids=out[:, :8])
    assert pool.num_used_blocks == 0 and pool.allocator.num_cached_blocks == 0


def test_a_cache_built_for_another_layer_count_is_refused():
    deeper, shallower = tiny_model("llama", num_layers=4), tiny_model("llama", num_layers=2)
    with pytest.raises(PoolMismatch, match="layer_idx 2: this PagedCache was built for 2 layers"):
        deeper.generate(random_prompt(5), past_key_values=PagedCache(config=shallower.config), max_new_tokens=2)
    with pytest.raises(PoolMismatch, match=r"the model's forward updated layers 0..1 of this PagedCache, built for 4"):
        shallower.generate(random_prompt(5), past_key_values=PagedCache(config=deeper.config), max_new_tokens=2)


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_a_cache_built_from_the_pool_alone_releases_out_of_window_blocks(name):
    model = tiny_model(name)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    held = []
    for kwargs in ({"config": model.config}, {}, {"config": model.config, "release_out_of_window": False}):
        cache = PagedCache(pool=pool, **kwargs)
        model.generate(random_prompt(6), past_key_values=cache, max_new_tokens=30)
        held.append(cache.held_blocks_per_group)
        cache.release()
    assert held[1] == held[0] and sum(held[0]) < sum(held[2])  # the sliding groups gave blocks back


def test_a_prefix_caching_pool_serves_one_model(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    paths = []
    for seed in (0, 1):
        paths.append(tmp_path / f"model{seed}")
        tiny_model("llama", seed=seed).save_pretrained(paths[-1])
    first, second = (AutoModelForCausalLM.from_pretrained(path) for path in paths)
    pool = BlockPool.for_model(first, num_blocks=8, block_size=4, enable_prefix_caching=True)
    PagedCache(config=AutoConfig.from_pretrained(paths[0]), pool=pool)  # another config of the same checkpoint
    with pytest.raises(PoolMismatch, match=rf"caches prefixes of {paths[0]}, not of {paths[1]}: .*its own BlockPool"):
        PagedCache(config=second.config, pool=pool)
    with pytest.raises(PoolMismatch, match="a prefix-caching pool serves one model"):
        PagedCache.from_prefix(pool, random_prompt(9), second.config)
    with pytest.raises(PoolMismatch, match="not of LlamaForCausalLM"):
        pool.serve_model(tiny_model("llama", seed=1))
    assert pool.num_used_blocks == 0
    # Without prefix caching no block is ever found by another cache: models of one shape may share a pool.
    PagedCache(config=second.config, pool=BlockPool.for_model(first, num_blocks=8, block_size=4))


def _kv(batch: int, q_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V of the tiny models' shape: [batch, 2 kv heads, q_len, 16]."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, 2, q_len, 16, generator=generator) for _ in range(2))


@pytest.mark.parametrize("name", ["llama", "gemma3"])  # one layer group; a sliding and a full group
@pytest.mark.parametrize("grad_of", ["key", "value"])
def test_states_that_require_grad_are_refused_with_the_step_undone(name, grad_of):
    """Layer 1's K or V require grad (a model trained from that layer on) after layer 0 stored the step: the refusal
    puts layer 0 back and gives back the step's blocks, so the step runs again as DynamicCache runs it."""
    model = tiny_model(name)
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    cache, dynamic = PagedCache(config=model.config, pool=pool), DynamicCache(config=model.config)
    for step, q_len in enumerate((8, 1, 1)):  # a first prefill, then decode steps (the first needs a new block)
        states = [_kv(2, q_len, seed=10 * step + layer) for layer in range(2)]
        used, lengths = pool.num_used_blocks, [layer.cumulative_length for layer in cache.layers]
        cache.update(*states[0], 0)
        key, value = states[1]
        refused = (key.clone().requires_grad_(), value) if grad_of == "key" else (key, value.clone().requires_grad_())
        with pytest.raises(GradientsUnsupported, match=r"layer 1's key_states/value_states require grad.*no_grad"):
            cache.update(*refused, 1)
        assert pool.num_used_blocks == used
        assert [layer.cumulative_length for layer in cache.layers] == lengths
        assert cache.get_seq_length() == sum(lengths) // 2
        for layer in range(2):
            got, expected = cache.update(*states[layer], layer), dynamic.update(*states[layer], layer)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(cache.layer_groups) == (2 if name == "gemma3" else 1)
    cache.release()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("max_cache_len", [None, 32])  # an eager cache; a compileable one's reserved steps
def test_a_forward_with_autograd_is_refused_and_runs_again_under_no_grad(max_cache_len):
    """A model whose parameters require grad, called outside torch.no_grad() (generate() runs under it): every forward
    is refused at layer 0 with the cache as it was (a compileable cache keeps the blocks it reserved for that forward,
    before it), and the same forward then runs under no_grad as DynamicCache's."""
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=16, block_size=4)
    cache = PagedCache(config=model.config, pool=pool, max_cache_len=max_cache_len)
    dynamic = DynamicCache(config=model.config)
    input_ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    reservations = 0  # refused forwards that kept blocks reserved for them
    for _ in range(3):  # a first prefill (a compileable cache reserves nothing for it), then decode steps
        used = pool.num_used_blocks
        assert torch.is_grad_enabled() and next(model.parameters()).requires_grad
        with pytest.raises(GradientsUnsupported, match="layer 0's"):
            model(input_ids, past_key_values=cache)
        reserved = pool.num_used_blocks
        reservations += reserved != used
        with torch.no_grad():
            got = model(input_ids, past_key_values=cache).logits
            expected = model(input_ids, past_key_values=dynamic).logits
        torch.testing.assert_close(got, expected)
        if reserved != used:
            assert pool.num_used_blocks == reserved  # the forward used the reservation
        input_ids = expected[:, -1:].argmax(-1)
    assert reservations == (1 if max_cache_len else 0)  # the 9th token's blocks: one reservation of a new block a row
    cache.release()
    assert pool.num_used_blocks == 0
