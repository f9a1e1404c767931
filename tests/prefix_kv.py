"""K/V as a function of token ids, for the prefix-caching tests: what a model would write for a token is a function of
its whole prefix (a blake2b digest of it, cut into 32 int16 values, exact in float32: per layer, K and V, head and
dim), so two rows hold equal K/V at a position exactly when their prefixes are equal, and a test knows from token
ids alone what every cache and every cached block must hold."""

from __future__ import annotations

import functools
import hashlib

import torch

from hf_paged import BlockPool, KVLayout, PagedCache

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 4
LAYOUT = KVLayout((NUM_KV_HEADS,) * NUM_LAYERS, (HEAD_DIM,) * NUM_LAYERS)


@functools.lru_cache(maxsize=1 << 16)
def _prefix_digest(prefix: tuple[int, ...]) -> bytes:
    """64 bytes naming `prefix` (a chain, like the block hashes, but per token)."""
    parent = _prefix_digest(prefix[:-1]) if len(prefix) > 1 else b""
    return hashlib.blake2b(parent + prefix[-1].to_bytes(8, "little")).digest()


def token_kv(tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each `[NUM_LAYERS, H, S, D]` float32, that a model writes for the `S` tokens of one row."""
    tokens = tuple(tokens)
    if not tokens:
        empty = torch.zeros(NUM_LAYERS, NUM_KV_HEADS, 0, HEAD_DIM)
        return empty, empty
    digests = bytearray(b"".join(_prefix_digest(tokens[: p + 1]) for p in range(len(tokens))))
    values = torch.frombuffer(digests, dtype=torch.int16).float()
    values = values.view(len(tokens), 2, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM).permute(1, 2, 3, 0, 4)
    return values[0], values[1]


def rows_kv(rows: list[list[int]], start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer `[B, H, end - start, D]` K and V of positions [start, end) of every row."""
    per_row = [token_kv(row[:end]) for row in rows]
    keys = [torch.stack([k[layer_idx, :, start:end] for k, _ in per_row]) for layer_idx in range(NUM_LAYERS)]
    values = [torch.stack([v[layer_idx, :, start:end] for _, v in per_row]) for layer_idx in range(NUM_LAYERS)]
    return keys, values


def read_blocks(pool: BlockPool, layer_idx: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[H, len(block_ids) * block_size, D]` K and V that the pool holds in `block_ids`, in order (read straight
    from the storage, not through the cache's gather)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    return pool.key_cache[layer_idx][:, index].flatten(1, 2), pool.value_cache[layer_idx][:, index].flatten(1, 2)


def update_rows(cache: PagedCache, tokens_per_row: list[list[int]], num_past: int = 0) -> None:
    """One update per layer: positions [num_past, len(row)) of every row's token K/V."""
    keys, values = rows_kv(tokens_per_row, num_past, len(tokens_per_row[0]))
    for layer_idx in range(NUM_LAYERS):
        cache.update(keys[layer_idx], values[layer_idx], layer_idx)
