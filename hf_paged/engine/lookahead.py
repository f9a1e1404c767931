"""Lookahead: how each running request grows (`GrowthModel`), and the forecast of all of them (`Lookahead`), worked out
once and shared by every newcomer tried against it.

Admission asks, for up to `backfill_depth` waiting requests a step, whether each fits next to the running requests
at every step ahead (`Admission.fits`). The running requests' side of that question (how each grows, when it
finishes, which blocks they hold together) does not depend on the newcomer, so `Lookahead` works it out once per
admission round and each try adds only the newcomer's share: while the queue is blocked, admission tries several
waiting requests every step, and each would otherwise rebuild the same forecast.

A running request grows by one token a step until its `max_new_tokens` (or for `decode_reserve_tokens` steps, when
set), and holds its blocks until it ends. A request whose prompt is not computed yet starts growing only once its
prefill has had budget: the prompts before it take the step's prefill tokens first, and with prefix caching it may
also wait for prompt blocks another request is computing. It may start (and end) up to `delay` steps late, so its
forecast (`Growth`) counts it from step 0 as if it started at once, then at its full size until the latest step it can
end; at every step, that is at least what it holds:

    step t:     0     1     2    ...   steps    steps + 1   ...   end = steps + delay
    tokens:     n    n+1   n+2   ...  n+steps    n+steps    ...   n+steps

Until step `end - steps` it may still be prefilling, so a sliding group counts a prefill chunk's keys until then.

With prefix caching the lookahead is handed the prefix cache's lookup (`peek`: `PrefixReuse.peek`), not the cache:
admission owns the prefix cache and decides what a request takes from it.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from ..storage import first_window_block
from .blocks import BlockCounts
from .request import PrefixHit, Request

# What a prefix lookup would give a request now (`PrefixReuse.peek`).
Peek = Callable[[Request], PrefixHit]


class Growth(NamedTuple):
    """How a request's K/V grow in the lookahead: from `tokens` by one a step for `steps` steps, held until step
    `end` (`end - steps`: the steps its prefill may still wait for budget); its computation goes on from position
    `start` (a sliding group holds nothing before that position's window)."""

    tokens: int
    steps: int
    end: int
    prefilling: bool
    start: int = 0


class GrowthModel:
    """Each request's forecast (`growth`) and block count (`demand`) in admission's lookahead, and the waits of prefills
    for prompt blocks other requests are computing (`add_prefix_waits`). `Lookahead` sums these over the running
    requests and a newcomer; a `Scheduler` subclass can count differently through `Scheduler.growth_model_class`."""

    def __init__(self, counts: BlockCounts, *, max_num_batched_tokens: int, decode_reserve_tokens: int | None = None):
        self.counts = counts
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_reserve_tokens = decode_reserve_tokens

    def growth(self, request: Request, delay: int, prefilling: bool, start: int | None = None) -> Growth:
        """`request`'s forecast in the lookahead when its prefill may wait `delay` steps for budget; `start`: the
        position its computation goes on from (default: its computed tokens)."""
        # What it holds once its input is computed (a token in flight counted: `Request.num_inflight`).
        num_tokens = len(request.prompt_ids) + len(request.output_ids) + request.num_inflight
        final = request.max_kv_tokens
        steps = max(final - num_tokens, 0)  # decode steps until its K/V stop growing
        if self.decode_reserve_tokens is not None:
            steps = min(steps, self.decode_reserve_tokens)
        return Growth(num_tokens, steps, steps + delay, prefilling, request.num_computed if start is None else start)

    def add_prefix_waits(
        self, requests: list[Request], prefilling: list[bool], delays: list[int], per_step: int, peek: Peek
    ) -> dict[bytes, int]:
        """Raise `delays[i]` of a request whose prefill will wait for prompt blocks another request is computing
        (`PrefixReuse.waits`): it starts the step after the forward that computes them, then needs its own prefill
        steps. Requests that started prefilling go first (whatever their order: one admitted later may have started
        while an earlier one waited), then the others in order, each recording the blocks it will compute.
        Returns what they compute: the hash of each prompt block not cached yet -> the step that computes it (a
        newcomer after them waits the same way, `Lookahead.newcomer_growth`)."""
        computing: dict[bytes, int] = {}  # hash of a prompt block not cached yet -> the step that computes it

        def record(index: int) -> None:
            request = requests[index]
            num_full = len(request.token_ids) // self.counts.block_size
            request.extend_hashes(num_full, self.counts.block_size)
            for block_hash in request.block_hashes[request.num_registered_blocks : num_full]:
                computing[block_hash] = max(computing.get(block_hash, delays[index]), delays[index])

        for index, request in enumerate(requests):
            if prefilling[index] and request.block_tables:
                record(index)
        for index, request in enumerate(requests):
            if not prefilling[index] or request.block_tables:
                continue
            waits_for = peek(request).waits_for
            delays[index] = self.prefix_wait(request, waits_for, computing, per_step, delays[index])
            record(index)
        return computing

    @staticmethod
    def prefix_wait(
        request: Request, waits_for: bytes | None, computing: dict[bytes, int], per_step: int, delay: int
    ) -> int:
        """`delay` raised for a request whose first uncached prompt block (`waits_for`) another request is computing
        (`computing`: hash -> the step that computes it): it starts the step after, then needs its own prefill
        steps."""
        if waits_for not in computing:
            return delay
        return max(delay, computing[waits_for] + -(-request.num_pending // per_step))

    def demand(
        self, num_tokens: int, *, prefilling: bool, windows: list[int | None] | None = None, start: int = 0
    ) -> int:
        """At most the blocks a request of `num_tokens` tokens holds over all groups in a step: everything in a full
        group; in a sliding group, the blocks the keys its step's queries see span. A decode row's one query sees
        `w` positions (its window); a prefill chunk's `q <= max_num_batched_tokens` queries see `w - 1 + q`,
        which a chunk keeps until the next step's release. `start`: the position the request's computation goes
        on from (its computed tokens, a prefix hit's): a sliding group holds nothing before the block the window
        of a query there starts in, so a prompt that continues a cached prefix counts from there.

        Non-decreasing in `num_tokens` (the lookahead's check points rely on it): a run of `n` positions spans
        `ceil((n - 1) / block_size) + 1` blocks when it starts inside a block, one fewer when it starts at one, and
        that maximum is what is counted. Out-of-window blocks go back at the start of each step, before admission
        (`Scheduler.schedule`), so the count holds for every request in the step. `windows`: the groups to count
        (default: every group of the pool).
        """
        counts = self.counts
        end_block = counts.blocks_for(num_tokens)
        queries = self.max_num_batched_tokens if prefilling else 1
        return sum(
            end_block
            if window is None
            else min(
                end_block - first_window_block(start, window, counts.block_size),
                counts.blocks_for(window + queries - 2) + 1,
            )
            for window in (counts.group_windows if windows is None else windows)
        )


class SlidingShare(NamedTuple):
    """One sliding layer group's blocks that several running requests hold (a shared prompt still in their windows),
    each counted once, and what each request holds there alone."""

    group: int
    window: int
    last_end: dict[int, int]  # block held by two or more running requests -> the last of their ends
    sorted_ends: list[int]  # last_end's values, sorted
    alone: list[int]  # per running request: the blocks of its table no other running request holds
    reach: list[int]  # per running request: the block its table ends before (first block + table length)


class Lookahead:
    """The forecast of the `running` requests with one newcomer after them (see `Admission.fits` for what it counts):
    `num_free_blocks` of the pool are free, and `growth_model` says how each request grows and what it holds.

    Valid while the running requests, their blocks and the pool stay as they are: admission makes a new one after
    each request it admits, and every step.
    """

    def __init__(
        self,
        running: list[Request],
        num_free_blocks: int,
        growth_model: GrowthModel,
        peek: Peek | None = None,
        failed_at: int | None = None,
    ):
        # The step the last newcomer that did not fit failed at (`failed_at`: a hint from the forecast before): the
        # next try checks it first, as a newcomer that does not fit most often fails where the one before it did.
        # The order of the checks decides how soon a try that fails stops, never its answer.
        self.failed_at = failed_at
        self.growth_model = growth_model
        self.counts = growth_model.counts
        self.peek = peek
        # NOTE: decode rows run every step, but prefill chunks share what is left of `max_num_batched_tokens` in
        # scheduling order, so a prompt waits for the prompts before it: admitting many requests at once (a burst)
        # starts the last of them several steps late, and they end as late. Without counting that delay, a burst
        # admitted on a forecast that fits runs out of blocks at its end and preempts.
        # Prefill tokens a step surely has once the newcomer runs: the budget less a decode row for every other
        # request (one that is prefilling has none); at least 1, as max_num_batched_tokens >= max_num_seqs.
        max_num_batched_tokens = growth_model.max_num_batched_tokens
        self.per_step = max_num_batched_tokens - len(running)
        assert self.per_step >= 1, (max_num_batched_tokens, len(running))
        prefilling = [request.num_pending > 1 or not request.block_tables for request in running]
        delays, self.queued = [], 0  # queued: prompt tokens still to compute, this request's and those before it
        for request, waits in zip(running, prefilling):
            self.queued += request.num_pending if waits else 0
            delays.append(self._prefill_delay(self.queued) if waits else 0)
        self.prefix_caching = peek is not None
        self.computing: dict[bytes, int] = {}
        if self.prefix_caching:
            self.computing = growth_model.add_prefix_waits(running, prefilling, delays, self.per_step, peek)
        self.growths = [
            growth_model.growth(request, delay, waits) for request, delay, waits in zip(running, delays, prefilling)
        ]
        held = set().union(*(table for request in running for table in request.block_tables))
        self.available = num_free_blocks + len(held)
        windows = self.counts.group_windows
        self.full_groups = [group for group, window in enumerate(windows) if window is None]
        self.sliding_windows = [window for window in windows if window is not None]
        # Shared blocks count once in the full groups (the sliding groups: `sliding_shares` below).
        self.full_shared = self.prefix_caching and bool(self.full_groups)
        self._demand_memo: dict[int, int] = {}  # step -> `_running_demand(step)`
        self._shared_memo: dict[int, tuple[int, int]] = {}  # step -> `_running_shared(step)`
        self.check_points = {0, *(growth.end for growth in self.growths)}
        if self.full_shared:
            # Per running request, its table in each full group (none before it holds blocks: `_full_tables`).
            self.tables = [self._full_tables(request) for request in running]
            # A held block counts at step t while a request holding it still runs: until the last of their ends.
            self.last_end = self._last_ends(self.tables)
            self._sorted_ends = sorted(self.last_end.values())
            # Per running request, what `_running_shared` reads: (tokens, steps, end, its full tables' lengths), the
            # latest end first.
            self._fresh_rows = sorted(
                (
                    (growth.tokens, growth.steps, growth.end, [len(table) for table in tables])
                    for growth, tables in zip(self.growths, self.tables)
                ),
                key=lambda row: -row[2],
            )
        if self.sliding_windows:  # a sliding group counts less once a prefill ends
            self.check_points.update(growth.end - growth.steps for growth in self.growths if growth.prefilling)
        # With prefix caching, a block several requests hold in a sliding group also counts once (`_sliding_demand`).
        self.sliding_shares = (
            [self._sliding_share(running, group, window) for group, window in enumerate(windows) if window is not None]
            if self.prefix_caching
            else []
        )
        self._sliding_memo: dict[int, list[tuple[int, int]]] = {}  # step -> `_running_sliding(step)`

    def _last_ends(self, tables: list[list[list[int]]]) -> dict[int, int]:
        """Block id -> the last end (`Growth.end`) of the running requests holding it; `tables[i]`: the tables of
        running request i to count."""
        last_end: dict[int, int] = {}
        # In the order of their ends, so that a later end replaces an earlier one.
        for index in sorted(range(len(tables)), key=lambda index: self.growths[index].end):
            for table in tables[index]:
                last_end.update(dict.fromkeys(table, self.growths[index].end))
        return last_end

    def _sliding_share(self, running: list[Request], group: int, window: int) -> SlidingShare:
        """Sliding group `group`'s blocks held by two or more `running` requests, and each request's own share."""
        tables = [request.block_tables[group] if request.block_tables else [] for request in running]
        holders = Counter(itertools.chain.from_iterable(tables))
        last_end = self._last_ends([[table] for table in tables])
        shared = {block_id: last_end[block_id] for block_id, count in holders.items() if count > 1}
        alone, reach = [], []
        for request, table in zip(running, tables):
            # A table holds a block once.
            alone.append(len(table) - len(shared.keys() & table) if shared else len(table))
            reach.append(request.first_blocks[group] + len(table) if request.block_tables else 0)
        return SlidingShare(group, window, shared, sorted(shared.values()), alone, reach)

    def _full_tables(self, request: Request, hit: PrefixHit | None = None) -> list[list[int]]:
        """What `request` counts as held in each full group: its tables once it holds blocks; for the newcomer, the
        prefix admission takes for it at once (`hit`, see `PrefixReuse.takes_at_admission`). Any other request that has
        not looked up counts every block as fresh: a lookup later could find less."""
        if request.block_tables:
            return [request.block_tables[group] for group in self.full_groups]
        if hit is None:
            return [[] for _ in self.full_groups]
        return [hit.tables[group] for group in self.full_groups]

    def newcomer_growth(self, newcomer: Request, waits_for: bytes | None = None, start: int = 0) -> Growth:
        """The newcomer's forecast, scheduled after the running requests: its prefill waits for theirs (and, with prefix
        caching, for `waits_for`, its first uncached prompt block, when one of them is computing it). `start`: the
        position it computes from (the prefix admission takes for it, `PrefixReuse.takes_at_admission`)."""
        delay = self._prefill_delay(self.queued + newcomer.num_pending)
        delay = self.growth_model.prefix_wait(newcomer, waits_for, self.computing, self.per_step, delay)
        return self.growth_model.growth(newcomer, delay, True, start)

    def _prefill_delay(self, queued: int) -> int:
        """Steps a prompt waits for budget before its last token is computed, when `queued` prompt tokens (its own
        and those scheduled before it) share `per_step` prefill tokens a step."""
        return -(-queued // self.per_step) - 1

    def fits(self, newcomer: Request) -> bool:
        """Whether the pool holds `newcomer` next to the running requests at every step of the lookahead."""
        # NOTE: one prefix lookup per try, for both its wait and (shared blocks) what it would take from the cache.
        hit = self.peek(newcomer) if self.prefix_caching else None
        taken = hit is not None and hit.taken_at_admission(self.computing)  # a waiting request holds no block
        start = hit.num_blocks * self.counts.block_size if taken else 0
        new = self.newcomer_growth(newcomer, hit.waits_for if hit else None, start)
        taken_hit = hit if taken else None
        if self.full_shared:
            return self._fits_shared(self._full_tables(newcomer, taken_hit), new, taken_hit)
        for t in self._in_order({*self.check_points, new.end, new.end - new.steps}):
            if self.sliding_shares:  # every group slides (a full group takes `_fits_shared`)
                demand = self._sliding_demand(new, taken_hit, t)
            else:
                demand = self._running_demand(t)
                if new.end >= t:
                    demand += self._demand_at(new, t)
            if demand > self.available:
                self.failed_at = t
                return False
        return True

    def _in_order(self, checks: set[int]) -> list[int]:
        """The check points `checks`, the one the last try failed at first."""
        if self.failed_at in checks:
            return [self.failed_at, *(t for t in checks if t != self.failed_at)]
        return list(checks)

    def _demand_at(self, growth: Growth, t: int, windows: list[int | None] | None = None) -> int:
        """What `growth` holds at step t (`GrowthModel.demand`), in the groups of `windows` (default: all)."""
        still_prefilling = growth.prefilling and t <= growth.end - growth.steps
        return self.growth_model.demand(
            growth.tokens + min(t, growth.steps), prefilling=still_prefilling, windows=windows, start=growth.start
        )

    def _running_demand(self, t: int) -> int:
        demand = self._demand_memo.get(t)
        if demand is None:
            demand = self._demand_memo[t] = sum(
                self._demand_at(growth, t) for growth in self.growths if growth.end >= t
            )
        return demand

    def _fits_shared(self, tables: list[list[int]], new: Growth, hit: PrefixHit | None = None) -> bool:
        """`fits` counting each block held in a full group once: at step t, the blocks held now by a request still
        running then (their union), plus the blocks each of those will have added by t; the sliding groups are
        counted by `_sliding_demand`. `tables`: per full group, the cached blocks admission takes for the newcomer;
        `hit`: the prefix the newcomer takes at admission (None: none)."""
        checks = {*self.check_points, new.end}
        if self.sliding_windows:
            checks.add(new.end - new.steps)
        for t in self._in_order(checks):
            held, fresh = self._running_shared(t)
            if new.end >= t:
                held += sum(  # not held by them then
                    1 for table in tables for block_id in table if self.last_end.get(block_id, -1) < t
                )
                fresh += self._fresh(new, tables, t)
            if self.sliding_shares:
                fresh += self._sliding_demand(new, hit, t)
            if held + fresh > self.available:
                self.failed_at = t
                return False
        return True

    def _fresh(self, growth: Growth, tables: list[list[int]], t: int) -> int:
        """Blocks `growth` adds by step t to its full groups' `tables` (each starts at block 0)."""
        return sum(self._added(growth, len(table), t) for table in tables)

    def _sliding_demand(self, new: Growth, hit: PrefixHit | None, t: int) -> int:
        """Blocks the sliding groups hold at step t, the newcomer `new` included (`hit`: the prefix it takes at
        admission, None: none), the smaller of two upper bounds per group:
        - each request at the blocks its window can span (`GrowthModel.demand`), as if it shared none;
        - each block two or more running requests hold now, once, while one of them still runs, plus each request's
          other blocks: those it holds alone now (the newcomer: the blocks of its hit that are not such a block
          still counted at t; one a single running request holds is counted by both) and those it adds by t, at
          most what its window can span.
        Both only grow between the check points (a shared block's count drops only after a holder's end), so
        checking there is enough, as in `fits`."""
        total = 0
        for share, (each, shared) in zip(self.sliding_shares, self._running_sliding(t)):
            if new.end >= t:
                bound = self._demand_at(new, t, [share.window])
                each += bound
                table = hit.tables[share.group] if hit is not None else []
                kept = sum(1 for block_id in table if share.last_end.get(block_id, -1) >= t)
                reach = hit.num_blocks if hit is not None else 0  # its table: blocks first_blocks[g] .. num_blocks - 1
                shared += min(bound, len(table) - kept + self._added(new, reach, t))
            total += min(each, shared)
        return total

    def _added(self, growth: Growth, reach: int, t: int) -> int:
        """Blocks `growth` adds by step t after block `reach`."""
        return max(self.counts.blocks_for(growth.tokens + min(t, growth.steps)) - reach, 0)

    def _running_sliding(self, t: int) -> list[tuple[int, int]]:
        """Per sliding group, the running requests' two bounds at step t (`_sliding_demand`)."""
        memo = self._sliding_memo.get(t)
        if memo is None:
            memo = self._sliding_memo[t] = []
            for share in self.sliding_shares:
                each, shared = 0, len(share.sorted_ends) - bisect.bisect_left(share.sorted_ends, t)
                for growth, alone, reach in zip(self.growths, share.alone, share.reach):
                    if growth.end >= t:
                        bound = self._demand_at(growth, t, [share.window])
                        each += bound
                        shared += min(bound, alone + self._added(growth, reach, t))
                memo.append((each, shared))
        return memo

    def _running_shared(self, t: int) -> tuple[int, int]:
        """(blocks the running requests still running at step t hold now, counted once; blocks they will have
        added by t)."""
        memo = self._shared_memo.get(t)
        if memo is None:
            held = len(self._sorted_ends) - bisect.bisect_left(self._sorted_ends, t)
            # NOTE: `_fresh` of every request still running at t, inlined: this runs for every check point of every
            # forecast, over every running request, and is most of admission's time with many of them.
            fresh, block_size = 0, self.counts.block_size
            for tokens, steps, end, lengths in self._fresh_rows:
                if end < t:  # and every request after it
                    break
                num_blocks = -(-(tokens + (t if t < steps else steps)) // block_size)
                for length in lengths:
                    if num_blocks > length:
                        fresh += num_blocks - length
            memo = self._shared_memo[t] = (held, fresh)
        return memo
