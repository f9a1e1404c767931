"""Paged-attention kernels: plain tensors in, tensors out (no transformers import here).

- `paged_decode_attention` / `store_kv`: dispatch to Triton (CUDA tensors) or the PyTorch reference (otherwise);
  see `dispatch.py` for the `backend` argument and the `HF_PAGED_ATTENTION_BACKEND` variable.
- `*_torch`: the PyTorch references (`reference.py`), also the CPU fallback.
- `paged_prefill_attention`: the new tokens of several sequences (packed, varlen) over their paged K/V, causal
  (prefill chunks, prompts after a prefix-cache hit); same dispatch.
- `*_triton`: the Triton kernels (`triton_decode.py`, `triton_prefill.py`, `triton_store.py`), imported on first
  attribute access so that this package imports without Triton installed; their launch choices (tiles, warps,
  stages) per GPU are in `launch_config.py`, and `resources.py` compiles every variant they pick for sm_80 /
  sm_90 without a GPU (registers, spills, shared memory: tests/test_kernel_compile.py, docs/kernels.md).
"""

from . import ops  # noqa: F401, E402  (registers the torch.ops.hf_paged custom ops that traced code calls)
from .dispatch import (
    BACKEND_ENV_VAR,
    BACKENDS,
    paged_decode_attention,
    paged_prefill_attention,
    resolve_backend,
    store_kv,
)
from .reference import gather_kv, paged_decode_attention_torch, paged_prefill_attention_torch, store_kv_torch

__all__ = [
    "BACKENDS",
    "BACKEND_ENV_VAR",
    "gather_kv",
    "paged_decode_attention",
    "paged_decode_attention_torch",
    "paged_decode_attention_triton",
    "paged_prefill_attention",
    "paged_prefill_attention_torch",
    "paged_prefill_attention_triton",
    "resolve_backend",
    "store_kv",
    "store_kv_torch",
    "store_kv_triton",
]


def __getattr__(name: str):
    if name == "paged_decode_attention_triton":
        from .triton_decode import paged_decode_attention_triton

        return paged_decode_attention_triton
    if name == "paged_prefill_attention_triton":
        from .triton_prefill import paged_prefill_attention_triton

        return paged_prefill_attention_triton
    if name == "store_kv_triton":
        from .triton_store import store_kv_triton

        return store_kv_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
