"""Admission: which waiting requests may start, looking ahead at how every running request will grow.

`Admission.fits` checks a newcomer against a forecast of the running requests (`Lookahead`, counting each request
as `GrowthModel` says); `Admission.admit` moves waiting requests to the running ones in arrival order, with
backfill: when the first does not fit, a later one of the next few that does goes first.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from ..storage import BlockPool
from .lookahead import GrowthModel, Lookahead
from .prefix_cache import PrefixReuse
from .request import Request


class Admission:
    """The scheduler's admission: `fits` and `admit` on the queues the scheduler passes in (`waiting`, in queue
    order; `running`, in admission order), with at most `max_num_seqs` running and backfill over the first
    `backfill_depth` waiting requests."""

    # NOTE: a request passed over this many times stops backfill behind it until it is admitted, so arrivals that
    # keep coming cannot starve a large request: it waits for at most this many later ones (a preempted request
    # that goes back to the front of the queue is not counted, and its own count starts again).
    MAX_SKIPS = 16

    def __init__(
        self,
        pool: BlockPool,
        prefix: PrefixReuse,
        growth_model: GrowthModel,
        *,
        max_num_seqs: int,
        backfill_depth: int,
    ):
        self.pool = pool
        self.prefix = prefix
        self.growth_model = growth_model
        self.max_num_seqs = max_num_seqs
        self.backfill_depth = backfill_depth
        self._failed_at: int | None = None  # the step (from the last admission's) where its last try failed

    def lookahead(self, running: list[Request], failed_at: int | None = None) -> Lookahead:
        """The forecast of `running` as the pool stands now, to try newcomers against (`Lookahead.fits`); `failed_at`:
        where a try is likely to fail, checked first (`Lookahead.failed_at`)."""
        peek = self.prefix.peek if self.prefix.enabled else None
        return Lookahead(running, self.pool.num_free_blocks, self.growth_model, peek, failed_at)

    def fits(self, newcomer: Request, running: list[Request]) -> bool:
        """Whether the pool can hold `newcomer` next to the `running` requests at every step of the lookahead.

        Every running request grows by one token a step until its `max_new_tokens` (or for `decode_reserve_tokens`
        steps) and gives its blocks back when it ends; a prompt not computed yet starts growing once its prefill has
        had budget; blocks several requests hold count once. Every count is an upper bound on what a request will
        hold, so with the default lookahead an admitted request is never preempted (`Lookahead`; docs/engine.md,
        "Admission looks ahead", has the whole argument)."""
        return self.lookahead(running).fits(newcomer)

    def admit(self, waiting: deque[Request], running: list[Request]) -> None:
        """Move waiting requests to running while they fit (`fits`), in arrival order with backfill: when the first
        waiting request does not fit, the first of the next `backfill_depth - 1` that does is admitted instead, and
        every request it passes counts a skip. A request skipped `MAX_SKIPS` times blocks backfill behind it.

        Why: a burst's head may need blocks that only a finishing request gives back, while a smaller request
        behind it fits now; without backfill the pool idles at that size gap.
        """
        # NOTE: admission looks ahead instead of keeping a fixed reserve: with a reserve of a block per running
        # request, admission and preemption chase each other (a preempted request is re-admitted as soon as blocks
        # free, re-prefilled, and preempted again), and a larger fixed reserve still preempts and holds concurrency
        # below what the pool allows.
        # Where the last try of the step before failed, a step later now: the first check of this step's tries.
        failed_at = None if self._failed_at is None else self._failed_at - 1
        while waiting and len(running) < self.max_num_seqs:
            # One forecast of the running requests for every waiting request tried against them (a new one after each
            # admission): nothing else changes between tries.
            lookahead = self.lookahead(running, failed_at) if running else None
            chosen = 0 if lookahead is None else self._first_fitting(waiting, lookahead)
            if lookahead is not None:
                failed_at = self._failed_at = lookahead.failed_at
            if chosen is None:
                return
            for passed in itertools.islice(waiting, chosen):
                passed.num_skips += 1
            request = waiting[chosen]
            del waiting[chosen]
            running.append(request)
            if request.scheduled_time is None:
                request.scheduled_time = time.perf_counter()
            if self.prefix.takes_at_admission(request, lookahead.computing if lookahead is not None else {}):
                self.prefix.take(request)

    def _first_fitting(self, waiting: deque[Request], lookahead: Lookahead) -> int | None:
        """Position in `waiting` of the first request that fits `lookahead`, within the backfill window and not
        behind a request that was skipped `MAX_SKIPS` times; None when none does."""
        for position, request in enumerate(itertools.islice(waiting, self.backfill_depth)):
            if lookahead.fits(request):
                return position
            if request.num_skips >= self.MAX_SKIPS:
                return None
        return None
