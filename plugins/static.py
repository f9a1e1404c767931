"""The "static" backend: transformers' StaticCache, the contiguous slot-reserving baseline.

It reserves `max_cache_len` slots per sequence up front, whatever the sequence ends up using: the memory waste
paging avoids.
"""

from transformers import StaticCache

from hf_paged.registry import hookimpl


def static_cache(config, *, max_cache_len: int) -> StaticCache:
    """A StaticCache for `config` holding up to `max_cache_len` tokens (prompt + new tokens) per sequence."""
    if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len <= 0:
        raise ValueError(f"max_cache_len must be a positive int (prompt + new tokens), got {max_cache_len!r}")
    return StaticCache(config=config, max_cache_len=max_cache_len)


@hookimpl
def hf_paged_register_backends(register):
    register(
        "static",
        static_cache,
        description="transformers StaticCache: contiguous, reserves max_cache_len slots per sequence up front",
    )
