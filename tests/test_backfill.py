"""Backfill admission: when the first waiting request does not fit, a later one of the next `backfill_window` that
does goes first, and a request passed over `Scheduler.MAX_SKIPS` times blocks backfill behind it."""

import itertools
import random

import pytest
import torch

from hf_paged import BlockPool, Engine, KVLayout, SamplingParams
from hf_paged.engine import Request, Scheduler
from hf_paged.engine.lookahead import Lookahead
from tests.models import greedy_reference, tiny_model

BLOCK_SIZE = 4


def _scheduler(num_blocks: int, **kwargs) -> Scheduler:
    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=num_blocks, block_size=BLOCK_SIZE)
    return Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, **kwargs)


def _request(request_id: int, prompt_len: int, max_new_tokens: int) -> Request:
    prompt = list(range(100 * request_id + 1, 100 * request_id + 1 + prompt_len))
    return Request(request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens))


def _fill(scheduler: Scheduler, big_first: bool = True) -> tuple[Request, Request, Request]:
    """A 10-block pool: one running request peaking at 5 blocks (16 + 4 tokens), then a waiting one peaking at 6
    (20 + 4) that cannot join it, then one peaking at 3 (8 + 4) that can."""
    running, big, small = _request(0, 16, 5), _request(1, 20, 5), _request(2, 8, 5)
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


def test_strict_arrival_order_with_a_window_of_one():
    scheduler = _scheduler(10, backfill_window=1)
    running, big, small = _fill(scheduler)
    scheduler.schedule()
    assert scheduler.running == [running] and list(scheduler.waiting) == [big, small]
    assert big.num_skips == 0


def test_the_window_bounds_how_far_admission_looks():
    scheduler = _scheduler(10, backfill_window=2)
    running, big, small = _fill(scheduler)
    scheduler.waiting.insert(1, _request(3, 24, 5))  # another that does not fit, between the two
    scheduler.schedule()
    assert scheduler.running == [running]  # the small one is third: outside a window of 2


def test_a_request_skipped_max_skips_times_blocks_backfill_behind_it():
    scheduler = _scheduler(10)
    running, big, small = _fill(scheduler)
    big.num_skips = Scheduler.MAX_SKIPS
    scheduler.schedule()
    assert scheduler.running == [running] and list(scheduler.waiting) == [big, small]
    # Once blocks come back, it goes first.
    scheduler.retire(running)
    scheduler.schedule()
    assert scheduler.running[0] is big


def test_backfill_window_must_be_a_positive_int():
    for bad in (0, -1, 2.5, True):
        message = rf"backfill_window must be an int >= 1 \(1: strict arrival order\), got {bad}"
        with pytest.raises(ValueError, match=message):
            _scheduler(10, backfill_window=bad)


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
        engine = Engine(engine_model, pool, max_num_seqs=8, backfill_window=window)
        assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == reference
        assert pool.num_used_blocks == 0
        stats[window] = engine.stats
    assert stats[8].num_preemptions == stats[1].num_preemptions == 0
    assert stats[8].mean_running > stats[1].mean_running
    assert stats[8].num_steps < stats[1].num_steps


def test_max_num_batched_tokens_must_cover_a_decode_row_per_request():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        Scheduler(BlockPool(KVLayout((2,), (4,)), num_blocks=8, block_size=BLOCK_SIZE), max_num_seqs=16,
                  max_num_batched_tokens=8)


def _drive(scheduler: Scheduler, requests: list[Request], max_steps: int | None = None) -> int:
    """Run `requests` to the end as the engine would, without a model (every computed prompt samples token 7);
    returns the steps taken, asserting they stay under `max_steps` when given (a loop that never ends fails)."""
    for request in requests:
        scheduler.add(request)
    num_steps = 0
    while scheduler.has_unfinished():
        assert max_steps is None or num_steps < max_steps, f"still running after {num_steps} steps"
        _step(scheduler)
        num_steps += 1
    assert scheduler.pool.num_used_blocks == 0
    return num_steps


def _step(scheduler: Scheduler) -> None:
    _finish_step(scheduler, scheduler.schedule())


def _finish_step(scheduler: Scheduler, step) -> None:
    """What the engine does after the forward of `step` (which must fit the step's token budget)."""
    assert len(step.decode) + sum(num_tokens for _, num_tokens in step.prefill) <= scheduler.max_num_batched_tokens
    for request, num_tokens in [(r, 1) for r in step.decode] + step.prefill:
        request.num_computed += num_tokens
        scheduler.cache_full_blocks(request)
        if request.num_pending == 0:
            request.output_ids.append(7)
    done = [r for r in scheduler.running if r.num_pending == 1 and len(r.output_ids) >= r.params.max_new_tokens]
    for request in done:
        scheduler.retire(request)


class _NoPrefillDelay(Scheduler):
    """The lookahead as it was: every admitted request starts growing at once, whatever the prefill budget."""

    def _growth_plan(self, request, delay, prefilling, start=None):
        return super()._growth_plan(request, 0, prefilling, start)


def _burst(seed: int) -> list[Request]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 25, (24,), generator=generator).tolist()
    outputs = torch.randint(8, 17, (24,), generator=generator).tolist()
    return [_request(i, n, k) for i, (n, k) in enumerate(zip(lengths, outputs))]


@pytest.mark.parametrize("backfill_window", [1, 8])
def test_lookahead_counts_prefill_waits_and_never_preempts(backfill_window):
    """A burst admitted at once prefills a few prompts a step (16 or 32 tokens of budget), so the last ones start
    and end steps late. The lookahead counts that wait and never preempts; a lookahead that does not count it
    admits on plans that run out of blocks at the burst's end."""
    late_plans = 0
    for seed, num_blocks, budget in itertools.product(range(6), (16, 24, 32, 40, 64, 96), (16, 32)):
        kwargs = dict(max_num_seqs=16, max_num_batched_tokens=budget, backfill_window=backfill_window)
        scheduler = Scheduler(BlockPool(KVLayout((2,), (4,)), num_blocks=num_blocks, block_size=BLOCK_SIZE), **kwargs)
        _drive(scheduler, _burst(seed))
        assert scheduler.num_preemptions == 0, (seed, num_blocks, budget)
        pool = BlockPool(KVLayout((2,), (4,)), num_blocks=num_blocks, block_size=BLOCK_SIZE)
        unaware = _NoPrefillDelay(pool, **kwargs)
        _drive(unaware, _burst(seed))
        late_plans += unaware.num_preemptions
    assert late_plans > 0


class _NoPrefixWaits(Scheduler):
    """The lookahead without the wait of a request for prompt blocks another one is computing."""

    def _add_prefix_waits(self, requests, prefilling, delays, per_step):
        return {}


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
            pool = BlockPool(KVLayout((2,), (4,)), num_blocks=num_blocks, block_size=block_size,
                             enable_prefix_caching=True)
            scheduler = cls(pool, max_num_seqs=8, max_num_batched_tokens=64)
            requests = [Request(i, prompt, SamplingParams(max_new_tokens=n)) for i, (prompt, n) in enumerate(specs)]
            _drive(scheduler, requests)
            pool.allocator.check_invariants()
            if cls is Scheduler:
                assert scheduler.num_preemptions == 0, (num_blocks, block_size, specs)
            else:
                unaware_preemptions += scheduler.num_preemptions
    assert unaware_preemptions > 0


def test_engine_with_a_shared_prefix_wait_matches_generate_without_preempting():
    """Three prompts sharing a 2-token start in 8 blocks of 2 (found by a randomized search): the third waits for
    the second's blocks. Planned as if it started at once, it was preempted; counted, nothing is."""
    prompts = [[50, 51], [50, 51, 16, 33, 47, 21, 25, 18], [50, 51, 16]]
    new_tokens = [1, 6, 3]
    reference = greedy_reference("llama", prompts, new_tokens)
    engine_model = tiny_model("llama", "hf_paged")
    pool = BlockPool.for_model(engine_model, num_blocks=8, block_size=2)
    engine = Engine(engine_model, pool, max_num_seqs=8, max_num_batched_tokens=64)
    assert pool.allocator.enable_prefix_caching  # the Engine's default on a one-group pool
    assert engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True) == reference
    assert engine.stats.num_preemptions == 0 and pool.num_used_blocks == 0


def test_a_recomputation_too_large_for_one_chunk_runs_in_smaller_ones_alone():
    """Sliding + full groups, window 2, blocks of 2, a 9-block pool, admission that keeps no room for growth (found by
    a randomized search): the second request is preempted after 2 tokens, and its recomputation in one chunk (6
    prompt + 2 generated + 1 to feed: 5 blocks in each group) does not fit the pool even alone. It used to be
    preempted and re-admitted forever, then to fail; running alone, it now computes what the pool holds each step
    (the sliding group gives blocks back between chunks) and finishes. `add` let it in: alone, one token a step, it
    needs 7 blocks at most (`_solo_need`)."""
    sliding, full = "sliding_attention", "full_attention"
    pool = BlockPool(KVLayout((2, 2), (4, 4), (sliding, full)), num_blocks=9, block_size=2)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, sliding_windows=[2, None],
                          decode_reserve_tokens=0)
    first, second = _request(0, 1, 7), _request(1, 6, 4)
    need = scheduler._solo_need(second)
    assert need == 7  # at position 8: full blocks 0-4, sliding blocks 3-4 (the window sees positions 7-8)
    for request in (first, second):
        scheduler.add(request)
    chunks, peak = [], 0
    for _ in range(50):  # bounded: the first bug was an endless loop
        if not scheduler.has_unfinished():
            break
        pending = second.num_pending
        step = scheduler.schedule()
        if scheduler.num_preemptions:
            chunks += [(num_tokens, pending) for request, num_tokens in step.prefill if request is second]
        peak = max(peak, len(second.block_ids))
        _finish_step(scheduler, step)
    assert not scheduler.has_unfinished() and pool.num_used_blocks == 0
    assert scheduler.num_preemptions == 1
    assert first.error is None and len(first.output_ids) == 7
    assert second.error is None and len(second.output_ids) == 4
    assert chunks and chunks[0][0] < chunks[0][1]  # the recomputation's first chunk was cut to fit
    assert peak <= pool.num_blocks


def test_decode_rows_after_a_prefill_chunk_keep_their_token_within_the_budget():
    """A 10-token prompt, then a 1-token one whose row is a decode row, with a budget of 2 tokens a step: the decode
    row's token is set aside first, so the prompt gets 1 token a step (it took both, and the step ran 3)."""
    scheduler = Scheduler(BlockPool(KVLayout((2,), (4,)), num_blocks=64, block_size=4), max_num_seqs=2,
                          max_num_batched_tokens=2)
    long, short = _request(0, 10, 2), _request(1, 1, 2)
    scheduler.add(long)
    scheduler.add(short)
    step = scheduler.schedule()
    assert step.prefill == [(long, 1)] and step.decode == [short]
    _finish_step(scheduler, step)
    _drive(scheduler, [])
    assert len(long.output_ids) == 2 and len(short.output_ids) == 2


def test_a_request_alone_fails_when_blocks_are_held_outside_the_engine():
    """`add` checks the whole pool; when a `PagedCache` (here: a plain allocation) holds some of it, a request that
    cannot compute even one more token alone fails with its numbers instead of waiting forever, and gives its
    blocks back."""
    pool = BlockPool(KVLayout((2,), (4,)), num_blocks=6, block_size=BLOCK_SIZE)
    outside = pool.allocator.allocate(3)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    request = _request(0, 10, 8)  # 17 tokens at its end: 5 blocks, 3 free
    _drive_until_idle(scheduler, [request], max_steps=20)
    assert request.error == "request 0 cannot hold 13 tokens (10 prompt + 3 generated) even alone in a pool of 6 blocks"
    assert pool.num_used_blocks == len(outside)


def _drive_until_idle(scheduler: Scheduler, requests: list[Request], max_steps: int) -> None:
    for request in requests:
        scheduler.add(request)
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        _step(scheduler)
    raise AssertionError(f"still running after {max_steps} steps")


def test_a_request_over_the_sliding_count_is_turned_away_at_once():
    """`add` turns away a request that could not run even alone: 1 prompt + 4 new tokens, window 2, blocks of 2
    hold 2 full + 2 sliding blocks at position 2, so a 3-block pool turns it away before it runs (it used to be
    admitted and to outgrow the pool alone), and a 4-block pool serves it."""
    sliding, full = "sliding_attention", "full_attention"
    for num_blocks in (3, 4):
        pool = BlockPool(KVLayout((2, 2), (4, 4), (sliding, full)), num_blocks=num_blocks, block_size=2)
        scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, sliding_windows=[2, None])
        request = _request(0, 1, 4)
        if num_blocks == 3:
            scheduler.add(request)
            assert request.finished and not scheduler.has_unfinished()
            assert request.error == "request 0 needs 4 blocks (1 prompt + 4 new tokens, block_size 2); the pool has 3"
        else:
            _drive(scheduler, [request], max_steps=20)
            assert request.error is None and len(request.output_ids) == 4


@pytest.mark.parametrize("mixed", [True, False], ids=["sliding+full", "sliding"])
def test_add_turns_away_exactly_what_cannot_run_alone(mixed):
    """Random requests on tiny pools with a sliding group (windows 1-12, blocks of 1-4, prefill budgets 2-64):
    - `_solo_need` is the most any position needs (`_held_at`), though it looks at the last `block_size` only;
    - a request is turned away iff that passes the pool, and one the pool holds is served in full, alone or in a
      burst, with the default admission or one that preempts (`decode_reserve_tokens=0`), never failing;
    - the count admission uses (`_demand`) would have turned some of them away: the pool one block smaller than
      it, and at least the need."""
    rng = random.Random(11 if mixed else 12)
    layer_types = ("sliding_attention", "full_attention") if mixed else ("sliding_attention",)
    layout = KVLayout((2,) * len(layer_types), (4,) * len(layer_types), layer_types)
    turned_away = served_below_demand = 0
    for _ in range(300):
        block_size, window, budget = rng.choice([1, 2, 4]), rng.randint(1, 12), rng.choice([2, 3, 8, 64])
        windows = [window, None][: len(layer_types)]
        specs = [(rng.randint(1, 40), rng.randint(1, 16)) for _ in range(rng.randint(1, 4))]
        probe = Scheduler(BlockPool(layout, num_blocks=1, block_size=block_size), max_num_seqs=2,
                          max_num_batched_tokens=budget, sliding_windows=windows)
        needs = []
        for prompt_len, new_tokens in specs:
            request = _request(0, prompt_len, new_tokens)
            end = prompt_len + new_tokens - 1
            needs.append(probe._solo_need(request))
            assert needs[-1] == max(probe._held_at(position) for position in range(end)), (block_size, window, end)
        num_blocks = max(rng.choice(needs) + rng.randint(-2, 2), 1)
        for reserve in (None, 0):
            pool = BlockPool(layout, num_blocks=num_blocks, block_size=block_size)
            scheduler = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=budget, sliding_windows=windows,
                                  decode_reserve_tokens=reserve)
            requests = [_request(i, n, k) for i, (n, k) in enumerate(specs)]
            _drive(scheduler, requests, max_steps=5000)
            case = (block_size, window, budget, num_blocks, specs, reserve)
            for request, need in zip(requests, needs):
                if need > num_blocks:
                    assert request.error is not None and f"needs {need} blocks" in request.error, case
                    turned_away += 1
                else:
                    assert request.error is None and len(request.output_ids) == request.params.max_new_tokens, case
                    tokens = len(request.prompt_ids)
                    demand = max(scheduler._demand(tokens, prefilling=True),
                                 scheduler._demand(tokens + request.params.max_new_tokens - 1, prefilling=False))
                    served_below_demand += demand > num_blocks
    assert turned_away > 0 and served_below_demand > 0


class _WindowAlignedDemand(Scheduler):
    """The sliding count as it was: from the first block the last token's query sees, one block short when the
    window starts inside a block, and a prompt counted whole only at step 0."""

    def _demand(self, num_tokens, *, prefilling, windows=None, start=0):
        assert windows is None  # no prefix caching in the tests that use it
        end_block = self._blocks_for(num_tokens)
        if prefilling:
            return end_block * len(self.group_windows)
        groups = range(len(self.group_windows))
        return sum(end_block - self._first_needed_block(group, num_tokens - 1) for group in groups)


@pytest.mark.parametrize("mixed", [True, False], ids=["sliding+full", "sliding"])
def test_lookahead_with_sliding_groups_never_preempts(mixed):
    """Random bursts through pools with a sliding group (alone, or beside a full one), windows of 1-12 tokens,
    blocks of 1-4, prefill budgets of 8-64: no admitted request is preempted, and none fails after admission.
    The count as it was (`_WindowAlignedDemand`) preempts in the same workloads."""
    rng = random.Random(1 if mixed else 2)
    layer_types = ("sliding_attention", "full_attention") if mixed else ("sliding_attention",)
    as_before = 0
    for _ in range(400):
        block_size, window = rng.choice([1, 2, 4]), rng.randint(1, 12)
        specs = [(rng.randint(1, 16), rng.randint(1, 12)) for _ in range(rng.randint(2, 8))]
        num_blocks, budget = rng.randint(4, 40), rng.choice([8, 16, 64])
        for cls in (Scheduler, _WindowAlignedDemand):
            layout = KVLayout((2,) * len(layer_types), (4,) * len(layer_types), layer_types)
            pool = BlockPool(layout, num_blocks=num_blocks, block_size=block_size)
            windows = [window, None][: len(layer_types)]
            scheduler = cls(pool, max_num_seqs=8, max_num_batched_tokens=budget, sliding_windows=windows)
            requests = [_request(i, n, k) for i, (n, k) in enumerate(specs)]
            _drive(scheduler, requests, max_steps=2000)
            if cls is Scheduler:
                case = (block_size, window, num_blocks, budget, specs)
                assert scheduler.num_preemptions == 0, case
                # Turned away at `add` (with its numbers) or served in full; never failed once admitted.
                assert all(r.error is None or " needs " in r.error for r in requests), case
                assert all(len(r.output_ids) == r.params.max_new_tokens for r in requests if r.error is None), case
            else:
                as_before += scheduler.num_preemptions
    assert as_before > 0


class _WholePromptDemand(Scheduler):
    """The prefill count as it was: a sliding group counted at every block of the prompt while it is computed."""

    def _demand(self, num_tokens, *, prefilling, windows=None, start=0):
        if prefilling:
            return self._blocks_for(num_tokens) * len(self.group_windows if windows is None else windows)
        return super()._demand(num_tokens, prefilling=False, windows=windows, start=start)


@pytest.mark.parametrize("mixed", [True, False], ids=["sliding+full", "sliding"])
def test_long_prompts_in_small_chunks_count_a_window_plus_a_chunk(mixed):
    """Prompts much longer than a window plus a prefill chunk: while a prompt is computed in chunks of at most
    `max_num_batched_tokens`, a sliding group holds the blocks the chunk's keys span (window - 1 + chunk positions),
    not the whole prompt. Counted that way, no admitted request is preempted in 300 random bursts, every block
    comes back, and the runs take fewer steps than with the whole prompt counted. Both serve the same requests:
    `add` checks what a request needs alone (`_solo_need`), not this count."""
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
            scheduler = cls(pool, max_num_seqs=budget, max_num_batched_tokens=budget,
                            sliding_windows=[window, None][: len(layer_types)])
            requests = [_request(i, n, k) for i, (n, k) in enumerate(specs)]
            runs[cls] = (_drive(scheduler, requests, max_steps=5000), sum(r.error is None for r in requests))
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
        scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=rng.choice([8, 16, 64]),
                              sliding_windows=[window, None][: len(layer_types)])
        requests = [Request(i, prompt, SamplingParams(max_new_tokens=n)) for i, (prompt, n) in enumerate(specs)]
        _drive(scheduler, requests, max_steps=2000)
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
    _step(scheduler)  # computes the prompt, caches its 8 blocks in both groups
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
    assert scheduler._cached_prefix(third).waits_for == second.block_hashes[8]
    _drive(scheduler, [])
    assert [len(r.output_ids) for r in (first, second, third)] == [4, 4, 4] and scheduler.num_preemptions == 0
    pool.allocator.check_invariants()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_one_lookahead_answers_every_newcomer_as_a_fresh_one(prefix_caching):
    """Admission tries every waiting request in its window against one plan of the running requests (`Lookahead`);
    what that plan memoizes while it answers for one newcomer must not change its answer for the next, in any
    order. Random pools, running sets caught mid-prefill or mid-decode, prompts that share a prefix."""
    rng = random.Random(1)
    num_checked = num_mixed = 0
    for _ in range(300):
        shared = [rng.randrange(1, 99) for _ in range(12)]
        pool = BlockPool(KVLayout((2,), (4,)), num_blocks=rng.randint(6, 24), block_size=rng.choice([1, 2, 4]),
                         enable_prefix_caching=prefix_caching)
        scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=rng.choice([8, 16, 64]))
        for index in range(16):
            prompt = shared[: rng.randint(2, 12)] + [rng.randrange(100, 999) for _ in range(rng.randint(0, 6))]
            scheduler.add(Request(index, prompt, SamplingParams(max_new_tokens=rng.randint(1, 8))))
        for _ in range(rng.randint(1, 4)):
            _step(scheduler)
        waiting = list(scheduler.waiting)
        if not scheduler.running or not waiting or len(scheduler.running) == scheduler.max_num_seqs:
            continue  # admission tries no newcomer then
        fresh = [scheduler.fits(request) for request in waiting]
        for order in (waiting, waiting[::-1]):
            lookahead = Lookahead(scheduler)
            answers = {request.request_id: lookahead.fits(request) for request in order}
            assert [answers[request.request_id] for request in waiting] == fresh
        num_checked += 1
        num_mixed += len(set(fresh)) > 1
    assert num_checked > 50 and num_mixed > 10, (num_checked, num_mixed)
