"""Triton paged prefill (extend) attention: the new tokens of several sequences, packed, over their paged K/V.

Reference: `reference.paged_prefill_attention_torch` (same signature, same semantics).

A prefill chunk, a prompt after a prefix-cache hit, or any step that adds several tokens to a sequence: new token `i`
of sequence `b` sits at position `seq_lens[b] - q_len_b + i` and attends causally to every key of its sequence up
to itself, read from the pool through the block table (its own K/V are stored before the kernel runs). The queries
of all sequences arrive packed, `[num_tokens, num_q_heads, head_dim]`, with `cu_seqlens_q` marking each sequence's
rows, so no query is padded and no mask is built.

Design (FlashAttention-2's loop over the paged K/V, as vLLM's and SGLang's Triton extend kernels do):
- one program per (tile of `block_q` new tokens of one sequence, kv head, tile of q heads): its `BLOCK_M =
  block_q * heads` query rows are the tokens x the q heads that share the kv head, so each K/V tile read from the
  pool serves the whole GQA group (row `r` is token `r // heads`, head `r % heads`; both runtime arguments, so the
  group compiles nothing new);
- the grid is one-dimensional, the kv heads (and tiles of q heads) of one query tile neighbours and the query tiles
  in reverse (`PrefillConfig.heavy_first`): a sequence's tiles that attend the most keys start before its others;
- the grid is sized from the token count alone (`num_tokens // block_q + B` tiles, an upper bound), and each program
  finds its sequence by a binary search over `cu_seqlens_q`: no host sync, so a step's launch can be captured;
- the key loop runs over the union of the tile's visible ranges (from the earliest query's window start to the
  last query's own position) in tiles of `BLOCK_N` tokens; the tiles every row sees whole (up to the first query's
  own position, inside every row's window) are read and used without a mask; on the others, per (query, key), the
  mask is causal, window and `kv_start`; tiles wholly before the window or after the causal edge are never loaded;
  with 3 pipeline stages the whole tiles' block ids are read one tile ahead, so that two tiles' K/V are in flight
  while one is used (`launch_config.ids_ahead`);
- online softmax in fp32 (exp2, the scale folded into log2(e): each row's running max is taken over the unscaled
  logits and scaled once, each logit's exponent one fused multiply-subtract); a row whose keys so far are all masked
  keeps a running max of -inf and contributes nothing; attention sinks add one logit per head to the denominator at
  the end.

Tiles, warps and stages come from `launch_config.prefill_config` (head_dim, dtype, GPU); the GQA group, block size,
window and sequence lengths are runtime arguments.

Import this module only through `hf_paged.kernels` (lazily): `triton.jit` reads `TRITON_INTERPRET` when the
kernels below are defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch_config
from .direct import DirectKernel, int_keys, pointer_keys
from .reference import check_prefill_args
from .triton_decode import (
    LOG2E,
    block_index,
    block_offset,
    block_shift,
    clamp_window,
    fp32_dot,
    load_kv_tile,
    on_device,
    pool_block_ids,
    slot_rows,
    softcap_logits,
    tile_slots,
    unused_fp32,
)


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, block_q):
    """The sequence whose tiles hold grid tile `tile`: sequence b's tiles start at `cu_seqlens_q[b] // block_q + b`
    (each sequence may waste one tile), so the last b with a start <= tile, by binary search."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // block_q + mid
        if start <= tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _kv_tiles(
    k_cache_ptr,
    v_cache_ptr,
    block_ids,
    offsets,
    mask,
    kv_head,
    d,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    block_size,
    SLOT_ROWS: tl.constexpr,
):
    """The K and V tiles (`[BLOCK_N, HEAD_DIM_PAD]` each) at the slots (pool block id, offset in it) of a tile's keys;
    zeros where `mask` is off."""
    k = load_kv_tile(
        k_cache_ptr, block_ids, offsets, kv_head, d, mask, stride_kb, stride_ks, stride_kh, stride_kd,
        block_size, SLOT_ROWS,
    )  # fmt: skip
    v = load_kv_tile(
        v_cache_ptr, block_ids, offsets, kv_head, d, mask, stride_vb, stride_vs, stride_vh, stride_vd,
        block_size, SLOT_ROWS,
    )  # fmt: skip
    return k, v


@triton.jit
def _attend_tile(
    q,
    k,
    v,
    acc,
    l_i,
    m_i,
    scale,
    softcap,
    pos,
    in_range,
    q_pos,
    sliding_window,
    USE_SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """One K/V tile (keys at positions `pos`) into the online softmax: (acc, l_i, m_i) updated. Where MASKED, each
    (query, key) is kept when the key is in range and `0 <= q_pos - pos < sliding_window` (causal and inside the
    window: one unsigned compare); a tile without the mask has every logit finite, so its running max needs no guard.
    Rows that are not the program's (past its tokens or its group's heads) are not masked: their queries are zeros,
    their logits finite, and they are never stored.

    Without a softcap the scale and log2(e) are one factor (`scale >= 0`): the running max is taken over the raw
    logits and scaled once per row, and each logit costs one fused multiply-subtract before its exp2, as
    FlashAttention's kernels do (the logits' arithmetic, not the dots, bounds a tile at head_dim 64)."""
    qk = fp32_dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N] fp32
    if USE_SOFTCAP:
        qk = softcap_logits(qk * scale, softcap)
        qk_scale = LOG2E
    else:
        qk_scale = scale * LOG2E
    if MASKED:
        distance = (q_pos[:, None] - pos[None, :]).to(tl.uint32)  # a key after the query wraps past any window
        visible = (distance < sliding_window.to(tl.uint32)) & in_range[None, :]
        logits = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        # A row with no visible key yet keeps m = -inf: subtract 0 instead, so its p and alpha are 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(logits - m_safe[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        m_safe = m_new
        p = tl.exp2(tl.fma(qk, qk_scale, -m_safe[:, None]))
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + fp32_dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


@triton.jit(
    do_not_specialize=[
        "stride_bt",
        "sliding_window",
        "group",
        "block_size",
        "block_shift",
        "num_seqs",
        "has_kv_start",
        "use_sinks",
        "heads",
        "block_q",
        "num_tiles",
        "num_kv_heads",
    ]
)
def _paged_prefill_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [B, max_blocks_per_seq]
    cu_seqlens_q_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    kv_start_ptr,  # [B], read only if has_kv_start
    sinks_ptr,  # [num_q_heads] fp32, read only if USE_SINKS
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    stride_qt,
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
    stride_ot,
    stride_oh,
    stride_od,
    scale,
    softcap,
    sliding_window,  # larger than any sequence when there is no window
    group,  # q heads per kv head
    head_dim,
    block_size,
    block_shift,  # log2(block_size) where SLOT_ROWS
    num_seqs,
    has_kv_start,  # 0 or 1 (an int: Triton 3.6's interpreter takes no bool argument)
    use_sinks,  # 0 or 1
    heads,  # q heads per program (a power of two up to 16)
    block_q,  # new tokens per program: BLOCK_M // heads
    num_tiles,  # query tiles of the grid: num_tokens // block_q + B, an upper bound
    num_kv_heads,
    BLOCK_M: tl.constexpr,  # query rows per program: block_q tokens x heads q heads
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    UNMASKED_TILES: tl.constexpr,  # read the tiles every row sees whole without a mask (launch_config)
    HEAVY_FIRST: tl.constexpr,  # the query tiles in reverse (launch_config)
    IDS_AHEAD: tl.constexpr,  # read each whole tile's block ids one tile ahead (launch_config.ids_ahead)
    SLOT_ROWS: tl.constexpr,  # a block's slots are consecutive cache rows, a power of two of them (`slot_rows`)
):
    # grid: ((num_tokens // BLOCK_Q + B) * num_kv_heads * head_tiles,): a program's (tile, kv head, head tile)
    head_tiles = tl.cdiv(group, heads)
    head_programs = num_kv_heads * head_tiles
    if HEAVY_FIRST:
        # The kv heads and head tiles of one query tile are neighbours, the tiles in reverse: a sequence's last
        # tiles, which attend the most keys, start before its first ones, which fill the last wave (the largest work
        # first, as FlashAttention schedules a causal grid; several sequences run last one first).
        head_program = tl.program_id(0) % head_programs
        tile = num_tiles - 1 - tl.program_id(0) // head_programs
    else:
        tile = tl.program_id(0) % num_tiles
        head_program = tl.program_id(0) // num_tiles
    seq_idx = _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, block_q)
    q_first = tl.load(cu_seqlens_q_ptr + seq_idx)
    q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_first
    q_tile = tile - (q_first // block_q + seq_idx)
    if q_tile * block_q >= q_len:  # one of the spare tiles of the grid's upper bound
        return
    kv_head = (head_program // head_tiles).to(tl.int64)  # int64: see the decode kernel
    head_start = (head_program % head_tiles) * heads

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * block_q + rows // heads  # the row's new token, within its sequence
    head = head_start + rows % heads  # the row's q head, within the kv head's group
    row_mask = (token < q_len) & (head < group)
    q_heads = kv_head * group + head
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < head_dim
    q_rows = (q_first + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + q_heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int32)
    context = seq_len - q_len
    q_pos = context + token  # [BLOCK_M] absolute positions
    kv_lo = 0
    if has_kv_start:
        kv_lo = tl.load(kv_start_ptr + seq_idx).to(tl.int32)
    # Keys any row of the tile sees: from the first token's window start to the last token's own position.
    first_pos = context + q_tile * block_q
    last_pos = context + tl.minimum(q_len, (q_tile + 1) * block_q) - 1
    start = tl.maximum(kv_lo, first_pos - sliding_window + 1)
    end = last_pos + 1

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), dtype=tl.float32)
    bt_row = block_tables_ptr + seq_idx * stride_bt

    tile_lo = (tl.maximum(start, 0) // BLOCK_N) * BLOCK_N
    tile_hi = tl.where(start < end, end, tile_lo)
    # Tiles every row of the program sees whole (from a first kept key on a tile boundary up to the first token's own
    # position, inside every row's window): no mask, no predicated loads. The tiles after them take the mask.
    full_hi = tile_lo
    if UNMASKED_TILES:
        full_hi = tl.where(
            (start == tile_lo) & (last_pos - tile_lo < sliding_window),
            tl.minimum(tl.maximum(tile_lo, ((first_pos + 1) // BLOCK_N) * BLOCK_N), tile_hi),
            tile_lo,
        )
        if IDS_AHEAD:  # each tile's block ids read one tile ahead (launch_config.ids_ahead)
            pos = tile_lo + tl.arange(0, BLOCK_N)
            ids = tl.load(bt_row + block_index(pos, block_size, block_shift, SLOT_ROWS), mask=pos < full_hi, other=0)
        for tile_start in range(tile_lo, full_hi, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N)
            if IDS_AHEAD:
                block_ids = pool_block_ids(ids, SLOT_ROWS)
                ahead = pos + BLOCK_N
                ahead_idx = block_index(ahead, block_size, block_shift, SLOT_ROWS)
                ids = tl.load(bt_row + ahead_idx, mask=ahead < full_hi, other=0)
            else:
                ids = tl.load(bt_row + block_index(pos, block_size, block_shift, SLOT_ROWS))
                block_ids = pool_block_ids(ids, SLOT_ROWS)
            offsets = block_offset(pos, block_size, SLOT_ROWS)
            k, v = _kv_tiles(
                k_cache_ptr, v_cache_ptr, block_ids, offsets, d_mask[None, :], kv_head, d,
                stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                block_size, SLOT_ROWS,
            )  # fmt: skip
            acc, l_i, m_i = _attend_tile(
                q, k, v, acc, l_i, m_i, scale, softcap, pos, pos, q_pos, sliding_window,
                USE_SOFTCAP, False, DOT_PRECISION, DOT_UPCAST,
            )  # fmt: skip
    for tile_start in range(full_hi, tile_hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        in_range = (pos >= start) & (pos < end)
        block_ids, offsets = tile_slots(bt_row, pos, in_range, block_size, block_shift, SLOT_ROWS)
        k, v = _kv_tiles(
            k_cache_ptr, v_cache_ptr, block_ids, offsets, in_range[:, None] & d_mask[None, :], kv_head, d,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            block_size, SLOT_ROWS,
        )  # fmt: skip
        acc, l_i, m_i = _attend_tile(
            q, k, v, acc, l_i, m_i, scale, softcap, pos, in_range, q_pos, sliding_window,
            USE_SOFTCAP, True, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip

    if use_sinks:
        # One more logit per head that attends to nothing: it only grows the denominator.
        sink = tl.load(sinks_ptr + q_heads, mask=row_mask, other=float("-inf")).to(tl.float32) * LOG2E
        m_final = tl.maximum(m_i, sink)
        m_final = tl.where(m_final == float("-inf"), 0.0, m_final)
        alpha = tl.exp2(m_i - m_final)
        l_i = l_i * alpha + tl.exp2(sink - m_final)
        acc = acc * alpha[:, None]
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row with no visible key: zeros
    out_rows = out_ptr + q_rows[:, None] * stride_ot + q_heads[:, None] * stride_oh
    o_mask = row_mask[:, None] & d_mask[None, :]
    tl.store(out_rows + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def paged_prefill_attention_triton(
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
) -> torch.Tensor:
    """Triton version of `paged_prefill_attention_torch`; see there for the arguments and shapes. Reads no device
    value on the host (the grid comes from `query.shape[0]` and the number of sequences)."""
    check_prefill_args(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, sinks)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if block_tables.shape[1] == 0:  # no sequence holds a key
        return out.zero_()

    capability = launch_config.device_capability(query.device)
    k_strides, v_strides = key_cache.stride(), value_cache.stride()
    slots = slot_rows(key_cache.shape, k_strides, v_strides)
    config = launch_config.prefill_config(head_dim, group, key_cache.dtype, capability, softcap is not None, slots)
    if config.unmasked_tiles and key_cache.dtype == torch.float32:
        raise ValueError("unmasked_tiles is for 16-bit caches (an fp32 cache's variant spills), got a float32 cache")
    if scale < 0 and softcap is None:
        # Without a softcap the kernel takes each row's running max over the unscaled logits, which a positive scale
        # keeps in order: a negative one runs as its magnitude over the negated query (the same logits exactly).
        query, scale = -query, -scale
    head_tiles = launch_config.ceil_div(group, config.heads)
    num_tiles = num_tokens // config.block_q + num_seqs
    # unused when USE_SINKS is False; fp32 like real sinks, so that both share one compiled variant
    sinks = sinks.to(torch.float32) if sinks is not None else unused_fp32(query.device)
    use_softcap = softcap is not None
    q_strides, out_strides = query.stride(), out.stride()  # the query's after any negation above
    ids_ahead = launch_config.ids_ahead(config.num_stages)
    has_kv_start = int(kv_start is not None)
    kv_start = kv_start if has_kv_start else seq_lens  # unused when has_kv_start is False
    tensors = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, kv_start, sinks, out)
    args = (
        *tensors,
        *q_strides,
        *k_strides,
        *v_strides,
        block_tables.stride(0),
        *out_strides,
        float(scale),
        float(softcap) if use_softcap else 1.0,
        clamp_window(sliding_window),
        group,
        head_dim,
        block_size,
        block_shift(block_size),
        num_seqs,
        has_kv_start,
        int(sinks.numel() > 0),
        config.heads,
        config.block_q,
        num_tiles,
        num_kv_heads,
        config.block_m,
        config.head_dim_pad,
        config.block_n,
        use_softcap,
        config.dot_precision,
        config.dot_upcast,
        config.unmasked_tiles,
        config.heavy_first,
        ids_ahead,
        slots,
    )
    # What Triton specializes on (direct.py): the tensors' dtypes and alignments, the strides, head_dim; the ints it
    # does not specialize are table widths, counts and flags, i32 whatever the step.
    key = (
        query.device.index,
        config,
        ids_ahead,
        slots,
        use_softcap,
        pointer_keys(*tensors),
        q_strides,
        k_strides,
        v_strides,
        out_strides,
        int_keys(head_dim),
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    with on_device(query):
        _PREFILL.launch((num_tiles * num_kv_heads * head_tiles, 1, 1), key, args, options)
    return out


# The kernel's launches by the variant a launch's key names (direct.py: without JITFunction.run's binding per call).
_PREFILL = DirectKernel(_paged_prefill_kernel)
