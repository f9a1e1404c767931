"""GatherWorkspace: one layer's visible K/V gathered from the pool into grow-only buffers that a cache reuses.

This is the sdpa / eager path (and the decode fallback of the "hf_paged" attention): attention wants contiguous
`[B, kv_heads, kv_len, head_dim]` K/V, the pool holds them in blocks named by a layer group's block tables.
"""

from __future__ import annotations

import torch

from .block_tables import BlockTables


class GatherWorkspace:
    """Grow-only K and V buffers (25% headroom, so a growing sequence rarely reallocates).

    NOTE: what `gather` returns are views into these buffers, overwritten by the next `gather`. Attention consumes
    them at once, and reusing the buffer is what makes the gather cheaper than DynamicCache's `torch.cat`, which pays
    for a fresh allocation every layer and step (docs/benchmarks.md has the measurement).
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def gather(
        self, blocks: BlockTables, layer_idx: int, first: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [first, num_tokens) of every row of `blocks` (the tables of `layer_idx`'s layer group) from
        that layer's pool storage: two [B, kv_heads, num_tokens - first, head_dim] views."""
        pool = blocks.pool
        num_heads, num_pool_blocks, block_size, head_dim = pool.key_cache[layer_idx].shape
        first_block, end_block = first // block_size, -(-num_tokens // block_size)
        index = blocks.gather_index(first_block, end_block, num_heads, num_pool_blocks)
        start, stop = first - first_block * block_size, num_tokens - first_block * block_size
        gathered = []
        for name, cache in (("keys", pool.key_cache[layer_idx]), ("values", pool.value_cache[layer_idx])):
            out = self._view(name, (index.numel(), block_size, head_dim), cache)
            torch.index_select(cache.view(-1, block_size, head_dim), 0, index, out=out)
            gathered.append(out.view(blocks.num_rows, num_heads, -1, head_dim)[:, :, start:stop])
        return gathered[0], gathered[1]

    def _view(self, name: str, shape: tuple[int, int, int], like: torch.Tensor) -> torch.Tensor:
        numel = shape[0] * shape[1] * shape[2]
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = like.new_empty(numel + numel // 4)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())
