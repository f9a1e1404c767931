"""The harness's memory bound on mean concurrency (`serving_report.concurrency_bound`) and the opt-in
`engine-optimistic` backend (the Engine with vLLM's admission), on a tiny model. Correctness only; nothing is timed.
"""

import pytest

from bench import serving, serving_report
from bench.runs import BLOCK_SIZE, OPTIMISTIC, Budget
from bench.workloads import RequestSpec, Workload, burst
from tests.models import VOCAB_SIZE, tiny_model


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama", "sdpa", seed=7)  # a private instance: the engine switches its attention
    yield model
    model.set_attn_implementation("sdpa")


@pytest.fixture(scope="module")
def tight_run(model):
    # Prompts of 12-40 tokens growing by 10-30: most requests cross a block boundary while they decode, so a
    # 2-reservation pool is short of blocks if admission keeps no room for growth.
    workload = burst(vocab_size=VOCAB_SIZE, num_requests=10, prompt_lens=(12, 40), output_lens=(10, 30), seed=3)
    run = serving.run_serving(model, workload, [2], ["dynamic", "engine", OPTIMISTIC], progress=False)
    return run, {row["backend"]: row for row in serving_report.summarize_all(run)}


def test_bound_is_budget_tokens_over_mean_tokens_held():
    # One sequence, prompt 16, 2 outputs: it holds 16 tokens in its prefill forward and 17 (two blocks: 32) in
    # its decode forward, 24 on average; a budget of 96 tokens bounds the mean concurrency at 4.
    workload = Workload("w", (RequestSpec(tuple(range(2, 18)), 2),))
    budget = Budget(multiple=3, reservation_tokens=32, bytes_per_token=10)
    assert budget.bytes // budget.bytes_per_token == 96
    assert serving_report.concurrency_bound(workload, budget) == pytest.approx(96 / 24)
    # Parallel samples count as sequences: the same tokens held on average, so the same bound.
    sampled = Workload("w", workload.requests, num_samples=3, temperature=1.0)
    assert serving_report.concurrency_bound(sampled, budget) == pytest.approx(96 / 24)


def test_bound_uses_whole_blocks():
    # A prompt of one token with one output holds one token, counted as a whole block.
    workload = Workload("w", (RequestSpec((5,), 1),))
    budget = Budget(multiple=1, reservation_tokens=BLOCK_SIZE, bytes_per_token=4)
    assert serving_report.concurrency_bound(workload, budget) == pytest.approx(1.0)


def test_no_backend_passes_the_bound_per_step(tight_run):
    run, rows = tight_run
    bound = serving_report.concurrency_bound(run.workload, run.budgets[0])
    for backend in ("engine", OPTIMISTIC):
        # Per step (no prefill here is chunked, no block is shared) every running sequence holds at least what the
        # bound counts, so the pool caps the mean over steps.
        assert rows[backend]["extra"]["mean_running_per_step"] <= bound + 1e-9, backend
        assert 0 < rows[backend]["concurrency_of_bound"], backend
    assert rows["dynamic"]["concurrency_of_bound"] == pytest.approx(rows["dynamic"]["mean_concurrency"] / bound)


def test_optimistic_engine_preempts_and_still_reproduces_generate(tight_run):
    run, rows = tight_run
    engine, optimistic = rows["engine"], rows[OPTIMISTIC]
    assert engine["preemptions"] == 0  # the default lookahead never preempts
    assert optimistic["preemptions"] > 0  # the tight pool runs out of blocks mid-decode
    n = run.workload.num_requests
    assert engine["num_agree"] == optimistic["num_agree"] == n  # recomputed requests still match generate()
    assert optimistic["extra"]["prefill_tokens"] > engine["extra"]["prefill_tokens"]  # the recomputation
    assert optimistic["peak_concurrency"] >= engine["peak_concurrency"]


def test_report_states_the_bound_and_the_opt_in_backend(tight_run):
    run, _ = tight_run
    rows = serving_report.summarize_all(run)
    facts = serving_report.describe(run)
    assert facts["concurrency_bounds"] == [pytest.approx(serving_report.concurrency_bound(run.workload, run.budgets[0]))]
    text = "\n".join(serving_report.render({"facts": facts, "rows": rows}))
    assert "of bound" in text and f"2x {facts['concurrency_bounds'][0]:.2f} seqs" in text
    assert f"`{OPTIMISTIC}`" in text
    assert OPTIMISTIC not in serving.default_backends()  # opt-in
