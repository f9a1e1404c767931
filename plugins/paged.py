"""The "paged" backend: hf_paged.PagedCache, K/V in fixed-size blocks of a BlockPool that caches can share."""

from hf_paged.registry import hookimpl


def paged_cache(config, *, pool=None, block_size: int | None = None, dtype=None, device=None, share_rows: bool = True):
    """A PagedCache for `config`.

    Args:
        pool (`hf_paged.BlockPool`, *optional*): a pool shared with other caches (`BlockPool.for_model(model, ...)`);
            without one the cache makes a private pool on its first update.
        block_size (`int`, *optional*): tokens per block of a private pool (PagedCache's default, 16). A shared
            pool has its own; giving a different one is an error.
        dtype (`torch.dtype`, *optional*), device (`torch.device`, *optional*): of a private pool; `create_cache`
            fills them from the model when given a model.
        share_rows (`bool`, defaults to `True`): store identical rows (expanded prompts) once.
    """
    # Imported here, not at module level: the registry and the other backends must load even where the cache
    # module cannot be imported.
    from hf_paged.cache import PagedCache

    if pool is not None and block_size is not None and block_size != pool.block_size:
        raise ValueError(f"block_size={block_size} but the shared pool has block_size={pool.block_size}; drop one")
    # Pass only what was set, so PagedCache's own defaults apply.
    options = {"block_size": block_size, "dtype": dtype, "device": device}
    options = {name: value for name, value in options.items() if value is not None}
    return PagedCache(config=config, pool=pool, share_rows=share_rows, **options)


@hookimpl
def hf_paged_register_backends(register):
    register("paged", paged_cache, description="hf_paged PagedCache: fixed-size blocks from a shareable BlockPool")
