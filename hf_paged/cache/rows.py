"""CacheRows: what a `PagedCache` keeps per row, and the operations that change rows or lengths of all of it at once.

A cache's rows live in four places, which every row and length operation must keep in step:

    block tables      GroupTables, one BlockTables per layer group   block ids, row groups (group_tables.py)
    lengths           PagedLayer.cumulative_length, per layer        tokens cached
    states            HybridStates                                   a hybrid model's recurrent / conv states
    indexer keys      IndexerKeys                                    DeepSeek Sparse Attention's (indexer.py)

Row operations move block tables, never K/V: beam search's reorder, `batch_repeat_interleave` and
`batch_select_indices` permute tables with reference counts (`reorder`, `repeat`, `select`). Length operations cut
them: `crop`, and the sliding groups' release of blocks that left the window (`release_before_windows`). `release`
empties them, caching full blocks for `from_prefix` first; `share_from` starts a branch holding the same blocks;
`adopt_prefix` starts from a prefix-cache hit.

A compileable cache's reservation (`ReservedSteps`) is settled before any of these, and dropped before rows or
lengths change (a row operation takes it again for the new rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import PoolExhausted
from ..storage import BlockPool, block_hashes
from .gather import workspace_for
from .group_tables import GroupTables
from .hybrid import HybridStates
from .indexer import IndexerKeys

if TYPE_CHECKING:
    from .fixed_width import ReservedSteps
    from .layer import PagedLayer


class CacheRows:
    """The rows of one `PagedCache` (see the module docstring).

    Args:
        tables (`GroupTables`): the block tables, one `BlockTables` per layer group.
        paged_layers (`list[PagedLayer]`): the cache's layers holding K/V, in pool-layer order; their lengths.
        states (`HybridStates`): a hybrid model's states (empty for an attention-only model).
        group_windows (`list[int | None]`): per layer group, the window of a group whose every layer slides and
            gives back the blocks that left it, None for a group that keeps every block.
        fixed (`ReservedSteps`, *optional*): a compileable cache's reservations.
    """

    def __init__(
        self,
        tables: GroupTables,
        paged_layers: list[PagedLayer],
        states: HybridStates,
        group_windows: list[int | None],
        fixed: ReservedSteps | None = None,
    ):
        self.tables = tables
        self.paged_layers = paged_layers
        self.states = states
        self.indexer = IndexerKeys()  # "indexed_attention" layers' indexer keys, beside the paged K/V
        self.group_windows = group_windows
        self.sliding_groups = tuple(group for group, window in enumerate(group_windows) if window is not None)
        self._fixed = fixed
        # Whether beam search reordered the rows since the last release: its rows are then beams, and what generate()
        # returns is its best finished hypotheses, so no row's tokens are known to `release(token_ids=...)`.
        self.reordered = False

    def reorder(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam `beam_idx[i]`; a hybrid model's states are index-selected on the batch
        dim, as DynamicCache does."""
        self._select_rows(beam_idx.tolist())
        self.states.select_rows(beam_idx)
        self.reordered = True

    def repeat(self, repeats: int) -> None:
        """Each row `repeats` times in a row (`batch_repeat_interleave`)."""
        self._select_rows([row for row in range(self.tables.num_rows) for _ in range(repeats)])
        self.states.repeat_rows(repeats)

    def select(self, indices: torch.Tensor) -> None:
        """Row i becomes row `indices[i]` (`batch_select_indices`: row indices, a negative one counted from the last
        row, or a boolean mask over the rows, the rows it keeps in order, as tensor indexing reads them)."""
        indices, num_rows = torch.as_tensor(indices), self.tables.num_rows
        if indices.dtype == torch.bool:
            if indices.shape != (num_rows,):
                raise IndexError(
                    f"a boolean mask selects among the cache's {num_rows} rows: its shape must be ({num_rows},), "
                    f"got {tuple(indices.shape)}"
                )
            indices = indices.nonzero().flatten()
        else:
            indices = torch.where(indices < 0, indices + num_rows, indices)
        self._select_rows(indices.tolist())
        self.states.select_rows(indices)

    def _select_rows(self, rows: list[int]) -> None:
        if not rows and self.tables.num_rows:
            raise ValueError(
                "a PagedCache keeps at least one row: the row selection is empty (release() frees every row's blocks)"
            )
        reserved = None
        if self._fixed is not None:
            self._fixed.settle()
            reserved = self._fixed.drop_reservation()
        self.tables.select_rows(rows)
        self.indexer.select_rows(rows)
        if reserved is not None:  # the rows changed under the reservation: take it again for the new rows
            try:
                self._fixed.reserve(reserved)
            except PoolExhausted:
                # The rows are the ones asked for, as a DynamicCache's would be; the next forward asks for its blocks
                # again (get_mask_sizes, or reserve before a compiled forward), where a pool without them refuses
                # that step whole.
                pass

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative int, as in `DynamicCache.crop`)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        self._forget_reservation()
        if tokens_to_remove == 0:
            self.states.crop(0)
            self.release_before_windows()
            return
        self.states.check_croppable(tokens_to_remove)
        layers, layer_groups = self.paged_layers, self.tables.layer_groups
        lengths = [max(layer.cumulative_length + tokens_to_remove, 0) for layer in layers]
        self.tables.truncate(
            [min(layers[i].first_visible(lengths[i]) for i in group) for group in layer_groups],
            [max(lengths[i] for i in group) for group in layer_groups],
            crop_call=f"crop({tokens_to_remove})",
        )
        for layer, length in zip(layers, lengths):
            layer.cumulative_length = length
        self.states.crop(tokens_to_remove)
        self.indexer.truncate(max(lengths))  # every indexed layer holds every token (a KV-sharing one no K/V)
        # NOTE: recording past states or not. `DynamicSlidingWindowLayer.crop` (crop(0) too) cuts its states back to
        # the window that ends at the new length, so no later crop can reach further back in DynamicCache either;
        # releasing here bounds assisted / prompt-lookup decoding to about the window plus the candidates.
        self.release_before_windows()

    def release_before_windows(self) -> None:
        """In each sliding group, give back the blocks before the first key its layers' next updates return.

        With prefix caching, from the first key a query at the end of the last full block sees instead (at most one
        block more): `release(token_ids=...)` caches what the group still holds, and `from_prefix` of every full
        block of the conversation needs that window (`BlockAllocator.peek_longest_prefix`)."""
        pool = self.tables.pool
        caching = pool is not None and pool.allocator.enable_prefix_caching
        first_needed = {}
        for group_idx in self.sliding_groups:
            layers = [self.paged_layers[layer_idx] for layer_idx in self.tables.layer_groups[group_idx]]
            lengths = [layer.cumulative_length for layer in layers]
            if caching:
                lengths = [length - length % pool.block_size for length in lengths]
            first_needed[group_idx] = min(layer.first_visible(length) for layer, length in zip(layers, lengths))
        self.tables.release_front(first_needed)

    def release(self, token_ids=None, attention_mask=None) -> None:
        """Return every block to the pool and forget every row; first, with `token_ids` ([B, S] or [S]), cache the
        full blocks of each unpadded row (`attention_mask` [B, S]) for `from_prefix`."""
        self._forget_reservation()
        try:
            if token_ids is not None:
                self._cache_rows(token_ids, attention_mask)
        finally:  # the blocks go back even when the token ids were refused
            self.tables.release()
            self.indexer.clear()
            if self.tables.pool is not None:
                workspace_for(self.tables.pool).clear()
            for layer in self.paged_layers:
                layer.cumulative_length = 0
            self.states.clear()
            self.reordered = False

    def _cache_rows(self, token_ids, attention_mask) -> None:
        """Remember every full block of every unpadded row in the prefix cache (see `release`)."""
        blocks = self.tables.groups[0]
        self.states.refuse_prefix_reuse("release(token_ids=...)")
        check_prefix_caching(blocks.pool, "release(token_ids=...)")
        if not blocks.num_rows:
            return
        if self.reordered:
            raise ValueError(
                "release(token_ids=...) after beam search: the cache's rows are its beams, and generate() returns the "
                "best finished hypotheses in order of score, so no row is known to hold the tokens given for it; "
                "release() without token_ids (the blocks go back uncached)"
            )
        rows = token_rows(token_ids)
        if len(rows) != blocks.num_rows:
            raise ValueError(f"release got token_ids for {len(rows)} rows, the cache holds {blocks.num_rows}")
        num_tokens = min(layer.cumulative_length for layer in self.paged_layers)
        shortest = min(len(row) for row in rows)
        if shortest < num_tokens:
            raise ValueError(
                f"release got a row of {shortest} token_ids, the cache computed {num_tokens} per row: pass every token "
                "of each row, prompt and generated (what generate() returned)"
            )
        padded = [False] * len(rows) if attention_mask is None else [not all(r) for r in token_rows(attention_mask)]
        for group, group_tables in enumerate(self.tables.groups):
            group_tables.cache_rows(rows, padded, num_tokens, group)

    def share_from(self, other: CacheRows) -> None:
        """Begin as a branch of `other`: its rows and lengths, sharing every block by reference count (the first write
        to a shared block, by either side, copies it), a copy of its indexer keys and states."""
        if other._fixed is not None:
            other._fixed.settle()
        self.tables.share_from(other.tables)
        self.indexer = other.indexer.copy()
        for layer, source in zip(self.paged_layers, other.paged_layers):
            layer.cumulative_length, layer.record_past = source.cumulative_length, source.record_past
            if source.is_initialized:
                layer.dtype, layer.device, layer.is_initialized = source.dtype, source.device, True
        self.states.copy_from(other.states)
        self.reordered = other.reordered

    def adopt_prefix(self, token_ids: list[int]) -> None:
        """Begin with one row holding the longest prefix of `token_ids` the pool has cached, leaving at least one
        token to compute (see `PagedCache.from_prefix`)."""
        self.states.refuse_prefix_reuse("from_prefix")
        pool = self.tables.pool
        block_size = pool.block_size
        num_blocks = (len(token_ids) - 1) // block_size
        hashes = block_hashes(token_ids[: num_blocks * block_size], block_size)
        num_cached, first_blocks, tables = pool.allocator.take_longest_prefix(hashes, self.group_windows, block_size)
        if num_cached:
            for group_tables, first, table in zip(self.tables.groups, first_blocks, tables):
                group_tables.adopt(table, base=first)
        for layer in self.paged_layers:
            layer.cumulative_length = num_cached * block_size

    def _forget_reservation(self) -> None:
        """Rows or lengths are about to change: count in what a reserved forward wrote, forget a reservation no
        forward used."""
        if self._fixed is not None:
            self._fixed.settle()
            self._fixed.drop_reservation()


def check_prefix_caching(pool: BlockPool | None, call: str) -> None:
    if pool is None or not pool.allocator.enable_prefix_caching:
        raise ValueError(
            f"{call} needs a pool with prefix caching: BlockPool.for_model(model, ..., enable_prefix_caching=True)"
        )


def token_rows(token_ids) -> list[list[int]]:
    """[S] or [B, S] ids (tensor or nested lists) -> B lists of ints."""
    rows = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    return [list(rows)] if not rows or not isinstance(rows[0], (list, tuple)) else [list(row) for row in rows]
