"""Admission on pools with sliding-window layer groups: a sliding group counts the blocks its window (and a prefill
chunk's keys) span, not the whole prompt, and a cached prefix is taken when the request is admitted (on every pool),
so the default admission never preempts and runs more requests side by side."""

import random

import pytest

from hf_paged import BlockPool, KVLayout, SamplingParams
from hf_paged.engine import Request, Scheduler
from hf_paged.engine.lookahead import GrowthModel
from tests.scheduler_runs import drive, new_request, run_step


class _WindowAlignedDemandGrowth(GrowthModel):
    """A sliding count from the first block the last token's query sees, one block short when the window starts
    inside a block, and a prompt counted whole only at step 0."""

    def demand(self, num_tokens, *, prefilling, windows=None, start=0):
        assert windows is None  # no prefix caching in the tests that use it
        blocks = self.counts
        end_block = blocks.blocks_for(num_tokens)
        if prefilling:
            return end_block * len(blocks.group_windows)
        groups = range(len(blocks.group_windows))
        return sum(end_block - blocks.first_needed_block(group, num_tokens - 1) for group in groups)


class _WindowAlignedDemand(Scheduler):
    growth_model_class = _WindowAlignedDemandGrowth


@pytest.mark.parametrize("mixed", [True, False], ids=["sliding+full", "sliding"])
def test_lookahead_with_sliding_groups_never_preempts(mixed):
    """Random bursts through pools with a sliding group (alone, or beside a full one), windows of 1-12 tokens,
    blocks of 1-4, prefill budgets of 8-64: no admitted request is preempted, and none fails after admission.
    A count one block short (`_WindowAlignedDemand`) preempts in the same workloads."""
    rng = random.Random(1 if mixed else 2)
    layer_types = ("sliding_attention", "full_attention") if mixed else ("sliding_attention",)
    short_count_preemptions = 0
    for _ in range(400):
        block_size, window = rng.choice([1, 2, 4]), rng.randint(1, 12)
        specs = [(rng.randint(1, 16), rng.randint(1, 12)) for _ in range(rng.randint(2, 8))]
        num_blocks, budget = rng.randint(4, 40), rng.choice([8, 16, 64])
        for cls in (Scheduler, _WindowAlignedDemand):
            layout = KVLayout((2,) * len(layer_types), (4,) * len(layer_types), layer_types)
            pool = BlockPool(layout, num_blocks=num_blocks, block_size=block_size)
            windows = [window, None][: len(layer_types)]
            scheduler = cls(pool, max_num_seqs=8, max_num_batched_tokens=budget, sliding_windows=windows)
            requests = [new_request(i, n, k) for i, (n, k) in enumerate(specs)]
            drive(scheduler, requests, max_steps=2000)
            if cls is Scheduler:
                case = (block_size, window, num_blocks, budget, specs)
                assert scheduler.num_preemptions == 0, case
                # Turned away at `add` (with its numbers) or served in full; never failed once admitted.
                assert all(r.error is None or " needs " in r.error for r in requests), case
                assert all(len(r.output_ids) == r.params.max_new_tokens for r in requests if r.error is None), case
            else:
                short_count_preemptions += scheduler.num_preemptions
    assert short_count_preemptions > 0


class _WholePromptDemandGrowth(GrowthModel):
    """A prefill count that holds a sliding group at every block of the prompt while it is computed."""

    def demand(self, num_tokens, *, prefilling, windows=None, start=0):
        if prefilling:
            return self.counts.blocks_for(num_tokens) * len(self.counts.group_windows if windows is None else windows)
        return super().demand(num_tokens, prefilling=False, windows=windows, start=start)


class _WholePromptDemand(Scheduler):
    growth_model_class = _WholePromptDemandGrowth


@pytest.mark.parametrize("mixed", [True, False], ids=["sliding+full", "sliding"])
def test_long_prompts_in_small_chunks_count_a_window_plus_a_chunk(mixed):
    """Prompts much longer than a window plus a prefill chunk: while a prompt is computed in chunks of at most
    `max_num_batched_tokens`, a sliding group holds the blocks the chunk's keys span (window - 1 + chunk positions),
    not the whole prompt. Counted that way, no admitted request is preempted in 300 random bursts, every block
    comes back, and the runs take fewer steps than with the whole prompt counted. Both serve the same requests:
    `add` checks what a request needs alone (`BlockManager.solo_need`), not this count."""
    rng = random.Random(5 if mixed else 6)
    layer_types = ("sliding_attention", "full_attention") if mixed else ("sliding_attention",)
    steps = {Scheduler: 0, _WholePromptDemand: 0}  # over the bursts both serve in full
    served = {Scheduler: 0, _WholePromptDemand: 0}
    for _ in range(300):
        block_size, window, budget = rng.choice([1, 2, 4]), rng.randint(1, 8), rng.randint(2, 8)
        specs = [(rng.randint(10, 60), rng.randint(1, 8)) for _ in range(rng.randint(2, 6))]
        num_blocks = rng.randint(12, 48)
        runs = {}
        for cls in steps:
            layout = KVLayout((2,) * len(layer_types), (4,) * len(layer_types), layer_types)
            pool = BlockPool(layout, num_blocks=num_blocks, block_size=block_size)
            scheduler = cls(
                pool,
                max_num_seqs=budget,
                max_num_batched_tokens=budget,
                sliding_windows=[window, None][: len(layer_types)],
            )
            requests = [new_request(i, n, k) for i, (n, k) in enumerate(specs)]
            runs[cls] = (drive(scheduler, requests, max_steps=5000), sum(r.error is None for r in requests))
            assert scheduler.num_preemptions == 0, (cls.__name__, block_size, window, budget, num_blocks, specs)
            served[cls] += runs[cls][1]
        if all(num_served == len(specs) for _, num_served in runs.values()):
            for cls, (num_steps, _) in runs.items():
                steps[cls] += num_steps
    assert served[Scheduler] == served[_WholePromptDemand]
    assert steps[Scheduler] < steps[_WholePromptDemand]


@pytest.mark.parametrize("mixed", [True, False], ids=["sliding+full", "sliding"])
def test_prefix_caching_with_sliding_groups_never_preempts_and_hits(mixed):
    """Random bursts of prompts that share a start (a system prompt, repeats), through pools with a sliding group
    (alone, or beside a full one) and prefix caching: no admitted request is preempted (admission counts every
    request's blocks as its own, cached or shared ones included), every block goes back, the cache's maps stay
    consistent, and later requests find what earlier ones computed."""
    rng = random.Random(3 if mixed else 4)
    layer_types = ("sliding_attention", "full_attention") if mixed else ("sliding_attention",)
    num_hit_tokens = 0
    for _ in range(300):
        block_size, window = rng.choice([1, 2, 4]), rng.randint(1, 12)
        shared = [rng.randrange(1, 99) for _ in range(16)]
        prompts = [
            shared[: rng.randint(1, 16)] + [rng.randrange(100, 999) for _ in range(rng.randint(0, 4))]
            for _ in range(rng.randint(2, 8))
        ]
        specs = [(prompt, rng.randint(1, 8)) for prompt in prompts]
        layout = KVLayout((2,) * len(layer_types), (4,) * len(layer_types), layer_types)
        pool = BlockPool(layout, num_blocks=rng.randint(8, 40), block_size=block_size, enable_prefix_caching=True)
        scheduler = Scheduler(
            pool,
            max_num_seqs=8,
            max_num_batched_tokens=rng.choice([8, 16, 64]),
            sliding_windows=[window, None][: len(layer_types)],
        )
        requests = [Request(i, prompt, SamplingParams(max_new_tokens=n)) for i, (prompt, n) in enumerate(specs)]
        drive(scheduler, requests, max_steps=2000)
        case = (block_size, window, pool.num_blocks, specs)
        assert scheduler.num_preemptions == 0, case
        assert all(len(r.output_ids) == r.params.max_new_tokens for r in requests if r.error is None), case
        pool.allocator.check_invariants()
        num_hit_tokens += scheduler.num_prefix_hit_tokens
    assert num_hit_tokens > 1000


def test_with_a_sliding_group_admission_takes_a_cached_prefix_unless_it_waits_for_one():
    """Sliding (window 4) + full groups, blocks of 2. Once a 16-token prompt is computed, a newcomer continuing it is
    admitted holding the 8 cached blocks in the full group and its window's in the sliding one, before its prefill
    starts (so no eviction can shorten the hit admission counted). A third request, whose next block the second is
    computing, takes nothing yet: it waits for that block and looks up when its prefill starts."""
    sliding, full = "sliding_attention", "full_attention"
    pool = BlockPool(KVLayout((2, 2), (4, 4), (sliding, full)), num_blocks=60, block_size=2, enable_prefix_caching=True)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, sliding_windows=[4, None])
    system = list(range(1, 17))
    first = Request(0, system, SamplingParams(max_new_tokens=4))
    scheduler.add(first)
    run_step(scheduler)  # computes the prompt, caches its 8 blocks in both groups
    second = Request(1, system + [50, 51, 52, 53], SamplingParams(max_new_tokens=4))
    third = Request(2, system + [50, 51, 52, 53, 54, 55], SamplingParams(max_new_tokens=4))
    scheduler.add(second)
    scheduler.admit()
    assert second in scheduler.running and second.num_computed == 16
    assert second.first_blocks == [6, 0]  # a query at position 16 sees positions 13-16: blocks 6-8
    assert second.block_tables[1] == first.block_tables[1]  # the full group's 8 blocks, shared
    assert second.block_tables[0] == first.block_tables[0][6 - first.first_blocks[0] :][:2]  # its blocks 6 and 7
    scheduler.add(third)
    scheduler.admit()
    assert third in scheduler.running and not third.block_tables and third.num_computed == 0
    assert scheduler.prefix.peek(third).waits_for == second.block_hashes[8]
    drive(scheduler, [])
    assert [len(r.output_ids) for r in (first, second, third)] == [4, 4, 4] and scheduler.num_preemptions == 0
    pool.allocator.check_invariants()


def test_several_full_groups_take_a_cached_prefix_at_admission_and_never_preempt():
    """Layer types that mix with no window give several full-attention groups, each caching its own copy of a block.
    Evicting one group's free copy while another group's is held shortens a hit below blocks running requests
    hold, as a sliding window's eviction does, so admission takes a newcomer's prefix at once there too: these
    staggered arrivals would preempt once if the prefix were looked up at prefill start."""
    prompt = list(range(1, 31))
    prompts = [prompt[:14], prompt[:30], prompt[:12] + [100], prompt[:18] + [101, 102, 103, 104, 105], prompt[:28]]
    new_tokens, arrivals = [12, 8, 7, 3, 1], [0, 0, 1, 3, 11]
    layout = KVLayout((2, 2, 2), (4, 4, 4), ("sliding_attention", "full_attention", "sliding_attention"))
    pool = BlockPool(layout, num_blocks=57, block_size=3, enable_prefix_caching=True)
    scheduler = Scheduler(pool, max_num_seqs=3, max_num_batched_tokens=19, sliding_windows=[None] * 3)
    assert pool.num_groups == 3
    requests = [Request(i, p, SamplingParams(max_new_tokens=n)) for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    for step in range(200):
        for request, arrival in zip(requests, arrivals):
            if arrival == step:
                scheduler.add(request)
        if step > max(arrivals) and not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert scheduler.num_preemptions == 0 and not scheduler.has_unfinished()
    assert [len(r.output_ids) for r in requests] == new_tokens
    assert pool.num_used_blocks == 0 and scheduler.num_prefix_hit_tokens > 0
    pool.allocator.check_invariants()


def test_one_full_group_takes_a_cached_prefix_at_admission_and_never_preempts():
    """One full-attention group, blocks of 1. Requests 0 and 1 compute block 16 of the same prompt in one step;
    request 1's copy is cached first, then goes free when it finishes, while request 0 holds blocks 17-22 that hang
    from it in the hash chain. Request 3 is admitted counting a 23-block hit. Looked up at its prefill start, after
    request 0's growth evicts that free copy, it would find 16 and compute 7 blocks admission counted as held, and
    request 0 would be preempted. Taken at admission, the hit is held."""
    prompt = list(range(1, 25))
    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=29, block_size=1, enable_prefix_caching=True)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16)
    arrivals = {
        0: [Request(0, prompt, SamplingParams(max_new_tokens=3))],
        1: [
            Request(1, prompt[:17], SamplingParams(max_new_tokens=1)),
            Request(2, [300, 301], SamplingParams(max_new_tokens=2)),
        ],
        2: [Request(3, prompt[:23] + [99], SamplingParams(max_new_tokens=1))],
    }
    for step in range(20):
        for request in arrivals.get(step, []):
            scheduler.add(request)
        if step > 2 and not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert scheduler.num_preemptions == 0 and not scheduler.has_unfinished() and pool.num_used_blocks == 0
    assert [len(r.output_ids) for rs in arrivals.values() for r in rs] == [3, 1, 2, 1]
    pool.allocator.check_invariants()


@pytest.mark.parametrize(
    ("layer_types", "num_blocks", "peak", "num_steps"),
    [(("sliding_attention",), 28, 8, 10), (("sliding_attention", "full_attention"), 44, 4, 16)],
    ids=["sliding", "sliding+full"],
)
def test_blocks_requests_share_in_a_sliding_window_count_once(layer_types, num_blocks, peak, num_steps):
    """A 64-token system prompt (blocks of 4, window 16) is computed, then 8 requests continue it with 4 tokens of
    their own and 8 new tokens. Each takes the 4 cached blocks its window still sees (blocks 12-15), the same
    blocks for all 8, and adds at most 3 of its own: admission counts the shared 4 once (plus, beside a full group,
    the 16 full-group blocks once). Counting each window as its own, 5 blocks a request, runs 5 of them at once in
    16 steps in the sliding pool, and 3 in 24 steps beside a full group."""
    windows = [16 if kind == "sliding_attention" else None for kind in layer_types]
    layout = KVLayout((2,) * len(layer_types), (4,) * len(layer_types), layer_types)
    pool = BlockPool(layout, num_blocks=num_blocks, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=16, sliding_windows=windows)
    system = list(range(1, 65))
    drive(scheduler, [Request(0, system, SamplingParams(max_new_tokens=1))])
    requests = [
        Request(i, system + [100 + 4 * i + k for k in range(4)], SamplingParams(max_new_tokens=8)) for i in range(1, 9)
    ]
    for request in requests:
        scheduler.add(request)
    most, steps = 0, 0
    while scheduler.has_unfinished():
        run_step(scheduler)
        steps += 1
        most = max(most, sum(1 for request in scheduler.running if request.block_tables))
    assert (most, steps) == (peak, num_steps)
    assert scheduler.num_preemptions == 0 and scheduler.num_prefix_hit_tokens == 8 * 64
    assert all(len(request.output_ids) == 8 for request in requests) and pool.num_used_blocks == 0


def test_shared_sliding_windows_with_staggered_arrivals_never_preempt():
    """Random prompts continuing one of a few shared starts, arriving over time, through sliding pools (alone or
    beside a full group; windows of 2-40 tokens, blocks of 1-8) with prefix caching: counting a block several
    requests hold in a window once never admits more than the pool holds (no preemption), and every block comes
    back. Undercounting it (dropping the shared blocks' own count, or a newcomer counting a shared block as kept
    after its holders end) preempts in these cases."""
    rng = random.Random(11)
    for _ in range(250):
        kinds = rng.choice([("sliding_attention",), ("sliding_attention", "full_attention")])
        block_size, window = rng.choice([1, 2, 4, 8]), rng.randint(2, 40)
        starts = [[rng.randrange(1, 99) for _ in range(rng.randint(8, 80))] for _ in range(rng.choice([1, 2, 3]))]
        specs = []
        for _ in range(rng.randint(3, 14)):
            start = rng.choice(starts)
            prompt = start[: rng.randint(len(start) // 2, len(start))] + [rng.randrange(100, 999) for _ in range(4)]
            specs.append((prompt, rng.randint(1, 30), rng.randint(0, 40) if rng.random() < 0.6 else 0))
        layout = KVLayout((2,) * len(kinds), (4,) * len(kinds), kinds)
        pool = BlockPool(layout, num_blocks=rng.randint(6, 120), block_size=block_size, enable_prefix_caching=True)
        budget = rng.choice([4, 8, 16, 64])
        scheduler = Scheduler(
            pool,
            max_num_seqs=min(budget, 8),
            max_num_batched_tokens=budget,
            sliding_windows=[window if kind == "sliding_attention" else None for kind in kinds],
        )
        requests = [Request(i, prompt, SamplingParams(max_new_tokens=n)) for i, (prompt, n, _) in enumerate(specs)]
        case = (kinds, block_size, window, pool.num_blocks, budget, [(len(p), n, at) for p, n, at in specs])
        step = 0
        while step <= max(at for _, _, at in specs) or scheduler.has_unfinished():
            for request, (_, _, at) in zip(requests, specs):
                if at == step:
                    scheduler.add(request)
            if scheduler.has_unfinished():
                run_step(scheduler)
            step += 1
            assert step < 5000 and scheduler.num_preemptions == 0, case
        assert pool.num_used_blocks == 0, case
        assert all(len(r.output_ids) == r.params.max_new_tokens for r in requests if r.error is None), case
        pool.allocator.check_invariants()
