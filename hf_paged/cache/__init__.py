"""`PagedCache`, the `transformers.Cache` over a `BlockPool`: its per-layer view, block tables and K/V gather."""

from .layer import PagedLayer
from .paged_cache import PagedCache

__all__ = ["PagedCache", "PagedLayer"]
