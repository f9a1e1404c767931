"""The harness on models with sliding-window layers: the budget counts what each cache really holds there."""

import pytest
import torch
from transformers import DynamicCache, StaticCache

from bench import serving, serving_report
from bench.__main__ import parse_args
from bench.continuous import add_workload_request
from bench.runs import BLOCK_SIZE, Budget
from bench.static_batches import dynamic_batch_size
from bench.workloads import RequestSpec, Workload, burst
from hf_paged import BlockPool, Engine
from tests.models import SLIDING_WINDOW, VOCAB_SIZE, tiny_model

WINDOWED = ["mistral", "gemma3"]  # every layer sliding; sliding and full layers


def _one_request(prompt_len: int, max_new_tokens: int) -> Workload:
    return Workload("burst", (RequestSpec(tuple(range(3, 3 + prompt_len)), max_new_tokens),))


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("name", WINDOWED + ["llama"])
def test_a_reservation_is_the_most_a_paged_row_holds(name):
    """One request of the worst length through the Engine on a roomy pool: the blocks it holds at its peak are the
    reservation, window and all (its 4-token prompt is one block, so its prefill holds no more than a decode)."""
    model = tiny_model(name, "hf_paged")
    workload = _one_request(4, 60)  # 64 tokens: 4 blocks; a window of 8 spans at most 2
    budget = Budget.for_workload(model, workload, 1)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE)
    engine = Engine(model, pool, max_num_seqs=1, max_num_batched_tokens=64)
    add_workload_request(engine, workload, 0)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, pool.num_used_blocks * pool.bytes_per_block)
    assert budget.reservation_bytes == peak
    if name == "llama":
        assert budget.reservation_bytes == 64 * budget.bytes_per_token and budget.windows == ()
    else:  # every sliding layer counted at its window's span, less than the sequence
        assert budget.reservation_bytes < 64 * budget.bytes_per_token
        assert {window for _, window in budget.windows} == {SLIDING_WINDOW}


@pytest.mark.parametrize("name", WINDOWED + ["llama"])
@pytest.mark.parametrize("num_tokens", [5, 7, 8, 30])
def test_contiguous_bytes_are_what_dynamic_and_static_caches_hold(name, num_tokens):
    model = tiny_model(name, "sdpa")
    budget = Budget.for_workload(model, _one_request(4, 4), 1)
    input_ids = torch.arange(3, 3 + num_tokens)[None]
    dynamic = DynamicCache(config=model.config)
    static = StaticCache(config=model.config, max_cache_len=32)
    with torch.inference_mode():
        model(input_ids, past_key_values=dynamic)
        model(input_ids, past_key_values=static)
    assert _cache_bytes(dynamic) == budget.contiguous_bytes(num_tokens)
    assert _cache_bytes(static) == budget.contiguous_bytes(32, window_tokens=lambda window: window)


def test_a_windowed_model_gets_larger_static_batches_in_the_same_bytes():
    """Sequences longer than the window: a reservation counts the window, so the same multiple is fewer bytes, and
    the same bytes hold more rows than the full-attention count (every layer at the whole sequence) would allow."""
    model = tiny_model("mistral", "sdpa")
    workload = _one_request(40, 24)
    budget = Budget.for_workload(model, workload, 4)
    full_count = Budget(budget.multiple, budget.reservation_tokens, budget.bytes_per_token)  # windows ignored
    assert budget.bytes < full_count.bytes
    assert dynamic_batch_size(budget) == 4
    assert dynamic_batch_size(Budget(1, budget.reservation_tokens, budget.bytes_per_token, budget.windows)) == 1
    assert full_count.bytes // budget.reservation_bytes == 4 * budget.reservation_tokens // (2 * BLOCK_SIZE)


@pytest.mark.parametrize("name", WINDOWED)
def test_every_backend_serves_a_windowed_model_and_agrees(name):
    model = tiny_model(name, "sdpa", seed=7)
    workload = burst(vocab_size=VOCAB_SIZE, num_requests=5, prompt_lens=(6, 20), output_lens=(4, 12), seed=2)
    try:
        run = serving.run_serving(model, workload, [2], progress=False)
    finally:
        model.set_attn_implementation("sdpa")
    assert not run.failures
    rows = serving_report.summarize_all(run)
    assert {row["backend"] for row in rows} >= set(serving.BUILTIN_BACKENDS)
    for row in rows:
        assert row["num_agree"] == workload.num_requests, (row["backend"], row["mismatches"])
        assert row["concurrency_bound"] > 0
    by_backend = {row["backend"]: row for row in rows}
    assert by_backend["engine"]["reserved_mib"] <= by_backend["engine"]["kv_budget_mib"]
    facts = serving_report.describe(run)
    assert facts["sliding_windows"] == [SLIDING_WINDOW]
    text = "\n".join(serving_report.render({"facts": facts, "rows": rows}))
    assert f"sliding-window layers, window {SLIDING_WINDOW}, only the blocks a row's window spans" in text


def test_cli_layers_option():
    assert parse_args(["--layers", "mixed"]).layers == "mixed"
    assert parse_args([]).layers == "full"
    with pytest.raises(SystemExit):
        parse_args(["--layers", "mixed", "--model", "/some/checkpoint"])
    with pytest.raises(SystemExit):
        parse_args(["--layers", "diagonal"])
