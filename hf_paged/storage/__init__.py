"""K/V storage: the block allocator (ids, reference counts, copy-on-write, prefix index; no torch), layer groups,
the per-model K/V layout, and the pool of block tensors."""

from .allocator import BlockAllocator, block_hashes, first_window_block, hash_block_tokens
from .layer_groups import LayerGroups, derive_layer_groups, group_of_layer, group_windows, slot_of_layer
from .layout import SLIDING_LAYER_TYPES, SUPPORTED_LAYER_TYPES, KVLayout, block_windows, sliding_windows
from .pool import BlockPool, parse_memory

__all__ = [
    "SLIDING_LAYER_TYPES",
    "SUPPORTED_LAYER_TYPES",
    "BlockAllocator",
    "BlockPool",
    "KVLayout",
    "LayerGroups",
    "block_hashes",
    "block_windows",
    "derive_layer_groups",
    "first_window_block",
    "group_of_layer",
    "group_windows",
    "hash_block_tokens",
    "parse_memory",
    "slot_of_layer",
    "sliding_windows",
]
