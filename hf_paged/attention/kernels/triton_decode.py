"""Triton paged decode attention: one new token per sequence against its K/V in the block pool.

Reference: `reference.paged_decode_attention_torch` (same signature, same semantics).

Design, for memory bandwidth (decode reads every cached K/V byte once and does little math per byte):
- one program per (sequence, kv head, split) handles the whole GQA group of q heads that share the kv head, so each
  K/V tile is read from HBM once per group, not once per q head;
- the program walks the sequence in tiles of `BLOCK_N` tokens; for each tile it gathers the block ids from the
  block table and loads a `[BLOCK_N, head_dim]` tile of K and of V (rows are contiguous `head_dim` vectors in the
  NHD layout, so every row load is coalesced whatever the block size);
- online softmax in fp32 (exp2 with the scale folded into log2(e)), tensor-core `tl.dot` for QK^T and PV with the
  group dim padded to >= 16 rows;
- split-K ("flash decoding"): when batch * num_kv_heads programs cannot fill the GPU, the context is cut into
  `num_splits` chunks processed in parallel; each writes a normalized partial output and its log-sum-exp, and a
  second small kernel merges them.

Import this module only through `hf_paged.kernels` (lazily): `triton.jit` reads `TRITON_INTERPRET` when the
kernels below are defined.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from .reference import check_decode_args

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`tl.dot(a, b)` in fp32; UPCAST first widens bf16 inputs, because Triton's CPU interpreter multiplies the raw
    uint16 bits of bf16 operands (GPU builds never set it)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


# NOTE: Triton compiles a variant per value class of each int argument (1, divisible by 16, other) unless told not
# to: a block table's row stride is its width in blocks, which grows with the context, so it would recompile as
# sequences grow (on the GPU, inside timed runs).
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_kernel(
    q_ptr,  # [B, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [B, max_blocks_per_seq]
    seq_lens_ptr,  # [B]
    kv_start_ptr,  # [B], read only if HAS_KV_START
    out_ptr,  # [B, num_q_heads, head_dim], written only if NUM_SPLITS == 1
    partial_out_ptr,  # [B, num_q_heads, NUM_SPLITS, head_dim] fp32, written only if NUM_SPLITS > 1
    partial_lse_ptr,  # [B, num_q_heads, NUM_SPLITS] fp32 (log2 units), written only if NUM_SPLITS > 1
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_od,
    scale,
    softcap,
    sliding_window,
    tokens_per_split,  # a multiple of BLOCK_N
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    # int64: in a head-major pool the head stride is num_blocks * block_size * head_dim, and a large pool's element
    # offsets overflow int32 (so do block_id * stride_kb, below).
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    # Visible key positions: [lo, seq_len), intersected with this split's chunk.
    seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int32)
    lo = seq_len * 0  # an int32 scalar tensor, like the values that may replace it below
    if HAS_KV_START:
        lo = tl.maximum(lo, tl.load(kv_start_ptr + seq_idx).to(tl.int32))
    if USE_SLIDING_WINDOW:
        lo = tl.maximum(lo, seq_len - sliding_window)
    start = tl.maximum(lo, split * tokens_per_split)
    end = tl.minimum(seq_len, (split + 1) * tokens_per_split)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    q_heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    # q: [GROUP_PAD, HEAD_DIM_PAD]; padded rows and columns are zero, so they add nothing to the dot products.
    q = tl.load(
        q_ptr + seq_idx * stride_qb + q_heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM_PAD), dtype=tl.float32)
    bt_row = block_tables_ptr + seq_idx * stride_bt

    # NOTE: the first tile contains `start` and every later one starts before `end`, so each tile processed has at
    # least one visible key: m_i is finite after the first iteration and exp2(m_i - m_new) never sees -inf - -inf.
    # An empty range (start >= end: a split past the sequence, or nothing visible) must run no tile at all.
    tile_lo = (start // BLOCK_N) * BLOCK_N
    tile_hi = tl.where(start < end, end, tile_lo)
    for tile_start in range(tile_lo, tile_hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        visible = (pos >= start) & (pos < end)
        block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
        offsets = pos % BLOCK_SIZE
        kv_mask = visible[:, None] & d_mask[None, :]
        # k, v: [BLOCK_N, HEAD_DIM_PAD]
        k = tl.load(
            k_cache_ptr
            + block_ids[:, None] * stride_kb
            + offsets[:, None] * stride_ks
            + kv_head * stride_kh
            + d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block_ids[:, None] * stride_vb
            + offsets[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )

        logits = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale  # [GROUP_PAD, BLOCK_N] fp32
        if USE_SOFTCAP:
            # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow for any x.
            x = logits / softcap
            e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
            tanh_abs = (1.0 - e) / (1.0 + e)
            logits = softcap * tl.where(x < 0.0, -tanh_abs, tanh_abs)
        logits = tl.where(visible[None, :], logits * LOG2E, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    # A split (or a sequence) with no visible key has l_i == 0: emit zeros, and lse = -inf so the merge ignores it.
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq_idx * stride_ob + q_heads[:, None] * stride_oh + d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        row = (seq_idx * GROUP * tl.num_programs(1) + q_heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [B, num_q_heads, NUM_SPLITS, head_dim] fp32
    partial_lse_ptr,  # [B, num_q_heads, NUM_SPLITS] fp32, log2 units
    out_ptr,  # [B, num_q_heads, head_dim]
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    q_head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    row = (seq_idx * tl.num_programs(1) + q_head) * NUM_SPLITS + s  # [SPLITS_PAD]

    lse = tl.load(partial_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: weights all 0
    weights = tl.exp2(lse - lse_max)  # [SPLITS_PAD]
    total = tl.sum(weights, axis=0)
    # o: [SPLITS_PAD, HEAD_DIM_PAD], each split's output already normalized by its own softmax sum
    o = tl.load(
        partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    o = tl.sum(o * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    out_row = out_ptr + seq_idx * stride_ob + q_head * stride_oh
    tl.store(out_row + d * stride_od, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property lookup is slow); 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # what choose_num_splits returns


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many chunks to cut each sequence into so that the grid fills the GPU: a power of two up to 64.

    Splitting costs one partial write and a merge, so split only when batch * num_kv_heads programs leave SMs idle,
    and keep every chunk at >= 512 tokens so each program still streams a long run of K/V. A power of two because
    the count is a compile-time constant: at most 7 variants of each kernel ever compile (`SPLIT_COUNTS`).
    """
    num_programs = batch * num_kv_heads
    num_sms = _num_sms(device)
    if num_programs >= num_sms:
        return 1
    wanted = max(1, min(triton.cdiv(2 * num_sms, num_programs), max_context // 512, SPLIT_COUNTS[-1]))
    return 1 << (wanted.bit_length() - 1)


def paged_decode_attention_triton(
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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of `paged_decode_attention_torch`; see there for the arguments and shapes.

    `num_splits` (Triton only, a tuning knob): chunks per sequence for split-K; `None` picks from the GPU's SM
    count and the block table width (never from `seq_lens`, which would need a device sync).
    """
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens)
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    if block_tables.shape[1] == 0:  # no sequence holds a key: zeros, as the reference gives
        return out.zero_()

    head_dim_pad = triton.next_power_of_2(head_dim)
    block_n = 64 if head_dim_pad <= 128 else 32
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, query.device)
    # Trailing chunks may be empty (a split past every sequence writes lse = -inf, which the merge ignores): the
    # split count stays the one asked for, so no new variant compiles.
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n

    if num_splits > 1:
        partial_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused by the kernel when NUM_SPLITS == 1
    with on_device(query):
        _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            kv_start if kv_start is not None else seq_lens,  # unused when HAS_KV_START is False
            out,
            partial_out,
            partial_lse,
            *query.stride(),
            *key_cache.stride(),
            *value_cache.stride(),
            block_tables.stride(0),
            *out.stride(),
            float(scale),
            float(softcap) if softcap is not None else 1.0,
            int(sliding_window) if sliding_window is not None else 0,
            tokens_per_split,
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
            HAS_KV_START=kv_start is not None,
            USE_SLIDING_WINDOW=sliding_window is not None,
            USE_SOFTCAP=softcap is not None,
            # fp32 caches: full-precision dot products (the default would round inputs to tf32 on the GPU).
            DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32",
            DOT_UPCAST=key_cache.dtype == torch.bfloat16 and key_cache.device.type != "cuda",
            num_warps=4,
            num_stages=2,
        )
        if num_splits > 1:
            _merge_splits_kernel[(batch, num_q_heads)](
                partial_out,
                partial_lse,
                out,
                *out.stride(),
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                NUM_SPLITS=num_splits,
                SPLITS_PAD=triton.next_power_of_2(num_splits),
                num_warps=4,
            )
    return out


def on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (`cuda:1` from a process on `cuda:0`)."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()
