"""Backfill admission and the lookahead: when the first waiting request does not fit, a later one of the next
`backfill_depth` that does goes first, a request passed over `Admission.MAX_SKIPS` times blocks backfill behind it,
and the plan admission checks newcomers against counts prefill waits, so the default admission never preempts."""

import itertools
import random

import pytest
import torch

from hf_paged import BlockPool, Engine, KVLayout, SamplingParams
from hf_paged.engine import Request, Scheduler
from hf_paged.engine.admission import Admission
from hf_paged.engine.lookahead import GrowthModel
from tests.models import greedy_reference, tiny_model
from tests.scheduler_runs import drive, new_request, run_step

BLOCK_SIZE = 4


def _scheduler(num_blocks: int, **kwargs) -> Scheduler:
    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=num_blocks, block_size=BLOCK_SIZE)
    return Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, **kwargs)


def _fill(scheduler: Scheduler, big_first: bool = True) -> tuple[Request, Request, Request]:
    """A 10-block pool: one running request peaking at 5 blocks (16 + 4 tokens), then a waiting one peaking at 6
    (20 + 4) that cannot join it, then one peaking at 3 (8 + 4) that can."""
    running, big, small = new_request(0, 16, 5), new_request(1, 20, 5), new_request(2, 8, 5)
    scheduler.add(running)
    assert scheduler.schedule().prefill == [(running, 16)]
    running.num_computed = 16  # what the engine does after the forward: the prompt is cached, one token sampled
    running.output_ids.append(7)
    for request in (big, small) if big_first else (small, big):
        scheduler.add(request)
    return running, big, small


def test_a_later_request_that_fits_goes_first_and_the_head_counts_a_skip():
    scheduler = _scheduler(10)
    running, big, small = _fill(scheduler)
    assert not scheduler.fits(big) and scheduler.fits(small)
    step = scheduler.schedule()
    assert scheduler.running == [running, small] and list(scheduler.waiting) == [big]
    assert step.prefill == [(small, 8)] and [r.request_id for r in step.decode] == [0]
    assert big.num_skips == 1 and small.num_skips == 0


def test_a_try_checks_first_where_the_try_before_failed_and_answers_the_same():
    """The lookahead remembers the step a newcomer failed at and checks it first for the next one (and, a step
    later, in the next step's forecast): a second newcomer that fails there stops after one check point, and every
    answer is the one of checking them all."""
    scheduler = _scheduler(10)
    running, big, small = _fill(scheduler)
    twin = new_request(3, 20, 5)  # fails where `big` does
    lookahead = scheduler.admission.lookahead(scheduler.running)
    assert lookahead.failed_at is None and not lookahead.fits(big)
    failed_at = lookahead.failed_at
    assert failed_at is not None
    checked = []  # the steps the running requests' demand is asked for
    running_demand = lookahead._running_demand
    lookahead._running_demand = lambda t: checked.append(t) or running_demand(t)
    assert not lookahead.fits(twin) and checked == [failed_at]
    assert lookahead.fits(small) and lookahead.failed_at == failed_at  # a newcomer that fits checks them all
    fresh = scheduler.admission.lookahead(scheduler.running)  # no hint: the same answers
    assert (fresh.fits(big), fresh.fits(twin), fresh.fits(small)) == (False, False, True)
    scheduler.schedule()  # admits `small`, passes `big`: the hint carries to the next step, a step earlier
    assert scheduler.admission._failed_at is not None


def test_strict_arrival_order_with_a_window_of_one():
    scheduler = _scheduler(10, backfill_depth=1)
    running, big, small = _fill(scheduler)
    scheduler.schedule()
    assert scheduler.running == [running] and list(scheduler.waiting) == [big, small]
    assert big.num_skips == 0


def test_the_window_bounds_how_far_admission_looks():
    scheduler = _scheduler(10, backfill_depth=2)
    running, big, small = _fill(scheduler)
    scheduler.waiting.insert(1, new_request(3, 24, 5))  # another that does not fit, between the two
    scheduler.schedule()
    assert scheduler.running == [running]  # the small one is third: outside a window of 2


def test_a_request_skipped_max_skips_times_blocks_backfill_behind_it():
    scheduler = _scheduler(10)
    running, big, small = _fill(scheduler)
    big.num_skips = Admission.MAX_SKIPS
    scheduler.schedule()
    assert scheduler.running == [running] and list(scheduler.waiting) == [big, small]
    # Once blocks come back, it goes first.
    scheduler.retire(running)
    scheduler.schedule()
    assert scheduler.running[0] is big


def test_backfill_depth_must_be_a_positive_int():
    for bad in (0, -1, 2.5, True):
        message = rf"backfill_depth must be an int >= 1 \(1: strict arrival order\), got {bad}"
        with pytest.raises(ValueError, match=message):
            _scheduler(10, backfill_depth=bad)


def test_engine_backfill_runs_more_side_by_side_and_matches_generate():
    """A long prompt second in line waits for blocks while the short prompts behind it run beside the first: more
    requests at once than in arrival order, every output still equal to generate() alone, no preemption."""
    generator = torch.Generator().manual_seed(3)
    lengths, new_tokens = (12, 40, 6, 5, 7), [8, 8, 6, 6, 6]
    prompts = [torch.randint(2, 128, (n,), generator=generator).tolist() for n in lengths]
    reference = greedy_reference("llama", prompts, new_tokens)
    stats = {}
    for window in (1, 8):
        engine_model = tiny_model("llama", "hf_paged")
        pool = BlockPool.for_model(engine_model, num_blocks=16, block_size=BLOCK_SIZE)
        engine = Engine(engine_model, pool, max_num_seqs=8, backfill_depth=window)
        assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == reference
        assert pool.num_used_blocks == 0
        stats[window] = engine.stats
    assert stats[8].num_preemptions == stats[1].num_preemptions == 0
    assert stats[8].mean_running > stats[1].mean_running
    assert stats[8].num_steps < stats[1].num_steps


def test_max_num_batched_tokens_must_cover_a_decode_row_per_request():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        Scheduler(
            BlockPool(KVLayout((2,), (4,)), num_blocks=8, block_size=BLOCK_SIZE),
            max_num_seqs=16,
            max_num_batched_tokens=8,
        )


class _NoPrefillDelayGrowth(GrowthModel):
    """A lookahead blind to prefill waits: every admitted request starts growing at once, whatever the prefill
    budget."""

    def growth(self, request, delay, prefilling, start=None):
        return super().growth(request, 0, prefilling, start)


class _NoPrefillDelay(Scheduler):
    growth_model_class = _NoPrefillDelayGrowth


def _burst(seed: int) -> list[Request]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 25, (24,), generator=generator).tolist()
    outputs = torch.randint(8, 17, (24,), generator=generator).tolist()
    return [new_request(i, n, k) for i, (n, k) in enumerate(zip(lengths, outputs))]


@pytest.mark.parametrize("backfill_depth", [1, 8])
def test_lookahead_counts_prefill_waits_and_never_preempts(backfill_depth):
    """A burst admitted at once prefills a few prompts a step (16 or 32 tokens of budget), so the last ones start
    and end steps late. The lookahead counts that wait and never preempts; a lookahead that does not count it
    admits on plans that run out of blocks at the burst's end."""
    late_plans = 0
    for seed, num_blocks, budget in itertools.product(range(6), (16, 24, 32, 40, 64, 96), (16, 32)):
        kwargs = dict(max_num_seqs=16, max_num_batched_tokens=budget, backfill_depth=backfill_depth)
        scheduler = Scheduler(BlockPool(KVLayout((2,), (4,)), num_blocks=num_blocks, block_size=BLOCK_SIZE), **kwargs)
        drive(scheduler, _burst(seed))
        assert scheduler.num_preemptions == 0, (seed, num_blocks, budget)
        pool = BlockPool(KVLayout((2,), (4,)), num_blocks=num_blocks, block_size=BLOCK_SIZE)
        unaware = _NoPrefillDelay(pool, **kwargs)
        drive(unaware, _burst(seed))
        late_plans += unaware.num_preemptions
    assert late_plans > 0


class _NoPrefixWaitsGrowth(GrowthModel):
    """The lookahead without the wait of a request for prompt blocks another one is computing."""

    def add_prefix_waits(self, requests, prefilling, delays, per_step, peek):
        return {}


class _NoPrefixWaits(Scheduler):
    growth_model_class = _NoPrefixWaitsGrowth


def _shared_prompt_workload(rng: random.Random) -> tuple[int, int, list[tuple[list[int], int]]]:
    """(num_blocks, block_size, [(prompt, max_new_tokens)]): 2-4 small requests, most of them prefixes of one
    8-token prompt (so one computes blocks the others wait for), in pools of 2-16 blocks."""
    block_size = rng.choice([1, 2, 4])
    shared = [rng.randrange(1, 99) for _ in range(8)]
    specs = []
    for _ in range(rng.randint(2, 4)):
        if rng.random() < 0.6:
            prompt = shared[: rng.randint(2, 8)]
        else:
            prompt = [rng.randrange(100, 999) for _ in range(rng.randint(1, 8))]
        specs.append((prompt, rng.randint(1, 6)))
    return rng.randint(2, 16), block_size, specs


def test_lookahead_counts_waits_for_a_shared_prefix_and_never_preempts():
    """With prefix caching, a request whose prompt continues with blocks another request is computing waits for them
    (then takes them from the cache), so it starts and ends later than its own prefill alone says. Counting that
    wait, no admitted request is preempted in 3,000 small shared-prompt workloads; without it, some are."""
    rng = random.Random(0)
    unaware_preemptions = 0
    for _ in range(3000):
        num_blocks, block_size, specs = _shared_prompt_workload(rng)
        for cls in (Scheduler, _NoPrefixWaits):
            pool = BlockPool(
                KVLayout((2,), (4,)), num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True
            )
            scheduler = cls(pool, max_num_seqs=8, max_num_batched_tokens=64)
            requests = [Request(i, prompt, SamplingParams(max_new_tokens=n)) for i, (prompt, n) in enumerate(specs)]
            drive(scheduler, requests)
            pool.allocator.check_invariants()
            if cls is Scheduler:
                assert scheduler.num_preemptions == 0, (num_blocks, block_size, specs)
            else:
                unaware_preemptions += scheduler.num_preemptions
    assert unaware_preemptions > 0


def test_engine_with_a_shared_prefix_wait_matches_generate_without_preempting():
    """Three prompts sharing a 2-token start in 8 blocks of 2: the third waits for the second's blocks. Planned as
    if it started at once, it would be preempted; with its wait counted, nothing is."""
    prompts = [[50, 51], [50, 51, 16, 33, 47, 21, 25, 18], [50, 51, 16]]
    new_tokens = [1, 6, 3]
    reference = greedy_reference("llama", prompts, new_tokens)
    engine_model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(engine_model, num_blocks=8, block_size=2)
    engine = Engine(engine_model, pool, max_num_seqs=8, max_num_batched_tokens=64)
    assert pool.allocator.enable_prefix_caching  # the Engine's default on a one-group pool
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == reference
    assert engine.stats.num_preemptions == 0 and pool.num_used_blocks == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_one_lookahead_answers_every_newcomer_as_a_fresh_one(prefix_caching):
    """Admission tries every waiting request in its window against one plan of the running requests (`Lookahead`);
    what that plan memoizes while it answers for one newcomer must not change its answer for the next, in any
    order. Random pools, running sets caught mid-prefill or mid-decode, prompts that share a prefix."""
    rng = random.Random(1)
    num_checked = num_mixed = 0
    for _ in range(300):
        shared = [rng.randrange(1, 99) for _ in range(12)]
        pool = BlockPool(
            KVLayout((2,), (4,)),
            num_blocks=rng.randint(6, 24),
            block_size=rng.choice([1, 2, 4]),
            enable_prefix_caching=prefix_caching,
        )
        scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=rng.choice([8, 16, 64]))
        for index in range(16):
            prompt = shared[: rng.randint(2, 12)] + [rng.randrange(100, 999) for _ in range(rng.randint(0, 6))]
            scheduler.add(Request(index, prompt, SamplingParams(max_new_tokens=rng.randint(1, 8))))
        for _ in range(rng.randint(1, 4)):
            run_step(scheduler)
        waiting = list(scheduler.waiting)
        if not scheduler.running or not waiting or len(scheduler.running) == scheduler.max_num_seqs:
            continue  # admission tries no newcomer then
        fresh = [scheduler.fits(request) for request in waiting]
        for order in (waiting, waiting[::-1]):
            lookahead = scheduler.admission.lookahead(scheduler.running)
            answers = {request.request_id: lookahead.fits(request) for request in order}
            assert [answers[request.request_id] for request in waiting] == fresh
        num_checked += 1
        num_mixed += len(set(fresh)) > 1
    assert num_checked > 50 and num_mixed > 10, (num_checked, num_mixed)
