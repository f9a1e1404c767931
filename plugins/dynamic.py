"""The "dynamic" backend: transformers' DynamicCache, the reference every other backend must match."""

from transformers import DynamicCache

from hf_paged.registry import hookimpl


def dynamic_cache(config) -> DynamicCache:
    """A DynamicCache for `config`: contiguous per-layer tensors that grow by concatenation at every step."""
    return DynamicCache(config=config)


@hookimpl
def hf_paged_register_backends(register):
    register("dynamic", dynamic_cache, description="transformers DynamicCache: contiguous tensors grown every step")
