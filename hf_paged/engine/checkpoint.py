"""Undo a step whose forward raised: the requests it would have advanced are back where they were, and the blocks
it gave them are back in the pool.

What `Scheduler.schedule` changes, and what `StepCheckpoint.restore` does about it:

    admission            waiting -> running, a prefix taken     back to waiting, in queue order; prefix blocks freed
    prefill / decode     blocks allocated at a table's end      freed; each table is as long as before the step
    backfill             skips counted for requests passed      counts as before
    sliding window       blocks that left the window freed      stand: they left for good (`num_computed` is unchanged,
                                                                so the next step would free the same blocks)
    preemption           a running request's blocks freed       stands: the request waits at the front to be
                                                                recomputed (its freed blocks may hold this step's
                                                                K/V by now), as the next step could decide again
    never fits           a request retired with its error       stands: it could not run however often it is tried

The forward writes K/V only at positions from each row's `num_computed` on: in blocks this step allocated (freed
here) or in the unfilled end of a row's last block (rewritten when the row runs again). Blocks in the prefix cache
are full of computed tokens, so they are never written.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import NamedTuple

from .request import Request
from .scheduler import Scheduler


class _Saved(NamedTuple):
    first_blocks: tuple[int, ...]
    table_lengths: tuple[int, ...]
    num_computed: int
    num_registered_blocks: int
    num_cached_tokens: int
    num_skips: int


class StepCheckpoint:
    """The scheduler's state before a step, as far as the step can change it (taken before `schedule()`). Costs
    O(running + waiting) pointer copies, O(running + a few waiting) tuples."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.waiting = list(scheduler.waiting)
        self.running = list(scheduler.running)
        # Admission takes and passes requests only within the first `backfill_window` of the queue, one admission at
        # a time, so at most `max_num_seqs` further along than that.
        head = itertools.islice(scheduler.waiting, scheduler.backfill_window + scheduler.max_num_seqs)
        self.saved = {request: _save(request) for request in itertools.chain(self.running, head)}
        self.num_hit_tokens = scheduler.prefix.num_hit_tokens

    def restore(self) -> None:
        scheduler = self.scheduler
        allocator = scheduler.pool.allocator
        running_now = set(scheduler.running)
        for request in scheduler.running:
            saved = self.saved[request]
            if not saved.table_lengths:  # it held nothing: what it holds now came with this step
                allocator.free(request.block_ids)
                request.block_tables, request.first_blocks = [], []
            else:
                for group, table in enumerate(request.block_tables):
                    released = request.first_blocks[group] - saved.first_blocks[group]
                    kept = saved.table_lengths[group] - released
                    allocator.free(table[kept:])
                    del table[kept:]
            _put_back(request, saved)
        was_running = set(self.running)
        preempted = [request for request in scheduler.waiting if request in was_running]
        for request in self.waiting:
            if request in self.saved:
                _put_back(request, self.saved[request])
        scheduler.running = [request for request in self.running if request in running_now]
        scheduler.waiting = deque(preempted + [request for request in self.waiting if not request.finished])
        scheduler.prefix.num_hit_tokens = self.num_hit_tokens


def _save(request: Request) -> _Saved:
    return _Saved(
        tuple(request.first_blocks),
        tuple(map(len, request.block_tables)),
        request.num_computed,
        request.num_registered_blocks,
        request.num_cached_tokens,
        request.num_skips,
    )


def _put_back(request: Request, saved: _Saved) -> None:
    request.num_computed = saved.num_computed
    request.num_registered_blocks = saved.num_registered_blocks
    request.num_cached_tokens = saved.num_cached_tokens
    request.num_skips = saved.num_skips
