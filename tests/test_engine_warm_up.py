"""`warm_up(engine)`: a synthetic burst before an Engine serves, which leaves no trace in its statistics, its pool or
its prefix cache."""

from __future__ import annotations

import copy

import pytest
from models import greedy_reference, random_prompts, tiny_model

from hf_paged import BlockPool, Engine
from hf_paged.engine.warm_up import PROMPT_LENS, warm_up


def test_a_warmed_up_engine_starts_clean_and_serves_generates_tokens():
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=256, block_size=4, enable_prefix_caching=True)
    engine = Engine(model, pool, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    seconds = warm_up(engine)
    assert seconds > 0 and engine.runner.stats.eager_steps > 0  # the burst ran decode steps
    assert engine.stats.num_steps == engine.stats.prefill_tokens == engine.stats.decode_tokens == 0
    assert pool.num_used_blocks == 0 and pool.allocator.num_cached_blocks == 0
    pool.allocator.check_invariants()
    prompts = random_prompts((5, 11, 3))
    assert engine.generate(prompts, max_new_tokens=[6, 4, 7], ignore_eos=True) == greedy_reference(
        "llama", prompts, [6, 4, 7]
    )
    assert pool.allocator.num_cached_blocks > 0  # the real prompts are cached as usual


def test_prompts_fit_the_model_and_the_pool_and_a_busy_engine_is_refused():
    model = copy.deepcopy(tiny_model("llama", "hf_paged"))  # the cached one is shared: not changed in place
    model.config.max_position_embeddings = 100  # below the burst's longest prompt
    assert max(PROMPT_LENS) > 100
    pool = BlockPool.for_model(model, num_blocks=64, block_size=4)
    engine = Engine(model, pool, max_num_seqs=4, max_num_batched_tokens=64)
    warm_up(engine)  # a prompt too long would fail its request, and generate() would raise
    engine.add_request([1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="warm_up needs an idle Engine: 0 requests are running and 1 waiting"):
        warm_up(engine)
