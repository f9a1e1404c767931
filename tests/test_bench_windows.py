"""The harness on models with sliding-window layers: the budget counts what each cache really holds there."""

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, StaticCache

from bench import serving, serving_report
from bench.__main__ import parse_args
from bench.continuous import add_workload_request
from bench.runs import BLOCK_SIZE, Budget
from bench.static_batches import _live_bytes, dynamic_batch_size
from bench.workloads import RequestSpec, Workload, burst
from hf_paged import BlockPool, Engine
from tests.models import SLIDING_WINDOW, VOCAB_SIZE, gemma3_config, tiny_model

WINDOWED = ["mistral", "gemma3"]  # every layer sliding; sliding and full layers


def _one_request(prompt_len: int, max_new_tokens: int) -> Workload:
    return Workload("burst", (RequestSpec(tuple(range(3, 3 + prompt_len)), max_new_tokens),))


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _padded_groups_model():
    """3 sliding : 2 full layers: groups of 2 layers, the last sliding one alone in a padded group."""
    torch.manual_seed(0)
    return Gemma3ForCausalLM(gemma3_config(["sliding_attention"] * 3 + ["full_attention"] * 2)).eval()


@pytest.mark.parametrize("name", WINDOWED + ["llama", "padded-groups"])
def test_a_reservation_is_the_most_a_paged_row_holds(name):
    """One request of the worst length through the Engine on a roomy pool: the blocks it holds at its peak are the
    reservation, window and all (its 4-token prompt is one block, so its prefill holds no more than a decode). A
    padded group's blocks cost a whole block of the largest group's layers, and the reservation counts them so."""
    model = _padded_groups_model() if name == "padded-groups" else tiny_model(name, "hf_paged")
    workload = _one_request(4, 60)  # 64 tokens: 4 blocks; a window of 8 spans at most 2
    budget = Budget.for_workload(model, workload, 1)
    pool = BlockPool.for_model(model, num_blocks=64, block_size=BLOCK_SIZE)
    try:
        engine = Engine(model, pool, max_num_seqs=1, max_num_batched_tokens=64)
        add_workload_request(engine, workload, 0)
        peaks = []
        engine.scheduler.schedule = _recording(engine.scheduler.schedule, pool, peaks)
        while engine.has_unfinished():
            engine.step()
        peak = max(peaks)
    finally:
        model.set_attn_implementation("sdpa" if name == "padded-groups" else "hf_paged")
    assert budget.reservation_bytes == peak
    if name == "llama":
        assert budget.reservation_bytes == 64 * budget.bytes_per_token and budget.windows == ()
    elif name == "padded-groups":
        assert len(pool.layer_groups) == 3 and pool.num_slots == 2
    else:  # every sliding layer counted at its window's span, less than the sequence
        assert budget.reservation_bytes < 64 * budget.bytes_per_token
        assert {window for _, window in budget.windows} == {SLIDING_WINDOW}


def _recording(schedule, pool, peaks):
    """`schedule` that records the bytes the pool holds once the step's blocks are allocated (its peak)."""

    def recorded():
        step = schedule()
        peaks.append(pool.num_used_blocks * pool.bytes_per_block)
        return step

    return recorded


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
    assert dynamic_batch_size(replace(budget, multiple=1)) == 1
    assert full_count.bytes // budget.reservation_bytes == 4 * budget.reservation_tokens // (2 * BLOCK_SIZE)


@pytest.mark.parametrize("name", WINDOWED)
def test_every_backend_serves_a_windowed_model_and_agrees(name):
    model = tiny_model(name, "sdpa", seed=7)
    # Prompts of up to 3 blocks of 16 against a window of 8 (2 blocks): generate() computes a batch's prompts whole,
    # so paged-generate's pool holds them (more than the budget), as its `reserved` says.
    workload = burst(vocab_size=VOCAB_SIZE, num_requests=5, prompt_lens=(6, 44), output_lens=(4, 12), seed=4)
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
    assert by_backend["paged-generate"]["reserved_mib"] > by_backend["paged-generate"]["kv_budget_mib"]
    facts = serving_report.describe(run)
    assert facts["sliding_windows"] == [SLIDING_WINDOW]
    text = "\n".join(serving_report.render({"facts": facts, "rows": rows}))
    assert f"sliding-window layers (window {SLIDING_WINDOW}) only the blocks a row's window spans" in text


@pytest.mark.parametrize(
    "prompt_len, max_new_tokens, sliding_tokens",
    [(4, 3, 4 + 4 * 3), (20, 4, 3 + 4 * 4)],  # all in the window; the window keeps 3 prompt tokens and 4 outputs
)
def test_live_bytes_count_a_prompt_the_samples_share_once(prompt_len, max_new_tokens, sliding_tokens):
    """Four samples of one request on the all-sliding model (window 8): each keeps its last 7 tokens, and the
    prompt tokens among them are the same K/V in every sample, counted once."""
    budget = Budget.for_workload(tiny_model("mistral", "sdpa"), _one_request(4, 4), 1)
    spec = RequestSpec(tuple(range(3, 3 + prompt_len)), max_new_tokens)
    assert _live_bytes(budget, spec, 4) == sliding_tokens * budget.bytes_per_token
    assert _live_bytes(budget, spec, 1) == budget.contiguous_bytes(prompt_len + max_new_tokens)


def test_cli_layers_option():
    assert parse_args(["--layers", "mixed"]).layers == "mixed"
    assert parse_args([]).layers == "full"
    with pytest.raises(SystemExit):
        parse_args(["--layers", "mixed", "--model", "/some/checkpoint"])
    with pytest.raises(SystemExit):
        parse_args(["--layers", "diagonal"])
