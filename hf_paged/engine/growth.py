"""How a request's blocks grow in admission's lookahead, and how many blocks it is counted at.

A running request grows by one token a step until its `max_new_tokens` (or for `decode_reserve_tokens` steps, when
set), and holds its blocks until it ends. A request whose prompt is not computed yet starts growing only once its
prefill has had budget: the prompts before it take the step's prefill tokens first, and with prefix caching it may
also wait for prompt blocks another request is computing. It may start (and end) up to `delay` steps late, so its
plan (`Growth`) counts it from step 0 as if it started at once, then at its full size until the latest step it can
end; at every step, that is at least what it holds:

    step t:     0     1     2    ...   steps    steps + 1   ...   end = steps + delay
    tokens:     n    n+1   n+2   ...  n+steps    n+steps    ...   n+steps

Until step `end - steps` it may still be prefilling, so a sliding group counts a prefill chunk's keys until then.
"""

from __future__ import annotations

from typing import NamedTuple

from ..storage import first_window_block
from .blocks import BlockCounts
from .prefix import PrefixReuse
from .request import Request


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
    """Each request's plan (`growth`) and block count (`demand`) in admission's lookahead, and the waits of prefills
    for prompt blocks other requests are computing (`add_prefix_waits`). `Lookahead` sums these over the running
    requests and a newcomer; a `Scheduler` subclass can count differently through `Scheduler.growth_model_class`."""

    def __init__(
        self,
        blocks: BlockCounts,
        prefix: PrefixReuse,
        *,
        max_num_batched_tokens: int,
        decode_reserve_tokens: int | None = None,
    ):
        self.blocks = blocks
        self.prefix = prefix
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_reserve_tokens = decode_reserve_tokens

    def growth(self, request: Request, delay: int, prefilling: bool, start: int | None = None) -> Growth:
        """`request`'s plan in the lookahead when its prefill may wait `delay` steps for budget; `start`: the
        position its computation goes on from (default: its computed tokens)."""
        num_tokens = len(request.prompt_ids) + len(request.output_ids)  # what it holds once its input is computed
        # NOTE: the last sampled token is never fed back, so K/V peak at prompt + max_new_tokens - 1 tokens.
        final = len(request.prompt_ids) + request.params.max_new_tokens - 1
        steps = max(final - num_tokens, 0)  # decode steps until its K/V stop growing
        if self.decode_reserve_tokens is not None:
            steps = min(steps, self.decode_reserve_tokens)
        return Growth(num_tokens, steps, steps + delay, prefilling, request.num_computed if start is None else start)

    def add_prefix_waits(
        self, requests: list[Request], prefilling: list[bool], delays: list[int], per_step: int
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
            num_full = len(request.token_ids) // self.blocks.block_size
            self.prefix.extend_hashes(request, num_full)
            for block_hash in request.block_hashes[request.num_registered_blocks : num_full]:
                computing[block_hash] = max(computing.get(block_hash, delays[index]), delays[index])

        for index, request in enumerate(requests):
            if prefilling[index] and request.block_tables:
                record(index)
        for index, request in enumerate(requests):
            if not prefilling[index] or request.block_tables:
                continue
            waits_for = self.prefix.peek(request).waits_for
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
        blocks = self.blocks
        end_block = blocks.blocks_for(num_tokens)
        queries = self.max_num_batched_tokens if prefilling else 1
        return sum(
            end_block
            if window is None
            else min(
                end_block - first_window_block(start, window, blocks.block_size),
                blocks.blocks_for(window + queries - 2) + 1,
            )
            for window in (blocks.group_windows if windows is None else windows)
        )
