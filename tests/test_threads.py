"""One `BlockPool` shared by caches on several threads, and blocks coming back after a failure inside generate().

Threads: N threads x M greedy `generate()` calls, each with its own `PagedCache` on one shared pool and one shared
read-only model, must give exactly the tokens of the same call run alone with a `DynamicCache`; a pool too small for
all of them at once makes some calls raise `PoolExhausted` without disturbing the others. Either way the pool ends
with every block back and its invariants intact.

Failures: an exception raised inside a decoder layer's forward in the middle of generate() leaves no block held,
whether the cache is left through `with` or just dropped. And a cache whose update runs out because another
thread took blocks in the middle of it still holds what it held.
"""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from models import random_prompt, tiny_model
from transformers import DynamicCache

from hf_paged import BlockPool, KVLayout, PagedCache, PoolExhausted

NUM_THREADS = 4
CALLS_PER_THREAD = 3
BLOCK_SIZE = 4
MAX_NEW_TOKENS = 8
# Prompts of 5..14 tokens: a call caches at most 14 + 8 - 1 = 21 tokens, 6 blocks.
MAX_BLOCKS_PER_CALL = -(-(14 + MAX_NEW_TOKENS - 1) // BLOCK_SIZE)
ROOMY_POOL_BLOCKS = NUM_THREADS * MAX_BLOCKS_PER_CALL  # every thread's call fits at once: nothing may run out
SMALL_POOL_BLOCKS = 2 * MAX_BLOCKS_PER_CALL  # two calls fit at once, three may not
OVERSIZED_PROMPT_LEN = SMALL_POOL_BLOCKS * BLOCK_SIZE + 1  # never fits the small pool, even alone


def _generate(model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids, past_key_values=cache, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)


def _prompts(oversized_thread: int | None = None) -> list[list[torch.Tensor]]:
    """prompts[thread][call]: `[1, len]` int64, a different length and seed for every call."""
    prompts = []
    for thread in range(NUM_THREADS):
        row = []
        for call in range(CALLS_PER_THREAD):
            seed = 100 * thread + call
            length = OVERSIZED_PROMPT_LEN if thread == oversized_thread else 5 + (3 * thread + 4 * call) % 10
            row.append(random_prompt(length, seed=seed))
        prompts.append(row)
    return prompts


def _assert_pool_clean(pool: BlockPool) -> None:
    assert pool.num_used_blocks == 0, pool.stats()
    pool.allocator.check_invariants()


def _run_threads(model, pool: BlockPool, prompts) -> list[list[torch.Tensor | PoolExhausted]]:
    """Every thread runs its calls in order, each in its own `with PagedCache`; a PoolExhausted is its result."""

    def worker(thread: int) -> list[torch.Tensor | PoolExhausted]:
        results = []
        for prompt in prompts[thread]:
            try:
                with PagedCache(config=model.config, pool=pool) as cache:
                    results.append(_generate(model, cache, prompt))
            except PoolExhausted as error:
                results.append(error)
        return results

    with ThreadPoolExecutor(max_workers=NUM_THREADS) as executor:
        return list(executor.map(worker, range(NUM_THREADS)))


def test_threads_sharing_one_pool_match_dynamic_cache(one_torch_thread):
    model = tiny_model("llama")
    prompts = _prompts()
    expected = [[_generate(model, DynamicCache(config=model.config), p) for p in row] for row in prompts]
    pool = BlockPool.for_model(model, num_blocks=ROOMY_POOL_BLOCKS, block_size=BLOCK_SIZE)

    results = _run_threads(model, pool, prompts)

    for thread in range(NUM_THREADS):
        for call in range(CALLS_PER_THREAD):
            actual = results[thread][call]
            assert isinstance(actual, torch.Tensor), f"thread {thread} call {call}: {actual!r}"
            assert torch.equal(actual, expected[thread][call]), f"thread {thread} call {call}"
    _assert_pool_clean(pool)


def test_threads_on_a_small_pool_fail_alone(one_torch_thread):
    """Calls that run out raise PoolExhausted; the calls beside them still match DynamicCache exactly.

    Thread 0's prompts never fit, so at least its calls run out; the others fit alone but not three at a time,
    so how many of them run out depends on the interleaving.
    """
    model = tiny_model("llama")
    prompts = _prompts(oversized_thread=0)
    expected = [[_generate(model, DynamicCache(config=model.config), p) for p in row] for row in prompts]
    pool = BlockPool.for_model(model, num_blocks=SMALL_POOL_BLOCKS, block_size=BLOCK_SIZE)

    results = _run_threads(model, pool, prompts)

    outcomes = []
    for thread in range(NUM_THREADS):
        for call in range(CALLS_PER_THREAD):
            actual = results[thread][call]
            if isinstance(actual, PoolExhausted):
                assert actual.num_total == SMALL_POOL_BLOCKS and actual.num_needed > actual.num_free, str(actual)
                outcomes.append("exhausted")
            else:
                assert thread != 0, f"an oversized prompt fit a pool of {SMALL_POOL_BLOCKS} blocks"
                assert torch.equal(actual, expected[thread][call]), f"thread {thread} call {call}"
                outcomes.append("ok")
    assert outcomes.count("exhausted") >= CALLS_PER_THREAD and "ok" in outcomes, outcomes
    _assert_pool_clean(pool)


# ------------------------------------------------------------------------------------------------ failures
FAIL_ON_CALL = 5  # the last decoder layer's 5th call: decode step 4, after layer 0 wrote that step's K/V


@pytest.fixture
def failing_last_layer(monkeypatch):
    """`failing_last_layer(exc_type)`: the llama model whose last decoder layer raises on its FAIL_ON_CALL-th call.

    Patched on the class (through monkeypatch, restored after the test) and only for that layer instance, so the
    cached model itself is never modified. Returns the model and a list holding the call count.
    """

    def make(exc_type: type[BaseException]):
        model = tiny_model("llama")
        target = model.model.layers[-1]
        layer_class = type(target)
        original_forward = layer_class.forward
        num_calls = [0]

        def forward(self, *args, **kwargs):
            if self is target:
                num_calls[0] += 1
                if num_calls[0] == FAIL_ON_CALL:
                    raise exc_type("boom in the decoder layer")
            return original_forward(self, *args, **kwargs)

        monkeypatch.setattr(layer_class, "forward", forward)
        return model, num_calls

    return make


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_exception_in_forward_inside_with_returns_every_block(failing_last_layer, exc_type):
    model, num_calls = failing_last_layer(exc_type)
    pool = BlockPool.for_model(model, num_blocks=32, block_size=BLOCK_SIZE)
    with pytest.raises(exc_type, match="boom"):
        with PagedCache(config=model.config, pool=pool) as cache:
            _generate(model, cache, random_prompt(13))
    assert num_calls[0] == FAIL_ON_CALL
    assert cache.num_held_blocks == 0
    _assert_pool_clean(pool)


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_exception_in_forward_then_dropped_cache_returns_every_block(failing_last_layer, exc_type):
    model, num_calls = failing_last_layer(exc_type)
    pool = BlockPool.for_model(model, num_blocks=32, block_size=BLOCK_SIZE)
    cache = PagedCache(config=model.config, pool=pool)
    with pytest.raises(exc_type, match="boom"):
        _generate(model, cache, random_prompt(13, seed=1))
    assert num_calls[0] == FAIL_ON_CALL
    assert pool.num_used_blocks == cache.num_held_blocks > 0  # the failure left the blocks with the live cache
    del cache
    gc.collect()
    _assert_pool_clean(pool)


# ------------------------------------------------------------------------------------------------ races
def test_blocks_taken_by_another_thread_mid_update_leave_the_cache_intact(monkeypatch):
    """Another thread's cache can take blocks at any moment between two of an update's allocator calls. Then the
    update may raise PoolExhausted, but what the cache held must read back unchanged.

    Simulated deterministically: right before the update's first allocation, the other cache fills the pool but
    one block. The update needs two copy-on-writes (rows a, a, b, b all diverge) and must take both in one
    atomic allocation, so it fails before changing anything.
    """
    pool = BlockPool(KVLayout((2, 2), (4, 4)), num_blocks=8, block_size=4)
    cache, other = PagedCache(pool=pool), PagedCache(pool=pool)
    prefix = torch.randn(2, 2, 2, 4)  # [B, H, S, D]: two rows, one half-full block each
    for layer_idx in range(2):
        cache.update(prefix, prefix, layer_idx)
    cache.batch_repeat_interleave(2)  # rows a, a, b, b: two groups, each sharing its half-full block
    expected = prefix.repeat_interleave(2, dim=0)

    allocate = pool.allocator.allocate
    raced = []

    def lose_the_race_then_allocate(num_blocks: int, num_holders: int = 1):
        if not raced:
            raced.append(num_blocks)
            taken = torch.randn(1, 2, 4 * (pool.num_free_blocks - 1), 4)
            other.update(taken, taken, 0)  # the other thread's prefill
        return allocate(num_blocks, num_holders)

    monkeypatch.setattr(pool.allocator, "allocate", lose_the_race_then_allocate)
    new = torch.randn(4, 2, 1, 4)
    try:
        for layer_idx in range(2):
            cache.update(new, new, layer_idx)
    except PoolExhausted:
        pass
    else:
        expected = torch.cat([expected, new], dim=2)
    assert raced, "the simulated race never ran"
    changed = []  # (layer, row) whose cached K/V no longer read back
    for layer_idx in range(2):
        keys, _ = cache._update.visible.gather(layer_idx, 0, cache.get_seq_length(layer_idx))
        changed += [(layer_idx, row) for row in range(4) if not torch.equal(keys[row], expected[row])]
    assert not changed, f"(layer, row) changed: {changed}; block tables {cache.block_tables}"
    cache.release()
    other.release()
    _assert_pool_clean(pool)
