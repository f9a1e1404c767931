"""Triton store of new K/V rows into the paged pool (the write half of paged attention).

Reference: `reference.store_kv_torch` (same signature). One program per (token, kv head) copies one `head_dim` row of
K and one of V to its slot; rows are contiguous in the NHD layout, so each program does two coalesced loads and
two coalesced stores. Import through `hf_paged.kernels` (lazily), like `triton_decode.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch_config
from .direct import DirectKernel, pointer_keys
from .reference import token_rows
from .triton_decode import on_device


# Block size and head_dim are runtime arguments, so one variant per (dtypes, head_dim_pad) serves every pool; the
# block size is not specialized (8 and 16 would compile twice), head_dim is (a multiple of 16 vectorizes).
@triton.jit(do_not_specialize=["block_size"])
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    block_size,
    head_dim,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # int64: a head-major pool's head stride times head overflows int32
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block_id = slot // block_size
    offset = slot - block_id * block_size
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < head_dim

    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d * stride_kd, mask=d_mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d * stride_vd, mask=d_mask)
    k_dst = key_cache_ptr + block_id * stride_kcb + offset * stride_kcs + head * stride_kch + d * stride_kcd
    v_dst = value_cache_ptr + block_id * stride_vcb + offset * stride_vcs + head * stride_vch + d * stride_vcd
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=d_mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=d_mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of `store_kv_torch`; see there for the arguments and shapes.

    Unlike the reference, the caches may have any strides; slots are not bounds-checked (the reference's
    `index_copy_` is, on CPU), so an out-of-range slot writes out of bounds.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape[2:] != key.shape[1:] or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be [num_tokens, num_kv_heads, head_dim] "
            f"matching key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)}"
        )
    if tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    with on_device(key_cache):
        StoreLaunch(key_cache, value_cache).launch_rows(key, value, slot_mapping)


class StoreLaunch:
    """The store kernel's launch into one layer's K and V pool tensors, made once for them and called at every step.

    The caches' strides, block size, tile width and warps are those of the pool's tensors, so they are read here
    once; a call takes the states of the rows that write (`[W, kv_heads, q_len, head_dim]`, as `store_kv_rows` takes
    them) and their slots, and launches the kernel. `key_cache` / `value_cache`: the layer's
    `[num_blocks, block_size, kv_heads, head_dim]` views (`BlockPool.nhd_views`), of one shape.
    """

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor):
        if value_cache.shape != key_cache.shape or key_cache.dim() != 4:
            raise ValueError(
                "the store kernel writes K and V of one shape [num_blocks, block_size, kv_heads, head_dim], got "
                f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
            )
        self.key_cache, self.value_cache = key_cache, value_cache
        _, block_size, self.num_heads, head_dim = key_cache.shape
        self.tail = (*key_cache.stride(), *value_cache.stride(), block_size, head_dim)
        self.head_dim_pad = launch_config.head_dim_pad(head_dim)
        self.options = {"num_warps": launch_config.store_num_warps(head_dim)}
        device = key_cache.device
        self.device_index = device.index if device.type == "cuda" else None
        # The device, and what Triton specializes among the arguments fixed for these caches (direct.py): the caches'
        # pointers, strides, block size and head_dim, the tile width and the warps.
        self.fixed_key = (
            self.device_index,
            pointer_keys(key_cache, value_cache),
            self.tail,
            self.head_dim_pad,
            self.options["num_warps"],
        )

    def __call__(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: torch.Tensor) -> None:
        """Write `key_states` / `value_states` ([W, kv_heads, q_len, head_dim]) at `slots` ([W * q_len] int64, row
        by row)."""
        if (
            key_states.shape[1] != self.num_heads
            or key_states.shape[-1] != self.tail[-1]
            or key_states.shape != value_states.shape
        ):
            raise ValueError(
                f"states {tuple(key_states.shape)} and {tuple(value_states.shape)} must be [W, {self.num_heads}, "
                f"q_len, {self.tail[-1]}] for caches {tuple(self.key_cache.shape)}"
            )
        key, value = token_rows(key_states, value_states)
        num_tokens = key.shape[0]
        if slots.shape != (num_tokens,):
            raise ValueError(f"slots must be [{num_tokens}], got {tuple(slots.shape)}")
        if not num_tokens:
            return
        if self.device_index is not None and self.device_index != torch.cuda.current_device():
            with torch.cuda.device(self.device_index):
                self.launch_rows(key, value, slots)
        else:
            self.launch_rows(key, value, slots)

    def launch_rows(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """The launch on token rows: `key` / `value` `[num_tokens, kv_heads, head_dim]` (any strides), `slots`
        `[num_tokens]`, checked by the caller, on the current device."""
        key_strides, value_strides = key.stride(), value.stride()
        # The per-call part of the variant's key (direct.py's `pointer_keys` of each tensor, written inline: this
        # runs at every layer).
        variant = (
            self.fixed_key,
            key.dtype,
            value.dtype,
            slots.dtype,
            key.data_ptr() % 16 == 0,
            value.data_ptr() % 16 == 0,
            slots.data_ptr() % 16 == 0,
            key_strides,
            value_strides,
        )
        args = (
            key,
            value,
            self.key_cache,
            self.value_cache,
            slots,
            *key_strides,
            *value_strides,
            *self.tail,
            self.head_dim_pad,
        )
        _STORE.launch((key.shape[0], self.num_heads, 1), variant, args, self.options)


# The store's launches by the variant a launch's key names (direct.py: without JITFunction.run's binding per call).
_STORE = DirectKernel(_store_kv_kernel)
