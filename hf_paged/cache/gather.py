"""One layer's visible K/V as the contiguous-per-row `[B, kv_heads, kv_len, head_dim]` tensors attention wants.

This is the sdpa / eager path (and the decode fallback of the "hf_paged" attention): attention wants
`[B, kv_heads, kv_len, head_dim]` K/V, the pool holds them in blocks named by a layer group's block tables. Two ways:

- zero-copy: when the cache holds one row whose blocks are consecutive pool blocks (one row generating alone in its
  pool, the usual batch-1 `generate()`), the K/V are one strided view of the pool;
- otherwise one `index_select` per K and V into a `GatherWorkspace`, a grow-only buffer shared by the caches of one
  pool within one thread (`workspace_for`).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .block_tables import GatherTables

if TYPE_CHECKING:
    from ..storage import BlockPool
    from .table_metadata import TableMetadata

# pool -> threading.local holding that thread's GatherWorkspace for the pool (dropped with the pool).
_WORKSPACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WORKSPACES_LOCK = threading.Lock()


def head_major(gathered: torch.Tensor, rows: int, width: int, head_dim: int) -> torch.Tensor:
    """`[kv_heads, rows * W, block_size * head_dim]` blocks gathered per head -> the `[rows, kv_heads, width,
    head_dim]` view of each row's first `width` keys (no copy: SDPA reads any strides but the last one's)."""
    return gathered.view(gathered.shape[0], rows, -1, head_dim).transpose(0, 1)[:, :, :width]


def workspace_for(pool) -> GatherWorkspace:
    """The gather workspace the caches of `pool` share in the calling thread.

    Sharing is safe because a gather's views are consumed by attention before the same thread updates any cache
    again; caches of one pool in different threads get different workspaces."""
    with _WORKSPACES_LOCK:
        local = _WORKSPACES.get(pool)
        if local is None:
            local = _WORKSPACES[pool] = threading.local()
    workspace = getattr(local, "workspace", None)
    if workspace is None:
        workspace = local.workspace = GatherWorkspace()
    return workspace


def visible_kv(blocks: GatherTables, layer_idx: int, first: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [first, num_tokens) of every row of `blocks` (the tables of `layer_idx`'s layer group): two
    `[B, kv_heads, num_tokens - first, head_dim]` tensors, views of the pool when the rows' blocks allow it, else of
    the pool's shared gather workspace. Valid until the next update of a cache of the same pool in this thread."""
    pool = blocks.pool
    block_size = pool.block_size
    first_block, end_block = first // block_size, -(-num_tokens // block_size)
    start, stop = first - first_block * block_size, num_tokens - first_block * block_size
    # The run views of these blocks (None: a gather), kept in the tables' memo with the pool tensors they view, so
    # a step's later layers and later steps in the same blocks look them up once.
    key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
    memo = blocks.memo
    key = ("visible", layer_idx, first_block, end_block)
    found = memo.get(key)
    if found is None or found[0] is not key_cache or found[1] is not value_cache:
        run = blocks.consecutive_run(first_block, end_block)
        views = None if run is None else run_views(blocks, layer_idx, run, end_block - first_block)
        found = memo[key] = (key_cache, value_cache, views)
    views = found[2]
    if views is not None:
        return views[0].narrow(2, start, stop - start), views[1].narrow(2, start, stop - start)
    return workspace_for(pool).gather(blocks, layer_idx, first_block, end_block, start, stop)


def shared_prefix_kv(
    blocks: TableMetadata, layer_idx: int, first: int, split: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Positions [first, num_tokens) of every row of `blocks`, in two parts: [first, split), which every row holds in
    the same blocks (`TableMetadata.shared_blocks`), once, and [split, num_tokens) of each row.

    `split` is a block boundary (or `num_tokens`: the rows share everything). Returns the prefix's keys and values,
    `[1, kv_heads, split - first, head_dim]` (a view of the pool when its blocks are consecutive, else gathered from
    row 0), and the tails', `[B, kv_heads, num_tokens - split, head_dim]` (gathered; None when empty). The workspace
    holds one row's prefix at most and every row's tail: far less than every row's whole context."""
    pool = blocks.pool
    block_size = pool.block_size
    first_block, split_block = first // block_size, -(-split // block_size)
    start, stop = first - first_block * block_size, split - first_block * block_size
    workspace = workspace_for(pool)
    run = blocks.consecutive_run(first_block, split_block, row=0)
    views = None if run is None else run_views(blocks, layer_idx, run, split_block - first_block)
    if views is not None:
        prefix_keys, prefix_values = (view.narrow(2, start, stop - start) for view in views)
    else:
        prefix_keys, prefix_values = workspace.gather(
            blocks, layer_idx, first_block, split_block, start, stop, row=0, name="prefix"
        )
    if split == num_tokens:
        return prefix_keys, prefix_values, None, None
    end_block = -(-num_tokens // block_size)
    tail_keys, tail_values = workspace.gather(blocks, layer_idx, split_block, end_block, 0, num_tokens - split)
    return prefix_keys, prefix_values, tail_keys, tail_values


def run_views(
    blocks: GatherTables, layer_idx: int, first_id: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`[1, kv_heads, num_blocks * block_size, head_dim]` K and V views of layer `layer_idx`'s pool storage over the
    consecutive pool blocks from `first_id`, or None when the pool's layout does not allow one (a head's blocks not
    contiguous). Memoized in the tables (cleared on a table change) for later layers and steps, made again when the
    pool's tensors changed (a private pool grew)."""
    pool = blocks.pool
    key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
    memo = blocks.memo
    key = ("views", layer_idx, first_id, num_blocks)
    views = memo.get(key)
    if views is None or views[0] is not key_cache or views[1] is not value_cache:
        if key_cache.stride(1) != key_cache.shape[2] * key_cache.stride(2):
            return None
        views = memo[key] = (
            key_cache,
            value_cache,
            _run_view(key_cache, first_id, num_blocks),
            _run_view(value_cache, first_id, num_blocks),
        )
    return views[2], views[3]


def pool_views(
    memo: dict, pool: BlockPool, layer_idx: int, make: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`make(key_cache)` and `make(value_cache)` of layer `layer_idx`, kept in `memo` with the pool tensors they view
    and made again when those changed (a private pool grew)."""
    key_cache, value_cache = pool.key_cache[layer_idx], pool.value_cache[layer_idx]
    views = memo.get(layer_idx)
    if views is None or views[0] is not key_cache or views[1] is not value_cache:
        views = memo[layer_idx] = (key_cache, value_cache, make(key_cache), make(value_cache))
    return views[2], views[3]


def _run_view(cache: torch.Tensor, first_id: int, num_blocks: int) -> torch.Tensor:
    """`[1, kv_heads, num_blocks * block_size, head_dim]` view of a head-major pool tensor `cache` ([kv_heads,
    num_pool_blocks, block_size, head_dim], blocks contiguous) over the consecutive blocks from `first_id`."""
    num_heads, _, block_size, head_dim = cache.shape
    head_stride, block_stride, token_stride, _ = cache.stride()
    return cache.as_strided(
        (1, num_heads, num_blocks * block_size, head_dim),
        (num_heads * head_stride, head_stride, token_stride, 1),
        cache.storage_offset() + first_id * block_stride,
    )


class GatherWorkspace:
    """Grow-only K and V buffers sized to the largest gather so far, in whole blocks per row: at most the visible K/V
    of the largest step's one layer plus the partly filled block of each row.

    NOTE: what `gather` returns are views into these buffers, overwritten by the next `gather`. Attention consumes
    them at once; reusing the buffer spares the fresh allocation that DynamicCache's `torch.cat` pays every layer
    and step. A first prefill never gathers (`PagedCache.update` returns the step's own K/V), so the buffers are
    sized by decode steps and by prefills after cached tokens.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}  # (name, device, dtype) -> buffer
        # Per pool layer: its K and V as `[kv_heads * num_blocks, block_size * head_dim]` rows (`pool_views`).
        self._rows: dict[int, tuple[torch.Tensor, ...]] = {}

    def gather(
        self,
        blocks: GatherTables,
        layer_idx: int,
        first_block: int,
        end_block: int,
        start: int,
        stop: int,
        *,
        row: int | None = None,
        name: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical blocks [first_block, end_block) of every row of `blocks` (`row`: of that row only, for a
        `TableMetadata`) from layer `layer_idx`'s pool storage, then tokens [start, stop) of them: `[B, kv_heads,
        stop - start, head_dim]` keys and `[B, value_heads, stop - start, value_head_dim]` values (views). `name`
        picks buffers apart from the plain gather's, for a gather whose result is used together with another."""
        pool = blocks.pool
        # NOTE: blocks as rows of block_size * head_dim values: on CPU, index_select copies 2-D rows ~3x faster than
        # 3-D ones.
        key_rows, value_rows = pool_views(self._rows, pool, layer_idx, lambda t: t.view(-1, t.shape[2] * t.shape[3]))
        gathered = []
        for buffer, cache, rows in (
            (name + "keys", pool.key_cache[layer_idx], key_rows),
            (name + "values", pool.value_cache[layer_idx], value_rows),
        ):
            # What does not depend on the layer (the index, the buffer's views) is made at the step's first layer
            # and kept in the tables' memo (dropped when they change) while the buffer is the same: a later layer then
            # costs one index_select, where making the views again costs more than the copy at small contexts.
            key = ("gather views", buffer, first_block, end_block, start, stop, row, cache.shape, cache.dtype)
            made = blocks.memo.get(key)
            if made is None or made[0] is not self._buffers.get((buffer, cache.device, cache.dtype)):
                made = blocks.memo[key] = self._gather_views(
                    blocks, buffer, cache, first_block, end_block, start, stop, row
                )
            _, index, out, result = made
            torch.index_select(rows, 0, index, out=out)
            gathered.append(result)
        return gathered[0], gathered[1]

    def _gather_views(
        self,
        blocks: GatherTables,
        buffer: str,
        cache: torch.Tensor,
        first_block: int,
        end_block: int,
        start: int,
        stop: int,
        row: int | None,
    ) -> tuple:
        """(the buffer, the gather's index, the buffer's `[blocks, block_size * head_dim]` view it fills, the
        `[B, heads, stop - start, head_dim]` view `gather` returns) for `cache`'s shape."""
        # V may have other heads and head_dim than K (multi-head latent attention): each its own shape.
        num_heads, num_pool_blocks, block_size, head_dim = cache.shape
        num_rows = blocks.num_rows if row is None else 1
        if row is None:
            index = blocks.gather_index(first_block, end_block, num_heads, num_pool_blocks)
        else:
            index = blocks.gather_index(first_block, end_block, num_heads, num_pool_blocks, row=row)
        out = self.buffer(buffer, (index.numel(), block_size, head_dim), cache)
        result = out.view(num_rows, num_heads, -1, head_dim)[:, :, start:stop]
        return self._buffers[(buffer, cache.device, cache.dtype)], index, out.view(index.numel(), -1), result

    def gather_heads(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor, num_rows: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool blocks `blocks` (`[num_rows * n]` ids, row after row) of one layer's K and V, each kv head's read
        in one pass over that head (`index_select` on the block dimension): `[num_rows, kv_heads, length,
        head_dim]` views of `[kv_heads, num_rows * n, ...]` copies (`head_major`). For attention the cache computes
        itself (a placeholder's plan), which reads any strides; K/V of several heads handed to a model, which may
        `.view` rows and heads together, are `gather`'s (one head's, a latent layout's, are laid out alike)."""
        gathered = []
        for name, cache in (("keys", key_cache), ("values", value_cache)):
            num_heads, num_pool_blocks, block_size, head_dim = cache.shape
            out = self.buffer(name, (num_heads, blocks.numel(), block_size * head_dim), cache)
            torch.index_select(cache.view(num_heads, num_pool_blocks, -1), 1, blocks, out=out)
            gathered.append(head_major(out, num_rows, length, head_dim))
        return gathered[0], gathered[1]

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A `shape` view of the grow-only buffer `name` for `like`'s device and dtype (one per device of a split
        pool), valid until the next call for the same name."""
        numel = math.prod(shape)
        key = (name, like.device, like.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self._buffers.pop(key, None)  # drop the old buffer before allocating the new one
            buffer = self._buffers[key] = like.new_empty(numel)
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()
        self._rows.clear()

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())
