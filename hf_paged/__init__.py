"""hf_paged: a paged KV cache for Hugging Face transformers."""

from .allocator import BlockAllocator
from .attention import enable, paged_attention_forward, register
from .cache import PAGED_ATTENTION, DecodePlan, PagedCache, PagedLayer
from .engine import Engine, RequestFailed, SamplingParams
from .errors import PoolExhausted, PoolMismatch
from .pool import BlockPool, KVLayout
from .registry import (
    BackendOptionError,
    DuplicateBackend,
    PluginLoadError,
    PluginLoadWarning,
    UnknownBackend,
    available_backends,
    create_cache,
    hookimpl,
)

# Registers the "hf_paged" attention and mask functions with transformers (a documented global registry), so
# from_pretrained(..., attn_implementation="hf_paged") works after `import hf_paged`.
register()

__all__ = [
    "PAGED_ATTENTION",
    "BackendOptionError",
    "BlockAllocator",
    "BlockPool",
    "DecodePlan",
    "DuplicateBackend",
    "Engine",
    "KVLayout",
    "PagedCache",
    "PagedLayer",
    "PluginLoadError",
    "PluginLoadWarning",
    "PoolExhausted",
    "PoolMismatch",
    "RequestFailed",
    "SamplingParams",
    "UnknownBackend",
    "available_backends",
    "create_cache",
    "enable",
    "hookimpl",
    "paged_attention_forward",
    "register",
]
