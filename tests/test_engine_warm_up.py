"""`warm_up(engine)`: synthetic bursts before an Engine serves, which leave no trace in its counters, its pool or its
prefix cache."""

from __future__ import annotations

import copy
import logging

import pytest
from models import greedy_reference, random_prompts, tiny_model

from hf_paged import BlockPool, Engine
from hf_paged.engine.warm_up import PROMPT_LENS, warm_up
from hf_paged.errors import RequestFailed


def test_a_warmed_up_engine_starts_clean_and_serves_generates_tokens():
    """Both bursts run (the second drains the decode batch from `max_num_seqs` rows one a step); the counters, the pool
    and the prefix cache are as before, what was cached before stays cached, and the Engine then serves as usual."""
    model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(model, num_blocks=256, block_size=4, enable_prefix_caching=True)
    engine = Engine(model, pool, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    cached = random_prompts((17,))
    engine.generate(cached, max_new_tokens=2, ignore_eos=True)
    before, queries = pool.allocator.cached_blocks(), pool.stats()["prefix_cache_queries"]
    assert before and queries > 0
    stats = engine.stats
    num_steps, prefill_tokens = stats.num_steps, stats.prefill_tokens
    seconds = warm_up(engine)
    assert seconds > 0 and engine.runner.stats.eager_steps >= 4  # decode steps of 4, 3, 2 and 1 rows at least
    assert engine.stats is stats and (stats.num_steps, stats.prefill_tokens) == (num_steps, prefill_tokens)
    assert engine.scheduler.num_preemptions == 0 and engine.scheduler.prefix.num_hit_tokens == 0
    assert pool.stats()["prefix_cache_queries"] == queries
    assert pool.num_used_blocks == 0 and pool.allocator.cached_blocks() == before
    pool.allocator.check_invariants()
    prompts = random_prompts((5, 11, 3))
    assert engine.generate(prompts, max_new_tokens=[6, 4, 7], ignore_eos=True) == greedy_reference(
        "llama", prompts, [6, 4, 7]
    )


@pytest.mark.parametrize("limit", ["positions", "pool"])
def test_prompts_fit_the_model_and_the_pool(limit):
    """The bursts' requests fit below the model's positions and what the pool holds (else they would fail and
    warm_up would say so)."""
    model = copy.deepcopy(tiny_model("llama", "hf_paged"))  # the cached one is shared: not changed in place
    if limit == "positions":
        model.config.max_position_embeddings = 100  # below the first burst's longest prompt
    pool = BlockPool.for_model(model, num_blocks=64 if limit == "positions" else 24, block_size=4)
    engine = Engine(model, pool, max_num_seqs=4, max_num_batched_tokens=64)
    assert min(engine.limits.max_positions, engine.max_pool_tokens) < max(PROMPT_LENS)
    warm_up(engine)
    assert engine.runner.stats.eager_steps > 0 and pool.num_used_blocks == 0


def test_a_failing_burst_is_skipped_with_a_warning_and_a_busy_engine_is_refused(caplog, monkeypatch):
    model = tiny_model("llama", "hf_paged")
    engine = Engine(model, BlockPool.for_model(model, num_blocks=8, block_size=4), max_num_seqs=2)  # 32 tokens
    generate, bursts = engine.generate, []

    def first_fails(prompts, **kwargs):
        bursts.append(len(prompts))
        if len(bursts) == 1:
            raise RequestFailed({0: "a request the Engine could not run"}, [[] for _ in prompts])
        return generate(prompts, **kwargs)

    monkeypatch.setattr(engine, "generate", first_fails)
    with caplog.at_level(logging.WARNING, logger="hf_paged.engine.warm_up"):
        warm_up(engine)
    assert bursts == [len(PROMPT_LENS), 2] and engine.runner.stats.eager_steps > 0  # the second burst ran
    assert any("a burst of synthetic requests failed, skipped" in record.message for record in caplog.records)
    assert engine.stats.num_steps == 0  # nothing ran before it
    engine.add_request([1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="warm_up needs an idle Engine: 0 requests are running and 1 waiting"):
        warm_up(engine)
