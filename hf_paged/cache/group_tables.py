"""GroupTables: the block tables of one `PagedCache`, one `BlockTables` per layer group of its pool.

Layer `l` reads and writes only its group's tables (`of_layer(l)`, and what a step derives from them:
`metadata_of(l)`); row operations (beam reorder, batch select, repeat) and length operations (crop, release) apply to
every group. A block id sits in one group's tables only,
because each group takes its own blocks from the shared allocator.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..storage import BlockPool, LayerGroups, group_of_layer
from .block_tables import BlockTables
from .table_metadata import TableMetadata


class GroupTables:
    def __init__(self, layer_groups: LayerGroups, pool: BlockPool | None):
        self.layer_groups = layer_groups
        self.groups = [BlockTables() for _ in layer_groups]  # groups[g]: the tables of layer group g
        self.metadata = [TableMetadata(tables) for tables in self.groups]  # metadata[g]: derived from groups[g]
        self._group_of_layer = group_of_layer(layer_groups)
        self.set_pool(pool)

    @property
    def pool(self) -> BlockPool | None:
        return self.groups[0].pool

    def set_pool(self, pool: BlockPool | None) -> None:
        for tables in self.groups:
            tables.pool = pool

    def of_layer(self, layer_idx: int) -> BlockTables:
        """The block tables of `layer_idx`'s layer group."""
        return self.groups[self._group_of_layer[layer_idx]]

    def metadata_of(self, layer_idx: int) -> TableMetadata:
        """The tensors and indexes a step derives from the block tables of `layer_idx`'s layer group."""
        return self.metadata[self._group_of_layer[layer_idx]]

    @property
    def num_rows(self) -> int:
        """Rows of the filled groups (every group once a forward has passed all layers; 0 while empty)."""
        return max(tables.num_rows for tables in self.groups)

    def held_blocks_per_group(self) -> tuple[int, ...]:
        return tuple(len(tables.held_block_ids()) for tables in self.groups)

    def release(self) -> None:
        """Return every group's blocks (idempotent; also the finalizer of a dropped cache)."""
        for tables in self.groups:
            tables.release()

    def share_from(self, other: GroupTables) -> None:
        """Hold `other`'s rows in every group, sharing their blocks copy-on-write (see `BlockTables.share_from`)."""
        for tables, other_tables in zip(self.groups, other.groups):
            tables.share_from(other_tables)

    def select_rows(self, indices: list[int]) -> None:
        """New row i becomes a copy of old row `indices[i]`, in every group (see `BlockTables.select_rows`)."""
        num_rows = self.num_rows
        if num_rows == 0:
            return
        if not all(0 <= i < num_rows for i in indices):
            raise IndexError(f"row indices must be in [0, {num_rows}), got {indices}")
        for tables in self.groups:
            if tables.num_rows:  # a group not written yet starts with the new batch size
                tables.select_rows(indices)

    def release_front(self, first_needed: dict[int, int]) -> None:
        """`first_needed[g]`: the first position group g's layers can still read; blocks wholly before it go back."""
        for group_idx, position in first_needed.items():
            if self.groups[group_idx].num_rows:
                self.groups[group_idx].release_front(position)

    def truncate(self, first_needed: Sequence[int], num_tokens: Sequence[int], crop_call: str) -> None:
        """Keep the first `num_tokens[g]` tokens of group g, which must still hold position `first_needed[g]`.

        Checks every group before changing any, so a refused truncation changes nothing."""
        for tables, needed in zip(self.groups, first_needed):
            released = tables.base * tables.pool.block_size if tables.pool is not None else 0
            if needed < released:
                raise RuntimeError(
                    f"`{crop_call}` needs keys from position {needed}, but the sliding window already released "
                    f"positions before {released}; call `activate_past_recording()` first to be able to roll back"
                )
        if self.pool is not None:
            for tables, length in zip(self.groups, num_tokens):
                tables.truncate(length)
