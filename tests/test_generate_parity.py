"""`generate()` with a PagedCache gives exactly the tokens of `generate()` with a DynamicCache.

The matrix is model x mode x attention implementation; every case compares whole output sequences with
`torch.equal` and then checks that the shared pool got every block back. Further down: the prompt of
`num_return_sequences` / `num_beams` rows is stored once, and the typed errors a user can hit (pool shape or dtype
mismatch, bad sizes, pool exhaustion) leave the pool clean.
"""

from __future__ import annotations

import gc

import pytest
import torch
from models import ATTN_IMPLEMENTATIONS, MODEL_NAMES, left_padded_batch, random_prompt, tiny_assistant, tiny_model
from transformers import DynamicCache

from hf_paged import BlockPool, KVLayout, PoolExhausted, PoolMismatch
from hf_paged.cache import PagedCache

PROMPT_LEN = 13  # not a multiple of BLOCK_SIZE: the prompt ends inside a block
MAX_NEW_TOKENS = 12
BLOCK_SIZE = 4  # small, so a ~25-token sequence spans several blocks and ends in a partial one
SHARED_POOL_BLOCKS = 96  # room for the largest case: 3 beams x ~33 tokens, no sharing
SEED = 1234

MODES = (
    "greedy",
    "left_padded",
    "sample_n",
    "beams",
    "assisted",
    "prompt_lookup",
    "prefill_chunks",
    "second_turn",
)

# Every (model, mode) pair runs: transformers 5.23 supports all of them with DynamicCache (assisted decoding and
# chunked prefill included, for the sliding-window models too), so nothing is skipped. Should a pair ever need a
# skip, it must be because DynamicCache fails it too, never to hide a PagedCache failure.


def _generate(model, cache, input_ids, **kwargs) -> torch.Tensor:
    torch.manual_seed(SEED)  # the same draws for both caches (sampling); harmless for greedy
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, **kwargs}
    return model.generate(input_ids, past_key_values=cache, **kwargs)


def run_mode(mode: str, name: str, model, cache) -> torch.Tensor:
    """Run one generate() scenario on `cache`; returns the output sequences `[rows, seq_len]` int64."""
    prompt = random_prompt(PROMPT_LEN)
    if mode == "greedy":
        return _generate(model, cache, prompt)
    if mode == "left_padded":
        input_ids, attention_mask = left_padded_batch(3, PROMPT_LEN)
        return _generate(model, cache, input_ids, attention_mask=attention_mask)
    if mode == "sample_n":
        return _generate(model, cache, prompt, do_sample=True, num_return_sequences=3)
    if mode == "beams":
        return _generate(model, cache, prompt, num_beams=3, num_return_sequences=2)
    if mode == "assisted":
        assistant = tiny_assistant(name, model.config._attn_implementation)
        return _generate(model, cache, prompt, assistant_model=assistant)
    if mode == "prompt_lookup":
        # A repeated span gives the n-gram lookup something to propose.
        repetitive = torch.cat([prompt, prompt[:, :6], prompt[:, :6]], dim=1)
        return _generate(model, cache, repetitive, prompt_lookup_num_tokens=3)
    if mode == "prefill_chunks":
        input_ids, attention_mask = left_padded_batch(3, PROMPT_LEN)
        return _generate(model, cache, input_ids, attention_mask=attention_mask, prefill_chunk_size=8)
    if mode == "second_turn":
        # Turn 1, then the user adds 4 tokens and turn 2 continues on the same cache object.
        first = _generate(model, cache, prompt, max_new_tokens=8)
        user_turn = random_prompt(4, seed=1)
        return _generate(model, cache, torch.cat([first, user_turn], dim=1), max_new_tokens=8)
    raise ValueError(f"unknown mode {mode!r}; choose one of {list(MODES)}")


def assert_same_tokens(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != DynamicCache's {tuple(expected.shape)}"
    if not torch.equal(actual, expected):
        row, col = (actual != expected).nonzero()[0].tolist()
        raise AssertionError(
            f"first difference at row {row}, position {col}:\n paged   {actual[row].tolist()}\n"
            f" dynamic {expected[row].tolist()}"
        )


def assert_pool_clean(pool: BlockPool) -> None:
    assert pool.num_used_blocks == 0, pool.stats()
    pool.allocator.check_invariants()


@pytest.fixture(scope="module")
def shared_pool():
    """`shared_pool(name)`: one pool per model family, shared by every case of this module (sdpa and eager)."""
    pools: dict[str, BlockPool] = {}

    def get(name: str) -> BlockPool:
        if name not in pools:
            pools[name] = BlockPool.for_model(tiny_model(name), num_blocks=SHARED_POOL_BLOCKS, block_size=BLOCK_SIZE)
        return pools[name]

    return get


# ------------------------------------------------------------------------------------------------ parity matrix
@pytest.mark.parametrize("attn", ATTN_IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_generate_parity(name, mode, attn, shared_pool):
    model = tiny_model(name, attn)
    pool = shared_pool(name)
    assert_pool_clean(pool)  # an earlier case left nothing behind

    expected = run_mode(mode, name, model, DynamicCache(config=model.config))
    with PagedCache(config=model.config, pool=pool) as cache:
        actual = run_mode(mode, name, model, cache)
        assert cache.num_held_blocks > 0
        assert pool.num_used_blocks == cache.num_held_blocks  # the only cache on this pool
        assert cache.get_seq_length() == expected.shape[1] - 1  # the last token is never fed back
        cache.release()
        assert cache.num_held_blocks == 0
        assert_pool_clean(pool)
    assert_same_tokens(actual, expected)


@pytest.mark.parametrize("mode", ["greedy", "beams", "second_turn"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_private_pool_parity(name, mode):
    """No pool given: the cache builds a private, growable one from the first key_states."""
    model = tiny_model(name)
    expected = run_mode(mode, name, model, DynamicCache(config=model.config))
    cache = PagedCache(config=model.config, block_size=BLOCK_SIZE)
    assert cache.pool is None
    actual = run_mode(mode, name, model, cache)
    assert_same_tokens(actual, expected)
    pool = cache.pool
    assert pool is not None and pool.growable and pool.dtype == model.dtype
    assert pool.num_used_blocks == cache.num_held_blocks > 0
    cache.release()
    assert_pool_clean(pool)


# ------------------------------------------------------------------------------------------------ memory sharing
def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@pytest.mark.parametrize("kind", ["greedy_n", "sample_n", "beams"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_prompt_blocks_stored_once(name, kind, shared_pool):
    """n rows that start from one prompt hold its blocks once, not n times."""
    num_rows, prompt_len, num_new = 4, 20, 8
    model = tiny_model(name)
    pool = shared_pool(name)
    bs = pool.block_size
    prompt = random_prompt(prompt_len, seed=2)
    if kind == "greedy_n":
        # transformers rejects greedy num_return_sequences>1 (with DynamicCache too); a batch of n copies of one
        # prompt is what it would have expanded to.
        prompt = prompt.repeat(num_rows, 1)
    kwargs = {
        "greedy_n": {},
        "sample_n": dict(do_sample=True, num_return_sequences=num_rows),
        "beams": dict(num_beams=num_rows, num_return_sequences=num_rows),
    }[kind]
    expected = _generate(model, DynamicCache(config=model.config), prompt, max_new_tokens=num_new, **kwargs)
    with PagedCache(config=model.config, pool=pool) as cache:
        actual = _generate(model, cache, prompt, max_new_tokens=num_new, **kwargs)
        assert_same_tokens(actual, expected)
        num_cached = prompt_len + num_new - 1  # the last token is never fed back
        assert cache.get_seq_length() == num_cached
        unshared = num_rows * _blocks(num_cached, bs)
        # The prompt once; each row at most its own new-token blocks plus the copied-on-write partial block where
        # the prompt ends. NOTE: this holds for greedy too, not one row's blocks: identical rows of a CPU batch can
        # get K/V that differ in the last bit during decode (DynamicCache shows the same), and a row whose K/V
        # differ leaves its group.
        bound = _blocks(prompt_len, bs) + num_rows * (_blocks(num_new, bs) + 1)
        assert bound < unshared
        # Per layer group (gemma3 has a sliding and a full one): each stores the prompt once.
        for group, held in zip(cache.layer_groups, cache.held_blocks_per_group):
            assert held <= bound, (group, held, bound, cache.layer_block_tables(group[0]))
        assert pool.num_used_blocks == cache.num_held_blocks
        assert cache.held_bytes == cache.num_held_blocks * pool.bytes_per_block
        cache.release()
    assert_pool_clean(pool)


def test_share_rows_off_stores_every_row(shared_pool):
    """The control: with share_rows=False every row holds its own blocks."""
    model = tiny_model("llama")
    pool = shared_pool("llama")
    prompt = random_prompt(20, seed=2)
    with PagedCache(config=model.config, pool=pool, share_rows=False) as cache:
        _generate(model, cache, prompt, max_new_tokens=8, do_sample=True, num_return_sequences=4)
        assert cache.num_held_blocks == 4 * _blocks(27, pool.block_size)
    assert_pool_clean(pool)


# ------------------------------------------------------------------------------------------------ errors
def test_pool_for_other_kv_heads_raises_pool_mismatch():
    llama, gpt2 = tiny_model("llama"), tiny_model("gpt2")  # 2 kv heads vs 4 kv heads, both head_dim 16
    pool = BlockPool.for_model(gpt2, num_blocks=8)
    with pytest.raises(PoolMismatch, match=r"kv heads \[4\].*kv heads \[2\]"):
        PagedCache(config=llama.config, pool=pool)
    assert_pool_clean(pool)


def test_pool_for_other_layer_count_raises_pool_mismatch():
    pool = BlockPool.for_model(tiny_model("llama", num_layers=3), num_blocks=8)
    with pytest.raises(PoolMismatch, match=r"3 layers.*2 layers"):
        PagedCache(config=tiny_model("llama").config, pool=pool)


def test_pool_for_other_head_dim_raises_pool_mismatch():
    pool = BlockPool(KVLayout((2, 2), (32, 32)), num_blocks=8)
    with pytest.raises(PoolMismatch, match=r"head_dim \[32\].*head_dim \[16\]"):
        PagedCache(config=tiny_model("llama").config, pool=pool)


def test_pool_without_config_checks_shapes_at_update():
    """A cache given only a pool cannot check the model up front; the first update does, before allocating."""
    model = tiny_model("llama")
    pool = BlockPool.for_model(tiny_model("gpt2"), num_blocks=8)
    with PagedCache(pool=pool) as cache:
        with pytest.raises(PoolMismatch, match=r"4 kv heads x head_dim 16, key_states have 2 x 16"):
            _generate(model, cache, random_prompt(PROMPT_LEN))
    assert_pool_clean(pool)


def test_dtype_mismatch_raises_pool_mismatch():
    model = tiny_model("llama")  # float32
    pool = BlockPool.for_model(model, num_blocks=8, dtype=torch.float16)
    with PagedCache(config=model.config, pool=pool) as cache:
        with pytest.raises(PoolMismatch, match=r"torch.float16.*torch.float32"):
            _generate(model, cache, random_prompt(PROMPT_LEN))
    assert_pool_clean(pool)


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_non_positive_num_blocks_raises(num_blocks):
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        BlockPool.for_model(tiny_model("llama"), num_blocks=num_blocks)


@pytest.mark.parametrize("block_size", [0, -4])
def test_non_positive_block_size_raises(block_size):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockPool.for_model(model, num_blocks=8, block_size=block_size)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        PagedCache(config=model.config, block_size=block_size)


def test_pool_exhaustion_during_generate():
    """PoolExhausted names the numbers; the failed cache releases cleanly; a cache beside it keeps working."""
    model = tiny_model("llama")
    bs, num_blocks = 4, 10
    pool = BlockPool.for_model(model, num_blocks=num_blocks, block_size=bs)
    prompt = random_prompt(PROMPT_LEN)
    dynamic = DynamicCache(config=model.config)
    expected_first = _generate(model, dynamic, prompt, max_new_tokens=4)

    survivor = PagedCache(config=model.config, pool=pool)
    first = _generate(model, survivor, prompt, max_new_tokens=4)
    assert_same_tokens(first, expected_first)
    survivor_blocks = survivor.block_tables
    num_survivor_blocks = survivor.num_held_blocks
    assert num_survivor_blocks == _blocks(PROMPT_LEN + 4 - 1, bs)

    # 13 + 16 - 1 tokens need 7 blocks; only 10 - 4 = 6 are free, so a decode step runs out.
    doomed = PagedCache(config=model.config, pool=pool)
    with pytest.raises(PoolExhausted) as info:
        _generate(model, doomed, prompt, max_new_tokens=16)
    assert isinstance(info.value, RuntimeError)
    assert info.value.num_total == num_blocks and info.value.num_free == 0 and info.value.num_needed >= 1
    assert str(info.value) == (
        f"need {info.value.num_needed} blocks, 0 free of {num_blocks}; give the pool more blocks (BlockPool "
        "num_blocks or max_memory), or run fewer or shorter sequences on it at once"
    )
    pool.allocator.check_invariants()
    doomed.release()
    assert pool.num_used_blocks == num_survivor_blocks
    pool.allocator.check_invariants()

    # The survivor is untouched: same blocks, and continuing it gives DynamicCache's tokens.
    assert survivor.block_tables == survivor_blocks
    expected = _generate(model, dynamic, expected_first, max_new_tokens=6)
    assert_same_tokens(_generate(model, survivor, first, max_new_tokens=6), expected)
    survivor.release()
    assert_pool_clean(pool)


@pytest.mark.parametrize("mode", ["sample_n", "beams", "prompt_lookup"])
def test_exhaustion_at_any_step_leaves_pool_clean(mode):
    """Pools from 1 block up to enough: each run either matches DynamicCache or raises PoolExhausted at some step
    (prefill, a new block, a copy-on-write, a crop and regrow), and release() always returns every block."""
    model = tiny_model("llama")
    expected = run_mode(mode, "llama", model, DynamicCache(config=model.config))
    outcomes = []
    for num_blocks in range(1, 25):
        pool = BlockPool.for_model(model, num_blocks=num_blocks, block_size=BLOCK_SIZE)
        with PagedCache(config=model.config, pool=pool) as cache:
            try:
                actual = run_mode(mode, "llama", model, cache)
            except PoolExhausted as error:
                assert error.num_needed > error.num_free and error.num_total == num_blocks
                outcomes.append("exhausted")
            else:
                assert_same_tokens(actual, expected)
                outcomes.append("ok")
            pool.allocator.check_invariants()
        assert_pool_clean(pool)
        if outcomes[-1] == "ok":
            break
    assert outcomes[0] == "exhausted" and outcomes[-1] == "ok" and len(outcomes) > 2, outcomes


def test_prompt_larger_than_pool_raises_before_allocating():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=2, block_size=4)
    with PagedCache(config=model.config, pool=pool) as cache:
        with pytest.raises(PoolExhausted, match=r"need 4 blocks, 2 free of 2"):
            _generate(model, cache, random_prompt(PROMPT_LEN))
        assert pool.num_used_blocks == 0
    assert_pool_clean(pool)


def test_exception_inside_forward_leaves_no_blocks_held():
    """The 5th call of the last decoder layer raises (mid-decode, after layer 0 wrote its K/V for that step)."""
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4)
    num_calls = 0

    def fail_on_fifth_call(module, args, kwargs):
        nonlocal num_calls
        num_calls += 1
        if num_calls == 5:
            raise RuntimeError("boom in forward")

    # A forward pre-hook, removed in `finally`: the cached model is shared by other tests and must not change.
    handle = model.model.layers[-1].register_forward_pre_hook(fail_on_fifth_call, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="boom in forward"):
            with PagedCache(config=model.config, pool=pool) as cache:
                _generate(model, cache, random_prompt(PROMPT_LEN), num_beams=2)
    finally:
        handle.remove()
    assert num_calls == 5
    assert_pool_clean(pool)
    # The cache object is reusable after the failure.
    expected = _generate(model, DynamicCache(config=model.config), random_prompt(PROMPT_LEN))
    assert_same_tokens(_generate(model, cache, random_prompt(PROMPT_LEN)), expected)
    cache.release()
    assert_pool_clean(pool)


def test_dropped_cache_returns_its_blocks():
    model = tiny_model("llama")
    pool = BlockPool.for_model(model, num_blocks=32, block_size=4)
    cache = PagedCache(config=model.config, pool=pool)
    _generate(model, cache, random_prompt(PROMPT_LEN), num_beams=2)
    assert pool.num_used_blocks > 0
    del cache
    gc.collect()
    assert_pool_clean(pool)
