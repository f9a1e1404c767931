"""Admission: which waiting requests may start, looking ahead at how every running request will grow.

`Scheduler` mixes this in; it uses the scheduler's pool, queues and limits (`pool`, `running`, `waiting`,
`max_num_seqs`, `max_num_batched_tokens`, `decode_reserve_tokens`, `backfill_window`, `group_windows`) and its
block helpers. Split from scheduler.py only to keep one concept per file: what `fits` counts and the queue
discipline (`admit`, backfill) live here, the running requests' plan that `fits` checks a newcomer against in
lookahead.py; running a step (growth, preemption, prefix reuse) lives in scheduler.py.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ..storage import first_window_block
from .lookahead import Growth, Lookahead

if TYPE_CHECKING:
    from .request import Request


class Admission:
    """The admission half of `Scheduler` (a mixin: see the module docstring for what it reads)."""

    # NOTE: a request passed over this many times stops backfill behind it until it is admitted, so arrivals that
    # keep coming cannot starve a large request: it waits for at most this many later ones (a preempted request
    # that goes back to the front of the queue is not counted, and its own count starts again).
    MAX_SKIPS = 16

    def _growth(self, request: Request) -> tuple[int, int]:
        """(tokens `request` holds once its input is computed, decode steps until its K/V stop growing)."""
        num_tokens = len(request.prompt_ids) + len(request.output_ids)
        # NOTE: the last sampled token is never fed back, so K/V peak at prompt + max_new_tokens - 1 tokens.
        final = len(request.prompt_ids) + request.params.max_new_tokens - 1
        steps = max(final - num_tokens, 0)
        if self.decode_reserve_tokens is not None:
            steps = min(steps, self.decode_reserve_tokens)
        return num_tokens, steps

    def fits(self, newcomer: Request) -> bool:
        """Whether the pool can hold `newcomer` next to the running requests at every step of the lookahead.

        Every running request grows by one token per step until its `max_new_tokens` (or for
        `decode_reserve_tokens` steps, when set) and its blocks come back when it finishes, so the demand at step
        t is the sum of blocks(tokens + t) over the requests still running at t; its peak is at t = 0, at the last
        step a prefill may take (a sliding group counts less after it), or just before one of them finishes.

        With prefix caching, blocks that several running requests hold in a full-attention group (a shared system
        prompt, parallel samples of one prompt) count once: the demand at t is every such block held now by a request
        still running at t, plus the blocks each of those will add by t. A sliding group counts, per request, the blocks
        its window can span (`_demand`), or, when smaller, each block two or more running requests hold there once plus
        what each holds alone and will add (`Lookahead._sliding_demand`). A newcomer with a cached prefix takes it when
        admitted (`_takes_prefix_at_admission`) and counts it as held: looked up later, the hit could be shorter than
        what admission counted (an evicted free block can cut it below blocks the others hold). One that waits for a
        block another request is computing, or was admitted without a hit, counts its whole prompt as fresh
        (`Lookahead._full_tables`). A request that goes on from a computed or cached prefix counts its sliding groups
        from that position's window (`_demand`'s `start`), not from its first token.

        A request whose prompt is not computed yet starts growing only once its prefill has had budget: the
        requests before it take the step's prefill tokens first, so it may start (and finish) up to `end - steps`
        steps late (`Lookahead`). It is counted at its full size for those extra steps, an upper bound on what it
        holds then.

        NOTE: with the default lookahead (to every request's `max_new_tokens`) an admitted request is never
        preempted: every count is an upper bound on what the request holds then, and requests can only finish
        earlier than planned (eos, stop tokens), which frees blocks sooner (tests/test_backfill.py and
        tests/test_sliding_admission.py drive random bursts, shared prompts and sliding + full pools through it).
        A finite `decode_reserve_tokens` admits more when requests usually stop early, and relies on preemption
        when they do not.
        """
        return Lookahead(self).fits(newcomer)

    def _growth_plan(self, request: Request, delay: int, prefilling: bool, start: int | None = None) -> Growth:
        """`request`'s plan in the lookahead when its prefill may wait `delay` steps for budget (see `Lookahead`);
        `start`: the position its computation goes on from (default: its computed tokens)."""
        tokens, steps = self._growth(request)
        return Growth(tokens, steps, steps + delay, prefilling, request.num_computed if start is None else start)

    def _add_prefix_waits(
        self, requests: list[Request], prefilling: list[bool], delays: list[int], per_step: int
    ) -> dict[bytes, int]:
        """Raise `delays[i]` of a request whose prefill will wait for prompt blocks another request is computing
        (`_waits_for_prefix`): it starts the step after the forward that computes them, then needs its own prefill
        steps. Requests that started prefilling go first (whatever their order: one admitted later may have started
        while an earlier one waited), then the others in order, each recording the blocks it will compute.
        Returns what they compute: the hash of each prompt block not cached yet -> the step that computes it (a
        newcomer after them waits the same way, `Lookahead.newcomer_growth`)."""
        computing: dict[bytes, int] = {}  # hash of a prompt block not cached yet -> the step that computes it

        def record(index: int) -> None:
            request = requests[index]
            num_full = len(request.token_ids) // self.pool.block_size
            self._extend_hashes(request, num_full)
            for block_hash in request.block_hashes[request.num_registered_blocks : num_full]:
                computing[block_hash] = max(computing.get(block_hash, delays[index]), delays[index])

        for index, request in enumerate(requests):
            if prefilling[index] and request.block_tables:
                record(index)
        for index, request in enumerate(requests):
            if not prefilling[index] or request.block_tables:
                continue
            waits_for = self._cached_prefix(request).waits_for
            delays[index] = self._prefix_wait(request, waits_for, computing, per_step, delays[index])
            record(index)
        return computing

    @staticmethod
    def _prefix_wait(
        request: Request, waits_for: bytes | None, computing: dict[bytes, int], per_step: int, delay: int
    ) -> int:
        """`delay` raised for a request whose first uncached prompt block (`waits_for`) another request is computing
        (`computing`: hash -> the step that computes it): it starts the step after, then needs its own prefill
        steps."""
        if waits_for not in computing:
            return delay
        return max(delay, computing[waits_for] + -(-request.num_pending // per_step))

    def _demand(
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
        end_block = self._blocks_for(num_tokens)
        queries = self.max_num_batched_tokens if prefilling else 1
        block_size = self.pool.block_size
        return sum(
            end_block
            if window is None
            else min(
                end_block - first_window_block(start, window, block_size),
                self._blocks_for(window + queries - 2) + 1,
            )
            for window in (self.group_windows if windows is None else windows)
        )

    def admit(self) -> None:
        """Move waiting requests to running while they fit (`fits`), in arrival order with backfill: when the first
        waiting request does not fit, the first of the next `backfill_window - 1` that does is admitted instead, and
        every request it passes counts a skip. A request skipped `MAX_SKIPS` times blocks backfill behind it.

        Why: a burst's head may need blocks that only a finishing request gives back, while a smaller request
        behind it fits now; without backfill the pool idles at that size gap (the full burst at 2 reservations ran
        2.8 requests at a time in arrival order, about 2.9 with backfill in a simulation of the same scheduler).
        """
        # NOTE: admission looks ahead instead of keeping a fixed reserve: reserving one block per running request
        # made admission and preemption chase each other (a preempted request was re-admitted as soon as blocks
        # freed, re-prefilled, and preempted again: 639 preemptions for 48 requests in the full burst run), and a
        # 64-token reserve still preempted and held concurrency below what the pool allows.
        while self.waiting and len(self.running) < self.max_num_seqs:
            # One plan of the running requests for every waiting request tried against them (a new one after each
            # admission): nothing else changes between tries.
            lookahead = Lookahead(self) if self.running else None
            chosen = 0 if lookahead is None else self._first_fitting(lookahead)
            if chosen is None:
                return
            for passed in itertools.islice(self.waiting, chosen):
                passed.num_skips += 1
            request = self.waiting[chosen]
            del self.waiting[chosen]
            self.running.append(request)
            if self._takes_prefix_at_admission(request, lookahead.computing if lookahead is not None else {}):
                self._reuse_prefix(request)

    def _takes_prefix_at_admission(self, request: Request, computing: dict[bytes, int], hit=None) -> bool:
        """Whether `request` takes its cached prefix when it is admitted rather than when its prefill starts: with
        prefix caching, when it has one and its first uncached block is not one a running request is computing
        (`computing`; then it waits for that block, `_waits_for_prefix`, and looks up later).

        Why: evicting one free cached block before a later lookup can shorten the hit below blocks the running
        requests hold (a shared system prompt), and the request would compute copies of them: a sliding group's
        window block, one full group's copy of a block another group still holds, or, in one full group, a free copy
        that a chain of held blocks hangs from (two requests computed the same block in one step, the copy that was
        cached first went free, and the blocks after it are held by the other). Taken at once, its blocks are held
        and admission counts them as shared (`Lookahead._full_tables`), and a sliding group counted from the window
        where its computation goes on (`_demand`'s `start`).
        `hit`: the request's `_cached_prefix`, when the caller has it."""
        if request.block_tables or request.num_computed or not self.pool.allocator.enable_prefix_caching:
            return False
        hit = hit if hit is not None else self._cached_prefix(request)
        return hit.num_blocks > 0 and hit.waits_for not in computing

    def _first_fitting(self, lookahead: Lookahead) -> int | None:
        """Position in `waiting` of the first request that fits `lookahead`, within the backfill window and not
        behind a request that was skipped `MAX_SKIPS` times; None when none does."""
        for position, request in enumerate(itertools.islice(self.waiting, self.backfill_window)):
            if lookahead.fits(request):
                return position
            if request.num_skips >= self.MAX_SKIPS:
                return None
        return None
