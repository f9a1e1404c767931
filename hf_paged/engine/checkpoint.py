"""Undo a step whose forward raised: the requests it would have advanced are back where they were, and the blocks
it gave them are back in the pool.

What `Scheduler.schedule` changes, and what `Scheduler.restore` does about it:

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


class _Saved(NamedTuple):
    first_blocks: tuple[int, ...]
    table_lengths: tuple[int, ...]
    num_computed: int
    num_registered_blocks: int
    num_cached_tokens: int
    num_skips: int


class StepCheckpoint:
    """The scheduler's queues and requests before a step, as far as the step can change them (`Scheduler.checkpoint`,
    taken before `schedule()`; `Scheduler.restore` puts them back). Costs O(running + waiting) pointer copies,
    O(running + a few waiting) tuples.

    `num_head`: the waiting requests a step can touch: admission takes and passes requests only within the first
    `backfill_depth` of the queue, one admission at a time, so at most `max_num_seqs` further along than that."""

    def __init__(
        self,
        waiting: deque[Request],
        running: list[Request],
        num_head: int,
        num_hit_tokens: int,
        steps_waited: int = 0,
    ):
        self.waiting = list(waiting)
        self.running = list(running)
        head = itertools.islice(waiting, num_head)
        self.saved = {request: _save(request) for request in itertools.chain(self.running, head)}
        self.num_hit_tokens = num_hit_tokens
        self.steps_waited = steps_waited  # the scheduler's count for `max_waiting_steps`

    def tables(self, request: Request) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(first_blocks, table lengths) of running `request` before the step."""
        saved = self.saved[request]
        return saved.first_blocks, saved.table_lengths

    def queues(self, running: list[Request], waiting: deque[Request]) -> tuple[list[Request], deque[Request]]:
        """The queues as they were, from the queues `running` and `waiting` now, with every request's counters put
        back (their tables are the block manager's to roll back): a request the step preempted waits at the front,
        one it finished stays out."""
        for request in running:
            _put_back(request, self.saved[request])
        was_running = set(self.running)
        preempted = [request for request in waiting if request in was_running]
        for request in self.waiting:
            if request in self.saved:
                _put_back(request, self.saved[request])
        running_now = set(running)
        restored_running = [request for request in self.running if request in running_now]
        restored_waiting = deque(preempted + [request for request in self.waiting if not request.finished])
        return restored_running, restored_waiting


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
