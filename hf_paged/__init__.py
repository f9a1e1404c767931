"""hf_paged: a paged KV cache for Hugging Face transformers."""

from .allocator import BlockAllocator
from .cache import PagedCache, PagedLayer
from .errors import PoolExhausted, PoolMismatch
from .pool import BlockPool, KVLayout

__all__ = ["BlockAllocator", "BlockPool", "KVLayout", "PagedCache", "PagedLayer", "PoolExhausted", "PoolMismatch"]
