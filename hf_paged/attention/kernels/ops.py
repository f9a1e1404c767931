"""The paged kernels as torch custom ops, so `torch.compile` traces through them and CUDA graphs capture them.

- `hf_paged::store_kv` writes K/V rows to their slots of the pool, in place (it mutates `key_cache` and
  `value_cache`, and says so to the compiler).
- `hf_paged::paged_decode_attention` is one decode step's attention over the paged pool.

Each op runs the backend it is given ("triton" or "torch", as `resolve_backend` returns it: resolved on the host
before a compiled region, never inside one) and has a fake implementation that only gives the output's shape, so
dynamo and inductor see it as one opaque call with known outputs. Eager callers use `dispatch.py` directly (a custom
op costs a dispatch through the torch library on every call); compiled code calls `torch.ops.hf_paged.*`, which
is what `paged_decode_attention_compiled` does. A compileable PagedCache stores with `index_copy_`, which inductor
lowers in place on the pool; the store op serves code that wants the Triton store inside a compiled region.

Neither op synchronizes with the host on the Triton path: the decode kernel sizes its grid from the block table's
width, never from `seq_lens`, so a decode step replays inside a CUDA graph.
"""

from __future__ import annotations

import torch

from .dispatch import paged_decode_attention, store_kv


@torch.library.custom_op("hf_paged::store_kv", mutates_args=("key_cache", "value_cache"))
def store_kv_op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str,
) -> None:
    """key, value `[num_tokens, num_kv_heads, head_dim]`; caches `[num_blocks, block_size, num_kv_heads, head_dim]`
    (written in place); slot_mapping `[num_tokens]` int64; backend "triton" or "torch"."""
    store_kv(key, value, key_cache, value_cache, slot_mapping, backend=backend)


@store_kv_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, backend) -> None:
    return None


@torch.library.custom_op("hf_paged::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_start: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    backend: str,
) -> torch.Tensor:
    """query `[B, num_q_heads, head_dim]`, caches `[num_blocks, block_size, num_kv_heads, head_dim]`, block_tables
    `[B, max_blocks_per_seq]` and seq_lens `[B]` int32 or int64, kv_start `[B]` the same or None -> `[B, num_q_heads,
    head_dim]` in `query.dtype` (see `paged_decode_attention_torch`)."""
    return _decode(
        query, key_cache, value_cache, block_tables, seq_lens, kv_start, scale, sliding_window, softcap, backend
    )


def _decode(query, key_cache, value_cache, block_tables, seq_lens, kv_start, scale, sliding_window, softcap, backend):
    kwargs = dict(scale=scale, kv_start=kv_start, sliding_window=sliding_window, softcap=softcap, backend=backend)
    return paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, **kwargs)


@paged_decode_attention_op.register_fake
def _(query, key_cache, value_cache, block_tables, seq_lens, kv_start, scale, sliding_window, softcap, backend):
    return torch.empty_like(query)


def paged_decode_attention_compiled(
    query, key_cache, value_cache, block_tables, seq_lens, *, scale, kv_start, sliding_window, softcap, backend: str
) -> torch.Tensor:
    """`paged_decode_attention` through the custom op when torch.compile is tracing, the plain call otherwise."""
    args = (query, key_cache, value_cache, block_tables, seq_lens, kv_start, scale, sliding_window, softcap, backend)
    if torch.compiler.is_compiling():
        return torch.ops.hf_paged.paged_decode_attention(*args)
    return _decode(*args)
