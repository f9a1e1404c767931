"""bench/replay.py: the Engine's scheduling without the model takes exactly the decisions the real Engine takes."""

import pytest

from bench.continuous import add_workload_request
from bench.replay import main, replay
from bench.runs import BLOCK_SIZE, Budget
from bench.workloads import RequestSpec, Workload, make_workload, random_requests
from hf_paged import BlockPool, Engine
from tests.models import tiny_model


def _workload(num_samples=1):
    requests = random_requests(10 // num_samples, (20, 60), (10, 40), vocab_size=128, seed=3)
    return Workload("burst", requests, num_samples=num_samples, temperature=1.0 if num_samples > 1 else 0.0)


@pytest.mark.parametrize("decode_reserve_tokens", [None, 0], ids=["lookahead", "preempting"])
@pytest.mark.parametrize(
    "name, num_samples",
    # gemma3: two layer groups, a sliding one gives blocks back; 2 samples: siblings share prompt blocks and
    # sample their own outputs (a preempted one must not find its sibling's output blocks in the prefix cache)
    [("llama", 1), ("gemma3", 1), ("llama", 2)],
)
def test_replay_takes_the_real_engines_decisions(name, num_samples, decode_reserve_tokens):
    model = tiny_model(name, "hf_paged")
    workload, multiple = _workload(num_samples), 2.5
    budget = Budget.for_workload(model, workload, multiple)
    pool = BlockPool.for_model(model, max_memory=budget.bytes, block_size=BLOCK_SIZE)
    engine = Engine(model, pool, max_num_seqs=8, max_num_batched_tokens=64, decode_reserve_tokens=decode_reserve_tokens)
    for index in range(workload.num_requests):  # as bench/continuous.py's run_engine adds them
        add_workload_request(engine, workload, index)
    while engine.has_unfinished():
        engine.step()

    result = replay(
        workload,
        multiple,
        config=model.config,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        decode_reserve_tokens=decode_reserve_tokens,
    )
    stats = engine.stats
    assert result.num_blocks == pool.num_blocks
    assert result.num_steps == stats.num_steps
    assert result.mean_rows == stats.mean_running and result.peak_rows == stats.peak_running
    assert result.mean_occupancy == sum(stats.used_blocks) / len(stats.used_blocks) / pool.num_blocks
    assert (result.num_preemptions, result.prefill_tokens, result.prefix_hit_tokens) == (
        stats.num_preemptions,
        stats.prefill_tokens,
        stats.prefix_hit_tokens,
    )
    if decode_reserve_tokens == 0 and name == "llama":  # the preempting cases really preempt and recompute
        assert result.num_preemptions > 0
        assert result.prefill_tokens + result.prefix_hit_tokens > result.prompt_tokens  # recomputed or found again
    if decode_reserve_tokens is None:
        assert result.num_preemptions == 0
        assert result.prefill_tokens + result.prefix_hit_tokens == result.prompt_tokens  # each prompt block once
    if num_samples > 1:  # the second sample takes its prompt's full blocks from the first
        assert result.prefix_hit_tokens > 0
    assert model.config._attn_implementation == "hf_paged"  # the stand-in copied the config it was given


def test_replay_counts_rows_against_the_static_batch_and_the_memory_bound():
    result = replay(make_workload("burst", vocab_size=8192, full=False), 2)
    assert result.static_batch == 2  # two worst-case reservations: dynamic's batch of 2
    assert 1 < result.mean_rows / result.static_batch and result.mean_rows < result.bound
    assert 0 < result.mean_occupancy <= 1


def test_replay_refuses_arrivals_after_t0():
    late = Workload("poisson", (RequestSpec((5, 6, 7), 4), RequestSpec((8, 9), 4, arrival=1.5)))
    with pytest.raises(ValueError, match=r"every request at t=0.*1 of 2 arriving later, the last at 1.5 s"):
        replay(late, 2)


def test_cli_prints_one_row_per_budget(capsys):
    assert main(["--budgets", "2,4", "--workload", "shared-prefix"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("shared-prefix: ")
    lines = [line for line in out.splitlines() if line.startswith("| 2x") or line.startswith("| 4x")]
    assert len(lines) == 2
    # shared-prefix: the prefix cache gives every request after the first its system prompt
    assert all(int(line.rstrip(" |").rsplit("|", 1)[1]) > 0 for line in lines)


def test_cli_replays_the_workload_of_the_seed_asked_for(capsys):
    assert main(["--budgets", "2", "--seed", "3"]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line.startswith("burst: ") and first_line.endswith("(uniform, seed 3)")


def test_cli_replays_a_model_with_sliding_layers_at_its_own_memory_bound(capsys):
    """`--layers mixed`: the default sizes with 5 sliding layers to 1 full one, one layer group per layer (so six
    times the blocks of the same bytes). The quick workload's sequences are shorter than the window of 256, so the
    budget is the full model's; the memory bound counts what each layer holds."""
    assert main(["--budgets", "1", "--layers", "mixed"]) == 0
    out = capsys.readouterr().out
    full = main(["--budgets", "1"]) == 0 and capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("| 1x")]
    (full_row,) = [line for line in full.splitlines() if line.startswith("| 1x")]
    cells, full_cells = [c.strip() for c in row.split("|")], [c.strip() for c in full_row.split("|")]
    assert int(cells[2]) == 6 * int(full_cells[2])  # blocks
    assert 0 < float(cells[7]) <= 1 and 0 < float(full_cells[7]) <= 1  # of bound
