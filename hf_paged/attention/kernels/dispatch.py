"""Backend choice for the paged kernels: Triton on CUDA tensors, the PyTorch reference otherwise.

`backend` is "auto", "triton" or "torch". When a call does not pass one, the environment variable
`HF_PAGED_ATTENTION_BACKEND` (same values, read at every call) decides, and "auto" when it is unset.

The Triton modules are imported on first use, not at import time: `import hf_paged.kernels` works without Triton
(macOS, CPU-only installs), and `TRITON_INTERPRET` may still be set after `hf_paged` is imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Mapping
from types import MappingProxyType, SimpleNamespace

import torch

from .reference import paged_decode_attention_torch, paged_prefill_attention_torch, store_kv_torch, token_rows

BACKENDS = ("auto", "triton", "torch")
BACKEND_ENV_VAR = "HF_PAGED_ATTENTION_BACKEND"


@functools.cache  # asked at every step's start: the package set does not change under a running process
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def triton_possible(device: torch.device) -> bool:
    """Whether some backend setting can resolve to "triton" for tensors on `device` (CUDA, or CPU under
    `TRITON_INTERPRET=1`): elsewhere every attention module runs the torch backend."""
    return (device.type == "cuda" or _triton_interpreting()) and triton_installed()


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Return "triton" or "torch" for tensors on `device`. `None` reads `HF_PAGED_ATTENTION_BACKEND`, then "auto"."""
    source = "backend"
    if backend is None:
        backend, source = os.environ.get(BACKEND_ENV_VAR, "auto"), BACKEND_ENV_VAR
    choice = backend.strip().lower() if isinstance(backend, str) else backend
    if choice not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    has_triton = triton_installed()
    if choice == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if choice == "triton":
        if not has_triton:
            raise ValueError(f"{source}='triton' but triton is not installed; use 'torch' or 'auto'")
        if device.type != "cuda" and not _triton_interpreting():
            raise ValueError(
                f"{source}='triton' needs CUDA tensors (got {device.type}), or TRITON_INTERPRET=1 set before the "
                f"first Triton call to run the kernels on CPU in Triton's interpreter"
            )
    return choice


def resolve_backends(device: torch.device) -> Mapping:
    """Every module backend setting resolved for `device` on the host, before a compiled step: None (the environment
    variable, else "auto") and each of BACKENDS, the error `resolve_backend` raises standing for a setting that
    cannot run there. Read-only; the same mapping while the environment variables it depends on keep their values."""
    return _resolved_backends(device, os.environ.get(BACKEND_ENV_VAR), os.environ.get("TRITON_INTERPRET"))


@functools.lru_cache(maxsize=64)
def _resolved_backends(device: torch.device, backend_env: str | None, interpret_env: str | None) -> Mapping:
    backends = {}
    for setting in (None, *BACKENDS):
        try:
            backends[setting] = resolve_backend(setting, device)
        except ValueError as error:
            backends[setting] = error.with_traceback(None)
    return MappingProxyType(backends)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    kv_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode attention over the paged pool; arguments and shapes as in `paged_decode_attention_torch`.

    query `[B, num_q_heads, head_dim]`, caches `[num_blocks, block_size, num_kv_heads, head_dim]`, block_tables
    `[B, max_blocks_per_seq]` and seq_lens `[B]` int32 or int64 -> `[B, num_q_heads, head_dim]` in `query.dtype`.
    `backend`: "auto" | "triton" | "torch"; `None` follows `HF_PAGED_ATTENTION_BACKEND`.
    """
    kwargs = dict(scale=scale, kv_start=kv_start, sliding_window=sliding_window, softcap=softcap, out=out)
    if resolve_backend(backend, query.device) == "torch":
        return paged_decode_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, **kwargs)
    return _triton_modules().decode.paged_decode_attention_triton(
        query, key_cache, value_cache, block_tables, seq_lens, **kwargs
    )


def decode_launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_start: torch.Tensor | None = None,
):
    """The Triton decode kernel's launch for these rows (`triton_decode.DecodeLaunch`), to call once per layer that
    reads them: `launch(query, key_cache, value_cache, scale=..., sliding_window=..., softcap=..., out=...)` computes
    what `paged_decode_attention(..., backend="triton")` would. Shapes as there."""
    return _triton_modules().decode.DecodeLaunch(
        query, key_cache, value_cache, block_tables, seq_lens, kv_start=kv_start
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    kv_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of several sequences' new tokens (packed) over their paged K/V; arguments and shapes as in
    `paged_prefill_attention_torch`.

    query `[num_tokens, num_q_heads, head_dim]`, caches `[num_blocks, block_size, num_kv_heads, head_dim]`,
    block_tables `[B, max_blocks_per_seq]` and seq_lens `[B]` int32 or int64, cu_seqlens_q `[B + 1]` int32 ->
    `[num_tokens, num_q_heads, head_dim]` in `query.dtype`. `backend` as in `paged_decode_attention`.
    """
    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens)
    kwargs = dict(scale=scale, kv_start=kv_start, sliding_window=sliding_window, softcap=softcap, sinks=sinks, out=out)
    if resolve_backend(backend, query.device) == "torch":
        return paged_prefill_attention_torch(*args, **kwargs)
    return _triton_modules().prefill.paged_prefill_attention_triton(*args, **kwargs)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write K/V rows `[num_tokens, num_kv_heads, head_dim]` to their slots (`[num_tokens]` int64) in place.

    Arguments as in `store_kv_torch`; `backend` as in `paged_decode_attention`.
    """
    if resolve_backend(backend, key_cache.device) == "torch":
        store_kv_torch(key, value, key_cache, value_cache, slot_mapping)
        return
    store_kv_triton(key, value, key_cache, value_cache, slot_mapping)


def store_launch(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """The Triton store kernel's launch into these `[num_blocks, block_size, kv_heads, head_dim]` caches of one shape
    (`triton_store.StoreLaunch`), to make once and call at every step: `launch(key_states, value_states, slots)`
    writes what `store_kv_rows(..., backend="triton")` would."""
    return _triton_modules().store.StoreLaunch(key_cache, value_cache)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """`triton_store.store_kv_triton`, imported at its first call (Triton is optional); arguments as there."""
    _triton_modules().store.store_kv_triton(key, value, key_cache, value_cache, slots)


@functools.cache
def _triton_modules() -> SimpleNamespace:
    """The Triton launchers' modules, imported once at the first launch (an `import` inside a launcher costs about a
    microsecond at every layer and step): Triton is optional, and a process without it never gets here. Launchers are
    looked up in their module at each call."""
    from . import triton_decode, triton_prefill, triton_store

    return SimpleNamespace(decode=triton_decode, prefill=triton_prefill, store=triton_store)


def store_backend(device: torch.device) -> str:
    """Where `store_kv_rows` runs the Triton store kernel ("triton": CUDA, or HF_PAGED_ATTENTION_BACKEND=triton under
    TRITON_INTERPRET=1), else "torch". Callers storing every layer of a step may resolve it once and pass it on."""
    if device.type == "cuda" or os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() == "triton":
        return resolve_backend(None, device)
    return "torch"


def store_kv_rows(
    key_cache, value_cache, key_states, value_states, slots, *, backend: str | None = None, nhd_views=None
) -> None:
    """Write [W, kv_heads, q_len, head_dim] states to `slots` ([W * q_len]) of the head-major pool, in place (V's
    heads and head_dim may differ from K's, as the pool's tensors say).

    The Triton store kernel on CUDA (or when HF_PAGED_ATTENTION_BACKEND=triton forces it, e.g. under
    TRITON_INTERPRET=1); `index_copy_` on the flattened [kv_heads, num_blocks * block_size, head_dim] view elsewhere.
    `backend`: "triton" or "torch" as `store_backend` resolves it (default: resolved now). `nhd_views`: the caches'
    `BlockPool.nhd_view`s, where the caller keeps them (`BlockPool.nhd_views`), else made here.
    """
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch' (as store_backend returns), got {backend!r}")
    # K and V of different shapes (multi-head latent attention): the Triton store writes rows of one shape, so each
    # is copied on its own by index_copy_.
    same_shape = key_cache.shape == value_cache.shape
    if same_shape and (backend or store_backend(key_cache.device)) == "triton":
        key_rows, value_rows = token_rows(key_states, value_states)
        # [num_blocks, block_size, kv_heads, head_dim] views of the head-major pool
        if nhd_views is None:
            nhd_views = key_cache.permute(1, 2, 0, 3), value_cache.permute(1, 2, 0, 3)
        if torch.compiler.is_compiling():  # traced: the custom op (ops.py), one opaque call that writes the pool
            torch.ops.hf_paged.store_kv(key_rows, value_rows, *nhd_views, slots, "triton")
            return
        store_kv(key_rows, value_rows, *nhd_views, slots, backend="triton")
        return
    for cache, states in ((key_cache, key_states), (value_cache, value_states)):
        num_heads, _, _, head_dim = cache.shape
        new = states.transpose(0, 1).reshape(num_heads, -1, head_dim)  # [H, W * q_len, D]
        cache.view(num_heads, -1, head_dim).index_copy_(1, slots, new)
