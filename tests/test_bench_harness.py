"""The serving benchmark harness (bench/serving.py) on a tiny model: every backend serves every request, greedy
outputs match per-request generate(), the metrics are consistent and the report has its sections.

Correctness of the harness only; nothing here is timed.
"""

import pytest
import torch
from transformers import DynamicCache

from bench import serving, serving_report
from bench.__main__ import parse_args, render
from bench.workloads import (
    WORKLOADS,
    RequestSpec,
    Workload,
    burst,
    make_workload,
    parallel_sampling,
    poisson,
    shared_prefix,
)
from hf_paged import hookimpl
from hf_paged.registry import BackendRegistry
from tests.models import VOCAB_SIZE, tiny_model

MULTIPLES = (2, 3)


@pytest.fixture(scope="module")
def model():
    # A private instance (seed 5): the engine switches attention to "hf_paged" and the harness must switch it back.
    model = tiny_model("llama", "sdpa", seed=5)
    yield model
    model.set_attn_implementation("sdpa")


@pytest.fixture(scope="module")
def workload():
    return burst(vocab_size=VOCAB_SIZE, num_requests=6, prompt_lens=(4, 12), output_lens=(3, 8), seed=1)


@pytest.fixture(scope="module")
def run(model, workload):
    run = serving.run_serving(model, workload, MULTIPLES, progress=False)
    assert model.config._attn_implementation == "sdpa"
    return run


@pytest.fixture(scope="module")
def rows(run):
    return serving_report.summarize_all(run)


def test_burst_workload_is_seeded_and_in_range():
    first = make_workload("burst", vocab_size=1000)
    assert first == make_workload("burst", vocab_size=1000)
    assert first.num_requests == 16
    for spec in first.requests:
        assert 64 <= len(spec.prompt_ids) <= 128 and 32 <= spec.max_new_tokens <= 64 and spec.arrival == 0
        assert all(2 <= token < 1000 for token in spec.prompt_ids)
    full = make_workload("burst", vocab_size=1000, full=True)
    assert full.num_requests == 48 and full.max_prompt_len <= 384 and full.max_new_tokens <= 256
    with pytest.raises(ValueError, match="burst"):
        make_workload("nope", vocab_size=1000)


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_is_seeded_and_sorted(name):
    quick = make_workload(name, vocab_size=1000)
    assert quick == make_workload(name, vocab_size=1000) and quick.name == name
    assert all(2 <= token < 1000 for spec in quick.requests for token in spec.prompt_ids)
    full = make_workload(name, vocab_size=1000, full=True)
    assert full.num_requests > quick.num_requests and full.max_prompt_len > quick.max_prompt_len
    if name == "shared-prefix":
        assert full.num_requests == 64 and len({spec.prompt_ids[:512] for spec in full.requests}) == 1
        assert all(544 <= len(spec.prompt_ids) <= 640 for spec in full.requests)
    if name == "long":
        assert all(1024 <= len(spec.prompt_ids) <= 3072 and spec.max_new_tokens == 64 for spec in full.requests)


def test_poisson_arrivals():
    workload = make_workload("poisson", vocab_size=1000, rate=2.0)
    arrivals = [spec.arrival for spec in workload.requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and len(set(arrivals)) == len(arrivals)
    # 15 gaps of mean 0.5 s: the last arrival is near 7.5 s (generously bounded).
    assert 2 < arrivals[-1] < 20
    burst_prompts = [spec.prompt_ids for spec in make_workload("burst", vocab_size=1000).requests]
    assert [spec.prompt_ids for spec in workload.requests] == burst_prompts
    with pytest.raises(ValueError, match="poisson"):
        make_workload("burst", vocab_size=1000, rate=2.0)
    with pytest.raises(ValueError, match="rate"):
        make_workload("poisson", vocab_size=1000, rate=0)


def test_poisson_requests_wait_for_their_arrival(model):
    workload = poisson(
        vocab_size=VOCAB_SIZE, rate=40.0, num_requests=5, prompt_lens=(4, 10), output_lens=(3, 5), seed=2
    )
    run = serving.run_serving(model, workload, [2], ["dynamic", "engine", serving.PEER], progress=False)
    assert not run.failures
    arrivals = [spec.arrival for spec in workload.requests]
    for result in run.results:
        assert result.outputs == run.reference, result.backend
        assert all(first >= arrival for first, arrival in zip(result.first_token, arrivals)), result.backend
    dynamic = run.results[0]
    # A static batch starts once its last request has arrived: requests 0 and 1 share a batch.
    assert dynamic.first_token[0] == dynamic.first_token[1] >= arrivals[1]


def test_shared_prefix_is_counted_once_in_the_engine(model):
    workload = shared_prefix(
        vocab_size=VOCAB_SIZE, num_requests=5, prefix_len=40, unique_lens=(2, 6), output_lens=(3, 6), seed=3
    )
    run = serving.run_serving(model, workload, [2], ["dynamic", "engine"], progress=False)
    rows = serving_report.summarize_all(run)
    for row, result in zip(rows, run.results):
        assert result.outputs == run.reference, result.backend
        assert 0 < row["utilization"] <= 1
    engine = run.results[1]
    assert engine.extra["prefix_hit_tokens"] > 0
    # With the growth reserve, a 2x budget of tiny requests admits at least as many as the static batch.
    assert engine.peak_concurrency >= run.results[0].peak_concurrency


def test_parallel_sampling_gives_every_request_its_samples(model):
    workload = parallel_sampling(
        vocab_size=VOCAB_SIZE,
        num_samples=3,
        temperature=1.0,
        num_requests=3,
        prompt_lens=(4, 10),
        output_lens=(4, 6),
        seed=4,
    )
    run = serving.run_serving(model, workload, [2], progress=False)
    assert not run.failures and run.reference is None
    rows = serving_report.summarize_all(run)
    for row, result in zip(rows, run.results):
        lengths = [len(output) for output in result.outputs]
        assert lengths == [spec.max_new_tokens for spec in workload.requests for _ in range(3)], result.backend
        # Temperature 1 on random weights: the 3 samples of a request are not all the same.
        assert any(len({tuple(o) for o in result.outputs[i : i + 3]}) > 1 for i in range(0, 9, 3)), result.backend
        assert row["num_agree"] is None and row["mismatches"] is None
    by_backend = {row["backend"]: row for row in rows}
    # Budget 2x cannot hold 3 worst-case rows: dynamic takes one request (3 rows) and reserves more than the budget.
    assert by_backend["dynamic"]["peak_concurrency"] == 3
    assert by_backend["dynamic"]["reserved_mib"] > by_backend["dynamic"]["kv_budget_mib"]
    assert by_backend["engine"]["reserved_mib"] <= by_backend["engine"]["kv_budget_mib"]
    text = "\n".join(serving_report.render({"facts": serving_report.describe(run), "rows": rows}))
    assert "n/a (sampled)" in text and "Parallel sampling: each request is 3 sequences" in text


def test_budget_is_whole_block_reservations(model, workload):
    budget = serving.Budget.for_workload(model, workload, 3)
    worst = workload.max_prompt_len + workload.max_new_tokens
    assert budget.reservation_tokens % serving.BLOCK_SIZE == 0
    assert worst <= budget.reservation_tokens < worst + serving.BLOCK_SIZE
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert budget.bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert budget.bytes == 3 * budget.reservation_tokens * budget.bytes_per_token
    assert serving.dynamic_batch_size(budget) == 3


def test_every_backend_serves_every_request(run, workload):
    assert not run.failures
    ran = {(result.backend, result.multiple) for result in run.results}
    assert ran == {(name, m) for name in serving.default_backends() for m in MULTIPLES}
    for result in run.results:
        assert [len(output) for output in result.outputs] == [spec.max_new_tokens for spec in workload.requests]


def test_reference_is_per_request_generate(model, workload, run):
    spec = workload.requests[0]
    input_ids = torch.tensor([spec.prompt_ids])
    out = model.generate(
        input_ids,
        past_key_values=DynamicCache(config=model.config),
        do_sample=False,
        max_new_tokens=spec.max_new_tokens,
    )
    assert run.reference[0] == out[0, input_ids.shape[1] :].tolist()


def test_greedy_fp32_agrees_everywhere(rows):
    for row in rows:
        assert row["mismatches"] == [], (row["backend"], row["budget"], row["mismatches"])
        assert row["num_agree"] == row["num_sequences"]


def test_metrics_are_consistent(rows, run, workload):
    for row, result in zip(rows, run.results):
        name = (row["backend"], row["budget"])
        assert row["output_tok_s"] > 0 and row["requests_s"] > 0, name
        assert row["output_tok_s"] == pytest.approx(workload.num_output_tokens / result.wall_s)
        if row["backend"] == serving.PEER:
            assert row["utilization"] is None, name  # its cache is internal
        else:
            assert 0 < row["utilization"] <= 1, name
        assert 0 <= row["ttft_p50_s"] <= row["ttft_p99_s"] <= result.wall_s + 1e-6, name
        assert 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"], name
        assert all(f >= t for f, t in zip(result.finish, result.first_token)), name
        assert row["other_load"] is None or row["other_load"] >= 0, name
        assert 1 <= row["peak_concurrency"] and 0 < row["mean_concurrency"] <= row["peak_concurrency"] + 1e-9, name
    by_key = {(row["backend"], row["budget"]): row for row in rows}
    for m in MULTIPLES:
        budget = f"{m}x"
        dynamic, engine = by_key["dynamic", budget], by_key["engine", budget]
        assert dynamic["tok_s_vs_dynamic"] == 1 and dynamic["concurrency_vs_dynamic"] == 1
        assert dynamic["peak_concurrency"] == m
        assert engine["peak_concurrency"] >= dynamic["peak_concurrency"]
        # Paged backends hold a pool of exactly the budget (whole blocks); dynamic reserves batch x reservation.
        assert engine["reserved_mib"] == by_key["paged-generate", budget]["reserved_mib"] == dynamic["reserved_mib"]
        assert by_key["static", budget]["reserved_mib"] >= dynamic["reserved_mib"]  # 1024-token slots, >= 1 row
        assert engine["wasted_tokens"] == 0 and dynamic["wasted_tokens"] >= 0


def test_render_has_every_section(run, rows):
    served = {"facts": serving_report.describe(run), "rows": rows, "notes": ["a note"]}
    text = "\n".join(serving_report.render(served))
    for heading in (
        "## Serving: `burst` workload",
        "### Throughput and latency",
        "### KV memory and concurrency",
        "### Greedy agreement with per-request generate()",
        "### Notes",
    ):
        assert heading in text
    assert "All 10 runs reproduce every request token for token." in text
    for name in serving.default_backends():
        assert f"| {name} " in text
    log = render({"header": {"command": "python -m bench"}, "serving": served, **_fake_cache_report()})
    assert log.startswith("# Serving log")
    assert log.index("## Serving:") < log.index("## PagedCache under plain generate()")


def _fake_cache_report():
    demo = dict(
        dynamic_tokens=[1, 2],
        paged_tokens=[1, 2],
        dynamic_kv_bytes=10,
        paged_kv_bytes=12,
        paged_block_size=16,
        identical=True,
    )
    return {
        "demo": demo,
        "kv_bytes_held": [{"mode": "x"}],
        "sliding_window_bytes": [{"cache": "y"}],
        "decode_speed": [{"batch": 1}],
    }


def test_mismatch_is_reported_with_its_position(run):
    assert serving_report.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert serving_report.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert serving_report.first_difference([1, 2], [1, 2, 3]) == 2
    broken = run.results[0]
    outputs = [list(output) for output in broken.outputs]
    outputs[1][2] += 1
    bad = serving.RunResult(**{**broken.__dict__, "outputs": outputs})
    fake = serving.ServingRun(run.workload, run.budgets, run.reference, [bad])
    [row] = serving_report.summarize_all(fake)
    token = outputs[1][2]
    assert row["mismatches"] == [{"request": 1, "first_difference": 2, "token": token, "reference_token": token - 1}]
    text = "\n".join(serving_report.render({"facts": serving_report.describe(fake), "rows": [row]}))
    assert f"request 1 at token 2 ({token} for {token - 1})" in text


def test_a_mismatch_recomputes_the_reference(model, run):
    """A backend that differs from the reference makes the harness compute those requests' reference again: the
    note says whether the reference reproduces (the backend's fault) or changed (the host's)."""
    good = run.results[0]
    assert serving.recheck_reference(model, run.workload, run.reference, [good], progress=False) is None
    assert serving.recheck_reference(model, run.workload, None, [good], progress=False) is None
    outputs = [list(output) for output in good.outputs]
    outputs[3][0] += 1
    bad = serving.RunResult(**{**good.__dict__, "outputs": outputs})
    note = serving.recheck_reference(model, run.workload, run.reference, [good, bad], progress=False)
    assert note.startswith("reference recomputed for request(s) 3: it reproduces")
    # A reference that does not come out the same again (here: altered after the fact) is named as such.
    altered = [list(output) for output in run.reference]
    altered[1][0] += 1
    note = serving.recheck_reference(model, run.workload, altered, [good], progress=False)
    assert "request(s) 1: it changed for 1;" in note and "not the backends'" in note


def test_the_reference_recheck_is_bounded(model, run, monkeypatch):
    """Only the first `MAX_RECHECKED` differing requests are computed again (a bfloat16 run may differ in many)."""
    good = run.results[0]
    outputs = [[token + 1 for token in output] for output in good.outputs]
    bad = serving.RunResult(**{**good.__dict__, "outputs": outputs})
    monkeypatch.setattr(serving, "MAX_RECHECKED", 2)
    note = serving.recheck_reference(model, run.workload, run.reference, [bad], progress=False)
    assert note.startswith("reference recomputed for request(s) 0, 1: it reproduces")


class _TwinPlugin:
    """A third-party backend: DynamicCache under another name."""

    @hookimpl
    def hf_paged_register_backends(self, register):
        register("dynamic-twin", lambda config: DynamicCache(config=config), description="test twin")


def test_third_party_backend_runs_like_dynamic(model, workload):
    registry = BackendRegistry()
    registry.register_plugin(_TwinPlugin())
    assert serving.third_party_backends(registry) == ["dynamic-twin"]
    assert serving.default_backends(registry)[-1] == "dynamic-twin"
    run = serving.run_serving(model, workload, [2], ["dynamic", "dynamic-twin"], registry=registry, progress=False)
    dynamic, twin = run.results
    assert twin.backend == "dynamic-twin" and twin.outputs == dynamic.outputs == run.reference
    assert twin.peak_concurrency == dynamic.peak_concurrency == 2


def test_repeats_keep_the_fastest_run_of_each(model, workload):
    run = serving.run_serving(model, workload, [2, 3], ["engine", "dynamic"], repeats=2, progress=False)
    assert [(r.backend, r.multiple) for r in run.results] == [
        ("engine", 2),
        ("dynamic", 2),
        ("engine", 3),
        ("dynamic", 3),
    ]
    assert run.repeats == 2 and run.notes == [] and all(r.outputs == run.reference for r in run.results)
    for result in run.results:  # every repeat's wall time, the fastest kept
        walls = result.extra["repeat_walls_s"]
        assert len(walls) == 2 and result.wall_s == min(walls)
    with pytest.raises(ValueError, match="repeats"):
        serving.run_serving(model, workload, [2], ["dynamic"], repeats=0, progress=False)


def test_unknown_backend_lists_the_valid_ones(model, workload):
    with pytest.raises(ValueError, match="engine"):
        serving.run_serving(model, workload, [2], ["nope"], progress=False)


def test_arrivals_must_be_sorted():
    with pytest.raises(ValueError, match="sorted by arrival"):
        Workload("x", (RequestSpec((2,), 1, 1.0), RequestSpec((2,), 1, 0.0)))


def test_cli_options():
    args = parse_args(["--budgets", "2,4.5", "--backends", "dynamic, engine", "--workload", "burst"])
    assert args.budgets == [2, 4.5] and args.backends == ["dynamic", "engine"] and args.workload == "burst"
    assert parse_args([]).budgets is None  # quick/full pick their own
    with pytest.raises(SystemExit):
        parse_args(["--budgets", "0"])
    assert parse_args(["--workload", "poisson", "--rate", "2"]).rate == 2
    with pytest.raises(SystemExit):
        parse_args(["--rate", "2"])  # burst has no rate
