"""Block arithmetic over a pool's layer groups: the blocks a number of tokens takes, and the blocks a query sees.

A full group (window None) holds every block up to a request's last token; a sliding group only the blocks from
the one its window starts in:

    positions:      0 ........................................ p
    full group:     [b0][b1][b2][b3][b4][b5][b6][b7]              every block up to p's
    sliding group:                      [b4][b5][b6][b7]          from the block p - window + 1 is in
"""

from __future__ import annotations

from ..storage import first_window_block


class BlockCounts:
    """Block counts for one pool's `block_size` and its layer groups' windows (`group_windows[g]`: the window when
    every layer of group g slides, else None)."""

    def __init__(self, block_size: int, group_windows: list[int | None]):
        self.block_size = block_size
        self.group_windows = group_windows

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` tokens from position 0 fill, the last one partly."""
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, group: int, position: int) -> int:
        """The first block of `group` that a query at `position` (or later) can see."""
        return first_window_block(position, self.group_windows[group], self.block_size)

    def held_at(self, position: int) -> int:
        """Blocks, over all groups, that a step whose last query is at `position` holds when the step's first is
        there too (a decode row, or a one-token chunk)."""
        end_block = self.blocks_for(position + 1)
        return sum(end_block - self.first_needed_block(group, position) for group in range(len(self.group_windows)))

    def max_tokens(self, num_blocks: int, max_positions: int | None = None) -> int | None:
        """The most tokens whose K/V one request can hold running alone in `num_blocks` blocks (a query at each
        position, `held_at`); None when it never runs out before `max_positions` (or, with no limit on positions,
        at all: every layer slides, so what a request holds is bounded by its windows)."""
        if all(window is None for window in self.group_windows):
            return (num_blocks // len(self.group_windows)) * self.block_size
        # NOTE: a sliding group's count rises and falls as the window crosses block boundaries, so scan.
        end = max_positions if max_positions is not None else num_blocks * self.block_size
        return next((position for position in range(end) if self.held_at(position) > num_blocks), None)
