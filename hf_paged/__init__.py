"""hf_paged: a paged KV cache for Hugging Face transformers."""

from .attention import PAGED_ATTENTION, DecodePlan, enable, paged_attention_forward, register
from .cache import PagedCache, PagedLayer
from .engine import Engine, SamplingParams
from .errors import (
    BackendOptionError,
    DuplicateBackend,
    GradientsUnsupported,
    LockstepError,
    PluginLoadError,
    PluginLoadWarning,
    PoolExhausted,
    PoolMismatch,
    PoolTooLarge,
    RequestFailed,
    UnknownBackend,
    UnsupportedCacheAttribute,
    UnsupportedModel,
)
from .registry import available_backends, create_cache, hookimpl
from .storage import BlockAllocator, BlockPool, KVLayout

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
    "GradientsUnsupported",
    "KVLayout",
    "LockstepError",
    "PagedCache",
    "PagedLayer",
    "PluginLoadError",
    "PluginLoadWarning",
    "PoolExhausted",
    "PoolMismatch",
    "PoolTooLarge",
    "RequestFailed",
    "SamplingParams",
    "UnknownBackend",
    "UnsupportedCacheAttribute",
    "UnsupportedModel",
    "available_backends",
    "create_cache",
    "enable",
    "hookimpl",
    "paged_attention_forward",
    "register",
]
