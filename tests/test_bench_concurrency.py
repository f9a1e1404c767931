"""The harness's memory bound on mean concurrency (`serving_report.concurrency_bound`) and the opt-in
`engine-optimistic` backend (the Engine with vLLM's admission), on a tiny model. Correctness only; nothing is timed.
"""

import pytest

from bench import serving, serving_report
from bench.runs import BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS, OPTIMISTIC, Budget
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
    # Two sequences: the mean is per forward, so the longer one weighs more. Prompt 1, 3 outputs: 16 x 3 tokens.
    two = Workload("w", (*workload.requests, RequestSpec((5,), 3)))
    assert serving_report.concurrency_bound(two, budget) == pytest.approx(96 / ((16 + 32 + 16 * 3) / 5))


def test_bound_uses_whole_blocks():
    # A prompt of one token with one output holds one token, counted as a whole block.
    workload = Workload("w", (RequestSpec((5,), 1),))
    budget = Budget(multiple=1, reservation_tokens=BLOCK_SIZE, bytes_per_token=4)
    assert serving_report.concurrency_bound(workload, budget) == pytest.approx(1.0)


def test_no_backend_passes_the_bound_per_step(tight_run):
    run, rows = tight_run
    budget = run.budgets[0]
    bound = serving_report.concurrency_bound(run.workload, budget)
    # The whole pool is under one step's token budget, so no prefill is chunked; the prompts share no block.
    assert budget.bytes // budget.bytes_per_token < MAX_NUM_BATCHED_TOKENS
    for backend in ("engine", OPTIMISTIC):
        # Every running sequence holds at least what the bound counts, so the pool caps the mean over steps.
        assert rows[backend]["extra"]["mean_running_per_step"] <= bound + 1e-9, backend
    # Static batches of the worst case use the memory worse than continuous batching does.
    assert rows["dynamic"]["mean_concurrency"] <= bound
    assert rows["dynamic"]["concurrency_of_bound"] < rows["engine"]["concurrency_of_bound"]


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
    run, by_backend = tight_run
    rows = serving_report.summarize_all(run)
    facts = serving_report.describe(run)
    bound = serving_report.concurrency_bound(run.workload, run.budgets[0])
    assert all(row["concurrency_bound"] == pytest.approx(bound) for row in rows)
    text = "\n".join(serving_report.render({"facts": facts, "rows": rows}))
    # Dynamic runs batches of 2 at 2x; its time-weighted mean rows are a little under 2 (the gaps between batches).
    dynamic = by_backend["dynamic"]
    assert (
        f"2x {bound:.2f} seqs ({bound / dynamic['mean_concurrency']:.2f}x dynamic's mean rows, "
        f"{bound / dynamic['mean_live']:.2f}x its mean live)"
    ) in text
    # The memory table (the second with a row per backend) has the `of bound` column.
    optimistic_row = [line for line in text.splitlines() if line.startswith(f"| 2x       | {OPTIMISTIC}")][1]
    assert f"| {next(r for r in rows if r['backend'] == OPTIMISTIC)['concurrency_of_bound']:.2f} " in optimistic_row
    assert OPTIMISTIC not in serving.default_backends()  # opt-in


def test_live_sequences_leave_out_padding_rows(model):
    # One static batch of two: outputs of 3 and 30 tokens. The short request's row computes padding for 27 steps,
    # so dynamic computes 2 rows per forward while fewer than 2 sequences still owe tokens.
    prompts = ((5, 6, 7, 8, 9, 10, 11, 12), (13, 14, 15, 16, 17, 18, 19, 20))
    uneven = Workload("w", (RequestSpec(prompts[0], 3), RequestSpec(prompts[1], 30)))
    even = Workload("w", (RequestSpec(prompts[0], 30), RequestSpec(prompts[1], 30)))
    for workload, live_share in ((uneven, (0.4, 0.8)), (even, (0.85, 1.0))):
        run = serving.run_serving(model, workload, [2], ["dynamic", "engine"], progress=False)
        dynamic, engine = run.results
        assert dynamic.extra["num_batches"] == 1 and dynamic.peak_concurrency == 2
        low, high = live_share
        assert low * dynamic.mean_concurrency < dynamic.mean_live <= high * dynamic.mean_concurrency
        assert engine.outputs == dynamic.outputs == run.reference


def _row(budget, backend, tok_s, live, **extra):
    return {"budget": budget, "backend": backend, "output_tok_s": tok_s, "mean_live": live, **extra}


def test_engine_ratios_divide_by_each_baseline_of_the_same_budget():
    engine = dict(
        tok_s_vs_dynamic=1.5,
        live_vs_dynamic=1.8,
        concurrency_vs_dynamic=1.4,
        utilization=0.99,
        preemptions=0,
        num_agree=10,
        num_sequences=10,
    )
    rows = [
        _row("2x", "dynamic", 100.0, 1.5),
        _row("2x", "static", 50.0, 0.9),
        _row("2x", serving.PEER, 60.0, 2.0),
        _row("2x", "engine", 150.0, 2.7, **engine),
        _row("4x", "dynamic", 200.0, 3.0, extra={"repeat_walls_s": [10.0, 12.0]}),
        _row("4x", "engine", 240.0, 5.4, **engine, extra={"repeat_walls_s": [8.0, 6.0]}),
    ]
    two, four = serving_report.engine_ratios(rows)
    assert two["tok_s_vs_dynamic_each"] is None  # one repeat: no spread to show
    assert four["tok_s_vs_dynamic_each"] == [pytest.approx(1.25), pytest.approx(2.0)]  # dynamic's wall over its own
    assert two["budget"] == "2x" and four["budget"] == "4x"
    assert two["tok_s_vs_peer"] == pytest.approx(2.5) and two["live_vs_static"] == pytest.approx(3.0)
    assert four["tok_s_vs_peer"] is None and four["live_vs_static"] is None  # not run at 4x
    assert two["live_vs_dynamic"] == 1.8 and two["rows_vs_dynamic"] == 1.4 and two["agree"] == "10/10"


def test_report_has_the_engine_summary(tight_run):
    run, by_backend = tight_run
    text = "\n".join(
        serving_report.render({"facts": serving_report.describe(run), "rows": serving_report.summarize_all(run)})
    )
    summary = text.split("### The engine against the baselines", 1)[1]
    engine_line = next(line for line in summary.splitlines() if line.startswith("| 2x"))
    cells = [cell.strip() for cell in engine_line.strip("|").split("|")]
    engine = by_backend["engine"]
    assert cells[1] == f"{engine['tok_s_vs_dynamic']:.2f}" and cells[4] == f"{engine['live_vs_dynamic']:.2f}"
    assert cells[2] == "-"  # one repeat
    assert cells[3] == cells[5] == "-"  # the peer and static did not run
    assert cells[-1] == f"{run.workload.num_requests}/{run.workload.num_requests}"


def test_engine_live_counts_held_and_just_finished_requests(model, tight_run):
    from bench.continuous import _num_live
    from hf_paged import BlockPool, Engine

    engine = Engine(
        model, BlockPool.for_model(model, num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=16
    )
    short = engine.add_request([5, 6, 7], max_new_tokens=1)  # finishes in its first step: live in it
    engine.add_request(list(range(10, 30)), max_new_tokens=4)  # 20 tokens: prefill chunked over two steps
    events = engine.step()
    assert engine.request(short).finished and engine.request(short).output_ids == [events[0][1]]
    assert _num_live(engine, events) == 2  # the finished one, and the long prompt holding its first chunk
    while engine.has_unfinished():
        events = engine.step()
    assert _num_live(engine, events) == 1  # its last token
    # In the harness: with no preemption every live request runs a row each step here; the optimistic engine's
    # preempted requests hold nothing while they wait, so live never exceeds what the rows count by much.
    _, rows = tight_run
    assert rows["engine"]["mean_live"] == pytest.approx(rows["engine"]["mean_concurrency"], rel=0.05)
    assert rows[OPTIMISTIC]["mean_live"] >= rows[OPTIMISTIC]["mean_concurrency"] - 1e-9
