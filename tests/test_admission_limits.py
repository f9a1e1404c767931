"""What a step and a request may take: a step never passes `max_num_batched_tokens`, and `add` turns a request away
exactly when it could not run even alone (`BlockManager.solo_need`); a request running alone computes the part of a
chunk that fits."""

import random

import pytest

from hf_paged import BlockPool, KVLayout
from hf_paged.engine import Scheduler
from tests.scheduler_runs import drive, finish_step, new_request

BLOCK_SIZE = 4


def test_decode_rows_after_a_prefill_chunk_keep_their_token_within_the_budget():
    """A 10-token prompt, then a 1-token one whose row is a decode row, with a budget of 2 tokens a step: the decode
    row's token is set aside first, so the prompt gets 1 token a step (it took both, and the step ran 3)."""
    scheduler = Scheduler(
        BlockPool(KVLayout((2,), (4,)), num_blocks=64, block_size=BLOCK_SIZE), max_num_seqs=2, max_num_batched_tokens=2
    )
    long, short = new_request(0, 10, 2), new_request(1, 1, 2)
    scheduler.add(long)
    scheduler.add(short)
    step = scheduler.schedule()
    assert step.prefill == [(long, 1)] and step.decode == [short]
    finish_step(scheduler, step)
    drive(scheduler, [])
    assert len(long.output_ids) == 2 and len(short.output_ids) == 2


def test_a_request_over_the_sliding_count_is_turned_away_at_once():
    """`add` turns away a request that could not run even alone: 1 prompt + 4 new tokens, window 2, blocks of 2
    hold 2 full + 2 sliding blocks at position 2, so a 3-block pool turns it away before it runs (rather than
    admitting it to outgrow the pool alone), and a 4-block pool serves it."""
    sliding, full = "sliding_attention", "full_attention"
    for num_blocks in (3, 4):
        pool = BlockPool(KVLayout((2, 2), (4, 4), (sliding, full)), num_blocks=num_blocks, block_size=2)
        scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, sliding_windows=[2, None])
        request = new_request(0, 1, 4)
        if num_blocks == 3:
            scheduler.add(request)
            assert request.finished and not scheduler.has_unfinished()
            assert request.error == "request 0 needs 4 blocks (1 prompt + 4 new tokens, block_size 2); the pool has 3"
        else:
            drive(scheduler, [request], max_steps=20)
            assert request.error is None and len(request.output_ids) == 4


@pytest.mark.parametrize("mixed", [True, False], ids=["sliding+full", "sliding"])
def test_add_turns_away_exactly_what_cannot_run_alone(mixed):
    """Random requests on tiny pools with a sliding group (windows 1-12, blocks of 1-4, prefill budgets 2-64):
    - `solo_need` is the most any position needs (`held_at`), though it looks at the last `block_size` only;
    - a request is turned away iff that passes the pool, and one the pool holds is served in full, alone or in a
      burst, with the default admission or one that preempts (`decode_reserve_tokens=0`), never failing;
    - some served requests have an admission count (`GrowthModel.demand`) above the pool: checking that count,
      `add` would turn them away."""
    rng = random.Random(11 if mixed else 12)
    layer_types = ("sliding_attention", "full_attention") if mixed else ("sliding_attention",)
    layout = KVLayout((2,) * len(layer_types), (4,) * len(layer_types), layer_types)
    turned_away = served_below_demand = 0
    for _ in range(300):
        block_size, window, budget = rng.choice([1, 2, 4]), rng.randint(1, 12), rng.choice([2, 3, 8, 64])
        windows = [window, None][: len(layer_types)]
        specs = [(rng.randint(1, 40), rng.randint(1, 16)) for _ in range(rng.randint(1, 4))]
        probe = Scheduler(
            BlockPool(layout, num_blocks=1, block_size=block_size),
            max_num_seqs=2,
            max_num_batched_tokens=budget,
            sliding_windows=windows,
        )
        needs = []
        for prompt_len, new_tokens in specs:
            request = new_request(0, prompt_len, new_tokens)
            end = prompt_len + new_tokens - 1
            needs.append(probe.block_manager.solo_need(request))
            assert needs[-1] == max(probe.block_manager.counts.held_at(position) for position in range(end)), (
                block_size,
                window,
                end,
            )
        num_blocks = max(rng.choice(needs) + rng.randint(-2, 2), 1)
        for reserve in (None, 0):
            pool = BlockPool(layout, num_blocks=num_blocks, block_size=block_size)
            scheduler = Scheduler(
                pool,
                max_num_seqs=2,
                max_num_batched_tokens=budget,
                sliding_windows=windows,
                decode_reserve_tokens=reserve,
            )
            requests = [new_request(i, n, k) for i, (n, k) in enumerate(specs)]
            drive(scheduler, requests, max_steps=5000)
            case = (block_size, window, budget, num_blocks, specs, reserve)
            for request, need in zip(requests, needs):
                if need > num_blocks:
                    assert request.error is not None and f"needs {need} blocks" in request.error, case
                    turned_away += 1
                else:
                    assert request.error is None and len(request.output_ids) == request.params.max_new_tokens, case
                    tokens = len(request.prompt_ids)
                    demand = max(
                        scheduler.growth_model.demand(tokens, prefilling=True),
                        scheduler.growth_model.demand(tokens + request.params.max_new_tokens - 1, prefilling=False),
                    )
                    served_below_demand += demand > num_blocks
    assert turned_away > 0 and served_below_demand > 0


def test_a_recomputation_too_large_for_one_chunk_runs_in_smaller_ones_alone():
    """Sliding + full groups, window 2, blocks of 2, a 9-block pool, admission that keeps no room for growth: the
    second request is preempted after 2 tokens, and its recomputation in one chunk (6 prompt + 2 generated + 1 to
    feed: 5 blocks in each group) does not fit the pool even alone. Rather than being preempted and re-admitted
    forever, or failing, it runs alone and computes what the pool holds each step (the sliding group gives blocks
    back between chunks) and finishes. `add` let it in: alone, one token a step, it needs 7 blocks at most
    (`solo_need`)."""
    sliding, full = "sliding_attention", "full_attention"
    pool = BlockPool(KVLayout((2, 2), (4, 4), (sliding, full)), num_blocks=9, block_size=2)
    scheduler = Scheduler(
        pool, max_num_seqs=8, max_num_batched_tokens=64, sliding_windows=[2, None], decode_reserve_tokens=0
    )
    first, second = new_request(0, 1, 7), new_request(1, 6, 4)
    need = scheduler.block_manager.solo_need(second)
    assert need == 7  # at position 8: full blocks 0-4, sliding blocks 3-4 (the window sees positions 7-8)
    for request in (first, second):
        scheduler.add(request)
    chunks, peak = [], 0
    for _ in range(50):  # bounded: a scheduler that never finishes fails here
        if not scheduler.has_unfinished():
            break
        pending = second.num_pending
        step = scheduler.schedule()
        if scheduler.num_preemptions:
            chunks += [(num_tokens, pending) for request, num_tokens in step.prefill if request is second]
        peak = max(peak, len(second.block_ids))
        finish_step(scheduler, step)
    assert not scheduler.has_unfinished() and pool.num_used_blocks == 0
    assert scheduler.num_preemptions == 1
    assert first.error is None and len(first.output_ids) == 7
    assert second.error is None and len(second.output_ids) == 4
    assert chunks and chunks[0][0] < chunks[0][1]  # the recomputation's first chunk was cut to fit
    assert peak <= pool.num_blocks


def test_a_request_alone_fails_when_blocks_are_held_outside_the_engine():
    """`add` checks the whole pool; when a `PagedCache` (here: a plain allocation) holds some of it, a request that
    cannot compute even one more token alone fails with its numbers instead of waiting forever, and gives its
    blocks back."""
    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=6, block_size=BLOCK_SIZE)
    outside = pool.allocator.allocate(3)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    request = new_request(0, 10, 8)  # 17 tokens at its end: 5 blocks, 3 free
    drive(scheduler, [request], max_steps=20, num_held_outside=len(outside))
    assert request.error == (
        "request 0 cannot hold 13 tokens (10 prompt + 3 generated) even alone: 3 of the pool's 6 blocks are held "
        "outside this engine (a PagedCache on the same pool?); release them or give the engine a pool of its own"
    )
